"""The generic importer reads the impressions in chunks (``impressions``): a dataset imported 7 rows
at a time is byte for byte the one imported in a single chunk (the whole table, as before the
chunked path existed), for every split, input format and kind of feature and stream, with shards
cut across chunks; and a bad cell in a later chunk is still named by its row in its file."""

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

from opengem.data.sources import common, generic
from opengem.data.sources.common import ColumnError
from opengem.data.sources.fake_log import T0, write_log
from opengem.data.sources.fake_log import spec as log_spec

pytest.importorskip("duckdb")

SMALL, WHOLE = 7, 10**9  # rows per chunk: several chunks per file and per shard, or one


def _table(n: int, seed: int, iso: bool = False) -> pa.Table:
    """Impressions with every kind of column: ids to fit, hash or take as given, a multi-hot
    cell, a list of ad ids, a log1p and a missing-indicator number, a domain, a label and a
    thresholded one."""
    rng = np.random.default_rng(seed)
    ts = T0 + rng.integers(0, 50, n) * 600  # coarse: many equal times, ties across chunks
    return pa.table({
        "uid": [f"u{u}" for u in rng.integers(0, 9, n)],
        "ts": ts.astype("datetime64[s]").astype(str) if iso else ts,
        "ad": [f"ad{a}" for a in rng.integers(0, 40, n)], "adh": rng.integers(0, 10**6, n),
        "slot": rng.integers(0, 12, n),
        "tags": ["|".join(f"t{t}" for t in rng.integers(0, 9, rng.integers(0, 4)))
                 for _ in range(n)],
        "price": np.round(rng.gamma(2.0, 10.0, n), 3),
        "age": np.where(rng.random(n) < 0.2, np.nan, np.round(rng.normal(30, 9, n), 2)),
        "seen": ["^".join(f"ad{a}" for a in rng.integers(0, 40, rng.integers(0, 5)))
                 for _ in range(n)],
        "pid": rng.choice(["feed", "search"], n), "click": rng.integers(0, 2, n),
        "dwell": np.round(rng.exponential(5, n), 2)})


BASE = {"tasks": [{"name": "click", "column": "click"},
                  {"name": "long", "column": "dwell", "positive_at": 5.0, "requires": "click"}],
        "sparse": [{"column": "ad", "group": "ad"}, {"column": "adh", "hash_size": 97},
                   {"column": "slot", "vocab_size": 10, "group": "context"},
                   {"column": "tags", "multi_hot": "|"}],
        "dense": [{"column": "price", "transform": "log1p", "fill": 0.0, "group": "ad"},
                  {"column": "age", "missing": "indicator"}],
        "domain": {"column": "pid"}, "user": "uid", "time": "ts"}


def _lists(d):
    """Impressions whose list columns are each user's earlier events (prefixes: v2)."""
    rng = np.random.default_rng(4)
    ev = {u: np.sort(T0 + rng.choice(20_000, 30, replace=False)) for u in range(6)}
    user, ts = rng.integers(0, 6, 90), T0 + rng.integers(5_000, 20_000, 90)
    times = [ev[u][ev[u] < t][-5:] for u, t in zip(user, ts)]
    pq.write_table(pa.table({
        "uid": user, "ts": ts, "ad": rng.integers(0, 20, 90), "click": rng.integers(0, 2, 90),
        "items": pa.array([[int(x) % 20 for x in t] for t in times], pa.list_(pa.int64())),
        "times": pa.array([list(map(int, t)) for t in times], pa.list_(pa.int64()))}),
        d / "imp.parquet")
    return d / "imp.parquet", {
        "tasks": [{"name": "click", "column": "click"}], "sparse": [{"column": "ad"}],
        "user": "uid", "time": "ts", "sequence": {"name": "seen", "from": "lists",
                                                  "column": "items", "times": "times",
                                                  "item": "ad", "max_len": 5}}


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    """name → (input path, spec) of every case."""
    d = tmp_path_factory.mktemp("logs")
    out = {}
    ev = write_log(d / "events", rows=300, users=20, events_per_user=30, seed=3,
                   ad_clicks_per_user=6)
    two = log_spec(max_len=8, ad_clicks=4)
    two["sequences"][0]["buckets"] = 3
    out["two_event_streams"] = ev, two
    (d / "csv").mkdir()
    t = _table(240, 1, iso=True)
    price = t.column("price").to_pylist()
    price[150] = "1_0"  # numpy reads it, Arrow does not: the file is read again as strings
    pa_csv.write_csv(t.set_column(t.schema.get_field_index("price"), "price",
                                  pa.array([str(x) for x in price])), d / "csv" / "imp.csv")
    out["csv_time_split"] = d / "csv" / "imp.csv", {**BASE, "split": {"by": "time"}}
    out["csv_user_time_split"] = d / "csv" / "imp.csv", {**BASE, "split": {"by": "user_time"}}
    out["csv_rows_stream"] = d / "csv" / "imp.csv", {
        **BASE, "sequence": {"name": "h", "from": "rows", "item": "ad", "only": "click",
                             "max_len": 4, "attributes": ["slot"]}}
    out["csv_column_stream"] = d / "csv" / "imp.csv", {
        **BASE, "sequence": {"name": "seen", "from": "column", "column": "seen", "sep": "^",
                             "item": "ad", "max_len": 3}}
    (d / "pq").mkdir()
    t = _table(200, 2)
    cat = np.arange(200, dtype=float) % 13
    cat[190:] = np.nan  # nulls only in the last chunk: every chunk's strings as the whole file's
    t = t.append_column("cat", pa.array(cat, mask=np.isnan(cat)).cast(pa.int64()))
    t = t.append_column("vec", pa.array(list(np.random.default_rng(0).normal(size=(200, 3))
                                             .astype(np.float32)), pa.list_(pa.float32())))
    pq.write_table(t, d / "pq" / "imp.parquet", row_group_size=60)
    no_user = {k: v for k, v in BASE.items() if k not in ("user", "time")}
    no_user["sparse"] = BASE["sparse"] + [{"column": "cat"}]
    out["parquet_random_split"] = d / "pq" / "imp.parquet", {**no_user,
                                                             "split": {"by": "random"}}
    out["parquet_row_order_time"] = d / "pq" / "imp.parquet", {**no_user,
                                                               "split": {"by": "time"}}
    out["parquet_embeddings"] = d / "pq" / "imp.parquet", {
        **BASE, "embeddings": [{"column": "vec", "name": "content"}]}
    (d / "files").mkdir()
    for i, name in enumerate(["tr0.csv", "tr1.csv", "va.parquet", "te.csv"]):
        t = _table(60 + 7 * i, 10 + i)
        if name.endswith(".csv"):
            pa_csv.write_csv(t, d / "files" / name)
        else:
            pq.write_table(t, d / "files" / name)
    out["files_split"] = d / "files", {
        **BASE, "files": {"train": ["tr0.csv", "tr1.csv"], "valid": ["va.parquet"],
                          "test": ["te.csv"]}}
    (d / "lists").mkdir()
    out["lists_stream"] = _lists(d / "lists")
    return out


def _digest(out) -> dict[str, str]:
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", ["two_event_streams", "csv_time_split", "csv_user_time_split",
                                  "csv_rows_stream", "csv_column_stream", "parquet_random_split",
                                  "parquet_row_order_time", "parquet_embeddings", "files_split",
                                  "lists_stream"])
def test_a_dataset_read_7_rows_at_a_time_is_the_one_read_whole(logs, case, tmp_path,
                                                               monkeypatch):
    monkeypatch.setattr(common, "ROWS_PER_SHARD", 25)  # shards cut across chunks
    src, spec = logs[case]
    small = generic.convert(src, tmp_path / "small", spec, seed=3, chunk_rows=SMALL)
    whole = generic.convert(src, tmp_path / "whole", spec, seed=3, chunk_rows=WHOLE)
    assert _digest(tmp_path / "small") == _digest(tmp_path / "whole")
    assert small.to_dict() == whole.to_dict()
    assert len(small.files) > 3 and sum(small.source["rows"].values()) > 80


def test_a_bad_cell_in_a_later_chunk_is_named_by_its_row_in_its_file(tmp_path):
    t = _table(40, 5)
    click = t.column("click").to_pylist()
    click[23] = None
    for i in range(2):
        pa_csv.write_csv(t.set_column(t.schema.get_field_index("click"), "click",
                                      pa.array(click if i else t.column("click").to_pylist())),
                         tmp_path / f"p{i}.csv")
    with pytest.raises(ColumnError, match=r"p1\.csv column 'click': empty value in row 23"):
        generic.convert(tmp_path, tmp_path / "out", BASE, chunk_rows=SMALL)
    iso = _table(30, 6, iso=True)
    ts = iso.column("ts").to_pylist()
    ts[17] = "yesterday"
    pa_csv.write_csv(iso.set_column(iso.schema.get_field_index("ts"), "ts", pa.array(ts)),
                     tmp_path / "iso.csv")
    with pytest.raises(ColumnError, match=r"'yesterday' in row 17 is not a unix time"):
        generic.convert(tmp_path / "iso.csv", tmp_path / "out2", BASE, chunk_rows=SMALL)
