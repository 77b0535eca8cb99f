"""Dense parameters: FSDP2 ``fully_shard`` block by block on a 1-D (FSDP) or 2-D (HSDP) mesh.

Units, children before parents and the root last (each unit all-gathers its own parameters just
before use and frees them after, so peak memory is about one block)::

    interformer.interaction.connections[i]   cross-layer connections           forward
    interformer.interaction.layers[i]        Wukong layers                      forward
    interformer.towers[k].layers[i]          sequence (pyramid) tower layers    forward
    interformer.towers[k]                    tower embeddings, pooling          embed, first_tokens
    interformer.cross[i].seq[k]              sequence summaries                 forward
    interformer.cross[i]                     non-sequence summary (LCE, gate)   summarize_x
    heads, dense_arch, history_counts                                           forward
    root (GEM)                               domain embedding + anything left   forward

Towers and cross arches are called through methods rather than ``forward``; those methods are
registered with ``register_fsdp_forward_method`` so FSDP gathers before them too. TorchRec-sharded
tables are ``ignored_params``: TorchRec owns them (and their fused optimizer).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from opengem.parallel.dims import ParallelConfig


def fsdp_units(model: nn.Module) -> list[tuple[nn.Module, tuple[str, ...]]]:
    """(module, extra forward methods) in the order ``fully_shard`` must see them (leaves first)."""
    units: list[tuple[nn.Module, tuple[str, ...]]] = []
    inter = model.interformer
    units += [(m, ()) for m in inter.interaction.connections]
    units += [(m, ()) for m in inter.interaction.layers]
    for tower in inter.towers:
        units += [(m, ()) for m in tower.layers]
        units.append((tower, ("embed", "first_tokens")))
    for cross in inter.cross:
        units += [(m, ()) for m in cross.seq]
        units.append((cross, ("summarize_x",)))
    units.append((model.heads, ()))
    units += [(m, ()) for m in (model.dense_arch, getattr(model, "history_counts", None))
              if m is not None]
    return [(m, meths) for m, meths in units if any(True for _ in m.parameters())]


def mixed_precision_policy(cfg: ParallelConfig, root: bool = False) -> MixedPrecisionPolicy:
    """bf16 compute and all-gathers, fp32 gradient reduction; the root returns fp32 logits."""
    if cfg.mixed_precision != "bf16":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                output_dtype=torch.float32 if root else None)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig,
               ignored_params: set[nn.Parameter] | None = None) -> nn.Module:
    """``fully_shard`` every unit of ``fsdp_units``, then the root. Parameters may be on meta."""
    mp = mixed_precision_policy(cfg)
    units = fsdp_units(model)
    for module, methods in units:
        fully_shard(module, mesh=mesh, mp_policy=mp)
        for name in methods:
            register_fsdp_forward_method(module, name)
    fully_shard(model, mesh=mesh, mp_policy=mixed_precision_policy(cfg, root=True),
                ignored_params=ignored_params or set())
    return model
