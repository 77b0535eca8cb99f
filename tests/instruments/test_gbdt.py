"""The LightGBM peer: causal history features, the fitted model, the tuning discipline, the
evaluator's metrics."""

import shutil
import sys

import pytest

pytest.importorskip("lightgbm")

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from instruments.gbdt import (  # noqa: E402
    GRID,
    GRID_POINTS,
    _lightgbm,
    batch_features,
    feature_names,
    features,
    fit,
    fit_task,
    metrics,
    predict,
    run_gbdt,
)

from opengem.data.base_rates import train_base_rates  # noqa: E402
from opengem.data.batch import collate  # noqa: E402
from opengem.data.loader import ShardLoader  # noqa: E402
from opengem.data.parquet import DataError, list_array  # noqa: E402
from opengem.discipline import DisciplineError  # noqa: E402
from opengem.evaluation.accumulator import MetricAccumulator  # noqa: E402
from opengem.evaluation.platt import TaskPlatt  # noqa: E402
from opengem.features.schema import FeatureSchema  # noqa: E402
from opengem.testing import random_table, tiny_schema, with_events  # noqa: E402


def test_history_features_of_a_drawn_row():
    schema = tiny_schema()
    table = random_table(schema, 3, seed=0,
                         lengths={"s0": np.array([0, 0, 0]), "s1": np.array([0, 0, 0])})
    req = table.column("request_ts").to_pylist()[1]
    cat = table.column("category").to_pylist()[1]
    # oldest first; the last two match the candidate's category
    ages = [8 * 86400, 2 * 86400, 7200, 600]
    table = with_events(table, 1, "s0", [req - a for a in ages], {})
    cats = table.column("s0.category").to_pylist()
    cats[1] = [(cat + 1) % 5, (cat + 1) % 5, cat, cat]
    table = table.set_column(table.schema.get_field_index("s0.category"), "s0.category",
                             list_array(np.array(sum(cats, []), dtype=np.int64),
                                        [len(c) for c in cats]))
    names, _ = feature_names(schema)
    x = dict(zip(names, batch_features(collate(table, schema), schema)[1]))
    assert (
        x["s0.n_events"] == 4 and x["s0.since_last_s"] == 600 and x["s0.since_first_s"] == 8 * 86400
    )
    assert (x["s0.n_last_1h"], x["s0.n_last_24h"], x["s0.n_last_7d"]) == (1, 2, 3)
    assert x["s0.category.n_match_category"] == 2 and x["s0.category.since_last_match_s"] == 600
    assert (
        x["s1.n_events"] == 0 and np.isnan(x["s1.since_last_s"]) and np.isnan(x["s1.since_first_s"])
    )
    # ids as categoricals; multi-hot ids left out
    assert x["category"] == cat and "tags" not in names


def test_events_at_or_after_the_request_change_nothing():
    schema = tiny_schema()
    table = random_table(schema, 6, seed=2)
    before = batch_features(collate(table, schema), schema)
    req = table.column("request_ts").to_pylist()[0]
    cat = table.column("category").to_pylist()[0]
    # collate does not quarantine
    later = with_events(table, 0, "s0", [req, req + 60], {"category": cat})
    after = batch_features(collate(later, schema), schema)
    np.testing.assert_array_equal(after, before)  # NaN == NaN here


def test_lightgbm_beats_the_base_rate_and_its_metrics_are_the_evaluators(world):
    schema = FeatureSchema.load(world)
    train, valid, test = (features(world, s) for s in ("train", "valid", "test"))
    models = fit(train, valid, schema, GRID[0])
    p = predict(models, test, schema)
    assert (p[:, 1] <= p[:, 0]).all()  # p(conversion) = p(click) · p(conversion | click)
    rates = train_base_rates(world, schema, "train")
    got = metrics(p, test, schema, rates)
    acc, start = MetricAccumulator(list(schema.domains.names), schema.task_names, rates), 0
    # the evaluator's own pass
    for b in ShardLoader(world, "test", 512, schema, shuffle=False, epochs=1):
        n = b.batch_size
        acc.update(p[start:start + n], b.labels, b.label_mask, b.domain, b.user_id, b.true_probs)
        start += n
    assert start == len(p) and got == acc.compute()
    # Measured: click NE 0.6865, AUC 0.829; conversion NE 0.530 (GEM tiny: 0.682, DIN 0.722,
    # DLRM-DCN 0.772).
    assert (
        got["all/click"]["ne"] < 0.75
        and got["all/click"]["auc"] > 0.80
        and got["all/conversion"]["ne"] < 0.65
    )
    run = run_gbdt(world, grid=[GRID[0]])
    assert run["metrics"] == got and run["chosen"]["learning_rate"] == GRID[0]["learning_rate"]
    assert run["chosen"]["rounds"]["click"] == models[0].best_iteration and len(run["trials"]) == 1
    # the Platt fit on valid (evaluation.platt) is applied to the same test scores: the
    # ranking stays
    platt = TaskPlatt.fit(predict(models, valid, schema), valid.labels, valid.mask)
    assert run["metrics_platt"] == metrics(platt(p), test, schema, rates)
    assert run["metrics_platt"]["all/click"]["auc"] == pytest.approx(
        got["all/click"]["auc"], abs=1e-9
    )


def test_the_grid_is_chosen_on_valid_never_on_test_nor_on_a_held_out_world(world, tmp_path):
    assert len(GRID) == GRID_POINTS and len({tuple(p.values()) for p in GRID}) == GRID_POINTS
    with pytest.raises(DisciplineError, match="test"):
        run_gbdt(world, tune_split="test")
    held = tmp_path / "held"
    shutil.copytree(world, held)
    schema = FeatureSchema.load(held)
    FeatureSchema.from_dict({**schema.to_dict(), "meta": {**schema.meta, "seed": 1000}}).save(
        held / "schema.json"
    )
    with pytest.raises(DisciplineError, match="held-out"):
        run_gbdt(held)  # four points: a choice; one point (no choice) is allowed there


def test_bad_input_names_the_problem(world, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(world, bad)
    shard = sorted((bad / "shards").glob("d003-*.parquet"))[0]
    table = pq.read_table(shard)
    pq.write_table(table.drop_columns(["ads.ts"]), shard)
    with pytest.raises(DataError, match=r"missing columns \['ads.ts'\]"):
        features(bad, "test")
    X = np.zeros((4, 1))
    with pytest.raises(ValueError, match="labels must be 0/1.*1 NaN"):
        fit_task(X, np.array([0.0, 1.0, np.nan, 0.0]), X, np.array([0.0, 1.0, 1.0, 0.0]), ["x"], [],
                 {})
    with pytest.raises(ValueError, match="grid point"):
        run_gbdt(world, grid=[{"learning_rate": 0.1}])


def test_a_clear_error_without_lightgbm(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightgbm", None)  # as if not installed
    with pytest.raises(RuntimeError, match=r"pip install 'opengem\[bench\]'"):
        _lightgbm()
