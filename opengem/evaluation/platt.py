"""Platt scaling per task, fitted on a held-out split: ``p' = σ(a_t · logit(p_t) + c_t)``.

Legend: R rows, T tasks.

What it is for: comparing models *recalibrated alike*. A model that ranks well but whose logits are
too spread (a few hundred clicks on valid, as at ``quality.py --quick``'s size) loses NE that two
numbers fitted on held-out days give back; a comparison of NE across models then measures partly
how well each was calibrated by chance. ``benchmarks/quality.py`` therefore reports, beside the raw
figures, each model's test metrics after a Platt fit on its own valid split, and the oracle's after
the same fit on its valid split (``evaluation.oracle``), so no side gets a correction the
other lacks.

Choices where the record is silent: one (a, c) per task over all domains (not per domain: a slice
of ~150 clicks would fit noise), on the task's *final* probability (for a chained task p(task), not
the conditional: the same form for models with and without an ESMM chain, GBDT included), by
maximum likelihood (Newton, no prior: two numbers from thousands of rows) with the slope kept ≥ 0,
so a fit never reverses a model's ranking. The pipeline's own
recalibration (``evaluation.recalibrate``) stays an offset per (domain, task) folded into each
model's output biases (GEM's heads', a peer's ``out_b``), for GEM and the peers alike.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from opengem.discipline import require_tuning_split
from opengem.evaluation.metrics import logistic_fit, separated

# probabilities are clipped to [EPS, 1 - EPS] before the logit: a saturated score stays finite
EPS = 1e-7


def fit_platt(z: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(a, c) minimising the mean log loss of ``σ(a z + c)`` against ``y``
    (``metrics.logistic_fit``), with a ≥ 0: where the best fit would reverse the model's ranking (a
    < 0, or the scores separate the labels the wrong way round: a model with no signal on a small
    split) or the scores are constant, the slope is held at 0 and c is the split's rate. Where the
    scores separate the labels (no finite fit: a few positives, all on top) the scores are kept as
    they are, (1, 0)."""
    z, y = torch.as_tensor(z).double().numpy(), torch.as_tensor(y).double().numpy()
    if z.size == 0 or not bool(((y >= 0) & (y <= 1)).all()):
        raise ValueError(f"a Platt fit needs rows with labels in [0, 1] (got {z.size} rows)")
    a, c = logistic_fit(z, y)
    if math.isnan(a) and 0 < y.mean() < 1 and separated(z, y) > 0:
        return 1.0, 0.0
    if math.isnan(a) or a < 0:
        rate = float(np.clip(y.mean(), EPS, 1 - EPS))
        return 0.0, math.log(rate / (1 - rate))
    return a, c


def _logit(p: torch.Tensor) -> torch.Tensor:
    p = p.clamp(EPS, 1 - EPS)
    return torch.log(p) - torch.log1p(-p)


class TaskPlatt:
    """One (a, c) per task, or None for a task with no labelled rows of both classes on the
    fitting split."""

    def __init__(self, params: list[tuple[float, float] | None]):
        self.params = params

    @classmethod
    def fit(cls, probs_RT, labels_RT, mask_RT=None) -> TaskPlatt:
        """Fit each task on its labelled rows (``mask``; all rows when None)."""
        p, y = (
            torch.as_tensor(np.asarray(probs_RT)).double(),
            torch.as_tensor(np.asarray(labels_RT)).double(),
        )
        m = (
            torch.ones_like(p, dtype=torch.bool)
            if mask_RT is None
            else torch.as_tensor(np.asarray(mask_RT)).bool()
        )
        params: list[tuple[float, float] | None] = []
        for t in range(p.shape[1]):
            yt = y[m[:, t], t]
            both = yt.numel() > 0 and 0 < float(yt.sum()) < yt.numel()
            params.append(fit_platt(_logit(p[m[:, t], t]), yt) if both else None)
        return cls(params)

    def __call__(self, probs_RT):
        """The recalibrated probabilities, the input's type (numpy or torch) and shape kept."""
        is_np = isinstance(probs_RT, np.ndarray)
        p = torch.as_tensor(probs_RT).double().clone()
        for t, ac in enumerate(self.params):
            if ac is not None:
                p[:, t] = torch.sigmoid(ac[0] * _logit(p[:, t]) + ac[1])
        return p.numpy() if is_np else p

    def as_dict(self, tasks: list[str]) -> dict:
        return {t: None if ac is None else {"a": round(ac[0], 6), "c": round(ac[1], 6)}
                for t, ac in zip(tasks, self.params)}


def evaluate_recalibrated(run_dir: str | Path, data_dir: str | Path, split: str = "test",
                          fit_split: str = "valid",
                          best: bool = True, progress: bool = False) -> dict:
    """A run's metrics on ``split`` as ``evaluate_run`` gives them (``metrics``) and after a
    per-task Platt fit on ``fit_split`` (``metrics_platt``; the oracle's figures there are its own
    Platt-fitted ones), with the fitted ``platt`` parameters. ``split`` is scored once, for both."""
    from opengem.evaluation.evaluate import add_oracle, metrics_of, score_rows
    from opengem.features.schema import FeatureSchema, SchemaError
    from opengem.run import load_base_rates, load_run_model

    require_tuning_split(fit_split, "the Platt scaling's (a, c)")
    model, _, schema = load_run_model(run_dir, best=best)
    if FeatureSchema.load(data_dir).fingerprint() != schema.fingerprint():
        raise SchemaError(f"{data_dir}: its schema differs from the one run {run_dir} was "
                          f"trained on")
    rates = load_base_rates(run_dir)
    fit_rows = score_rows(model, schema, data_dir, fit_split, progress=progress)
    platt = TaskPlatt.fit(fit_rows["probs"], fit_rows["labels"], fit_rows["mask"])
    rows = score_rows(model, schema, data_dir, split, progress=progress)
    raw = add_oracle(metrics_of(rows, schema, rates), data_dir, split)
    fitted = add_oracle(metrics_of(rows, schema, rates, platt(rows["probs"])), data_dir, split,
                        platt=True)
    return {"metrics": raw, "metrics_platt": fitted, "platt": platt.as_dict(schema.task_names)}


def crossfit(run_dir: str | Path, data_dir: str | Path, split: str = "valid",
             best: bool = True) -> dict:
    """Whether a Platt fit carries to rows it was not fitted on, read on ``split`` alone: its rows
    are halved by user (even / odd id), the fit on each half scores the other, and each task's
    all-domain NE is reported raw and fitted (row-weighted over the halves). ``quality.py`` reads it
    on development worlds, to decide whether recalibrated figures are the ones to adopt."""
    from opengem.evaluation.evaluate import metrics_of, score_rows
    from opengem.run import load_base_rates, load_run_model

    require_tuning_split(split, "the cross-fitted Platt check")
    model, _, schema = load_run_model(run_dir, best=best)
    rows, rates = score_rows(model, schema, data_dir, split), load_base_rates(run_dir)
    half = rows["user_id"] % 2 == 0
    out: dict = {t: {"ne": 0.0, "ne_platt": 0.0, "rows": 0} for t in schema.task_names}
    for fit_on in (half, ~half):
        platt = TaskPlatt.fit(rows["probs"][fit_on], rows["labels"][fit_on], rows["mask"][fit_on])
        other = {k: None if v is None else v[~fit_on] for k, v in rows.items()}
        raw, fitted = metrics_of(other, schema,
                                 rates), metrics_of(other, schema, rates, platt(other["probs"]))
        for t in schema.task_names:
            n = int(other["mask"][:, schema.task_names.index(t)].sum())
            out[t]["ne"] += n * raw[f"all/{t}"]["ne"]
            out[t]["ne_platt"] += n * fitted[f"all/{t}"]["ne"]
            out[t]["rows"] += n
    return {t: {"ne": v["ne"] / v["rows"], "ne_platt": v["ne_platt"] / v["rows"]} for t,
            v in out.items() if v["rows"]}
