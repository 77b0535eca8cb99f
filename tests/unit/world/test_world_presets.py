"""Synthetic-world presets: each validates, they differ only in their sizes, and world overrides go
through the one override path (dotted keys, typed values, errors that name the key)."""

import dataclasses
import itertools

import pytest

from opengem.cli import main
from opengem.config import ConfigError
from opengem.testing import differing
from opengem.world.generate import WorldConfig
from opengem.world.presets import world_config, world_names

# The world dial: sizes, and for tiny the event caps and the impression rate. The click and
# conversion models (and the rest of behaviour and impressions) are the same in every world.
DIAL_EXTRA = {"behaviour.max_events", "behaviour.ads_max_events", "impressions.impressions_per_day"}


def test_every_world_validates():
    assert world_names() == ["tiny", "demo", "small", "large"]
    for name in world_names():
        cfg = world_config(name)
        assert isinstance(cfg, WorldConfig) and cfg.validate() is cfg
    assert world_config("demo") == WorldConfig()  # demo is the defaults


def test_worlds_differ_only_along_the_dial():
    configs = {n: dataclasses.asdict(world_config(n)) for n in world_names()}
    for a, b in itertools.combinations(world_names(), 2):
        diff = differing(configs[a], configs[b])
        assert all(k.startswith("sizes.") or k in DIAL_EXTRA
                   for k in diff), f"{a} vs {b}: {sorted(diff)}"


def test_preset_sizes_and_seed():
    rows = {}
    for name in world_names():
        s = world_config(name)
        rows[name] = s.sizes.num_users * s.sizes.num_days * s.impressions.impressions_per_day
    assert 1000 < rows["tiny"] < 10000
    assert 500_000 < rows["demo"] < 700_000
    assert 2_000_000 < rows["small"] < 3_000_000
    assert rows["large"] >= 20_000_000
    assert world_config("tiny", seed=5).seed == 5 and world_config("tiny").seed == 0


def test_overrides_are_parsed_by_the_fields_type():
    cfg = world_config("tiny", overrides=["sizes.num_users=250", "click.target_ctr=0.05",
                                          "behaviour.event_attributes=false",
                                          "behaviour.max_events=1e3", "seed=9"])
    assert (cfg.sizes.num_users, cfg.click.target_ctr, cfg.behaviour.event_attributes,
            cfg.behaviour.max_events, cfg.seed) == (250, 0.05, False, 1000, 9)
    assert world_config("tiny").sizes.num_users == 400  # the preset is untouched


@pytest.mark.parametrize("item, words", [
    ("num_users=3000", "unknown config key 'num_users'; valid keys: seed, sizes.num_users, "),
    ("sizes.bogus=1", "unknown config key 'sizes.bogus'; valid keys: .*conversion.target_cvr"),
    ("sizes=3", "'sizes' is a section"),
    ("sizes.num_users=2.5", "sizes.num_users: cannot read '2.5' as int"),
    ("behaviour.event_attributes=maybe", "behaviour.event_attributes: cannot read 'maybe' as bool"),
    ("click.target_ctr=1.5", r"WorldConfig.click.target_ctr must be in \(0, 1\), got 1.5"),
    ("behaviour.interest_drift=nan", "WorldConfig.behaviour.interest_drift must be finite"),
    ("sizes.num_days=2", "WorldConfig.sizes.num_days must leave >= 1 train day"),
    ("sizes.num_users", "must look like key=value"),
])
def test_bad_overrides_name_the_key(item, words):
    with pytest.raises(ConfigError, match=words):
        world_config("tiny", overrides=[item])


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown synthetic preset 'huge'.*'tiny'"):
        world_config("huge")


def test_generate_command_line_reports_a_flat_key(tmp_path, capsys):
    assert (
        main(
            [
                "--quiet",
                "generate",
                "--preset",
                "tiny",
                "--out",
                str(tmp_path / "w"),
                "num_users=50",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "unknown config key 'num_users'" in err and "sizes.num_users" in err
    assert not (tmp_path / "w").exists()
