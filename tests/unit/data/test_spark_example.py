"""examples/spark_v2.py writes a v2 dataset with Spark SQL that `opengem validate` passes and whose
joined histories are each row's user's strictly earlier events. Skipped without pyspark or Java
(pyspark is ~500 MB and not in requirements-test.txt: CI skips this test)."""

import importlib.util
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from opengem.cli import main
from opengem.data.events import ShardReader
from opengem.data.parquet import LAYOUT_V2, DatasetManifest
from opengem.data.sources.fake_log import write_log
from opengem.features.schema import FeatureSchema

pytest.importorskip("pyspark")
if not shutil.which("java"):
    pytest.skip("Spark needs Java", allow_module_level=True)


def _example():
    path = Path(__file__).parents[3] / "examples" / "spark_v2.py"
    spec = importlib.util.spec_from_file_location("spark_v2", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["spark_v2"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_spark_writes_a_valid_v2_dataset(tmp_path):
    log = write_log(tmp_path / "log", rows=300, users=20, events_per_user=40, seed=5)
    m = _example().main(["--in", str(log), "--out", str(tmp_path / "data"), "--buckets", "3"])
    assert m.layout == LAYOUT_V2 and sorted({e.bucket for e in m.events["clicks"]}) == [0, 1, 2]
    assert sum(f.rows for f in m.files) == 300 and sum(e.rows for e in m.events["clicks"]) == 800
    assert main(["--quiet", "validate", str(tmp_path / "data"), "--strict"]) == 0
    schema = FeatureSchema.load(tmp_path / "data")
    reader = ShardReader(tmp_path / "data", DatasetManifest.load(tmp_path / "data"), schema)
    got = pa.concat_tables([reader.read(f, schema.columns()) for f in m.files]).to_pydict()
    ev = pq.read_table(log / "events.parquet").to_pydict()
    eu, ets = np.array(ev["user"]), np.array(ev["ts"])
    # users 0..19
    n = [int(((eu == u) & (ets < t)).sum()) for u, t in zip(got["user_id"], got["request_ts"])]
    assert [len(h) for h in got["clicks.ts"]] == n and sum(n) > 1000
    assert all(h == sorted(h) and max(h, default=0) < t for h,
               t in zip(got["clicks.ts"], got["request_ts"]))
