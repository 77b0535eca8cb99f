"""Negative down-sampling (``data.negative_rate``) at rates 1, 0.5, 0.1: training speed, and valid
NE and calibration with and without the correction (logit + log r on
click, ``opengem.model.logit_shift.downsampling_offsets``).

    python benchmarks/downsampling.py --quick     # world seed 0, training seeds 0-1 (~2.5 min on 2 cores)
    python benchmarks/downsampling.py             # world seeds 0-2, training seeds 0-2

The ``tiny`` recipe on a ``tiny`` development world (seeds < 100) widened to ``--users`` users, at
each rate on the same data, two budgets, scored on the valid day only (never test):

- ``equal_epochs``: ``--epochs`` passes over the split; a lower rate trains fewer steps (and, with
  the recipe's 50 warm-up steps, at a lower lr: at r = 0.1 the run ends inside its warm-up);
- ``equal_steps``: as many steps as rate 1 took, the passes raised to ⌈epochs / r⌉ (each pass draws
  other negatives, the positives repeat): what down-sampling buys for the same compute.

- ``rows_read_per_s``: rows of the training split the loader went through per second of training
  (the files' rows × epochs / train_s), ``rows_trained_per_s``: rows the steps trained on per second
  (final.json ``examples_per_s``). Down-sampling reads every row and trains on the kept ones.
- ``ne`` / ``calibration`` (Σp/Σy) of all/click and all/conversion on valid, ``corrected`` (what
  every stage reads: ``load_run_model``) and ``raw`` (``corrected=False``: the model as trained). NE
  is normalised by the true training base rate in both.

Prints a line per run, a table of the means, and last ONE JSON line.

The correction matters because a model trained on a fraction r of the negatives over-predicts by
about 1/r; what it measured: docs/experiments.md, 'Figures moved from code docstrings'.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from opengem.config import apply_overrides
from opengem.discipline import require_dev_world, require_tuning_split
from opengem.evaluation.evaluate import evaluate_model
from opengem.recipes import recipe
from opengem.run import load_base_rates, load_run_model
from opengem.train.trainer import train
from opengem.world.generate import generate
from opengem.world.presets import world_config

RATES = (1.0, 0.5, 0.1)
SPLIT = "valid"
TASKS = ("click", "conversion")


def score(run: Path, data: Path, corrected: bool) -> dict:
    model, _, schema = load_run_model(run, recalibrated=False, corrected=corrected)
    m = evaluate_model(model, schema, data, SPLIT, load_base_rates(run), progress=False)["metrics"]
    return {t: {k: round(m[f"all/{t}"][k], 5) for k in ("ne", "calibration")} for t in TASKS}


def one_run(data: Path, out: Path, rate: float, seed: int, epochs: int, max_steps: int = 0) -> dict:
    cfg = apply_overrides(recipe("tiny"), [f"data.negative_rate={rate}", f"train.epochs={epochs}",
                                           f"train.seed={seed}", f"data.seed={seed}",
                                           "train.threads=1", "train.progress=false",
                                           "data.prefetch=0", f"train.max_steps={max_steps}"])
    final = train(cfg, data, out)
    train_s = final["wall_s"]
    sampled = final.get("downsampling")
    # rows the loader went through: the files' rows per pass, pro rata to the kept rows trained on
    read = final["examples"] * (sampled["rows_read_per_epoch"]
                                / statistics.fmean(sampled["rows_kept_per_epoch"])
                                if sampled else 1.0)
    return {"rate": rate, "seed": seed, "steps": final["steps"], "rows_trained": final["examples"],
            "rows_read_per_s": round(read / train_s, 1),
            "rows_trained_per_s": round(final["examples_per_s"], 1), "train_s": round(train_s, 2),
            "corrected": score(out, data, True), "raw": score(out, data, False)}


def mean_of(runs: list[dict], path: tuple) -> float:
    vals = []
    for r in runs:
        v = r
        for k in path:
            v = v[k]
        vals.append(v)
    return round(statistics.fmean(vals), 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--users", type=int, default=1500)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--out", default=None,
                    help="keep the worlds and runs here (default: a temporary directory)")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    require_tuning_split(SPLIT, "the down-sampling rate")
    worlds, seeds = ((0,), (0, 1)) if args.quick else ((0, 1, 2), (0, 1, 2))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        runs = []
        for w in worlds:
            data = root / f"w{require_dev_world(w, 'the down-sampling rate')}"
            if not (data / "dataset.json").exists():
                generate(world_config("tiny", seed=w, overrides=[f"sizes.num_users={args.users}"]),
                         data, progress=False)
            for s in seeds:
                steps = None
                for budget in ("equal_epochs", "equal_steps"):
                    for rate in RATES:
                        if budget == "equal_steps" and rate == 1.0:
                            r = dict(next(x for x in runs if x["world"] == w and x["seed"] == s
                                          and x["rate"] == 1))
                        else:
                            epochs = (
                                args.epochs
                                if budget == "equal_epochs"
                                else math.ceil(args.epochs / rate)
                            )
                            r = one_run(data, root / f"w{w}-s{s}-r{rate:g}-{budget}", rate, s,
                                        epochs, steps if budget == "equal_steps" else 0)
                        steps = steps or r["steps"]
                        r |= {"world": w, "budget": budget}
                        print(json.dumps(r), flush=True)
                        runs.append(r)
    out = {budget: table([r for r in runs if r["budget"] == budget])
           for budget in ("equal_epochs", "equal_steps")}
    for budget, by_rate in out.items():
        print(f"\n{budget}")
        print_table(by_rate)
    eq = out["equal_epochs"]
    headline = {"benchmark": "downsampling", "quick": args.quick, "worlds": list(worlds),
                "training_seeds": list(seeds),
                "users": args.users, "epochs": args.epochs, "split": SPLIT, **out,
                "read_speedup_at_0.1": round(eq["0.1"]["rows_read_per_s"]
                                             / eq["1"]["rows_read_per_s"], 3),
                "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(headline))


def table(runs: list[dict]) -> dict:
    by_rate = {}
    for rate in RATES:
        rs = [r for r in runs if r["rate"] == rate]
        by_rate[f"{rate:g}"] = {
            "rows_read_per_s": mean_of(rs, ("rows_read_per_s",)),
            "rows_trained_per_s": mean_of(rs, ("rows_trained_per_s",)),
            "rows_trained": mean_of(rs, ("rows_trained",)), "steps": mean_of(rs, ("steps",)),
            **{f"{kind}_{t}_{m}": mean_of(rs, (kind, t, m)) for kind in ("corrected", "raw")
               for t in TASKS for m in ("ne", "calibration")}}
    return by_rate


def print_table(by_rate: dict) -> None:
    print(f"\n{'rate':>5} {'read/s':>8} {'trained/s':>9} {'click NE':>9} {'cal':>6} {'raw NE':>7} "
          f"{'raw cal':>7} {'conv NE':>8} {'cal':>6} {'raw cal':>7}")
    for rate, m in by_rate.items():
        print(f"{rate:>5} {m['rows_read_per_s']:>8.0f} {m['rows_trained_per_s']:>9.0f} "
              f"{m['corrected_click_ne']:>9.4f} "
              f"{m['corrected_click_calibration']:>6.3f} {m['raw_click_ne']:>7.4f} "
              f"{m['raw_click_calibration']:>7.3f} {m['corrected_conversion_ne']:>8.4f} "
              f"{m['corrected_conversion_calibration']:>6.3f} "
              f"{m['raw_conversion_calibration']:>7.3f}")


if __name__ == "__main__":
    main()
