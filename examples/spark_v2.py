"""Write an OpenGEM layout-v2 dataset with Spark SQL, from an impressions table and an events table.

    python examples/spark_v2.py --in LOG --out DATA [--buckets 4]      (then: opengem validate DATA)

``LOG`` holds ``impressions.parquet`` (user, ts, item_id, cat, click) and ``events.parquet`` (user,
ts, item_id, action, cat), the shape ``opengem.data.sources.fake_log.write_log`` makes; any log of
that shape works. Two behaviour streams: ``clicks``, the events table, and ``ad_clicks``, the
user's clicked impressions, whose items are ad ids (``matches="item_id"``: the model compares them
with the candidate's). Spark does the heavy part: user ids, buckets, the split, and each stream's
bucket sorted by (user_id, ts) and written once (``docs/dataset-layout.md``); the streams share
the user bucketing. A few lines of Python then write ``schema.json`` and ``dataset.json`` listing
the files Spark wrote (rows from their footers).

Runs on Spark's local mode (needs Java 17+ and ``pip install pyspark``); on a cluster, point
``--in``/``--out`` at shared storage and drop ``master("local[...]")``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pyarrow.parquet as pq

from opengem.data.parquet import LAYOUT_V2, DatasetManifest, EventFileInfo, ShardInfo, ShardWriter
from opengem.features.schema import (
    SCHEMA_FILE,
    Domains,
    EventAttribute,
    FeatureSchema,
    SequenceStream,
    SparseFeature,
    Task,
)

ITEMS, CATS = 10_000, 50  # the log's item and category ids are already in [0, ITEMS) and [0, CATS)

# Spark SQL: user ids (dense, by raw user), buckets = user_id % B, day 0/1/2 by time
# rank (80/10/10).
USERS = """
SELECT user, CAST(dense_rank() OVER (ORDER BY user) - 1 AS BIGINT) AS user_id
FROM (SELECT DISTINCT user FROM impressions)
"""
IMPRESSIONS = """
SELECT u.user_id, i.ts AS request_ts,
       CAST(CASE WHEN i.q < 0.8 THEN 0 WHEN i.q < 0.9 THEN 1 ELSE 2 END AS INT) AS day,
       CAST(0 AS BIGINT) AS domain, i.item_id, i.cat, CAST(i.click AS BIGINT) AS click,
       u.user_id % {B} AS b
FROM (SELECT *, percent_rank() OVER (ORDER BY ts) AS q FROM impressions) i
JOIN users u ON i.user = u.user
"""
# Each stream's events: user_id, ts, item, event, its attributes, and the bucket b (as the
# impressions').
STREAMS = {
    "clicks": """
SELECT u.user_id, e.ts, e.item_id AS item,
       CAST(CASE e.action WHEN 'click' THEN 1 ELSE 0 END AS BIGINT) AS event, e.cat,
       u.user_id % {B} AS b
FROM events e JOIN users u ON e.user = u.user
""",
    # an impression's click is an event at its request time: only later impressions' histories
    # hold it (the join takes events strictly before request_ts)
    "ad_clicks": """
SELECT u.user_id, i.ts, i.item_id AS item, CAST(0 AS BIGINT) AS event, i.cat, u.user_id % {B} AS b
FROM impressions i JOIN users u ON i.user = u.user
WHERE i.click = 1
""",
}


def schema() -> FeatureSchema:
    return FeatureSchema(
        sparse=(SparseFeature("item_id", ITEMS, "ad"), SparseFeature("cat", CATS, "ad")), dense=(),
        sequences=(SequenceStream("clicks", ITEMS, 2, 200, (EventAttribute("cat", CATS),)),
                   SequenceStream("ad_clicks", ITEMS, 1, 50,
                                  (EventAttribute("cat", CATS, matches="cat"),),
                                  matches="item_id")),
        tasks=(Task("click", "click"),), domains=Domains(("default",)),
        meta={"source": "examples/spark_v2.py"})


def write_with_spark(log: Path, out: Path, buckets: int) -> None:
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").appName("opengem-v2")
             .config("spark.sql.shuffle.partitions",
                     str(buckets)).config("spark.ui.enabled", "false")
             .getOrCreate())
    try:
        spark.read.parquet(str(log / "impressions.parquet")).createOrReplaceTempView("impressions")
        spark.read.parquet(str(log / "events.parquet")).createOrReplaceTempView("events")
        spark.sql(USERS).createOrReplaceTempView("users")
        imp = spark.sql(IMPRESSIONS.format(B=buckets))
        (imp.withColumn("d", imp.day).repartition("d",
                                                  "b").sortWithinPartitions("d", "b", "request_ts")
         .write.partitionBy("d", "b").parquet(str(out / "shards")))
        for name, sql in STREAMS.items():
            ev = spark.sql(sql.format(B=buckets))
            # One Spark partition per bucket, sorted by (user_id, ts): each bucket's file is its
            # sorted log.
            (ev.repartition(buckets, "b").sortWithinPartitions("b", "user_id", "ts")
             .write.partitionBy("b").parquet(str(out / "events" / name)))
    finally:
        spark.stop()


def _key(path: Path, name: str) -> int:
    return int(next(p for p in path.parts if p.startswith(name + "="))[len(name) + 1:])


def write_manifest(out: Path) -> DatasetManifest:
    """List the files Spark wrote (Hive-style d=<day>/b=<bucket> directories) in the manifest,
    each stream's under ``events/<stream>/b=<bucket>``."""
    def rel(p: Path) -> str:
        return str(p.relative_to(out))

    files = [ShardInfo(rel(p), _key(p, "d"), pq.ParquetFile(p).metadata.num_rows, _key(p, "b"))
             for p in sorted((out / "shards").rglob("*.parquet"))]
    events = {name: [EventFileInfo(rel(p), _key(p, "b"), pq.ParquetFile(p).metadata.num_rows)
                     for p in sorted((out / "events" / name).rglob("*.parquet"))]
              for name in STREAMS}
    writer = ShardWriter(out, schema(), layout=LAYOUT_V2)  # only for its close(): schema + manifest
    writer.files, writer.events = files, events
    m = writer.close({"train": [0], "valid": [1], "test": [2]},
                     source={"kind": "examples/spark_v2.py"})
    assert (out / SCHEMA_FILE).exists()
    return m


def main(argv: list[str] | None = None) -> DatasetManifest:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--in", dest="log", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--buckets", type=int, default=4)
    a = p.parse_args(argv)
    write_with_spark(Path(a.log), Path(a.out), a.buckets)
    return write_manifest(Path(a.out))


if __name__ == "__main__":
    main()
