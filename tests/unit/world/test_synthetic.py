"""The synthetic world: reproducible, its probability columns are the label probabilities, its
histories are well formed, and the true model reads only what a row stores."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from opengem.data.parquet import DatasetManifest
from opengem.features.schema import FeatureSchema
from opengem.world.generate import (
    WorldConfig,
    build_schema,
    columns_from_table,
    generate,
    world_from_manifest,
)
from opengem.world.latent import (
    ORGANIC_EVENT_WEIGHTS,
    World,
    history_signals,
    probabilities,
    sequence_match,
)
from opengem.world.presets import world_config


def _gen(path, *overrides, preset="tiny", seed=None):
    cfg = world_config(preset, seed, overrides)
    return cfg, generate(cfg, path, progress=False)


def _read(path, manifest, split=None):
    files = manifest.files if split is None else manifest.split_files(split)
    return pa.concat_tables([pq.read_table(path / f.path) for f in files])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    cfg, m = _gen(path, seed=7)
    return cfg, path, m


def _digest(path, manifest):
    return {f.path: hashlib.sha256((path / f.path).read_bytes()).hexdigest()
            for f in manifest.files}


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    _, a = _gen(tmp_path / "a", "sizes.num_users=200", seed=3)
    _, b = _gen(tmp_path / "b", "sizes.num_users=200", seed=3)
    _, c = _gen(tmp_path / "c", "sizes.num_users=200", seed=4)
    assert _digest(tmp_path / "a", a) == _digest(tmp_path / "b", b)
    assert (tmp_path / "a" / "dataset.json").read_text() == (
        tmp_path / "b" / "dataset.json"
    ).read_text()
    assert _read(tmp_path / "a", a).equals(_read(tmp_path / "b", b))
    ta, tc = _read(tmp_path / "a", a), _read(tmp_path / "c", c)
    assert not ta.equals(tc)
    assert _digest(tmp_path / "a", a) != _digest(tmp_path / "c", c)


def _check_calibrated(p, y, bins):
    edges = np.quantile(p, np.linspace(0, 1, bins + 1))
    which = np.clip(np.searchsorted(edges, p, side="right") - 1, 0, bins - 1)
    for k in [*range(bins), None]:
        sel = slice(None) if k is None else which == k
        exp, got = p[sel].sum(), y[sel].sum()
        sd = np.sqrt((p[sel] * (1 - p[sel])).sum())
        assert abs(got - exp) <= 4 * sd + 1, (
            f"bin {k}: {got} labels vs expected {exp:.1f} ± {sd:.1f}"
        )


def test_prob_columns_are_the_label_probabilities(tmp_path):
    cfg, m = _gen(tmp_path, "sizes.num_users=3000", "sizes.users_per_block=1000")
    t = _read(tmp_path, m)
    assert t.num_rows > 20000
    pc, pv = t["p_click"].to_numpy(), t["p_conversion"].to_numpy()
    yc, yv = t["click"].to_numpy(), t["conversion"].to_numpy()
    assert np.all((pc > 0) & (pc < 1)) and np.all(pv <= pc) and np.all(pv > 0)
    assert not np.any((yv == 1) & (yc == 0)), "conversion without click"
    _check_calibrated(pc, yc, bins=10)
    _check_calibrated(pv, yv, bins=4)
    # p(conversion | click) among clicked rows is p_conversion / p_click
    clicked = yc == 1
    _check_calibrated((pv / pc)[clicked], yv[clicked], bins=3)
    assert abs(pc.mean() - cfg.click.target_ctr) < 0.25 * cfg.click.target_ctr
    assert abs(pv.sum() / pc.sum() - cfg.conversion.target_cvr) < 0.25 * cfg.conversion.target_cvr
    assert pc.std() > 0.03  # the world is not flat


def _lists(t, name):
    col = t[name].combine_chunks()
    off = col.offsets.to_numpy()
    return col.values.to_numpy()[off[0]:off[-1]], np.diff(off)


def test_histories_well_formed_and_truncated_to_most_recent(tmp_path):
    cfg, m = _gen(tmp_path / "short", "behaviour.organic_max_len=64", "behaviour.ads_max_len=8",
                  seed=1)
    _, m_full = _gen(tmp_path / "full", seed=1)
    world = World(cfg)
    t, t_full = _read(tmp_path / "short", m), _read(tmp_path / "full", m_full)
    req = t["request_ts"].to_numpy()
    for s in build_schema(cfg).sequences:
        items, lens = _lists(t, s.item_column)
        events, lens_e = _lists(t, s.event_column)
        ts, lens_t = _lists(t, s.ts_column)
        assert (lens == lens_e).all() and (lens == lens_t).all()
        assert lens.max() == s.max_len, f"{s.name}: truncation not exercised"
        assert ((items >= 0) & (items < s.item_vocab_size)).all()
        assert ((events >= 0) & (events < s.num_event_types)).all()
        row = np.repeat(np.arange(t.num_rows), lens)
        assert (ts < req[row]).all()
        same_row = row[1:] == row[:-1]
        assert (np.diff(ts)[same_row] >= 0).all()
        # the stored history is the most recent max_len events of the untruncated one
        items_f, lens_f = _lists(t_full, s.item_column)
        ts_f, _ = _lists(t_full, s.ts_column)
        ends = np.cumsum(lens_f)
        assert (lens == np.minimum(lens_f, s.max_len)).all()
        keep = np.arange(len(items_f)) >= np.repeat(ends - lens, lens_f)
        assert (items_f[keep] == items).all() and (ts_f[keep] == ts).all()
    for st in ("organic", "ads"):
        assert m.source["stats"]["seq_len"][st]["truncated_rows"] > 0
        assert m_full.source["stats"]["seq_len"][st]["truncated_rows"] == 0
    org_len = _lists(t_full, "organic.item")[1]
    assert np.median(org_len) < np.quantile(org_len, 0.99) / 2  # long tail

    # ads are live when shown / engaged with; ads launched later appear on later days only
    ad, day = t["ad_id"].to_numpy(), t["day"].to_numpy()
    assert (world.ad_launch[ad] <= req - cfg.sizes.start_ts).all()
    assert (world.ad_launch_day[ad] <= day).all()
    ads_items, ads_lens = _lists(t, "ads.item")
    ads_ts, _ = _lists(t, "ads.ts")
    assert (world.ad_launch[ads_items] <= ads_ts - cfg.sizes.start_ts).all()
    train = set(_read(tmp_path / "short", m, "train")["ad_id"].to_numpy().tolist())
    test = set(_read(tmp_path / "short", m, "test")["ad_id"].to_numpy().tolist())
    assert test - train, "the test days should show ads never seen in training"
    assert (world.ad_launch_day[list(test - train)] >= 1).mean() > 0.5


def _row(c, i):
    """One row of a column dict (list columns as 1-row (values, lengths))."""
    out = {}
    for k, v in c.items():
        if isinstance(v, tuple):
            vals, lens = v
            s = lens[:i].sum()
            out[k] = (vals[s:s + lens[i]], lens[i:i + 1])
        else:
            out[k] = v[i:i + 1]
    return out


def test_true_model_reads_only_the_stored_row(tiny):
    cfg, path, m = tiny
    world = world_from_manifest(DatasetManifest.load(path))
    for f in m.files[:4]:
        c = columns_from_table(pq.read_table(path / f.path))
        p_click, p_cvr, _, _ = probabilities(world, c)
        np.testing.assert_allclose(p_click, c["p_click"], rtol=1e-12, atol=0)
        np.testing.assert_allclose(p_click * p_cvr, c["p_conversion"], rtol=1e-12, atol=0)

    c = columns_from_table(pq.read_table(path / m.files[-1].path))
    mvals, _ = history_signals(world, c)
    tau = cfg.click.seq_tau_hours * 3600
    rows = np.flatnonzero(c["organic.item"][1] > 0)[:25]
    for i in rows:  # m by a plain loop over the stored events
        r = _row(c, i)
        num, den = 0.0, 1.0
        for item, ev, ts in zip(r["organic.item"][0], r["organic.event"][0], r["organic.ts"][0]):
            w = ORGANIC_EVENT_WEIGHTS[ev] * np.exp(-(r["request_ts"][0] - ts) / tau)
            den += w
            num += w * (world.item_category[item] == r["category"][0])
        assert mvals[i] == pytest.approx(num / den, rel=1e-12, abs=1e-15)

    # appending a matching "view" one second before the request moves the logit by
    # exactly beta_seq·Δm
    for i in rows[:5]:
        r = _row(c, i)
        item = np.flatnonzero(world.item_category == r["category"][0])[0]
        r2 = dict(r)
        for k, v in (("item", item), ("event", 0), ("ts", r["request_ts"][0] - 1)):
            vals, lens = r[f"organic.{k}"]
            r2[f"organic.{k}"] = (np.append(vals, v).astype(np.int64), lens + 1)
        m1 = sequence_match(world, *[r[f"organic.{k}"][0] for k in ("item", "event", "ts")],
                            r["organic.item"][1], r["request_ts"], r["category"])[0]
        w = np.exp(-1 / tau)
        num, den = m1 * (1 + _den(world, r)), 1 + _den(world, r)
        m2 = (num + w) / (den + w)
        p1, p2 = probabilities(world, r)[0][0], probabilities(world, r2)[0][0]
        dz = np.log(p2 / (1 - p2)) - np.log(p1 / (1 - p1))
        assert dz == pytest.approx(cfg.click.beta_seq * (m2 - m1), rel=1e-6, abs=1e-9)
        assert dz > 0
    shares = m.source["stats"]["click_logit_var_share"]
    assert (
        shares["sequence"] > 0.1 and shares["ad_quality"] > 0.03 and shares["surface_format"] > 0.03
    )


def _den(world, r):
    tau = world.cfg.click.seq_tau_hours * 3600
    age = r["request_ts"][0] - r["organic.ts"][0]
    return (ORGANIC_EVENT_WEIGHTS[r["organic.event"][0]] * np.exp(-age / tau)).sum()


def test_schema_round_trip_and_column_types(tiny):
    cfg, path, m = tiny
    schema = build_schema(cfg)
    assert FeatureSchema.from_dict(json.loads(schema.to_json())) == schema
    assert FeatureSchema.load(path) == schema
    assert {f.name for f in schema.sparse} == {"age", "gender", "country", "device", "segment",
                                               "ad_id", "advertiser_id", "campaign_id", "category",
                                               "format", "position", "hour"}
    assert [f.name for f in schema.dense] == ["user_activity", "ad_age", "ad_quality", "hour_sin",
                                              "hour_cos"]
    assert [s.name for s in schema.sequences] == ["organic", "ads"]
    assert schema.domains.names == ("feed", "video", "messaging")
    t = pq.read_table(path / m.files[0].path)
    types = {
        "user_id": pa.int64(), "request_ts": pa.int64(), "day": pa.int32(), "domain": pa.int64(),
        **{f.name: pa.int64() for f in schema.sparse},
        **{f.name: pa.float32() for f in schema.dense},
        **{c: pa.list_(pa.int64()) for s in schema.sequences
           for c in (s.item_column, s.event_column, s.ts_column)},
        "organic.category": pa.list_(pa.int64()), "ads.advertiser_id": pa.list_(pa.int64()),
        "click": pa.int8(), "conversion": pa.int8(), "p_click": pa.float64(),
        "p_conversion": pa.float64(),
    }
    assert set(schema.columns()) == set(t.column_names) == set(types)
    for name, ty in types.items():
        assert t.schema.field(name).type == ty, name
    # event attributes are the item's category / the engaged ad's advertiser
    world = World(cfg)
    assert (
        _lists(t, "organic.category")[0] == world.item_category[_lists(t, "organic.item")[0]]
    ).all()
    assert (
        _lists(t, "ads.advertiser_id")[0] == world.ad_advertiser[_lists(t, "ads.item")[0]]
    ).all()
    assert (_lists(t, "organic.category")[1] == _lists(t, "organic.item")[1]).all()
    plain = build_schema(world_config("tiny", overrides=["behaviour.event_attributes=false"]))
    assert all(not s.attributes for s in plain.sequences)
    assert not {"organic.category", "ads.advertiser_id"} & set(plain.columns())
    for f in schema.sparse:
        v = _read(path, m)[f.name].to_numpy()
        assert v.min() >= 0 and v.max() < f.vocab_size, f.name
    assert np.isfinite(np.stack([t[f.name].to_numpy() for f in schema.dense])).all()


def test_manifest_layout_and_stats(tiny):
    cfg, path, m = tiny
    n_blocks = -(-cfg.sizes.num_users // cfg.sizes.users_per_block)
    assert sorted(f.path for f in m.files) == sorted(
        f"shards/d{d:03d}-b{b:05d}.parquet" for d in range(cfg.sizes.num_days)
        for b in range(n_blocks))
    assert m.splits == {"train": [0, 1], "valid": [2], "test": [3]}
    loaded = DatasetManifest.load(path)
    assert loaded.source["config"] == json.loads(json.dumps(loaded.source["config"]))
    st = loaded.source["stats"]
    assert (
        sum(st["rows"][s] for s in ("train", "valid", "test"))
        == st["rows"]["all"]
        == sum(f.rows for f in m.files)
    )
    assert 0.5 * cfg.click.target_ctr < st["ctr"]["all"] < 1.5 * cfg.click.target_ctr
    assert st["new_ad_row_share"]["train"] == 0 and st["new_ad_row_share"]["test"] > 0
    o = st["seq_len"]["organic"]
    assert o["median"] < o["p99"] <= o["max"] <= cfg.behaviour.max_events
    assert 0 < st["bayes_ne"]["test"]["click"] < 1
    assert abs(sum(st["click_logit_var_share"].values()) - 1) < 0.5


@pytest.mark.parametrize("changes, match", [
    ({"sizes.num_users": 0}, "sizes.num_users"),
    ({"sizes.users_per_block": -3}, "sizes.users_per_block"),
    ({"sizes.num_days": 2}, "sizes.num_days"),
    ({"behaviour.organic_max_len": 0}, "behaviour.organic_max_len"),
    ({"click.target_ctr": 1.5}, "click.target_ctr"),
    ({"sizes.num_campaigns": 3}, "sizes.num_campaigns"),
    ({"sizes.num_users": 2.5}, "sizes.num_users"),
    ({"behaviour.interest_drift": float("nan")}, "behaviour.interest_drift"),
    ({"behaviour.event_attributes": 1}, "behaviour.event_attributes"),
    ({"sizes.start_ts": 5}, "sizes.start_ts"),
    ({"impressions.target_frac": 0.9, "impressions.retarget_frac": 0.3},
     "impressions.retarget_frac"),
])
def test_bad_config_names_the_dotted_field(changes, match, tmp_path):
    cfg = world_config("tiny")
    for key, value in changes.items():
        part, name = key.split(".")
        setattr(getattr(cfg, part), name, value)
    with pytest.raises(ValueError, match=re.escape(f"WorldConfig.{match} ")):
        cfg.validate()
    with pytest.raises(ValueError, match=re.escape(match)):
        generate(cfg, tmp_path, progress=False)


def test_config_from_manifest_dict_nested_and_flat():
    cfg = world_config("tiny", seed=4, overrides=["click.target_ctr=0.05"])
    nested = json.loads(json.dumps(dataclasses.asdict(cfg)))
    assert WorldConfig.from_dict(nested) == cfg
    flat = {"seed": 4,
            **{k: v for part in nested.values() if isinstance(part, dict) for k, v in part.items()}}
    # a dataset written before the nesting
    assert WorldConfig.from_dict({**flat, "retired_knob": 1}) == cfg
