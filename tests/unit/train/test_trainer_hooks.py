"""The trainer's held-out evaluation hooks: periodic evaluation lines, early stopping (and its
resume), the best checkpoint; with the hooks on, training itself is unchanged."""

import json
import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from opengem.checkpoint import CheckpointError, best_checkpoint
from opengem.config import ConfigError, apply_overrides
from opengem.evaluation.evaluate import held_out_evaluator
from opengem.parallel.launch import DistInfo
from opengem.recipes import recipe
from opengem.run import load_run_model
from opengem.train.hooks import EvalHook
from opengem.train.trainer import params_sha256, train


def _cfg(*overrides):
    cfg = apply_overrides(recipe("tiny"), ["train.log_every=2", "optim.warmup_steps=2", *overrides])
    cfg.train.progress = False
    return cfg


def _lines(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


class Scripted:
    """An evaluator whose all/click NE is the next of ``values``; it notes the
    model's fingerprint."""

    def __init__(self, values):
        self.values, self.seen = list(values), []

    def __call__(self, model, *, base_rates, rank, world_size, device):
        assert not model.training and (rank, world_size) == (0, 1) and base_rates
        self.seen.append(params_sha256(model))
        return {"all/click": {"ne": self.values[len(self.seen) - 1], "auc": 0.5}}


def fingerprint_ne(model, **_):
    """A made-up NE in [0.5, 1) that is a function of the parameters: the same in a resumed run."""
    return {"all/click": {"ne": 0.5 + int(params_sha256(model)[:6], 16) / 2**25}}


def test_periodic_evaluation_writes_lines_and_leaves_training_unchanged(tiny, tmp_path):
    plain = train(_cfg("train.max_steps=6"), tiny, tmp_path / "plain")
    cfg = _cfg("train.max_steps=6", "train.eval_every=4", "train.eval_at=[3]")
    final = train(cfg, tiny, tmp_path / "evals", evaluator=held_out_evaluator(tiny, "valid"))
    lines = _lines(tmp_path / "evals")
    evals = [x for x in lines if "eval" in x]
    assert [x["step"] for x in evals] == [3, 4, 6]  # eval_at, eval_every, and the last step
    assert [x["step"] for x in lines if "loss" in x] == [2, 4, 6] and not any(
        "loss" in x for x in evals
    )
    for x in evals:
        assert (
            x["eval_split"] == "valid"
            and 0 < x["eval"]["all/click"]["ne"] < 1.5
            and x["eval_s"] > 0
        )
        assert x["examples"] == x["step"] * cfg.data.batch_size
        assert (
            x["eval_metric"]["name"] == "all/click:ne"
            and x["eval_metric"]["value"] == x["eval"]["all/click"]["ne"]
        )
    train_s = [x["train_s"] for x in evals]
    assert (
        train_s == sorted(train_s)
        and train_s[-1] < final["wall_s"] - final["evaluation"]["eval_s"] + 1e-6
    )
    assert final["evaluation"]["evaluations"] == 3 and not final["evaluation"]["stopped_early"]
    tb = EventAccumulator(str(tmp_path / "evals" / "tensorboard"))
    tb.Reload()
    assert [e.step for e in tb.Scalars("eval/all/click/ne")] == [
        3,
        4,
        6,
    ] and "train_s" in tb.Tags()["scalars"]
    # Evaluation runs in eval mode under a forked RNG: the trained parameters are those of the
    # plain run.
    assert (
        final["params_sha256"] == plain["params_sha256"] and final["steps"] == plain["steps"] == 6
    )


def test_early_stopping_after_patience_and_the_best_checkpoint(tiny, tmp_path):
    # best after step 2, then 2 evaluations without a better one
    ev = Scripted([0.9, 0.8, 0.85, 0.86, 0.5])
    cfg = _cfg("train.max_steps=20", "train.eval_every=1", "train.early_stop_patience=2",
               "train.keep_best=true")
    final = train(cfg, tiny, tmp_path / "run", evaluator=ev)
    # stopped after the 4th step; the 5th value never read
    assert final["steps"] == 4 and len(ev.seen) == 4
    e = final["evaluation"]
    assert (e["best"], e["best_step"], e["since_best"], e["stopped_early"]) == (0.8, 2, 2, True)
    assert [x["eval_metric"]["since_best"] for x in _lines(tmp_path / "run") if "eval" in x] == [
        0,
        0,
        1,
        2,
    ]
    best = best_checkpoint(tmp_path / "run")
    assert (
        best is not None
        and torch.load(best / "trainer_state-rank0.pt", weights_only=False)["step"] == 2
    )
    model, _, _ = load_run_model(tmp_path / "run", recalibrated=False, best=True)
    # the model scored at step 2, not the last one
    assert params_sha256(model) == ev.seen[1] != ev.seen[3]
    assert (
        params_sha256(load_run_model(tmp_path / "run", recalibrated=False)[0])
        == final["params_sha256"]
    )


def test_step_zero_scores_the_untrained_model_and_keep_best_can_keep_it(tiny, tmp_path):
    # Nothing after training beats the untrained model: the best checkpoint is the model at init,
    # whose heads predict the training base rates (the fallback for data without learnable signal).
    ev = Scripted([0.7, 0.8, 0.9, 0.95])
    cfg = _cfg("train.max_steps=6", "train.eval_at=[0,2]", "train.eval_every=4",
               "train.keep_best=true", "train.early_stop_patience=2", "train.ema_decay=0.9")
    final = train(cfg, tiny, tmp_path / "run", evaluator=ev)
    # stopped: patience 2
    assert [x["step"] for x in _lines(tmp_path / "run") if "eval" in x] == [0, 2, 4]
    assert (
        final["steps"] == 4
        and final["evaluation"]["best_step"] == 0
        and final["evaluation"]["stopped_early"]
    )
    first = _lines(tmp_path / "run")[0]
    # scored before any batch
    assert (first["step"], first["examples"]) == (0, 0) and "loss" not in first
    best = best_checkpoint(tmp_path / "run")
    assert torch.load(best / "trainer_state-rank0.pt", weights_only=False)["step"] == 0
    model, _, _ = load_run_model(tmp_path / "run", recalibrated=False, best=True)
    assert params_sha256(model) == ev.seen[0] != ev.seen[1] and ev.seen[0] != final["params_sha256"]
    with pytest.raises(ConfigError, match="eval_at steps >= 0"):
        _cfg("train.eval_at=[-1]")


def test_which_way_is_better_follows_the_metric():
    values = iter([0.9, 0.8, math.nan, 0.85, 0.91])

    def auc(model, **_):
        return {"all/click": {"auc": next(values)}}

    hook = EvalHook(_cfg("train.eval_every=1", "train.eval_metric=all/click:auc").train, auc, {},
                    DistInfo(0, 1, 0, 1, torch.device("cpu"), None))
    toy = torch.nn.Linear(2, 1)
    assert [hook.evaluate(toy, s)[1] for s in (1, 2, 3, 4, 5)] == [True, False, False, False, True]
    assert (hook.state.best, hook.state.best_step, hook.state.since_best) == (
        0.91,
        5,
        0,
    ) and toy.training


def test_early_stopping_resumes_where_an_uninterrupted_run_stops(tiny, tmp_path):
    cfg = ["train.max_steps=16", "train.eval_every=1", "train.early_stop_patience=2",
           "train.keep_best=true"]
    ref = train(_cfg(*cfg), tiny, tmp_path / "ref", evaluator=fingerprint_ne)
    # a stop needs 1 + patience evaluations
    assert ref["evaluation"]["stopped_early"] and 3 <= ref["steps"] < 16
    paused = train(_cfg(*cfg, "train.stop_at=2"), tiny, tmp_path / "run", evaluator=fingerprint_ne)
    assert paused["steps"] == 2 and not paused["evaluation"]["stopped_early"]
    resumed = train(_cfg(*cfg), tiny, tmp_path / "run", resume=True, evaluator=fingerprint_ne)
    for key in ("steps", "examples", "params_sha256"):
        assert resumed[key] == ref[key], key
    assert {
        k: resumed["evaluation"][k] for k in ("best", "best_step", "since_best", "evaluations")
    } == {k: ref["evaluation"][k] for k in ("best", "best_step", "since_best", "evaluations")}

    def evals(run):
        return [(x["step"], x["eval_metric"]["value"]) for x in _lines(run) if "eval" in x]

    assert evals(tmp_path / "run") == evals(tmp_path / "ref")
    # A stopped run stays stopped: resuming it trains no further step.
    again = train(_cfg(*cfg), tiny, tmp_path / "run", resume=True, evaluator=fingerprint_ne)
    assert again["steps"] == ref["steps"] and again["params_sha256"] == ref["params_sha256"]
    assert evals(tmp_path / "run") == evals(tmp_path / "ref")


def test_evaluation_after_each_epoch(tiny, tmp_path):
    ev = Scripted([0.9] * 10)
    cfg = _cfg("train.epochs=2", "data.batch_size=512", "train.eval_each_epoch=true")
    final = train(cfg, tiny, tmp_path / "run", evaluator=ev)
    rows_per_epoch = final["examples"] // 2
    steps = [x["step"] for x in _lines(tmp_path / "run") if "eval" in x]
    # the step that ends epoch 1, then the last
    assert steps == [math.ceil(rows_per_epoch / 512), final["steps"]]


def test_hooks_need_an_evaluator_and_an_evaluation_to_follow(tiny, tmp_path):
    with pytest.raises(ConfigError, match="evaluator"):
        train(_cfg("train.eval_every=2"), tiny, tmp_path / "run")
    with pytest.raises(ConfigError, match="follow held-out evaluations"):
        _cfg("train.early_stop_patience=2")
    with pytest.raises(ConfigError, match="eval_metric"):
        _cfg("train.eval_every=2", "train.eval_metric=all/click:calibration")
    with pytest.raises(ConfigError, match="no such value"):
        train(_cfg("train.max_steps=2", "train.eval_every=1", "train.eval_metric=all/klick:ne"),
              tiny, tmp_path / "bad", evaluator=Scripted([0.9] * 3))
    train(_cfg("train.max_steps=1"), tiny, tmp_path / "plain")
    with pytest.raises(CheckpointError, match="keep_best"):
        load_run_model(tmp_path / "plain", best=True)


def test_early_stopping_refuses_the_reported_split():
    """Choosing the stopping step on the split a run reports on would tune on it."""
    with pytest.raises(ConfigError, match="reports on"):
        apply_overrides(recipe("tiny"),
                        ["train.eval_every=5", "train.early_stop_patience=2",
                         "train.eval_split=test"])
    with pytest.raises(ConfigError, match="reports on"):
        apply_overrides(recipe("tiny"),
                        ["train.eval_every=5", "train.keep_best=true", "train.eval_split=test"])
    # only watching is fine
    apply_overrides(recipe("tiny"), ["train.eval_every=5", "train.eval_split=test"])
