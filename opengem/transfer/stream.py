"""The students' rows: a split cut to their surfaces, each batch scored once by the teacher.

Legend: B rows, K keys of a KeyedJaggedTensor, N values.

ExFM's data augmentation service, in one process: every student's examples are one stream, the
teacher is called once per example, and each student reads its slice of the result::

    ShardLoader(split) ─► rows of the students' domains ─► teacher.predict ─► (Batch, TeacherOutput)

Row selection and history caps act on the collated, jagged ``Batch`` (never padded): selecting
rows [0, 2] of a key with lengths [2, 0, 3] keeps values [v0 v1 | v2 v3 v4] → lengths [2, 3].
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torchrec import KeyedJaggedTensor

from opengem.data.base_rates import RateCounter
from opengem.data.batch import Batch, keep_recent
from opengem.data.loader import ShardLoader
from opengem.data.parquet import DatasetManifest, read_shard
from opengem.features.schema import FeatureSchema


def select_kjt(kjt: KeyedJaggedTensor, rows: torch.Tensor) -> KeyedJaggedTensor:
    """The rows ``rows`` (sorted or not) of every key, jagged."""
    K = len(kjt.keys())
    if K == 0:
        return kjt
    B = kjt.stride()
    # key-major, as KJT lays out lengths
    flat = (torch.arange(K)[:, None] * B + rows[None, :]).reshape(-1)
    lens = kjt.lengths()[flat]
    starts = kjt.offsets()[flat]
    seg = torch.cumsum(lens, 0) - lens
    idx = torch.repeat_interleave(starts - seg, lens) + torch.arange(int(lens.sum()))
    return KeyedJaggedTensor.from_lengths_sync(keys=kjt.keys(), values=kjt.values()[idx],
                                               lengths=lens)


def select_rows(batch: Batch, rows: torch.Tensor) -> Batch:
    """The batch restricted to ``rows`` [R] (int64 indices)."""
    out = {}
    for f in dataclasses.fields(batch):
        x = getattr(batch, f.name)
        out[f.name] = (
            select_kjt(x, rows)
            if isinstance(x, KeyedJaggedTensor)
            else (None if x is None else x[rows])
        )
    return Batch(**out)


def _cap_kjt(kjt: KeyedJaggedTensor, caps: dict[str, int]) -> KeyedJaggedTensor:
    parts = kjt.to_dict()
    vals, lens = [], []
    for k in kjt.keys():  # noqa: SIM118 - a KJT is not a dict
        v, n = parts[k].values(), parts[k].lengths()
        cap = caps.get(k)
        if cap is not None and n.numel() and int(n.max()) > cap:
            idx, new = keep_recent(parts[k].offsets().numpy(), cap)  # the loader's own truncation
            v, n = v[torch.from_numpy(idx)], torch.from_numpy(new)
        vals.append(v)
        lens.append(n)
    return KeyedJaggedTensor.from_lengths_sync(keys=kjt.keys(), values=torch.cat(vals),
                                               lengths=torch.cat(lens))


def cap_history(batch: Batch, schema: FeatureSchema, caps: dict[str, int]) -> Batch:
    """Keep each stream's most recent ``caps[stream]`` events (a student with a shorter history
    limit than the teacher sees what its serving layout will give it)."""
    by_key = {}
    for s in schema.sequences:
        if s.name in caps:
            for col in [s.item_column, s.event_column] + [s.attribute_column(a)
                                                          for a in s.attributes]:
                by_key[col] = caps[s.name]
    if not by_key:
        return batch
    values = None if batch.seq_values is None else _cap_kjt(
        batch.seq_values, {c: caps[s.name] for s in schema.sequences if s.name in caps
                           for c in s.value_columns})
    return dataclasses.replace(batch, sequences=_cap_kjt(batch.sequences, by_key),
                               seq_age=_cap_kjt(batch.seq_age, {s: caps[s] for s in caps}),
                               seq_values=values)


def domain_ids(schema: FeatureSchema, names) -> list[int]:
    unknown = [n for n in names if n not in schema.domains.names]
    if unknown:
        raise ValueError(f"unknown domains {unknown}; the schema has {list(schema.domains.names)}")
    return [schema.domains.names.index(n) for n in names]


def slice_rates(data_dir: str | Path, schema: FeatureSchema, split: str,
                domains: list[int]) -> tuple[dict, int, int]:
    """(base rates of the split's rows on ``domains`` — NE's normaliser, slice rows, all rows),
    reading only the label and domain columns."""
    manifest = DatasetManifest.load(data_dir)
    counter = RateCounter(list(schema.domains.names), schema.task_names)
    cols = [schema.domains.column] + [t.label_column for t in schema.tasks]
    n_slice = n_all = 0
    for info in manifest.split_files(split):
        table = read_shard(data_dir, info, cols)
        dom = table.column(schema.domains.column).to_numpy()
        keep = np.isin(dom, domains)
        labels = np.stack(
            [
                table.column(t.label_column).to_numpy(zero_copy_only=False).astype(np.float64)
                for t in schema.tasks
            ],
            1,
        )
        mask = ~np.isnan(labels) & keep[:, None]
        counter.update(np.nan_to_num(labels), mask, dom)
        n_slice, n_all = n_slice + int(keep.sum()), n_all + len(dom)
    return counter.rates(), n_slice, n_all


def day_loader(data_dir: str | Path, days: list[int], batch_size: int, schema: FeatureSchema,
               **kw) -> ShardLoader:
    """A ``ShardLoader`` over the shards of ``days`` (whatever split they belong to)."""
    manifest = DatasetManifest.load(data_dir)
    loader = ShardLoader(data_dir, next(iter(manifest.splits)), batch_size, schema, **kw)
    loader.files = [f for f in manifest.files if f.day in set(days)]  # shard_order reads this list
    return loader


class SliceStream:
    """(Batch, TeacherOutput) pairs over ``split``'s rows of ``domains``; the teacher scores each
    row once.

    The teacher scores chunks of about ``teacher_batch`` of the students' rows (the loader reads
    ``teacher_batch · all / slice`` rows at a time), and the students step on consecutive pieces of
    ``batch_size`` rows of each chunk: a large model runs fastest on large batches (the ``demo`` GEM
    scores 128-row batches a third slower per row), a small one learns best from small ones.
    ``update_cache``: the
    teacher's user cache grows during training passes and is frozen on held-out days.
    ``warmup_days``: the teacher first scores the students' rows of that many days before the split
    (its own last days), so the user cache is filled before the students' first day, as a feature
    store would be.

    Chunks are cut per day (one loader per day): a teacher publishes its per-user tables when the
    day it is told changes, so a chunk straddling two days would put rows of the later day into the
    earlier day's table, and the rows after it would read their own day (a same-day leak). For a
    one-day split the batches are those of one loader over the split.
    """

    def __init__(self, data_dir: str | Path, split: str, schema: FeatureSchema, domains: list[int],
                 teacher, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 update_cache: bool = True, slice_rows: int | None = None,
                 all_rows: int | None = None, warmup_days: int = 0,
                 teacher_batch: int = 2048):
        if slice_rows is None or all_rows is None:
            _, slice_rows, all_rows = slice_rates(data_dir, schema, split, domains)
        self.rows, self.batch_size = slice_rows, batch_size
        chunk = max(teacher_batch, batch_size)
        self.read = max(1, math.ceil(chunk * all_rows / max(slice_rows, 1)))
        self.domains = torch.tensor(domains)
        self.all_domains = len(domains) == schema.num_domains
        self.teacher, self.update_cache = teacher, update_cache
        self.warm_calls = self.warm_rows = 0
        self.split_days = sorted(DatasetManifest.load(data_dir).splits[split])
        first = self.split_days[0]
        self.warm_days = list(range(max(0, first - warmup_days), first))
        # student steps per pass (for the lr schedules): every chunk ends in a partial piece, and a
        # day's last chunk is short, so there are at most ceil(all / read) + days − 1 chunks
        self.steps = (math.ceil(slice_rows / batch_size) + math.ceil(all_rows / self.read)
                      + len(self.split_days) - 1)
        self._loader_kw = {"max_seq_len": teacher.max_seq_len(), "prefetch": 2, "epochs": 1}
        self._data, self._schema, self._shuffle, self._seed = data_dir, schema, shuffle, seed

    def _slice(self, loader: ShardLoader) -> Iterator[Batch]:
        for batch in loader:
            if not self.all_domains:
                rows = torch.isin(batch.domain, self.domains).nonzero().squeeze(1)
                if rows.numel() == 0:
                    continue
                batch = select_rows(batch, rows)
            yield batch

    def _days(self, days: list[int], shuffle: bool) -> Iterator[tuple[Batch, int]]:
        for d in days:
            loader = day_loader(self._data, [d], self.read, self._schema, shuffle=shuffle,
                                seed=self._seed, **self._loader_kw)
            for batch in self._slice(loader):
                yield batch, d

    def batches(self) -> Iterator[tuple[Batch, int]]:
        """(chunk, day): the students' rows before the teacher (what
        ``cache_to_parquet`` consumes)."""
        yield from self._days(self.split_days, self._shuffle)

    def __iter__(self):
        calls, rows = self.teacher.calls, self.teacher.rows
        for batch, day in self._days(self.warm_days, False):
            self.teacher.predict(batch, True, day)
        self.warm_calls, self.warm_rows = self.teacher.calls - calls, self.teacher.rows - rows
        for chunk, day in self.batches():
            tout = self.teacher.predict(chunk, self.update_cache, day)
            n = chunk.batch_size
            if n <= self.batch_size:
                yield chunk, tout
                continue
            for lo in range(0, n, self.batch_size):
                idx = torch.arange(lo, min(lo + self.batch_size, n))
                yield select_rows(chunk, idx), tout.select(idx)
