"""Base rates: the mean label per task and per (domain, task) of a split, NE's normaliser.

They are counted from the label and domain columns alone, before any model exists (the trainer
records the training split's in ``RUN/base_rates.json``; distillation counts a student's slice), so
they sit with the data, below ``train/`` and ``evaluation/``. The checks of a labelled batch's
arrays (labels and mask ``[B, T]``, domains ``[B]``, names) are here for the same reason:
evaluation's ``MetricAccumulator`` applies the same ones.

Arrays may be torch tensors (detached and moved to CPU here) or numpy arrays. In multi-process
counting each rank updates with its own shard of the data and then calls ``reduce()`` once.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from opengem.data.parquet import DatasetManifest, read_shard
from opengem.features.schema import FeatureSchema

__all__ = ["ALL_DOMAIN", "RateCounter", "train_base_rates"]

# the pooled pseudo-domain of evaluation's "all/<task>" slices: no real domain may be named so
ALL_DOMAIN = "all"


# ------------------------------------------------------------------------------------- checks


def as_1d(x: Any, name: str) -> np.ndarray:
    """``x`` as a numpy array; ValueError unless it is 1-D."""
    arr = np.asarray(x)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    return arr


def check_labels(x: Any, name: str = "y") -> np.ndarray:
    """Return ``x`` as float64 1-D; raise ValueError unless every value is 0 or 1."""
    arr = as_1d(x, name)
    if arr.dtype.kind not in "biuf":
        raise ValueError(f"{name} must be numeric or bool, got dtype {arr.dtype}")
    arr = arr.astype(np.float64, copy=False)
    bad = ~((arr == 0.0) | (arr == 1.0))
    if bad.any():
        example = arr[np.flatnonzero(bad)[0]]
        raise ValueError(
            f"{name} (labels) must be 0 or 1; {int(bad.sum())} value(s) are not, e.g. {example}"
        )
    return arr


def to_numpy(x: Any, name: str) -> np.ndarray:
    """torch tensor or array-like -> numpy array (floats below 32 bits are widened to float32)."""
    if isinstance(x, torch.Tensor):
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.is_floating_point() and t.dtype not in (torch.float32, torch.float64):
            t = t.float()
        return t.numpy()
    arr = np.asarray(x)
    if arr.dtype.kind == "f" and arr.dtype.itemsize < 4:
        arr = arr.astype(np.float32)
    if arr.dtype.kind not in "biuf":
        raise ValueError(f"{name} must be numeric, got dtype {arr.dtype}")
    return arr


def as_2d(x: Any, name: str, num_tasks: int) -> np.ndarray:
    arr = to_numpy(x, name)
    if arr.ndim == 1 and num_tasks == 1:
        arr = arr[:, None]
    if arr.ndim != 2 or arr.shape[1] != num_tasks:
        raise ValueError(f"{name} must have shape [B, {num_tasks}] (one column per task), "
                         f"got {arr.shape}")
    return arr


def domain_index(domains: Any, batch: int, num_domains: int) -> np.ndarray:
    d = to_numpy(domains, "domains")
    if d.ndim != 1 or d.shape[0] != batch:
        raise ValueError(f"domains must have shape [{batch}], got {d.shape}")
    if d.dtype.kind == "f":
        if not np.all(np.isfinite(d)) or not np.all(d == np.round(d)):
            raise ValueError("domains must hold integer domain indices")
    elif d.dtype.kind not in "biu":
        raise ValueError(f"domains must be integer, got dtype {d.dtype}")
    d = d.astype(np.int64, copy=False)
    if d.size and (int(d.min()) < 0 or int(d.max()) >= num_domains):
        raise ValueError(
            f"domains must lie in [0, {num_domains}), got values in "
            f"[{int(d.min())}, {int(d.max())}]"
        )
    return d


def mask_2d(mask: Any, batch: int, num_tasks: int) -> np.ndarray:
    if mask is None:
        return np.ones((batch, num_tasks), dtype=bool)
    m = as_2d(mask, "mask", num_tasks)
    if m.shape[0] != batch:
        raise ValueError(f"mask has {m.shape[0]} rows but probs has {batch}")
    if m.dtype != np.bool_:
        if not np.all((m == 0) | (m == 1)):
            raise ValueError("mask must be boolean (or 0/1)")
        m = m.astype(bool)
    return m


def check_names(names: Sequence[str], what: str) -> list[str]:
    names = list(names)
    if not names:
        raise ValueError(f"{what} must not be empty")
    if any(not isinstance(n, str) or not n or "/" in n for n in names):
        raise ValueError(f"{what} must be non-empty strings without '/', got {names}")
    if len(set(names)) != len(names):
        raise ValueError(f"{what} contain duplicates: {names}")
    return names


def initialized_dist():
    """torch.distributed if it is available and initialised, else None."""
    return dist if dist.is_available() and dist.is_initialized() else None


# --------------------------------------------------------------------------------- counting


class RateCounter:
    """Label sums and counts per (domain, task): base rates without storing predictions.

    ``update(labels [B, T], mask [B, T], domains [B])``; ``rates()`` gives the mean label per
    ``"<task>"`` and ``"<domain>/<task>"`` in the same format as
    :meth:`MetricAccumulator.label_rates`, suitable as ``base_rates``.
    """

    def __init__(self, domain_names: Sequence[str], task_names: Sequence[str]) -> None:
        self.domain_names = check_names(domain_names, "domain_names")
        self.task_names = check_names(task_names, "task_names")
        if ALL_DOMAIN in self.domain_names:
            raise ValueError(f"domain name {ALL_DOMAIN!r} is reserved for the pooled pseudo-domain")
        self.reset()

    def reset(self) -> None:
        shape = (len(self.domain_names), len(self.task_names))
        self.sums = np.zeros(shape, dtype=np.float64)
        self.counts = np.zeros(shape, dtype=np.float64)
        self._reduced = False

    def update(self, labels: Any, mask: Any, domains: Any) -> None:
        """Add the labelled rows (``mask`` true) of one batch; masked-out labels are ignored."""
        if self._reduced:
            raise RuntimeError("update() after reduce(); call reset() to start over")
        num_t, num_d = len(self.task_names), len(self.domain_names)
        y = as_2d(labels, "labels", num_t)
        batch = y.shape[0]
        m = mask_2d(mask, batch, num_t)
        d = domain_index(domains, batch, num_d)
        for t, task in enumerate(self.task_names):
            rows = np.flatnonzero(m[:, t])
            if rows.size == 0:
                continue
            try:
                yc = check_labels(y[rows, t], "labels")
            except ValueError as e:
                raise ValueError(f"task {task!r}: {e}") from None
            self.sums[:, t] += np.bincount(d[rows], weights=yc, minlength=num_d)
            self.counts[:, t] += np.bincount(d[rows], minlength=num_d)

    def rates(self) -> dict[str, float]:
        """Mean label per ``"<task>"`` and per ``"<domain>/<task>"`` (slices with rows only)."""
        out: dict[str, float] = {}
        for t, task in enumerate(self.task_names):
            total = float(self.counts[:, t].sum())
            if total > 0:
                out[task] = float(self.sums[:, t].sum()) / total
            for di, domain in enumerate(self.domain_names):
                c = float(self.counts[di, t])
                if c > 0:
                    out[f"{domain}/{task}"] = float(self.sums[di, t]) / c
        return out

    def reduce(self, group: Any = None) -> None:
        """Sum the counters of all ranks (``all_reduce``); call once. No-op
        without torch.distributed."""
        if initialized_dist() is None:
            return
        if self._reduced:
            raise RuntimeError("reduce() was already called; call reset() to start over")
        buf = torch.from_numpy(np.stack([self.sums, self.counts]))
        if dist.get_backend(group) == "nccl":
            buf = buf.cuda()
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
        buf = buf.cpu().numpy()
        self.sums, self.counts = buf[0].copy(), buf[1].copy()
        self._reduced = True


def train_base_rates(data_dir: str | Path, schema: FeatureSchema, split: str,
                     rank: int = 0, world_size: int = 1) -> dict[str, float]:
    """Label means of the training split per task and per domain/task, reading only label columns
    (what ``RUN/base_rates.json`` holds).

    Rank r reads files r, r+W, …; the counts are summed over ranks (exact: they are integers)."""
    manifest = DatasetManifest.load(data_dir)
    counter = RateCounter(list(schema.domains.names), schema.task_names)
    cols = [schema.domains.column] + [t.label_column for t in schema.tasks]
    for info in manifest.split_files(split)[rank::world_size]:
        table = read_shard(data_dir, info, cols, schema)  # a wrong type is a DataError naming it
        labels = np.stack(
            [
                table.column(t.label_column).to_numpy(zero_copy_only=False).astype(np.float64)
                for t in schema.tasks
            ],
            1,
        )
        mask = ~np.isnan(labels) & ((labels == 0) | (labels == 1))
        counter.update(np.nan_to_num(labels), mask, table.column(schema.domains.column).to_numpy())
    if world_size > 1:
        counter.reduce()
    return counter.rates()
