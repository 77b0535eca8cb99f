"""The logistic-regression peer: its columns (one-hot ids, user x ad crosses, history counters), the
fitted model against the base rate, and the L2 choice on valid only."""

import math
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
from instruments.gbdt import features
from instruments.history_features import PractitionerHistory
from instruments.linear import DECAY_HOURS, L2_GRID, LinearColumns, fit, predict, run_linear

from opengem.data.batch import collate
from opengem.data.parquet import DataError, list_array
from opengem.discipline import DisciplineError
from opengem.features.schema import FeatureSchema
from opengem.testing import random_table, tiny_schema, with_events


def test_the_columns_are_ids_their_user_by_ad_crosses_and_counters():
    # user_id (user), ad_id, category (ad), tags (multi-hot, left out); 2 domains
    schema = tiny_schema()
    cols = LinearColumns(schema)
    names = [g[0] for g in cols.groups]
    assert names == ["user_id", "ad_id", "category", "domain", "user_id_x_ad_id",
                     "user_id_x_category", "domain_x_ad_id", "domain_x_category"]
    # OOV rows crossed too
    assert dict((g[0], g[1]) for g in cols.groups)["user_id_x_ad_id"] == 51 * 31
    assert [g[0] for g in LinearColumns(schema, max_cross_cells=1000).groups][-3:] == [
        "user_id_x_category", "domain_x_ad_id", "domain_x_category"]  # 1,581 cells: left out
    assert cols.categorical == names and cols.names[:len(names)] == names
    # dense raw and signed-log; s0: (all, category match) x 4 event ids x 5 tau, sums and newest, 5
    # shares; s1 (no attribute): 1 x 4 x 5 twice; then the practitioner's history columns
    counters = 2 * 2 + (2 * 4 * 5 * 2 + 5) + 4 * 5 * 2
    assert len(LinearColumns(schema, history="basic").names) - len(names) == counters
    assert cols.names[len(names) + counters:] == PractitionerHistory(schema).names
    table = random_table(schema, 8, seed=3)
    x = cols.batch(collate(table, schema))
    assert x.shape == (8, len(cols.names)) and np.isfinite(x).all()
    ids = x[:, :len(names)].astype(np.int64)
    assert ((ids >= 0) & (ids < np.array([g[1] for g in cols.groups]))).all()
    u, a = (np.asarray(table.column(c).to_pylist()) for c in ("user_id", "ad_id"))
    np.testing.assert_array_equal(ids[:, 4], u * 31 + a)


def test_a_schema_without_streams_gets_ids_and_dense_columns_only():
    # Open Bandit's shape: no behaviour stream, so the practitioner's history has no column
    schema = tiny_schema(streams=0)
    cols = LinearColumns(schema)
    assert PractitionerHistory(schema).names == []
    x = cols.batch(collate(random_table(schema, 5, seed=1), schema))
    assert x.shape == (5, len(cols.groups) + 2 * 2) and np.isfinite(x).all()


def test_history_counters_of_a_drawn_row():
    schema = tiny_schema()
    table = random_table(schema, 3, seed=0,
                         lengths={"s0": np.array([0, 0, 0]), "s1": np.array([0, 0, 0])})
    req, cat = (table.column(c).to_pylist()[1] for c in ("request_ts", "category"))
    table = with_events(table, 1, "s0", [req - 7200, req - 3600], {})
    cats = table.column("s0.category").to_pylist()
    # the newest event, an hour old, matches the candidate's category
    cats[1] = [(cat + 1) % 5, cat]
    table = table.set_column(table.schema.get_field_index("s0.category"), "s0.category",
                             list_array(np.array(sum(cats, []), dtype=np.int64),
                                        [len(c) for c in cats]))
    cols = LinearColumns(schema)
    x = dict(zip(cols.names, cols.batch(collate(table, schema))[1]))
    e1, e2 = math.exp(-1), math.exp(-2)  # tau 1 h: the events' decays
    assert x["s0.log1p_sum.all.e0.tau1h"] == pytest.approx(math.log1p(e1 + e2))
    assert x["s0.log1p_sum.s0.category.e0.tau1h"] == pytest.approx(math.log1p(e1))
    assert x["s0.newest.all.e0.tau1h"] == pytest.approx(e1) and x[
        "s0.newest.s0.category.e0.tau1h"
    ] == pytest.approx(e1)
    assert x["s0.share.s0.category.tau1h"] == pytest.approx(e1 / (1 + e1 + e2))
    # no such events
    assert x["s0.log1p_sum.all.e1.tau1h"] == 0 and x["s1.log1p_sum.all.e0.tau1h"] == 0
    assert len(DECAY_HOURS) == 5


def test_it_beats_the_base_rate_and_chooses_l2_on_valid(world):
    schema = FeatureSchema.load(world)
    cols = LinearColumns(schema)
    train, valid, test = (features(world, s, schema, columns=cols)
                          for s in ("train", "valid", "test"))
    fits, paths = fit(train, valid, cols)
    assert all(f.l2 in L2_GRID and f.l2 in p for f, p in zip(fits, paths))
    for f, path in zip(fits, paths):  # the chosen point is the path's lowest valid log loss
        assert path[f.l2] == min(path.values())
    p = predict(fits, test, cols, "test")
    assert (p[:, 1] <= p[:, 0]).all()  # p(conversion) = p(click) · p(conversion | click)
    run = run_linear(world)
    # Measured at this world (dev world 0 at quality.py --quick's size, 7,543 train rows): valid
    # click NE 0.8018 with the practitioner's history columns (lambda 100 / 300), 0.7777 without
    # (history="basic", lambda 30 / 100): "auto" chooses the set on valid, as it chooses lambda
    assert run["chosen"]["history"] == "basic"
    assert run["valid"]["all/click"]["ne"] == pytest.approx(0.7777, abs=0.01)
    assert run["valid"]["all/click"]["auc"] > 0.83 and run["metrics"]["all/click"]["ne"] < 0.85
    basic = LinearColumns(schema, history="basic")
    chosen = fit(*(features(world, s, schema, columns=basic) for s in ("train", "valid")), basic)[0]
    assert run["chosen"]["l2"] == {"click": chosen[0].l2, "conversion": chosen[1].l2}
    assert run["metrics_platt"]["all/click"]["auc"] == pytest.approx(
        run["metrics"]["all/click"]["auc"], abs=1e-9
    )
    with pytest.raises(DisciplineError, match="test"):
        run_linear(world, tune_split="test")


def test_bad_input_names_the_problem(world, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(world, bad)
    shard = sorted((bad / "shards").glob("d003-*.parquet"))[0]
    pq.write_table(pq.read_table(shard).drop_columns(["organic.ts"]), shard)
    with pytest.raises(DataError, match=r"missing columns \['organic.ts'\]"):
        run_linear(bad)
