"""One training step of a GEM-style model, shared by every loop that trains one.

The trainer's loop calls ``train_step``; the benchmarks (``instruments``) call it too, or, where
they time the phases of a step, its pieces, so that what they measure is the trainer's step::

    schedule.set(step)                         the caller's: before the forward (the fused CPU table
                                               kernel takes the lr it applies in backward there)
    loss, table = forward_loss(...)            forward (FP8 saved activations when asked), masked BCE
                                               scaled so the mean over ranks is the global-batch loss
    value = loss_value(loss)                   that mean as a float; TrainingError when not finite
    backward(loss, optimizers)                 every optimizer's gradients cleared, then backward
    update(optimizers, dense_params, clip)     dense gradients' norm clipped, every optimizer stepped

The order is the trainer's and must stay so: its runs are bit-exact across resumes and releases.
"""

from __future__ import annotations

import contextlib
import math

import torch

from opengem.data.batch import Batch
from opengem.ops.fp8 import fp8_saved_activations
from opengem.parallel import train_step as dist_step
from opengem.train.losses import global_masked_bce


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. the loss became NaN); the message says where."""


def batch_loss(logits_BT: torch.Tensor, batch: Batch, task_w_T: torch.Tensor,
               num_domains: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss scaled to the global batch, this rank's per-(domain, task) loss table [G, T])."""
    return global_masked_bce(logits_BT, batch.labels, batch.label_mask, batch.weights, task_w_T,
                             batch.domain, num_domains)


def forward_loss(model: torch.nn.Module, batch: Batch, task_w_T: torch.Tensor, num_domains: int,
                 fp8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    with fp8_saved_activations(model) if fp8 else contextlib.nullcontext():
        logits = model(batch)
    return batch_loss(logits, batch, task_w_T, num_domains)


def loss_value(loss: torch.Tensor) -> float:
    """The mean of ``loss`` over ranks (a collective when distributed); TrainingError when
    not finite."""
    value = dist_step.global_mean(loss).item()
    if not math.isfinite(value):
        raise TrainingError(f"loss is {value}")
    return value


def backward(loss: torch.Tensor, optimizers: list) -> None:
    for o in optimizers:
        o.zero_grad(set_to_none=True)
    loss.backward()


def update(optimizers: list, dense_params: list, grad_clip: float) -> None:
    if grad_clip:
        dist_step.clip_grad_norm_(dense_params, grad_clip)
    for o in optimizers:
        o.step()  # the table optimizer's step also averages the 2-D table copies when due


def train_step(model: torch.nn.Module, optimizers: list, batch: Batch, task_w_T: torch.Tensor,
               num_domains: int, *, grad_clip: float = 0.0, fp8: bool = False,
               dense_params: list | None = None) -> tuple[float, torch.Tensor]:
    """Forward, loss, backward, clip, every optimizer (set the lr first). Returns (loss of the
    global batch, this rank's per-(domain, task) loss table). ``dense_params`` defaults to
    the model's."""
    loss, table = forward_loss(model, batch, task_w_T, num_domains, fp8)
    value = loss_value(loss)  # before backward: a NaN step leaves the parameters as they were
    backward(loss, optimizers)
    update(optimizers, list(model.dense_parameters()) if dense_params is None else dense_params,
           grad_clip)
    return value, table
