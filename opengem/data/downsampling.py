"""Negative down-sampling of the training split, ads-style: every positive kept, a negative kept
with rate r.

Rare labels waste most of a step on rows that carry almost no gradient; production ads training
keeps every positive and a share r of the negatives, then corrects the predictions (He et al. 2014,
"Practical lessons from predicting clicks on ads at Facebook": negative down sampling).

What "negative" means with multi-task labels: a row is negative when **none of its labels is 1**
(missing labels are not positives). With the click → conversion chain (conversion ``requires``
click, and ``validate_rows`` quarantines a conversion without a click) this is exactly "click = 0",
so the sampling conditions on the base task only and ``p(conversion | click)`` is left as it was.
Rows whose labels are all missing are dropped at rate r too: they carry no loss.

The rate is per domain: ``rate`` for every domain, ``by_domain`` overriding some
(``data.negative_rate``, ``data.negative_rate_by_domain``). A negative of domain g is kept when
``u < r_g``, ``u`` the row's uniform draw from ``default_rng([seed, epoch, crc32(shard path),
TAG])`` over the shard's rows in file order: a pure function of (seed, epoch, shard, row
position), so

- a resumed loader rebuilds exactly the kept rows it had (its row cursor indexes the kept rows);
- every rank, at any world size, decides the same for the same row (the shard's path, not its
  position in one rank's order, names it);
- each epoch draws afresh, so later epochs see other negatives.

The correction of the predictions (``opengem.model.logit_shift.downsampling_offsets``): with
negatives kept at rate r the model learns odds × 1/r, so the calibrated probability is q = p / (p +
(1 − p)/w) with w = r (He et al.'s w is the sampling rate; 1/r is the weight a kept negative stands
for), i.e. logit(q) = logit(p) + log r on the base task's own logit (and 0 on a chained task's
conditional). ``rate = 1`` is off: no draw is made and the loader is bit-identical to one
without sampling.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from opengem.data.parquet import DatasetManifest, ShardInfo, read_shard
from opengem.features.schema import FeatureSchema

__all__ = ["NegativeSampler", "SampledCounts", "check_rate", "positive_rows"]

TAG = 0x5EED  # keeps these draws apart from the row permutations (same seed, epoch, shard)


def check_rate(rate: float, key: str) -> float:
    """``rate`` as a float in (0, 1]; ValueError naming ``key`` otherwise."""
    try:
        r = float(rate)
    except (TypeError, ValueError):
        raise ValueError(f"{key}: a negative rate must be a number in (0, 1], "
                         f"got {rate!r}") from None
    if not (0.0 < r <= 1.0) or math.isnan(r):
        raise ValueError(f"{key}: a negative rate must be in (0, 1] (1 = keep every negative), "
                         f"got {rate!r}")
    return r


def positive_rows(table: pa.Table, schema: FeatureSchema) -> np.ndarray:
    """[n] bool: rows with at least one label equal to 1 (the rows never dropped)."""
    pos = np.zeros(table.num_rows, dtype=bool)
    for t in schema.tasks:
        pos |= table.column(t.label_column).to_numpy(zero_copy_only=False).astype(np.float64) == 1.0
    return pos


@dataclass
class SampledCounts:
    """What the sampling keeps of a split: rows per shard and epoch, and label sums of epoch 0."""

    kept: dict[str, list[int]] = field(default_factory=dict)  # shard path → kept rows per epoch
    read: dict[str, int] = field(default_factory=dict)  # shard path → rows in the file
    # [T] positives kept in epoch 0 (all kept: positives are never dropped)
    label_sums: np.ndarray | None = None
    label_counts: np.ndarray | None = None  # [T] observed labels kept in epoch 0

    def sampled_rates(self, tasks: Sequence[str]) -> dict[str, float]:
        """Each task's label mean over the kept rows of epoch 0: the rate the training loss sees."""
        return {t: float(s / c) for t, s,
                c in zip(tasks, self.label_sums, self.label_counts) if c > 0}


class NegativeSampler:
    """The keep decision of the module docstring for one dataset's schema.

    Args:
        schema: the data's schema (tasks, domains).
        rate: r for every domain, in (0, 1].
        by_domain: {domain name: r} overriding ``rate``; an unknown name is a ValueError.
        seed: the loader's seed.
    """

    def __init__(self, schema: FeatureSchema, rate: float = 1.0,
                 by_domain: Mapping[str, float] | None = None,
                 seed: int = 0):
        self.schema, self.seed = schema, seed
        names = list(schema.domains.names)
        rates = np.full(schema.num_domains, check_rate(rate, "data.negative_rate"),
                        dtype=np.float64)
        for name, r in (by_domain or {}).items():
            if name not in names:
                raise ValueError(f"data.negative_rate_by_domain: unknown domain {name!r} "
                                 f"(domains: {names})")
            rates[names.index(name)] = check_rate(r, f"data.negative_rate_by_domain[{name!r}]")
        self.rates_G = rates

    @property
    def active(self) -> bool:
        return bool((self.rates_G < 1.0).any())

    def rates(self) -> dict[str, float]:
        """{domain name: r}."""
        return {n: float(r) for n, r in zip(self.schema.domains.names, self.rates_G)}

    def keep(self, table: pa.Table, path: str, epoch: int) -> np.ndarray:
        """[n] bool over ``table``'s rows, the shard at ``path`` in file order: positives, and the
        negatives whose draw falls under their domain's rate."""
        n = table.num_rows
        u = np.random.default_rng([self.seed, epoch, zlib.crc32(path.encode()), TAG]).random(n)
        dom = table.column(self.schema.domains.column).to_numpy(zero_copy_only=False)
        dom = np.clip(np.nan_to_num(dom.astype(np.float64)), 0,
                      self.schema.num_domains - 1).astype(np.int64)
        # out-of-range rows are quarantined anyway
        return positive_rows(table, self.schema) | (u < self.rates_G[dom])

    def count(self, data_dir: str | Path, files: Sequence[ShardInfo], epochs: int) -> SampledCounts:
        """Kept rows of ``files`` per epoch, reading only their label and domain columns.

        Quarantined rows are counted as the file has them (the loader drops them after sampling),
        so a count can exceed the rows the loader hands out by the quarantined ones."""
        cols = [self.schema.domains.column] + [t.label_column for t in self.schema.tasks]
        out = SampledCounts(label_sums=np.zeros(len(self.schema.tasks)),
                            label_counts=np.zeros(len(self.schema.tasks)))
        for info in files:
            table = read_shard(data_dir, info, cols, self.schema)
            out.read[info.path] = table.num_rows
            keeps = [self.keep(table, info.path, e) for e in range(epochs)]
            out.kept[info.path] = [int(k.sum()) for k in keeps]
            for t, task in enumerate(self.schema.tasks):
                y = (
                    table.column(task.label_column)
                    .to_numpy(zero_copy_only=False)
                    .astype(np.float64)[keeps[0]]
                )
                seen = (y == 0) | (y == 1)
                out.label_sums[t] += float((y[seen] == 1).sum())
                out.label_counts[t] += float(seen.sum())
        return out

    def count_split(self, data_dir: str | Path, split: str, epochs: int = 1) -> SampledCounts:
        return self.count(data_dir, DatasetManifest.load(data_dir).split_files(split), epochs)
