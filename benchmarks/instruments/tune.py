"""One search for every model: a learning-rate grid, each point trained with held-out evaluations on
valid, early stopping and the best checkpoint; the point with the best valid metric is chosen.

A comparison is fair when every model gets the same search budget on the same split, so this is
the one path the benchmarks tune through (GEM, the TorchRec peers, DIN alike):

    trial = train_point(recipe("tiny"), data, run, (3e-3, 0.1))     # valid only, early stopping
    chosen = choose({point: [trial.value, …] for point in grid}, higher_is_better=False)
    evaluate_run(run_of_chosen, data, "test", best=True)           # the one read of test

Nothing here reads the test split (``discipline.require_tuning_split``). The number of epochs is
the early stopping's: a trial runs up to ``max_epochs`` passes with one evaluation after each, stops
after ``patience`` evaluations without a better one, and keeps the best (``train.keep_best``). Its
cosine schedule spans ``max_epochs``, so a model that peaks after one pass is scored at the lr it
had then, not annealed: the cost of choosing the epochs on valid with one run instead of one
per count.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from opengem.config import Config, apply_overrides
from opengem.discipline import require_tuning_split
from opengem.run import METRICS_FILE

# (dense AdamW lr, tables' row-wise Adagrad lr): the recipes' defaults sit inside (tiny 3e-3 / 0.1,
# demo 3e-3 / 0.3), a factor ~3 apart, the spacing the race's hand grids used.
DENSE_LRS = (1e-3, 3e-3, 1e-2)
TABLE_LRS = (0.03, 0.1, 0.3)
Point = tuple[float, float]


def lr_grid(dense: Sequence[float] = DENSE_LRS, tables: Sequence[float] = TABLE_LRS) -> list[Point]:
    """Every (dense lr, table lr) pair: the same grid for every model in a comparison."""
    return list(itertools.product(dense, tables))


def search_overrides(split: str = "valid", max_epochs: int = 1, patience: int = 1,
                     metric: str = "all/click:ne") -> list[str]:
    """The ``train.*`` keys of one trial: evaluate on ``split`` before training and after each
    epoch, stop early, keep the best. The untrained model (heads at the training base rates) is a
    candidate, so a model that learns nothing on valid falls back to the base rate rather than to
    noise, alike for every model in a comparison."""
    require_tuning_split(split, "the learning-rate search")
    return [f"train.eval_split={split}", "train.eval_at=[0]", "train.eval_each_epoch=true",
            "train.keep_best=true", f"train.epochs={max_epochs}",
            f"train.early_stop_patience={patience}", f"train.eval_metric={metric}"]


@dataclass
class Trial:
    """One grid point's run: its best held-out value of ``metric``, at which step, that
    evaluation's metrics."""

    point: Point
    value: float
    step: int
    valid: dict
    run: str
    wall_s: float


def best_evaluation(run: str | Path) -> tuple[float, int, dict]:
    """(best value, its step, that evaluation's metrics per slice) from a
    run's ``metrics.jsonl``."""
    evals = [r for r in map(json.loads, (Path(run) / METRICS_FILE).read_text().splitlines())
             if "eval" in r]
    if not evals:
        raise ValueError(f"{run}: no held-out evaluation in {METRICS_FILE} (were train.eval_* "
                         f"keys set?)")
    last = evals[-1]["eval_metric"]
    at = {r["step"]: r for r in evals}[last["best_step"]]
    return last["best"], last["best_step"], at["eval"]


def train_point(cfg: Config, data: str | Path, run: str | Path, point: Point, split: str = "valid",
                max_epochs: int = 1, patience: int = 1, metric: str = "all/click:ne") -> Trial:
    """Train ``cfg`` at ``point`` (dense lr, table lr) with held-out evaluations on ``split``."""
    from opengem.evaluation.evaluate import held_out_evaluator
    from opengem.train.trainer import train

    lr, sparse_lr = point
    cfg = apply_overrides(cfg, [f"optim.lr={lr}", f"optim.sparse_lr={sparse_lr}",
                                *search_overrides(split, max_epochs, patience, metric)])
    t0 = time.perf_counter()
    train(cfg, data, run, evaluator=held_out_evaluator(data, split))
    value, step, valid = best_evaluation(run)
    return Trial(tuple(point), value, step, valid, str(run), time.perf_counter() - t0)


def choose(values: Mapping[Point, Sequence[float]], higher_is_better: bool = False) -> Point:
    """The point whose mean value (over worlds or seeds) is best; ties go to the earlier point, and
    a point with a non-finite value (a diverged run) is never chosen over a finite one."""
    worst = -math.inf if higher_is_better else math.inf
    mean = {p: (m if math.isfinite(m := sum(v) / len(v)) else worst) for p,
            v in values.items() if v}
    if not mean:
        raise ValueError("nothing to choose from: the grid is empty")
    return (max if higher_is_better else min)(mean, key=mean.__getitem__)
