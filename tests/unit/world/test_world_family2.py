"""The wider family (``family=2``): new history effects drawn from their own generator, recomputed
from the shards, exact in the oracle, and family-1 worlds left exactly as they were."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from opengem.cli import main
from opengem.data.events import ShardReader
from opengem.data.parquet import DatasetManifest
from opengem.features.schema import FeatureSchema
from opengem.world.generate import WorldConfig, columns_from_table, generate, world_from_manifest
from opengem.world.latent import (
    DAY,
    World,
    history_stats,
    probabilities,
    structure_for,
)
from opengem.world.oracle import Layout
from opengem.world.presets import world_config
from opengem.world.structure import (
    Fatigue,
    LastK,
    Repeat,
    Similarity,
    WideEffects,
    WorldStructure,
)
from opengem.world.wide import wide_stats

FIXTURE = Path(__file__).parent / "fixtures" / "family1_structures.json"
# structure seeds whose family-2 draw turns on: 2 similarity (ads), fatigue, repeat;
# 10 all four (similarity on the organic stream)
SEEDS = {2: ["similarity", "fatigue", "repeat"], 10: ["similarity", "fatigue", "repeat", "last_k"]}


def _cfg(structure_seed, family=2, users=200):
    return world_config("tiny", overrides=[f"structure_seed={structure_seed}", f"family={family}",
                                           f"sizes.num_users={users}"])


def _columns(path, manifest) -> dict:
    return columns_from_table(pa.concat_tables([pq.read_table(path / f.path)
                                                for f in manifest.files]))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A family-1 tiny world's rows: every statistic reads only columns, so any structure's
    statistics can be taken on them."""
    path = tmp_path_factory.mktemp("f1")
    cfg = _cfg(0, family=1)
    return cfg, _columns(path, generate(cfg, path, progress=False))


def _json(st: WorldStructure) -> str:
    return json.dumps(st.to_dict(), sort_keys=True)


def test_family_one_structures_are_the_ones_drawn_before_the_family():
    fx = json.loads(FIXTURE.read_text())
    for seed, digest in fx["sha256"].items():
        st = structure_for(world_config("tiny", overrides=[f"structure_seed={seed}"]))
        assert hashlib.sha256(_json(st).encode()).hexdigest() == digest, seed
        wide = structure_for(world_config("tiny", overrides=[f"structure_seed={seed}",
                                                             "family=2"]))
        assert wide.wide is not None and dataclasses.replace(wide, wide=None) == st, seed
    full = structure_for(world_config("tiny", overrides=["structure_seed=1000"]))
    assert json.loads(_json(full)) == fx["full"]["1000"]


def test_family_two_turns_each_class_on_somewhere():
    on = {s: list(structure_for(_cfg(s)).wide.on()) for s in range(1, 40)}
    assert all(on[s] == names for s, names in SEEDS.items())
    for name in ("similarity", "fatigue", "repeat", "last_k"):
        assert 0.3 < np.mean([name in v for v in on.values()]) < 0.9, name
    with pytest.raises(ValueError, match="family"):
        world_config("tiny", overrides=["family=3"])


def test_entities_of_family_one_do_not_move():
    a, b = World(_cfg(10, family=1)), World(_cfg(10))
    assert a.item_vectors is None and b.item_vectors.shape == (1500, 13)
    for name in ("ad_quality", "item_category", "ad_launch", "advertiser_drift"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    for k, (u, v) in a.factors.items():
        np.testing.assert_array_equal(u, b.factors[k][0])


@pytest.mark.parametrize("structure_seed", sorted(SEEDS))
def test_probabilities_recompute_from_the_shards(structure_seed, tmp_path):
    cfg = _cfg(structure_seed)
    m = generate(cfg, tmp_path, progress=False)
    loaded = DatasetManifest.load(tmp_path)
    assert loaded.source["config"]["family"] == 2
    world = world_from_manifest(loaded)
    assert world.structure == structure_for(cfg) and world.structure.wide is not None
    for f in m.files:
        c = columns_from_table(pq.read_table(tmp_path / f.path))
        p_click, p_cvr, ct, _ = probabilities(world, c)
        np.testing.assert_allclose(p_click, c["p_click"], rtol=1e-12, atol=0)
        np.testing.assert_allclose(p_click * p_cvr, c["p_conversion"], rtol=1e-12, atol=0)
        assert list(ct)[-len(SEEDS[structure_seed]):] == SEEDS[structure_seed]


def test_manifests_without_the_family_load_as_family_one(tmp_path):
    cfg = _cfg(3, family=1)
    m = generate(cfg, tmp_path, progress=False)
    assert "family" not in m.source["config"] and "wide" not in m.source["structure"]
    world = world_from_manifest(DatasetManifest.load(tmp_path))
    assert world.cfg.family == 1 and world.structure.wide is None
    assert WorldConfig.from_dict({"seed": 1}).family == 1


def _design(layout: Layout, c: dict, stats: dict) -> np.ndarray:
    """The oracle's inputs as one dense matrix: every one-hot group, then the scalar columns."""
    idx, x = layout.rows(c, stats)
    onehot = np.zeros((x.shape[0], layout.num_weights))
    for g in idx:
        onehot[np.arange(len(g)), g] = 1.0
    return np.c_[np.ones(len(x)), onehot, x]


def _residual(design: np.ndarray, z: np.ndarray) -> float:
    coef, *_ = np.linalg.lstsq(design, z, rcond=None)
    return float(np.abs(design @ coef - z).max())


@pytest.mark.parametrize("structure_seed", sorted(SEEDS))
def test_the_oracle_is_exact_on_family_two(structure_seed, shards):
    # Exact: the true click logit less the drift by day (which no oracle may know) lies in the span
    # of the oracle's inputs. Without the family-2 columns it does not.
    _, c = shards
    world = World(_cfg(structure_seed))
    stats = history_stats(world, c)
    _, _, ct, _ = probabilities(world, c, b0=0.0, c0=0.0)
    z = sum(ct.values()) - ct["ad_drift"]
    layout = Layout(world, "click")
    assert layout.dense_names[-len(layout.wide):] == [f"wide_{n}" for n in SEEDS[structure_seed]]
    design = _design(layout, c, stats)
    assert _residual(design, z) < 1e-6
    assert _residual(design[:, :-len(layout.wide)], z) > 1e-2


def test_generate_family_two_from_the_cli_with_its_oracle(tmp_path):
    out = tmp_path / "data"
    assert main(["--quiet", "generate", "--preset", "tiny", "--out", str(out), "--world-seed", "10",
                 "family=2", "sizes.num_users=300"]) == 0
    m = DatasetManifest.load(out)
    assert m.source["config"]["family"] == 2 and m.source["structure"]["wide"]["last_k"]
    world = world_from_manifest(m)
    schema = FeatureSchema.load(out)
    reader = ShardReader(out, m, schema)  # v2: histories joined back from the event logs
    c = columns_from_table(reader.read(m.files[-1], schema.columns()))
    p_click, _, _, _ = probabilities(world, c)
    np.testing.assert_allclose(p_click, c["p_click"], rtol=1e-12, atol=0)
    o = m.source["stats"]["oracle"]
    for split in ("valid", "test"):
        e = o[split]["all/click"]
        assert e["ne_bayes"] < e["ne"] < 1 and 0 < e["captured"] < 1, (split, e)


# ------------------------------------------------------------------ each mechanism, by a plain loop
def _events(c, stream, i):
    items, lens = c[f"{stream}.item"]
    end = int(np.cumsum(lens)[i])
    rows = range(end - int(lens[i]), end)
    return [(items[j], c[f"{stream}.event"][0][j], c[f"{stream}.ts"][0][j]) for j in rows]


def _plain(world, c, i, name, e):
    t = c["request_ts"][i]
    if name == "fatigue":
        return np.log1p(sum(t - ts <= 3600 * e.window_hours
                            for s in ("organic", "ads") for _, _, ts in _events(c, s, i)))
    if name == "repeat":
        return float(any(world.ad_advertiser[it] == c["advertiser_id"][i] and t - ts <= e.days * DAY
                         for it, _, ts in _events(c, "ads", i)))
    if name == "last_k":
        last = _events(c, "organic", i)[-e.k:]
        hits = sum(world.item_category[it] == c["category"][i] for it, _, _ in last)
        return hits / max(len(last), 1)
    from opengem.world.latent import ADS_EVENT_WEIGHTS, ORGANIC_EVENT_WEIGHTS

    type_w = ORGANIC_EVENT_WEIGHTS if e.stream == "organic" else ADS_EVENT_WEIGHTS
    vectors = world.item_vectors if e.stream == "organic" else world.ad_vectors
    num = den = 0.0
    for it, ev, ts in _events(c, e.stream, i):
        w = type_w[ev] * np.exp(-(t - ts) / (3600 * e.tau_hours))
        num, den = num + w * float(vectors[it] @ world.ad_vectors[c["ad_id"][i]]), den + w
    return num / (1 + den)


EFFECTS = {"similarity": Similarity("organic", 48.0, 2.0, 8, 0.5),
           "similarity_ads": Similarity("ads", 300.0, 2.0, 8, 0.5),
           "fatigue": Fatigue(1.0, 0.5), "repeat": Repeat(3, 0.5), "last_k": LastK(3, 1.0)}


def _only(cfg, name, e) -> World:
    st = structure_for(cfg)
    field = "similarity" if name.startswith("similarity") else name
    return World(cfg, dataclasses.replace(st, wide=WideEffects(**{field: e})))


@pytest.mark.parametrize("name", sorted(EFFECTS))
def test_each_statistic_by_a_plain_loop(name, shards):
    cfg, c = shards
    e = EFFECTS[name]
    world = _only(cfg, name, e)
    (s,) = wide_stats(world, c).values()
    rows = np.random.default_rng(0).choice(len(s), 80, replace=False)
    for i in rows:
        assert s[i] == pytest.approx(_plain(world, c, i, name.split("_ads")[0], e), rel=1e-9,
                                     abs=1e-12), i
    assert (s != 0).any() and (s == 0).any() if name != "similarity" else (s != 0).any()


def test_similar_histories_raise_the_click_probability(shards):
    # With only the similarity term on and a huge beta, p_click orders rows by how like the ad
    # their recent items are; items of the ad's own category are the most alike.
    cfg, c = shards
    world = _only(cfg, "similarity", Similarity("organic", 48.0, 40.0, 8, 0.5))
    vi, va = world.item_vectors, world.ad_vectors
    same = world.item_category[:, None] == world.ad_category[None, :]
    dots = vi @ va.T
    assert dots[same].mean() > 0.6 and abs(dots[~same].mean()) < 0.1
    p, _, _, _ = probabilities(world, c, b0=0.0, c0=0.0)
    s = wide_stats(world, c)["wide", "similarity"]
    hi, lo = s > np.quantile(s, 0.8), s < np.quantile(s, 0.2)
    assert p[hi].mean() > 5 * p[lo].mean()
    z = np.log(p / (1 - p))
    assert np.corrcoef(z, s)[0, 1] > 0.9


def test_declaring_the_ad_items_changes_the_schema_only(tmp_path):
    """``behaviour.declare_ad_items``: the ads stream's items are declared the candidate's
    ``ad_id`` in the schema; the shards are the default world's, byte for byte, and the default
    schema does not carry the field."""
    import hashlib

    from opengem.features.schema import FeatureSchema
    from opengem.world.generate import generate
    from opengem.world.presets import world_config

    def shards(out, *extra):
        m = generate(world_config("tiny", seed=5, overrides=["sizes.num_users=150", *extra]), out,
                     progress=False, layout="v1")
        return {f.path: hashlib.sha256((out / f.path).read_bytes()).hexdigest() for f in m.files}

    plain = shards(tmp_path / "plain")
    declared = shards(tmp_path / "declared", "behaviour.declare_ad_items=true")
    assert plain == declared
    assert FeatureSchema.load(tmp_path / "plain").stream("ads").matches is None
    assert "matches" not in (tmp_path / "plain" / "schema.json").read_text()
    assert FeatureSchema.load(tmp_path / "declared").stream("ads").matches == "ad_id"
