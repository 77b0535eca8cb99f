"""GEM recipes: each builds and validates, a fresh copy per call, and they differ only along
the dial."""

import dataclasses
import itertools

import pytest

from opengem.config import Config
from opengem.model.build import build_gem, count_parameters
from opengem.recipes import recipe, recipe_names
from opengem.testing import differing
from opengem.world.generate import build_schema
from opengem.world.presets import world_config

# The leaves GEMSize sets that move between recipes (min_recent = min(8, K) is 8 in all of them),
# and demo's periodic evaluation (the report's held-out NE; it changes no trained parameter);
# nothing else may differ.
DIAL = {"recipe", "train.eval_every", "model.embedding_dim", "model.max_seq_len",
        "model.sparse.max_rows_per_table",
        "model.wukong.num_layers", "model.wukong.num_fm", "model.wukong.num_lc",
        "model.wukong.fm_rank", "model.wukong.mlp_dims", "model.sequence.num_heads",
        "model.sequence.recent_len", "model.sequence.num_pooled", "model.heads.trunk_dims",
        "model.heads.task_dims", "data.batch_size", "optim.lr", "optim.sparse_lr",
        "optim.warmup_steps", "train.ema_decay", "train.ema_warmup"}


@pytest.mark.parametrize("name", ["tiny", "demo"])
def test_small_recipes_build_on_the_tiny_world(name):
    cfg = recipe(name)
    model = build_gem(build_schema(world_config("tiny")), cfg.model)
    assert count_parameters(model)["total"] > 0


def test_every_recipe_validates_and_is_a_fresh_copy():
    assert recipe_names() == ["tiny", "demo", "small", "medium", "large", "xl"]
    for name in recipe_names():
        cfg = recipe(name)
        assert isinstance(cfg, Config) and cfg.recipe == name
        assert cfg.validate() is cfg
        cfg.optim.lr = 123.0
        assert recipe(name).optim.lr != 123.0


def test_recipes_differ_only_along_the_dial():
    configs = {n: dataclasses.asdict(recipe(n)) for n in recipe_names()}
    seen = set()
    for a, b in itertools.combinations(recipe_names(), 2):
        diff = differing(configs[a], configs[b])
        assert diff <= DIAL, f"{a} vs {b}: {sorted(diff - DIAL)} are not on the dial"
        seen |= diff
    assert seen == DIAL  # and every dial key does move somewhere


def test_the_dial_grows():
    sizes = [recipe(n) for n in recipe_names()]
    dims = [c.model.embedding_dim for c in sizes]
    layers = [c.model.wukong.num_layers for c in sizes]
    assert dims == sorted(dims) and layers == sorted(layers) and len(set(dims)) == len(dims)


def test_unknown_recipe_lists_the_names():
    with pytest.raises(ValueError, match="unknown recipe 'huge'.*'demo'"):
        recipe("huge")
