"""The figures ``opengem bench --quick`` adds: layout bytes and the loader against the trainer."""

from __future__ import annotations

import torch
from instruments.layout import layout_bytes
from instruments.quick import fp8_budget, loader_and_step_examples_per_s

from opengem.recipes import recipe
from opengem.world.generate import generate
from opengem.world.presets import world_config


def test_layout_bytes_v1_over_v2_is_the_total_ratio(tmp_path):
    out = layout_bytes(world_config("tiny", seed=0), tmp_path)
    assert out["bytes_v2"]["history_columns_in_shards"] == 0 and out["bytes_v1"]["event_logs"] == 0
    assert out["bytes_v2"]["event_logs"] > 0 and out["bytes_v1"]["history_columns_in_shards"] > 0
    assert out["dataset_bytes_v1_over_v2"] == round(out["bytes_v1"]["total"]
                                                    / out["bytes_v2"]["total"], 2)
    # histories copied per row cost more than logs once per user
    assert out["dataset_bytes_v1_over_v2"] > 1.5


def test_loader_over_train_step_is_one_ratio_on_the_same_batches(tmp_path):
    torch.set_num_threads(1)
    generate(world_config("tiny", seed=0), tmp_path, progress=False)
    cfg = recipe("tiny")
    out = loader_and_step_examples_per_s(cfg, tmp_path, batches=2, rounds=3)
    assert all(len(v) == 3 for v in out.values())
    # same rows in each round, so examples/s over examples/s is step seconds over load seconds
    for lo, st, ratio in zip(out["loader"], out["train_step"], out["loader_over_train_step"]):
        assert lo > 0 and st > 0 and abs(ratio - lo / st) < 1e-9 * ratio


def test_fp8_is_read_on_the_eighth_of_the_pass_not_on_the_crossing():
    ladder = [{"pass_fraction": f, "final_ne": ne}
              for f, ne in ((1 / 32, 1.03), (1 / 16, 0.99), (1 / 8, 0.95), (1 / 4, 0.91),
                            (1 / 2, 0.87), (1.0, 0.85))]
    assert fp8_budget(ladder)["pass_fraction"] == 1 / 8
    # a race that crossed early has no 1/8 run: the nearest budget
    assert fp8_budget(ladder[:2])["pass_fraction"] == 1 / 16
