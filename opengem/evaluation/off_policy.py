"""Off-policy value estimates from logged bandit feedback: IPS, self-normalised IPS, doubly robust,
and percentile-bootstrap intervals. Pure numpy; no data loading.

Legend: n logged rows (one decision each: the logger showed action a_i in context x_i); B bootstrap
replicates. Every array is ``[..., n]`` and every estimator averages over the last axis, so
``[B, n]`` resamples are scored in one call.

    reward     r_i        the observed reward (a click: 0/1), finite
    pscore     π_b(a_i | x_i)  the logging policy's probability of the logged action, in (0, 1]
    target     π_e(a_i | x_i)  the target policy's probability of that same action, in [0, 1]
    q_logged   q̂(x_i, a_i)     the reward model's prediction for the logged action
    q_target   Σ_a π_e(a | x_i) q̂(x_i, a): the reward model's value of the target policy at x_i

    IPS   = mean(w r),  w = target / pscore     unbiased when π_b > 0 wherever π_e > 0
    SNIPS = Σ w r / Σ w                         bias O(1/n), less variance when weights spread
    DR    = mean(q_target + w (r − q_logged))   unbiased when the pscores are right, whatever q̂;
                                                less variance the closer q̂ is to the truth

Why written here rather than imported: obp (Open Bandit Pipeline, which has these estimators)
0.5.7 declares Python < 3.11 and pins torch==1.12, pandas==1.5.2, scikit-learn==1.1.3 and
scipy==1.9.3; pip cannot resolve it beside this project's torch on Python 3.11, and its older
releases fail to build their pinned PyYAML. Each estimator is one weighted mean, so three short
functions cost less than a second environment.

Bad input is a ``ValueError`` naming the array and the first bad row: a propensity of 0 (the
logger could not have taken the logged action, so the weight is undefined) or outside (0, 1],
arrays of different lengths, a NaN or infinite reward or prediction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# cells (replicates x rows) of one resample chunk: bounds the bootstrap's memory whatever B and n
_BOOT_CHUNK_CELLS = 4_000_000


def _as_array(name: str, x) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim == 0:
        raise ValueError(f"{name}: expected an array of one value per logged row, got a scalar")
    bad = ~np.isfinite(a)
    if bad.any():
        kind = "NaN" if np.isnan(a[bad]).any() else "infinite"
        raise ValueError(f"{name}: {int(bad.sum())} {kind} value(s) "
                         f"(first at row {_first(bad)})")
    return a


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask.reshape(-1, mask.shape[-1]).any(0))[0])


def _in_range(name: str, a: np.ndarray, low_open: bool, where: str) -> None:
    bad = ((a <= 0) if low_open else (a < 0)) | (a > 1)
    if bad.any():
        zeros = int((a[bad] == 0).sum())
        why = f", {zeros} of them 0" if zeros else ""
        raise ValueError(f"{name}: {int(bad.sum())} value(s) outside {where}{why} (first at row "
                         f"{_first(bad)}, value {a[bad].flat[0]!r})")


def check_log(reward, pscore, target, *models: tuple[str, object]) -> list[np.ndarray]:
    """The arrays as float64, after the checks above; ``models``: (name, array) pairs of reward-model
    predictions, checked for shape and finiteness."""
    arrays = [_as_array("reward", reward), _as_array("pscore", pscore),
              _as_array("target", target), *(_as_array(n, m) for n, m in models)]
    names = ["reward", "pscore", "target", *(n for n, _ in models)]
    shapes = {n: a.shape for n, a in zip(names, arrays)}
    if len(set(shapes.values())) > 1:
        raise ValueError("arrays of different lengths: "
                         + ", ".join(f"{n} {s}" for n, s in shapes.items()))
    if arrays[0].shape[-1] == 0:
        raise ValueError("no logged rows: every array is empty")
    _in_range("pscore", arrays[1], low_open=True, where="(0, 1]")
    _in_range("target", arrays[2], low_open=False, where="[0, 1]")
    return arrays


def ips(reward, pscore, target) -> np.ndarray:
    """Inverse propensity scoring: ``mean(target / pscore · reward)`` over the last axis."""
    r, p, t = check_log(reward, pscore, target)
    return (t / p * r).mean(-1)


def snips(reward, pscore, target) -> np.ndarray:
    """Self-normalised IPS: ``Σ w r / Σ w``; nan where every weight is 0 (the target never takes a
    logged action, so the log says nothing about it)."""
    r, p, t = check_log(reward, pscore, target)
    w = t / p
    total = w.sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, (w * r).sum(-1) / total, np.nan)


def dr(reward, pscore, target, q_logged, q_target) -> np.ndarray:
    """Doubly robust: ``mean(q_target + target / pscore · (reward − q_logged))``."""
    r, p, t, ql, qt = check_log(reward, pscore, target, ("q_logged", q_logged),
                                ("q_target", q_target))
    return (qt + t / p * (r - ql)).mean(-1)


@dataclass(frozen=True)
class Interval:
    """A point estimate on all rows and its percentile-bootstrap interval at ``level``."""

    value: float
    low: float
    high: float
    level: float

    def covers(self, x: float) -> bool:
        return self.low <= x <= self.high

    def as_list(self, digits: int = 6) -> list[float]:
        return [round(v, digits) for v in (self.value, self.low, self.high)]


def bootstrap_draws(estimator: Callable[..., np.ndarray], *arrays, n_boot: int = 1000,
                    seed: int = 0) -> np.ndarray:
    """``n_boot`` values of ``estimator`` on the rows resampled with replacement (the same row
    indices for every array, so a row's reward, propensity and predictions stay together)."""
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    estimator(*arrays)  # the checks, once, on the rows as given
    arrays = [np.asarray(a, dtype=np.float64) for a in arrays]
    n = arrays[0].shape[-1]
    rng = np.random.default_rng(seed)
    chunk = max(1, _BOOT_CHUNK_CELLS // n)
    out = []
    for start in range(0, n_boot, chunk):
        idx = rng.integers(0, n, size=(min(chunk, n_boot - start), n))
        out.append(estimator(*(a[idx] for a in arrays)))
    return np.concatenate(out)


def bootstrap_ci(estimator: Callable[..., np.ndarray], *arrays, level: float = 0.95,
                 n_boot: int = 1000, seed: int = 0) -> Interval:
    """``estimator`` (``ips``, ``snips``, ``dr`` or any function of ``[..., n]`` arrays) on all rows,
    with the ``level`` percentile interval of ``n_boot`` bootstrap resamples of the rows."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    draws = bootstrap_draws(estimator, *arrays, n_boot=n_boot, seed=seed)
    low, high = np.nanquantile(draws, [(1 - level) / 2, (1 + level) / 2])
    return Interval(float(estimator(*arrays)), float(low), float(high), level)


def percentile_interval(draws: np.ndarray, value: float, level: float = 0.95) -> Interval:
    """The ``level`` percentile interval of bootstrap ``draws`` around ``value`` (for draws combined
    by hand, e.g. a difference of two independent bootstraps)."""
    low, high = np.nanquantile(np.asarray(draws, dtype=np.float64),
                               [(1 - level) / 2, (1 + level) / 2])
    return Interval(float(value), float(low), float(high), level)
