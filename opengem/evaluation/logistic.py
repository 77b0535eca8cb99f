"""An L2-penalised logistic regression over one-hot groups and scalar columns, fitted
to convergence.

The world's oracle (``opengem.world.oracle``) and the logistic-regression peer
(``benchmarks/instruments/linear.py``) share it: one convex solver, so the two differ only in their
columns. Only a train split fits and only a valid split chooses λ.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from opengem.discipline import require_tuning_split

L2_GRID = (100.0, 30.0, 10.0, 3.0, 1.0)  # λ of the sum-form penalty, largest first (warm starts)
# L-BFGS iterations per λ; it stops when the mean loss moves less than TOLERANCE in an iteration
# (the demo world's valid losses then sit within 1e-6 of a 1e-10 fit's, their λ-to-λ steps ≥ 3e-4).
MAX_ITER, TOLERANCE = 300, 1e-8

@dataclass
class Design:
    """The rows of one split for one model: group indices (column-major, so each group is one
    contiguous gather; docs/experiments.md, 'Figures moved from code docstrings'), scalar
    columns, labels."""

    split: str
    idx: np.ndarray  # [G, n] int64, global indices into the weights
    x: np.ndarray  # [n, K] float64
    y: np.ndarray  # [n] float64 0/1

    def subset(self, rows: np.ndarray) -> Design:
        return Design(self.split, self.idx[:, rows], self.x[rows], self.y[rows])


class Fit:
    """A fitted oracle model; ``theta`` = [b, w (num_weights), β (K, on standardised columns)]."""

    def __init__(self, theta: np.ndarray, num_weights: int, mean: np.ndarray, std: np.ndarray,
                 l2: float):
        self.theta, self.num_weights, self.mean, self.std, self.l2 = (
            theta,
            num_weights,
            mean,
            std,
            l2,
        )

    def logits(self, d: Design) -> np.ndarray:
        return _logits(self.theta, self.num_weights, d.idx, (d.x - self.mean) / self.std)


def _logits(theta, num_weights, idx, x) -> np.ndarray:
    w = theta[1:1 + num_weights]
    z = theta[0] + x @ theta[1 + num_weights:]
    for col in idx:
        z += w[col]
    return z


def _logloss(z, y) -> float:
    return float(np.mean(np.logaddexp(0.0, z) - y * z))


def _loss_residual(z, y) -> tuple[float, np.ndarray]:
    """(mean log loss, sigmoid(z) − y) sharing one exp (the closure's costliest part after
    the gathers)."""
    e = np.exp(-np.abs(z))
    loss = float(np.mean(np.maximum(z, 0.0) + np.log1p(e) - y * z))
    return loss, np.where(z >= 0, 1.0, e) / (1.0 + e) - y


def fit_logistic(d: Design, num_weights: int, l2: float, mean, std, init: np.ndarray | None = None,
                 max_iter: int = MAX_ITER) -> Fit:
    """Minimise mean log loss + λ/(2n)·(Σ w² + Σ β²) by full-batch L-BFGS (``torch.optim.LBFGS``) in
    float64; the loss and its exact gradient are numpy gathers and bincounts.

    The variables are preconditioned by the diagonal of the Hessian at the base rate
    (rows per one-hot cell · q + λ, q = ȳ(1 − ȳ)), so rare cells and the bias move at one pace."""
    x, y = (d.x - mean) / std, d.y
    n, K = len(y), x.shape[1]
    rate = min(max(float(y.mean()), 1e-6), 1 - 1e-6) if n else 0.5
    q = rate * (1 - rate)
    counts = (
        sum(np.bincount(col, minlength=num_weights) for col in d.idx)
        if len(d.idx)
        else np.zeros(num_weights)
    )
    scale = 1 / np.sqrt(np.concatenate([[q * n], counts * q + l2, np.full(K, q * n + l2)])
                        / max(n, 1))
    penal = np.ones_like(scale)
    penal[0] = 0.0  # the bias is not penalised
    if init is None:
        init = np.zeros(len(scale))
        init[0] = np.log(rate / (1 - rate))
    v = torch.nn.Parameter(torch.from_numpy(init / scale))
    opt = torch.optim.LBFGS([v], lr=1.0, max_iter=max_iter, history_size=20, tolerance_grad=1e-10,
                            tolerance_change=TOLERANCE, line_search_fn="strong_wolfe")

    def closure():
        theta = v.detach().numpy() * scale
        loss, r = _loss_residual(_logits(theta, num_weights, d.idx, x), y)
        loss += 0.5 * l2 / n * float((penal * theta * theta).sum())
        r /= n
        g = np.empty_like(theta)
        g[0] = r.sum()
        g[1:1 + num_weights] = sum(np.bincount(col, r, minlength=num_weights) for col in d.idx)
        g[1 + num_weights:] = x.T @ r
        g += l2 / n * penal * theta
        v.grad = torch.from_numpy(g * scale)
        return torch.tensor(loss, dtype=torch.float64)

    opt.step(closure)
    return Fit(v.detach().numpy() * scale, num_weights, mean, std, l2)


def logloss_of(fit: Fit, d: Design) -> float:
    return _logloss(fit.logits(d), d.y)


def choose_l2(train: Design, valid: Design, num_weights: int,
              grid=L2_GRID) -> tuple[Fit, dict[float, float]]:
    """The fit on ``train`` whose λ in ``grid`` has the lowest log loss on ``valid``, and every
    λ's loss.

    The path runs from the largest λ down, each fit warm-started from the last, and stops once the
    valid loss has risen (it is unimodal in λ). Only a train split fits and only a valid split
    chooses: test rows never shape the oracle."""
    require_tuning_split(valid.split, "the oracle's L2")
    if train.split != "train":
        raise ValueError(f"the oracle fits on 'train', got {train.split!r}")
    mean = train.x.mean(0) if len(train.y) else np.zeros(train.x.shape[1])
    std = train.x.std(0) if len(train.y) else np.ones(train.x.shape[1])
    std = np.where(std > 0, std, 1.0)
    best, losses, init = None, {}, None
    for l2 in grid:
        fit = fit_logistic(train, num_weights, l2, mean, std, init)
        init = fit.theta
        losses[l2] = logloss_of(fit, valid)
        if best is None or losses[l2] < losses[best.l2]:
            best = fit
        else:
            break
    return best, losses
