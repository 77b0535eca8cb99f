"""Recalibration: a logit offset per (domain, task) (``platt``: also a slope per task) from
held-out days, for every model the trainer trains (GEM, its students' backbones, the peers: any
``opengem.model.logit_shift.LogitOutput``).

Legend: R rows of the fitting split, T tasks, G output groups (domains, or 1 with shared heads).

A model trained by log loss is calibrated on average over its training rows, but where it stops
depends on its last steps (training seeds of one recipe end with visibly different calibration).
Production ads systems correct this with a calibration layer fitted on the freshest held-out labels
(He et al. 2014 fit one on top of the model). Ours is the smallest such layer: δ_{g,t} added to each
task's own logit before chaining,

    δ_t = argmin_δ Σ_r ω_r m_rt BCE(chain(raw_r + δ_{g_r})_t, y_rt) + ½ Σ_g δ_gt² / σ²

task by task in schema order (a chained task is fitted with its parent's offsets in place). The
prior σ (``prior_std``, 0.1, about the spread of the offsets across training seeds) keeps a slice
with few labels near 0, where a loose prior fits noise. The offsets are written to
``RUN/recalibration.json``; ``opengem.run.load_run_model`` adds them to the output biases ``out_b``
(GEM's heads', a peer's own), so evaluation, export, serving and teachers all read the recalibrated
model, and the checkpoint itself is never changed. The fitting split must not be the evaluation
split: ``valid`` (the days between train and test). What it did on the demo world is in
docs/experiments.md.

``form="platt"`` (``opengem recalibrate --form platt``) adds one slope per task: each task's own
logit becomes a_t (raw − m_t) + m_t + δ_{g,t}, m_t its mean on the split. An offset cannot shrink
logits that are too spread (a model that ranks well but saw few positives; ``evaluation.platt``
measures it across models). The slope is per task, not per (domain, task), because the weights it
is folded into are shared by the domains (GEM's FwFM shortcut, a peer's OverArch output layer;
``opengem.run.apply_recalibration``). The prior on δ is unchanged; a_t > 0 has none.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from opengem.data.loader import ShardLoader
from opengem.discipline import require_tuning_split
from opengem.evaluation import EVAL_BATCH
from opengem.evaluation.segments import MIN_ROWS, assign, row_key, segment_families
from opengem.features.schema import FeatureSchema
from opengem.model.logit_shift import RecalibrationError, gem_heads, offset_groups, own_logits
from opengem.progress import progress_bar
from opengem.run import load_run_model, save_recalibration

FORMS = ("offset", "platt")


@torch.no_grad()
def head_inputs(model: torch.nn.Module, schema: FeatureSchema, data_dir: str | Path, split: str,
                batch_size: int, progress: bool = True,
                keys: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Each row's raw (pre-chain) logits [R, T], output group [R], labels, label mask [R, T], weight
    and user id [R] on ``split`` (``own_logits``: any model with a ``LogitOutput``), and each
    segment key source of ``keys`` [R] (``opengem.evaluation.segments.row_key``)."""
    gem_heads(model)  # a model without one stops before the split is read
    loader = ShardLoader(data_dir, split, batch_size, schema, shuffle=False, epochs=1,
                         max_seq_len=model.max_seq_len(), prefetch=2)
    parts: dict[str, list[torch.Tensor]] = {k: []
                                            for k in ("raw", "group", "labels", "mask", "weights",
                                                      "user_id", *keys)}
    for batch in progress_bar(loader, desc=f"recalibrate on {split}", unit="batch",
                              disable=not progress):
        raw, group = own_logits(model, batch)
        parts["raw"].append(raw.double())
        parts["group"].append(group)
        parts["labels"].append(batch.labels.double())
        parts["mask"].append(batch.label_mask)
        parts["weights"].append(batch.weights.double())
        parts["user_id"].append(batch.user_id)
        for k in keys:
            parts[k].append(torch.from_numpy(row_key(batch, k)))
    if not parts["raw"]:
        raise RecalibrationError(f"{data_dir}: split {split!r} has no rows to fit the "
                                 f"recalibration on")
    return {k: torch.cat(v) for k, v in parts.items()}


def fit_offsets(heads, rows: dict[str, torch.Tensor], num_groups: int,
                prior_std: float = 0.1) -> torch.Tensor:
    """δ [G, T] (see the module docstring), by L-BFGS per task; a group without labels keeps 0."""
    return fit_recalibration(heads, rows, num_groups, prior_std, "offset")[1]


def fit_recalibration(heads, rows: dict[str, torch.Tensor], num_groups: int, prior_std: float = 0.1,
                      form: str = "offset") -> tuple[torch.Tensor, torch.Tensor]:
    """(slopes a [T], additions [G, T]): each task's own logit becomes ``a_t · raw + add_{g,t}``.
    ``offset``: a = 1, add = δ. ``platt``: add = (1 − a_t) m_t + δ_{g,t}, with m_t the task's mean
    raw logit on the split, so the prior on δ still means "near no change" whatever a_t is; a_t ≥ 0
    is fitted without a prior (one number per task from every labelled row of the split)."""
    if not prior_std > 0:
        raise RecalibrationError(f"prior_std must be > 0, got {prior_std}")
    if form not in FORMS:
        raise RecalibrationError(f"the recalibration form must be one of {FORMS}, got {form!r}")
    T = rows["raw"].shape[1]
    slopes, add = rows["raw"].new_ones(T), rows["raw"].new_zeros(num_groups, T)
    for t in range(T):
        w = rows["mask"][:, t].double() * rows["weights"]
        if w.sum() > 0:
            slopes[t], add[:, t] = _fit_task(heads, rows, w, slopes, add, t, prior_std,
                                             form == "platt")
    return slopes, add


def _fit_task(heads, rows: dict[str, torch.Tensor], w_R: torch.Tensor, slopes: torch.Tensor,
              add: torch.Tensor, t: int, prior_std: float,
              slope: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Task t's slope and additions [G], the other tasks' as in ``slopes`` and ``add``."""
    raw, group, y = rows["raw"], rows["group"], rows["labels"][:, t]
    m = (raw[:, t] * w_R).sum() / w_R.sum()
    d = torch.zeros(add.shape[0], dtype=raw.dtype, requires_grad=True)
    log_a = torch.zeros((), dtype=raw.dtype, requires_grad=slope)  # a = exp(log_a) stays > 0
    opt = torch.optim.LBFGS([d, log_a] if slope else [d], lr=1.0, max_iter=100,
                            tolerance_grad=1e-10, line_search_fn="strong_wolfe")

    def task_add():
        return (1 - log_a.exp()) * m + d

    def closure():
        opt.zero_grad()
        a, shift = slopes.clone(), add.clone()
        a[t], shift[:, t] = log_a.exp(), task_add()
        z = heads.chain(raw * a + shift[group])[:, t]
        loss = (F.binary_cross_entropy_with_logits(z, y, reduction="none") * w_R).sum()
        loss = loss + 0.5 * (d**2).sum() / prior_std**2
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        return log_a.exp(), task_add()


def recalibrate_run(run_dir: str | Path, data_dir: str | Path, split: str = "valid",
                    prior_std: float = 0.1, batch_size: int | None = None, progress: bool = True,
                    form: str = "offset", best: bool = False) -> dict:
    """Fit the recalibration of a run on ``split`` (``form``: ``offset`` or ``platt``, module
    docstring) and write ``RUN/recalibration.json``; returns its record (offsets, with ``platt`` the
    slopes, and each slice's calibration Σp/Σy on ``split`` before and after). ``best``: fit it on
    the best held-out evaluation's model (``train.keep_best``) instead of the last; the record
    says which."""
    require_tuning_split(split, "the recalibration (its offsets and prior_std)")
    model, _, schema = load_run_model(run_dir, recalibrated=False, best=best)
    data_schema = FeatureSchema.load(data_dir)
    if data_schema.fingerprint() != schema.fingerprint():
        raise RecalibrationError(f"{data_dir}: its schema differs from the one run {run_dir} "
                                 f"was trained on")
    heads = gem_heads(model)
    rows = head_inputs(model, schema, data_dir, split, batch_size or EVAL_BATCH, progress)
    G = heads.out_b.shape[0]
    slopes, add = fit_recalibration(heads, rows, G, prior_std, form)
    groups = offset_groups(heads, schema)

    def calibration(a: torch.Tensor, shift: torch.Tensor) -> dict[str, float]:
        p = torch.sigmoid(heads.chain(rows["raw"] * a + shift[rows["group"]]))
        out = {}
        for g, name in enumerate(groups):
            for t, task in enumerate(schema.task_names):
                w = rows["mask"][:, t].double() * rows["weights"] * (rows["group"] == g)
                y = (rows["labels"][:, t] * w).sum()
                if y > 0:
                    out[f"{name}/{task}"] = round(float((p[:, t] * w).sum() / y), 4)
        return out

    with torch.no_grad():
        before, after = calibration(torch.ones_like(slopes),
                                    torch.zeros_like(add)), calibration(slopes, add)
    record = {"split": split, "checkpoint": "best" if best else "last",
              "rows": int(rows["raw"].shape[0]),
              "prior_std": prior_std, "form": form,
              "offsets": {f"{g}/{t}": round(float(add[i, j]), 6) for i, g in enumerate(groups)
                          for j, t in enumerate(schema.task_names)}}
    if form == "platt":
        record["slopes"] = {t: round(float(slopes[j]), 6) for j, t in enumerate(schema.task_names)}
    record.update(calibration_before=before, calibration_after=after)
    save_recalibration(run_dir, record)
    return record


def crossfit_forms(run_dir: str | Path, data_dir: str | Path, split: str = "valid",
                   prior_std: float = 0.1, batch_size: int | None = None) -> dict:
    """Which recalibration form carries to rows it was not fitted on, read on ``split`` alone: its
    rows halved by user (even / odd id), each form fitted on one half and scored on the other, both
    ways. Returns task → {"raw", "offset", "platt": mean log loss over the held-out halves}."""
    require_tuning_split(split, "the choice of recalibration form")
    model, _, schema = load_run_model(run_dir, recalibrated=False)
    heads = gem_heads(model)
    rows = head_inputs(model, schema, data_dir, split, batch_size or EVAL_BATCH, progress=False)
    half = rows.pop("user_id") % 2 == 0
    G, T = heads.out_b.shape[0], rows["raw"].shape[1]
    losses = {t: {f: 0.0 for f in ("raw", *FORMS)} for t in schema.task_names}
    counts = dict.fromkeys(schema.task_names, 0.0)
    for fit_on in (half, ~half):
        part = {k: v[fit_on] for k, v in rows.items()}
        other = {k: v[~fit_on] for k, v in rows.items()}
        fits = {"raw": (torch.ones(T, dtype=torch.float64), torch.zeros(G, T, dtype=torch.float64))}
        fits.update({f: fit_recalibration(heads, part, G, prior_std, f) for f in FORMS})
        for f, (a, add) in fits.items():
            with torch.no_grad():
                z = heads.chain(other["raw"] * a + add[other["group"]])
            for t, task in enumerate(schema.task_names):
                w = other["mask"][:, t].double() * other["weights"]
                bce = F.binary_cross_entropy_with_logits(z[:, t], other["labels"][:, t],
                                                         reduction="none")
                losses[task][f] += float((bce * w).sum())
                counts[task] += float(w.sum()) if f == "raw" else 0.0
    return {t: {f: v / counts[t] for f, v in fs.items()} for t,
            fs in losses.items() if counts[t] > 0}


def crossfit_segments(run_dir: str | Path, data_dir: str | Path, family: str,
                      split: str = "valid", prior_std: float = 0.1,
                      batch_size: int | None = None, min_rows: int = MIN_ROWS) -> dict:
    """What offsets per segment of ``family`` (``opengem.evaluation.segments``) add to today's per
    (domain, task) ones, read on ``split`` alone, as ``crossfit_forms`` does: its rows halved by
    user, each half fitted and scored on the other, both ways. Per segment, one offset per task
    on top of the domain offsets, under the same prior (``prior_std``): the first stage takes the
    part every segment shares, the second only what is left, and a thin segment stays near its
    domain's. Returns per task the mean log loss of ``raw``, ``domain`` and ``segment`` on the
    held-out halves, and the max / min calibration over segments of at least ``min_rows`` rows
    (on a held-out half) of each. Fitted offsets are not written: a served model has one bias per
    (domain, task), and no per-segment one to fold them into."""
    require_tuning_split(split, "the per-segment recalibration")
    model, _, schema = load_run_model(run_dir, recalibrated=False)
    families, _ = segment_families(schema, [family])
    fam = families[0]
    heads = gem_heads(model)
    rows = head_inputs(model, schema, data_dir, split, batch_size or EVAL_BATCH, progress=False,
                       keys=(fam.source,))
    code, names = assign(fam, rows.pop(fam.source).numpy(), schema)
    rows["segment"] = torch.from_numpy(code)
    return {"family": family, "segments": names, "split": split, "prior_std": prior_std,
            "rows": int(rows["raw"].shape[0]),
            "tasks": crossfit_segment_rows(heads, rows, schema.task_names, len(names), prior_std,
                                           min_rows)}


def crossfit_segment_rows(heads, rows: dict[str, torch.Tensor], task_names: list[str], K: int,
                          prior_std: float = 0.1, min_rows: int = MIN_ROWS) -> dict:
    """``crossfit_segments`` on rows (``head_inputs``' with ``user_id`` and a ``segment`` code in
    [0, K)): task → {"raw", "domain", "segment"} → {"logloss", "calibration_ratio"}, each the mean
    of the two held-out halves."""
    half = rows["user_id"] % 2 == 0
    G = heads.out_b.shape[0]
    forms = ("raw", "domain", "segment")
    sums = {t: {f: [0.0, 0.0] for f in forms} for t in task_names}
    spread = {t: {f: [] for f in forms} for t in task_names}
    for fit_on in (half, ~half):
        part = {k: v[fit_on] for k, v in rows.items()}
        other = {k: v[~fit_on] for k, v in rows.items()}
        _, dom = fit_recalibration(heads, part, G, prior_std, "offset")
        on_top = {**part, "raw": part["raw"] + dom[part["group"]], "group": part["segment"]}
        _, seg = fit_recalibration(heads, on_top, K, prior_std, "offset")
        shifts = {"raw": torch.zeros_like(other["raw"]), "domain": dom[other["group"]],
                  "segment": dom[other["group"]] + seg[other["segment"]]}
        for f, shift in shifts.items():
            with torch.no_grad():
                z = heads.chain(other["raw"] + shift)
            for t, task in enumerate(task_names):
                w = other["mask"][:, t].double() * other["weights"]
                y = other["labels"][:, t]
                bce = F.binary_cross_entropy_with_logits(z[:, t], y, reduction="none")
                sums[task][f][0] += float((bce * w).sum())
                sums[task][f][1] += float(w.sum())
                spread[task][f].append(_calibration_ratio(torch.sigmoid(z[:, t]), y, w,
                                                          other["segment"], K, min_rows))
    return {t: {f: {"logloss": v[0] / v[1] if v[1] else float("nan"),
                    "calibration_ratio": sum(spread[t][f]) / 2}
                for f, v in fs.items()} for t, fs in sums.items()}


def _calibration_ratio(p: torch.Tensor, y: torch.Tensor, w: torch.Tensor, seg: torch.Tensor,
                       K: int, min_rows: int) -> float:
    """Max / min of Σp / Σy over the segments with at least ``min_rows`` rows and a positive."""
    n = torch.bincount(seg, weights=(w > 0).double(), minlength=K)
    sp = torch.bincount(seg, weights=p * w, minlength=K)
    sy = torch.bincount(seg, weights=y * w, minlength=K)
    ok = (n >= min_rows) & (sy > 0)
    if not ok.any():
        return float("nan")
    cal = sp[ok] / sy[ok]
    return float(cal.max() / cal.min())
