"""What a training step needs in the distributed case, beyond the single-process loop.

Per step (the trainer's order; only the marked calls differ from one process)::

    schedule.set(step)                          sets lr on AdamW and on FusedSparseOptimizer; must
                                                 come before the forward (the fused CPU kernel takes
                                                 the lr it applies in backward at forward time)
    logits = model(local_batch)                 each rank: its own rows
    loss, table = global_masked_bce(...)   (*)  so that the mean over ranks is the global-batch loss
    dense_opt.zero_grad(); sparse_opt.zero_grad()   (the second has no gradients to clear)
    loss.backward()                             FSDP reduce-scatters dense grads (mean over ranks);
                                                 tables update in place (fused)
    clip_grad_norm_(dense_params, max_norm)  (*) norm over the DTensor shards
    dense_opt.step(); sparse_opt.step()         the second counts steps and averages the 2-D
                                                 table copies every ``replica_sync_every`` steps
    global_mean(loss)                        (*) for logging

``FusedSparseOptimizer`` is the sparse optimizer of that loop (``SparseSharding.optimizer``).
``gather_full_state_dict`` / ``gather_full_optim_state`` return plain full tensors (tests, the
run summary's parameter hash); they hold every full table at once, so use them on small models.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.distributed.tensor import DTensor

from opengem.parallel.launch import comm_device
from opengem.parallel.sparse import SparseOptimizerSpec, SparseSharding, TableInfo
from opengem.train.losses import masked_bce


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def global_masked_bce(logits_BT, labels_BT, mask_BT, weights_B, task_weights_T, domain_B=None, num_domains=1):
    """``masked_bce`` scaled so that the mean over ranks equals ``masked_bce`` of the global batch.

    Each task's loss is a mean over its labelled rows; when ranks hold different numbers of them the
    mean of per-rank means is not the global mean. Using the global denominators (one all-reduce of
    T numbers, no gradient) and multiplying by the world size fixes that: FSDP and TorchRec both
    average gradients over ranks. The returned per-(domain, task) table is this rank's.
    """
    W = _world()
    if W == 1:
        return masked_bce(logits_BT, labels_BT, mask_BT, weights_B, task_weights_T, domain_B, num_domains)
    with torch.no_grad():
        den_local = (mask_BT.to(logits_BT.dtype) * weights_B.unsqueeze(1)).sum(0)
        den_global = den_local.clone()
        dist.all_reduce(den_global)
        scale = W * den_local.clamp(min=1e-12) / den_global.clamp(min=1e-12)
    return masked_bce(logits_BT, labels_BT, mask_BT, weights_B, task_weights_T * scale, domain_B, num_domains)


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
    """A full plain CPU copy of a DTensor, a ShardedTensor or a tensor (collective for the first two)."""
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
            out[tuple(slice(a, a + n) for a, n in zip(s.metadata.shard_offsets, s.metadata.shard_sizes))] = s.tensor
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


def gather_full_optim_state(model: nn.Module, optimizers: list, sharding_pg=None) -> dict[str, torch.Tensor]:
    """Optimizer state flattened to ``state.<param fqn>.<key>`` → full tensor (and param-group values)."""
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


# ---------------------------------------------------------------------------------- optimizer view
class FusedSparseOptimizer(torch.optim.Optimizer):
    """The fused table optimizer as the trainer and ``get_state_dict`` see it.

    - ``param_groups``: one group over the table weights (model FQNs), with the keys of the
      single-process optimizer. Setting ``lr`` there (the trainer's ``Schedule`` does, before the
      forward) pushes it into the kernels at once: the CPU kernel takes the learning rate at
      *forward* time for the update it applies in backward, so pushing it in ``zero_grad`` (after
      the forward) would apply the previous step's lr (measured: the first update 2× too large
      under a 2-step warm-up).
    - ``state[param]`` = ``{"step": tensor, "sum": [rows, 1]}`` (row-wise Adagrad), where ``sum``
      is a ShardedTensor over the kernel's own accumulator (no copy) for table-, row- and
      table-row-wise tables, and a width-weighted mean refreshed by ``state_dict()`` for
      column-wise tables. ``load_state_dict`` writes loaded values back into the kernels.
    """

    def __init__(self, model: nn.Module, sharding: SparseSharding, spec: SparseOptimizerSpec,
                 device: torch.device | None = None):
        named = dict(model.named_parameters())
        params = [named[t.fqn] for t in sharding.tables]
        super().__init__(params, spec.defaults())
        device = device or torch.device("cpu")
        self.spec, self.sharding = spec, sharding
        self._fused = [m.fused_optimizer for m in sharding.modules.values()]
        self.param_groups[0] = _LrGroup(self.param_groups[0], self._push_lr)
        self._device = device
        self._cw: dict[str, tuple[TableInfo, list]] = {}  # column-wise tables: fqn → (table, pieces)
        self._fused_state: dict[str, dict] = {}
        self._steps = 0
        if spec.kind == "rowwise_adagrad":  # plain SGD (no momentum) has no state at all
            for t, p in zip(sharding.tables, params):
                self.state[p] = {"step": torch.tensor(0.0), "sum": self._sum_view(t)}

    # -------------------------------------------------------------- lr
    def _push_lr(self) -> None:
        lr = self.param_groups[0]["lr"]
        for fo in self._fused:
            for g in fo.param_groups:
                g["lr"] = lr
            fo.zero_grad()  # torchrec: sets the kernels' learning rate (no gradients to clear)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._push_lr()

    @torch.no_grad()
    def step(self, closure=None):
        """The update already happened in backward: count the step, push the lr, 2-D sync when due."""
        self._push_lr()
        self._steps += 1
        for st in self.state.values():
            st["step"] += 1
        self.sharding.after_step(self._steps)

    def reset_steps(self) -> None:
        self._steps = 0
        for st in self.state.values():
            st["step"].zero_()

    # -------------------------------------------------------------- state ↔ kernels
    def _momentum_pieces(self, t: TableInfo) -> list[tuple[int, torch.Tensor]]:
        """(offset in torchrec's momentum1 layout, local 1-D accumulator view) for table ``t``."""
        if t.module not in self._fused_state:  # one state_dict per collection (they are views)
            self._fused_state[t.module] = self.sharding.modules[t.module].fused_optimizer.state_dict()["state"]
        st = self._fused_state[t.module].get(t.fqn[len(t.module) + 1:], {}).get(f"{t.name}.momentum1")
        if st is None:
            return []
        if isinstance(st, ShardedTensor):
            return [(s.metadata.shard_offsets[0], s.tensor) for s in st.local_shards()]
        local = st.to_local()
        return [(o[0], s) for s, o in zip(local.local_shards(), local.local_offsets())]

    def _weight_metadata(self, t: TableInfo) -> list[ShardMetadata]:
        ps = self.sharding.plan.plan[t.module][t.name]  # type: ignore[index]
        return list(ps.sharding_spec.shards)  # type: ignore[union-attr]

    def _sum_view(self, t: TableInfo) -> ShardedTensor:
        shards_md = self._weight_metadata(t)
        column_wise = any(md.shard_offsets[1] for md in shards_md)
        rank = dist.get_rank()
        gmd, local = [], []
        pieces = dict(self._momentum_pieces(t))
        col_order = sorted(md.shard_offsets[1] for md in shards_md)
        for md in shards_md:
            r0, c0 = md.shard_offsets
            n = md.shard_sizes[0]
            if c0:
                continue  # column shards > 0 fold into the first one (see _sync_cw)
            smd = ShardMetadata([r0, 0], [n, 1], md.placement)
            gmd.append(smd)
            if md.placement.rank() == rank:
                if column_wise:
                    local.append(Shard(torch.zeros(n, 1, device=self._device), smd))
                else:
                    local.append(Shard(pieces[r0].view(n, 1), smd))
        if column_wise:
            self._cw[t.fqn] = (t, [(col_order.index(md.shard_offsets[1]) * t.rows, md)
                                   for md in shards_md if md.placement.rank() == rank])
        meta = ShardedTensorMetadata(gmd, torch.Size([t.rows, 1]), TensorProperties(dtype=torch.float32))
        pg = self.sharding.sharding_pg if self.sharding.dims.sparse_2d else None
        return ShardedTensor._init_from_local_shards_and_global_metadata(local, meta, process_group=pg)

    @torch.no_grad()
    def _sync_cw(self, to_kernels: bool) -> None:
        """Column-wise tables: kernels → canonical sum (width-weighted mean) or back (a collective)."""
        pg = self.sharding.sharding_pg if self.sharding.dims.sparse_2d else None
        params = dict(zip([t.fqn for t in self.sharding.tables], self.param_groups[0]["params"]))
        for fqn in sorted(self._cw):
            t, mine = self._cw[fqn]
            pieces = dict(self._momentum_pieces(t))
            canon = self.state[params[fqn]]["sum"]
            buf = torch.zeros(t.rows, device=self._device)
            if to_kernels:
                for s in canon.local_shards():
                    buf += s.tensor.view(-1)
                dist.all_reduce(buf, group=pg)
                for off, md in mine:
                    pieces[off].copy_(buf)
            else:
                for off, md in mine:
                    buf += pieces[off] * (md.shard_sizes[1] / t.dim)
                dist.all_reduce(buf, group=pg)
                for s in canon.local_shards():
                    s.tensor.copy_(buf.view(-1, 1))

    def state_dict(self):
        if self._cw:
            self._sync_cw(to_kernels=False)
        return super().state_dict()

    @torch.no_grad()
    def load_state_dict(self, state_dict) -> None:
        own = {id(p): self.state[p] for p in self.param_groups[0]["params"]}
        loaded_groups = state_dict["param_groups"]
        if len(loaded_groups) != 1 or len(loaded_groups[0]["params"]) != len(own):
            raise ValueError(f"sparse optimizer state has {len(loaded_groups)} groups / "
                             f"{[len(g['params']) for g in loaded_groups]} tables; expected 1 group of {len(own)}")
        for k, v in loaded_groups[0].items():
            if k != "params":
                self.param_groups[0][k] = v
        for idx, p in zip(loaded_groups[0]["params"], self.param_groups[0]["params"]):
            src = state_dict["state"].get(idx, {})
            dst = self.state[p]
            for key, val in src.items():
                _copy_into(dst[key], val)
        if self._cw:
            self._sync_cw(to_kernels=True)
        steps = [int(st["step"]) for st in self.state.values() if "step" in st]
        self._steps = max(steps, default=self._steps)
        self._push_lr()


class _LrGroup(dict):
    """A param group that pushes ``lr`` into the fused kernels whenever it is set."""

    def __init__(self, group: dict, push):
        super().__init__(group)
        self._push = push

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        if key == "lr":
            self._push()


def _copy_into(dst, src) -> None:
    if isinstance(dst, ShardedTensor):
        if src is dst:
            return
        if not isinstance(src, ShardedTensor):
            raise TypeError(f"cannot load a {type(src).__name__} into a sharded optimizer state")
        for d, s in zip(dst.local_shards(), src.local_shards()):
            if d.tensor.data_ptr() != s.tensor.data_ptr():
                d.tensor.copy_(s.tensor)
        return
    if src is not dst:
        dst.copy_(src)
