"""The one training step (``opengem.train.step``) that the trainer, the benchmarks and the
students share."""

import json
import math

import pytest
import torch

from opengem.config import apply_overrides
from opengem.data.loader import ShardLoader
from opengem.features.schema import FeatureSchema
from opengem.model.build import build_gem, materialize
from opengem.recipes import recipe
from opengem.train.optim import build_optimizers
from opengem.train.step import TrainingError, train_step
from opengem.train.trainer import train

FP8_TOL = 3e-2  # the fp8 lever's stated tolerance (tests/unit/bench/test_levers.py)


def _model(data):
    schema, cfg = FeatureSchema.load(data), recipe("tiny")
    model = materialize(build_gem(schema, cfg.model))
    opts = [
        o
        for o in build_optimizers(model.dense_parameters(), model.sparse_parameters(), cfg.optim)
        if o
    ]
    batch = next(iter(ShardLoader(data, "train", 64, schema, max_seq_len=model.max_seq_len())))
    return schema, model, opts, batch


def test_train_step_updates_parameters_and_returns_the_loss(tiny):
    schema, model, opts, batch = _model(tiny)
    before = [p.detach().clone() for p in model.parameters()]
    loss, table = train_step(model, opts, batch, torch.ones(len(schema.tasks)), schema.num_domains,
                             grad_clip=1.0)
    assert 0 < loss < 2 and table.shape == (schema.num_domains, len(schema.tasks))
    moved = sum(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert moved > len(before) // 2


def test_a_non_finite_loss_raises_before_any_parameter_moves(tiny):
    schema, model, opts, batch = _model(tiny)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TrainingError, match="loss is nan"):
        train_step(model, opts, batch, torch.full((len(schema.tasks),), math.nan),
                   schema.num_domains)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_trainer_fp8_activations_stay_near_fp32(tiny, tmp_path):
    """``train.fp8_activations=true`` through the trainer: same losses as fp32 within the
    bench tolerance."""
    losses = {}
    for flag in ("false", "true"):
        cfg = apply_overrides(recipe("tiny"), ["train.max_steps=4", "train.log_every=1",
                                               f"train.fp8_activations={flag}"])
        cfg.train.progress = False
        train(cfg, tiny, tmp_path / flag)
        losses[flag] = [json.loads(x)["loss"]
                        for x in (tmp_path / flag / "metrics.jsonl").read_text().splitlines()]
    assert len(losses["true"]) == 4
    assert max(abs(a - b) / b for a, b in zip(losses["true"], losses["false"])) < FP8_TOL
