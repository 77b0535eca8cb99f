"""The impressions table out of core: the generic importer never holds it whole.

Its stages, in data-flow order (``generic.convert_frames`` runs them top to bottom):

1. ``Impressions(...)`` scans each input table (a CSV/TSV/Parquet file read in record batches, or
   columns in memory) in chunks of ``CHUNK_ROWS`` rows: labels, dense values, times, the ids of
   hashed and pre-encoded sparse features and the raw strings of the rest are parsed with the
   checks and messages a whole table gets (rows numbered from the file's start), and appended to
   a DuckDB table on disk with their row number, the input order across files that breaks ties
   of equal times.
2. ``split`` gives every row its day in SQL (its file's; a global rank by time; each user's last
   rows; ``random``: a seeded permutation, the one stage that holds a number per row) and its user
   id (the rank of its user among the sorted user values), and keeps each user's last train and
   last request times (``Users``) for the events streams.
3. ``distinct`` streams a column's distinct values (over the train rows) to fit a vocabulary.
4. ``ordered`` reads the rows back in output order (day, user bucket, time, row number) in chunks,
   as ``common.write_shards`` cuts them into shards.

Memory: a chunk, DuckDB's ``MEMORY_LIMIT`` (its sorts, windows and joins spill to the workspace
directory) and per-user and per-vocabulary state. ``whole`` reads whole columns in row order for
the parts that still need them (streams from rows or lists, embeddings), and logs it.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import numpy as np
import pyarrow as pa

from opengem.data.parquet import DataError
from opengem.data.sources.common import (
    ColumnError,
    need,
    parse_time,
    random_split,
    read_csv,
    time_is_numeric,
    to_float,
    to_label,
)
from opengem.data.sources.spec import time_divisor

log = logging.getLogger("opengem")

CHUNK_ROWS = 65_536  # rows parsed, encoded and handed to the shard writer at a time
MEMORY_LIMIT = "512MB"  # DuckDB's working memory; beyond it its sorts and joins spill to disk
WHOLE_WARN_ROWS = 10_000_000  # holding columns whole is logged as a warning from this many rows
NEVER = np.iinfo(np.int64).min  # the last train request of a user with no train row


class Workspace:
    """A DuckDB database spilling to a temporary directory, shared by the impressions and every
    events stream of one import: one memory limit and one place to spill, removed on ``close``."""

    def __init__(self):
        try:
            import duckdb
        except ImportError as e:  # an optional dependency of the package: say which
            raise ImportError("the generic importer sorts and splits tables out of core with "
                              "DuckDB: pip install 'opengem[import]' (or -r requirements.txt)"
                              ) from e
        self._tmp = tempfile.TemporaryDirectory(prefix="opengem-import-")
        self.dir = Path(self._tmp.name)
        # in memory: its tables spill to the temporary directory beyond the limit, with no
        # database file to write and checkpoint
        self.con = duckdb.connect(config={"memory_limit": MEMORY_LIMIT, "threads": 1,
                                          "temp_directory": str(self.dir / "spill")})
        # DuckDB draws a progress bar on stdout, the caller's output, on long queries
        self.con.execute("SET enable_progress_bar = false")
        self.error = duckdb.Error

    def close(self) -> None:
        self.con.close()
        self._tmp.cleanup()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------------------------ the inputs
@dataclass
class Source:
    """One input table of the impressions: a file (``path``, read in record batches) or columns in
    memory (``frame``); ``name`` names it in messages and in ``source.files``, ``day`` is its split
    (``split.by: files``) or None."""

    name: str
    day: int | None
    path: Path | None = None
    frame: dict | None = None
    sep: str = ","

    @property
    def parquet(self) -> bool:
        return self.path is not None and self.path.name.endswith(".parquet")

    def columns(self, only: set[str]) -> list[str]:
        """The names a missing column is reported against: a Parquet file's within ``only`` (it
        is read no further), every column of a CSV or a frame."""
        if self.frame is not None:
            return list(self.frame)
        if self.parquet:
            return [c for c in self._parquet().schema_arrow.names if c in only]
        return self._csv_names()

    def batches(self, cols: list[str], numeric: Callable[[str], bool] | None,
                rows: int) -> Iterator[dict[str, np.ndarray]]:
        """``cols`` as numpy columns, at most ``rows`` rows at a time, converted as
        ``read_table`` converts a whole file (a CSV's ``numeric`` columns as float64, the rest as
        strings; a Parquet file's numbers native, the rest strings)."""
        if self.frame is not None:
            n = len(next(iter(self.frame.values()))) if self.frame else 0
            for i in range(0, n, rows):
                yield {c: self.frame[c][i:i + rows] for c in cols}
        elif self.parquet:
            yield from self._parquet_batches(cols, rows)
        else:
            yield from self._csv_batches(cols, numeric, rows)

    def head(self, col: str, numeric: Callable[[str], bool] | None, k: int = 100) -> np.ndarray:
        """The first ``k`` values of a column (a time column's format is judged on them)."""
        parts, got = [], 0
        for b in self.batches([col], numeric, k):
            parts.append(b[col])
            got += len(b[col])
            if got >= k:
                break
        return np.concatenate(parts)[:k] if parts else np.zeros(0)

    def whole(self, cols: list[str], numeric: Callable[[str], bool] | None,
              lists: tuple[str, ...]) -> dict:
        """``cols`` whole (``read_table``): for the parts of an import that still need them."""
        if self.frame is not None:
            return {c: self.frame[c] for c in cols}
        return read_table(self.path, self.sep, numeric, lists, set(cols))

    def _parquet(self):
        import pyarrow.parquet as pq

        if not self.path.exists():
            raise ColumnError(f"{self.path}: file not found")
        try:
            return pq.ParquetFile(self.path)
        except (pa.ArrowInvalid, OSError) as e:
            raise ColumnError(f"{self.path}: not a readable Parquet file ({e})") from e

    def _parquet_batches(self, cols: list[str], rows: int) -> Iterator[dict[str, np.ndarray]]:
        pf = self._parquet()
        nulls = _columns_with_nulls(pf, cols)
        try:
            for batch in pf.iter_batches(batch_size=rows, columns=cols):
                yield {c: _parquet_numpy(self.path, c, batch.column(c), c in nulls) for c in cols}
        except (pa.ArrowInvalid, OSError) as e:
            raise ColumnError(f"{self.path}: not a readable Parquet file ({e})") from e

    def _csv_options(self) -> dict:
        import pyarrow.csv as pa_csv

        return {"read_options": pa_csv.ReadOptions(encoding="utf8"),
                "parse_options": pa_csv.ParseOptions(delimiter=self._delimiter())}

    def _delimiter(self) -> str:
        return "\t" if self.path.name.endswith(".tsv") else self.sep

    def _csv_names(self) -> list[str]:
        import pyarrow.csv as pa_csv

        if not self.path.exists():
            raise DataError(f"{self.path}: file not found")
        try:
            return pa_csv.open_csv(self.path, **self._csv_options()).schema.names
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"{self.path}: not a readable CSV ({e})") from e

    def _csv_batches(self, cols: list[str], numeric: Callable[[str], bool] | None,
                     rows: int) -> Iterator[dict[str, np.ndarray]]:
        """As ``read_csv``: a non-number in a numeric column raises ``NotNumbers`` (the caller
        reads the file again as strings, so that ``to_float`` names the value)."""
        import pyarrow.csv as pa_csv

        from opengem.data.sources.common import _numpy

        self._csv_names()  # the file's own errors first
        types = {c: pa.float64() if numeric and numeric(c) else pa.string() for c in cols}
        try:
            reader = pa_csv.open_csv(self.path, convert_options=pa_csv.ConvertOptions(
                column_types=types, include_columns=cols), **self._csv_options())
            for batch in reader:
                for i in range(0, batch.num_rows, rows):
                    part = batch.slice(i, rows)
                    yield {c: _numpy(pa.chunked_array([part.column(c)])) for c in cols}
        except pa.ArrowInvalid as e:
            if numeric and any(numeric(c) for c in cols):
                raise NotNumbers() from e
            raise DataError(f"{self.path}: not a readable CSV ({e})") from e
        except OSError as e:
            raise DataError(f"{self.path}: not a readable CSV ({e})") from e


class NotNumbers(Exception):
    """A CSV's numeric column holds a non-number: read the file again as strings."""


def read_table(path: Path, sep: str = ",", numeric=None, lists: tuple[str, ...] = (),
               only: set[str] | None = None) -> dict[str, np.ndarray]:
    """A CSV (strings) or Parquet (native numbers, other columns as strings) file as numpy columns;
    the Parquet list columns named in ``lists`` stay Arrow arrays (``sequence.from: lists``).
    ``only``: read just these columns (the others are never decoded)."""
    if path.name.endswith(".parquet"):
        import pyarrow.parquet as pq

        if not path.exists():
            raise ColumnError(f"{path}: file not found")
        try:
            names = pq.read_schema(path).names
            t = pq.read_table(path, columns=[c for c in names if only is None or c in only])
        except (pa.ArrowInvalid, OSError) as e:
            raise ColumnError(f"{path}: not a readable Parquet file ({e})") from e
        return {name: col if name in lists else _parquet_numpy(path, name, col)
                for name, col in zip(t.column_names, t.columns)}
    return read_csv(path, sep="\t" if path.name.endswith(".tsv") else sep, numeric=numeric,
                    columns=None if only is None else list(only))


def _parquet_numpy(path: Path, name: str, col, file_has_nulls: bool = False) -> np.ndarray:
    """A Parquet column as numpy: numbers native, the rest strings. ``file_has_nulls``: a batch
    of a column with nulls elsewhere in its file converts as the whole column does (integers as
    float64, booleans as objects), so that every batch gives the same strings."""
    if pa.types.is_nested(col.type):
        raise ColumnError(f"{path}: column {name!r} is a {col.type} column; use a "
                          f"delimited string (multi_hot)")
    v = col.to_numpy(zero_copy_only=False)
    if file_has_nulls and not col.null_count:
        if pa.types.is_integer(col.type):
            v = v.astype(np.float64)
        elif pa.types.is_boolean(col.type):
            v = v.astype(object)
    return v if v.dtype.kind in "iufb" else v.astype(str)


def _columns_with_nulls(pf, cols: list[str]) -> set[str]:
    """The columns of a Parquet file with a null anywhere: from the row groups' statistics, or
    (none written) by reading that column alone."""
    meta = pf.metadata
    out = set()
    for c in cols:
        leaf = [i for i in range(meta.num_columns) if meta.schema.column(i).path == c]
        if not leaf:  # nested, or absent: nothing to convert
            continue
        stats = [meta.row_group(g).column(leaf[0]).statistics for g in range(meta.num_row_groups)]
        if all(s is not None and s.has_null_count for s in stats):
            if sum(s.null_count for s in stats):
                out.add(c)
        elif pf.read(columns=[c]).column(c).null_count:
            out.add(c)
    return out


# ------------------------------------------------------------------------------ the staged table
@dataclass
class Users:
    """Per-user state of a split table (the workspace's ``users`` table: u, uid, train_ts,
    last_ts): the user count, each user's last request time (by uid) and the latest of all."""

    count: int
    last_ts: np.ndarray
    req_max: int
    # pseudonymised imports: each user id's pseudonym (row i = user i), sorted
    pseudonyms: np.ndarray | None = None


class Impressions:
    """The impressions of ``sources`` staged in ``ws`` (see the module docstring).

    ``needed``: the columns every table must have (a missing one is a ``ColumnError`` naming the
    file); ``ids``: label → (column, a stateless encoder: hashed or pre-encoded ids), applied
    while scanning; ``strings``: the columns kept as raw strings (vocabularies fitted after the
    split, the domain, per-row streams). ``numeric``: the CSV columns read as numbers.
    """

    def __init__(self, ws: Workspace, sources: list[Source], spec: dict, needed: list[str],
                 ids: dict, strings: list[str], numeric: Callable[[str], bool] | None = None,
                 chunk_rows: int = CHUNK_ROWS):
        self.ws, self.con, self.spec = ws, ws.con, spec
        self.chunk_rows, self.numeric, self.needed = chunk_rows, numeric, needed
        self.files = [s.name for s in sources]
        self.tasks = {t["name"]: f"t{i}" for i, t in enumerate(spec["tasks"])}
        self.dense = {f["name"]: f"x{i}" for i, f in enumerate(spec["dense"])}
        self.ids = {label: (c, enc, f"i{i}") for i, (label, (c, enc)) in enumerate(ids.items())}
        self.strings = {c: f"r{i}" for i, c in enumerate(dict.fromkeys(strings))}
        self.read = list(dict.fromkeys(
            [t["column"] for t in spec["tasks"]] + [f["column"] for f in spec["dense"]]
            + [spec[k] for k in ("time", "user") if k in spec]
            + [c for c, _, _ in self.ids.values()]
            + list(self.strings)))
        self.schema = pa.schema(
            [("rn", pa.int64()), ("fi", pa.int32()), ("fday", pa.int32()), ("ts", pa.int64()),
             ("u", pa.string())] + [(k, pa.int8()) for k in self.tasks.values()]
            + [(k, pa.float32()) for k in self.dense.values()]
            + [(k, pa.int64()) for _, _, k in self.ids.values()]
            + [(k, pa.string()) for k in self.strings.values()])
        self.n = 0
        self.starts: list[int] = []  # each file's first row number (``locate``)
        self.missing = dict.fromkeys(self.dense, 0)  # NaNs kept per dense feature
        self._insert(self.schema.empty_table(), create=True)
        for fi, src in enumerate(sources):
            self._scan(fi, src)

    # -------------------------------------------------------------------------------- 1. scan
    def _scan(self, fi: int, src: Source) -> None:
        """One input table, chunk by chunk; a CSV whose numeric column holds a non-number is read
        again as strings."""
        need(dict.fromkeys(src.columns(set(self.needed))), self.needed, src.name)
        n0, missing0 = self.n, dict(self.missing)
        self.starts.append(n0)
        for numeric in (self.numeric, None):
            try:
                numeric_time = (time_is_numeric(src.head(self.spec["time"], numeric))
                                if "time" in self.spec else None)
                row0 = 0
                for batch in src.batches(self.read, numeric, self.chunk_rows):
                    self._stage(fi, src, batch, row0, numeric_time)
                    row0 += len(next(iter(batch.values())))
                return
            except NotNumbers:
                self.con.execute(f"DELETE FROM raw WHERE fi = {fi}")
                self.n, self.missing = n0, missing0

    def _stage(self, fi: int, src: Source, t: dict, row0: int, numeric_time: bool | None) -> None:
        """One chunk parsed (labels, dense, time, ids, strings: the checks of a whole table, rows
        numbered from the file's start) and appended to the staged table."""
        m = len(next(iter(t.values())))
        spec, name = self.spec, src.name
        rn = np.arange(self.n, self.n + m, dtype=np.int64)
        out = {"rn": rn, "fi": np.full(m, fi, dtype=np.int32),
               "fday": np.full(m, -1 if src.day is None else src.day, dtype=np.int32)}
        for task in spec["tasks"]:
            out[self.tasks[task["name"]]] = to_label(t[task["column"]],
                                                     f"{name} column {task['column']!r}",
                                                     task.get("positive_at"), row0=row0)
        for f in spec["dense"]:
            v = to_float(t[f["column"]], f"{name} column {f['column']!r}", f.get("fill"),
                         keep_missing=f.get("missing") == "indicator", row0=row0)
            v = np.log1p(np.maximum(v, 0)) if f["transform"] == "log1p" else v
            out[self.dense[f["name"]]] = v.astype(np.float32)
            self.missing[f["name"]] += int(np.isnan(out[self.dense[f["name"]]]).sum())
        out["ts"] = (parse_time(t[spec["time"]], f"{name} column {spec['time']!r}",
                                time_divisor(spec), numeric_time, row0)
                     if "time" in spec else rn)
        out["u"] = (np.asarray(t[spec["user"]]).astype(str) if "user" in spec
                    else rn.astype(str))
        for col, enc, key in self.ids.values():
            out[key] = enc(np.asarray(t[col]).astype(str))
        for col, key in self.strings.items():
            out[key] = np.asarray(t[col]).astype(str)
        self._insert(pa.table(out, schema=self.schema))
        self.n += m

    def _insert(self, table: pa.Table, create: bool = False) -> None:
        self.con.register("chunk", table)
        self.con.execute("CREATE TABLE raw AS SELECT * FROM chunk" if create
                         else "INSERT INTO raw SELECT * FROM chunk")
        self.con.unregister("chunk")

    def locate(self, rn: int) -> tuple[str, int]:
        """(file name, row within it) of row number ``rn``, for messages."""
        fi = int(np.searchsorted(self.starts, rn, side="right")) - 1
        return self.files[fi], int(rn) - self.starts[fi]

    # ------------------------------------------------------------------------------- 2. split
    def split(self, by: dict, seed: int,
              pseudonym: Callable[[np.ndarray], np.ndarray] | None = None) -> Users:
        """Each row's day (``by``: the spec's split) and user id; per-user times (``Users``).
        ``pseudonym``: user ids are the ranks of the users' pseudonyms, not of their raw values
        (``opengem.data.pseudonym``)."""
        q = self.con.execute
        order = "u" if pseudonym is None else self._pseudonyms(pseudonym)
        q(f"CREATE TABLE users AS SELECT u, CAST(row_number() OVER (ORDER BY {order}) - 1 AS "
          f"BIGINT) AS uid FROM {'(SELECT DISTINCT u FROM raw)' if pseudonym is None else 'pu'}")
        src, drop = "raw", "fday"
        if by["by"] == "files":
            day = "fday"
        elif by["by"] == "random":  # numpy's seeded permutation: the one per-row array
            held_whole("the random split's seeded permutation", self.n)
            days = random_split(self.n, by["valid"], by["test"], seed)
            self.con.register("days", pa.table({"rn": np.arange(self.n), "day": days}))
            src, day = "raw JOIN days USING (rn)", "days.day"
        else:  # rank by (time, row number): globally, or within each user
            part = "PARTITION BY u " if by["by"] == "user_time" else ""
            src = (f"(SELECT *, row_number() OVER ({part}ORDER BY ts, rn) - 1 AS _rank, "
                   f"count(*) OVER ({part.strip()}) AS _n FROM raw) raw")
            day, drop = _shares("_rank", "_n", by["valid"], by["test"]), "fday, _rank, _n"
        q(f"CREATE TABLE imp AS SELECT raw.* EXCLUDE ({drop}), users.uid, "
          f"CAST({day} AS INTEGER) AS day FROM {src} JOIN users USING (u)")
        q("DROP TABLE raw")
        if by["by"] == "random":
            self.con.unregister("days")
        q(f"CREATE TABLE user_ts AS SELECT users.u, users.uid, "
          f"coalesce(s.train_ts, {NEVER}) AS train_ts, s.last_ts FROM users JOIN "
          f"(SELECT uid, max(ts) FILTER (WHERE day = 0) AS train_ts, max(ts) AS last_ts "
          f"FROM imp GROUP BY uid) s USING (uid)")
        q("DROP TABLE users")
        q("ALTER TABLE user_ts RENAME TO users")
        last = self.con.sql("SELECT last_ts FROM users ORDER BY uid").fetchnumpy()["last_ts"]
        last = np.asarray(last, dtype=np.int64)
        names = None
        if pseudonym is not None:
            names = self.con.sql("SELECT p FROM pu ORDER BY p").fetchnumpy()["p"].astype(str)
            q("DROP TABLE pu")
        return Users(len(last), last, int(last.max()) if len(last) else 0, names)

    def _pseudonyms(self, pseudonym: Callable[[np.ndarray], np.ndarray]) -> str:
        """The workspace table ``pu`` (u, p): every distinct user and its pseudonym, hashed a
        chunk of users at a time (the users are per-user state: held whole); returns the column to
        rank users by."""
        self.con.execute("CREATE TABLE pu (u VARCHAR, p VARCHAR)")
        users = self.con.sql("SELECT DISTINCT u FROM raw").to_arrow_table().column(0)
        for lo in range(0, len(users), self.chunk_rows):
            u = users.slice(lo, self.chunk_rows).to_numpy(zero_copy_only=False).astype(str)
            self._insert_into("pu", pa.table({"u": u, "p": pseudonym(u)}))
        return "p"

    def _insert_into(self, name: str, table: pa.Table) -> None:
        self.con.register("chunk", table)
        self.con.execute(f"INSERT INTO {name} SELECT * FROM chunk")
        self.con.unregister("chunk")

    # --------------------------------------------------------------------------------- 3. fit
    def distinct(self, column: str, train: bool = True) -> Iterator[np.ndarray]:
        """The distinct raw strings of a ``strings`` column (of the train rows), in chunks."""
        rel = self.con.sql(f"SELECT DISTINCT {self.strings[column]} FROM imp"
                           + (" WHERE day = 0" if train else ""))
        for b in rel.to_arrow_reader(self.chunk_rows):
            yield b.column(0).to_numpy(zero_copy_only=False).astype(str)

    def first_not_in(self, column: str, values: list[str]) -> str | None:
        """The first value (in row order) of a ``strings`` column that is not in ``values``."""
        self.con.register("allowed", pa.table({"v": pa.array(values, pa.string())}))
        k = self.strings[column]
        row = self.con.sql(f"SELECT {k} FROM imp WHERE {k} NOT IN (SELECT v FROM allowed) "
                           f"ORDER BY rn LIMIT 1").fetchall()
        self.con.unregister("allowed")
        return row[0][0] if row else None

    # -------------------------------------------------------------------------------- 4. read
    def ordered(self, buckets: int) -> Iterator[tuple[int, int, dict]]:
        """Every row in output order — day, user bucket (``user_id % buckets``), time, row
        number — as (day, bucket, columns) chunks of at most ``chunk_rows`` rows
        (``_columns``)."""
        rel = self.con.sql(f"SELECT day, uid % {buckets} AS bucket, {self._select()} FROM imp "
                           f"ORDER BY day, bucket, ts, rn")
        for b in rel.to_arrow_reader(self.chunk_rows):
            day, bucket = b.column(0).to_numpy(), b.column(1).to_numpy()
            cut = np.flatnonzero((day[1:] != day[:-1]) | (bucket[1:] != bucket[:-1])) + 1
            cols = self._columns(b)
            for lo, hi in zip(np.r_[0, cut], np.r_[cut, b.num_rows]):
                yield int(day[lo]), int(bucket[lo]), {k: v[lo:hi] for k, v in cols.items()}

    def whole(self, why: str) -> dict:
        """Every column whole, in row order (``_columns``, plus ``day``), for ``why`` (logged)."""
        held_whole(f"every impression column ({why})", self.n)
        t = self.con.sql(f"SELECT day, {self._select()} FROM imp ORDER BY rn").to_arrow_table()
        return {"day": t.column(0).to_numpy(), **self._columns(t)}

    def _select(self) -> str:
        keys = (["rn", "uid", "ts"] + list(self.tasks.values()) + list(self.dense.values())
                + [k for _, _, k in self.ids.values()] + list(self.strings.values()))
        return ", ".join(keys)

    def _columns(self, t) -> dict:
        """A result's columns by their names in the output (``rn``, ``user_id``, ``request_ts``,
        task and dense names) or, for sparse inputs, ``("ids", column)`` and ``("raw", column)``."""
        def num(k):
            return np.asarray(t.column(k).to_numpy())

        out = {"rn": num("rn"), "user_id": num("uid"), "request_ts": num("ts")}
        out |= {name: num(k) for name, k in (self.tasks | self.dense).items()}
        out |= {("ids", label): num(k) for label, (_, _, k) in self.ids.items()}
        out |= {("raw", c): t.column(k).to_numpy(zero_copy_only=False).astype(str)
                for c, k in self.strings.items()}
        return out


def held_whole(what: str, rows: int) -> None:
    """Log that ``what`` is held in memory for every impression row (a warning at a size where
    it matters)."""
    log.log(logging.WARNING if rows >= WHOLE_WARN_ROWS else logging.INFO,
            "import: %s held whole in memory (%d impression rows); streams from events and "
            "plain features are read in chunks", what, rows)


def _shares(rank: str, n: str, valid: float, test: float) -> str:
    """``common._bucket`` in SQL: the last ``floor(n × test)`` ranks → test (2), the
    ``floor(n × valid)`` before them → valid (1), the rest train (0); the shares are doubles, as
    in numpy, given as text so that DuckDB parses the same float."""
    t, v = f"CAST('{float(test)!r}' AS DOUBLE)", f"CAST('{float(valid)!r}' AS DOUBLE)"
    n_test, n_valid = f"CAST(floor({n} * {t}) AS BIGINT)", f"CAST(floor({n} * {v}) AS BIGINT)"
    return (f"CASE WHEN {rank} >= {n} - {n_test} THEN 2 "
            f"WHEN {rank} >= {n} - {n_test} - {n_valid} THEN 1 ELSE 0 END")
