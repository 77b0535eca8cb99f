"""Dataset layout v2: per-stream event logs stored once per user, joined to impressions at
read time.

Layout 1 copies each user's whole history into every impression row; layout 2 writes each event once
(``docs/dataset-layout.md`` is the contract)::

    DIR/shards/<name>.parquet                         impressions, no history columns; the manifest
                                                      gives each shard's user ``bucket``
    DIR/events/<stream>/bucket=<b>/<part>.parquet     user_id, ts, item, event, <attribute>…,
                                                      <value>… (floats); sorted by (user_id, ts); a
                                                      bucket's parts, in manifest order, are its log

A row's history of a stream is its user's events with ``ts`` strictly before ``request_ts``, the
newest ``max_len`` of them, in log order: exactly what the synthetic world stores in a v1 row (its
``UserBlock.history`` is a left ``searchsorted``, so an event at the request's own second is left
out, and ``validate_rows`` quarantines v1 rows that hold one). Events at equal ``ts`` keep their
log order.

``ShardReader.read`` returns a v1-shaped table (history list columns rebuilt) for either layout, so
``validate_rows``, ``collate`` and the quarantine side files see the same rows whatever the layout.
Legend: E events of a bucket, Q impression rows of a shard.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from opengem.data.parquet import (  # noqa: F401 (TS, event_columns: re-exported, their home is the layout's)
    LAYOUT_V2,
    TS,
    DataError,
    DatasetManifest,
    EventFileInfo,
    ShardInfo,
    event_columns,
    read_shard,
    stream_columns,
)
from opengem.features.schema import FeatureSchema, SequenceStream


def history_column(stream: SequenceStream, col: str) -> str:
    """The v1 list column an event log column becomes (``ts`` → ``<stream>.ts``, ``item``
    → ``<stream>.item``)."""
    return f"{stream.name}.{col}"


@dataclass
class BucketEvents:
    """One bucket's log of one stream: user and ts as numpy [E], the other columns as Arrow [E]."""

    user: np.ndarray
    ts: np.ndarray
    # event-log column name → values (nulls kept: validate_rows sees them)
    columns: dict[str, pa.Array]
    _index: tuple | None = None

    def end_before(self, user: np.ndarray, t: np.ndarray) -> np.ndarray:
        """``events_before`` for queries [Q]; a bucket serves many shards, so its search index is
        built once."""
        if not len(self.user):
            return np.zeros(len(user), dtype=np.int64)
        if self._index is None:
            self._index = _search_index(self.user, self.ts)
        if self._index == ():  # keys would overflow int64: the general (per-shard lexsort) path
            return events_before(self.user, self.ts, user, t)
        users, first, key, tmin, span = self._index
        g = np.searchsorted(users, user)
        found = (g < len(users)) & (users[np.minimum(g, len(users) - 1)] == user)
        q = g * span + np.clip(t - tmin, 0, span - 1)
        return np.where(found, np.searchsorted(key, q, side="left"), first[g])


def _search_index(user: np.ndarray, ts: np.ndarray) -> tuple:
    """(distinct users, their first event [U+1], key [E], tmin, span): key = user index × span + (ts
    − tmin) is sorted because the log is, so a (user, t) query is one searchsorted; () if keys
    overflow int64."""
    users, first = np.unique(user, return_index=True)
    # span − 1 stands for "after every event"
    tmin, span = int(ts.min()), int(ts.max()) - int(ts.min()) + 2
    if len(users) * span >= 2**62:
        return ()
    g = np.repeat(np.arange(len(users), dtype=np.int64), np.diff(np.r_[first, len(user)]))
    return users, np.r_[first, len(user)].astype(np.int64), g * span + (ts - tmin), tmin, span


def read_bucket(data_dir: str | Path, files: list[EventFileInfo], schema: FeatureSchema,
                stream: SequenceStream) -> BucketEvents:
    """Read and check one bucket's event files. A missing or non-integer column (a value column:
    non-numeric), a null user or time, or a log not sorted by (user, ts) is a ``DataError`` naming
    the file, column and value: the join would otherwise hand out wrong histories silently. Value
    columns come back as float32 whatever the file held, so every shard's joined lists have one
    type (a NaN stays: ``validate_rows`` quarantines the rows whose history holds it)."""
    cols = event_columns(schema, stream)
    values = set(stream.values)
    tables = []
    for f in files:
        t = read_shard(data_dir, f, cols)
        bad = [f"column {c!r} is {t.schema.field(c).type}, expected integers" for c in cols
               if c not in values and not pa.types.is_integer(t.schema.field(c).type)]
        bad += [f"column {c!r} is {t.schema.field(c).type}, expected numbers" for c in cols
                if c in values and not (pa.types.is_integer(t.schema.field(c).type)
                                        or pa.types.is_floating(t.schema.field(c).type))]
        if bad:
            raise DataError(f"{Path(data_dir) / f.path}: " + "; ".join(bad))
        for c in (schema.user_column, TS):
            if t.column(c).null_count:
                raise DataError(f"{Path(data_dir) / f.path}: column {c!r} has "
                                f"{t.column(c).null_count} nulls")
        tables.append(t)
    if not tables:  # a bucket whose users have no events of this stream: every history is empty
        empty = np.zeros(0, dtype=np.int64)
        return BucketEvents(empty, empty, {c: pa.array(empty, pa.float32() if c in values else None)
                                           for c in cols[2:]})
    table = pa.concat_tables(tables).combine_chunks()
    user = table.column(schema.user_column).to_numpy().astype(np.int64, copy=False)
    ts = table.column(TS).to_numpy().astype(np.int64, copy=False)
    check_sorted(user, ts, files, data_dir)

    def column(c: str) -> pa.Array:
        col = table.column(c)
        arr = col.chunk(0) if col.num_chunks else pa.array([], col.type)
        return arr.cast(pa.float32(), safe=False) if c in values else arr

    return BucketEvents(user, ts, {c: column(c) for c in cols[2:]})


def unsorted_at(user: np.ndarray, ts: np.ndarray) -> np.ndarray:
    """Indices i where event i comes before event i-1 in (user, ts) order."""
    return (
        np.flatnonzero((user[1:] < user[:-1]) | ((user[1:] == user[:-1]) & (ts[1:] < ts[:-1]))) + 1
    )


def check_sorted(user: np.ndarray, ts: np.ndarray, files: list[EventFileInfo],
                 data_dir: str | Path) -> None:
    bad = unsorted_at(user, ts)
    if len(bad):
        i = int(bad[0])
        ends = np.cumsum([f.rows for f in files])
        k = int(np.searchsorted(ends, i, side="right"))
        raise DataError(f"{Path(data_dir) / files[k].path}: event log not sorted by (user_id, "
                        f"ts) at row {i - (ends[k - 1] if k else 0)}: (user {user[i - 1]}, ts "
                        f"{ts[i - 1]}) is followed by "
                        f"(user {user[i]}, ts {ts[i]}) ({len(bad)} such places in the bucket)")


def events_before(ev_user: np.ndarray, ev_ts: np.ndarray, user: np.ndarray,
                  t: np.ndarray) -> np.ndarray:
    """For each query (user, t) [Q], the number of log events [E] that sort before (user, t): all
    events of smaller users plus ``user``'s events with ts < t. The log is sorted by (user, ts), so
    this is the end of the query's history in the log. One stable lexsort of events and queries,
    queries placed before events of equal (user, ts) so that an event at the request's own time is
    never counted."""
    E = len(ev_user)
    users = np.concatenate([ev_user, user])
    times = np.concatenate([ev_ts, t])
    is_event = np.concatenate([np.ones(E, dtype=np.int64), np.zeros(len(user), dtype=np.int64)])
    order = np.lexsort((is_event, times, users))
    before = np.cumsum(is_event[order])  # a query adds 0: the count of events strictly before it
    where = np.empty(len(order), dtype=np.int64)
    where[order] = np.arange(len(order))
    return before[where[E:]]


def join_histories(user: np.ndarray, t: np.ndarray, ev: BucketEvents,
                   stream: SequenceStream) -> dict[str, pa.Array]:
    """The v1 history list columns of ``stream`` for impressions (user [Q], request_ts [Q]): per row
    the user's events strictly before t, newest ``stream.max_len`` kept, oldest → newest."""
    end = ev.end_before(user, t)
    first = np.searchsorted(ev.user, user, side="left")  # the user's first event (per-user offset)
    length = np.minimum(end - first, stream.max_len)
    offsets = np.zeros(len(user) + 1, dtype=np.int64)
    np.cumsum(length, out=offsets[1:])
    if offsets[-1] >= 2**31:
        raise DataError(f"stream {stream.name!r}: {offsets[-1]} history events in one shard "
                        f"overflow a list column")
    idx = np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1] - (end - length), length)
    off = pa.array(offsets.astype(np.int32))
    take = pa.array(idx)
    out = {history_column(stream, TS): pa.ListArray.from_arrays(off, pa.array(ev.ts[idx]))}
    for c, values in ev.columns.items():
        out[history_column(stream, c)] = pa.ListArray.from_arrays(off, pc.take(values, take))
    return out


class ShardReader:
    """Reads a dataset's impression shards as v1-shaped tables, whatever the layout.

    v2 shards are joined with their bucket's event logs; the last ``cache_buckets`` buckets read
    stay in memory (per stream), since one bucket serves every day's shard of its users.
    """

    def __init__(self, data_dir: str | Path, manifest: DatasetManifest, schema: FeatureSchema,
                 cache_buckets: int = 2):
        self.data_dir, self.manifest, self.schema = Path(data_dir), manifest, schema
        self.cache_buckets = cache_buckets
        self._cache: OrderedDict[tuple[str, int], BucketEvents] = OrderedDict()

    def read(self, info: ShardInfo, columns: list[str]) -> pa.Table:
        if self.manifest.layout != LAYOUT_V2:
            return read_shard(self.data_dir, info, columns, self.schema)
        histories = stream_columns(self.schema)
        base = [c for c in columns if c not in histories]
        need = [s for s in self.schema.sequences
                if any(history_column(s, c) in columns for c in event_columns(self.schema, s)[1:])]
        keys = [self.schema.user_column, self.schema.time_column]
        table = read_shard(self.data_dir, info, list(dict.fromkeys(base + (keys if need else []))),
                           self.schema)
        if not need:
            return table.select(columns)
        for c in keys:
            if table.column(c).null_count:
                raise DataError(f"{self.data_dir / info.path}: column {c!r} has nulls; histories "
                                f"cannot be joined")
        user = table.column(keys[0]).to_numpy().astype(np.int64, copy=False)
        t = table.column(keys[1]).to_numpy().astype(np.int64, copy=False)
        joined: dict[str, pa.Array] = {}
        for s in need:
            joined |= join_histories(user, t, self.bucket(s, info.bucket), s)
        return pa.table({c: joined[c] if c in joined else table.column(c) for c in columns})

    def bucket(self, stream: SequenceStream, bucket: int) -> BucketEvents:
        key = (stream.name, bucket)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        ev = read_bucket(self.data_dir, self.manifest.event_files(stream.name, bucket), self.schema,
                         stream)
        self._cache[key] = ev
        while len(self._cache) > self.cache_buckets * max(len(self.schema.sequences), 1):
            self._cache.popitem(last=False)
        return ev
