"""Activation checkpointing per block: Wukong layers and sequence-tower layers recompute
in backward.

Those are the blocks whose activations grow with batch × tokens; the rest (summaries, heads) is
small. Applied before ``torch.compile`` and before ``fully_shard`` (torchtitan's order), so the
compiled graph contains the checkpointed region and FSDP wraps the checkpointed block.

Two modes (``parallel.activation_checkpoint``):

- ``full``: a block keeps only its input; backward re-runs the whole block.
- ``selective``: op-level selective checkpointing (``torch.utils.checkpoint``'s
  ``create_selective_checkpoint_contexts``): the outputs of the compute-bound ops (matmuls and
  attention, ``SAVE_OPS``) are kept, everything cheap and memory-bound (norms, activations,
  elementwise, gathers) is recomputed. Backward then redoes no matmul, so it costs little time and
  frees the activations of the elementwise tail of each block. torchtitan's "op" policy also
  recomputes every second matmul; at our block sizes the matmul outputs are a minority of the bytes,
  so we keep them all (measured with ``opengem bench --levers eager,ac,sac``).

``checkpoint_wrapper`` inserts ``_checkpoint_wrapped_module`` into parameter names; ``state_dict``,
``get_state_dict`` and DCP strip it, so checkpoints keep the plain model's keys.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from opengem.parallel.dims import ParallelConfig

_aten = torch.ops.aten
# Compute-bound ops whose outputs ``selective`` keeps (a name missing from this torch build
# is skipped).
SAVE_OPS = frozenset(
    getattr(_aten, name).default for name in (
        "mm", "addmm", "bmm", "baddbmm",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    ) if hasattr(_aten, name)
)


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_blocks(model: nn.Module) -> list[tuple[nn.ModuleList, int]]:
    """(list, index) of every block to recompute: Wukong layers, then each tower's layers."""
    inter = model.interformer
    lists = [inter.interaction.layers] + [tower.layers for tower in inter.towers]
    return [(lst, i) for lst in lists for i in range(len(lst))]


def apply_activation_checkpoint(model: nn.Module, cfg: ParallelConfig) -> nn.Module:
    if cfg.activation_checkpoint == "none":
        return model
    kwargs = {}
    if cfg.activation_checkpoint == "selective":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts,
                                                 _save_matmuls)
    for lst, i in checkpoint_blocks(model):
        lst[i] = checkpoint_wrapper(lst[i], preserve_rng_state=False, **kwargs)
    return model
