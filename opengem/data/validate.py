"""``opengem validate DATA``: check a dataset against its schema and layout before training on it.

The loader tolerates what it can repair (out-of-range ids → the OOV row) and quarantines bad rows,
so a producer's bug can train quietly; this check names every problem up front, by file, column
and value.

Errors (the dataset is wrong): an unreadable manifest or schema; a listed file missing, unreadable
or of another row count; a missing column or one of the wrong type; nulls in a v2 event log, or a
NaN/inf in its per-event value columns (``SequenceStream.values``); an event log not sorted by
(user_id, ts); a user's events in two buckets, or in another bucket than its impressions'; times in
another unit than ``request_ts`` (found by magnitude: a millisecond time is ~1000× a second one).
v1 rows with a NaN/inf value are quarantined rows (a warning below), as a NaN dense value is.

Warnings (the loader keeps or repairs them, counted; ``--strict`` fails on them): ids outside
``[0, vocab)``, which the loader maps to the OOV row (new ads are normal in ads logs, a whole column
off is not: the count and an example say which); v1 rows the loader would quarantine
(``validate_rows``); exact duplicate events (every column equal), which real logs get from double
logging but the synthetic world also draws, and which v1 rows hold, so the loader keeps them and
v1 = v2 stays exact; a stream with no event files at all.

Counted only: missing values (NaN/null) of a dense feature declared ``missing="indicator"``, which
the loader keeps (``counts["missing.<feature>"]``); in any other dense feature they are
quarantined rows.

Duplicate (user, ts) events that differ are valid (a view and a like in one second): they keep
their log order, and are only counted. Users with no events have empty histories
(valid, counted). Events after a user's last impression are allowed and unused.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from opengem.data.batch import validate_rows
from opengem.data.events import TS, read_bucket
from opengem.data.parquet import (
    LAYOUT_V2,
    DataError,
    DatasetManifest,
    ShardInfo,
    impression_columns,
    read_shard,
)
from opengem.features.schema import FeatureSchema, SchemaError

# a time this many times off the requests' range is in another unit (ms vs s: 1000)
UNIT_FACTOR = 100.0


@dataclass
class Report:
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)

    def format(self) -> str:
        lines = [f"error: {e}" for e in self.errors] + [f"warning: {w}" for w in self.warnings]
        lines.append("counts: " + ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items())))
        lines.append(f"{len(self.errors)} errors, {len(self.warnings)} warnings")
        return "\n".join(lines)


def validate_dataset(data_dir: str | Path) -> Report:
    """Every check of the module docstring on ``data_dir``; never raises on bad data
    (it reports)."""
    data_dir, report = Path(data_dir), Report()
    try:
        manifest = DatasetManifest.load(data_dir)
        schema = FeatureSchema.load(data_dir)
    except (DataError, SchemaError) as e:
        report.errors.append(str(e))
        return report
    report.counts["layout"] = manifest.layout
    # bucket → (users, request_ts) per shard
    requests: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    for info in manifest.files:
        got = _check_shard(data_dir, info, schema, manifest.layout, report)
        if got is not None and info.bucket is not None:
            requests.setdefault(info.bucket, []).append(got)
    if manifest.layout == LAYOUT_V2:
        for s in schema.sequences:
            _check_stream(data_dir, manifest, schema, s, requests, report)
    return report


def _check_shard(data_dir: Path, info: ShardInfo, schema: FeatureSchema, layout: int,
                 report: Report) -> tuple[np.ndarray, np.ndarray] | None:
    path = data_dir / info.path
    try:
        table = read_shard(data_dir, info, impression_columns(schema, layout), schema)
    except DataError as e:
        report.errors.append(str(e))
        return None
    report.counts["rows"] += table.num_rows
    for f in schema.sparse:
        _ids_in_range(path, f.name, table.column(f.name), f.vocab_size, report)
    # kept by the loader (imputed, flagged): counted, neither error nor warning
    for i in schema.dense_missing:
        v = table.column(schema.dense[i].name).to_numpy(zero_copy_only=False).astype(np.float64)
        report.counts[f"missing.{schema.dense[i].name}"] += int(np.isnan(v).sum())
    req = table.column(schema.time_column).to_numpy(zero_copy_only=False)
    if table.column(schema.time_column).null_count:
        report.errors.append(f"{path}: column {schema.time_column!r} has nulls")
        return None
    if layout != LAYOUT_V2:
        for s in schema.sequences:
            _ids_in_range(path, s.item_column, table.column(s.item_column), s.item_vocab_size,
                          report)
            _ids_in_range(path, s.event_column, table.column(s.event_column), s.num_event_types,
                          report)
            for a in s.attributes:
                _ids_in_range(path, s.attribute_column(a), table.column(s.attribute_column(a)),
                              a.vocab_size, report)
            ts = pc.list_flatten(table.column(s.ts_column)).to_numpy(zero_copy_only=False)
            _same_unit(path, s.ts_column, ts, req, schema.time_column, report)
        _, reasons, _ = validate_rows(table, schema)
        for reason, n in reasons:
            report.warnings.append(f"{path}: {n} rows would be quarantined by the loader: {reason}")
            report.counts["quarantined_rows"] += n
    users = table.column(schema.user_column).to_numpy(zero_copy_only=False)
    return users.astype(np.int64), req.astype(np.int64)


def _check_stream(data_dir: Path, manifest: DatasetManifest, schema: FeatureSchema, stream,
                  requests: dict, report: Report) -> None:
    files = manifest.events.get(stream.name, [])
    if not files:
        report.warnings.append(f"stream {stream.name!r}: the manifest lists no event files (every "
                               f"history is empty)")
    owners: list[tuple[np.ndarray, int]] = []  # (users with events, their bucket)
    for bucket in sorted({f.bucket for f in files} | set(requests)):
        bfiles = manifest.event_files(stream.name, bucket)
        where = str(data_dir / bfiles[0].path) if bfiles else f"{stream.name} bucket {bucket}"
        try:
            # sort order, nulls in user/ts, types, columns
            ev = read_bucket(data_dir, bfiles, schema, stream)
        except DataError as e:
            report.errors.append(str(e))
            continue
        report.counts[f"{stream.name}.events"] += len(ev.user)
        vocab = {"item": stream.item_vocab_size, "event": stream.num_event_types} | {
            a.name: a.vocab_size for a in stream.attributes}
        for c, values in ev.columns.items():
            if values.null_count:
                report.errors.append(f"{where}: column {c!r} has {values.null_count} nulls")
            if c in vocab:
                _ids_in_range(where, c, values, vocab[c], report)
            else:
                _finite(where, c, values, report)
        _duplicates(where, stream.name, ev, report)
        owners.append((np.unique(ev.user), bucket))
        if bucket in requests:
            users = np.concatenate([u for u, _ in requests[bucket]])
            req = np.concatenate([t for _, t in requests[bucket]])
            _same_unit(where, TS, ev.ts, req, schema.time_column, report)
            report.counts[f"{stream.name}.users_without_events"] += int(
                (~np.isin(np.unique(users), ev.user)).sum()
            )
    _buckets_own_their_users(stream.name, owners, requests, report)


def _buckets_own_their_users(stream: str, owners: list, requests: dict, report: Report) -> None:
    """A user's events live in one bucket, the one of its impression shards: the join reads
    no other."""
    if not owners:
        return
    users = np.concatenate([u for u, _ in owners])
    bucket = np.concatenate([np.full(len(u), b) for u, b in owners])
    order = np.argsort(users, kind="stable")
    users, bucket = users[order], bucket[order]
    twice = np.flatnonzero(users[1:] == users[:-1])
    if len(twice):
        i = int(twice[0])
        report.errors.append(f"stream {stream!r}: {len(twice)} users have events in more than one "
                             f"bucket (user {users[i]} in buckets {bucket[i]} and "
                             f"{bucket[i + 1]}); a user's events live in one")
    for b, parts in sorted(requests.items()):
        u = np.unique(np.concatenate([x for x, _ in parts]))
        j = np.clip(np.searchsorted(users, u), 0, len(users) - 1)
        wrong = (users[j] == u) & (bucket[j] != b)
        if wrong.any():
            k = int(np.flatnonzero(wrong)[0])
            report.errors.append(f"stream {stream!r}: {int(wrong.sum())} users of bucket {b}'s "
                                 f"impression shards have "
                                 f"their events in another bucket (user {u[k]} in bucket "
                                 f"{bucket[j[k]]}); the join "
                                 "reads only the shard's own bucket")


def _duplicates(where: str, stream: str, ev, report: Report) -> None:
    same_time = np.flatnonzero((ev.user[1:] == ev.user[:-1]) & (ev.ts[1:] == ev.ts[:-1])) + 1
    report.counts[f"{stream}.same_user_and_ts_events"] += len(same_time)
    if not len(same_time):
        return
    exact = np.ones(len(same_time), dtype=bool)
    for values in ev.columns.values():
        a = values.to_numpy(zero_copy_only=False)
        exact &= a[same_time] == a[same_time - 1]
    n = int(exact.sum())
    if n:
        i = int(same_time[exact][0])
        report.counts[f"{stream}.exact_duplicate_events"] += n
        report.warnings.append(f"{where}: {n} events repeat the one before them exactly (e.g. "
                               f"user {ev.user[i]}, ts {ev.ts[i]}); kept, as v1 rows keep them; "
                               f"double logging upstream?")


def _finite(where, column: str, values: pa.Array, report: Report) -> None:
    """An event log's value column (read as float32): a NaN or ±inf is an error, as a null is."""
    v = values.drop_null().to_numpy(zero_copy_only=False)
    bad = ~np.isfinite(v)
    if bad.any():
        report.errors.append(f"{where}: column {column!r} has {int(bad.sum())} NaN/inf values "
                             f"(e.g. {v[bad][0]}); the loader quarantines the rows whose history "
                             f"holds one")


def _ids_in_range(where, column: str, values, vocab: int, report: Report) -> None:
    if pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
        values = pc.list_flatten(values)
    v = values.drop_null().to_numpy(zero_copy_only=False) if values.null_count else values.to_numpy(
        zero_copy_only=False)
    bad = (v < 0) | (v >= vocab)
    if bad.any():
        report.counts["oov_ids"] += int(bad.sum())
        report.warnings.append(f"{where}: column {column!r} has {int(bad.sum())} ids outside "
                               f"[0, {vocab}) (e.g. {v[bad][0]}); the loader maps them to the "
                               f"OOV row")


def _same_unit(where, column: str, ts: np.ndarray, req: np.ndarray, req_column: str,
               report: Report) -> None:
    """Times far outside the requests' range by magnitude are in another unit (or garbage)."""
    if not len(ts) or not len(req):
        return
    lo, hi = float(req.min()), float(req.max())
    t = ts.astype(np.float64)
    off = (t > hi * UNIT_FACTOR) | ((t > 0) & (t * UNIT_FACTOR < lo))
    if off.any():
        x = ts[off][0]
        report.errors.append(f"{where}: column {column!r} has {int(off.sum())} times of another "
                             f"magnitude than {req_column!r} (e.g. {x} vs requests in "
                             f"[{int(lo)}, {int(hi)}]; "
                             f"ratio ~{x / hi:.3g}): mixed units, e.g. milliseconds vs seconds?")
