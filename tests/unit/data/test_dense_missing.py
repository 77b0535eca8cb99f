"""Missing dense values (``DenseFeature.missing="indicator"``): the schema option, the row check,
the train-split statistics and the normaliser's imputation and indicator."""

import dataclasses

import numpy as np
import pyarrow as pa
import pytest
import torch

from opengem.data.batch import collate, validate_rows
from opengem.data.dense_stats import train_dense_stats
from opengem.data.loader import ShardLoader
from opengem.data.parquet import ShardWriter
from opengem.features.schema import DenseFeature, FeatureSchema, SchemaError
from opengem.model.build import build_gem, fit_dense_norm, materialize
from opengem.model.dense_norm import DenseNormalizer, signed_log
from opengem.model.foundation import GEMConfig
from opengem.testing import random_table, tiny_schema


def _schema():
    """tiny_schema with ``quality`` (an ad feature) declared missing="indicator"."""
    s = tiny_schema()
    return dataclasses.replace(s,
                               dense=(s.dense[0],
                                      DenseFeature("quality", "ad", missing="indicator")))


def _with_nan(table, name, rows, value=np.nan):
    v = table.column(name).to_numpy().copy()
    v[rows] = value
    return table.set_column(table.schema.get_field_index(name), name, pa.array(v))


def test_the_option_is_checked_and_the_default_keeps_the_schema_bytes():
    s = tiny_schema()
    assert "missing" not in s.to_json() and s.dense_missing == []
    m = _schema()
    assert m.dense_missing == [1] and m.fingerprint() != s.fingerprint()
    assert FeatureSchema.from_dict(m.to_dict()) == m
    with pytest.raises(SchemaError,
                       match="dense feature 'quality': missing must be one "
                             "of quarantine/indicator"):
        dataclasses.replace(s, dense=(DenseFeature("quality", "ad", missing="zero"),))


def test_nan_is_kept_only_for_a_feature_with_the_option():
    t = _with_nan(_with_nan(random_table(tiny_schema(), 8), "quality", [1, 2]), "activity", [5])
    keep, reasons, _ = validate_rows(t, tiny_schema())
    assert keep.sum() == 5 and dict(reasons) == {"dense activity is NaN/inf": 1,
                                                 "dense quality is NaN/inf": 2}
    # activity has no option: still quarantined, by name
    keep, reasons, _ = validate_rows(t, _schema())
    assert keep.sum() == 7 and dict(reasons) == {"dense activity is NaN/inf": 1}
    nulls = t.set_column(t.schema.get_field_index("quality"), "quality",
                         pa.array([None, 1.0] * 4, pa.float32()))
    keep, reasons, _ = validate_rows(nulls, _schema())  # null is missing too
    assert keep.sum() == 7 and dict(reasons) == {"dense activity is NaN/inf": 1}
    batch = collate(nulls.filter(pa.array(keep)), _schema())
    assert torch.isnan(batch.dense[:, 1]).sum() == 4 and not torch.isnan(batch.dense[:, 0]).any()
    # inf is never a value
    keep, reasons, _ = validate_rows(_with_nan(t, "quality", [0], np.inf), _schema())
    assert dict(reasons) == {"dense quality is inf": 1, "dense activity is NaN/inf": 1}


def _dataset(tmp_path):
    """Days 0-1 train, day 2 valid; a third of quality missing, valid's values on another scale."""
    schema = _schema()
    w = ShardWriter(tmp_path, schema)
    for day in range(3):
        t = random_table(schema, 60, seed=day)
        q = t.column("quality").to_numpy().copy() + (100.0 if day == 2 else 0.0)
        q[day::3] = np.nan
        w.write(t.set_column(t.schema.get_field_index("quality"), "quality", pa.array(q)),
                f"d{day}", day)
    w.close({"train": [0, 1], "valid": [2]})
    return schema


def test_statistics_are_fitted_on_train_only_and_ignore_missing_values(tmp_path):
    schema = _dataset(tmp_path)
    stats = train_dense_stats(tmp_path, schema, "train")
    q = next(iter(ShardLoader(tmp_path, "train", 1000, schema, shuffle=False))).dense[:, 1].numpy()
    assert np.isnan(q).sum() == stats["missing"][1] == 40 and stats["missing"][0] == 0
    finite = q[~np.isnan(q)].astype(np.float64)
    assert stats["median"][1] == pytest.approx(np.median(finite), rel=1e-6)
    # no valid rows
    assert stats["mean"][1] == pytest.approx(finite.mean(), rel=1e-5) and stats["median"][1] < 10
    # other runs' statistics unchanged
    assert "median" not in train_dense_stats(tmp_path, tiny_schema(), "train")
    model = materialize(build_gem(schema, GEMConfig(embedding_dim=8)))
    # signed_log too needs the median
    assert model.dense_norm.out_features == 3 and not model.dense_norm.fitted
    fit_dense_norm(model, tmp_path, schema, "train")
    assert model.dense_norm.fill.item() == pytest.approx(stats["median"][1], rel=1e-6)
    batch = next(iter(ShardLoader(tmp_path, "valid", 64, schema, shuffle=False,
                                  max_seq_len=model.max_seq_len())))
    with torch.no_grad():
        assert torch.isfinite(model(batch)).all()


@pytest.mark.parametrize("mode", ["signed_log", "standardize", "quantile"])
def test_the_indicator_is_isnan_and_the_value_is_the_transformed_median(mode):
    x = torch.tensor([[1.0, 2.0, 5.0], [float("nan"), 3.0, float("nan")], [0.5, -1.0, 7.0]])
    v = np.array([[1.0, 2.0, 5.0], [3.0, 0.0, 9.0], [4.0, 1.0, 6.0]])
    stats = {"names": ["a", "b", "c"], "mean": v.mean(0).tolist(), "std": v.std(0).tolist(),
             "quantiles": np.quantile(v, np.linspace(0, 1, 33), axis=0).T.tolist(),
             "median": [3.0, 1.0, 6.0]}
    m = DenseNormalizer(3, mode, missing=(0, 2))
    with pytest.raises(RuntimeError, match="not fitted"):
        m(x)
    m.fit(stats, ["a", "b", "c"])
    y = m(x)
    assert y.shape == (3, 5)
    torch.testing.assert_close(y[:, 3:], torch.isnan(x[:, [0, 2]]).float())
    plain = DenseNormalizer(3, mode)
    plain.fit(stats, ["a", "b", "c"])
    torch.testing.assert_close(y[:, :3],
                               plain(torch.tensor([[1.0, 2.0, 5.0], [3.0, 3.0, 6.0],
                                                   [0.5, -1.0, 7.0]])))
    if mode == "signed_log":
        torch.testing.assert_close(y[1, 0], signed_log(torch.tensor(3.0)))
    fresh = DenseNormalizer(3, mode, missing=(0, 2))
    fresh.load_state_dict(m.state_dict())  # the median travels in the checkpoint
    torch.testing.assert_close(fresh(x), y)
    assert "fill" not in plain.state_dict() and "missing_idx" not in m.state_dict()


def test_validate_counts_missing_values_of_the_option_and_flags_the_others(tmp_path):
    from opengem.data.validate import validate_dataset

    _dataset(tmp_path / "ok")
    report = validate_dataset(tmp_path / "ok")
    assert not report.errors and not report.warnings and report.counts["missing.quality"] == 60
    # the same shards under a schema without the option: the NaN rows are flagged
    schema = tiny_schema()
    w = ShardWriter(tmp_path / "bad", schema)
    w.write(_with_nan(random_table(schema, 20), "quality", [3, 4]), "d0", 0)
    w.close({"train": [0]})
    report = validate_dataset(tmp_path / "bad")
    assert any("2 rows would be quarantined by the loader: dense quality is NaN/inf" in x
               for x in report.warnings)
    assert "missing.quality" not in report.counts
