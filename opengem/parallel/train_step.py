"""What a training step needs in the distributed case, beyond the single-process loop.

Per step (the trainer's order; only the marked calls differ from one process)::

    schedule.set(step)                          sets lr on AdamW and on FusedSparseOptimizer; must
                                                 come before the forward (the fused CPU kernel takes
                                                 the lr it applies in backward at forward time)
    logits = model(local_batch)                 each rank: its own rows
    loss, table = global_masked_bce(...)   (*)  so that the mean over ranks is the global-batch loss
                                                 (``opengem.train.losses``: a loss, not a sharding API)
    dense_opt.zero_grad(); sparse_opt.zero_grad()   (the second has no gradients to clear)
    loss.backward()                             FSDP reduce-scatters dense grads (mean over ranks);
                                                 tables update in place (fused)
    clip_grad_norm_(dense_params, max_norm)  (*) norm over the DTensor shards
    dense_opt.step(); sparse_opt.step()         the second counts steps and averages the 2-D
                                                 table copies every ``replica_sync_every`` steps
    global_mean(loss)                        (*) for logging

``sparse.FusedSparseOptimizer`` is the sparse optimizer of that loop (``SparseSharding.optimizer``).
``gather_full_state_dict`` / ``gather_full_optim_state`` return plain full tensors (tests, the
run summary's parameter hash); they hold every full table at once, so use them on small models.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

from opengem.parallel.launch import comm_device


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def global_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean of a scalar over ranks (detached), for logging."""
    x = x.detach().clone()
    if _world() > 1:
        dist.all_reduce(x, op=dist.ReduceOp.AVG)
    return x


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for FSDP2 (DTensor) gradients: the norm is reduced over
    the mesh before clipping; the returned norm is a plain tensor, identical on every rank."""
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


# ---------------------------------------------------------------------------------- gathering
def _full(value, group=None) -> torch.Tensor:
    """A full plain CPU copy of a DTensor, a ShardedTensor or a tensor (collective for the
    first two)."""
    if isinstance(value, DTensor):
        local = value.to_local()
        if hasattr(local, "local_shards"):
            out = torch.zeros(value.shape, dtype=value.dtype, device=comm_device())
            for s, o in zip(local.local_shards(), local.local_offsets()):
                out[tuple(slice(a, a + n) for a, n in zip(o, s.shape))] = s
            dist.all_reduce(out, group=group)
            return out.cpu()
        return value.full_tensor().cpu()
    if isinstance(value, ShardedTensor):
        out = torch.zeros(value.size(), dtype=value.dtype, device=comm_device())
        for s in value.local_shards():
            out[
                tuple(
                    slice(a, a + n)
                    for a, n in zip(s.metadata.shard_offsets, s.metadata.shard_sizes)
                )
            ] = s.tensor
        dist.all_reduce(out, group=value._process_group)
        return out.cpu()
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def gather_full_state_dict(model: nn.Module, sharding_pg=None) -> dict[str, torch.Tensor]:
    """Every parameter as a full plain tensor, on every rank, keyed like the single-process model.

    ``sharding_pg``: the sparse sharding group (``SparseSharding.sharding_pg``) when tables are
    DTensors over local shards (2-D); shards are disjoint within it, so a sum assembles them."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    sd = get_model_state_dict(model)
    return {k: _full(v, sharding_pg) for k, v in sorted(sd.items())}


def gather_full_optim_state(model: nn.Module, optimizers: list,
                            sharding_pg=None) -> dict[str, torch.Tensor]:
    """Optimizer state flattened to ``state.<param fqn>.<key>`` → full tensor (and
    param-group values)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    _, osd = get_state_dict(model, [o for o in optimizers if o is not None])
    out = {}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            out[f"state.{fqn}.{k}"] = _full(v, sharding_pg)
    for i, g in enumerate(osd["param_groups"]):
        for k, v in g.items():
            if k != "params":
                out[f"group.{i}.{k}"] = v
    return dict(sorted(out.items()))
