"""Activation checkpointing per block: Wukong layers and sequence-tower layers recompute in backward.

Those are the blocks whose activations grow with batch × tokens; the rest (summaries, heads) is
small. Applied before ``torch.compile`` and before ``fully_shard`` (torchtitan's order), so the
compiled graph contains the checkpointed region and FSDP wraps the checkpointed block.

``checkpoint_wrapper`` inserts ``_checkpoint_wrapped_module`` into parameter names; ``state_dict``,
``get_state_dict`` and DCP strip it, so checkpoints keep the plain model's keys.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from opengem.parallel.dims import ParallelConfig


def checkpoint_blocks(model: nn.Module) -> list[tuple[nn.ModuleList, int]]:
    """(list, index) of every block to recompute: Wukong layers, then each tower's layers."""
    inter = model.interformer
    lists = [inter.interaction.layers] + [tower.layers for tower in inter.towers]
    return [(lst, i) for lst in lists for i in range(len(lst))]


def apply_activation_checkpoint(model: nn.Module, cfg: ParallelConfig) -> nn.Module:
    if cfg.activation_checkpoint == "none":
        return model
    for lst, i in checkpoint_blocks(model):
        lst[i] = checkpoint_wrapper(lst[i], preserve_rng_state=False)
    return model
