"""Histories of a real log stored as layout v2 (``docs/dataset-layout.md``): an events table, or
per-row list columns that turn out to be prefixes of one per-user history.

``EventTable`` (``sequence.from: events``) never holds the events in memory: DuckDB (the import's
``impressions.Workspace``) reads the event files (CSV/TSV/Parquet), joins the users to the
impressions' user ids (its ``users`` table) and writes the events into user buckets
(``PARTITION BY``, spilling to disk under ``impressions.MEMORY_LIMIT``); then one bucket at a time
is read back sorted by (user, time) (DuckDB ``ORDER BY``), encoded and written as that bucket's
log. Peak memory is one bucket (``EVENTS_PER_BUCKET`` events) plus DuckDB's limit, whatever the
log's length. The input need not be sorted: the importer sorts, and says so. Several streams
(``sequences``) are one ``EventTable`` each, partitioned into the dataset's one bucket count.
A stream's per-event ``values`` travel the same way, as DOUBLE columns beside the ids: checked to
be numbers when read, their missing ones dropped (with their events, before anything else sees
them) or filled, and written float32 (``event_values``).

``list_histories`` (``sequence.from: lists``) reads per-row list columns (items, per-event times),
builds the union per-user history and checks that the v2 join over it gives back every row's list
exactly; if so the dataset is v2, else (features logged at serving time, say) rows keep their own
lists (v1), with their times. Either way the log line and ``source.storage`` say which and why.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from opengem.data.parquet import LAYOUT_V1, LAYOUT_V2, ShardWriter
from opengem.data.sources.common import ColumnError, Vocab, history, ranges
from opengem.data.sources.impressions import Users, Workspace
from opengem.data.sources.spec import FLOAT32_MAX
from opengem.features.schema import SequenceStream

log = logging.getLogger("opengem")

EVENTS_PER_BUCKET = 1_000_000  # one bucket's events are in memory at a time (~100 MB encoded)
# event times this many times larger/smaller than request_ts: another unit (ms vs s)
UNIT_RATIO = 30.0
# the DESCRIBE types a value column may have besides DECIMAL(p, s) and VARCHAR (numbers as text)
_NUMBER_TYPES = {"TINYINT", "SMALLINT", "INTEGER", "BIGINT", "HUGEINT", "UTINYINT", "USMALLINT",
                 "UINTEGER", "UBIGINT", "UHUGEINT", "FLOAT", "DOUBLE"}


def _q(s: str) -> str:
    return '"' + s.replace('"', '""') + '"'


def _lit(s: str | Path) -> str:
    return "'" + str(s).replace("'", "''") + "'"


def n_buckets(n_events: int, n_users: int, wanted: int | None = None) -> int:
    """Buckets so that one holds about ``EVENTS_PER_BUCKET`` events (at most one per user)."""
    return max(1, min(int(wanted or -(-n_events // EVENTS_PER_BUCKET)), max(n_users, 1)))


@dataclass
class Storage:
    """Which layout the importer chose, why, and what it counted on the way (``source.storage``)."""

    layout: int
    why: str
    buckets: int = 1
    counts: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"layout": self.layout, "why": self.why, "buckets": self.buckets, **self.counts}

    def report(self, name: str) -> None:
        log.info("import: history %r stored as layout v%d (%s); %s", name, self.layout, self.why,
                 ", ".join(f"{k} {v}" for k, v in self.counts.items()) or "nothing counted")


class EventTable:
    """An events table (one row per event) → the v2 event logs of one stream; see the
    module docstring.

    ``s`` is the stream's spec (``key`` its path in the spec, for messages; ``name`` its view's
    name in the workspace ``ws``). The workspace's ``users`` table (u, uid, train_ts) maps the raw
    user values to the impressions' ``user_id``; events of users with no impression are dropped
    (counted). ``train_ts`` is each user's last train request time: a vocabulary fitted on the log
    (``fit``) sees only the events a train row's history can hold. The id encoders of the item and
    the attributes are given to ``stream``; event types get contiguous ids of the values in the
    log.
    """

    def __init__(self, s: dict, base: Path, ws: Workspace, users: Users, divisor: int,
                 key: str = "sequence", name: str = "ev"):
        self.s, self.key, self.ev = s, key, name
        self.files = [base / f for f in s["files"]]
        self.cols = {"user": s["user"], "time": s["time"], "item": s["item"]}
        if "event" in s:
            self.cols["event"] = s["event"]
        self.cols |= {f"a{i}": a if isinstance(a, str) else a["column"]
                      for i, a in enumerate(s["attributes"])}
        # per-event numbers (checked spec objects), read as DOUBLE under the keys v<i>
        self.values = {f"v{i}": v for i, v in enumerate(s.get("values", []))}
        self.con, self.duckdb_error, self.dir = ws.con, ws.error, ws.dir / name
        self.last_ts, self.req_max = users.last_ts, users.req_max  # a user's last impression
        self.counts: dict[str, int] = {}
        # with values, the view of every event read is checked, then filtered into ``self.ev``
        self.read_view = f"{name}_read" if self.values else name
        self._events_view(divisor)
        self._check()
        self.kept = self.counts["events_read"]
        if self.values:
            self._filter_values()

    def _events_view(self, divisor: int) -> None:
        """A view of every event file: raw values as text, time as int64 seconds, file and
        row number."""
        parts = []
        for fi, f in enumerate(self.files):
            if not f.exists():
                raise ColumnError(f"{f}: events file not found")
            if f.name.endswith(".parquet"):
                src = f"read_parquet({_lit(f)}, file_row_number=true)"
                rn = "file_row_number"
            else:
                sep = "\t" if f.name.endswith(".tsv") else self.s.get("sep", ",")
                src = f"read_csv({_lit(f)}, header=true, all_varchar=true, delim={_lit(sep)})"
                rn = "row_number() OVER ()"
            try:
                types = {r[0]: r[1]
                         for r in self.con.sql(f"DESCRIBE SELECT * FROM {src}").fetchall()}
            except self.duckdb_error as e:
                raise ColumnError(f"{f}: not a readable events table ({e})") from e
            missing = [c for c in list(self.cols.values())
                       + [v["column"] for v in self.values.values()] if c not in types]
            if missing:
                raise ColumnError(f"{f}: missing columns {missing}; it has {sorted(types)}")
            t, tt = _q(self.cols["time"]), types[self.cols["time"]]
            if tt.startswith("TIMESTAMP") or tt == "DATE":
                ts = f"CAST(floor(epoch({t})) AS BIGINT)"
            elif tt == "VARCHAR":  # numbers in the spec's unit, or ISO-8601 datetimes
                ts = (f"CASE WHEN TRY_CAST({t} AS DOUBLE) IS NOT NULL THEN CAST(floor(CAST({t} AS "
                      f"DOUBLE) / {divisor}) AS BIGINT) ELSE CAST(floor(epoch(CAST({t} AS "
                      f"TIMESTAMPTZ))) AS BIGINT) END")
            else:
                ts = f"CAST(floor({t} / {divisor}) AS BIGINT)"
            vals = ", ".join(f"CAST({_q(c)} AS VARCHAR) AS {k}" for k,
                             c in self.cols.items() if k != "time")
            for k, v in self.values.items():
                self._check_numbers(f, src, rn, v["column"], types[v["column"]])
                c = _q(v["column"])
                vals += f", TRY_CAST({c} AS DOUBLE) AS {k}, CAST({c} AS VARCHAR) AS r{k}"
            parts.append(f"SELECT {vals}, {ts} AS ts, {fi} AS fi, {rn} AS rn FROM {src}")
        self.con.sql(f"CREATE VIEW {self.read_view} AS " + " UNION ALL ".join(parts))

    def _check_numbers(self, f: Path, src: str, rn: str, col: str, type_: str) -> None:
        """A value column must hold numbers: a number type, or text whose every non-empty cell
        parses as one; else a ``ColumnError`` naming the file, column and first bad value."""
        number = type_ in _NUMBER_TYPES or type_.startswith("DECIMAL")
        if not number and type_ != "VARCHAR":
            raise ColumnError(f"{f}: column {col!r} is {type_}; a per-event value column holds "
                              f"numbers")
        if number:
            return
        c = _q(col)
        bad = self.con.sql(f"SELECT rn, v FROM (SELECT {rn} AS rn, {c} AS v FROM {src}) "
                           f"WHERE trim(v) <> '' AND TRY_CAST(v AS DOUBLE) IS NULL "
                           f"ORDER BY rn LIMIT 1").fetchall()
        if bad:
            raise ColumnError(f"{f}: column {col!r}: {bad[0][1]!r} (row "
                              f"{self._row(self.files.index(f), bad[0][0])}) is not a number; a "
                              f"per-event value column holds numbers")

    def _row(self, fi: int, rn: int) -> int:
        """A data row's number from 0 in its file (the view's ``rn`` counts CSV rows from 1)."""
        return int(rn) - (0 if self.files[fi].name.endswith(".parquet") else 1)

    def _filter_values(self) -> None:
        """Missing values (an empty or null cell, NaN, ±inf, or beyond float32, which would be
        stored as inf), per value's ``missing``: ``drop`` the event, ``fill`` (at ``write``) or
        ``error``. Counted per value on every event read; the view ``self.ev`` holds the events
        kept, so vocabularies, user joins and the log see only those."""
        bad = {k: f"({k} IS NULL OR NOT isfinite({k}) OR abs({k}) > {FLOAT32_MAX!r})"
               for k in self.values}
        drop = " OR ".join(bad[k] for k, v in self.values.items() if v["missing"] == "drop")
        counts = self.con.sql(
            "SELECT " + ", ".join(f"count(*) FILTER (WHERE {b})" for b in bad.values())
            + (f", count(*) FILTER (WHERE {drop})" if drop else "")
            + f" FROM {self.read_view}").fetchall()[0]
        for (k, v), n in zip(self.values.items(), counts):
            if v["missing"] == "error" and n:
                fi, rn, raw = self.con.sql(f"SELECT fi, rn, r{k} FROM {self.read_view} WHERE "
                                           f"{bad[k]} ORDER BY fi, rn LIMIT 1").fetchall()[0]
                first = repr(raw) if raw is not None and raw.strip() else "an empty cell"
                raise ColumnError(f"{self.files[fi]}: column {v['column']!r}: {n} events have a "
                                  f"missing value (empty, NaN, ±inf or beyond float32; the "
                                  f"first: {first}, row {self._row(fi, rn)}); set "
                                  f"{self.key}.values {v['name']!r}'s missing to drop or fill "
                                  f"to keep importing")
            self.counts[f"{v['name']}_missing_or_non_finite"] = int(n)
        if drop:
            self.counts["events_with_missing_or_non_finite_values_dropped"] = int(counts[-1])
            self.kept -= int(counts[-1])
        self.con.sql(f"CREATE VIEW {self.ev} AS SELECT * FROM {self.read_view}"
                     + (f" WHERE NOT ({drop})" if drop else ""))

    def _check(self) -> None:
        """Nulls, unparseable times and times of another unit than ``request_ts``: errors naming
        the file."""
        try:
            rows = self.con.sql("SELECT fi, count(*), count(*) - count(user), count(*) - "
                                "count(ts), min(ts), max(ts), "
                                f"count(*) - count(item) FROM {self.read_view} GROUP BY fi "
                                "ORDER BY fi").fetchall()
        except self.duckdb_error as e:
            raise ColumnError(f"{[str(f) for f in self.files]}: column {self.cols['time']!r}: a "
                              f"value is not a unix time or an ISO-8601 datetime ({e})") from e
        req_max = self.req_max
        for fi, n, null_user, null_ts, lo, hi, null_item in rows:
            f = self.files[fi]
            for col, k in ((self.cols["user"], null_user), (self.cols["time"], null_ts)):
                if k:
                    raise ColumnError(f"{f}: column {col!r} has {k} empty values; every event "
                                      f"needs a user and a time")
            self.counts["null_items"] = self.counts.get("null_items", 0) + int(null_item)
            if hi is None or req_max <= 1e8:  # not unix-like times: nothing to compare against
                continue
            if hi > UNIT_RATIO * req_max or (lo > 1e8 and hi > UNIT_RATIO * lo):
                raise ColumnError(f"{f}: column {self.cols['time']!r}: time {hi} is "
                                  f"{hi / req_max:.0f}x the "
                                  f"impressions' last request_ts {req_max} (values from {lo}): "
                                  f"times in mixed units "
                                  f"(ms vs s)? set {self.key}.time_unit")
            if 0 < hi < req_max / UNIT_RATIO:
                raise ColumnError(f"{f}: column {self.cols['time']!r}: the latest time {hi} is "
                                  f"{req_max / hi:.0f}x "
                                  f"smaller than the impressions' request_ts {req_max}: times in "
                                  f"another unit? set {self.key}.time_unit")
        self.counts["events_read"] = int(sum(r[1] for r in rows))

    def known(self) -> int:
        """The events of users with an impression (the others are dropped, counted)."""
        known = int(self.con.sql(f"SELECT count(*) FROM {self.ev} ev JOIN users ON ev.user "
                                 "= users.u").fetchall()[0][0])
        self.counts["events_of_users_without_impressions_dropped"] = self.kept - known
        return known

    def fit(self, key: str, column: str | None = None) -> Vocab:
        """A vocabulary of the events' ``key`` ("item" or "a<i>"; ``column`` its name in the
        files, unused) fitted on the events a train row's
        history can hold (strictly before the user's last train impression): an id first seen
        later is OOV, as a new item is in production and as sparse features are fitted."""
        values = self.con.sql(f"SELECT DISTINCT {key} FROM {self.ev} ev JOIN users "
                              f"ON ev.user = users.u WHERE ev.ts < users.train_ts "
                              f"AND {key} IS NOT NULL").fetchall()
        return Vocab(np.array([r[0] for r in values], dtype=str))

    def partition(self, buckets: int) -> None:
        """Join users, assign buckets (user id mod B) and write the events into per-bucket files
        on disk."""
        self.buckets = buckets
        keys = [k for k in self.cols if k not in ("user", "time")] + list(self.values)
        self.parts = self.dir / "parts"
        self.dir.mkdir(exist_ok=True)
        self.con.sql(f"COPY (SELECT uid % {self.buckets} AS bucket, uid, ts, {', '.join(keys)}, "
                     f"fi, rn FROM {self.ev} ev JOIN users ON ev.user = users.u) "
                     f"TO {_lit(self.parts)} (FORMAT parquet, PARTITION_BY (bucket))")
        self.keys = keys
        log.info("import: %d events sorted by (user, time) and split into %d buckets by DuckDB "
                 "(input order is not required)", self.kept
                 - self.counts["events_of_users_without_impressions_dropped"], self.buckets)

    def stream(self, name: str, max_len: int, item: tuple, attributes: list[tuple]
               ) -> SequenceStream:
        """The stream's schema entry. ``item``: (encoder, matched feature or None);
        ``attributes``: (EventAttribute, encoder) in spec order. Event types get ids of their
        sorted values in the log."""
        if "event" in self.cols:
            values = [r[0]
                      for r in self.con.sql(f"SELECT DISTINCT event FROM {self.ev} WHERE event "
                                            "IS NOT NULL").fetchall()]
            self.event_vocab = Vocab(np.array(values, dtype=str))
        else:
            self.event_vocab = None
        self.item_encoder, self.attr_encoders = item[0], [enc for _, enc in attributes]
        n_events = self.event_vocab.vocab_size if self.event_vocab else 1
        return SequenceStream(name, self.item_encoder.vocab_size, n_events, max_len,
                              tuple(a for a, _ in attributes), matches=item[1],
                              values=tuple(v["name"] for v in self.values.values()))

    def write(self, writer: ShardWriter, stream: SequenceStream) -> None:
        """Each bucket's log, read back sorted by (user, time, then input order) and encoded."""
        oov = dict.fromkeys(["item", "event"] + [a.name for a in stream.attributes], 0)
        dup_time = exact = after = 0
        with_events = np.zeros(len(self.last_ts), dtype=bool)
        for b in range(self.buckets):
            d = self.parts / f"bucket={b}"
            if not d.exists():
                continue
            files = _lit(str(d) + "/*.parquet")
            t = self.con.sql(f"SELECT uid, ts, {', '.join(self.keys)} FROM read_parquet({files}) "
                             "ORDER BY uid, ts, fi, rn").to_arrow_table()
            uid, ts = t.column("uid").to_numpy(), t.column("ts").to_numpy()
            cols = {"user_id": uid, "ts": ts}

            def enc(key: str, encoder, t=t) -> np.ndarray:
                raw = t.column(key).fill_null("").to_numpy(zero_copy_only=False).astype(str)
                return encoder(raw)

            cols["item"] = enc("item", self.item_encoder)
            cols["event"] = (
                enc("event", self.event_vocab)
                if self.event_vocab
                else np.zeros(len(uid), dtype=np.int64)
            )
            for i, a in enumerate(stream.attributes):
                cols[a.name] = enc(f"a{i}", self.attr_encoders[i])
            nums = {v["name"]: event_values(t.column(k).to_numpy(zero_copy_only=False), v)
                    for k, v in self.values.items()}
            oov["item"] += int((cols["item"] == stream.item_vocab_size).sum())
            if self.event_vocab:
                oov["event"] += int((cols["event"] == stream.num_event_types).sum())
            for a in stream.attributes:
                oov[a.name] += int((cols[a.name] == a.vocab_size).sum())
            same = (uid[1:] == uid[:-1]) & (ts[1:] == ts[:-1])
            dup_time += int(same.sum())
            # every column: exact duplicates adjacent
            every = cols | nums
            order = np.lexsort([every[k] for k in reversed(list(every))])
            stacked = np.stack([every[k][order] for k in every], 1)
            exact += int((stacked[1:] == stacked[:-1]).all(1).sum())
            after += int((ts >= self.last_ts[uid]).sum())
            with_events[uid] = True
            table = {k: pa.array(v, pa.int64()) for k, v in cols.items()}
            table |= {k: pa.array(v, pa.float32()) for k, v in nums.items()}
            writer.write_events(stream.name, b, pa.table(table))
        self.counts |= {"events_at_or_after_last_impression_kept_unused": after,
                        "events_sharing_user_and_time": dup_time,
                        "exact_duplicate_events_kept": exact,
                        "users_without_events": int((~with_events).sum())}
        self.counts |= {f"{k}_out_of_range_to_oov": v for k, v in oov.items() if v}
        if exact:
            log.warning("import: %d exact duplicate events kept (double logging upstream?)", exact)
        shutil.rmtree(self.dir, ignore_errors=True)  # its buckets, written: free the disk

    def storage(self) -> Storage:
        return Storage(LAYOUT_V2,
                       "an events table: every history is a time-prefix of its user's log",
                       self.buckets, self.counts)


def event_values(raw: np.ndarray, v: dict) -> np.ndarray:
    """A value column's float32 numbers as stored: a missing one (null, NaN, ±inf, beyond
    float32; only ``missing: fill`` values still hold any here) filled, then ``transform``
    (log1p of max(x, 0), as for dense features)."""
    x = np.asarray(raw, dtype=np.float64)
    if v["missing"] == "fill":
        x = np.where(np.isfinite(x) & (np.abs(x) <= FLOAT32_MAX), x, v["fill"])
    if v["transform"] == "log1p":
        x = np.log1p(np.maximum(x, 0))
    return x.astype(np.float32)


def list_times(col: pa.ChunkedArray, where: str, divisor: int) -> np.ndarray:
    """The flat int64 seconds of a list<timestamp | integer | float> column."""
    values = pc.list_flatten(col)
    if pa.types.is_timestamp(values.type):
        return pc.cast(pc.cast(values, pa.timestamp("s", values.type.tz)), pa.int64()).to_numpy()
    if not (pa.types.is_integer(values.type) or pa.types.is_floating(values.type)):
        raise ColumnError(f"{where}: a list of {values.type}, expected times (list<int64> "
                          f"or list<timestamp>)")
    v = values.to_numpy(zero_copy_only=False)
    if np.isnan(v.astype(np.float64)).any():
        raise ColumnError(f"{where}: an empty time in a list")
    return (v // divisor).astype(np.int64)


def read_lists(frames, s: dict, item_encoder) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row [E], item id [E], ts [E]) of every listed event of stream ``s``, rows numbered across
    ``frames``."""
    rows, items, times, n0 = [], [], [], 0
    for name, _, table in frames:
        it, tm = table[s["column"]], table[s["times"]]
        for c, col in ((s["column"], it), (s["times"], tm)):
            if not isinstance(col, (pa.ChunkedArray, pa.Array)) or not pa.types.is_list(col.type):
                raise ColumnError(f"{name}: column {c!r} is not a Parquet list column "
                                  f"(sequence from lists)")
        li = pc.fill_null(pc.list_value_length(it), 0).to_numpy()
        lt = pc.fill_null(pc.list_value_length(tm), 0).to_numpy()
        bad = np.flatnonzero(li != lt)
        if len(bad):
            i = int(bad[0])
            raise ColumnError(f"{name}: columns {s['column']!r} and {s['times']!r} differ in "
                              f"length in row {i} ({li[i]} items, {lt[i]} times; {len(bad)} "
                              f"such rows)")
        rows.append(n0 + np.repeat(np.arange(len(li)), li))
        raw = pc.list_flatten(it).to_numpy(zero_copy_only=False)
        items.append(item_encoder(np.asarray(raw).astype(str)) if len(raw)
                     else np.zeros(0, dtype=np.int64))
        times.append(list_times(tm, f"{name} column {s['times']!r}", _divisor(s)))
        n0 += len(li)
    return np.concatenate(rows), np.concatenate(items), np.concatenate(times)


def _divisor(s: dict) -> int:
    from opengem.data.sources.spec import _TIME_UNITS

    return _TIME_UNITS[s.get("time_unit", "s")]


def list_histories(frames, s: dict, c: dict, item_encoder, key: str = "sequence",
                   matches: str | None = None) -> tuple[SequenceStream, Storage, dict | None]:
    """Rows' own lists of stream ``s`` → v1 history columns in ``c`` (always: the caller may need
    them when another stream keeps the dataset v1; a v2 dataset never writes them), and, if every
    list is what the v2 join over the union per-user history gives back, that history as event
    columns (user_id, ts, item, event) for the caller to bucket. Returns the stream, the storage
    decision and those columns (None: not prefixes, v1)."""
    name, max_len = s["name"], s["max_len"]
    row, item, ts = read_lists(frames, s, item_encoder)
    user, req = c["user_id"], c["request_ts"]
    _check_list_unit(ts, req, frames, s, key)
    late = ts >= req[row]
    counts = {"events_at_or_after_the_impression_dropped": int(late.sum())}
    row, item, ts = row[~late], item[~late], ts[~late]
    # a row's events by time (then item: one canonical order of a second)
    order = np.lexsort((item, ts, row))
    row, item, ts = row[order], item[order], ts[order]
    n_rows = len(user)
    length = np.bincount(row, minlength=n_rows)
    keep = np.arange(len(row)) >= np.repeat(np.cumsum(length) - np.minimum(length, max_len), length)
    row, item, ts = row[keep], item[keep], ts[keep]  # the newest max_len of each row, as v1 stores
    length = np.bincount(row, minlength=n_rows)
    counts["events_over_max_len_cut"] = int((~keep).sum())
    stream = SequenceStream(name, item_encoder.vocab_size, 1, max_len, matches=matches)
    c[f"{name}.item"], c[f"{name}.ts"] = (item, length), (ts, length)
    c[f"{name}.event"] = (np.zeros(len(item), dtype=np.int64), length)
    # The union history: every distinct (user, ts, item), sorted; the v2 join over it must give each
    # row back.
    eu = user[row]
    o = np.lexsort((item, ts, eu))
    eu, ets, eit = eu[o], ts[o], item[o]
    new = np.r_[True, (eu[1:] != eu[:-1]) | (ets[1:] != ets[:-1]) | (eit[1:] != eit[:-1])]
    eu, ets, eit = eu[new], ets[new], eit[new]
    joined = history(eu, ets, {"item": eit}, user, req, max_len)
    same = (np.array_equal(joined["item"][1], length) and np.array_equal(joined["item"][0], item)
            and np.array_equal(joined["ts"][0], ts))
    if same:
        why = "every row's list is the time-prefix of one per-user history"
        counts["events_stored"] = len(eu)
        log_cols = {"user_id": eu, "ts": ets, "item": eit,
                    "event": np.zeros(len(eu), dtype=np.int64)}
        return stream, Storage(LAYOUT_V2, why, 1, counts), log_cols
    jlen = joined["item"][1]
    bad_row = jlen != length
    ok = np.flatnonzero(~bad_row)  # rows of equal length: compare their events one by one
    a = ranges(np.r_[0, np.cumsum(length)][ok], length[ok])
    b = ranges(np.r_[0, np.cumsum(jlen)][ok], length[ok])
    differs = (item[a] != joined["item"][0][b]) | (ts[a] != joined["ts"][0][b])
    bad_row[ok[np.unique(np.repeat(np.arange(len(ok)), length[ok])[differs])]] = True
    bad = np.flatnonzero(bad_row)
    why = (f"{len(bad)} of {n_rows} rows' lists are not the time-prefix of one per-user history "
           f"(first: row {bad[0]}; "
           "features logged at serving time?): stored per row with their times")
    counts["rows_not_prefixes"] = len(bad)
    return stream, Storage(LAYOUT_V1, why, 1, counts), None


def bucket_tables(log_cols: dict, buckets: int) -> dict[int, pa.Table]:
    """A stream's sorted event columns (``list_histories``) as one table per user bucket."""
    out = {}
    for b in range(buckets):
        m = log_cols["user_id"] % buckets == b
        out[b] = pa.table({k: pa.array(v[m]) for k, v in log_cols.items()})
    return out


def _check_list_unit(ts: np.ndarray, req: np.ndarray, frames, s: dict, key: str) -> None:
    """Listed times in another unit than ``request_ts`` would all fall after (ms read as s) or
    far before every request and leave every history silently empty: an error instead."""
    req_max = int(req.max()) if len(req) else 0
    if not len(ts) or req_max <= 1e8:  # not unix-like times: nothing to compare against
        return
    hi = int(ts.max())
    if hi > UNIT_RATIO * req_max or 0 < hi < req_max / UNIT_RATIO:
        raise ColumnError(f"{[f for f, _, _ in frames]} column {s['times']!r}: the latest listed "
                          f"time {hi} vs the impressions' last request_ts {req_max}: times in "
                          f"another unit? set {key}.time_unit")
