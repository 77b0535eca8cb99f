"""Offline metrics for binary prediction tasks: pure functions on 1-D numpy arrays.

Every function takes predictions ``p`` (probabilities in [0, 1]), labels ``y`` (0/1; bool, int or
float) and, where stated, non-negative sample weights ``w``. Inputs are converted to float64 and
validated; a problem (arrays that are not 1-D or differ in length, NaN or out-of-range predictions,
labels other than 0/1, negative or non-finite weights) raises ``ValueError`` naming it.

Undefined values (an AUC with a single class present, a metric of zero rows) are ``nan`` rather than
errors, so that a report over many (domain, task) slices does not fail because one slice is
degenerate. Scalars are returned as python ``float``.

Definitions:

* logloss     ``-Σ w_i [y_i log p_i + (1-y_i) log(1-p_i)] / Σ w_i`` with p clipped to [eps, 1-eps]
* entropy     ``H(r) = -(r log r + (1-r) log(1-r))`` (nats), ``H(0) = H(1) = 0``
* ne          ``logloss / H(base_rate)`` where base_rate is the *training* positive rate
              (He et al., 2014, "Practical Lessons from Predicting Clicks on Ads at Facebook")
* auc         ``Σ_{i∈pos, j∈neg} w_i w_j ([p_i > p_j] + ½[p_i = p_j]) / (W_pos W_neg)``
* gauc        ``Σ_g P_g AUC_g / Σ_g P_g`` over groups g (users) having both classes; P_g = number
              of positives (clicks) of g
* calibration ``Σ w p / Σ w y`` (expected / observed positives)
* captured    ``(1 - ne_model) / (1 - ne_bayes)``: the share of the learnable signal captured
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from opengem.data.base_rates import as_1d, check_labels

__all__ = [
    "auc",
    "calibration",
    "calibration_slope",
    "captured",
    "entropy",
    "gauc",
    "logistic_fit",
    "logloss",
    "ne",
    "ne_bayes",
    "separated",
    "summarize",
]


# --------------------------------------------------------------------------------------- checks


def _same_length(n: int, arr: np.ndarray, name: str, ref: str) -> None:
    if arr.shape[0] != n:
        raise ValueError(f"length mismatch: {name} has {arr.shape[0]} rows but {ref} has {n}")


def _check_probs(x: Any, name: str = "p") -> np.ndarray:
    """Return ``x`` as float64 1-D; raise ValueError on NaN or values outside [0, 1]."""
    arr = as_1d(x, name)
    if arr.dtype.kind not in "biuf":
        raise ValueError(f"{name} must be numeric, got dtype {arr.dtype}")
    arr = arr.astype(np.float64, copy=False)
    if arr.size:
        nan = np.isnan(arr)
        if nan.any():
            raise ValueError(f"{name} contains NaN ({int(nan.sum())} of {arr.size} values)")
        lo, hi = float(arr.min()), float(arr.max())
        if lo < 0.0 or hi > 1.0:
            raise ValueError(f"{name} must lie in [0, 1], got values in [{lo}, {hi}]")
    return arr


def _check_weights(x: Any, n: int, name: str = "w") -> np.ndarray:
    arr = as_1d(x, name)
    _same_length(n, arr, name, "p")
    if arr.dtype.kind not in "biuf":
        raise ValueError(f"{name} must be numeric, got dtype {arr.dtype}")
    arr = arr.astype(np.float64, copy=False)
    if arr.size and (not np.isfinite(arr).all() or float(arr.min()) < 0.0):
        raise ValueError(f"{name} (weights) must be finite and non-negative")
    return arr


def _check_groups(x: Any, n: int, name: str = "groups") -> np.ndarray:
    arr = as_1d(x, name)
    _same_length(n, arr, name, "p")
    if arr.dtype.kind == "f" and np.isnan(arr).any():
        raise ValueError(f"{name} contains NaN")
    return arr


def _check_py(p: Any, y: Any, w: Any = None, p_name: str = "p"):
    p = _check_probs(p, p_name)
    y = check_labels(y)
    _same_length(p.shape[0], y, "y", p_name)
    if w is not None:
        w = _check_weights(w, p.shape[0])
    return p, y, w


def _check_base_rate(base_rate: float) -> float:
    try:
        r = float(base_rate)
    except (TypeError, ValueError):
        raise ValueError(f"base_rate must be a number, got {base_rate!r}") from None
    if not (0.0 < r < 1.0):  # also rejects NaN
        raise ValueError(f"base_rate must be in the open interval (0, 1), got {base_rate!r}")
    return r


# -------------------------------------------------------------------------------------- metrics


def logloss(p: Any, y: Any, w: Any = None, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy (nats).

    ``logloss = -Σ w_i [y_i log p_i + (1 - y_i) log(1 - p_i)] / Σ w_i`` with ``p`` clipped to
    ``[eps, 1 - eps]`` and ``w_i = 1`` when ``w`` is None. ``nan`` for zero rows or zero
    total weight.
    """
    p, y, w = _check_py(p, y, w)
    if p.size == 0:
        return math.nan
    pc = np.clip(p, eps, 1.0 - eps)
    losses = -(y * np.log(pc) + (1.0 - y) * np.log1p(-pc))
    if w is None:
        return float(losses.mean())
    total = float(w.sum())
    if total == 0.0:
        return math.nan
    return float(np.dot(w, losses) / total)


def entropy(rate: Any) -> Any:
    """Binary entropy in nats: ``H(r) = -(r log r + (1 - r) log(1 - r))``, with ``0 log 0 = 0``.

    ``H(0) = H(1) = 0`` (no NaN). ``rate`` may be a scalar (returns float) or an array (returns an
    array of the same shape). Raises ValueError for NaN or values outside [0, 1].
    """
    arr = np.asarray(rate, dtype=np.float64)
    if np.isnan(arr).any() or (arr < 0.0).any() or (arr > 1.0).any():
        raise ValueError(f"rate must lie in [0, 1], got {rate!r}")
    q = 1.0 - arr
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(arr > 0.0, arr * np.log(np.where(arr > 0.0, arr, 1.0)), 0.0)
        b = np.where(q > 0.0, q * np.log(np.where(q > 0.0, q, 1.0)), 0.0)
    h = -(a + b)
    h = np.where(h == 0.0, 0.0, h)  # no negative zero
    if h.ndim == 0:
        return float(h)
    return h


def ne(p: Any, y: Any, base_rate: float, w: Any = None) -> float:
    """Normalized entropy: ``NE = logloss(p, y, w) / H(base_rate)``.

    ``base_rate`` is the positive rate of the *training* data (He et al., 2014): NE < 1 means the
    model beats always predicting the training base rate. Raises ValueError unless
    ``0 < base_rate < 1`` (H would be 0).
    """
    r = _check_base_rate(base_rate)
    return logloss(p, y, w) / float(entropy(r))


def ne_bayes(p_true: Any, y: Any, base_rate: float) -> float:
    """NE of the true label probabilities: ``ne(p_true, y, base_rate)`` (alias of :func:`ne`).

    On synthetic data where each label was drawn with a known probability, this is the best NE any
    model can reach in expectation (the Bayes floor); use it with :func:`captured`.
    """
    return ne(p_true, y, base_rate)


def captured(ne_model: float, ne_bayes: float) -> float:
    """Share of the learnable signal captured: ``(1 - ne_model) / (1 - ne_bayes)``.

    1 means the model matches the true probabilities, 0 means it is no better than the base rate.
    ``nan`` when ``ne_bayes == 1`` (no learnable signal) or either input is NaN.
    """
    nm, nb = float(ne_model), float(ne_bayes)
    denom = 1.0 - nb
    if math.isnan(nm) or math.isnan(nb) or denom == 0.0:
        return math.nan
    return (1.0 - nm) / denom


def _sorted_auc_parts(
    p: np.ndarray, y: np.ndarray, w: np.ndarray | None, groups: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-group pieces of the tie-aware AUC: (numerator, positive weight, negative weight).

    Rows are sorted by (group, p). Within a group, a block of tied scores contributes
    ``pos_block * (neg_below_block + neg_block / 2)``; AUC_g = num_g / (P_g N_g). All groups are
    handled at once with cumulative sums, without a Python loop over groups.
    """
    n = p.shape[0]
    if groups is None:
        order = np.argsort(p, kind="stable")
        gstart = np.zeros(n, dtype=bool)
        gstart[0] = True
    else:
        order = np.lexsort((p, groups))
        gs = groups[order]
        gstart = np.empty(n, dtype=bool)
        gstart[0] = True
        np.not_equal(gs[1:], gs[:-1], out=gstart[1:])
    ps = p[order]
    bstart = gstart.copy()
    bstart[1:] |= ps[1:] != ps[:-1]
    bidx = np.flatnonzero(bstart)

    ys = y[order]
    if w is None:
        pos_b = np.add.reduceat(ys, bidx)
        cnt_b = np.diff(np.append(bidx, n)).astype(np.float64)
        neg_b = cnt_b - pos_b
    else:
        ws = w[order]
        pos_w = ws * ys
        pos_b = np.add.reduceat(pos_w, bidx)
        neg_b = np.add.reduceat(ws - pos_w, bidx)

    gid_b = np.cumsum(gstart)[bidx] - 1  # group index of each block
    neg_before = np.cumsum(neg_b) - neg_b  # negatives in all earlier blocks (any group)
    group_offset = neg_before[gstart[bidx]]  # value at each group's first block
    neg_below = neg_before - group_offset[gid_b]
    num_b = pos_b * (neg_below + 0.5 * neg_b)
    ng = int(gid_b[-1]) + 1
    num_g = np.bincount(gid_b, weights=num_b, minlength=ng)
    pos_g = np.bincount(gid_b, weights=pos_b, minlength=ng)
    neg_g = np.bincount(gid_b, weights=neg_b, minlength=ng)
    return num_g, pos_g, neg_g


def auc(p: Any, y: Any, w: Any = None) -> float:
    """Exact ROC AUC with ties counted as one half.

    ``AUC = Σ_{i∈pos, j∈neg} w_i w_j ([p_i > p_j] + ½[p_i = p_j]) / (Σ_pos w · Σ_neg w)``,
    computed from one sort (O(n log n)). ``nan`` if only one class (or zero rows) is present.
    """
    p, y, w = _check_py(p, y, w)
    if p.size == 0:
        return math.nan
    num, pos, neg = _sorted_auc_parts(p, y, w, None)
    if pos[0] <= 0.0 or neg[0] <= 0.0:
        return math.nan
    return float(num[0] / (pos[0] * neg[0]))


def gauc(p: Any, y: Any, groups: Any) -> float:
    """Group AUC: the per-group AUC averaged with each group's number of positives as weight.

    ``gAUC = Σ_g P_g · AUC_g / Σ_g P_g`` over the groups (users) that have both a positive and a
    negative row; P_g = positives (clicks) of group g (InterFormer's definition). Single-class
    groups are skipped; ``nan`` if no group qualifies. Ties count one half as in :func:`auc`.
    """
    p, y, _ = _check_py(p, y)
    g = _check_groups(groups, p.shape[0])
    if p.size == 0:
        return math.nan
    num, pos, neg = _sorted_auc_parts(p, y, None, g)
    ok = (pos > 0.0) & (neg > 0.0)
    if not ok.any():
        return math.nan
    # P_g * num_g / (P_g N_g) = num_g / N_g
    return float((num[ok] / neg[ok]).sum() / pos[ok].sum())


def calibration(p: Any, y: Any, w: Any = None) -> float:
    """Expected over observed positives: ``Σ w p / Σ w y``.

    1 is perfectly calibrated in aggregate, > 1 over-predicts. ``inf`` if ``Σ w y = 0`` and
    ``Σ w p > 0``; ``nan`` if both are 0.
    """
    p, y, w = _check_py(p, y, w)
    if w is None:
        expected, observed = float(p.sum()), float(y.sum())
    else:
        expected, observed = float(np.dot(w, p)), float(np.dot(w, y))
    if observed == 0.0:
        return math.inf if expected > 0.0 else math.nan
    return expected / observed


def calibration_slope(p: Any, y: Any, eps: float = 1e-7) -> float:
    """Slope a of the logistic fit ``y ~ σ(a · logit(p) + c)`` (Cox 1958; ``logistic_fit``).

    1: the predictions are as spread as the labels support; < 1: over-spread (over-confident: too
    high where high, too low where low), what an offset cannot fix (``opengem recalibrate --form
    platt`` can); > 1: under-spread. ``calibration`` (Σp/Σy) says nothing of this. ``nan`` without
    both classes, with constant predictions, or when the fit does not converge (separable labels).
    """
    p, y, _ = _check_py(p, y)
    q = np.clip(p.astype(np.float64), eps, 1 - eps)
    return logistic_fit(np.log(q) - np.log1p(-q), y)[0]


def separated(z: Any, y: Any) -> int:
    """+1 if every positive scores at least every negative (no finite logistic fit: a → +∞), −1 if
    at most (a → −∞), 0 otherwise; labels of both classes assumed."""
    z, y = np.asarray(z), np.asarray(y)
    pos, neg = z[y > 0], z[y < 1]
    return 1 if pos.min() >= neg.max() else -1 if pos.max() <= neg.min() else 0


def logistic_fit(z: Any, y: Any) -> tuple[float, float]:
    """Maximum-likelihood (a, c) of ``y ~ σ(a z + c)`` by Newton's method with step halving (a plain
    step from the identity can overshoot); (nan, nan) without both classes, with constant ``z``,
    when the classes are separated by ``z`` (``separated``: the slope is infinite) or when it does
    not converge. The one two-number logistic fit of the project: ``calibration_slope`` and
    ``evaluation.platt`` use it."""
    z, y = np.asarray(z, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if z.shape[0] == 0 or y.min() == y.max() or z.std() == 0 or separated(z, y) != 0:
        return math.nan, math.nan
    x = np.stack([z, np.ones_like(z)], 1)

    def nll(theta: np.ndarray) -> float:  # mean −log-likelihood, overflow-free
        v = x @ theta
        return float(np.mean(np.logaddexp(0.0, v) - y * v))

    theta = np.array([1.0, 0.0])
    f = nll(theta)
    for _ in range(100):
        mu = 0.5 * (1.0 + np.tanh(0.5 * (x @ theta)))  # σ without overflow
        hess = x.T @ (x * (mu * (1 - mu))[:, None])
        step = np.linalg.lstsq(hess, x.T @ (y - mu), rcond=None)[0]
        for _ in range(30):
            f_new = nll(theta + step)
            if f_new <= f:
                break
            step = step / 2
        theta, f = theta + step, f_new
        if not np.all(np.isfinite(theta)) or np.abs(theta).max() > 1e6:
            break
        if np.abs(step).max() < 1e-9:
            return float(theta[0]), float(theta[1])
    return math.nan, math.nan


def summarize(
    p: Any,
    y: Any,
    base_rate: float | None,
    groups: Any = None,
    p_true: Any = None,
) -> dict[str, float | int]:
    """All metrics of one slice, as JSON-serialisable python numbers (NaN for undefined).

    Keys: ``ne``, ``auc``, ``gauc`` (NaN without ``groups``), ``calibration``,
    ``calibration_slope``, ``logloss``, ``n`` (rows), ``positives``; with ``p_true`` also
    ``ne_bayes`` and ``captured``. ``base_rate`` is the training positive rate used by NE; ``None``
    means "unknown" and gives NaN for the NE-based keys. A numeric ``base_rate`` outside (0, 1)
    raises ValueError.
    """
    p, y, _ = _check_py(p, y)
    n = int(p.shape[0])
    if groups is not None:
        groups = _check_groups(groups, n)
    if p_true is not None:
        p_true = _check_probs(p_true, "p_true")
        _same_length(n, p_true, "p_true", "p")
    r = None if base_rate is None else _check_base_rate(base_rate)

    out: dict[str, float | int] = {
        "ne": ne(p, y, r) if r is not None else math.nan,
        "auc": auc(p, y),
        "gauc": gauc(p, y, groups) if groups is not None else math.nan,
        "calibration": calibration(p, y),
        "calibration_slope": calibration_slope(p, y),
        "logloss": logloss(p, y),
        "n": n,
        "positives": int(y.sum()),
    }
    if p_true is not None:
        nb = ne(p_true, y, r) if r is not None else math.nan
        out["ne_bayes"] = nb
        out["captured"] = captured(out["ne"], nb)
    return out


def reliability_bins(p, y, n_bins: int = 20, strategy: str = "quantile") -> dict[str, list]:
    """Mean prediction ``p``, observed rate ``y`` and rows ``n`` per bin of the predictions.

    ``quantile``: equal-count bins of the sorted predictions (every bin populated even when the
    rates are a few percent); ``uniform``: bins [0, 1/n), …, [(n-1)/n, 1]. Empty bins are left out.

    >>> reliability_bins([0.1, 0.2, 0.3, 0.4], [0, 0, 1, 1], n_bins=2)
    {'p': [0.15, 0.35], 'y': [0.0, 1.0], 'n': [2, 2]}
    """
    p = np.asarray(p, dtype=np.float64).ravel()
    y = np.asarray(y, dtype=np.float64).ravel()
    if p.shape != y.shape:
        raise ValueError(f"p has {p.size} rows but y has {y.size}")
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    if strategy == "quantile":
        order = np.argsort(p, kind="stable")
        bin_of = np.empty(p.size, dtype=np.int64)
        for b, rows in enumerate(np.array_split(order, min(n_bins, max(p.size, 1)))):
            bin_of[rows] = b
    elif strategy == "uniform":
        bin_of = np.clip((p * n_bins).astype(np.int64), 0, n_bins - 1)
    else:
        raise ValueError(f"strategy must be 'quantile' or 'uniform', got {strategy!r}")
    n = np.bincount(bin_of, minlength=n_bins)
    keep = n > 0
    sp = np.bincount(bin_of, weights=p, minlength=n_bins)[keep]
    sy = np.bincount(bin_of, weights=y, minlength=n_bins)[keep]
    n = n[keep]
    return {"p": [round(float(v), 12) for v in sp / n], "y": [round(float(v), 12) for v in sy / n],
            "n": [int(v) for v in n]}
