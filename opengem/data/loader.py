"""Iterable, per-rank, resumable loader over a dataset's Parquet shards.

Order: epoch by epoch; inside an epoch, days in order (one-pass, time-ordered training as in
online ads training), the shards of one day in a seeded random order, and the rows of each shard
in a seeded random permutation. Rank ``r`` of ``W`` reads shards ``r, r+W, …`` of that order, so no
rank ever reads (or holds) another rank's shards, and only one shard is in memory at a time.
Layout v2 datasets (``opengem.data.events``) join each shard with its user bucket's event logs as it
is read (the bucket's files, nothing else: the join is local), so both layouts yield the
same batches.

``state_dict()`` is the position after the last row handed out: (epoch, shard cursor, row cursor).
Loading it and iterating yields exactly the rows not yet yielded, in the same order and batching
as an uninterrupted run, because every permutation is a pure function of (seed, epoch, shard).

Bad rows are quarantined by ``validate_rows`` before collate: counted per reason, logged, and (if
``quarantine_dir`` is set) written to a Parquet side file with a ``reason`` column. A shard's counts
join ``quarantined`` with the first batch handed out after it is read (not when a prefetching
thread reads it), so a checkpointed position and its counts agree and a resume counts nothing twice.

Negative down-sampling (``negative_rate`` < 1, training split only: ``opengem.data.downsampling``)
drops negatives of a shard right after validation, before the permutation: the kept rows are a pure
function of (seed, epoch, shard path, row position), so the row cursor of ``state_dict()`` indexes
the same kept rows on resume, and the permutation is over them.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from opengem.data.batch import Batch, CollateStats, collate, validate_rows
from opengem.data.downsampling import NegativeSampler
from opengem.data.events import ShardReader
from opengem.data.parquet import DatasetManifest, ShardInfo
from opengem.features.schema import FeatureSchema

log = logging.getLogger(__name__)


def split_files(manifest: DatasetManifest, split: str) -> list[ShardInfo]:
    """The split's shards in the order an unshuffled loader reads them on one process (days in
    order, a day's shards as listed), so a row index means the same row to every reader."""
    files = manifest.split_files(split)
    return [f for day in sorted({f.day for f in files}) for f in files if f.day == day]


def read_split(data_dir: str | Path, schema: FeatureSchema, split: str) -> pa.Table:
    """Every row of ``split`` with histories joined (v2) as list columns, in ``split_files``
    order: for readers that need the rows' columns beside the model's scores of them."""
    manifest = DatasetManifest.load(data_dir)
    reader = ShardReader(data_dir, manifest, schema)
    return pa.concat_tables([reader.read(f, schema.columns())
                             for f in split_files(manifest, split)])


class ShardLoader:
    """Batches of one split for one rank, in the order the module docstring gives; resumable.

    Args:
        data_dir: a dataset directory (``dataset.json``, ``schema.json``, the shards).
        split: ``train`` | ``valid`` | ``test`` (days listed in the manifest).
        batch_size: rows per ``Batch``; a batch may span shards, and the last one is short unless
            ``drop_last``.
        schema: the data's schema (default: ``data_dir``'s).
        rank, world_size: this rank reads shards ``rank, rank + world_size, …`` of each epoch's order.
        shuffle, seed, epochs: seeded shard and row permutations; passes over the split.
        max_seq_len: stream → history cap (most recent kept), at most the schema's ``max_len``.
        quarantine_dir: where bad rows are written (they are always counted in ``quarantined``).
        prefetch: batches collated ahead on a thread (0: none).
        negative_rate, negative_rate_by_domain: keep every row with a positive label and a negative
            with this rate (per domain name where the map says); 1 = off (``opengem.data.downsampling``).

    Iterating yields ``Batch`` objects: sparse and sequences as KeyedJaggedTensors (jagged, never
    padded), dense [B, F], labels and mask [B, T], domain [B]. ``state_dict()`` /
    ``load_state_dict()`` give and restore the position after the last batch handed out.
    """

    def __init__(
        self,
        data_dir: str | Path,
        split: str,
        batch_size: int,
        schema: FeatureSchema | None = None,
        *,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        epochs: int = 1,
        drop_last: bool = False,
        max_seq_len: dict[str, int] | None = None,
        quarantine_dir: str | Path | None = None,
        prefetch: int = 0,
        negative_rate: float = 1.0,
        negative_rate_by_domain: dict[str, float] | None = None,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, {world_size})")
        self.data_dir = Path(data_dir)
        self.schema = schema or FeatureSchema.load(self.data_dir)
        self.manifest = DatasetManifest.load(self.data_dir)
        self.split = split
        self.files = self.manifest.split_files(split)
        if not self.files:
            raise ValueError(f"{data_dir}: split {split!r} has no shards")
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.shuffle, self.seed, self.epochs, self.drop_last = shuffle, seed, epochs, drop_last
        self.max_seq_len = max_seq_len
        self.quarantine_dir = Path(quarantine_dir) if quarantine_dir else None
        self.prefetch = prefetch
        self.columns = [c for c in self.schema.columns() if c]
        self.reader = ShardReader(self.data_dir, self.manifest, self.schema)
        self.stats = CollateStats()
        self.quarantined: Counter = Counter()
        self._pos = {"epoch": 0, "shard": 0, "row": 0}
        sampler = NegativeSampler(self.schema, negative_rate, negative_rate_by_domain, seed)
        self.sampler = sampler if sampler.active else None

    # ------------------------------------------------------------------ order
    def shard_order(self, epoch: int) -> list[ShardInfo]:
        """This rank's shards for ``epoch``: days in order, shards of a day shuffled,
        then strided."""
        out: list[ShardInfo] = []
        days = sorted({f.day for f in self.files})
        for day in days:
            group = [f for f in self.files if f.day == day]
            if self.shuffle:
                perm = np.random.default_rng([self.seed, epoch, day]).permutation(len(group))
                group = [group[i] for i in perm]
            out += group
        return out[self.rank :: self.world_size]

    def _rows(self, epoch: int, shard_idx: int, n: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch, shard_idx, 7919]).permutation(n)

    @property
    def rows_per_epoch(self) -> int:
        return sum(f.rows for f in self.shard_order(0))

    def planned_rows(self, epochs: int) -> list[int]:
        """This rank's rows per epoch: the files' rows, or with down-sampling the kept ones (counted
        from the label columns; quarantined rows are in both counts)."""
        if self.sampler is None:
            return [sum(f.rows for f in self.shard_order(e)) for e in range(epochs)]
        counts = self.sampler.count(self.data_dir, self.shard_order(0), epochs).kept
        return [sum(counts[f.path][e] for f in self.shard_order(e)) for e in range(epochs)]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {**self._pos, "seed": self.seed, "split": self.split, "rank": self.rank,
                "world_size": self.world_size, "quarantined": dict(self.quarantined),
                "repaired": self.stats.as_dict()}

    def load_state_dict(self, state: dict) -> None:
        if (state.get("seed"), state.get("split")) != (self.seed, self.split):
            raise ValueError(f"loader state is for "
                             f"seed/split {state.get('seed')}/{state.get('split')}, "
                             f"this loader is {self.seed}/{self.split}")
        self._pos = {k: int(state[k]) for k in ("epoch", "shard", "row")}
        self.quarantined = Counter(state.get("quarantined", {}))
        self.stats = CollateStats.from_dict(state.get("repaired", {}))

    # ------------------------------------------------------------------ reading
    def _read(self, info: ShardInfo, epoch: int) -> tuple[pa.Table, Counter]:
        """The shard's valid rows and the count of its quarantined rows per reason (epoch 0 only:
        later epochs read the same rows)."""
        table = self.reader.read(info, self.columns)
        keep, reasons, row_reason = validate_rows(table, self.schema)
        found: Counter = Counter()
        if reasons and epoch == 0:
            for reason, n in reasons:
                found[reason] += n
                log.warning("%s: quarantined %d rows: %s", info.path, n, reason)
            self._write_quarantine(table, keep, row_reason, info)
        if self.sampler is not None:  # after validation: a bad row is quarantined whatever its draw
            keep = keep & self.sampler.keep(table, info.path, epoch)
        # Quarantined rows are removed before the permutation, so positions stay deterministic.
        return (table.filter(pa.array(keep)) if not keep.all() else table), found

    def _write_quarantine(self, table: pa.Table, keep: np.ndarray, row_reason: np.ndarray,
                          info: ShardInfo) -> None:
        if self.quarantine_dir is None:
            return
        self.quarantine_dir.mkdir(parents=True, exist_ok=True)
        rows = table.filter(pa.array(~keep))
        rows = rows.append_column("quarantine_reason",
                                  pa.array(list(row_reason[~keep]), pa.string()))
        rows = rows.append_column("quarantine_shard", pa.array([info.path] * rows.num_rows))
        pq.write_table(rows,
                       self.quarantine_dir / f"{Path(info.path).stem}-rank{self.rank}.parquet")

    def _batches(self) -> Iterator[tuple[pa.Table | None, dict, Counter]]:
        """Yields (rows, position after them, quarantine counts to add then); rows may span shards.
        A last item with rows None carries counts no batch did (shards with no valid row at
        the end)."""
        pending: list[pa.Table] = []
        n_pending = 0
        epoch, shard, row = self._pos["epoch"], self._pos["shard"], self._pos["row"]
        pos, counts = dict(self._pos), Counter()
        while epoch < self.epochs:
            order = self.shard_order(epoch)
            while shard < len(order):
                table, found = self._read(order[shard], epoch)
                if row == 0:  # a shard resumed mid-way was counted before the checkpoint
                    counts += found
                perm = self._rows(epoch, shard, table.num_rows)
                while row < table.num_rows:
                    take = min(self.batch_size - n_pending, table.num_rows - row)
                    pending.append(table.take(pa.array(perm[row : row + take])))
                    n_pending += take
                    row += take
                    if n_pending == self.batch_size:
                        pos = _next_pos(epoch, shard, row, table.num_rows, len(order))
                        yield _concat(pending), pos, counts
                        pending, n_pending, counts = [], 0, Counter()
                shard, row = shard + 1, 0
            epoch, shard = epoch + 1, 0
        if pending and not self.drop_last:
            yield _concat(pending), {"epoch": self.epochs, "shard": 0, "row": 0}, counts
        elif counts:
            yield None, pos, counts

    def __iter__(self) -> Iterator[Batch]:
        def make(rows: pa.Table | None, pos: dict, counts: Counter) -> tuple:
            stats = CollateStats()
            batch = None if rows is None else collate(rows, self.schema, self.max_seq_len, stats)
            return batch, stats, pos, counts

        items = (
            (make(*x) for x in self._batches()) if self.prefetch <= 0 else self._prefetched(make)
        )
        try:
            # The position and both counters advance together, when a batch is handed out.
            for batch, stats, pos, counts in items:
                self._pos = pos
                self.quarantined += counts
                for what in self.stats.add(stats):
                    # cutting histories to the recipe's length is what it asks for; ids out of the
                    # vocab are not
                    level = logging.INFO if what.startswith("truncated_rows") else logging.WARNING
                    log.log(level, "repairing %s (counted in the run's 'repaired' summary)", what)
                if batch is not None:
                    yield batch
        finally:
            items.close()

    def _prefetched(self, make) -> Iterator[tuple]:
        # Arrow and numpy release the GIL, so collating the next batch overlaps the training step.
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        done = object()

        def work() -> None:
            try:
                for item in self._batches():
                    if stop.is_set():
                        return
                    q.put(make(*item))
                q.put(done)
            except BaseException as e:  # surfaced in the consumer, never swallowed
                q.put(e)

        t = threading.Thread(target=work, daemon=True)
        t.start()
        try:
            while True:
                item = q.get()
                if item is done:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            while t.is_alive():
                try:
                    q.get_nowait()
                except queue.Empty:
                    t.join(timeout=0.05)


def _next_pos(epoch: int, shard: int, row: int, n_rows: int, n_shards: int) -> dict:
    if row < n_rows:
        return {"epoch": epoch, "shard": shard, "row": row}
    if shard + 1 < n_shards:
        return {"epoch": epoch, "shard": shard + 1, "row": 0}
    return {"epoch": epoch + 1, "shard": 0, "row": 0}


def _concat(tables: list[pa.Table]) -> pa.Table:
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables)
