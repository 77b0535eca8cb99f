"""Per-segment metrics: one segment is the overall slice, families partition the rows (rows,
positives and predicted sums add up), a tiny world's table has the expected segments, bad names
fail clearly."""

import math

import numpy as np
import pytest
import torch

from opengem.evaluation.accumulator import MetricAccumulator
from opengem.evaluation.evaluate import evaluate_model
from opengem.evaluation.segments import (
    Family,
    _deciles,
    segment_families,
    segment_table,
)
from opengem.features.schema import SchemaError
from opengem.report.build import segment_section
from opengem.report.text import segment_lines, worst_segment_line
from opengem.testing import tiny_schema
from opengem.world.generate import generate
from opengem.world.presets import world_config


def _rows(n=5_000, seed=0, domains=2):
    rng = np.random.default_rng(seed)
    pt = rng.uniform(0.01, 0.3, (n, 2))
    y = (rng.uniform(size=(n, 2)) < pt).astype(np.float32)
    p = np.clip(pt * rng.uniform(0.7, 1.4, (n, 2)), 0, 1)
    mask = np.ones((n, 2), bool)
    mask[: n // 10, 1] = False
    return {"p": p, "y": y, "mask": mask, "pt": pt,
            "domain": rng.integers(0, domains, n), "user": rng.integers(0, 300, n),
            "sparse:category": rng.integers(0, 6, n)}


def test_one_segment_equals_the_overall_slice():
    rows = _rows()
    schema = tiny_schema(num_domains=1)
    rows["domain"][:] = 0
    table = segment_table(rows, schema, [Family("surface", "domain", "values", "")], min_rows=1)
    acc = MetricAccumulator(["d0"], schema.task_names, None)  # NE by the evaluated rate
    acc.update(rows["p"], rows["y"], rows["mask"], rows["domain"], true_probs=rows["pt"])
    overall = acc.compute()
    for task in schema.task_names:
        seg, ref = table["tasks"][task]["segments"]["surface=d0"], overall[f"all/{task}"]
        for k in ("n", "positives", "ne", "auc", "calibration", "logloss", "ne_bayes", "captured"):
            assert seg[k] == pytest.approx(ref[k], rel=1e-12), k


def test_families_partition_the_rows():
    rows = _rows()
    schema = tiny_schema()
    fams = [Family("surface", "domain", "values", ""), Family("category", "sparse:category",
                                                               "values", ""),
            Family("activity", "user", "deciles", "")]
    table = segment_table(rows, schema, fams, min_rows=1, top=4)
    for t, task in enumerate(schema.task_names):
        m = rows["mask"][:, t]
        segs = table["tasks"][task]["segments"]
        for f in fams:
            mine = [s for k, s in segs.items() if k.startswith(f"{f.name}=")]
            assert sum(s["n"] for s in mine) == m.sum()
            assert sum(s["positives"] for s in mine) == rows["y"][m, t].sum()
            assert sum(s["predicted"] for s in mine) == pytest.approx(rows["p"][m, t].sum())
            assert sum(s["logloss"] * s["n"] for s in mine) == pytest.approx(
                sum(table["tasks"][task]["segments"][f"surface={d}"]["logloss"]
                    * table["tasks"][task]["segments"][f"surface={d}"]["n"] for d in ("d0", "d1")))
        # 6 categories capped to the 4 with most rows + other
        assert len([k for k in segs if k.startswith("category=")]) == 5 and "category=other" in segs
    spread = table["tasks"]["click"]["spread"]
    assert spread["min"] <= 1.2 and spread["ratio"] == pytest.approx(spread["max"] / spread["min"])
    key = table["tasks"]["click"]["worst_calibration"][0]
    assert table["tasks"]["click"]["segments"][key]["n"] >= 1
    text = segment_lines({**table, "notes": ["x: skipped"]})
    assert "segments of conversion" in text and "calibration spread over" in text
    assert key in worst_segment_line(table) and "note: x: skipped" in text
    html = segment_section(table).body  # opengem report's section
    assert "<h3>conversion</h3>" in html and f"<td>{key}</td>" in html


def test_deciles_keep_a_key_whole_and_hold_a_tenth_of_the_rows_each():
    keys = np.repeat(np.arange(1000), np.arange(1000) % 7 + 1)
    code, names = _deciles(keys)
    assert len(names) <= 10
    for k in np.unique(keys):
        assert len(np.unique(code[keys == k])) == 1
    spread = np.random.default_rng(0).permutation(10_000)
    code, names = _deciles(spread)  # every key once: one decile of equal sizes
    assert names == ["d1 (1-1)"]


def test_bad_names_fail_clearly():
    schema = tiny_schema()
    with pytest.raises(SchemaError, match="no segment family or single-hot sparse feature named "
                                          "'nope'"):
        segment_families(schema, ["nope"])
    with pytest.raises(SchemaError, match="advertiser_size.*none"):
        segment_families(schema, ["advertiser_size"])
    with pytest.raises(SchemaError, match="'history' needs a behaviour stream"):
        segment_families(tiny_schema(streams=0), ["history"])
    fams, notes = segment_families(schema)
    assert [f.name for f in fams] == ["surface", "activity", "history"]  # user_id skipped
    assert any("advertiser_size" in n for n in notes) and any("tags" in n for n in notes)


class _Constant(torch.nn.Module):
    """A model that predicts logit −3 for every task: the segment table needs scores, not skill."""

    def __init__(self, tasks: int):
        super().__init__()
        self.tasks = tasks

    def max_seq_len(self):
        return {}

    def forward(self, batch):
        return torch.full((batch.batch_size, self.tasks), -3.0)


def test_a_tiny_world_has_the_expected_segments(tmp_path):
    data = tmp_path / "data"
    generate(world_config("tiny", seed=1), data, progress=False)
    from opengem.features.schema import FeatureSchema

    schema = FeatureSchema.load(data)
    out = evaluate_model(_Constant(len(schema.tasks)), schema, data, "test", None, 512,
                         progress=False, segments=True, min_rows=50)
    seg = out["segments"]
    assert set(seg["families"]) == {"age", "gender", "country", "device", "segment", "surface",
                                    "activity", "history", "advertiser_size"}
    click = seg["tasks"]["click"]["segments"]
    assert {f"surface={d}" for d in schema.domains.names} >= {k for k in click
                                                              if k.startswith("surface=")}
    assert sum(click[k]["n"] for k in click if k.startswith("surface=")) == out["rows"]
    assert {k for k in click if k.startswith("history=")} <= {"history=new", "history=returning"}
    assert any(k.startswith("advertiser_size=d") for k in click)
    assert all(math.isfinite(s["ne_bayes"]) for s in click.values() if s["positives"])
    with pytest.raises(SchemaError, match="'ad_idd'"):
        evaluate_model(_Constant(2), schema, data, "test", None, segments=["ad_idd"])
