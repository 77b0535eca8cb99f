"""The training state (``opengem.train.state.TrainState``): its restore puts a fresh run where a
checkpoint left off; and the components the loop asks after each step (checkpoint cadence, a
stream's day end, preemption) are due exactly when the loop used to act."""

import os
import signal

import pytest
import torch

from opengem.checkpoint import CheckpointError, latest_checkpoint
from opengem.config import apply_overrides
from opengem.data.loader import ShardLoader
from opengem.features.schema import FeatureSchema
from opengem.model.build import build_gem, materialize
from opengem.parallel.launch import DistInfo
from opengem.recipes import recipe
from opengem.train.continual import DayStream
from opengem.train.hooks import CheckpointEvery, EvalHook
from opengem.train.optim import Schedule, build_optimizers
from opengem.train.resume import SigtermFlag
from opengem.train.state import TrainState
from opengem.train.trainer import loop_parts, params_sha256, train

CPU = DistInfo(0, 1, 0, 1, torch.device("cpu"), None)


def _cfg(*overrides):
    cfg = apply_overrides(recipe("tiny"), ["train.log_every=2", "optim.warmup_steps=2", *overrides])
    cfg.train.progress = False
    return cfg


def made_up_ne(model, **_):
    return {"all/click": {"ne": 0.9}}


def _state(cfg, data, run) -> TrainState:
    """A fresh state, as the trainer builds one before a resume (untrained weights, loader at 0)."""
    schema = FeatureSchema.load(data)
    rates = [0.5] * len(schema.task_names)
    model = materialize(build_gem(schema, cfg.model), "cpu", cfg.train.seed + 1, rates)
    dense, sparse = build_optimizers(model.dense_parameters(), model.sparse_parameters(), cfg.optim)
    optimizers = [o for o in (dense, sparse) if o is not None]
    d = cfg.data
    loader = ShardLoader(data, d.train_split, d.batch_size, schema, seed=d.seed)
    return TrainState(cfg, schema, run, CPU, model, optimizers, None, loader,
                      Schedule(optimizers, 10, cfg.optim), 10, *loop_parts(cfg))


def test_restore_puts_a_fresh_state_where_the_checkpoint_left_off(tiny, tmp_path):
    cfg = _cfg("train.max_steps=6", "train.stop_at=3", "train.eval_at=[2]")
    paused = train(cfg, tiny, tmp_path / "run", evaluator=made_up_ne)  # last checkpoint: step 3
    ckpt = latest_checkpoint(tmp_path / "run")
    saved = torch.load(ckpt / "trainer_state-rank0.pt", weights_only=False)
    s = _state(cfg, tiny, tmp_path / "run")
    s.evals = EvalHook(cfg.train, made_up_ne, {}, CPU)
    torch.manual_seed(12345)  # an RNG state the restore must replace
    state = s.restore(ckpt)
    assert state["loader"] == saved["loader"]  # returned for the caller to place
    assert (s.step, s.examples, s.start_examples) == (3, paused["examples"], paused["examples"])
    assert torch.equal(torch.get_rng_state(), saved["rng"])
    assert (s.evals.state.last_step, s.evals.state.evaluations) == (2, 1)
    assert cfg.train.ema_decay > 0 and s.ema.state() == {k: saved[k] for k in ("ema",)}
    with s.ema.applied():  # the served (EMA) weights, which final.json fingerprints
        assert params_sha256(s.model) == paused["params_sha256"]
    assert all(o.state_dict()["state"] for o in s.optimizers)  # the moments came back too


def test_restore_refuses_a_checkpoint_of_another_model(tiny, tmp_path):
    train(_cfg("train.max_steps=2"), tiny, tmp_path / "run")
    other = _state(_cfg("model.embedding_dim=8"), tiny, tmp_path / "run")
    with pytest.raises(CheckpointError, match="another model"):
        other.restore(latest_checkpoint(tmp_path / "run"))


def test_checkpoint_cadence_is_due_every_nth_step(tiny, tmp_path):
    s = _state(_cfg(), tiny, tmp_path)

    def due_steps(every: int) -> list[int]:
        out = []
        for step in range(1, 8):
            s.step = step
            out += [step] if CheckpointEvery(every).due(s) else []
        return out

    assert due_steps(0) == [] and due_steps(3) == [3, 6]
    assert _state(_cfg("train.ckpt_every=4"), tiny, tmp_path).checkpoints == CheckpointEvery(4)


def test_day_end_is_due_after_a_days_last_step_of_a_stream_only(tiny, tmp_path):
    s = _state(_cfg(), tiny, tmp_path)
    assert not s.day_end.due(s)  # a plain run publishes at its end, not daily
    s.loader = DayStream(tiny, [0], 64, s.schema, [], "train")
    assert not s.day_end.due(s)
    s.loader.day_ended = True
    assert s.day_end.due(s)


def test_preemption_is_due_once_sigterm_arrived(tiny, tmp_path):
    s = _state(_cfg(), tiny, tmp_path)
    before = signal.getsignal(signal.SIGTERM)
    with s.sigterm as flag:
        assert flag is s.sigterm and not flag.due(s)
        os.kill(os.getpid(), signal.SIGTERM)  # handled: sets the flag, the process goes on
        assert flag.due(s)
    assert signal.getsignal(signal.SIGTERM) is before
    assert SigtermFlag().due(s) is False
