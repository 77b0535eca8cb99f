"""train.ema_decay: the EMA of the dense weights is what is evaluated, checkpointed as ``model`` and
served; training itself is unchanged, and a resumed run is the uninterrupted one."""

import json

import pytest
import torch

from opengem.checkpoint import latest_checkpoint, load_tensors
from opengem.config import ConfigError, apply_overrides
from opengem.recipes import recipe
from opengem.run import load_run_model
from opengem.train.ema import EMA_KEY, DenseEMA, dense_ema
from opengem.train.trainer import params_sha256, train


def _cfg(*overrides):
    cfg = apply_overrides(recipe("tiny"), ["optim.warmup_steps=2", "train.max_steps=6", *overrides])
    cfg.train.progress = False
    return cfg


def test_the_shadow_is_the_exponential_average_and_applied_swaps_back():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    ema = DenseEMA({"w": w}, decay=0.75)
    assert ema.state() == {} and ema.extra() is None
    with ema.applied():  # no step yet: nothing to apply
        assert w.tolist() == [1.0, 2.0]
    expected = None
    for value in ([1.0, 2.0], [3.0, 2.0], [5.0, -2.0]):
        with torch.no_grad():
            w.copy_(torch.tensor(value))
        ema.update()
        x = torch.tensor(value)
        expected = x if expected is None else 0.75 * expected + 0.25 * x  # the first step copies
    assert torch.allclose(ema.shadow[0], expected) and ema.state() == {
        "ema": {"decay": 0.75, "updates": 3}
    }
    with ema.applied():
        assert torch.allclose(w, expected)
        assert ema.extra()[EMA_KEY]["w"].tolist() == [5.0, -2.0]
        with ema.applied():  # nested: still the shadow, restored only by the outer block
            pass
        assert torch.allclose(w, expected)
    assert w.tolist() == [5.0, -2.0] and w.requires_grad and ema.extra() is None
    off = DenseEMA({"w": w}, decay=0.0)
    off.update()
    assert off.shadow is None and off.state() == {}


def test_the_warmed_up_shadow_follows_the_weights_early_then_decays_at_d():
    """``train.ema_warmup``: update t's decay is min(d, (1 + t)/(10 + t)); the shadow is the
    average those decays give, much nearer the weights after a few steps than a fixed d's."""
    w = torch.nn.Parameter(torch.zeros(1))
    warm, fixed = DenseEMA({"w": w}, 0.99, warmup=True), DenseEMA({"w": w}, 0.99)
    assert [round(warm.decay_at(t), 4) for t in (1, 10, 100, 1000)] == [0.1818, 0.55, 0.9182, 0.99]
    assert fixed.decay_at(1) == 0.99
    expected = None
    for t in range(20):
        with torch.no_grad():
            w.fill_(float(t > 0))  # the weights jump from 0 to 1 after the first step
        warm.update()
        fixed.update()
        d = min(0.99, (1 + t) / (10 + t))
        expected = torch.zeros(1) if expected is None else d * expected + (1 - d) * w.detach()
    torch.testing.assert_close(warm.shadow[0], expected)
    assert warm.shadow[0].item() > 0.6 and fixed.shadow[0].item() < 0.2


def test_the_config_refuses_a_decay_outside_zero_to_one():
    for bad in ("1.0", "-0.1"):
        with pytest.raises(ConfigError, match="ema_decay"):
            _cfg(f"train.ema_decay={bad}")


def test_training_is_unchanged_and_the_run_serves_the_average(tiny, tmp_path):
    plain = train(_cfg("train.ema_decay=0"), tiny, tmp_path / "plain")  # the tiny recipe has one on
    final = train(_cfg("train.ema_decay=0.5"), tiny, tmp_path / "ema")
    served, _, _ = load_run_model(tmp_path / "ema", recalibrated=False)
    assert params_sha256(served) == final["params_sha256"] != plain["params_sha256"]
    ckpt = latest_checkpoint(tmp_path / "ema")
    state = torch.load(ckpt / "trainer_state-rank0.pt", weights_only=False)
    assert state["ema"] == {"decay": 0.5, "updates": 6}
    # The training weights beside the average are exactly the plain run's.
    trained = dense_ema(served, 0.5).params
    load_tensors(ckpt, {EMA_KEY: trained})
    assert params_sha256(served) == plain["params_sha256"]
    # Only dense parameters are averaged: the tables are the plain run's, the dense weights moved.
    plain_model, _, _ = load_run_model(tmp_path / "plain", recalibrated=False)
    averaged, _, _ = load_run_model(tmp_path / "ema", recalibrated=False)
    for p, q in zip(plain_model.sparse_parameters(), averaged.sparse_parameters(), strict=True):
        assert torch.equal(p, q)
    moved = [not torch.equal(p, q) for p,
             q in zip(plain_model.dense_parameters(), averaged.dense_parameters(),
                                                   strict=True)]
    assert sum(moved) > len(moved) // 2


def test_a_resumed_run_is_the_uninterrupted_one(tiny, tmp_path):
    seen = {}

    def fingerprint(run):
        def evaluate(model, **_):
            seen.setdefault(run, []).append(params_sha256(model))
            return {"all/click": {"ne": 0.5}}
        return evaluate

    cfg = ["train.ema_decay=0.6", "train.eval_every=2", "train.keep_best=true"]
    ref = train(_cfg(*cfg), tiny, tmp_path / "ref", evaluator=fingerprint("ref"))
    paused = train(_cfg(*cfg, "train.stop_at=3"), tiny, tmp_path / "run",
                   evaluator=fingerprint("run"))
    assert paused["steps"] == 3
    resumed = train(_cfg(*cfg), tiny, tmp_path / "run", resume=True, evaluator=fingerprint("run"))
    assert (
        resumed["params_sha256"] == ref["params_sha256"] and resumed["steps"] == ref["steps"] == 6
    )
    assert seen["run"] == seen["ref"]  # every evaluation scored the same averaged weights
    # The best checkpoint holds the averaged weights of its step (the first evaluation: NE
    # never improves).
    best, _, _ = load_run_model(tmp_path / "ref", recalibrated=False, best=True)
    assert params_sha256(best) == seen["ref"][0]
    assert (
        json.loads((tmp_path / "ref" / "final.json").read_text())["params_sha256"]
        == ref["params_sha256"]
    )


def test_turning_the_average_on_or_off_at_a_resume(tiny, tmp_path):
    plain = train(_cfg("train.ema_decay=0"), tiny, tmp_path / "plain")
    # Written with an average, resumed without: training goes on from the training weights, not
    # the average.
    train(_cfg("train.ema_decay=0.5", "train.stop_at=3"), tiny, tmp_path / "off")
    off = train(_cfg("train.ema_decay=0"), tiny, tmp_path / "off", resume=True)
    assert off["params_sha256"] == plain["params_sha256"]
    assert "ema" not in torch.load(latest_checkpoint(tmp_path / "off") / "trainer_state-rank0.pt",
                                   weights_only=False)
    # Written without, resumed with: a fresh average from the next step on.
    train(_cfg("train.ema_decay=0", "train.stop_at=3"), tiny, tmp_path / "on")
    on = train(_cfg("train.ema_decay=0.5"), tiny, tmp_path / "on", resume=True)
    state = torch.load(latest_checkpoint(tmp_path / "on") / "trainer_state-rank0.pt",
                       weights_only=False)
    assert (
        state["ema"] == {"decay": 0.5, "updates": 3}
        and on["params_sha256"] != plain["params_sha256"]
    )
    trained, _, _ = load_run_model(tmp_path / "on", recalibrated=False)
    load_tensors(latest_checkpoint(tmp_path / "on"), {EMA_KEY: dense_ema(trained, 0.5).params})
    assert params_sha256(trained) == plain["params_sha256"]
