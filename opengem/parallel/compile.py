"""``torch.compile`` per block, before ``fully_shard``.

Compiling the FSDP2 root silently falls back to eager (a graph break on FSDP's hooks); compiling
each block in place (``module.compile()``, parameter names unchanged) gives whole-block graphs.
Blocks: Wukong layers, sequence-tower layers, sequence summaries, heads, the dense arch — every
module whose ``forward`` does the dense math. The jagged parts (pooling over a row's events,
the recent window) stay eager: their shapes change every batch.
"""

from __future__ import annotations

from torch import nn

from opengem.parallel.dims import ParallelConfig


def compile_blocks(model: nn.Module) -> list[nn.Module]:
    inter = model.interformer
    blocks: list[nn.Module] = list(inter.interaction.layers)
    for tower in inter.towers:
        blocks += list(tower.layers)
    for cross in inter.cross:
        blocks += list(cross.seq)
    blocks.append(model.heads)
    if model.dense_arch is not None:
        blocks.append(model.dense_arch)
    return blocks


def apply_compile(model: nn.Module, cfg: ParallelConfig) -> nn.Module:
    if not cfg.compile:
        return model
    for block in compile_blocks(model):
        # jagged batches change shapes every step: one dynamic graph, no recompiles
        block.compile(dynamic=True)
    return model
