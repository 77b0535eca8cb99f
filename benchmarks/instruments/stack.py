"""A trained run stacked with the logistic regression: w·p(run) + (1 − w)·p(regression), w chosen
on valid.

Legend: n rows of a split, T tasks.

    run (best checkpoint) ─► evaluate.score_rows ─► p_run [n, T] ─┐
    bench.linear.fit_data (L2 on valid) ────────► p_lr  [n, T] ─┴─► w · p_run + (1 − w) · p_lr

Why: on little data a deep model and a convex one err differently, so their blend can beat both
(docs/results.md; docs/experiments.md, 'Figures moved from code docstrings'). This is the classic
wide-and-deep pairing (Cheng et al. 2016) done in two stages, each part fitted its own way: the
regression convex with its own L2, the run as trained. Where the record is silent (GEM's papers name
no linear part) this is a choice, made per dataset on valid.

The weight: probabilities, not logits, are averaged (chosen on development worlds' valid splits:
docs/experiments.md, "The stack's form: probabilities or logits"); one
weight for every task and domain, the one of ``WEIGHTS`` with the lowest valid NE of the choice task
(the first task that requires no other), ties going to the larger weight on the run. Chained tasks'
probabilities are joint (p(click) · p(conv | click)) on both sides, so their average is too. Serving
the stack is not built: ``opengem export`` exports the run alone.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from instruments.gbdt import choice_task
from instruments.linear import fit_data
from instruments.tune import choose
from opengem.checkpoint import best_checkpoint
from opengem.discipline import REPORT_SPLIT, require_tuning_split
from opengem.evaluation.evaluate import metrics_of, score_rows
from opengem.evaluation.platt import TaskPlatt
from opengem.features.schema import FeatureSchema, SchemaError
from opengem.run import load_base_rates, load_run_model

# The run's share: 1 first, so a tie keeps the run alone.
WEIGHTS = (1.0, 0.75, 0.5, 0.25, 0.0)


def blend(p_run, p_lr, w: float):
    """w · p_run + (1 − w) · p_lr, elementwise (any array type that scales and adds)."""
    return w * p_run + (1.0 - w) * p_lr


def run_stack(data_dir: str | Path, runs: Sequence[str | Path], tune_split: str = "valid",
              max_seq_len: dict[str, int] | None = None,
              weights: Sequence[float] = WEIGHTS) -> list[dict]:
    """Each of ``runs`` (trained on ``data_dir``'s train split) stacked with one regression fitted
    on it, its weight chosen on ``tune_split``, test read once. One result a run, as
    ``linear.run_linear`` gives:
    {"metrics", "metrics_platt", "platt", "valid", "chosen": {"w"}, "trials": [{"w": {w: valid
    NE}}], "wall_s"}.
    """
    t0 = time.perf_counter()
    require_tuning_split(tune_split, "the stack's weight")
    if not weights or any(not 0.0 <= w <= 1.0 for w in weights):
        raise ValueError(f"the stack's weights must be a non-empty list in [0, 1], "
                         f"got {list(weights)}")
    schema = FeatureSchema.load(data_dir)
    models = []
    for run in runs:  # every run checked before the regression's fit
        model, _, run_schema = load_run_model(run, best=best_checkpoint(run) is not None)
        if run_schema.fingerprint() != schema.fingerprint():
            raise SchemaError(f"run {run} was trained on another schema than {data_dir}'s")
        models.append(model)
    lr = fit_data(data_dir, tune_split, max_seq_len)
    c = choice_task(schema)
    out = []
    for run, model in zip(runs, models):
        rates = load_base_rates(run)
        scored = {}
        for split in (tune_split, REPORT_SPLIT):
            rows = score_rows(model, schema, data_dir, split)
            if not np.array_equal(rows["labels"].numpy(), lr.rows[split].labels, equal_nan=True):
                raise ValueError(f"{data_dir} {split}: the run's rows and the regression's are not "
                                 f"in the same order")
            scored[split] = (rows, rows["probs"].numpy(), lr.probs[split])
        rows, p_run, p_lr = scored[tune_split]
        ne = {w: metrics_of(rows, schema, rates,
                            blend(p_run, p_lr, w))[f"all/{schema.task_names[c]}"]["ne"]
              for w in weights}
        w = choose({w: [v] for w, v in ne.items()})
        valid = blend(p_run, p_lr, w)
        platt = TaskPlatt.fit(valid, rows["labels"].numpy(), rows["mask"].numpy())
        test_rows, t_run, t_lr = scored[REPORT_SPLIT]
        test = blend(t_run, t_lr, w)
        out.append({"metrics": metrics_of(test_rows, schema, rates, test),
                    "metrics_platt": metrics_of(test_rows, schema, rates, platt(test)),
                    "platt": platt.as_dict(schema.task_names),
                    "valid": metrics_of(rows, schema, rates, valid),
                    "chosen": {"w": w}, "trials": [{"w": {str(k): v for k, v in ne.items()}}],
                    "run": str(run), "wall_s": round(time.perf_counter() - t0, 3)})
    return out
