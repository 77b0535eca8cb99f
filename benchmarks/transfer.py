"""The knowledge-transfer table: transfer ratio R per technique, alone and combined, over seeds.

    python benchmarks/transfer.py --quick      # a few minutes on 2 CPU cores
    python benchmarks/transfer.py              # the fuller table (README "Knowledge transfer")

Per seed: generate a synthetic world (its drift knobs set the staleness), train a GEM teacher on
the ``train`` days, then in ONE pass over the ``valid`` days of one surface (the teacher called once
per batch) train every student variant, a domain FM, and the VMs that FM teaches online (it scores
each batch before it learns from it) side by side; a second pass trains a VM from the trained,
frozen domain FM on the same days (its soft labels are then in-sample). All are evaluated on the
``test`` day's rows of that surface with the same NE normaliser, next to the teacher:

    R = (NE_alone − NE_with) / (NE_alone − NE_GEM)          (dossier §8.6)

Prints a table of mean ± std over seeds and, as its last line, one JSON object with ``r_kd``,
``r_best``, ``best`` (the technique set), ``ratio_best_vs_kd`` and every row.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from opengem.config import apply_overrides, apply_prefixed_overrides
from opengem.data.synthetic import generate
from opengem.features.schema import FeatureSchema
from opengem.model.build import count_parameters
from opengem.recipes import recipe, student_recipe, world_config
from opengem.run import FINAL_FILE
from opengem.train.trainer import train
from opengem.transfer.config import techniques_config
from opengem.transfer.distill import make_trainer
from opengem.transfer.stream import SliceStream, domain_ids, slice_rates
from opengem.transfer.teacher import TeacherService
from opengem.transfer.trainer import evaluate_students, train_students, transfer_ratio

# (row name, techniques, overrides for that student). "kd" is standard KD at its tuned weight (3, the
# default); "kd (w=1)" the untuned one. rep(row) feeds each row's own teacher features: an offline
# upper bound, not free at serving (the teacher would run per candidate), so it never counts as "best".
DIRECT = [("alone", "", ()), ("kd (w=1)", "kd", ("transfer.kd.weight=1",)), ("kd", "kd", ()),
          ("kd+aux", "kd+aux", ()), ("kd+adapter", "kd+adapter", ()), ("kd+rep", "kd+rep", ()),
          ("kd+share", "kd+share", ()), ("kd+share+rep", "kd+share+rep", ()),
          ("default (kd+adapter+share)", "kd+adapter+share", ()), ("all", "kd+aux+adapter+rep+share", ()),
          ("kd+rep(row) offline", "kd+rep", ("transfer.rep.source=row",))]
# Hierarchical: GEM → domain FM → VM. Online: the FM trains in the same pass as the direct students
# and teaches its VMs each batch before it learns from it (as a continuously trained FM serves).
# Frozen: a second pass with the trained FM as a frozen teacher on the days it was trained on, so its
# soft labels are in-sample.
ONLINE = [("hier online: kd", "kd", ()), ("hier online: kd+share", "kd+share", ())]
HIER = [("hier frozen FM: kd", "kd", ())]
FM = ("domain FM (fm_domain)", "kd+adapter+share", ())  # a GEM student itself, then the VMs' teacher
OFFLINE = {"kd+rep(row) offline"}


def world(args, seed: int):
    d = args.drift
    base = world_config(args.preset, seed=seed)
    return world_config(args.preset, seed=seed, overrides=[
        f"sizes.num_users={args.users}", f"sizes.num_days={args.days + args.student_days + 1}",
        f"sizes.valid_days={args.student_days}", "sizes.test_days=1",
        f"behaviour.interest_drift={base.behaviour.interest_drift * d}", f"click.ad_drift={base.click.ad_drift * d}",
        f"click.advertiser_drift={base.click.advertiser_drift * d}"])


def run_seed(args, seed: int, root: Path, direct=DIRECT, hier=HIER, fm_row=FM, online=ONLINE) -> dict:
    data, run = root / f"data{seed}", root / f"gem{seed}"
    t0 = time.perf_counter()
    if not (run / FINAL_FILE).exists():  # a kept --out directory is reused
        generate(world(args, seed), data, progress=False)
        cfg = apply_overrides(recipe(args.teacher), [f"train.seed={seed}", "train.progress=false", "train.threads=1",
                                                     *args.teacher_overrides])
        train(cfg, data, run)
    t_teacher = time.perf_counter() - t0
    schema = FeatureSchema.load(data)
    gem = TeacherService.from_run(run)
    doms = domain_ids(schema, [args.domain])
    rates, n_slice, n_all = slice_rates(data, schema, "valid", doms)

    def student(row, teacher, recipe_name, steps):
        name, techniques, extra = row
        trees = apply_prefixed_overrides(
            {"": student_recipe(recipe_name), "transfer": techniques_config(techniques, domains=(args.domain,))},
            [f"train.seed={seed}", f"data.seed={seed}", *args.overrides, *extra])
        return make_trainer(name, trees[""], trees["transfer"], schema, teacher, rates, steps)

    def stream(teacher, split="valid", **kw):
        bs = student_recipe(args.student).data.batch_size if split == "valid" else 4096
        return SliceStream(data, split, schema, doms, teacher, bs, seed=seed, slice_rows=n_slice if split == "valid"
                           else None, all_rows=n_all if split == "valid" else None, **kw)

    s1 = stream(gem, warmup_days=1)  # fills the per-user cache with the teacher's last day
    students = [student(row, gem, args.student, s1.steps) for row in direct]
    fm = student(fm_row, gem, args.fm, s1.steps) if hier or online else None
    live_fm = SimpleNamespace(model=fm.student.backbone, feature_dim=fm.student.backbone.feature_dim) if fm else None
    follow = [student(row, live_fm, args.student, s1.steps) for row in online]
    train_students(students + ([fm] if fm else []), s1, {fm.name: follow} if follow else None)
    calls_per_row = (gem.rows - s1.warm_rows) / max(s1.rows, 1)
    ev = evaluate_students(students + ([fm] if fm else []) + follow,
                           stream(gem, "test", shuffle=False, update_cache=False), schema, rates)
    names = [r[0] for r in direct] + [r[0] for r in online] + ([fm_row[0]] if fm else [])
    if hier:
        gem2 = TeacherService(gem.model)  # a fresh user cache: the FM's inputs replay as in its training pass
        fm_teacher = TeacherService(fm.student.backbone, upstream=gem2 if fm.tcfg.rep.enabled else None,
                                    upstream_source=fm.tcfg.rep.source)
        s2 = stream(fm_teacher, warmup_days=1)
        vms = [student(row, fm_teacher, args.student, s2.steps) for row in hier]
        train_students(vms, s2)
        ev.update(evaluate_students(vms, stream(fm_teacher, "test", shuffle=False, update_cache=False), schema, rates,
                                    {"gem": gem2}))
        names += [r[0] for r in hier]
    out = summarize(ev, names, seed, time.perf_counter() - t0, t_teacher, calls_per_row)
    stats = json.loads((data / "dataset.json").read_text())["source"]["stats"]
    out["world"] = {"ctr": stats["ctr"], "new_ad_row_share_test": stats["new_ad_row_share"]["test"],
                    "bayes_ne_test_click": stats["bayes_ne"]["test"]["click"]}
    out["parameters"] = {"teacher": count_parameters(gem.model), "student": count_parameters(students[0].student.backbone),
                         **({"fm": count_parameters(fm.student.backbone)} if fm else {})}
    return out


def summarize(ev: dict, names: list[str], seed: int, wall: float, t_teacher: float, calls_per_row: float) -> dict:
    key = "all/click"
    ne_alone, ne_gem = ev["alone"][key]["ne"], ev["teacher@alone"][key]["ne"]
    rows = {}
    for n in names:
        m = ev[n][key]
        rows[n] = {"ne": m["ne"], "auc": m["auc"], "calibration": m["calibration"],
                   "r": transfer_ratio(ne_alone, m["ne"], ne_gem) if n != "alone" else 0.0,
                   "r_conversion": transfer_ratio(ev["alone"]["all/conversion"]["ne"], ev[n]["all/conversion"]["ne"],
                                                  ev["teacher@alone"]["all/conversion"]["ne"])}
    teacher = ev["teacher@alone"][key]
    return {"seed": seed, "rows": rows, "teacher": {"ne": ne_gem, "auc": teacher["auc"],
                                                    "calibration": teacher["calibration"],
                                                    "ne_bayes": teacher.get("ne_bayes")},
            "n_test": teacher["n"], "wall_s": wall, "teacher_train_s": t_teacher, "teacher_calls_per_row": calls_per_row}


def _ms(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return math.nan, math.nan
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def table(results: list[dict]) -> tuple[str, dict]:
    names = list(results[0]["rows"])
    agg = {}
    lines = [f"{'students (click, test day)':<28}{'NE':>16}{'AUC':>9}{'calib':>8}{'R':>16}{'R(conv)':>10}"]
    t_ne = _ms([r["teacher"]["ne"] for r in results])
    lines.append(f"{'GEM teacher (stale)':<28}{t_ne[0]:>10.4f} ±{t_ne[1]:.3f}"
                 f"{_ms([r['teacher']['auc'] for r in results])[0]:>9.4f}"
                 f"{_ms([r['teacher']['calibration'] for r in results])[0]:>8.3f}")
    for n in names:
        get = {k: _ms([r["rows"][n][k] for r in results]) for k in ("ne", "auc", "calibration", "r", "r_conversion")}
        agg[n] = {k: {"mean": v[0], "std": v[1]} for k, v in get.items()}
        agg[n]["r_per_seed"] = [r["rows"][n]["r"] for r in results]
        lines.append(f"{n:<28}{get['ne'][0]:>10.4f} ±{get['ne'][1]:.3f}{get['auc'][0]:>9.4f}"
                     f"{get['calibration'][0]:>8.3f}{get['r'][0]:>10.3f} ±{get['r'][1]:.3f}{get['r_conversion'][0]:>10.3f}")
    return "\n".join(lines), agg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small world, 3 seeds: a few minutes on 2 cores")
    p.add_argument("--seeds", type=int, default=None)
    p.add_argument("--preset", default="demo", help="synthetic world preset the world is scaled from")
    p.add_argument("--users", type=int, default=None)
    p.add_argument("--days", type=int, default=None, help="teacher days T")
    p.add_argument("--student-days", type=int, default=2, help="student days k (the teacher's staleness)")
    p.add_argument("--drift", type=float, default=None, help="multiplier of the preset's drift knobs")
    p.add_argument("--domain", default="feed")
    p.add_argument("--teacher", default="tiny", help="GEM recipe of the teacher")
    p.add_argument("--student", default="vm_s")
    p.add_argument("--fm", default="fm_domain", help="recipe of the domain FM (hierarchical transfer)")
    p.add_argument("--teacher-overrides", nargs="*", default=[])
    p.add_argument("--overrides", nargs="*", default=[], help="student / transfer.* overrides for every student")
    p.add_argument("--out", default=None, help="keep worlds and runs here (default: a temporary directory)")
    args = p.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    quick = {"seeds": 3, "users": 4000, "days": 3, "drift": 3.0}
    full = {"seeds": 5, "users": 12000, "days": 4, "drift": 3.0}
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out) if args.out else Path(tmp)
        results = []
        for seed in range(args.seeds):
            results.append(run_seed(args, seed, root))
            print(f"seed {seed}: " + ", ".join(f"{n} R {r['r']:.3f}" for n, r in results[-1]["rows"].items())
                  + f"  ({results[-1]['wall_s']:.0f} s)", flush=True)
    text, agg = table(results)
    direct = [r[0] for r in DIRECT if r[0] != "alone" and r[0] not in OFFLINE]
    best = max(direct, key=lambda n: agg[n]["r"]["mean"])
    r_kd, r_best, r_kd1 = agg["kd"]["r"]["mean"], agg[best]["r"]["mean"], agg["kd (w=1)"]["r"]["mean"]
    per_seed = [r["rows"][best]["r"] / r["rows"]["kd"]["r"] for r in results if r["rows"]["kd"]["r"] > 0]
    ratio_spread = _ms(per_seed)
    offline = next(iter(OFFLINE))
    settings = {k: getattr(args, k) for k in ("preset", "users", "days", "student_days", "drift", "domain", "teacher",
                                              "student", "fm", "seeds", "overrides", "teacher_overrides")}
    w = results[0]["world"]
    print(f"\nworld: {args.preset} × {args.users} users; teacher ({args.teacher}) on days 0-{args.days - 1}, students "
          f"({args.student}, {args.domain}) on days {args.days}-{args.days + args.student_days - 1}, test day "
          f"{args.days + args.student_days}; drift ×{args.drift}; test rows {results[0]['n_test']} (seed 0), "
          f"{w['new_ad_row_share_test']:.0%} of them show ads launched after the teacher's days; "
          f"{len(results)} seeds; {time.perf_counter() - t0:.0f} s")
    print(text)
    print(f"\nR(best)/R(KD) = {r_best:.3f} / {r_kd:.3f} = {r_best / r_kd:.2f} (per seed {ratio_spread[0]:.2f} "
          f"± {ratio_spread[1]:.2f}; best servable set: {best}); vs untuned KD (w=1): {r_best / r_kd1:.2f}; "
          f"offline upper bound {offline}: {agg[offline]['r']['mean'] / r_kd:.2f}")
    print(json.dumps({"r_kd": r_kd, "r_best": r_best, "best": best, "ratio_best_vs_kd": r_best / r_kd,
                      "ratio_best_vs_kd_per_seed": {"mean": ratio_spread[0], "std": ratio_spread[1]},
                      "r_kd_w1": r_kd1, "ratio_best_vs_kd_w1": r_best / r_kd1,
                      "r_offline_row_rep": agg[offline]["r"]["mean"], "rows": agg, "settings": settings,
                      "teacher": {k: _ms([r["teacher"][k] for r in results])[0] for k in ("ne", "auc", "calibration")},
                      "world_seed0": w, "parameters": results[0]["parameters"],
                      "teacher_calls_per_row": results[0]["teacher_calls_per_row"],
                      "wall_s": time.perf_counter() - t0}, default=str))


if __name__ == "__main__":
    main()
