"""Student presets: each builds and validates, they differ only along the student dial, and a
student with its transfer techniques takes one command line through the one override path."""

import dataclasses
import itertools

import pytest

from opengem.config import ConfigError, apply_prefixed_overrides
from opengem.model.build import build_gem, count_parameters
from opengem.recipes import recipe, student_recipe, student_recipe_names
from opengem.testing import differing
from opengem.transfer.config import TransferConfig
from opengem.world.generate import build_schema
from opengem.world.presets import world_config

DIAL = {"recipe", "model.embedding_dim", "model.max_seq_len", "model.use_sequences",
        "model.wukong.num_layers", "model.wukong.num_fm", "model.wukong.num_lc",
        "model.wukong.fm_rank", "model.wukong.mlp_dims",
        "model.sequence.num_heads", "model.sequence.recent_len", "model.sequence.min_recent",
        "model.sequence.num_pooled", "model.interformer.num_sum", "model.heads.trunk_dims",
        "model.heads.task_dims"}


def test_every_student_builds_and_validates():
    schema = build_schema(world_config("tiny"))
    assert student_recipe_names() == ["vm_xs", "vm_s", "vm_m", "fm_domain"]
    for name in student_recipe_names():
        cfg = student_recipe(name)
        assert cfg.recipe == name and cfg.validate() is cfg
        assert count_parameters(build_gem(schema, cfg.model))["total"] > 0
    assert student_recipe("demo") == recipe("demo")  # a GEM recipe is a (large) student too


def test_students_differ_only_along_the_dial():
    configs = {n: dataclasses.asdict(student_recipe(n)) for n in student_recipe_names()}
    for a, b in itertools.combinations(student_recipe_names(), 2):
        diff = differing(configs[a], configs[b])
        assert diff <= DIAL, f"{a} vs {b}: {sorted(diff - DIAL)} are not on the dial"


def test_unknown_student_lists_students_and_recipes():
    with pytest.raises(ValueError, match="unknown student recipe 'vm_xxl'.*'vm_xs'.*'tiny'"):
        student_recipe("vm_xxl")


def test_student_and_transfer_overrides_share_one_path():
    trees = apply_prefixed_overrides({"": student_recipe("vm_s"), "transfer": TransferConfig()},
                                     ["optim.lr=1e-3", "transfer.domains=feed,video",
                                      "transfer.kd.weight=1",
                                      "transfer.share.tables=t_ad_id",
                                      "model.wukong.mlp_dims=16,8"])
    cfg, tcfg = trees[""], trees["transfer"]
    assert cfg.optim.lr == 1e-3 and cfg.model.wukong.mlp_dims == (16, 8)
    assert (
        tcfg.domains == ("feed", "video")
        and tcfg.kd.weight == 1.0
        and tcfg.share.tables == ("t_ad_id",)
    )
    # bases untouched
    assert TransferConfig().kd.weight == 3.0 and student_recipe("vm_s").optim.lr == 3e-3


@pytest.mark.parametrize("item, words", [
    ("transfer.kd.wieght=1",
     "unknown config key 'transfer.kd.wieght'; valid keys: .*optim.lr.*transfer.kd.weight"),
    ("kd.weight=1", "unknown config key 'kd.weight'"),
    ("transfer.kd.weight=heavy", "transfer.kd.weight: cannot read 'heavy' as float"),
    ("transfer.kd=1", "'transfer.kd' is a section"),
    ("transfer.kd.enabled=false", "need transfer.kd.enabled=true"),
    ("optim.lr=-1", "must be > 0"),
])
def test_bad_student_or_transfer_overrides_name_the_key(item, words):
    with pytest.raises(ConfigError, match=words):
        apply_prefixed_overrides({"": student_recipe("vm_xs"), "transfer": TransferConfig()},
                                 [item])
