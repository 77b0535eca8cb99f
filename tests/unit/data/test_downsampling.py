"""Negative down-sampling in the loader: kept share ≈ r (binomial), positives never dropped,
per-domain rates, the same decision on every rank and on resume, rate 1 leaves the loader as it was,
bad rates fail."""

import math

import numpy as np
import pyarrow as pa
import pytest

from opengem.config import ConfigError, apply_overrides
from opengem.data.downsampling import NegativeSampler
from opengem.data.loader import ShardLoader
from opengem.data.parquet import ShardWriter
from opengem.recipes import recipe
from opengem.testing import random_table, tiny_schema

ROWS = 1500


def _dataset(tmp_path, n_shards=4, rows=ROWS):
    """Shards with a unique row key (user_id = 10,000 · shard + row) and click rate ~15%."""
    schema = tiny_schema()
    w = ShardWriter(tmp_path, schema)
    for i in range(n_shards):
        t = random_table(schema, rows, seed=i)
        t = t.set_column(t.schema.get_field_index("user_id"), "user_id",
                         pa.array(np.arange(rows) + 10_000 * i))
        w.write(t, f"s{i}", i // 2)
    w.close({"train": [0, 1]})
    return schema


def _rows(loader):
    """{user_id: (domain, click, conversion)} of every row handed out, and the order."""
    seen, order = {}, []
    for b in loader:
        for u, d, y in zip(b.user_id.tolist(), b.domain.tolist(), b.labels.tolist()):
            seen[u] = (d, y[0], y[1])
            order.append(u)
    return seen, order


def _all_rows(tmp_path):
    return _rows(ShardLoader(tmp_path, "train", 256, shuffle=False))[0]


def _within_binomial(kept: int, n: int, r: float) -> bool:
    return abs(kept - n * r) <= 4.5 * math.sqrt(n * r * (1 - r)) + 1


@pytest.mark.parametrize("rate", [0.5, 0.1])
def test_kept_share_of_negatives_is_the_rate_and_every_positive_is_kept(tmp_path, rate):
    _dataset(tmp_path)
    every = _all_rows(tmp_path)
    kept, order = _rows(ShardLoader(tmp_path, "train", 256, seed=5, negative_rate=rate))
    assert len(order) == len(kept)  # no row twice
    positives = {u for u, (_, c, v) in every.items() if c == 1 or v == 1}
    negatives = set(every) - positives
    assert positives <= set(kept)  # never dropped
    n_neg = len(set(kept) & negatives)
    assert _within_binomial(n_neg, len(negatives), rate), (n_neg, len(negatives), rate)
    assert 0.1 < len(positives) / len(every) < 0.2  # the fixture has enough of both


def test_per_domain_rates(tmp_path):
    _dataset(tmp_path)
    every = _all_rows(tmp_path)
    kept, _ = _rows(ShardLoader(tmp_path, "train", 256, seed=2, negative_rate=0.5,
                                negative_rate_by_domain={"d1": 0.1}))
    for d, r in ((0, 0.5), (1, 0.1)):
        neg = {u for u, (dd, c, v) in every.items() if dd == d and c == 0 and v == 0}
        assert _within_binomial(len(neg & set(kept)), len(neg), r)
    # an override to 1 keeps every row of that domain
    kept, _ = _rows(ShardLoader(tmp_path, "train", 256, negative_rate=0.2,
                                negative_rate_by_domain={"d0": 1.0}))
    assert {u for u, x in every.items() if x[0] == 0} <= set(kept)


def test_same_decision_on_every_rank_and_world_size(tmp_path):
    _dataset(tmp_path)
    one, _ = _rows(ShardLoader(tmp_path, "train", 64, seed=3, negative_rate=0.3))
    two = {}
    for rank in (0, 1):
        two |= _rows(ShardLoader(tmp_path, "train", 64, seed=3, negative_rate=0.3, rank=rank,
                                 world_size=2))[0]
    assert set(one) == set(two)
    # another seed draws other negatives; another epoch too
    assert set(_rows(ShardLoader(tmp_path, "train", 64, seed=4, negative_rate=0.3))[0]) != set(one)
    both = _rows(ShardLoader(tmp_path, "train", 64, seed=3, negative_rate=0.3, epochs=2))[1]
    first = set(both[:len(one)])
    assert first == set(one) and set(both[len(one):]) != first


@pytest.mark.parametrize("prefetch", [0, 2])
def test_resume_mid_epoch_yields_exactly_the_rest(tmp_path, prefetch):
    _dataset(tmp_path)
    kw = dict(seed=1, epochs=2, prefetch=prefetch, negative_rate=0.25)
    full = _rows(ShardLoader(tmp_path, "train", 16, **kw))[1]
    first = ShardLoader(tmp_path, "train", 16, **kw)
    it = iter(first)
    head = [next(it) for _ in range(60)]  # inside epoch 0, mid-shard
    state = first.state_dict()
    assert state["epoch"] == 0 and state["row"] > 0
    it.close()
    resumed = ShardLoader(tmp_path, "train", 16, **kw)
    resumed.load_state_dict(state)
    rest = _rows(resumed)[1]
    assert [u for b in head for u in b.user_id.tolist()] + rest == full


def test_planned_rows_are_the_rows_handed_out(tmp_path):
    _dataset(tmp_path)
    for rank in (0, 1):
        loader = ShardLoader(tmp_path, "train", 64, seed=7, negative_rate=0.2, epochs=2, rank=rank,
                             world_size=2)
        order = _rows(loader)[1]
        planned = loader.planned_rows(2)
        assert sum(planned) == len(order) and planned[0] != planned[1]
    plain = ShardLoader(tmp_path, "train", 64)
    assert plain.sampler is None and plain.planned_rows(1) == [4 * ROWS]


def test_rate_one_is_the_loader_without_sampling(tmp_path):
    _dataset(tmp_path, n_shards=2, rows=200)
    plain = ShardLoader(tmp_path, "train", 32, seed=9)
    off = ShardLoader(tmp_path, "train", 32, seed=9, negative_rate=1.0,
                      negative_rate_by_domain={"d1": 1.0})
    assert off.sampler is None
    assert _rows(plain)[1] == _rows(off)[1]


def test_sampled_rates_count_the_kept_rows(tmp_path):
    schema = _dataset(tmp_path)
    every = _all_rows(tmp_path)
    sampler = NegativeSampler(schema, 0.2, seed=0)
    counts = sampler.count_split(tmp_path, "train")
    kept = _rows(ShardLoader(tmp_path, "train", 256, seed=0, negative_rate=0.2))[0]
    rates = counts.sampled_rates(schema.task_names)
    assert rates["click"] == pytest.approx(np.mean([x[1] for x in kept.values()]))
    true = np.mean([x[1] for x in every.values()])
    assert rates["click"] == pytest.approx(true / (true + 0.2 * (1 - true)), rel=0.08)  # odds × 1/r


@pytest.mark.parametrize("rate, by_domain, match", [
    (0.0, {}, r"data.negative_rate: a negative rate must be in \(0, 1\]"),
    (-0.5, {}, "must be in"),
    (1.5, {}, "must be in"),
    (float("nan"), {}, "must be in"),
    (0.5, {"d1": 0.0}, r"negative_rate_by_domain\['d1'\]"),
    (0.5, {"nowhere": 0.3}, r"unknown domain 'nowhere' \(domains: \['d0', 'd1'\]\)"),
])
def test_bad_rates_are_clear_errors(tmp_path, rate, by_domain, match):
    _dataset(tmp_path, n_shards=1, rows=10)
    with pytest.raises(ValueError, match=match):
        ShardLoader(tmp_path, "train", 4, negative_rate=rate, negative_rate_by_domain=by_domain)


@pytest.mark.parametrize("override, match", [
    ("data.negative_rate=0", "data.negative_rate"),
    ("data.negative_rate=2", "must be in"),
    ('data.negative_rate_by_domain={"feed": 1.2}', r"negative_rate_by_domain\['feed'\]"),
    ('data.negative_rate_by_domain={"feed": "x"}', "must be a number"),
])
def test_bad_rates_in_the_config(override, match):
    with pytest.raises(ConfigError, match=match):
        apply_overrides(recipe("tiny"), [override])
    cfg = apply_overrides(recipe("tiny"),
                          ["data.negative_rate=0.1", 'data.negative_rate_by_domain={"feed": 0.5}'])
    assert cfg.data.negative_rate == 0.1 and cfg.data.negative_rate_by_domain == {"feed": 0.5}


def test_layouts_v1_and_v2_keep_the_same_rows(tmp_path):
    from opengem.world.generate import generate
    from opengem.world.presets import world_config

    kept = {}
    for layout in ("v1", "v2"):
        generate(world_config("tiny", seed=5), tmp_path / layout, progress=False, layout=layout)
        loader = ShardLoader(tmp_path / layout, "train", 64, seed=1, negative_rate=0.2)
        kept[layout] = [(u, y[0], n) for b in loader for u, y, n in
                        zip(b.user_id.tolist(), b.labels.tolist(),
                            b.sequences["organic.item"].lengths().tolist())]
        assert len(kept[layout]) == sum(loader.planned_rows(1))
    assert kept["v1"] == kept["v2"] and len(kept["v1"]) > 100
