"""An exponential moving average (EMA) of the dense parameters: the weights a run is judged and
served by.

With ``train.ema_decay = d > 0`` the trainer keeps a shadow ``s ← d·s + (1 − d)·θ`` of every dense
parameter after each optimizer step (the first step copies θ). Held-out evaluations, the best
checkpoint, every checkpoint's ``model`` and published snapshots hold the shadow, so every later
stage (evaluate, recalibrate, export, serve, distil) reads the averaged weights without knowing
about it; the training weights travel beside them in the checkpoint (``EMA_KEY``) so that a resumed
run is the run it would have been. Why: on little data the last steps' noise spreads the logits and
the average removes part of it (docs/experiments.md, "EMA of the dense weights"). Only the dense
parameters: the tables are updated row by row (row-wise Adagrad), an average over them would touch
every row at every step, and averaging them too did no better. Under FSDP2 each rank averages its
own shards (the parameters are DTensors; the arithmetic runs on their local tensors), so the shadow
costs one copy of this rank's dense shard.

``train.ema_warmup``: the decay at update t is min(d, (1 + t) / (10 + t)), TensorFlow's
``ExponentialMovingAverage(num_updates=…)`` rule. Why an option: with a fixed d the shadow after t
updates still holds d^t of the first step's weights (0.99^100 = 37 %), so a short run, or any
evaluation in a run's first 1/(1 − d) steps, judges weights close to the initial ones; warmed up,
the shadow follows the weights early and averages like the fixed d once (1 + t)/(10 + t) > d.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from opengem.checkpoint import load_tensors

# the DCP entry of the training weights while ``model`` holds the shadow
EMA_KEY = "ema_training_weights"


def _local(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


class DenseEMA:
    """The shadow of ``params`` (name → dense parameter) at ``decay``; ``decay = 0`` is off
    (a no-op)."""

    def __init__(self, params: dict[str, torch.nn.Parameter], decay: float,
                 warmup: bool = False):
        self.params, self.decay, self.warmup = params, decay, warmup
        self.shadow: list[torch.Tensor] | None = None
        self.updates = 0
        # the training weights while the shadow is applied
        self._training: list[torch.Tensor] | None = None

    @property
    def on(self) -> bool:
        return self.decay > 0

    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer step."""
        if not self.on:
            return
        live = list(self.params.values())
        if self.shadow is None:
            self.shadow = [p.detach().clone() for p in live]
        else:
            torch._foreach_lerp_(_local(self.shadow), _local(live),
                                 1.0 - self.decay_at(self.updates))
        self.updates += 1

    def decay_at(self, t: int) -> float:
        """The decay of update ``t`` (0-based; update 0 copies the weights)."""
        return min(self.decay, (1.0 + t) / (10.0 + t)) if self.warmup else self.decay

    @contextlib.contextmanager
    def applied(self):
        """The shadow in the parameters inside the block, the training weights back after it."""
        # off, no step yet, or already applied
        if self.shadow is None or self._training is not None:
            yield
            return
        live = list(self.params.values())
        with torch.no_grad():
            self._training = [p.detach().clone() for p in live]
            torch._foreach_copy_(_local(live), _local(self.shadow))
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(_local(live), _local(self._training))
            self._training = None

    def state(self) -> dict:
        """For the trainer state: present only when a checkpoint's ``model`` holds a shadow."""
        return (
            {"ema": {"decay": self.decay, "updates": self.updates}}
            if self.shadow is not None
            else {}
        )

    def extra(self) -> dict | None:
        """The training weights to save beside ``model``, inside ``applied()`` only."""
        if self._training is None:
            return None
        return {EMA_KEY: dict(zip(self.params, self._training, strict=True))}

    @torch.no_grad()
    def resume(self, ckpt: Path, trainer_state: dict) -> None:
        """After ``load_checkpoint`` put the checkpoint's ``model`` (a shadow, if it was written
        with one) in the parameters: that becomes the shadow and the saved training weights go back
        in. A checkpoint without a shadow starts a fresh one at the next step; with ``decay = 0``
        the shadow is dropped and training goes on from the training weights."""
        saved = trainer_state.get("ema")
        if saved is None:
            self.shadow, self.updates = None, 0
            return
        live = list(self.params.values())
        shadow = [p.detach().clone() for p in live]
        # in place: the parameters hold the training weights
        load_tensors(ckpt, {EMA_KEY: dict(self.params)})
        self.shadow, self.updates = (shadow, int(saved["updates"])) if self.on else (None, 0)


def dense_ema(model: torch.nn.Module, decay: float, warmup: bool = False) -> DenseEMA:
    """The EMA of ``model``'s dense parameters (``model.dense_parameters()``), keyed by
    their names."""
    dense = {id(p) for p in model.dense_parameters()}
    return DenseEMA({n: p for n, p in model.named_parameters() if id(p) in dense}, decay, warmup)
