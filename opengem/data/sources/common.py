"""Pieces every real-data adapter shares: id vocabularies, leakage-free histories, splits, writing.

Ids. Built-in adapters map raw values to contiguous ids with a vocabulary *fitted on the train split
only*: train values get ``0..n-1`` in sorted order, a value never seen in train gets ``n`` — the
schema's OOV row (``vocab_size = n``), so a valid/test row with a new ad is a cold start, as it
would be in production. The generic adapter may also hash (``hash_size``) or pass pre-encoded
ids through.

Histories. ``history`` gives each row the events of its user with timestamp *strictly before* the
row's request time, oldest → newest, the most recent ``max_len`` kept. An event at the same second
as the row (the row itself included) is never in its history, so no label leaks into a feature.

Splits. A dataset's splits are logical days (the manifest maps a split to its days): adapters that
split by time or by user write ``day`` 0 = train, 1 = valid, 2 = test unless they have real days.
The generic importer computes the same splits in SQL (``impressions``); these are the definitions.

Writing. ``write_shards`` takes rows already in output order, in chunks of any size, and cuts the
shards; ``write_dataset`` is its in-memory front (columns whole, ordered here).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa

from opengem.data.parquet import (
    LAYOUT_V1,
    LAYOUT_V2,
    DataError,
    DatasetManifest,
    ShardWriter,
    impression_columns,
    list_array,
)
from opengem.features.schema import FeatureSchema, SchemaError

SPLITS = ("train", "valid", "test")
TRAIN, VALID, TEST = 0, 1, 2


class SpecError(SchemaError):
    """A source spec (the generic adapter's JSON file or a built-in spec) is invalid; names file
    and key."""


class ColumnError(DataError):
    """An input column is missing or holds values of the wrong kind; names file, column
    and value."""


# ------------------------------------------------------------------------------------------ ids
class Vocab:
    """Contiguous ids for the values seen in ``fit_values``; anything else maps to
    ``vocab_size`` (OOV)."""

    def __init__(self, fit_values: np.ndarray):
        self.values = np.unique(np.asarray(fit_values).astype(str))

    def __len__(self) -> int:
        return len(self.values)

    @property
    def vocab_size(self) -> int:
        return max(len(self.values), 1)  # a schema needs >= 1 row; an empty vocab maps all to OOV

    def __call__(self, values: np.ndarray) -> np.ndarray:
        v = np.asarray(values).astype(str)
        if not len(self.values):
            return np.full(len(v), self.vocab_size, dtype=np.int64)
        pos = np.clip(np.searchsorted(self.values, v), 0, len(self.values) - 1)
        return np.where(self.values[pos] == v, pos, self.vocab_size).astype(np.int64)


def hash_ids(values: np.ndarray, size: int, salt: str = "") -> np.ndarray:
    """Stable (process- and platform-independent) hash of each value's string form into
    ``[0, size)``."""
    v = np.asarray(values).astype(str)
    uniq, inv = np.unique(v, return_inverse=True)
    h = np.array(
        [
            int.from_bytes(hashlib.blake2b((salt + u).encode(), digest_size=8).digest(), "little")
            % size
            for u in uniq
        ],
        dtype=np.int64,
    )
    return h[inv.reshape(-1)] if len(v) else np.zeros(0, dtype=np.int64)


def fit_ids(values: np.ndarray, train: np.ndarray) -> tuple[np.ndarray, int]:
    """Contiguous ids fitted on the rows where ``train`` is true; (ids, vocab_size)."""
    vocab = Vocab(np.asarray(values)[train])
    return vocab(values), vocab.vocab_size


def time_is_numeric(values: np.ndarray) -> bool:
    """Whether a time column holds numbers (else ISO-8601 datetimes), judged on its first 100
    values: a column read in chunks is judged once, on its head."""
    return all(_is_float(x) for x in np.char.strip(np.asarray(values[:100]).astype(str)))


def parse_time(values: np.ndarray, where: str, divisor: int = 1, numeric: bool | None = None,
               row0: int = 0) -> np.ndarray:
    """Unix seconds (int64) from numbers (seconds × ``divisor``) or ISO-8601 datetimes
    (``2019-11-24 00:00:34.76+00:00``; an offset is applied, none means UTC). ``numeric``: the
    column's ``time_is_numeric`` (default: judged on ``values``); ``row0``: the row number of
    ``values[0]`` in messages."""
    v = np.char.strip(np.asarray(values).astype(str))
    if time_is_numeric(v) if numeric is None else numeric:
        return (to_float(v, where, row0=row0) // divisor).astype(np.int64)
    out = np.empty(len(v), dtype=np.int64)
    for i, x in enumerate(v):
        off = 0
        if x.endswith("Z"):
            x = x[:-1]
        elif len(x) > 6 and x[-6] in "+-" and x[-3] == ":":
            sign = 1 if x[-6] == "+" else -1
            off, x = sign * (int(x[-5:-3]) * 3600 + int(x[-2:]) * 60), x[:-6]
        try:
            out[i] = np.datetime64(x.replace(" ", "T"), "s").astype(np.int64) - off
        except ValueError:
            raise ColumnError(f"{where}: {str(values[i])!r} in row {row0 + i} is not a unix "
                              f"time or an ISO-8601 "
                              "datetime") from None
    return out


# ------------------------------------------------------------------------------------ histories
def ranges(lo: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Flat indices ``lo[i] .. lo[i]+lengths[i]-1`` of every row, concatenated."""
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(
        np.asarray(lo, dtype=np.int64) - starts, lengths
    )


def history(ev_user: np.ndarray, ev_ts: np.ndarray, ev_cols: dict[str, np.ndarray],
            row_user: np.ndarray, row_ts: np.ndarray,
            max_len: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each row's strictly-earlier events of the same user, oldest → newest, last ``max_len``
    kept.

    Returns ``{name: (flat values, lengths)}`` for every event column plus ``"ts"``. Ties in time
    keep the events' input order. ``row_user``/``ev_user`` are any comparable ids.
    """
    order, end, start = _prior(ev_user, ev_ts, row_user, row_ts)
    lo = np.maximum(start, end - max_len)
    lengths = end - lo
    idx = order[ranges(lo, lengths)]
    out = {name: (np.asarray(col)[idx], lengths) for name, col in ev_cols.items()}
    out["ts"] = (np.asarray(ev_ts, dtype=np.int64)[idx], lengths)
    return out


def prior_stats(ev_group: np.ndarray, ev_ts: np.ndarray, ev_value: np.ndarray,
                row_group: np.ndarray, row_ts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(count, sum of ``ev_value``) of each row's group's events strictly before the row's time."""
    order, end, start = _prior(ev_group, ev_ts, row_group, row_ts)
    csum = np.r_[0.0, np.cumsum(np.asarray(ev_value, dtype=np.float64)[order])]
    return end - start, csum[end] - csum[start]


def _prior(ev_group, ev_ts, row_group, row_ts):
    """Events sorted by (group, time); per row the [start, end) of its group's
    strictly-earlier events."""
    groups = np.unique(np.concatenate([np.asarray(ev_group), np.asarray(row_group)]))
    all_ts = np.concatenate([np.asarray(ev_ts, dtype=np.int64), np.asarray(row_ts, dtype=np.int64)])
    t0 = int(all_ts.min(initial=0))
    # (group, time) packed into one int64 key
    bits = max(int(all_ts.max(initial=0)) - t0, 1).bit_length()
    if len(groups) >= 1 << (62 - bits):
        raise ValueError(f"{len(groups)} groups over a time span of 2^{bits} s do not fit a "
                         f"63-bit key")

    def key(g, t):
        return (np.searchsorted(groups, g).astype(np.int64) << bits) + (
            np.asarray(t, dtype=np.int64) - t0
        )

    ev_key = key(ev_group, ev_ts)
    order = np.argsort(ev_key, kind="stable")
    ev_key = ev_key[order]
    row_key = key(row_group, row_ts)
    # the first event not strictly before the row
    end = np.searchsorted(ev_key, row_key, side="left")
    # the group's first event
    start = np.searchsorted(ev_key, (row_key >> bits) << bits, side="left")
    return order, end, start


# ---------------------------------------------------------------------------------------- splits
def split_by_time(ts: np.ndarray, valid: float, test: float) -> np.ndarray:
    """Global time split by rank: the last ``test`` share of rows (by time, then input order) →
    test, the ``valid`` share before it → valid, the rest → train. Returns the day (0/1/2)
    per row."""
    n = len(ts)
    rank = np.empty(n, dtype=np.int64)
    rank[np.argsort(ts, kind="stable")] = np.arange(n)
    return _bucket(rank, np.full(n, n), valid, test)


def split_per_user(user: np.ndarray, ts: np.ndarray, valid: float, test: float) -> np.ndarray:
    """Per-user time split: each user's last ``test`` share of rows (by time) → test, the
    ``valid`` share before → valid, the rest → train (``floor`` of each share, so a user with
    few rows keeps them all in train). Returns the day (0/1/2) per row."""
    order = np.lexsort((np.arange(len(ts)), ts, user))
    u = np.asarray(user)[order]
    first = np.r_[True, u[1:] != u[:-1]]
    group_start = np.maximum.accumulate(np.where(first, np.arange(len(u)), 0))
    counts = np.diff(np.r_[np.flatnonzero(first), len(u)])
    n_user = np.repeat(counts, counts)
    rank = np.empty(len(u), dtype=np.int64)
    rank[order] = np.arange(len(u)) - group_start
    n_row = np.empty(len(u), dtype=np.int64)
    n_row[order] = n_user
    return _bucket(rank, n_row, valid, test)


def _bucket(rank: np.ndarray, n: np.ndarray, valid: float, test: float) -> np.ndarray:
    n_test = np.floor(n * test).astype(np.int64)
    n_valid = np.floor(n * valid).astype(np.int64)
    day = np.full(len(rank), TRAIN, dtype=np.int32)
    day[rank >= n - n_test - n_valid] = VALID
    day[rank >= n - n_test] = TEST
    return day


def random_split(n: int, valid: float, test: float, seed: int) -> np.ndarray:
    """A seeded random split, for data with no time at all: the rows a seeded permutation puts last
    are test, those before them valid (``_bucket``'s shares, without a rank array). Returns the day
    (0/1/2) per row."""
    perm = np.random.default_rng(seed).permutation(n)
    n_test, n_valid = int(np.floor(n * test)), int(np.floor(n * valid))
    day = np.full(n, TRAIN, dtype=np.int32)
    day[perm[n - n_test - n_valid:]] = VALID
    day[perm[n - n_test:]] = TEST
    return day


# --------------------------------------------------------------------------------------- writing
ROWS_PER_SHARD = 50_000


def write_dataset(out_dir: str | Path, schema: FeatureSchema, cols: dict, day: np.ndarray,
                  splits: dict[str, list[int]] | None = None, source: dict | None = None,
                  rows_per_shard: int = ROWS_PER_SHARD, layout: int = LAYOUT_V1, buckets: int = 1,
                  events: Callable[[ShardWriter], None] | None = None) -> DatasetManifest:
    """Write rows (``cols``: name → array, or (flat values, lengths) for list columns) as shards.

    One or more shards per day, rows in time order inside a day (ties in row order). Layout v2:
    per (day, user bucket ``user_id % buckets``). The rest is ``write_shards``'s.
    """
    day = np.asarray(day, dtype=np.int32)
    _check_columns(schema, cols, layout)
    offsets = {k: np.r_[0, np.cumsum(v[1])] for k, v in cols.items() if isinstance(v, tuple)}
    ts = np.asarray(cols[schema.time_column])
    bucket = (
        np.asarray(cols[schema.user_column]) % buckets
        if layout == LAYOUT_V2
        else np.zeros(len(day), np.int64)
    )

    def ordered():
        for d in np.unique(day):
            for b in np.unique(bucket[day == d]):
                rows = np.flatnonzero((day == d) & (bucket == b))
                rows = rows[np.argsort(ts[rows], kind="stable")]
                for i in range(0, len(rows), rows_per_shard):
                    yield int(d), int(b), take_rows(cols, offsets, rows[i:i + rows_per_shard])

    return write_shards(out_dir, schema, ordered(), splits, source, rows_per_shard, layout, events)


def write_shards(out_dir: str | Path, schema: FeatureSchema,
                 chunks: Iterable[tuple[int, int, dict]],
                 splits: dict[str, list[int]] | None = None, source: dict | None = None,
                 rows_per_shard: int | None = None, layout: int = LAYOUT_V1,
                 events: Callable[[ShardWriter], None] | None = None) -> DatasetManifest:
    """Write rows that arrive in output order as (day, bucket, columns) chunks of any size: each
    (day, bucket) run is cut into shards of ``rows_per_shard`` rows, so only one shard's rows are
    held, whatever the table's length.

    ``splits`` defaults to day 0/1/2 → train/valid/test; the row counts per split go into the
    manifest's ``source.rows``. Layout v2: shards are named by user bucket and carry no history
    columns; ``events(writer)`` then writes the event logs (``ShardWriter.write_events``) of the
    same buckets. ``rows_per_shard`` defaults to ``ROWS_PER_SHARD``.
    """
    rows_per_shard = rows_per_shard or ROWS_PER_SHARD
    splits = splits or {s: [d] for d, s in enumerate(SPLITS)}
    writer = ShardWriter(out_dir, schema, layout=layout)
    per_day: dict[int, int] = {}
    key, part, held = None, 0, []

    def flush(rows: int) -> None:
        nonlocal part, held
        whole = held[0] if len(held) == 1 else concat_rows(held)
        table = _table(schema, slice_rows(whole, 0, rows), key[0], layout)
        if layout == LAYOUT_V2:
            writer.write(table, f"d{key[0]:03d}-b{key[1]:05d}-p{part:04d}", key[0], bucket=key[1])
        else:
            writer.write(table, f"d{key[0]:03d}-p{part:04d}", key[0])
        rest = n_rows(whole) - rows
        held, part = ([slice_rows(whole, rows, rest)] if rest else []), part + 1

    for d, b, chunk in chunks:
        _check_columns(schema, chunk, layout)
        if (d, b) != key:
            if held:
                flush(sum(map(n_rows, held)))
            key, part = (d, b), 0
        held.append(chunk)
        per_day[d] = per_day.get(d, 0) + n_rows(chunk)
        while held and sum(map(n_rows, held)) >= rows_per_shard:
            flush(rows_per_shard)
    if held:
        flush(sum(map(n_rows, held)))
    if events is not None:
        events(writer)
    rows_per_split = {s: sum(per_day.get(d, 0) for d in ds) for s, ds in splits.items()}
    return writer.close(splits, source={**(source or {}), "rows": rows_per_split})


def _check_columns(schema: FeatureSchema, cols: dict, layout: int) -> None:
    for name in impression_columns(schema, layout):
        if name not in cols and name not in (schema.day_column,):
            raise SchemaError(f"adapter produced no column {name!r} that its schema declares")


def n_rows(cols: dict) -> int:
    v = next(iter(cols.values()))
    return len(v[1]) if isinstance(v, tuple) else len(v)


def take_rows(cols: dict, offsets: dict, rows: np.ndarray) -> dict:
    """``rows`` of every column (list columns as (flat values, lengths); ``offsets`` their row
    starts)."""
    out = {}
    for name, v in cols.items():
        if isinstance(v, tuple):
            out[name] = (v[0][ranges(offsets[name][rows], v[1][rows])], v[1][rows])
        else:
            out[name] = np.asarray(v)[rows]
    return out


def slice_rows(cols: dict, start: int, count: int) -> dict:
    """Rows ``start .. start+count-1`` of chunk columns."""
    out = {}
    for name, v in cols.items():
        if isinstance(v, tuple):
            lo = int(v[1][:start].sum())
            out[name] = (v[0][lo:lo + int(v[1][start:start + count].sum())],
                         v[1][start:start + count])
        else:
            out[name] = v[start:start + count]
    return out


def concat_rows(chunks: list[dict]) -> dict:
    out = {}
    for name, v in chunks[0].items():
        if isinstance(v, tuple):
            out[name] = (np.concatenate([c[name][0] for c in chunks]),
                         np.concatenate([c[name][1] for c in chunks]))
        else:
            out[name] = np.concatenate([c[name] for c in chunks])
    return out


def _table(schema: FeatureSchema, cols: dict, day: int, layout: int = LAYOUT_V1) -> pa.Table:
    out = {}
    n = n_rows(cols)
    for name in impression_columns(schema, layout):
        if name == schema.day_column:
            out[name] = pa.array(np.full(n, day, dtype=np.int32))
            continue
        v = cols[name]
        out[name] = list_array(v[0], v[1]) if isinstance(v, tuple) else pa.array(np.asarray(v))
    return pa.table(out)


# --------------------------------------------------------------------------------------- reading
def read_csv(path: str | Path, sep: str = ",", encoding: str = "utf8",
             numeric: Callable[[str], bool] | None = None,
             columns: list[str] | None = None) -> dict[str, np.ndarray]:
    """Every column of a CSV/TSV (``.gz`` too) as a numpy ``str`` array, header names as written
    (``columns``: just these).

    Columns for which ``numeric(name)`` holds are parsed as float64 (blank → NaN), which is much
    faster than strings; if one of them holds a non-number the file is read again as strings, so
    that ``to_float`` can name the bad value.
    """
    import pyarrow.csv as pa_csv

    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: file not found")
    opts = {"read_options": pa_csv.ReadOptions(encoding=encoding),
            "parse_options": pa_csv.ParseOptions(delimiter=sep)}
    try:
        names = pa_csv.open_csv(path, **opts).schema.names
        names = [n for n in names if columns is None or n in columns]
        types = {n: pa.float64() if numeric and numeric(n) else pa.string() for n in names}
        try:
            table = pa_csv.read_csv(path, convert_options=pa_csv.ConvertOptions(
                column_types=types, include_columns=names), **opts)
        except pa.ArrowInvalid:
            if not numeric:
                raise
            table = pa_csv.read_csv(path, convert_options=pa_csv.ConvertOptions(
                column_types={n: pa.string() for n in names}, include_columns=names), **opts)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: not a readable CSV ({e})") from e
    return {n: _numpy(table.column(i)) for i, n in enumerate(names)}


def _numpy(col: pa.ChunkedArray) -> np.ndarray:
    if pa.types.is_floating(col.type):
        return col.to_numpy()  # nulls → NaN
    return np.asarray(col.to_numpy(zero_copy_only=False), dtype=str)


def need(cols: dict, names: list[str], where: str) -> None:
    missing = [n for n in names if n not in cols]
    if missing:
        raise ColumnError(f"{where}: missing columns {missing}; it has {sorted(cols)}")


def to_float(values: np.ndarray, where: str, fill: float | None = None,
             keep_missing: bool = False, row0: int = 0) -> np.ndarray:
    """Strings (or numbers) → float64; empty cells / nulls become ``fill`` (an error if ``fill``
    is None), or stay NaN with ``keep_missing`` (a ``missing="indicator"`` feature: the model
    flags them). ``row0``: the row number of ``values[0]`` in messages (a chunk of a file)."""
    v = np.asarray(values)
    if v.dtype.kind not in "iufb":
        v = v.astype(str)
        empty = np.char.str_len(np.char.strip(v)) == 0
        try:
            out = np.where(empty, "nan", v).astype(np.float64)
        except ValueError:
            bad = next(x for x in v[~empty] if not _is_float(x))
            raise ColumnError(f"{where}: {str(bad)!r} is not a number") from None
    else:
        out = v.astype(np.float64)
    missing = np.isnan(out)
    if keep_missing:
        if np.isinf(out).any():
            raise ColumnError(f"{where}: {float(out[np.isinf(out)][0])!r} is not a finite number")
        return out
    if missing.any():
        if fill is None:
            raise ColumnError(f"{where}: empty value in row "
                              f"{row0 + int(np.flatnonzero(missing)[0])} "
                              f"(no fill given)")
        out[missing] = fill
    if not np.isfinite(out).all():
        raise ColumnError(f"{where}: {float(out[~np.isfinite(out)][0])!r} is not a finite number")
    return out


def to_label(values: np.ndarray, where: str, positive_at: float | None = None,
             row0: int = 0) -> np.ndarray:
    """A 0/1 label as int8 (``positive_at``: label = value >= threshold); other values are
    an error. ``row0`` as for ``to_float``."""
    v = to_float(values, where, row0=row0)
    if positive_at is not None:
        return (v >= positive_at).astype(np.int8)
    bad = (v != 0) & (v != 1)
    if bad.any():
        raise ColumnError(f"{where}: label value {float(v[bad][0])!r} in "
                          f"row {row0 + int(np.flatnonzero(bad)[0])} "
                          "is not 0 or 1")
    return v.astype(np.int8)


def _is_float(x: str) -> bool:
    try:
        float(x)
        return True
    except ValueError:
        return False
