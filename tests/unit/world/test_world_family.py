"""The family of synthetic worlds: structure seed 0 is today's world, other seeds draw other forms
that the shards still determine, the manifest carries the structure, and every world's oracle sits
between the base rate and Bayes without ever reading test rows."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from opengem.cli import main
from opengem.data.events import ShardReader
from opengem.data.parquet import LAYOUT_V2, DatasetManifest
from opengem.evaluation.logistic import Design, choose_l2
from opengem.features.schema import FeatureSchema
from opengem.world.generate import _plain, columns_from_table, generate, world_from_manifest
from opengem.world.latent import (
    TAG_STRUCTURE,
    World,
    history_statistic,
    history_stats,
    probabilities,
    rng_for,
    structure_for,
)
from opengem.world.oracle import OracleCollector, refit
from opengem.world.presets import world_config
from opengem.world.structure import (
    AD_FIELDS,
    HISTORY_FORMS,
    NUMERIC_SHAPES,
    POSITION_FORMS,
    USER_FIELDS,
    WorldStructure,
    draw_structure,
)

TODAY_TERMS = ["surface", "position", "hour", "ad_quality", "ad_drift", "ad_novelty",
               "surface_format", "segment_category", "age_format", "country_cluster", "sequence",
               "ads_history", "user"]
# Written by the code before the family existed (commit 547ab50): calibrated intercepts, Σ p_click,
# Σ p_conversion, clicks, conversions and rows of the tiny world, sampling seeds 0 and 1. The shard
# and schema.json bytes were identical too (sha256; a pyarrow upgrade would change those,
# not these).
TODAY = {0: (-4.841532192212744, -4.0679012023421475, 161.36718782327796, 13.50058964223086, 149,
             10, 3972),
         1: (-6.3491608314852215, -4.178709918537413, 164.0303622612227, 16.83601751623943, 156, 16,
             4039)}


def _gen(path, *overrides, oracle=False, seed=0):
    cfg = world_config("tiny", seed, overrides)
    return cfg, generate(cfg, path, progress=False, observer=OracleCollector if oracle else None)


def _table(path, manifest, split=None):
    files = manifest.files if split is None else manifest.split_files(split)
    return pa.concat_tables([pq.read_table(path / f.path) for f in files])


@pytest.fixture(scope="module")
def world7(tmp_path_factory):
    path = tmp_path_factory.mktemp("w7")
    cfg, m = _gen(path, "structure_seed=7", "sizes.num_users=1000", oracle=True)
    return cfg, path, m


@pytest.mark.parametrize("seed", [0, 1])
def test_structure_seed_zero_is_todays_world(seed, tmp_path):
    cfg, m = _gen(tmp_path, "structure_seed=0", seed=seed)
    t = _table(tmp_path, m)
    b0, c0, spc, spv, clicks, convs, rows = TODAY[seed]
    cal = m.source["stats"]["calibration"]
    assert (cal["b0"], cal["c0"]) == pytest.approx((b0, c0), rel=1e-12)
    assert float(t["p_click"].to_numpy().sum()) == pytest.approx(spc, rel=1e-12)
    assert float(t["p_conversion"].to_numpy().sum()) == pytest.approx(spv, rel=1e-12)
    counts = int(t["click"].to_numpy().sum()), int(t["conversion"].to_numpy().sum()), t.num_rows
    assert counts == (clicks, convs, rows)
    world = world_from_manifest(m)
    _, _, ct, vt = probabilities(world,
                                 columns_from_table(pq.read_table(tmp_path / m.files[0].path)))
    assert list(ct) == TODAY_TERMS and list(vt) == ["advertiser", "segment_category", "sequence",
                                                    "surface"]
    assert world_config("tiny").structure_seed == 0


def test_the_distribution_covers_every_form():
    cfg = world_config("tiny")
    seen = set()
    for s in range(1, 100):
        st = draw_structure(cfg, rng_for(s, TAG_STRUCTURE)).validate()
        assert 2 <= len(st.click.interactions) <= 5 and len(st.conversion.interactions) <= 2
        for it in st.click.interactions + st.conversion.interactions:
            assert it.user in USER_FIELDS and it.ad in AD_FIELDS and 1 <= it.rank <= 6
        for h in st.click.history:
            assert 1 <= h.tau_hours <= 720
            seen.add((h.stream, h.form, h.key))
        seen |= {("shape", e.shape) for e in st.click.numeric} | {
            ("position", st.click.position.form)
        }
        assert 0.25 * cfg.click.ad_drift <= st.drift.ad <= 2 * cfg.click.ad_drift
    assert {("position", f) for f in POSITION_FORMS} <= seen and {
        ("shape", s) for s in NUMERIC_SHAPES
    } <= seen
    for form in HISTORY_FORMS[:3]:
        assert {
            ("organic", form, "category"),
            ("ads", form, "advertiser"),
            ("ads", form, "category"),
        } <= seen


def test_structure_seeds_differ_in_form_not_in_entities(tmp_path):
    _, m = _gen(tmp_path, "sizes.num_users=200")
    c = columns_from_table(_table(tmp_path, m))
    a, b = (World(world_config("tiny", overrides=[f"structure_seed={s}"])) for s in (3, 4))
    assert a.structure != b.structure and a.structure.to_dict() != b.structure.to_dict()
    np.testing.assert_array_equal(a.ad_quality, b.ad_quality)  # same sampling seed, same entities
    pa_, _, ta, _ = probabilities(a, c, b0=0.0, c0=0.0)
    pb_, _, tb, _ = probabilities(b, c, b0=0.0, c0=0.0)
    assert set(ta) != set(tb)
    assert np.corrcoef(np.log(pa_), np.log(pb_))[0, 1] < 0.9


@pytest.mark.parametrize("structure_seed", [1, 2, 3, 4, 5])
def test_probabilities_recompute_from_the_shards(structure_seed, tmp_path):
    _, m = _gen(tmp_path, f"structure_seed={structure_seed}", "sizes.num_users=200")
    world = world_from_manifest(DatasetManifest.load(tmp_path))
    for f in m.files:
        c = columns_from_table(pq.read_table(tmp_path / f.path))
        p_click, p_cvr, _, _ = probabilities(world, c)
        np.testing.assert_allclose(p_click, c["p_click"], rtol=1e-12, atol=0)
        np.testing.assert_allclose(p_click * p_cvr, c["p_conversion"], rtol=1e-12, atol=0)


def test_recency_statistic_by_a_plain_loop(tmp_path):
    _, m = _gen(tmp_path, "structure_seed=1", "sizes.num_users=200")  # ads: recency, key category
    world = world_from_manifest(m)
    h = world.structure.click.history[1]
    assert (h.form, h.key) == ("recency", "category")
    c = columns_from_table(pq.read_table(tmp_path / m.files[-1].path))
    s = history_statistic(world, c, h)
    items, lens = c["ads.item"]
    ts = c["ads.ts"][0]
    ends = np.cumsum(lens)
    for i in np.flatnonzero(lens > 0)[:40]:
        rows = range(ends[i] - lens[i], ends[i])
        hits = [ts[j] for j in rows if world.ad_category[items[j]] == c["category"][i]]
        want = np.exp(-(c["request_ts"][i] - max(hits)) / (h.tau_hours * 3600)) if hits else 0.0
        assert s[i] == pytest.approx(want, rel=1e-12, abs=0)
    assert (s > 0).any() and (s == 0).any()


def test_manifest_carries_the_structure(world7):
    cfg, path, m = world7
    loaded = DatasetManifest.load(path)
    assert loaded.source["config"]["structure_seed"] == 7
    d = loaded.source["structure"]
    assert d == json.loads(json.dumps(d))
    assert WorldStructure.from_dict(d) == structure_for(cfg) == World(cfg).structure
    assert world_from_manifest(loaded).structure == structure_for(cfg)
    assert (
        d["seed"] == 7
        and d["click"]["interactions"]
        and d["click"]["history"][0]["form"] in HISTORY_FORMS
    )


def test_oracle_between_base_rate_and_bayes(world7):
    _, path, m = world7
    o = m.source["stats"]["oracle"]
    for split in ("valid", "test"):
        e = o[split]["all/click"]
        assert e["ne_bayes"] < e["ne"] < 1 and 0 < e["captured"] < 1, (split, e)
        assert 0 < e["captured_expected"] < 1
        # a tiny split's few conversions: its drawn labels may favour the oracle
        for key, e in o[split].items():
            assert e["ne_expected"] is None or e["ne_expected"] > e["ne_bayes_expected"], (
                split,
                key,
            )
        assert {"feed/click", "video/click", "messaging/click"} <= set(o[split])
    assert set(o["l2"].values()) <= set(map(float, o["valid_logloss"]["click"]))
    assert o["train_rows"]["click"] == m.source["stats"]["rows"]["train"]
    assert _plain(refit(path)) == o  # from the shards and the manifest alone


def test_the_oracle_reads_no_latent_cluster(tmp_path):
    # World 0 crosses country with the advertiser's cluster, which no column holds: the oracle's
    # cross is country × advertiser_id (what a learner sees), and its rows do not move when the
    # latent cluster assignment does.
    from opengem.world.oracle import Layout

    cfg, m = _gen(tmp_path, "sizes.num_users=200")
    world = World(cfg)
    layout = Layout(world, "click")
    cross = dict((name, cells) for name, cells, _ in layout.groups)["cross_country_cluster"]
    assert cross == 20 * cfg.sizes.num_advertisers
    c = columns_from_table(_table(tmp_path, m))
    stats = history_stats(world, c)
    before = layout.rows(c, stats)
    world.advertiser_cluster = (world.advertiser_cluster + 1) % cfg.sizes.num_advertiser_clusters
    after = layout.rows(c, stats)
    assert np.array_equal(before[0], after[0]) and np.array_equal(before[1], after[1])


def test_the_pair_blind_oracle_crosses_every_user_field_with_every_ad_field(world7):
    # crosses="all": the oracle's model without knowing which pairs interact (every user field x
    # category, format, advertiser_id; domain x format is a click group already), the exact history
    # statistics and transforms kept. Never what generate stores.
    from opengem.world.oracle import Layout

    cfg, path, m = world7
    world = world_from_manifest(m)
    click, conv = Layout(world, "click", "all"), Layout(world, "conversion", "all")
    crosses = [name for name, _, _ in click.groups if name.startswith("cross_")]
    assert len(crosses) == len(USER_FIELDS) * 3 - 1 and "cross_domain_format" not in crosses
    assert len([n for n, _, _ in conv.groups if n.startswith("cross_")]) == len(USER_FIELDS) * 3
    assert click.dense_names == Layout(world, "click").dense_names  # the same scalar columns
    blind = refit(path, crosses="all")
    assert blind["parameters"]["click"] > m.source["stats"]["oracle"]["parameters"]["click"]
    e = blind["valid"]["all/click"]
    assert e["ne_bayes"] < e["ne"] < 1
    with pytest.raises(ValueError, match="crosses"):
        Layout(world, "click", "pairs")


def test_the_l2_choice_never_reads_test(world7):
    rng = np.random.default_rng(0)

    def design(split, n=200):
        return Design(split, rng.integers(0, 5, (1, n)), rng.normal(size=(n, 2)),
                      (rng.random(n) < 0.3) * 1.0)

    fit, losses = choose_l2(design("train"), design("valid"), num_weights=5)
    assert fit.l2 in losses
    for train, valid in (("train", "test"), ("test", "valid"), ("valid", "valid")):
        with pytest.raises(ValueError, match="test split only grades|fits on 'train'"):
            choose_l2(design(train), design(valid), num_weights=5)


def test_cli_world_seed(tmp_path):
    out = tmp_path / "data"
    assert main(["--quiet", "generate", "--preset", "tiny", "--out", str(out), "--world-seed", "7",
                 "sizes.num_users=200"]) == 0
    m = DatasetManifest.load(out)
    assert m.source["config"]["structure_seed"] == 7
    assert (
        m.source["structure"]
        == structure_for(world_config("tiny", overrides=["structure_seed=7"])).to_dict()
    )
    assert "oracle" in m.source["stats"]
    assert m.layout == LAYOUT_V2  # the CLI's default: histories joined from the event logs on read
    shard = ShardReader(out, m,
                        FeatureSchema.load(out)).read(m.files[0], FeatureSchema.load(out).columns())
    stats = history_stats(world_from_manifest(m), columns_from_table(shard))
    assert stats  # a structure with a history effect
