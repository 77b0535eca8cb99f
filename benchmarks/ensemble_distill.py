"""One model distilled from an ensemble of its own seeds (``train.soft_label_runs``), against the
same model trained on the labels, for GEM and its neural peers alike, at ``quality.py
--quick``'s size.

    python benchmarks/ensemble_distill.py --quick          # held-out worlds 1000-1002, GEM and DLRM (~5 min)
    python benchmarks/ensemble_distill.py                  # + DIN and DLRM-DCN
    python benchmarks/ensemble_distill.py --dev            # the choice: development worlds 0-4, valid only

Why: at 1,500 users a trained model's error is mostly variance, so the mean of several training
seeds' probabilities scores better than one run (docs/experiments.md, "Variance, and one model
distilled from an ensemble of its seeds"). ``--dev`` measures, on development worlds' valid splits
only, what one model trained on its ensemble's mean probability recovers of that, for K teachers and
label weights w (``train.soft_label_weight``); the default run reads held-out worlds' test splits,
once, with the choice fixed by ``--dev`` (K = 3, w = 1).

Each model trains at the point ``quality.py --quick`` chose for it on development worlds (the same
grid for every model; docs/results.md), with its EMA as there, up to 2 epochs with early stopping
and the best checkpoint on valid. Per world and model: K teachers (training seeds 100, 101, …), then
for each training seed s in {0, 1} the plain run and the run on the teachers' soft labels. Every
model gets the same K and w, its own seeds as teachers. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import quality  # benchmarks/quality.py: the worlds, one run at a point, the discipline's modes

from opengem.discipline import held_out_world_seeds, require_dev_world

# quality.py --quick's choices on development worlds 0 and 1 (docs/results.md): every neural
# model's synthetic point but DLRM-DCN's is (6e-3, 0.1).
POINTS = {"gem": (6e-3, 0.1), "dlrm": (6e-3, 0.1), "din": (6e-3, 0.1), "dlrm_dcn": (2e-3, 0.1)}
TEACHER_SEED0 = 100  # teachers' training seeds: never a student's
K, WEIGHT = 3, 1.0  # chosen with --dev (docs/experiments.md)


def trial(data: Path, run: Path, model: str, seed: int, score_test: bool, teachers=(),
          weight: float = WEIGHT):
    soft = [f"train.soft_label_runs={json.dumps([str(t) for t in teachers])}",
            f"train.soft_label_weight={weight}"] if teachers else []
    return quality.neural_trial(str(data), str(run), "tiny",
                                [*quality.NEURAL[model], f"train.seed={seed}",
                                f"data.seed={seed}", *soft], POINTS[model],
                                quality.QUICK.max_epochs, score_test)


def click(r: dict, key: str) -> float:
    return r["metrics"]["all/click"][key]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="GEM and DLRM only")
    ap.add_argument("--dev", action="store_true",
                    help="the choice of K and w on development worlds (valid only)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--work", default=None)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    work = Path(args.work or tempfile.mkdtemp(prefix="opengem-ensemble-"))
    models = ["gem", "dlrm"] if args.quick or args.dev else ["gem", "dlrm", "din", "dlrm_dcn"]
    if args.dev:
        worlds = [require_dev_world(w, "the ensemble's K and label weight") for w in range(5)]
        seeds, variants = [0, 1, 2, 3], [(1, 1.0), (3, 0.5), (3, 1.0)]
        models = ["gem"]
    else:
        worlds, seeds, variants = held_out_world_seeds(3), [0, 1], [(K, WEIGHT)]
    data = {w: quality.synthetic_world(work, w, quality.QUICK) for w in worlds}
    kmax = max(k for k, _ in variants)
    run = {}
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        first = {}
        for m in models:
            for w in worlds:
                for t in range(kmax):
                    first[(m, w, "teacher", t)] = pool.submit(
                        trial,
                        data[w],
                        work / m / f"w{w}" / f"teacher{t}",
                        m,
                        TEACHER_SEED0 + t,
                        False,
                    )
                for s in seeds:
                    first[(m, w, "plain", s)] = pool.submit(trial, data[w],
                                                            work / m / f"w{w}" / f"plain{s}", m, s,
                                                            not args.dev)
        run.update({k: f.result() for k, f in first.items()})
        second = {}
        for m in models:
            for w in worlds:
                for k, wt in variants:
                    teachers = [work / m / f"w{w}" / f"teacher{t}" for t in range(k)]
                    for s in seeds:
                        second[(m, w, f"k{k}-w{wt:g}", s)] = pool.submit(
                            trial, data[w], work / m / f"w{w}" / f"k{k}-w{wt:g}-s{s}", m, s,
                            not args.dev, teachers, wt)
        run.update({k: f.result() for k, f in second.items()})
    out = (
        dev_report(run, worlds, seeds, variants)
        if args.dev
        else test_report(run, models, worlds, seeds)
    )
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))


def dev_report(run: dict, worlds, seeds, variants) -> dict:
    """Valid click NE of each variant minus the plain run's, paired by world and seed."""
    out = {"split": "valid", "dev_world_seeds": worlds, "train_seeds": seeds}
    for k, wt in variants:
        d = [run[("gem", w, f"k{k}-w{wt:g}", s)]["valid_value"]
             - run[("gem", w, "plain", s)]["valid_value"]
             for w in worlds for s in seeds]
        out[f"k{k}-w{wt:g}"] = {"delta_valid_click_ne": [round(statistics.fmean(d), 5),
                                                         round(statistics.stdev(d), 5)],
                                "better": f"{sum(x < 0 for x in d)}/{len(d)}"}
        print(f"K={k} w={wt:g}: valid click NE {statistics.fmean(d):+.4f} "
              f"± {statistics.stdev(d):.4f}, "
              f"better on {sum(x < 0 for x in d)}/{len(d)}", flush=True)
    return out


def test_report(run: dict, models, worlds, seeds) -> dict:
    """Test click figures (raw, best-on-valid checkpoint) per model, world and form, mean
    over seeds."""
    tag = f"k{K}-w{WEIGHT:g}"
    out: dict = {"split": "test", "held_out_world_seeds": worlds, "train_seeds": seeds, "k": K,
                 "weight": WEIGHT, "points": {m: POINTS[m] for m in models}, "worlds": {}}
    for w in worlds:
        row = {}
        for m in models:
            for form in ("plain", tag):
                rs = [run[(m, w, form, s)] for s in seeds]
                row[f"{m}/{'plain' if form == 'plain' else 'distilled'}"] = {
                    k: round(statistics.fmean(click(r, k) for r in rs), 5)
                    for k in ("auc", "ne", "captured_over_oracle")}
        out["worlds"][str(w)] = row
        print(w, json.dumps(row), flush=True)
    for name in out["worlds"][str(worlds[0])]:
        ratios = [out["worlds"][str(w)][name]["captured_over_oracle"] for w in worlds]
        out[f"{name}_over_oracle"] = {"mean": round(statistics.fmean(ratios), 5),
                                      "std": round(statistics.stdev(ratios), 5),
                                      "min": round(min(ratios), 5)}
    peers = [m for m in models if m != "gem"]
    out["distilled_gem_beats_every_peer"] = {
        str(w): all(
            out["worlds"][str(w)]["gem/distilled"]["auc"] > out["worlds"][str(w)][f"{p}/{f}"]["auc"]
            and out["worlds"][str(w)]["gem/distilled"]["ne"]
            < out["worlds"][str(w)][f"{p}/{f}"]["ne"]
            for p in peers
            for f in ("plain", "distilled")
        )
        for w in worlds
    }
    return out


if __name__ == "__main__":
    main()
