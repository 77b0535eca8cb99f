"""What a better model is worth in an auction: GEM against DLRM-DCN in expected clicks, conversions
and cost per conversion, at equal impressions, on held-out worlds whose truth is known.

    python benchmarks/outcomes.py --quick     one held-out world at 6,000 users, 2 training seeds (< 5 min)
    python benchmarks/outcomes.py             held-out worlds 2200-2202 at the demo's size, 2 seeds each
    python benchmarks/outcomes.py --worlds 2200 --users 12000 --seeds 0 1 2 --requests 5000

Each model trains as ``make demo`` trains GEM (the demo recipe, one pass, recalibrated on
valid) at the race's learning rates of its family, ``race.race_rates`` (chosen on a
development world's valid day for both sides alike), so each is replayed as it would be served. The
replay (``opengem.world.replay``, the same as ``opengem outcomes``) samples ``--requests`` test requests,
K = 8 candidates each (the logged ad and 7 the world's targeting draws), S = 3 slots, and ranks by
bid × the model's probability of the campaign's objective.

Worlds: the outcome figures read their own block of held-out seeds (``discipline.
outcome_world_seeds``, 2200 on), each with its own structure, so no figure here reads the quality or
race seeds. Nothing is chosen here: the test split is read once per world and training seed.

Ends with ONE JSON line: per model, expected conversions and cost per conversion over DLRM-DCN's
and over the truth ranking's, mean ± std over training seeds (and over worlds in the full mode),
the share of each model's conversion shortfall that recalibrating against the truth wins back, and
the random ranking's conversions over the truth's (the floor).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from opengem.discipline import outcome_world_seeds  # noqa: E402

MODELS = ("gem", "dlrm_dcn")
BASELINE = "dlrm_dcn"
QUICK_USERS = 6000
METRICS = ("conversions", "cost_per_conversion", "clicks", "spend")


def world(work: Path, seed: int, users: int | None) -> Path:
    from opengem.world.generate import generate
    from opengem.world.presets import world_config

    out = work / f"world-{seed}"
    if not (out / "dataset.json").exists():
        sizes = [f"sizes.num_users={users}"] if users else []
        generate(world_config("demo", seed=seed, overrides=[f"structure_seed={seed}", *sizes]),
                 out, progress=False, layout="v2")
    return out


def trained(data: Path, run: Path, arch: str, seed: int) -> float:
    """One pass of ``arch`` at its race rates, recalibrated on valid; the training seconds."""
    from instruments.race import race_rates

    from opengem.config import apply_overrides
    from opengem.evaluation.evaluate import held_out_evaluator
    from opengem.evaluation.recalibrate import recalibrate_run
    from opengem.pipeline import DEMO_EVAL_EVERY_KTH_FILE
    from opengem.recipes import recipe
    from opengem.train.trainer import train

    cfg = apply_overrides(recipe("demo"), ["train.threads=1", "train.progress=false",
                                           f"model.arch={arch}", f"train.seed={seed}",
                                           *race_rates(data)[arch]])
    t = time.perf_counter()
    # the demo's periodic evaluation on valid (a curve only: the demo serves its last checkpoint)
    train(cfg, data, run, evaluator=held_out_evaluator(data, cfg.train.eval_split,
                                                       every_kth_file=DEMO_EVAL_EVERY_KTH_FILE))
    wall = time.perf_counter() - t
    recalibrate_run(run, data, "valid", progress=False)
    return wall


def one_world(work: Path, seed: int, users: int | None, train_seeds: list[int],
              requests: int) -> dict:
    from opengem.world.replay import format_outcomes, replay, run_scorers

    data = world(work, seed, users)
    out: dict = {"world": seed, "seeds": {}}
    for s in train_seeds:
        runs = {arch: work / f"runs-{seed}" / f"{arch}-{s}" for arch in MODELS}
        walls = {arch: round(trained(data, run, arch, s), 1) for arch, run in runs.items()}
        scorers = run_scorers(list(runs.values()), data)
        named = dict(zip(MODELS, scorers.values()))
        r = replay(data, named, "test", requests, baseline=BASELINE, seed=0)
        print(f"[outcomes] world {seed}, training seed {s}:\n{format_outcomes(r)}", flush=True)
        out["seeds"][s] = {"train_s": walls, "totals": r["totals"], "vs_baseline":
                           r["vs_baseline"], "vs_truth": r["vs_truth"],
                           "calibration_share": r["calibration_share"],
                           "expected_ne": r["expected_ne"]}
    return out


def _ms(xs: list[float]) -> list[float]:
    xs = [x for x in xs if x is not None]
    if not xs:
        return [None, None]
    return [round(statistics.fmean(xs), 4), round(statistics.stdev(xs), 4) if len(xs) > 1 else 0.0]


def headline(worlds: list[dict]) -> dict:
    """Mean ± std over every (world, training seed) of each ratio."""
    per = [s for w in worlds for s in w["seeds"].values()]
    out: dict = {"worlds": [w["world"] for w in worlds], "runs": len(per), "models": {}}
    for m in MODELS:
        e = {}
        for metric in METRICS:
            e[f"{metric}_vs_{BASELINE}"] = _ms([s["vs_baseline"][m][metric]["ratio"] for s in per])
            e[f"{metric}_vs_truth"] = _ms([s["vs_truth"][m][metric]["ratio"] for s in per])
        e["conversions_interval_vs_dlrm_dcn"] = [[round(s["vs_baseline"][m]["conversions"][k], 4)
                                                  for k in ("lo", "hi")] for s in per]
        e["recalibration_wins_back"] = _ms([s["calibration_share"][m]["conversions"] for s in per])
        out["models"][m] = e
    out["random_conversions_vs_truth"] = _ms([s["vs_truth"]["random"]["conversions"]["ratio"]
                                               for s in per])
    out["base_rates_conversions_vs_truth"] = _ms(
        [s["vs_truth"]["base_rates"]["conversions"]["ratio"] for s in per])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one world at 6,000 users (< 5 min)")
    p.add_argument("--worlds", type=int, nargs="*", default=None,
                   help="held-out world seeds (default: 2200-2202; --quick 2200)")
    p.add_argument("--users", type=int, default=None, help="users per world (default: the demo's)")
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1], help="training seeds")
    p.add_argument("--requests", type=int, default=None,
                   help="test requests replayed (default 5,000; --quick 2,000)")
    p.add_argument("--work", default=None, help="keep worlds and runs here (default: a temp dir)")
    args = p.parse_args()
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")  # DCP's "single process" notice on every save and load
    torch.set_num_threads(1)
    worlds = args.worlds or outcome_world_seeds(1 if args.quick else 3)
    users = args.users or (QUICK_USERS if args.quick else None)
    requests = args.requests or (2000 if args.quick else 5000)
    with tempfile.TemporaryDirectory(prefix="outcomes-") as tmp:
        work = Path(args.work or tmp)
        t = time.perf_counter()
        per_world = [one_world(work, w, users, args.seeds, requests) for w in worlds]
        res = headline(per_world)
        res.update(mode="quick" if args.quick else "full", users=users or "demo",
                   requests=requests, wall_s=round(time.perf_counter() - t, 1))
        if args.work:
            (work / "outcomes.json").write_text(json.dumps({"headline": res, "worlds": per_world},
                                                           indent=1, default=str))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
