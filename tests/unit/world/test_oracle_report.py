"""``opengem evaluate`` divides a slice's ``captured`` by the world's oracle's, where the manifest
has one."""

import json
import math

from opengem.data.parquet import MANIFEST, DatasetManifest
from opengem.evaluation.evaluate import add_oracle


def _dataset(path, source):
    path.mkdir(parents=True, exist_ok=True)
    (path
     / MANIFEST).write_text(json.dumps(DatasetManifest(files=[], splits={"test": [0]},
                                                       source=source).to_dict()))
    return path


def test_captured_over_oracle_per_slice(tmp_path):
    oracle = {"test": {"all/click": {"captured": 0.8}, "feed/click": {"captured": None},
                       "video/click": {"captured": 0}}}
    data = _dataset(tmp_path / "d", {"kind": "synthetic", "stats": {"oracle": oracle}})
    metrics = {"all/click": {"ne": 0.9, "captured": 0.4}, "feed/click": {"captured": 0.3},
               "video/click": {"captured": 0.2}, "messaging/click": {"captured": 0.1},
               "all/conversion": {"ne": 0.9}}
    before = json.loads(json.dumps(metrics))
    add_oracle(metrics, data, "test")
    assert metrics["all/click"] == {**before["all/click"], "oracle_captured": 0.8,
                                    "captured_over_oracle": 0.5}
    assert math.isnan(metrics["video/click"]["captured_over_oracle"])
    # no oracle figure, or no captured
    for key in ("feed/click", "messaging/click", "all/conversion"):
        assert metrics[key] == before[key]
    # no oracle for the split
    assert add_oracle(json.loads(json.dumps(before)), data, "valid") == before


def test_no_oracle_no_keys(tmp_path):
    data = _dataset(tmp_path / "real", {"kind": "movielens"})
    metrics = {"all/click": {"ne": 0.9}}
    assert add_oracle(metrics, data, "test") == {"all/click": {"ne": 0.9}}
