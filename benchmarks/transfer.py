"""The knowledge-transfer sweep and, with ``--table``, the technique table (docs/transfer.md).

    python benchmarks/transfer.py --quick      # the sweep, reduced grid: ~10 min on 2 CPU cores
    python benchmarks/transfer.py              # the sweep, whole grid
    python benchmarks/transfer.py --table [--quick]   # the technique table (docs/transfer.md)

**The sweep**: lag {0, 1, 3, 7} days × student data {1, 3} days × objective {matched, mismatched}
(``--quick``: lag {0, 3} × data {1, 3}, 3,000 users, 3 seeds; code: ``instruments.transfer_sweep``).
Per seed: one world with the surface
task on (``engage`` on video, ``opengem.world.latent.SurfaceTask``), one FM (``tiny``)
trained *continuously* on a view of it without the task (``opengem.transfer.objectives.fm_view``)
over days 0..V−1, a snapshot published per day; V is the valid day, V+1 the test day. Per (lag,
data) one pass trains every technique set on video's ``data`` days before V, from the snapshot that
has seen up to (V − data) − 1 − lag (rep(days) reads daily tables each computed by its day's own
snapshot, ``DailySnapshots``, with the same lag); the same students are graded on click ("matched")
and on engage ("mismatched": KD reads the FM's click head). The set is chosen per cell on valid NE
(``opengem.transfer.sweep.select_on_valid``, ``require_tuning_split``; development seeds only) and
the test day grades KD and it once. R's reference: the teacher's head for click; for engage, its
click head Platt-recalibrated on the students' days (the most the FM alone knows about it). Each
cell also reports R measured on AUC (ranking) and what the adapter adds to KD's R (calibration).
Candidates: KD at weights 1, 3 and 10, KD with each technique and their combinations, sharing and
representations without KD, and in the full mode (``--hier``; off with ``--quick`` for time) a VM
taught online by a domain FM (GEM → FM → VM); R(KD), the ratio's denominator, stays KD at weight 3.
The last line is one JSON object: per cell R(KD), R(best), their ratio and the set chosen on valid;
``ratio_best_vs_kd_stale`` (the mean ratio over cells with R(KD) <= 0.5), ``ratio_best_vs_kd_all``;
per cell the NE gain over the student alone (defined where R is not) and
``gain_ratio_best_vs_kd_all``; the teacher's inference seconds and rows scored per student training
row (``passes``); and the table's headline keys (``r_kd``, ``r_best``, ``best``,
``ratio_best_vs_kd``, ``teacher.ne``) as means over cells, for ``opengem report``.

**The table** (``--table``): transfer ratio R per technique, alone and combined, over seeds; the
technique set chosen on a valid day, graded once on the test day.

    python benchmarks/transfer.py --table --quick      # a few minutes on 2 CPU cores (no hierarchical rows)
    python benchmarks/transfer.py --table              # the fuller table

Per seed: generate a synthetic world (its drift knobs set the staleness), train a GEM teacher on
the ``train`` days, then in ONE pass over the students' ``distill`` days of one surface (the teacher
called once per batch) train every student variant, a domain FM, and the VMs that FM teaches online
(it scores each batch before it learns from it) side by side; a second pass trains a VM from the
trained, frozen domain FM on the same days (its soft labels are then in-sample). Every student is
scored on the ``valid`` day that follows the students' days, with the same NE normaliser (the
students' training base rate), next to the teacher:

    R = (NE_alone − NE_with) / (NE_alone − NE_GEM)          (dossier §8.6)

The servable technique set (and the KD weight among 1, 3, 10) is chosen on that valid day, per
seed (highest R, i.e. lowest NE) and by majority over seeds (``require_tuning_split``; development
world seeds only). The ``test`` day after it then grades KD and the chosen set, once: the test pass
scores only the candidate sets (one pass is cheaper than one per seed's choice), and only KD's and
the chosen sets' test R are read.

The world is generated with ``sizes.valid_days`` = students' days + 1 and its manifest's ``valid``
split is cut in two: ``distill`` (the students' days) and ``valid`` (the day the choice is made on).

Prints the valid table (mean ± std over seeds), the test figures, and as its last line one JSON
object with ``r_kd``, ``r_best``, ``best`` (the majority choice), ``best_per_seed``,
``ratio_best_vs_kd`` and ``valid`` (every row's valid figures).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import math
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from instruments.transfer_sweep import run_seeds

from opengem.config import apply_overrides, apply_prefixed_overrides
from opengem.data.parquet import MANIFEST, DatasetManifest
from opengem.discipline import require_dev_world, require_tuning_split
from opengem.features.schema import FeatureSchema
from opengem.model.build import count_parameters
from opengem.recipes import recipe, student_recipe
from opengem.run import FINAL_FILE
from opengem.train.trainer import train
from opengem.transfer.config import techniques_config
from opengem.transfer.distill import make_trainer
from opengem.transfer.stream import SliceStream, domain_ids, slice_rates
from opengem.transfer.teacher import TeacherService
from opengem.transfer.trainer import evaluate_students, train_students, transfer_ratio
from opengem.world.generate import generate
from opengem.world.presets import world_config

# (row name, techniques, overrides for that student). "kd" is standard KD at the default weight (3);
# "kd (w=1)" and "kd (w=10)" bracket it, so the weight is chosen on valid too. rep(row) feeds each
# row's own teacher features: an offline upper bound, not free at serving (the teacher would run per
# candidate), so it is never a candidate.
DIRECT = [("alone", "", ()), ("kd (w=1)", "kd", ("transfer.kd.weight=1",)), ("kd", "kd", ()),
          ("kd (w=10)", "kd", ("transfer.kd.weight=10",)),
          ("kd+aux", "kd+aux", ()), ("kd+adapter", "kd+adapter", ()), ("kd+rep", "kd+rep", ()),
          ("kd+share", "kd+share", ()), ("kd+share+rep", "kd+share+rep", ()),
          ("default (kd+adapter+share)", "kd+adapter+share", ()),
          ("all", "kd+aux+adapter+rep+share", ()),
          ("kd+rep(row) offline", "kd+rep", ("transfer.rep.source=row",))]
# Hierarchical: GEM → domain FM → VM. Online: the FM trains in the same pass as the direct students
# and teaches its VMs each batch before it learns from it (as a continuously trained FM serves).
# Frozen: a second pass with the trained FM as a frozen teacher on the days it was trained on, so
# its soft labels are in-sample.
ONLINE = [("hier online: kd", "kd", ()), ("hier online: kd+share", "kd+share", ())]
HIER = [("hier frozen FM: kd", "kd", ())]
# a GEM student itself, then the VMs' teacher
FM = ("domain FM (fm_domain)", "kd+adapter+share", ())
OFFLINE = {"kd+rep(row) offline"}
KD_WEIGHTS = {"kd (w=1)": 1.0, "kd": 3.0, "kd (w=10)": 10.0}
STUDENT_SPLIT, CHOICE_SPLIT = "distill", "valid"


def candidates(direct=DIRECT) -> list[str]:
    """The servable sets the choice is made among (every direct row but the baseline and
    offline bounds)."""
    return [r[0] for r in direct if r[0] != "alone" and r[0] not in OFFLINE]


def world(args, seed: int):
    d = args.drift
    base = world_config(args.preset, seed=seed)
    return world_config(args.preset, seed=seed, overrides=[
        f"sizes.num_users={args.users}", f"sizes.num_days={args.days + args.student_days + 2}",
        f"sizes.valid_days={args.student_days + 1}", "sizes.test_days=1",
        f"behaviour.interest_drift={base.behaviour.interest_drift * d}",
        f"click.ad_drift={base.click.ad_drift * d}",
        f"click.advertiser_drift={base.click.advertiser_drift * d}"])


def split_student_days(data: Path, student_days: int) -> None:
    """Cut the world's ``valid`` days into the students' ``distill`` days and the last one, kept as
    ``valid`` to choose on: a choice must not be graded on the days the students learnt from."""
    m = DatasetManifest.load(data)
    if STUDENT_SPLIT in m.splits:  # a kept --out world, already cut
        return
    days = sorted(m.splits["valid"])
    if len(days) != student_days + 1:
        raise ValueError(f"{data}: expected {student_days + 1} valid days, got {days}")
    m.splits = {"train": m.splits["train"], STUDENT_SPLIT: days[:-1], CHOICE_SPLIT: days[-1:],
                "test": m.splits["test"]}
    (data / MANIFEST).write_text(json.dumps(m.to_dict(), indent=2))


def run_seed(args, seed: int, root: Path, direct=DIRECT, hier=HIER, fm_row=FM,
             online=ONLINE) -> dict:
    require_dev_world(seed, "the transfer benchmark's technique set")
    if not args.hier:
        hier, online = [], []
    data, run = root / f"data{seed}", root / f"gem{seed}"
    t0 = time.perf_counter()
    if not (run / FINAL_FILE).exists():  # a kept --out directory is reused
        generate(world(args, seed), data, progress=False)
        split_student_days(data, args.student_days)
        cfg = apply_overrides(recipe(args.teacher),
                              [f"train.seed={seed}", "train.progress=false", "train.threads=1",
                                                     *args.teacher_overrides])
        train(cfg, data, run)
    t_teacher = time.perf_counter() - t0
    schema = FeatureSchema.load(data)
    gem = TeacherService.from_run(run)
    doms = domain_ids(schema, [args.domain])
    rates, n_slice, n_all = slice_rates(data, schema, STUDENT_SPLIT, doms)

    def student(row, teacher, recipe_name, steps):
        name, techniques, extra = row
        trees = apply_prefixed_overrides(
            {"": student_recipe(recipe_name),
             "transfer": techniques_config(techniques, domains=(args.domain,))},
            [f"train.seed={seed}", f"data.seed={seed}", *args.overrides, *extra])
        return make_trainer(name, trees[""], trees["transfer"], schema, teacher, rates, steps)

    def stream(teacher, split=STUDENT_SPLIT, **kw):
        if split != STUDENT_SPLIT:  # scoring: big batches, in file order
            return SliceStream(data, split, schema, doms, teacher, 4096, seed=seed, shuffle=False,
                               **kw)
        return SliceStream(data, split, schema, doms, teacher,
                           student_recipe(args.student).data.batch_size,
                           seed=seed, slice_rows=n_slice, all_rows=n_all, **kw)

    s1 = stream(gem, warmup_days=1)  # fills the per-user cache with the teacher's last day
    students = [student(row, gem, args.student, s1.steps) for row in direct]
    fm = student(fm_row, gem, args.fm, s1.steps) if hier or online else None
    live_fm = (
        SimpleNamespace(model=fm.student.backbone, feature_dim=fm.student.backbone.feature_dim)
        if fm
        else None
    )
    follow = [student(row, live_fm, args.student, s1.steps) for row in online]
    phase = {"teacher": t_teacher}
    t = time.perf_counter()
    train_students(students + ([fm] if fm else []), s1, {fm.name: follow} if follow else None)
    calls_per_row = (gem.rows - s1.warm_rows) / max(s1.rows, 1)
    phase["students"], t = time.perf_counter() - t, time.perf_counter()
    # the valid day feeds the teacher's user cache as the days before it did (no labels enter it),
    # so the test day reads the snapshot of the day before it, as the valid day did
    ev_valid = evaluate_students(students + ([fm] if fm else []) + follow,
                                 stream(gem, CHOICE_SPLIT), schema, rates)
    phase["valid"], t = time.perf_counter() - t, time.perf_counter()
    graded = [tr for tr in students if tr.name not in OFFLINE]
    ev_test = evaluate_students(graded, stream(gem, "test", update_cache=False), schema, rates)
    phase["test"], t = time.perf_counter() - t, time.perf_counter()
    names = [r[0] for r in direct] + [r[0] for r in online] + ([fm_row[0]] if fm else [])
    if hier:
        # a fresh user cache: the FM's inputs replay as in its training pass
        gem2 = TeacherService(gem.model)
        fm_teacher = TeacherService(fm.student.backbone,
                                    upstream=gem2 if fm.tcfg.rep.enabled else None,
                                    upstream_source=fm.tcfg.rep.source)
        s2 = stream(fm_teacher, warmup_days=1)
        vms = [student(row, fm_teacher, args.student, s2.steps) for row in hier]
        train_students(vms, s2)
        ev_valid.update(evaluate_students(vms, stream(fm_teacher, CHOICE_SPLIT), schema, rates,
                                          {"gem": gem2}))
        names += [r[0] for r in hier]
        phase["hier_frozen_fm"] = time.perf_counter() - t
    out = {"seed": seed, "phase_s": phase, "valid": summarize(ev_valid, names),
           "test": summarize(ev_test, [tr.name for tr in graded]),
           "wall_s": time.perf_counter() - t0, "teacher_train_s": t_teacher,
           "teacher_calls_per_row": calls_per_row}
    stats = json.loads((data / MANIFEST).read_text())["source"]["stats"]
    out["world"] = {"ctr": stats["ctr"], "new_ad_row_share_test": stats["new_ad_row_share"]["test"],
                    "bayes_ne_test_click": stats["bayes_ne"]["test"]["click"]}
    out["parameters"] = {"teacher": count_parameters(gem.model),
                         "student": count_parameters(students[0].student.backbone),
                         **({"fm": count_parameters(fm.student.backbone)} if fm else {})}
    return out


def summarize(ev: dict, names: list[str]) -> dict:
    """Each row's click NE, AUC, calibration and R (click and conversion) on one day, and
    the teacher's."""
    key = "all/click"
    ne_alone, ne_gem = ev["alone"][key]["ne"], ev["teacher@alone"][key]["ne"]
    rows = {}
    for n in names:
        m = ev[n][key]
        rows[n] = {"ne": m["ne"], "auc": m["auc"], "calibration": m["calibration"],
                   "r": transfer_ratio(ne_alone, m["ne"], ne_gem) if n != "alone" else 0.0,
                   "r_conversion": transfer_ratio(ev["alone"]["all/conversion"]["ne"],
                                                  ev[n]["all/conversion"]["ne"],
                                                  ev["teacher@alone"]["all/conversion"]["ne"])}
    teacher = ev["teacher@alone"][key]
    return {"rows": rows,
            "teacher": {"ne": ne_gem, "auc": teacher["auc"], "calibration": teacher["calibration"],
                                      "ne_bayes": teacher.get("ne_bayes")}, "n": teacher["n"]}


def _ms(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return math.nan, math.nan
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _agg(results: list[dict], split: str, names: list[str]) -> dict:
    agg = {}
    for n in names:
        get = {k: _ms([r[split]["rows"][n][k] for r in results])
               for k in ("ne", "auc", "calibration", "r", "r_conversion")}
        agg[n] = {k: {"mean": v[0], "std": v[1]} for k, v in get.items()}
        agg[n]["r_per_seed"] = [r[split]["rows"][n]["r"] for r in results]
    return agg


def choose(results: list[dict], cands: list[str],
           split: str = CHOICE_SPLIT) -> tuple[list[str], str, dict]:
    """(each seed's set with the highest valid R, the majority of those, each set's mean valid NE
    gain over the student alone). Reads the valid rows only.

    Within a seed, the highest R is the lowest NE (one teacher, one normaliser), so the choice ranks
    NE: it stays defined on a seed whose stale teacher is not ahead of the student alone on the
    valid day (R is NaN there). A majority tie goes to the larger mean gain."""
    require_tuning_split(split, "the transfer benchmark's technique set")
    rows = [r[split]["rows"] for r in results]
    per_seed = [min(cands, key=lambda n, x=x: x[n]["ne"]) for x in rows]
    gain = {n: statistics.fmean(x["alone"]["ne"] - x[n]["ne"] for x in rows) for n in cands}
    votes = collections.Counter(per_seed)
    best = max((n for n in cands if votes[n] == max(votes.values())), key=gain.get)
    return per_seed, best, gain


def valid_table(results: list[dict]) -> tuple[str, dict]:
    names = list(results[0][CHOICE_SPLIT]["rows"])
    agg = _agg(results, CHOICE_SPLIT, names)
    lines = [f"{'students (click, valid day)':<28}{'NE':>16}{'AUC':>9}{'calib':>8}{'R':>16}{'R(conv)':>10}"]
    t_ne = _ms([r[CHOICE_SPLIT]["teacher"]["ne"] for r in results])
    lines.append(f"{'GEM teacher (stale)':<28}{t_ne[0]:>10.4f} ±{t_ne[1]:.3f}"
                 f"{_ms([r[CHOICE_SPLIT]['teacher']['auc'] for r in results])[0]:>9.4f}"
                 f"{_ms([r[CHOICE_SPLIT]['teacher']['calibration'] for r in results])[0]:>8.3f}")
    for n in names:
        a = agg[n]
        lines.append(f"{n:<28}{a['ne']['mean']:>10.4f} "
                     f"±{a['ne']['std']:.3f}{a['auc']['mean']:>9.4f}"
                     f"{a['calibration']['mean']:>8.3f}{a['r']['mean']:>10.3f} ±{a['r']['std']:.3f}"
                     f"{a['r_conversion']['mean']:>10.3f}")
    return "\n".join(lines), agg


def grade_on_test(results: list[dict], best: str, per_seed: list[str]) -> dict:
    """The test day, read once: the teacher, the student alone, KD and the chosen sets."""
    def r(res, n):
        return res["test"]["rows"][n]["r"]

    r_kd, r_best = _ms([r(x, "kd") for x in results]), _ms([r(x, best) for x in results])
    r_own = _ms([r(x, n) for x, n in zip(results, per_seed)])
    ratio = _ms([r(x, best) / r(x, "kd") for x in results if r(x, "kd") > 0])
    return {"r_kd": r_kd, "r_best": r_best, "r_per_seed_choice": r_own, "ratio_per_seed": ratio,
            "ne_teacher": _ms([x["test"]["teacher"]["ne"] for x in results]),
            "ne_alone": _ms([x["test"]["rows"]["alone"]["ne"] for x in results]),
            "ne_kd": _ms([x["test"]["rows"]["kd"]["ne"] for x in results]),
            "ne_best": _ms([x["test"]["rows"][best]["ne"] for x in results]),
            "r_kd_per_seed": [r(x, "kd") for x in results],
            "r_best_per_seed": [r(x, best) for x in results]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="small world, 3 seeds: a few minutes on 2 cores")
    p.add_argument("--table", action="store_true",
                   help="the technique table (docs/transfer.md) instead of the sweep")
    p.add_argument("--lags", type=int, nargs="*", default=None, help="sweep: teacher lags in days")
    p.add_argument("--data", type=int, nargs="*", default=None, help="sweep: student data in days")
    p.add_argument("--seeds", type=int, default=None)
    p.add_argument("--preset", default="demo",
                   help="synthetic world preset the world is scaled from")
    p.add_argument("--users", type=int, default=None)
    p.add_argument("--days", type=int, default=None, help="teacher days T")
    p.add_argument("--student-days", type=int, default=2,
                   help="student days k (then one valid day, one test day)")
    p.add_argument("--drift", type=float, default=None,
                   help="multiplier of the preset's drift knobs")
    p.add_argument("--domain", default="feed")
    p.add_argument("--teacher", default="tiny", help="GEM recipe of the teacher")
    p.add_argument("--student", default="vm_s")
    p.add_argument("--fm", default="fm_domain",
                   help="recipe of the domain FM (hierarchical transfer)")
    p.add_argument("--hier", action=argparse.BooleanOptionalAction, default=None,
                   help="the hierarchical rows (domain FM, its VMs); default: on, off with --quick")
    p.add_argument("--teacher-overrides", nargs="*", default=[])
    p.add_argument("--overrides", nargs="*", default=[],
                   help="student / transfer.* overrides for every student")
    p.add_argument("--out", default=None,
                   help="keep worlds and runs here (default: a temporary directory)")
    args = p.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    if not args.table:
        # quick: lag {0, 3} × data {1, 3} × both objectives, 3 seeds, 3,000 users; full: the whole
        # grid the hierarchical candidate (a domain FM per pass) in the full mode only: it would
        # take --quick past its time
        quick = {"seeds": 3, "users": 3000, "days": 5, "drift": 3.0, "lags": [0, 3], "data": [1, 3],
                 "hier": False}
        full = {"seeds": 3, "users": 8000, "days": 8, "drift": 3.0, "lags": [0, 1, 3, 7],
                "data": [1, 3], "hier": True}
        for k, v in (quick if args.quick else full).items():
            if getattr(args, k) is None:
                setattr(args, k, v)
        from instruments.transfer_sweep import sweep_main

        return sweep_main(args)
    # --quick leaves out the hierarchical rows (never candidates) to stay within 5 minutes on
    # 2 cores
    quick = {"seeds": 3, "users": 4000, "days": 3, "drift": 3.0, "hier": False}
    full = {"seeds": 5, "users": 12000, "days": 4, "drift": 3.0, "hier": True}
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    t0 = time.perf_counter()
    results = run_seeds(args, run_seed, lambda res: ", valid: " + ", ".join(
        f"{n} R {r['r']:.3f}" for n, r in res[CHOICE_SPLIT]["rows"].items())
                                        + f"  ({res['wall_s']:.0f} s)")
    text, agg = valid_table(results)
    cands = candidates()
    per_seed, best, gain = choose(results, cands)
    kd_weight = KD_WEIGHTS[max(KD_WEIGHTS, key=gain.get)]
    t = grade_on_test(results, best, per_seed)
    settings = {k: getattr(args, k)
                for k in ("preset", "users", "days", "student_days", "drift", "domain", "teacher",
                                              "student", "fm", "hier", "seeds", "overrides",
                          "teacher_overrides")}
    w = results[0]["world"]
    T, k = args.days, args.student_days
    print(f"\nworld: {args.preset} × {args.users} users; teacher ({args.teacher}) on days "
          f"0-{T - 1}, students ({args.student}, {args.domain}) on days {T}-{T + k - 1}, valid day "
          f"{T + k} (the choice), test day "
          f"{T + k + 1}; drift ×{args.drift}; valid rows {results[0][CHOICE_SPLIT]['n']}, "
          f"test rows {results[0]['test']['n']} (seed 0), {w['new_ad_row_share_test']:.0%} of the "
          f"test rows show ads launched after the teacher's days; {len(results)} seeds; "
          f"{time.perf_counter() - t0:.0f} s")
    print(text)
    print(f"\nchosen on valid R: {best} (per seed: {', '.join(per_seed)}); KD weight on "
          f"valid: {kd_weight:g}")
    print(f"test day (read once): NE teacher {t['ne_teacher'][0]:.4f}, "
          f"alone {t['ne_alone'][0]:.4f}, "
          f"KD {t['ne_kd'][0]:.4f}, {best} {t['ne_best'][0]:.4f}")
    print(f"test R: KD {t['r_kd'][0]:.3f} ± {t['r_kd'][1]:.3f}; {best} {t['r_best'][0]:.3f} "
          f"± {t['r_best'][1]:.3f}; each seed's own choice {t['r_per_seed_choice'][0]:.3f} "
          f"± {t['r_per_seed_choice'][1]:.3f}; "
          f"R(best)/R(KD) = {t['r_best'][0] / t['r_kd'][0]:.2f} (per "
          f"seed {t['ratio_per_seed'][0]:.2f} "
          f"± {t['ratio_per_seed'][1]:.2f})")
    ms = {key: {"mean": v[0], "std": v[1]} for key, v in t.items() if isinstance(v, tuple)}
    print(json.dumps({"r_kd": t["r_kd"][0], "r_best": t["r_best"][0], "best": best,
                      "best_per_seed": per_seed, "ratio_best_vs_kd": t["r_best"][0] / t["r_kd"][0],
                      "test": ms,
                      "test_r_per_seed": {"kd": t["r_kd_per_seed"], best: t["r_best_per_seed"]},
                      "kd_weight_chosen_on_valid": kd_weight, "candidates": cands,
                      "valid_ne_gain": gain,
                      "valid_per_seed": [{"teacher_ne": r[CHOICE_SPLIT]["teacher"]["ne"],
                                          "alone_ne": r[CHOICE_SPLIT]["rows"]["alone"]["ne"]}
                                         for r in results],
                      "phase_s": [r["phase_s"] for r in results],
                      "valid_r": {n: agg[n]["r"] for n in agg}, "valid": agg, "settings": settings,
                      "teacher_valid": {key: _ms([r[CHOICE_SPLIT]["teacher"][key]
                                                  for r in results])[0]
                                        for key in ("ne", "auc", "calibration")},
                      "world_seed0": w, "parameters": results[0]["parameters"],
                      "teacher_calls_per_row": results[0]["teacher_calls_per_row"],
                      "wall_s": time.perf_counter() - t0}, default=str))


if __name__ == "__main__":
    main()
