"""examples/spark_v2.py writes a v2 dataset of two streams with Spark SQL that `opengem validate`
passes and whose joined histories are each row's user's strictly earlier events (of the events
table; of the clicked impressions). The Spark run is skipped without pyspark or Java (pyspark is
~500 MB and not in requirements-test.txt: CI skips it); the same SQL and the manifest step also run
on DuckDB, written in Spark's Hive-style layout, so they are checked everywhere."""

import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _examples import load_example

from opengem.cli import main
from opengem.data.events import ShardReader
from opengem.data.parquet import LAYOUT_V2, DatasetManifest
from opengem.data.sources.fake_log import write_log
from opengem.features.schema import FeatureSchema

BUCKETS = 3


@pytest.fixture
def log(tmp_path):
    return write_log(tmp_path / "log", rows=300, users=20, events_per_user=40, seed=5)


def _check(m, log, out):
    assert m.layout == LAYOUT_V2 and set(m.events) == {"clicks", "ad_clicks"}
    assert sorted({e.bucket for e in m.events["clicks"]}) == list(range(BUCKETS))
    imp = pq.read_table(log / "impressions.parquet").to_pydict()
    assert sum(f.rows for f in m.files) == 300 and sum(e.rows for e in m.events["clicks"]) == 800
    assert sum(e.rows for e in m.events["ad_clicks"]) == sum(imp["click"])
    assert main(["--quiet", "validate", str(out), "--strict"]) == 0
    schema = FeatureSchema.load(out)
    assert schema.stream("ad_clicks").matches == "item_id"
    reader = ShardReader(out, DatasetManifest.load(out), schema)
    got = pa.concat_tables([reader.read(f, schema.columns()) for f in m.files]).to_pydict()
    ev = pq.read_table(log / "events.parquet").to_pydict()
    clicked = np.array(imp["click"]) == 1
    for name, eu, ets, at_least in (
        ("clicks", np.array(ev["user"]), np.array(ev["ts"]), 1000),
        ("ad_clicks", np.array(imp["user"])[clicked], np.array(imp["ts"])[clicked], 10),
    ):
        # users 0..19 are their own ids (dense_rank of 0..19)
        n = [int(((eu == u) & (ets < t)).sum()) for u, t in zip(got["user_id"], got["request_ts"])]
        assert [len(h) for h in got[f"{name}.ts"]] == n and sum(n) > at_least, name
        assert all(h == sorted(h) and max(h, default=0) < t
                   for h, t in zip(got[f"{name}.ts"], got["request_ts"]))


def test_spark_writes_a_valid_v2_dataset(log, tmp_path):
    pytest.importorskip("pyspark")
    if not shutil.which("java"):
        pytest.skip("Spark needs Java")
    out = tmp_path / "data"
    m = load_example("spark_v2").main(["--in", str(log), "--out", str(out),
                                       "--buckets", str(BUCKETS)])
    _check(m, log, out)


def test_the_examples_sql_on_duckdb_writes_a_valid_v2_dataset(log, tmp_path):
    """The example's SQL and its manifest step, with DuckDB writing what Spark writes: Hive-style
    d=<day>/b=<bucket> shards without the partition columns, each bucket's events sorted."""
    duckdb = pytest.importorskip("duckdb")
    ex, out = load_example("spark_v2"), tmp_path / "data"
    (out / "events").mkdir(parents=True)
    con = duckdb.connect()
    con.execute("SET threads = 1")  # one file per partition, written in the query's order
    for table in ("impressions", "events"):
        con.execute(f"CREATE VIEW {table} AS SELECT * FROM read_parquet('{log / table}.parquet')")
    con.execute(f"CREATE TABLE users AS {ex.USERS}")
    imp = ex.IMPRESSIONS.format(B=BUCKETS)
    con.execute(f"COPY (SELECT *, day AS d FROM ({imp}) ORDER BY d, b, request_ts) "
                f"TO '{out / 'shards'}' (FORMAT parquet, PARTITION_BY (d, b))")
    for name, sql in ex.STREAMS.items():
        con.execute(f"COPY (SELECT * FROM ({sql.format(B=BUCKETS)}) ORDER BY b, user_id, ts) "
                    f"TO '{out / 'events' / name}' (FORMAT parquet, PARTITION_BY (b))")
    _check(ex.write_manifest(out), log, out)
