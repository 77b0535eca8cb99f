"""The knowledge-transfer sweep (``python benchmarks/transfer.py [--quick]``): lag × student data ×
objective, every technique set trained in one pass per (lag, data), chosen per cell on valid, graded
on test once. benchmarks/transfer.py's docstring describes the protocol; this is its code.

Candidates per cell: KD at weights 1, 3 and 10, KD with each technique, their combinations, sharing
and representations without KD, and (full
mode, ``--hier``) a VM taught online by a domain FM that GEM teaches (GEM → domain FM → VM). R(KD),
the ratio's denominator, is KD at the default weight 3, as before the weights became candidates.
"""

from __future__ import annotations

import collections
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from opengem.config import apply_overrides, apply_prefixed_overrides
from opengem.data.parquet import MANIFEST, DatasetManifest
from opengem.discipline import require_dev_world
from opengem.evaluation.platt import fit_platt
from opengem.features.schema import FeatureSchema
from opengem.recipes import recipe, student_recipe
from opengem.run import FINAL_FILE, load_run_model
from opengem.train.trainer import train
from opengem.transfer.config import techniques_config
from opengem.transfer.distill import make_trainer
from opengem.transfer.objectives import fm_view, head_map
from opengem.transfer.stream import SliceStream, domain_ids, slice_rates
from opengem.transfer.sweep import (
    CHOICE_SPLIT,
    cell_key,
    grade_cell,
    headline,
    select_on_valid,
    valid_gains,
)
from opengem.transfer.teacher import DailySnapshots, TeacherOutput, TeacherService, teacher_snapshot
from opengem.transfer.trainer import evaluate_students, train_students, transfer_ratio
from opengem.world.generate import generate
from opengem.world.presets import world_config

# ------------------------------------------------------------------------------ the sweep
# lag × student data days × objective. One world per seed with the surface task on (``engage`` on
# video, absent from the FM), one FM trained continuously over days 0..V−1 (a snapshot per day) on a
# view without the task; per (lag, data) one pass trains every set below on video's last ``data``
# days before the valid day V, from the snapshot that has seen up to (V − data) − 1 − lag; "matched"
# grades them on click, "mismatched" on engage (the FM's click head is what KD reads for it).
SWEEP = [("alone", "", ()), ("kd (w=1)", "kd", ("transfer.kd.weight=1",)), ("kd", "kd", ()),
         ("kd (w=10)", "kd", ("transfer.kd.weight=10",)), ("kd+aux", "kd+aux", ()),
         ("kd+adapter", "kd+adapter", ()),
         ("kd+rep(days)", "kd+rep", ("transfer.rep.source=days",)), ("kd+share", "kd+share", ()),
         ("kd+adapter+share", "kd+adapter+share", ()),
         ("kd+adapter+share+rep(days)", "kd+adapter+share+rep", ("transfer.rep.source=days",)),
         # without KD: for an objective the FM never trained on, its soft label can cost more than
         # its tables and representations give (the first full sweep: every KD set below the
         # student alone)
         ("share", "share", ()), ("rep(days)", "rep", ("transfer.rep.source=days",)),
         ("share+rep(days)", "share+rep", ("transfer.rep.source=days",))]
# Hierarchical (full mode): GEM teaches a domain FM, which teaches its VM online in the same pass
# (it scores each batch before it learns from it, as a continuously trained FM serves). The FM is
# bigger than a VM, so it is reported, never a candidate; the VM it teaches is one.
SWEEP_FM = ("domain FM", "kd+adapter+share", ())
SWEEP_HIER = [("hier: GEM→FM→VM kd", "kd", ())]
SWEEP_DOMAIN, OBJECTIVES = "video", {"matched": "click", "mismatched": "engage"}


def sweep_world(args, seed: int):
    d = args.drift
    base = world_config(args.preset, seed=seed)
    V = args.days + max(args.data)
    return world_config(args.preset, seed=seed, overrides=[
        f"sizes.num_users={args.users}", f"sizes.num_days={V + 2}",
        f"sizes.valid_days={max(args.data) + 1}",
        "sizes.test_days=1", "surface_task.enabled=true",
        f"behaviour.interest_drift={base.behaviour.interest_drift * d}",
        f"click.ad_drift={base.click.ad_drift * d}",
        f"click.advertiser_drift={base.click.advertiser_drift * d}"]), V


class _TimedTeacher(TeacherService):
    """A teacher service that counts its inference seconds (the compute spent per student row)."""

    seconds = 0.0

    def predict(self, batch, update_cache=True, day=None):
        t = time.perf_counter()
        out = super().predict(batch, update_cache, day)
        self.seconds += time.perf_counter() - t
        return out


class _Recalibrated:
    """The reference for a task the FM lacks: its closest head, Platt-recalibrated on the
    students' days."""

    def __init__(self, model, head_idx: torch.Tensor, ab: dict[int, tuple[float, float]]):
        self.svc, self.head_idx, self.ab = TeacherService(model, user_cache=False), head_idx, ab

    def predict(self, batch, update_cache=False):
        z = self.svc.predict(batch, False).logits[:, self.head_idx].clone()
        for t, (a, b) in self.ab.items():
            z[:, t] = a * z[:, t] + b
        return TeacherOutput(z)


def _cell_rows(ev: dict, names: list[str], task: str, ref: str) -> dict:
    key = f"all/{task}"
    alone, r_m = ev["alone"][key], ev[ref][key]
    rows = {}
    for n in names:
        m = ev[n][key]
        rows[n] = {"ne": m["ne"], "auc": m["auc"], "calibration": m["calibration"],
                   "r": transfer_ratio(alone["ne"], m["ne"], r_m["ne"]) if n != "alone" else 0.0,
                   "r_auc": ((m["auc"] - alone["auc"]) / (r_m["auc"] - alone["auc"])
                             if n != "alone" and r_m["auc"] > alone["auc"] else math.nan)}
    rows["_reference"] = {"ne": r_m["ne"], "auc": r_m["auc"], "calibration": r_m["calibration"],
                          "ne_bayes": r_m.get("ne_bayes")}
    return rows


def sweep_seed(args, seed: int, root: Path) -> dict:
    require_dev_world(seed, "the transfer sweep's technique sets")
    cfg_w, V = sweep_world(args, seed)
    data, view, run = root / f"sdata{seed}", root / f"sview{seed}", root / f"sgem{seed}"
    t0 = time.perf_counter()
    if not (run / FINAL_FILE).exists():
        generate(cfg_w, data, progress=False)
        m = DatasetManifest.load(data)
        m.splits = {"train": list(range(args.days)), CHOICE_SPLIT: [V], "test": [V + 1],
                    **{f"distill{k}": list(range(V - k, V)) for k in args.data}}
        (data / MANIFEST).write_text(json.dumps(m.to_dict(), indent=2))
        fm_view(data, view, ["engage"])
        cfg = apply_overrides(recipe(args.teacher),
                              [f"train.seed={seed}", "train.progress=false", "train.threads=1",
                                                     *args.teacher_overrides])
        # continuous: a snapshot per day, never the valid/test days
        train(cfg, view, run, days=list(range(V)))
    t_teacher = time.perf_counter() - t0
    schema = FeatureSchema.load(data)
    doms = domain_ids(schema, [SWEEP_DOMAIN])
    out = {"seed": seed, "cells": {}, "teacher_train_s": t_teacher, "passes": {}}
    for k in args.data:
        split = f"distill{k}"
        rates, n_slice, n_all = slice_rates(data, schema, split, doms)
        for lag in args.lags:
            t = time.perf_counter()
            snap, meta = teacher_snapshot(run, V - k, lag)
            model, _, _ = load_run_model(run, snapshot=snap)
            # rep(days): each day's table from the day's own snapshot, with the same
            # lag (DailySnapshots)
            gem = _TimedTeacher(model, history=(3, 16, DailySnapshots(run, lag, {snap: model})))
            hidx = torch.tensor(head_map(schema.task_names, model.schema.task_names))
            s1 = SliceStream(data, split, schema, doms, gem,
                             student_recipe(args.student).data.batch_size, seed=seed,
                             slice_rows=n_slice, all_rows=n_all, warmup_days=3)

            def student(row, recipe_name=args.student, teacher=gem):
                name, techniques, extra = row
                trees = apply_prefixed_overrides(
                    {"": student_recipe(recipe_name),
                     "transfer": techniques_config(techniques, domains=(SWEEP_DOMAIN,))},
                    [f"train.seed={seed}", f"data.seed={seed}", *args.overrides, *extra])
                return make_trainer(name, trees[""], trees["transfer"], schema, teacher, rates,
                                    s1.steps)

            students = [student(row) for row in SWEEP]
            fm, follow = None, []
            if args.hier:
                fm = student(SWEEP_FM, args.fm)
                live = SimpleNamespace(model=fm.student.backbone,
                                       feature_dim=fm.student.backbone.feature_dim)
                follow = [student(row, teacher=live) for row in SWEEP_HIER]
            zs, ys = [], []
            e = schema.task_names.index("engage")

            def collecting(stream):
                for batch, tout in stream:
                    m = batch.label_mask[:, e]
                    zs.append(tout.logits[:, hidx[e]][m])
                    ys.append(batch.labels[:, e][m])
                    yield batch, tout
            train_students(students + ([fm] if fm else []), collecting(s1),
                           {fm.name: follow} if fm else None)
            # the teacher's compute per student training row: every row it scored for this pass (the
            # students' rows and the warm-up days that fill the daily representation tables), and
            # the days' own snapshots computing those tables (their seconds count, their rows
            # do not)
            teacher_s, student_rows, scored = gem.seconds, s1.rows, gem.rows
            # scored on GEM's stream now: their teacher@ column is GEM's (a VM reads no teacher)
            for f in follow:
                f.head_idx = hidx
            ref = _Recalibrated(model, hidx, {e: fit_platt(torch.cat(zs), torch.cat(ys))})
            names = [r[0] for r in SWEEP] + ([SWEEP_FM[0]] + [r[0] for r in SWEEP_HIER] if fm
                                             else [])
            cell = {}
            for split_name, upd in ((CHOICE_SPLIT, True), ("test", False)):
                held = SliceStream(data, split_name, schema, doms, gem, 4096, seed=seed,
                                   shuffle=False,
                                     update_cache=upd)
                ev = evaluate_students(students + ([fm] if fm else []) + follow, held, schema,
                                       rates, {"fm": ref})
                for obj, task in OBJECTIVES.items():
                    refname = "teacher@alone" if obj == "matched" else "fm@alone"
                    cell.setdefault(obj, {})[split_name] = _cell_rows(ev, names, task, refname)
            for obj in OBJECTIVES:
                out["cells"][cell_key(lag, k, obj)] = cell[obj]
            out["passes"][f"lag{lag}/data{k}"] = {
                "snapshot_last_day": meta["last_day"], "student_days": list(range(V - k, V)),
                "rep_table_snapshot_last_day": dict(gem.history.source),
                "wall_s": time.perf_counter() - t,
                "teacher_s_per_student_row": teacher_s / max(student_rows, 1),
                "teacher_rows_per_student_row": scored / max(student_rows, 1),
                "teacher_warmup_rows_per_student_row": s1.warm_rows / max(student_rows, 1),
                "student_rows": student_rows}
    out["wall_s"] = time.perf_counter() - t0
    return out


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.fmean(xs) if xs else math.nan


def run_seeds(args, run_one, describe) -> list[dict]:
    """``run_one(args, seed, root)`` for seeds 0 … ``args.seeds`` − 1 under ``args.out`` (else a
    temporary directory, removed after), printing ``describe(result)`` after each seed."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out) if args.out else Path(tmp)
        results = []
        for seed in range(args.seeds):
            results.append(run_one(args, seed, root))
            print(f"seed {seed}{describe(results[-1])}", flush=True)
    return results


def sweep_main(args) -> None:
    t0 = time.perf_counter()
    results = run_seeds(args, sweep_seed,
                        lambda r: f": {r['wall_s']:.0f} s (teacher {r['teacher_train_s']:.0f} s)")
    cands = [r[0] for r in SWEEP if r[0] != "alone"] + ([r[0] for r in SWEEP_HIER] if args.hier
                                                        else [])
    cells = {}
    for c in results[0]["cells"]:
        best, own = select_on_valid(results, c, cands)  # valid only
        cells[c] = {**grade_cell(results, c, best), "chosen_per_seed": own,  # test, once
                    "gains_valid": valid_gains(results, c, cands)}
        # reported next to direct, whatever was chosen: the VM via the FM, and the FM itself
        if args.hier:
            cells[c]["r_hier"] = _mean([r["cells"][c]["test"][SWEEP_HIER[0][0]]["r"]
                                        for r in results])
            cells[c]["r_domain_fm"] = _mean([r["cells"][c]["test"][SWEEP_FM[0]]["r"]
                                             for r in results])
    head = headline(cells)
    print(f"\nsweep: {args.preset} × {args.users} users, FM ({args.teacher}) continuous over "
          f"days 0-{args.days + max(args.data) - 1}, students ({args.student}, {SWEEP_DOMAIN}); "
          f"lags {args.lags}, data {args.data} days, {args.seeds} seeds; "
          f"{time.perf_counter() - t0:.0f} s")
    print(f"{'cell':<26}{'R(KD)':>14}{'R(best)':>14}{'ratio':>7}  "
          f"{'R_AUC(best)':>11}{'adapter ΔR':>11}"
          f"{'gain(KD)':>10}{'gain(best)':>11}  chosen on valid")
    for c, v in cells.items():
        print(f"{c:<26}{v['r_kd']:>8.3f} "
              f"±{v['r_kd_std']:.2f}{v['r_best']:>8.3f} ±{v['r_best_std']:.2f}"
              f"{v['ratio']:>7.2f}  {v['r_auc_best']:>11.3f}{v['r_adapter_gain']:>11.3f}"
              f"{v['gain_kd']:>10.4f}{v['gain_best']:>11.4f}  {v['best']}"
              + (f"  (hier VM {v['r_hier']:.3f}, domain FM {v['r_domain_fm']:.3f})" if "r_hier" in v
                 else ""))
    print(f"ratio R(best)/R(KD): stale cells (R(KD) <= 0.5) "
          f"{head['ratio_best_vs_kd_stale']:.2f}, mismatched "
          f"{head['ratio_best_vs_kd_mismatched']:.2f}, all "
          f"{head['ratio_best_vs_kd_all']:.2f}; gain(best)/gain(KD) "
          f"over the {head['gain_ratio_cells']} cells where KD gains beyond its spread: "
          f"{head['gain_ratio_best_vs_kd_all']:.2f}")
    per_pass = {p: {k: statistics.fmean(r["passes"][p][k] for r in results)
                    for k in ("teacher_s_per_student_row", "teacher_rows_per_student_row",
                              "teacher_warmup_rows_per_student_row", "wall_s", "student_rows")}
                for p in results[0]["passes"]}
    # the same snapshots on every seed: the days' tables and who computed them
    for p, v in per_pass.items():
        v["rep_table_snapshot_last_day"] = results[0]["passes"][p]["rep_table_snapshot_last_day"]
    votes = collections.Counter(v["best"] for v in cells.values())
    r_kd = statistics.fmean(v["r_kd"] for v in cells.values() if not math.isnan(v["r_kd"]))
    r_best = statistics.fmean(v["r_best"] for v in cells.values() if not math.isnan(v["r_best"]))
    settings = {k: getattr(args, k)
                for k in ("preset", "users", "days", "data", "lags", "drift", "teacher", "student",
                                              "fm", "hier", "seeds", "overrides",
                          "teacher_overrides")}
    print(json.dumps({"cells": {c: {k: v[k]
                                    for k in ("r_kd", "r_best", "ratio", "best", "r_kd_std",
                                              "r_best_std",
                                                      "r_auc_kd", "r_auc_best", "r_adapter_gain",
                                              "calibration_best",
                                                      "ne_reference", "ne_alone", "ne_kd",
                                              "ne_best",
                                                      "gain_kd", "gain_kd_std", "gain_best",
                                              "gain_best_std",
                                                      "gain_ratio", "gains", "gains_valid",
                                              "chosen_per_seed",
                                                      "r_hier", "r_domain_fm") if k in v}
                                for c, v in cells.items()},
                      **head, "r_kd": r_kd, "r_best": r_best, "best": votes.most_common(1)[0][0],
                      "ratio_best_vs_kd": head["ratio_best_vs_kd_all"],
                      "teacher": {"ne": statistics.fmean(
                          v["ne_reference"] for c, v in cells.items() if c.endswith("/matched"))},
                      "candidates": cands, "passes": per_pass, "settings": settings,
                      "wall_s": time.perf_counter() - t0}, default=str))
