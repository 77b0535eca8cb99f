"""DenseNormalizer: how raw dense values [B, F] enter the model (``model.dense_norm``).

Real logs hold counters, rates and prices on any scale. Three choices, measured
in docs/experiments.md:

- ``signed_log`` (default): sign(x)·log1p(|x|), no fitted state — what earlier versions did. A
  feature the importer already log1p'd (``transform: log1p``) is logged twice.
- ``standardize``: (x − μ_f) / σ_f with μ, σ of the training split, clipped to ±8. No log:
  heavy-tailed counters should be log1p'd once at import.
- ``quantile``: the feature's empirical CDF on the training split (piecewise linear between
  ``DENSE_QUANTILES`` knots), mapped to [−√3, √3] (unit variance): any monotone scale or unit gives
  the same input, outliers are bounded.

Features declared ``missing="indicator"`` (``opengem.features.schema.DenseFeature``) may hold NaN:
each NaN is replaced by the feature's train-split median before the transform, and a 0/1 "was
missing" column per such feature is appended, so the output is [B, F + M]. The median, not the mean:
counters and prices are heavy-tailed, and the median is a value the feature actually takes (the
centre of ``quantile``'s range). With no such feature the module is exactly what it was.

The fitted statistics are buffers of this module, so they travel in every checkpoint and in the
serving artifact, and serving applies exactly the training transform. ``fit(stats)`` takes what
``opengem.data.dense_stats.train_dense_stats`` returns; a fitted mode used before ``fit`` (or a
checkpoint load) raises instead of silently applying an identity.
"""

from __future__ import annotations

import math

import torch
from torch import nn

MODES = ("signed_log", "standardize", "quantile")
_CLIP = 8.0


def signed_log(x: torch.Tensor) -> torch.Tensor:
    """sign(x)·log1p(|x|): keeps counts and standardised floats in one range (real logs vary)."""
    return torch.sign(x) * torch.log1p(x.abs())


class DenseNormalizer(nn.Module):
    """[B, F] raw dense values (NaN = missing in the ``missing`` columns) → [B, F + M] model inputs:
    the transformed values, then one 0/1 missing indicator per ``missing`` column
    (module docstring).

    Args:
        num_features: F. mode: one of ``MODES``. num_quantiles: the quantile knots (``quantile`` mode).
        missing: indices of the features whose NaNs are imputed and flagged (``schema.dense_missing``).
    """

    def __init__(self, num_features: int, mode: str = "signed_log", num_quantiles: int = 33,
                 missing: tuple[int, ...] | list[int] = ()):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"model.dense_norm must be one of {'|'.join(MODES)}, got {mode!r}")
        self.mode, self.num_features, self.missing = mode, num_features, tuple(missing)
        self.out_features = num_features + len(self.missing)
        self.needs_fit = mode != "signed_log" or bool(self.missing)
        self.fitted = not self.needs_fit
        # what ``fit`` was given (the trainer writes it to RUN/dense_stats.json)
        self.stats: dict | None = None
        if mode == "standardize":
            self.register_buffer("mean", torch.zeros(num_features))
            self.register_buffer("inv_std", torch.ones(num_features))
        elif mode == "quantile":
            self.register_buffer("knots", torch.zeros(num_features, num_quantiles))
        if self.missing:  # only then: models without missing features keep their state dict
            self.register_buffer("fill", torch.zeros(len(self.missing)))  # train median, raw scale
            self.register_buffer("missing_idx", torch.tensor(self.missing, dtype=torch.int64),
                                 persistent=False)

    def reset_parameters(self) -> None:
        """``init_weights`` leaves a fitted state alone only by refitting: the buffers go back to
        neutral values and the module is unfitted again (``to_empty`` left them undefined)."""
        if self.mode == "standardize":
            self.mean.zero_()
            self.inv_std.fill_(1.0)
        elif self.mode == "quantile":
            self.knots.copy_(torch.linspace(0, 1, self.knots.shape[1]).expand_as(self.knots))
        if self.missing:
            self.fill.zero_()
            self.missing_idx.copy_(torch.tensor(self.missing, dtype=torch.int64))
        self.fitted = not self.needs_fit

    @torch.no_grad()
    def fit(self, stats: dict, names: list[str]) -> None:
        """Set the buffers from ``train_dense_stats``'s figures; ``names`` = the schema's dense
        features, in order."""
        if not self.needs_fit:
            return
        if list(stats.get("names", [])) != list(names):
            raise ValueError(f"dense statistics are for features {stats.get('names')}, the "
                             f"model has {names}")
        if self.mode == "standardize":
            std = torch.tensor(stats["std"], dtype=torch.float64)
            self.mean.copy_(torch.tensor(stats["mean"], dtype=torch.float64))
            self.inv_std.copy_(torch.where(std > 1e-12, 1.0 / std.clamp(min=1e-12),
                                           torch.ones_like(std)))
        elif self.mode == "quantile":
            knots = torch.tensor(stats["quantiles"], dtype=torch.float64)
            if knots.shape != self.knots.shape:
                raise ValueError(f"dense quantiles have shape {tuple(knots.shape)}, "
                                 f"expected {tuple(self.knots.shape)}")
            self.knots.copy_(knots)
        if self.missing:
            self.fill.copy_(torch.tensor([stats["median"][i] for i in self.missing],
                                         dtype=torch.float64))
        self.fitted, self.stats = True, stats

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.fitted = True  # a checkpoint holds the statistics it was trained with

    def forward(self, x_BF: torch.Tensor) -> torch.Tensor:
        if not self.fitted:
            raise RuntimeError(f"model.dense_norm={self.mode} is not fitted: "
                               f"call fit(train_dense_stats(...)) "
                               "or load a checkpoint first")
        miss_BM = None
        if self.missing:
            cols_BM = x_BF.index_select(1, self.missing_idx)
            miss_BM = torch.isnan(cols_BM)
            x_BF = x_BF.index_copy(1, self.missing_idx,
                                   torch.where(miss_BM, self.fill.to(x_BF.dtype), cols_BM))
        if self.mode == "signed_log":
            y_BF = signed_log(x_BF)
        elif self.mode == "standardize":
            y_BF = ((x_BF - self.mean) * self.inv_std).clamp(-_CLIP, _CLIP)
        else:
            y_BF = self._cdf(x_BF)
        return y_BF if miss_BM is None else torch.cat([y_BF, miss_BM.to(y_BF.dtype)], dim=1)

    def _cdf(self, x_BF: torch.Tensor) -> torch.Tensor:
        """Piecewise-linear empirical CDF per feature (ties: the middle of the tied knots), centred
        and scaled."""
        knots = self.knots.to(x_BF.dtype)  # [F, Q]
        Q = knots.shape[1]
        xt = x_BF.t().contiguous()  # [F, B]
        lo = torch.searchsorted(knots, xt, right=False)  # first knot >= x
        hi = torch.searchsorted(knots, xt, right=True)  # first knot > x
        i = hi.clamp(1, Q - 1)
        k0, k1 = knots.gather(1, i - 1), knots.gather(1, i)
        frac = ((xt - k0) / (k1 - k0).clamp(min=1e-12)).clamp(0.0, 1.0)
        interp = (i - 1).to(x_BF.dtype) + frac
        tied = hi > lo  # x equals one or more knots: the mean of their positions
        pos = torch.where(tied, (lo + hi - 1).to(x_BF.dtype) / 2, interp)
        u = pos / (Q - 1)  # [0, 1]
        return ((u - 0.5) * (2 * math.sqrt(3.0))).t()
