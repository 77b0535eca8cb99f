"""Histories by user id at serving: the ``HistoryStore`` interface and the
embedded ``ArrowHistoryStore``.

A request may carry ``user_id`` and leave out a stream's history fields; the predictor then asks its
store for them (``Predictor(..., history=store)``, ``opengem serve --history STORE``). Fields given
in the request win, per stream. What a store returns is exactly what the training loader joins from
a v2 dataset (``opengem.data.events.join_histories``, ``docs/dataset-layout.md``): the user's events
with ``ts`` strictly before ``request_ts``, the newest ``max_len`` of the stream, oldest → newest.

Store directory (``opengem history-store --data DATA --out STORE``, built once from a v2 dataset)::

    STORE/history.json            format, source, per stream: the event columns and vocabularies it was
                                  built for (checked against the artifact's schema at load), events, users
    STORE/<stream>.arrow          Arrow IPC file, uncompressed: user_id, ts, item, event,
                                  <attribute>… (int64), <value>… (float32), one record batch
                                  per user bucket, each sorted by (user_id, ts)
    STORE/<stream>.users.arrow    per-user offsets: user (sorted), start, end (rows of <stream>.arrow)

Why this shape: an uncompressed IPC file opened with ``pyarrow.memory_map`` is read in place, so
start-up reads only the footers (no parse, no copy) and the server's resident memory grows with the
users actually looked up, not with the log (the OS pages the rest in and out). A lookup is one
``searchsorted`` in the user index and a slice of the mapped columns. Buckets are copied in turn, so
the build holds one bucket in memory; users need not be ordered across buckets because the index,
not the file order, finds them. No hash is checked at load (hashing the log would read all of it);
sizes and row counts are, so a truncated or replaced file is refused.

A feature store plugs in by implementing ``HistoryStore`` (``lookup`` and ``check``); it may return
lists or int64 arrays. Its histories go through the same request checks as a client's (equal
lengths, events before ``request_ts``, oldest → newest). The store is separate from the artifact
because the two change at different rates: events arrive continuously, models are retrained
and hot-reloaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np
import pyarrow as pa

from opengem.data.events import TS, BucketEvents, event_columns, join_histories, read_bucket
from opengem.data.parquet import LAYOUT_V2, DataError, DatasetManifest
from opengem.features.schema import FeatureSchema, SequenceStream

FORMAT = 1
META = "history.json"


class HistoryStoreError(ValueError):
    """A store that cannot serve: missing or corrupt files, or built for another schema (the CLI's
    exit 2)."""


class HistoryStore(Protocol):
    """Where the predictor reads histories a request left out.

    ``lookup(user_id, request_ts, streams)`` returns, for each stream in ``streams`` that the store
    has events of this user in, its v1 history fields (``<stream>.item``, ``.event``, ``.ts``,
    ``.<attribute>``: one int per event; ``.<value>``: one float per event; events with
    ts < request_ts, newest ``max_len`` kept, oldest → newest). A stream left out of the answer
    means the store has never seen the user there: the request is scored with an empty history and
    the response counts it (``unknown_user``).
    ``check(schema)`` raises ``HistoryStoreError`` if the store cannot serve a model of ``schema``.
    """

    def lookup(self, user_id: int, request_ts: int,
               streams: Sequence[str]) -> dict[str, Sequence[int]]: ...

    def check(self, schema: FeatureSchema) -> None: ...


def stream_spec(schema: FeatureSchema, s: SequenceStream) -> dict:
    """What a store's stream must agree on with the model: its columns and the ids' vocabularies."""
    return {"columns": event_columns(schema, s), "item_vocab_size": s.item_vocab_size,
            "num_event_types": s.num_event_types,
            "attributes": {a.name: a.vocab_size for a in s.attributes}}


def _paths(root: Path, stream: str) -> tuple[Path, Path]:
    return root / f"{stream}.arrow", root / f"{stream}.users.arrow"


# ---------------------------------------------------------------------------------------------- build
def build_history_store(data_dir: str | Path, out_dir: str | Path) -> dict:
    """Write the store of a v2 dataset's event logs into ``out_dir``; returns
    ``history.json``'s content.

    Every bucket is read and checked by the loader's own ``read_bucket`` (sorted by (user, ts), no
    null user or time). A null item, event or attribute, or a NaN/inf value, is an error here (the
    loader quarantines the rows such an event would reach; a server cannot), as is a user in two
    buckets.
    """
    data_dir, out = Path(data_dir), Path(out_dir)
    try:
        manifest = DatasetManifest.load(data_dir)
        schema = FeatureSchema.load(data_dir)
    except (DataError, OSError, ValueError) as e:
        raise HistoryStoreError(f"{data_dir}: not a dataset: {e}") from e
    if manifest.layout != LAYOUT_V2:
        raise HistoryStoreError(f"{data_dir} is a layout {manifest.layout} dataset: a history "
                                f"store is built from "
                                "a layout 2 dataset's event logs (v1 rows hold only each "
                                "impression's capped history, not the log); write one with "
                                "`opengem generate --layout v2`")
    out.mkdir(parents=True, exist_ok=True)
    # a store without its manifest is refused while half-written
    (out / META).unlink(missing_ok=True)
    meta = {"format": FORMAT,
            "source": {"data": str(data_dir.resolve()), "schema": schema.fingerprint()},
            "user_column": schema.user_column, "streams": {}}
    for s in schema.sequences:
        meta["streams"][s.name] = {**stream_spec(schema, s),
                                   **_build_stream(data_dir, manifest, schema, s, out)}
    tmp = out / (META + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, out / META)
    return meta


def _build_stream(data_dir: Path, manifest: DatasetManifest, schema: FeatureSchema,
                  s: SequenceStream, out: Path) -> dict:
    cols = event_columns(schema, s)
    values = set(s.values)
    arrow_schema = pa.schema([(c, pa.float32() if c in values else pa.int64()) for c in cols])
    log_path, index_path = _paths(out, s.name)
    users, starts, ends, rows = [], [], [], 0
    with pa.OSFile(str(log_path), "wb") as sink, pa.ipc.new_file(sink, arrow_schema) as w:
        for b in sorted({e.bucket for e in manifest.events.get(s.name, [])}):
            ev = read_bucket(data_dir, manifest.event_files(s.name, b), schema, s)
            for c, v in ev.columns.items():
                if v.null_count:
                    raise HistoryStoreError(f"{data_dir}: stream {s.name!r} bucket {b}: "
                                            f"column {c!r} has "
                                            f"{v.null_count} nulls; a served history cannot "
                                            f"hold them")
                if c in values and not np.isfinite(v.to_numpy(zero_copy_only=False)).all():
                    raise HistoryStoreError(f"{data_dir}: stream {s.name!r} bucket {b}: "
                                            f"column {c!r} holds NaN/inf values; a served "
                                            f"history cannot hold them")
            w.write_table(pa.table([pa.array(ev.user), pa.array(ev.ts)] +
                                   [ev.columns[c].cast(arrow_schema.field(c).type)
                                    for c in cols[2:]],
                                   schema=arrow_schema))
            u, first = np.unique(ev.user, return_index=True)
            users.append(u)
            starts.append(rows + first)
            ends.append(rows + np.r_[first[1:], len(ev.user)])
            rows += len(ev.user)
    user, start, end = (np.concatenate(x).astype(np.int64) if x else np.zeros(0, np.int64)
                        for x in (users, starts, ends))
    order = np.argsort(user, kind="stable")
    user, start, end = user[order], start[order], end[order]
    if len(user) > 1 and (np.diff(user) == 0).any():
        dup = int(user[np.flatnonzero(np.diff(user) == 0)[0]])
        raise HistoryStoreError(f"{data_dir}: stream {s.name!r}: user {dup} has events in "
                                f"two buckets")
    index = pa.table({"user": user, "start": start, "end": end})
    with pa.OSFile(str(index_path), "wb") as sink, pa.ipc.new_file(sink, index.schema) as w:
        w.write_table(index)
    return {"file": log_path.name, "index": index_path.name, "events": rows, "users": len(user),
            "bytes": log_path.stat().st_size}


# ----------------------------------------------------------------------------------------------- read
@dataclass
class _Stream:
    """One stream's mapped log, kept as its record batches (one per bucket): concatenating them
    would copy the log into memory, and a user's events never cross a batch (a user lives in
    one bucket)."""

    stream: SequenceStream
    # per record batch: user, ts as numpy views, other columns as Arrow views
    batches: list[BucketEvents]
    bounds: np.ndarray  # [B] first row of each batch
    index_user: np.ndarray  # [U] sorted
    start: np.ndarray  # [U] rows of the log
    end: np.ndarray

    def events(self, i: int) -> BucketEvents:
        """The events of the i-th indexed user, sliced (no copy) from its batch."""
        a, b = int(self.start[i]), int(self.end[i])
        k = int(np.searchsorted(self.bounds, a, side="right")) - 1
        ev, a, b = self.batches[k], a - int(self.bounds[k]), b - int(self.bounds[k])
        return BucketEvents(ev.user[a:b], ev.ts[a:b],
                            {c: v.slice(a, b - a) for c, v in ev.columns.items()})


class ArrowHistoryStore:
    """The embedded default store: a directory written by ``build_history_store``, memory-mapped.

    Args:
        store_dir: the directory.
        schema: the served model's schema; its streams (and their ``max_len``) decide what is returned,
            and a store built for other columns or vocabularies is refused here, naming the difference.
    """

    def __init__(self, store_dir: str | Path, schema: FeatureSchema):
        self.root = Path(store_dir)
        try:
            self.meta = json.loads((self.root / META).read_text())
        except (OSError, ValueError) as e:
            raise HistoryStoreError(f"{self.root}: not a history store ({META}: {e}); build "
                                    f"one with "
                                    "`opengem history-store --data DATA --out DIR`") from e
        if self.meta.get("format") != FORMAT:
            raise HistoryStoreError(f"{self.root}: store format {self.meta.get('format')!r}, this "
                                    f"code reads {FORMAT}")
        self.check(schema)
        self.streams = {s.name: self._open(s) for s in schema.sequences}

    def check(self, schema: FeatureSchema) -> None:
        have = self.meta.get("streams", {})
        problems = []
        if self.meta.get("user_column") != schema.user_column:
            problems.append(f"user column {self.meta.get('user_column')!r} vs the "
                            f"model's {schema.user_column!r}")
        for s in schema.sequences:
            if s.name not in have:
                problems.append(f"stream {s.name!r} is not in the store (it has {sorted(have)})")
                continue
            want = stream_spec(schema, s)
            problems += [f"stream {s.name!r} {k}: store {have[s.name].get(k)!r}, model {v!r}"
                         for k, v in want.items() if have[s.name].get(k) != v]
        if problems:
            raise HistoryStoreError(f"{self.root} was built from a dataset whose schema differs "
                                    f"from the model's: "
                                    + "; ".join(problems))

    def _open(self, s: SequenceStream) -> _Stream:
        info = self.meta["streams"][s.name]
        log_path, index_path = self.root / info["file"], self.root / info["index"]
        try:
            if log_path.stat().st_size != info["bytes"]:
                raise HistoryStoreError(f"{log_path}: {log_path.stat().st_size} bytes, the "
                                        f"store wrote {info['bytes']} (a truncated or "
                                        f"replaced file)")
            reader = pa.ipc.open_file(pa.memory_map(str(log_path)))
            if reader.schema.names != info["columns"]:
                raise HistoryStoreError(f"{log_path}: columns {reader.schema.names}, the store "
                                        f"wrote {info['columns']}")
            batches = [reader.get_batch(k) for k in range(reader.num_record_batches)]
            index = pa.ipc.open_file(pa.memory_map(str(index_path))).read_all()
            idx = {c: index.column(c).to_numpy() for c in ("user", "start", "end")}
        except (OSError, pa.ArrowException, KeyError) as e:
            raise HistoryStoreError(f"{self.root}: stream {s.name!r}: unreadable store "
                                    f"file: {e}") from e
        rows = sum(b.num_rows for b in batches)
        if rows != info["events"] or len(idx["user"]) != info["users"] or \
                (len(idx["end"]) and int(idx["end"].max()) > rows):
            raise HistoryStoreError(f"{log_path}: {rows} events / {len(idx['user'])} users, "
                                    f"the store wrote {info['events']} / {info['users']}")
        user_col, cols = self.meta["user_column"], info["columns"]
        evs = [BucketEvents(b.column(user_col).to_numpy(), b.column(TS).to_numpy(),
                            {c: b.column(c) for c in cols if c not in (user_col, TS)})
               for b in batches]
        bounds = np.cumsum([0] + [b.num_rows for b in batches])[:-1].astype(np.int64)
        return _Stream(s, evs, bounds, idx["user"], idx["start"], idx["end"])

    def lookup(self, user_id: int, request_ts: int,
               streams: Sequence[str]) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        q_user, q_ts = np.array([user_id], np.int64), np.array([request_ts], np.int64)
        for name in streams:
            st = self.streams[name]
            i = int(np.searchsorted(st.index_user, user_id))
            if i == len(st.index_user) or st.index_user[i] != user_id:
                continue
            for c, lst in join_histories(q_user, q_ts, st.events(i), st.stream).items():
                out[c] = lst.flatten().to_numpy()
        return out
