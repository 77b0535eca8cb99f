"""Held-out evaluation while training: when it runs, what it records, early stopping, the
best model.

The evaluation package sits above training (it loads trained runs), so the trainer never imports it:
its caller hands ``train`` an ``Evaluator``, any callable that scores a model on held-out data. The
CLI passes the default one::

    from opengem.evaluation.evaluate import held_out_evaluator
    train(cfg, data, run, evaluator=held_out_evaluator(data, cfg.train.eval_split))

and ``train.*`` keys turn it on (all off by default; then the loop is exactly the one
without hooks)::

    eval_every=N                after every N-th step
    eval_each_epoch=true        after the step that finishes an epoch (on every rank)
    eval_at=[s1,s2,…]           after these steps (the race's schedule); 0: before the first step
                                (the untrained model, whose heads predict the training base rates)
    eval_metric=all/click:ne    what the next two follow: ne, logloss lower is better; auc, gauc, captured higher
    early_stop_patience=P       stop after P evaluations in a row without a better value
    keep_best=true              RUN/checkpoints/best: the model of the best evaluation so far
                                (``checkpoint.best_checkpoint``; ``load_run_model(run, best=True)``)

Whenever evaluations are on, the run's last step is evaluated too (unless it just was). Each one
appends a ``metrics.jsonl`` line (and TensorBoard scalars, ``observe.RunLog``)::

    {"step": S, "examples": …, "train_s": …, "eval_s": …, "eval_split": "valid",
     "eval": {"all/click": {"ne": …, "auc": …}, …}, "eval_metric": {"value", "best", "best_step", "since_best"}}

``train_s`` is this process's loop time up to step S with every evaluation (and best-checkpoint
save) taken out; the logged examples/s leave them out too. The evaluation runs under a forked RNG
state and in eval mode, so turning it on changes no trained parameter. Best value and step,
evaluations since it and the last evaluated step are part of the checkpoint's trainer state: a
resumed run stops where an uninterrupted one would, and an early-stopped run stays stopped.
Distributed: each rank scores its share of the split (the evaluator reduces the metrics across
ranks) and rank 0's value of the metric is broadcast, so every rank takes the same decision after
the same step.

The loop's other "after this step?" questions are asked the same way, of a component's ``due``:
``CheckpointEvery`` (here), ``continual.DayEnd`` (a stream's snapshot) and ``resume.SigtermFlag``
(preemption).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from opengem.config import ConfigError, TrainConfig
from opengem.parallel.launch import DistInfo, comm_device, min_over_ranks
from opengem.train.state import TrainState


class Evaluator(Protocol):
    def __call__(self, model: torch.nn.Module, *, base_rates: dict[str, float], rank: int,
                 world_size: int, device: torch.device) -> Mapping[str, Mapping[str, float]]:
        """Metrics per slice (``{"all/click": {"ne": …, "auc": …}, …}``) of ``model`` (in eval mode)
        on held-out data: this rank's share, reduced so every rank returns the same. A collective
        when distributed: every rank calls it after the same step."""


@dataclass
class EvalState:
    """What a checkpoint keeps of the evaluations (``trainer_state["evals"]``)."""

    best: float | None = None
    best_step: int | None = None
    since_best: int = 0  # evaluations since the best one
    last_step: int = -1  # the step last evaluated
    epoch: int = 0  # the epoch every rank's loader had reached at the last step
    evaluations: int = 0


class EvalHook:
    """The trainer's evaluation schedule and early-stopping state for one run."""

    def __init__(self, cfg: TrainConfig, evaluator: Evaluator, base_rates: dict[str, float],
                 info: DistInfo):
        self.cfg, self.evaluator, self.base_rates, self.info = cfg, evaluator, base_rates, info
        self.slice, self.metric, self.higher = cfg.eval_goal()
        self.at = set(cfg.eval_at)
        self.state = EvalState()

    @property
    def stopped(self) -> bool:
        return (
            bool(self.cfg.early_stop_patience)
            and self.state.since_best >= self.cfg.early_stop_patience
        )

    def due(self, step: int, loader_epoch: int) -> bool:
        """Whether to evaluate after ``step``; ``loader_epoch`` is this rank's loader epoch after it
        (a collective with ``eval_each_epoch``: an epoch ends when every rank has finished it)."""
        every = bool(self.cfg.eval_every) and step % self.cfg.eval_every == 0
        epoch_done = False
        if self.cfg.eval_each_epoch:
            epoch = min_over_ranks(loader_epoch, self.info.backend is not None)
            epoch_done, self.state.epoch = epoch > self.state.epoch, max(epoch, self.state.epoch)
        return every or epoch_done or step in self.at

    def due_at_start(self) -> bool:
        """``eval_at`` names step 0 and nothing has been evaluated yet: score the model before it
        trains. Why: its heads start at the training base rates, so on data with no learnable signal
        (Open Bandit's ~200 training clicks) ``keep_best`` can keep the base rate instead of a model
        that fits noise, and every model in a comparison gets the same fallback."""
        return 0 in self.at and self.state.last_step < 0

    def due_at_end(self, step: int) -> bool:
        return step != self.state.last_step

    def evaluate(self, model: torch.nn.Module, step: int) -> tuple[dict, bool]:
        """Score ``model`` after ``step``: (the metrics.jsonl fields, whether it is the best
        so far)."""
        device = self.info.device
        with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
            model.eval()
            try:
                metrics = self.evaluator(model, base_rates=self.base_rates, rank=self.info.rank,
                                         world_size=self.info.world_size, device=device)
            finally:
                model.train()
        value = self._broadcast(self._value(metrics))
        s = self.state
        improved = math.isfinite(value) and (s.best is None
                                             or (value > s.best if self.higher else value < s.best))
        if improved:
            s.best, s.best_step, s.since_best = value, step, 0
        else:
            s.since_best += 1
        s.last_step, s.evaluations = step, s.evaluations + 1
        record = {"eval_split": self.cfg.eval_split,
                  "eval": {k: dict(v) for k, v in metrics.items()},
                  "eval_metric": {"name": self.cfg.eval_metric, "value": value, "best": s.best,
                                  "best_step": s.best_step, "since_best": s.since_best}}
        return record, improved

    def _value(self, metrics: Mapping[str, Mapping[str, float]]) -> float:
        if self.slice not in metrics or self.metric not in metrics[self.slice]:
            raise ConfigError(f"train.eval_metric={self.cfg.eval_metric}: the evaluation has "
                              f"no such value (slices: {sorted(metrics)})")
        v = metrics[self.slice][self.metric]
        return float(v) if v is not None else math.nan

    def _broadcast(self, value: float) -> float:
        if self.info.backend is None:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=comm_device())
        dist.broadcast(t, src=0)
        return float(t.item())

    def summary(self) -> dict:
        """final.json's ``evaluation`` block."""
        return {"metric": self.cfg.eval_metric, "split": self.cfg.eval_split, **asdict(self.state),
                "stopped_early": self.stopped}

    def state_dict(self) -> dict:
        return asdict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = EvalState(**state)


@dataclass(frozen=True)
class CheckpointEvery:
    """The checkpoint cadence: after every ``every``-th step (``train.ckpt_every``; 0: never, only
    the final checkpoint and a preemption's)."""

    every: int

    def due(self, state: TrainState) -> bool:
        return bool(self.every) and state.step % self.every == 0
