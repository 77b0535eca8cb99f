"""The figures ``opengem bench --quick`` adds for issue 23: layout bytes and the loader against the trainer."""

from __future__ import annotations

import torch
from instruments.layout import layout_bytes
from instruments.quick import loader_examples_per_s

from opengem.features.schema import FeatureSchema
from opengem.model.build import build_gem
from opengem.recipes import recipe
from opengem.world.generate import generate
from opengem.world.presets import world_config


def test_layout_bytes_v1_over_v2_is_the_total_ratio(tmp_path):
    out = layout_bytes(world_config("tiny", seed=0), tmp_path)
    assert out["bytes_v2"]["history_columns_in_shards"] == 0 and out["bytes_v1"]["event_logs"] == 0
    assert out["bytes_v2"]["event_logs"] > 0 and out["bytes_v1"]["history_columns_in_shards"] > 0
    assert out["dataset_bytes_v1_over_v2"] == round(out["bytes_v1"]["total"] / out["bytes_v2"]["total"], 2)
    assert out["dataset_bytes_v1_over_v2"] > 1.5  # histories copied per row cost more than logs once per user


def test_loader_examples_per_s_reads_batches_as_the_trainer(tmp_path):
    torch.set_num_threads(1)
    generate(world_config("tiny", seed=0), tmp_path, progress=False)
    cfg = recipe("tiny")
    assert cfg.data.prefetch > 0  # the figure is the prefetched loader, as training uses it
    eps = loader_examples_per_s(cfg, tmp_path, build_gem(FeatureSchema.load(tmp_path), cfg.model).max_seq_len(),
                                seconds=0.3)
    assert eps > 0
