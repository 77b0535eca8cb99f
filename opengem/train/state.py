"""The state of one training run: its parts, its counters, and the restore from a checkpoint.

``opengem.train.trainer`` builds a ``TrainState`` and runs its loop over it; ``resume``
(``--resume``) and ``continual`` (a stream's legs) put it where a checkpoint left off with
``restore``, then place the data each in its own way (same world size, another one, or a stream's
days).

What a checkpoint's trainer state holds (``trainer_state()``, one file per rank)::

    schema, model        the identity a resume must match (``identity()``)
    step, examples       the counters
    loader               the data position (a ``ShardLoader``'s or a ``DayStream``'s)
    rng                  torch's CPU generator: dropout and sampling go on as uninterrupted
    evals, ema           when on: the evaluations' state, the EMA's update count
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from opengem.checkpoint import load_checkpoint
from opengem.config import Config
from opengem.data.loader import ShardLoader
from opengem.features.schema import FeatureSchema
from opengem.parallel.launch import DistInfo
from opengem.train.ema import DenseEMA, dense_ema
from opengem.train.optim import Schedule
from opengem.train.soft_labels import SoftLabels, soft_labels


class Due(Protocol):
    """A part of the loop that says, after each step, whether it acts now: the checkpoint cadence
    (``hooks.CheckpointEvery``), a stream's day end (``continual.DayEnd``), pre-emption
    (``resume.SigtermFlag``). They read the state, so they sit above this module, not in it."""

    def due(self, state: TrainState) -> bool: ...


class Positioned(Protocol):
    """What a checkpoint saves of a loader (a ``ShardLoader`` or a stream's ``DayStream``) or of the
    held-out evaluations (``hooks.EvalHook``)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class TrainState:
    """One training run's parts and counters (one process: ``sparse`` is None).

    What the run is: ``cfg``, ``schema``, ``run`` (its directory), ``info`` (this rank's place).

    What trains: ``model``; ``optimizers`` (dense, then the tables'); ``sparse``, the TorchRec
    sharding (``opengem.parallel.SparseSharding``) or None; ``loader``, a ``ShardLoader`` or a
    stream's ``DayStream``; ``schedule``, the lr factor by step.

    Where it is (what ``restore`` sets): ``total``, the planned steps (the schedule's horizon);
    ``step`` and ``examples`` done; ``start_examples``, the examples when this process started (its
    examples/s leave out those of earlier processes); ``resumed``, final.json's ``resharded`` record
    when a resume re-derived the data position on another world size.

    What the loop asks after each step, each deciding when it is due: ``evals`` (held-out
    evaluation, ``hooks.EvalHook``) or None; ``day_end`` (a stream's daily snapshot,
    ``continual.DayEnd``); ``checkpoints`` (``hooks.CheckpointEvery``, from ``train.ckpt_every``);
    ``sigterm`` (preemption, ``resume.SigtermFlag``; entered around the loop and the final save).

    Extras: ``eval_s``, seconds this process spent in evaluations (not training time);
    ``publish_end``, publish the final model as a snapshot (a plain run; a stream publishes daily);
    ``downsampling``, RUN/downsampling.json's record when negatives are down-sampled; ``ema``, the
    averaged dense weights (``train.ema_decay``; off: a no-op); ``soft``, the teachers of the labels
    (``train.soft_label_runs``) or None.
    """

    cfg: Config
    schema: FeatureSchema
    run: Path
    info: DistInfo
    model: torch.nn.Module
    optimizers: list
    sparse: object | None
    loader: ShardLoader | Positioned
    schedule: Schedule
    total: int
    checkpoints: Due
    day_end: Due
    sigterm: Due
    step: int = 0
    examples: int = 0
    start_examples: int = 0
    resumed: dict = field(default_factory=dict)
    evals: Positioned | None = None
    eval_s: float = 0.0
    publish_end: bool = False
    downsampling: dict | None = None
    ema: DenseEMA = field(init=False)
    soft: SoftLabels | None = field(init=False)

    def __post_init__(self) -> None:
        self.ema = dense_ema(self.model, self.cfg.train.ema_decay, self.cfg.train.ema_warmup)
        t = self.cfg.train
        self.soft = soft_labels(t.soft_label_runs, t.soft_label_weight, self.schema,
                                self.info.device)

    @property
    def distributed(self) -> bool:
        return self.sparse is not None

    def identity(self) -> dict:
        """What a checkpoint must match to be resumed by this run (``load_checkpoint`` checks)."""
        return {"schema": self.schema.fingerprint(), "model": asdict(self.cfg.model)}

    def trainer_state(self) -> dict:
        """This rank's part of a checkpoint besides the weights and the optimizers."""
        evals = {"evals": self.evals.state_dict()} if self.evals is not None else {}
        return {**self.identity(), "step": self.step, "examples": self.examples,
                "loader": self.loader.state_dict(), "rng": torch.get_rng_state(), **evals,
                **self.ema.state()}

    def restore(self, ckpt: Path) -> dict:
        """Load ``ckpt`` into the model, optimizers, EMA, counters, RNG and evaluations; returns its
        trainer state, whose ``loader`` position the caller places (a resume and a stream's leg
        place it differently). A checkpoint of another schema or model is refused."""
        state = load_checkpoint(ckpt, self.model, self.optimizers, expect=self.identity())
        self.ema.resume(ckpt, state)  # after the load: it swaps the saved training weights back in
        self.step, self.examples = state["step"], state["examples"]
        self.start_examples = self.examples
        torch.set_rng_state(state["rng"])
        if self.evals is not None and "evals" in state:  # early stopping goes on where it was
            self.evals.load_state_dict(state["evals"])
        return state
