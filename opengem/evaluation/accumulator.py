"""Streaming evaluation state per (domain, task), with multi-process reduction.

:class:`MetricAccumulator` keeps the raw predictions of every labelled row, split by
(domain, task), because the exact metrics (AUC, gAUC) cannot be computed from running sums. Rows are
appended as numpy chunks and concatenated lazily. Besides the real domains, every task has an
``"all"`` pseudo-domain that pools all domains; it is reported as ``"all/<task>"`` and computed from
the per-domain arrays (nothing is stored twice).

Base rates without stored predictions (what the trainer records, NE's normaliser) are counted by
``opengem.data.base_rates.RateCounter``, which applies the same input checks.

It accepts torch tensors (detached and moved to CPU here) or numpy arrays. In multi-process
evaluation each rank updates with its own shard of the data and then calls ``reduce()`` once; after
that every rank holds the global state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from opengem.data.base_rates import (
    ALL_DOMAIN,
    as_2d,
    check_labels,
    check_names,
    domain_index,
    initialized_dist,
    mask_2d,
    to_numpy,
)
from opengem.evaluation.metrics import _check_probs, reliability_bins, summarize

__all__ = ["ALL_DOMAIN", "MetricAccumulator"]


# -------------------------------------------------------------------------- MetricAccumulator


class _Slice:
    """Growing numpy chunks of one (domain, task): predictions, labels, groups, true probs."""

    __slots__ = ("p", "y", "g", "pt")

    def __init__(self) -> None:
        self.p: list[np.ndarray] = []
        self.y: list[np.ndarray] = []
        self.g: list[np.ndarray] = []
        self.pt: list[np.ndarray] = []

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Concatenate (once; the result replaces the chunks) and return (p, y, groups, p_true)."""
        for field in self.__slots__:
            chunks = getattr(self, field)
            if len(chunks) > 1:
                setattr(self, field, [np.concatenate(chunks)])
        p = self.p[0] if self.p else np.zeros(0, np.float32)
        y = self.y[0] if self.y else np.zeros(0, np.int8)
        g = self.g[0] if self.g else None
        pt = self.pt[0] if self.pt else None
        return p, y, g, pt

    def __len__(self) -> int:
        return sum(c.shape[0] for c in self.p)


class MetricAccumulator:
    """Collects (prediction, label) rows per (domain, task) and computes exact metrics.

    Args:
        domain_names: names of the domains (surfaces); ``domains`` in :meth:`update` index this list.
            ``"all"`` is reserved for the pooled pseudo-domain.
        task_names: names of the tasks; column ``t`` of ``probs``/``labels``/``mask`` is task ``t``.
        base_rates: training positive rates for NE. A key ``"<task>"`` applies to every domain of the
            task (and to ``"all/<task>"``); a key ``"<domain>/<task>"`` (``domain`` may be ``"all"``)
            takes precedence for that slice. Every slice must resolve to a rate (ValueError
            otherwise) and unknown keys are rejected. ``None``: each slice is normalised by its own
            evaluated label rate and reported with ``"base_rate_source": "eval"``.

    A rate of exactly 0 or 1 (e.g. a domain without training positives, or an evaluated slice with a
    single class) makes NE undefined; the slice then reports ``ne`` (and ``ne_bayes``, ``captured``)
    as NaN instead of failing the whole evaluation.
    """

    def __init__(
        self,
        domain_names: Sequence[str],
        task_names: Sequence[str],
        base_rates: Mapping[str, float] | None = None,
    ) -> None:
        self.domain_names = check_names(domain_names, "domain_names")
        self.task_names = check_names(task_names, "task_names")
        if ALL_DOMAIN in self.domain_names:
            raise ValueError(f"domain name {ALL_DOMAIN!r} is reserved for the pooled pseudo-domain")
        self.base_rates = None if base_rates is None else self._check_base_rates(base_rates)
        self.reset()

    # -- configuration -------------------------------------------------------------------------

    def _check_base_rates(self, base_rates: Mapping[str, float]) -> dict[str, float]:
        domains = [*self.domain_names, ALL_DOMAIN]
        known = set(self.task_names) | {f"{d}/{t}" for d in domains for t in self.task_names}
        out: dict[str, float] = {}
        for key, value in base_rates.items():
            if key not in known:
                raise ValueError(
                    f"base_rates has unknown key {key!r}; expected '<task>' or '<domain>/<task>' "
                    f"with tasks {self.task_names} and domains {domains}"
                )
            try:
                r = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"base_rates[{key!r}] must be a number, got {value!r}") from None
            if not (0.0 <= r <= 1.0):  # also rejects NaN
                raise ValueError(f"base_rates[{key!r}] must lie in [0, 1], got {value!r}")
            out[key] = r
        missing = [
            f"{d}/{t}"
            for t in self.task_names
            for d in domains
            if t not in out and f"{d}/{t}" not in out
        ]
        if missing:
            raise ValueError(f"base_rates has no rate for {missing} (give '<task>' "
                             f"or '<domain>/<task>')")
        return out

    def reset(self) -> None:
        """Forget every stored row (and the reduced state)."""
        self._slices = {
            (d, t): _Slice() for d in range(len(self.domain_names))
            for t in range(len(self.task_names))
        }
        self._has_groups: bool | None = None  # decided by the first update
        self._has_true: bool | None = None
        self._reduced = False

    # -- update --------------------------------------------------------------------------------

    def update(
        self,
        probs: Any,
        labels: Any,
        mask: Any,
        domains: Any,
        groups: Any = None,
        true_probs: Any = None,
    ) -> None:
        """Add one batch.

        Args:
            probs: ``[B, T]`` predicted probabilities (``[B]`` allowed when T == 1).
            labels: ``[B, T]`` 0/1 labels; entries where ``mask`` is false are ignored (may be
                anything, e.g. NaN or -1).
            mask: ``[B, T]`` bool, true where the row has a label for the task; None = all true.
            domains: ``[B]`` integer domain index of each row.
            groups: ``[B]`` integer group (user) id of each row, for gAUC; None = no gAUC.
            true_probs: ``[B, T]`` probabilities the labels were drawn with (synthetic data), for
                ``ne_bayes`` / ``captured``; None if unknown.

        Whether ``groups`` / ``true_probs`` are given must be the same in every call.
        """
        if self._reduced:
            raise RuntimeError("update() after reduce(); call reset() to start a new evaluation")
        num_t = len(self.task_names)
        p = as_2d(probs, "probs", num_t)
        batch = p.shape[0]
        y = as_2d(labels, "labels", num_t)
        if y.shape[0] != batch:
            raise ValueError(f"labels has {y.shape[0]} rows but probs has {batch}")
        m = mask_2d(mask, batch, num_t)
        d = domain_index(domains, batch, len(self.domain_names))
        g = None
        if groups is not None:
            g = to_numpy(groups, "groups")
            if g.ndim != 1 or g.shape[0] != batch:
                raise ValueError(f"groups must have shape [{batch}], got {g.shape}")
            if g.dtype.kind == "f" and np.isnan(g).any():
                raise ValueError("groups contains NaN")
        pt = None
        if true_probs is not None:
            pt = as_2d(true_probs, "true_probs", num_t)
            if pt.shape[0] != batch:
                raise ValueError(f"true_probs has {pt.shape[0]} rows but probs has {batch}")
        has_groups = self._consistent(self._has_groups, g is not None, "groups")
        has_true = self._consistent(self._has_true, pt is not None, "true_probs")

        # Select and validate every task first, so that a bad batch stores nothing.
        kept = []
        for t, task in enumerate(self.task_names):
            rows = np.flatnonzero(m[:, t])
            if rows.size == 0:
                continue
            pc, yc = p[rows, t], y[rows, t]
            ptc = None if pt is None else pt[rows, t]
            try:  # masked-out entries are not looked at: they may hold anything
                _check_probs(pc, "probs")
                yc = check_labels(yc, "labels").astype(np.int8)
                if ptc is not None:
                    ptc = _check_probs(ptc, "true_probs")
            except ValueError as e:
                raise ValueError(f"task {task!r}: {e}") from None
            if pc.dtype.kind != "f":
                pc = pc.astype(np.float64)
            kept.append((t, rows, pc, yc, ptc))
        self._has_groups, self._has_true = has_groups, has_true

        for t, rows, pc, yc, ptc in kept:
            gc = None if g is None else g[rows]
            dc = d[rows]
            for di in np.unique(dc):
                sel = dc == di
                sl = self._slices[(int(di), t)]
                sl.p.append(pc[sel])
                sl.y.append(yc[sel])
                if gc is not None:
                    sl.g.append(gc[sel])
                if ptc is not None:
                    sl.pt.append(ptc[sel])

    @staticmethod
    def _consistent(current: bool | None, given: bool, name: str) -> bool:
        if current is not None and current != given:
            raise ValueError(
                f"{name} must be given in every update() or in none "
                f"(earlier calls {'did' if current else 'did not'} pass it)"
            )
        return given

    # -- reading -------------------------------------------------------------------------------

    def _slice_arrays(self, domain: str, t: int):
        """(p, y, groups, p_true) of one slice; ``domain == "all"`` pools every domain."""
        if domain != ALL_DOMAIN:
            return self._slices[(self.domain_names.index(domain), t)].arrays()
        parts = [self._slices[(di, t)].arrays() for di in range(len(self.domain_names))]
        parts = [x for x in parts if x[0].shape[0] > 0]
        if not parts:
            return np.zeros(0, np.float32), np.zeros(0, np.int8), None, None
        if len(parts) == 1:
            return parts[0]
        p = np.concatenate([x[0] for x in parts])
        y = np.concatenate([x[1] for x in parts])
        g = np.concatenate([x[2] for x in parts]) if self._has_groups else None
        pt = np.concatenate([x[3] for x in parts]) if self._has_true else None
        return p, y, g, pt

    def _keys(self):
        for domain in [*self.domain_names, ALL_DOMAIN]:
            for t, task in enumerate(self.task_names):
                yield domain, t, task

    def calibration_bins(self, n_bins: int = 20, min_rows: int = 100) -> dict[str, dict[str, list]]:
        """Reliability bins (equal-count) per ``"<domain>/<task>"`` and ``"all/<task>"``: ``{"p",
        "y", "n"}``; a slice of few rows gets fewer bins (≥ ``min_rows`` rows each, one at
        the least)."""
        out = {}
        for domain, t, task in self._keys():
            p, y, _, _ = self._slice_arrays(domain, t)
            if p.shape[0]:
                out[f"{domain}/{task}"] = reliability_bins(
                    p, y, max(1, min(n_bins, p.shape[0] // min_rows))
                )
        return out

    def num_rows(self) -> dict[str, int]:
        """Stored rows per ``"<domain>/<task>"`` (including ``"all/<task>"``)."""
        out = {}
        for domain, t, task in self._keys():
            if domain == ALL_DOMAIN:
                out[f"{domain}/{task}"] = sum(len(self._slices[(di, t)])
                                              for di in range(len(self.domain_names)))
            else:
                out[f"{domain}/{task}"] = len(self._slices[(self.domain_names.index(domain), t)])
        return out

    def _base_rate(self, domain: str, task: str, y: np.ndarray) -> tuple[float, str]:
        if self.base_rates is None:
            return float(y.mean()), "eval"
        key = f"{domain}/{task}"
        return (self.base_rates[key] if key in self.base_rates else self.base_rates[task]), "train"

    def compute(self) -> dict[str, dict[str, Any]]:
        """Metrics per ``"<domain>/<task>"`` and ``"all/<task>"``, for slices with at least one row.

        Each entry is :func:`opengem.evaluation.metrics.summarize` plus ``base_rate`` (the NE
        normaliser) and ``base_rate_source`` (``"train"`` or ``"eval"``).
        """
        out: dict[str, dict[str, Any]] = {}
        for domain, t, task in self._keys():
            p, y, g, pt = self._slice_arrays(domain, t)
            if p.shape[0] == 0:
                continue
            rate, source = self._base_rate(domain, task, y)
            usable = rate if 0.0 < rate < 1.0 else None
            entry: dict[str, Any] = summarize(p, y, usable, groups=g, p_true=pt)
            entry["base_rate"] = float(rate)
            entry["base_rate_source"] = source
            out[f"{domain}/{task}"] = entry
        return out

    def label_rates(self) -> dict[str, float]:
        """Mean label per ``"<task>"`` (all domains pooled) and per ``"<domain>/<task>"``.

        Only slices with rows appear. The result can be passed as ``base_rates`` of another
        accumulator (it is how training base rates are recorded when predictions are kept anyway;
        otherwise use ``opengem.data.base_rates.RateCounter``).
        """
        out: dict[str, float] = {}
        for domain, t, task in self._keys():
            _, y, _, _ = self._slice_arrays(domain, t)
            if y.shape[0]:
                out[task if domain == ALL_DOMAIN else f"{domain}/{task}"] = float(y.mean())
        return out

    # -- distributed ---------------------------------------------------------------------------

    def reduce(self, group: Any = None) -> None:
        """Gather every rank's rows so that :meth:`compute` on each rank covers the whole data set.

        Uses ``torch.distributed.all_gather_object`` (works with gloo; ranks may hold different
        numbers of rows, including none). Rows are concatenated in rank order. Every rank then holds
        all rows, so memory grows to the global size; call once, after the last update (a second
        call, or update() after it, raises RuntimeError). No-op when torch.distributed is not
        initialised. With NCCL, ``torch.cuda.set_device`` must have been called (as
        all_gather_object requires).
        """
        dist = initialized_dist()
        if dist is None:
            return
        if self._reduced:
            raise RuntimeError("reduce() was already called; call reset() to start a "
                               "new evaluation")
        payload = {
            "has_groups": self._has_groups,
            "has_true": self._has_true,
            "slices": {key: sl.arrays() for key, sl in self._slices.items() if len(sl)},
        }
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, payload, group=group)

        flags = {}
        for name in ("has_groups", "has_true"):
            seen = {r[name] for r in gathered if r[name] is not None}
            if len(seen) > 1:
                raise ValueError(f"ranks disagree on whether {name[4:]} were given to update()")
            flags[name] = seen.pop() if seen else None
        self._has_groups, self._has_true = flags["has_groups"], flags["has_true"]

        slices = {key: _Slice() for key in self._slices}
        for rank_payload in gathered:
            for key, (p, y, g, pt) in rank_payload["slices"].items():
                sl = slices[key]
                sl.p.append(p)
                sl.y.append(y)
                if g is not None:
                    sl.g.append(g)
                if pt is not None:
                    sl.pt.append(pt)
        self._slices = slices
        self._reduced = True
