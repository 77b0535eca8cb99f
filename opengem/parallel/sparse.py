"""Embedding tables: TorchRec planner + sharders, 1-D or 2-D, sparse optimizer fused into backward.

``apply_sparse_sharding(model, dims, cfg, optim)`` replaces every ``EmbeddingBagCollection`` and
``EmbeddingCollection`` of ``model`` in place by its TorchRec sharded module and returns a
``SparseSharding`` (plan, readable table, optimizer, replica sync). Model FQNs do not change.

- 1-D (``sparse_group`` = world): one plan over all ranks, ``ShardingEnv`` on the world group.
- 2-D (``sparse_group`` < world): the planner plans for ``sparse_group`` ranks (on the world
  group, so every rank gets the same plan), each sharding group gets that plan with its ranks
  remapped, and copies are averaged over the replica groups every ``replica_sync_every`` steps.
  Each copy updates from its own group's rows in between, so this equals one process only for
  plain SGD averaged every step; with row-wise Adagrad it is DMPCollection's approximation
  (averaged accumulators are not the accumulator of the averaged gradient).
  On CUDA that is TorchRec's own ``DMPCollection``; it asserts CUDA, so on CPU the same thing is
  composed here from ``ShardingEnv2D`` + remapped plan + replica all-reduce.
  Both paths sit behind this one function.

The update is fused into backward (FBGEMM TBE; on CPU TorchRec offers only the ``fused`` kernel
for sharded tables), so there is no sparse ``.grad`` and no separate optimizer step.
``FusedSparseOptimizer`` (in ``train_step``) is what the trainer and checkpoints see: it pushes the
scheduled learning rate into the kernels and presents the state exactly as the single-process
``torchrec.optim.RowWiseAdagrad`` does (``step`` and ``sum`` [rows, 1] per table under the table's
FQN), so DCP checkpoints move freely between world sizes, including 1.

Row-wise Adagrad, fused (``EXACT_ROWWISE_ADAGRAD``) vs ``torchrec.optim.RowWiseAdagrad``: both do
``sum += mean_d(g²); w -= lr · g / (sqrt(sum) + eps)``, eps outside the square root, no weight
decay, lr not decayed, zero initial accumulator; they differ only in float rounding (the kernel
computes ``g · (lr / (sqrt(sum) + eps))`` with a sequential sum of squares). One real difference:
under column-wise sharding every column shard keeps its own accumulator (the mean over *its*
columns), so the update is no longer the single-process one. Checkpoints store the width-weighted
mean of those accumulators, which is exactly the single-process accumulator for the same gradients;
loading into column-wise shards gives every shard that value.

Two torchrec behaviours are compensated: gradients of the sharded tables are divided by the
sharding-group size — with every rank's loss the mean over its own equal slice, that
makes the update the one for the mean over the group's rows, as FSDP does for dense parameters;
and sharding on CPU throws away module weights (the TBE re-initialises them) — ``init_tables``
writes every local shard from ``table_init_slice`` afterwards.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.distributed.remote_device import _remote_device
from torchrec import EmbeddingBagCollection, EmbeddingCollection, KeyedTensor
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.types import PlannerError
from torchrec.distributed.types import (
    EnumerableShardingSpec,
    ShardingEnv,
    ShardingEnv2D,
    ShardingPlan,
)
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from opengem.parallel.dims import ParallelConfig, ParallelDims

log = logging.getLogger(__name__)

_SHARDABLE = (EmbeddingBagCollection, EmbeddingCollection)


class SparseShardingError(RuntimeError):
    """A table cannot be placed as asked; the message names the table and the constraint."""


class CpuEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """TorchRec offers row-wise and table-row-wise EBC sharding only when the device is CUDA; on CPU
    they work and are exact (tested against one process), so offer the CUDA list everywhere."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return super().sharding_types("cuda")


# ---------------------------------------------------------------------------------- optimizer
@dataclass
class SparseOptimizerSpec:
    """The fused table optimizer. ``rowwise_adagrad`` matches the trainer's single-process
    ``torchrec.optim.RowWiseAdagrad``; ``sgd`` (plain SGD) exists for exactness checks (its replica
    average in 2-D is the single-process update, Adagrad's is not)."""

    kind: str = "rowwise_adagrad"
    lr: float = 0.05
    eps: float = 1e-8

    @classmethod
    def from_optim(cls, optim) -> SparseOptimizerSpec:
        """From ``opengem.config.OptimConfig`` (sparse_lr, sparse_eps)."""
        return cls("rowwise_adagrad", optim.sparse_lr, optim.sparse_eps)

    def optimizer_class(self) -> tuple[type, dict]:
        if self.kind == "rowwise_adagrad":
            return RowWiseAdagrad, {"lr": self.lr, "eps": self.eps}
        if self.kind == "sgd":
            return torch.optim.SGD, {"lr": self.lr}
        raise ValueError(f"sparse optimizer must be rowwise_adagrad|sgd, got {self.kind!r}")

    def defaults(self) -> dict:
        """param_group keys of the matching single-process optimizer (so state dicts line up)."""
        if self.kind == "rowwise_adagrad":
            return {"lr": self.lr, "lr_decay": 0.0, "eps": self.eps, "weight_decay": 0.0,
                    "initial_accumulator_value": 0.0, "maximize": False}
        return dict(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=self.lr).defaults)


# ---------------------------------------------------------------------------------- planning
@dataclass
class TableInfo:
    name: str  # torchrec table name, e.g. t_user_id
    fqn: str  # weight FQN in the model, e.g. sparse_arch.ebc.embedding_bags.t_user_id.weight
    module: str  # FQN of the (sharded) collection
    rows: int
    dim: int
    pooled: bool  # EmbeddingBagCollection (True) or EmbeddingCollection (False)


def find_tables(model: nn.Module) -> list[TableInfo]:
    """Every table of every (unsharded) embedding collection, in ``model.named_modules()`` order."""
    out = []
    for path, m in model.named_modules():
        if isinstance(m, EmbeddingBagCollection):
            out += [TableInfo(c.name, f"{path}.embedding_bags.{c.name}.weight", path,
                              c.num_embeddings, c.embedding_dim, True)
                    for c in m.embedding_bag_configs()]
        elif isinstance(m, EmbeddingCollection):
            out += [TableInfo(c.name, f"{path}.embeddings.{c.name}.weight", path, c.num_embeddings,
                              c.embedding_dim, False) for c in m.embedding_configs()]
    return out


def _requested(tables: list[TableInfo], cfg: ParallelConfig) -> dict[str, str]:
    """table → sharding type ("auto" = the planner's choice), with the errors a user can fix."""
    names = {t.name for t in tables}
    unknown = sorted(set(cfg.sharding) - names)
    if unknown:
        raise SparseShardingError(f"parallel.sharding names unknown tables {unknown}; "
                                  f"tables: {sorted(names)}")
    out = {}
    for t in tables:
        kind = cfg.sharding.get(t.name, cfg.default_sharding)
        if kind == "table_row_wise" and not t.pooled:
            if t.name in cfg.sharding:
                raise SparseShardingError(
                    f"table {t.name}: table_row_wise is not available for sequence tables "
                    f"(TorchRec EmbeddingCollectionSharder offers table_wise, "
                    f"row_wise, column_wise); "
                    f"choose one of those for {t.name}")
            # the default applies to pooled tables; sequence tables get its row-wise form
            kind = "row_wise"
        if kind in ("column_wise",) and cfg.column_wise_dim and t.dim % cfg.column_wise_dim:
            raise SparseShardingError(
                f"table {t.name}: column_wise_dim {cfg.column_wise_dim} does not divide its "
                f"dim {t.dim}")
        out[t.name] = kind
    return out


def _constraints(requested: dict[str, str], cfg: ParallelConfig) -> dict[str, ParameterConstraints]:
    out = {}
    for name, kind in requested.items():
        out[name] = ParameterConstraints(
            sharding_types=None if kind == "auto" else [kind],
            compute_kernels=["fused"],
            min_partition=cfg.column_wise_dim or None,
        )
    return out


def _plan(model: nn.Module, dims: ParallelDims, cfg: ParallelConfig, sharders: list,
          device: torch.device, requested: dict[str, str]) -> ShardingPlan:
    local = min(dims.sparse_group, int(_local_world_size()))
    topology = Topology(world_size=dims.sparse_group, local_world_size=local,
                        compute_device=device.type)
    planner = EmbeddingShardingPlanner(topology=topology, constraints=_constraints(requested, cfg))
    try:
        # Planned on the world group even in 2-D: a sharding subgroup fails with
        # "Global rank 0 is not part of group"; every rank gets the same plan.
        return planner.collective_plan(model, sharders, dist.group.WORLD)
    except (RuntimeError, PlannerError) as e:
        msg = str(e)
        bad = [n for n in requested if f" {n}." in msg or f" {n} " in msg or msg.endswith(n)]
        which = ", ".join(f"{n} ({requested[n]})" for n in bad) or "one or more tables"
        raise SparseShardingError(
            f"TorchRec could not place {which} on {dims.sparse_group} {device.type} rank(s) "
            f"with the fused kernel: {msg.splitlines()[0]}") from e


def _local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))


def _remap_plan(plan: ShardingPlan, group: list[int], device: torch.device) -> None:
    """Plan ranks 0..G-1 → this sharding group's global ranks (what DMPCollection does in place)."""
    local = _local_world_size()
    for module_plan in plan.plan.values():
        for ps in module_plan.values():  # type: ignore[union-attr]
            ps.ranks = [group[r] for r in ps.ranks] if ps.ranks is not None else None
            spec = ps.sharding_spec
            if isinstance(spec, EnumerableShardingSpec):
                for shard in spec.shards:
                    r = group[shard.placement.rank()]
                    where = f"cuda:{r % local}" if device.type == "cuda" else device.type
                    shard.placement = _remote_device(f"rank:{r}/{where}")


# ---------------------------------------------------------------------------------- result
@dataclass
class SparseSharding:
    """What ``apply_sparse_sharding`` did: the plan, the groups, the optimizer view,
    replica sync."""

    tables: list[TableInfo]
    requested: dict[str, str]  # what the config asked per table (the plan says what it got)
    plan: ShardingPlan
    dims: ParallelDims
    sync_every: int
    modules: dict[str, nn.Module]  # collection FQN → sharded module
    sharding_pg: dist.ProcessGroup | None
    replica_pg: dist.ProcessGroup | None
    optimizer: torch.optim.Optimizer | None = None  # FusedSparseOptimizer (below)
    dmp_collection: object | None = None  # TorchRec DMPCollection (CUDA path only)

    def rows(self) -> list[tuple[str, str, str, str, str]]:
        """(table, rows×dim, sharding type, ranks, shards) per table, for ``describe``."""
        out = []
        for t in self.tables:
            ps = self.plan.plan[t.module][t.name]  # type: ignore[index]
            shards = ""
            if isinstance(ps.sharding_spec, EnumerableShardingSpec):
                shards = " ".join(
                    f"r{s.placement.rank()}:[{s.shard_offsets[0]}+{s.shard_sizes[0]},{s.shard_offsets[1]}+{s.shard_sizes[1]}]"
                    for s in ps.sharding_spec.shards)
            asked = self.requested[t.name]
            kind = ps.sharding_type + ("" if asked in ("auto", ps.sharding_type)
                                       else f" (asked {asked})")
            out.append((t.name, f"{t.rows}×{t.dim}", kind, ",".join(map(str, ps.ranks or [])),
                        shards))
        return out

    def describe(self) -> str:
        """The plan as a table: table → sharding type → ranks → shards ([row0+rows, col0+cols])."""
        head = ("table", "rows×dim", "sharding", "ranks", "shards (rank:[row0+rows,col0+cols])")
        rows = [head] + self.rows()
        w = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = [f"sparse plan — {self.dims.describe()}"]
        if self.dims.sparse_2d:
            groups = self.dims.sparse_groups()
            mine = groups[dist.get_rank() // self.dims.sparse_group]
            lines.append(f"(ranks of this rank's sharding group {mine}; every group in {groups} "
                         f"holds the same layout, copies averaged every {self.sync_every} steps)")
        for i, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w[j]) for j, c in enumerate(r)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * x for x in w))
        return "\n".join(lines)

    # -------------------------------------------------------------- 2-D replica sync
    def after_step(self, step: int) -> bool:
        """Called by ``FusedSparseOptimizer.step`` with the step count (1-based, restored from
        checkpoints); averages the table copies when it is a multiple of ``replica_sync_every``."""
        if not self.dims.sparse_2d or step % self.sync_every:
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self) -> None:
        """Average weights and optimizer state of the local shards over the replica group."""
        if not self.dims.sparse_2d:
            return
        if self.dmp_collection is not None:
            self.dmp_collection.sync(include_optimizer_state=True)  # type: ignore[attr-defined]
            return
        tensors: list[torch.Tensor] = []
        for tbe in _tbe_modules(self.modules.values()):
            tensors += list(tbe.split_embedding_weights())
            tensors += [v for state in tbe.get_optimizer_state() for v in state.values()]
        # In place, one collective per tensor (no flattened copy of all local shards).
        works = [dist.all_reduce(t, op=dist.ReduceOp.AVG, group=self.replica_pg, async_op=True)
                 for t in tensors if t.numel()]
        for w in works:
            w.wait()

    # -------------------------------------------------------------- init
    @torch.no_grad()
    def init_tables(self, seed: int, std: float) -> None:
        """Write every local shard from ``table_init_slice`` (the single-process values) and zero
        the optimizer state, so a sharded model starts bit-identical to ``materialize`` on
        one process."""
        from opengem.model.sparse_arch import table_init_slice

        for t, tensor in self.table_shards():
            for (r0, c0), local in tensor:
                n, d = local.shape
                local.copy_(table_init_slice(t.name, seed, std, r0, r0 + n, c0, c0 + d, t.dim))
        for tbe in _tbe_modules(self.modules.values()):
            for state in tbe.get_optimizer_state():
                for v in state.values():
                    v.zero_()
        if self.optimizer is not None:
            self.optimizer.reset_steps()

    def table_shards(self) -> list[tuple[TableInfo, list[tuple[tuple[int, int], torch.Tensor]]]]:
        """(table, [((row0, col0), local view into the kernel's weights), …]) for every table."""
        states = {path: m.state_dict() for path, m in self.modules.items()}
        return [(t, _local_pieces(states[t.module][t.fqn[len(t.module) + 1:]]))
                for t in self.tables]


def _local_pieces(value) -> list[tuple[tuple[int, int], torch.Tensor]]:
    """((row0, col0), tensor) of the local shards of a ShardedTensor or a DTensor over
    local shards."""
    if isinstance(value, ShardedTensor):
        return [((s.metadata.shard_offsets[0], s.metadata.shard_offsets[1]), s.tensor)
                for s in value.local_shards()]
    local = value.to_local()
    if hasattr(local, "local_shards"):
        return [((o[0], o[1]), s) for s, o in zip(local.local_shards(), local.local_offsets())]
    raise TypeError(f"unexpected table state of type {type(value).__name__}")


def _tbe_modules(modules) -> list[nn.Module]:
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    out: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        # TorchRec keeps its lookups (which hold the kernels) in a plain list, not as submodules.
        for x in [m, *getattr(m, "_lookups", [])]:
            for y in x.modules():
                if isinstance(y, SplitTableBatchedEmbeddingBagsCodegen) and all(
                    y is not o for o in out
                ):
                    out.append(y)
                if y is not x and hasattr(y, "_lookups"):
                    visit(y)

    for m in modules:
        visit(m)
    return out


# ---------------------------------------------------------------------------------- apply
def apply_sparse_sharding(model: nn.Module, dims: ParallelDims, cfg: ParallelConfig,
                          optim: SparseOptimizerSpec | None = None,
                          device: torch.device | None = None) -> SparseSharding:
    """Shard every embedding collection of ``model`` (built on meta or CPU) in place; see
    module doc.

    The sharded tables come back allocated on ``device`` with arbitrary values: call
    ``SparseSharding.init_tables`` (``parallelize.init_parallel_model`` does) before training.
    """
    device = device or torch.device("cpu")
    optim = optim or SparseOptimizerSpec()
    tables = find_tables(model)
    if not tables:
        raise SparseShardingError("the model has no EmbeddingBagCollection/EmbeddingCollection "
                                  "to shard")
    requested = _requested(tables, cfg)
    opt_cls, opt_kwargs = optim.optimizer_class()
    for path, m in model.named_modules():
        if isinstance(m, _SHARDABLE):
            apply_optimizer_in_backward(opt_cls, m.parameters(), opt_kwargs)
    sharders = [CpuEmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()]
    plan = _plan(model, dims, cfg, sharders, device, requested)
    if dims.sparse_2d and device.type == "cuda":
        modules, dmpc, sharding_pg, replica_pg = _shard_dmp_collection(
            model, dims, plan, sharders, device
        )
    else:
        modules, sharding_pg, replica_pg = _shard_composed(model, dims, plan, sharders, device)
        dmpc = None
    asked = {t.name: cfg.sharding.get(t.name, cfg.default_sharding) for t in tables}
    result = SparseSharding(tables, asked, plan, dims, cfg.replica_sync_every, modules, sharding_pg,
                            replica_pg, dmp_collection=dmpc)
    result.optimizer = FusedSparseOptimizer(model, result, optim, device)
    return result


def _sharded_env(dims: ParallelDims, device: torch.device):
    if not dims.sparse_2d:
        return ShardingEnv.from_process_group(dist.group.WORLD), dist.group.WORLD, None
    mesh = dims.sparse_mesh
    if mesh is None:
        raise RuntimeError("dims.build_meshes() must run before apply_sparse_sharding")
    sharding_pg, replica_pg = mesh.get_group("sparse_shard"), mesh.get_group("sparse_replicate")
    # The mesh has DMPCollection's layout: dim 0 = copies (replicate), dim 1 = sharding group.
    env = ShardingEnv2D(sharding_pg=sharding_pg, replica_pg=replica_pg, global_pg=dist.group.WORLD,
                        device_mesh=mesh,
                        node_group_size=min(dims.sparse_group, _local_world_size()),
                        use_inter_host_allreduce=True)
    return env, sharding_pg, replica_pg


def _shard_composed(model, dims, plan, sharders, device):
    env, sharding_pg, replica_pg = _sharded_env(dims, device)
    if dims.sparse_2d:
        group = dims.sparse_groups()[dist.get_rank() // dims.sparse_group]
        _remap_plan(plan, group, device)
    by_type = {s.module_type: s for s in sharders}
    modules = {}
    for path, m in list(model.named_modules()):
        if isinstance(m, _SHARDABLE) and plan.get_plan_for_module(path):
            sharded = by_type[type(m)].shard(m, plan.get_plan_for_module(path), env, device, path)
            _keep_key_order(m, sharded)
            parent, _, name = path.rpartition(".")
            model.get_submodule(parent).register_module(name, sharded)
            modules[path] = sharded
    return modules, sharding_pg, replica_pg


def _keep_key_order(unsharded: nn.Module, sharded: nn.Module) -> None:
    """A sharded EBC returns its KeyedTensor keys grouped by sharding (e.g. table-wise:
    ``[user_id, category, tags, ad_id]`` for tables declared ``[user_id, ad_id, category, tags]``);
    code reading ``kt.values()`` positionally would mix features up. Restore the unsharded order
    (a forward hook: FQNs unchanged; a no-op when the order already matches)."""
    if not isinstance(unsharded, EmbeddingBagCollection):
        return
    order = [f for c in unsharded.embedding_bag_configs() for f in c.feature_names]

    def hook(_module, _inputs, kt):
        if kt.keys() == order:
            return kt
        parts = kt.to_dict()
        return KeyedTensor(keys=order, length_per_key=[parts[k].shape[1] for k in order],
                           values=torch.cat([parts[k] for k in order], dim=1))

    sharded.register_forward_hook(hook)


def _shard_dmp_collection(model, dims, plan, sharders, device):  # pragma: no cover - CUDA only
    """TorchRec's DMPCollection over a container of the collections; the sharded children go back
    into the model (FQNs unchanged) and the DMPCollection is kept only for ``sync``."""
    from torchrec.distributed.model_parallel import DMPCollection

    paths = [p for p, m in model.named_modules() if isinstance(m, _SHARDABLE)]
    unsharded = {p: model.get_submodule(p) for p in paths}
    container = nn.Module()
    for i, p in enumerate(paths):
        container.register_module(f"m{i}", model.get_submodule(p))
    sub_plan = ShardingPlan({f"m{i}": plan.get_plan_for_module(p) for i, p in enumerate(paths)})
    dmpc = DMPCollection(module=container, device=device, plan=sub_plan, world_size=dims.world_size,
                         sharding_group_size=dims.sparse_group, global_pg=dist.group.WORLD,
                         sharders=sharders, init_data_parallel=False, init_parameters=False,
                         use_inter_host_allreduce=True)
    modules = {}
    for i, p in enumerate(paths):
        sharded = dmpc._dmp_wrapped_module.get_submodule(f"m{i}")
        _keep_key_order(unsharded[p], sharded)
        parent, _, name = p.rpartition(".")
        model.get_submodule(parent).register_module(name, sharded)
        modules[p] = sharded
        plan.plan[p] = sub_plan.plan[f"m{i}"]
    return modules, dmpc, dmpc._default_ctx.sharding_pg, dmpc._default_ctx.replica_pg


# ---------------------------------------------------------------------------------- optimizer view
class FusedSparseOptimizer(torch.optim.Optimizer):
    """The fused table optimizer as the trainer and ``get_state_dict`` see it.

    - ``param_groups``: one group over the table weights (model FQNs), with the keys of the
      single-process optimizer. Setting ``lr`` there (the trainer's ``Schedule`` does, before the
      forward) pushes it into the kernels at once: the CPU kernel takes the learning rate at
      *forward* time for the update it applies in backward, so pushing it in ``zero_grad`` (after
      the forward) would apply the previous step's lr.
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
        # column-wise tables: fqn → (table, pieces)
        self._cw: dict[str, tuple[TableInfo, list]] = {}
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
        """The update already happened in backward: count the step, push the lr, 2-D sync
        when due."""
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
            self._fused_state[t.module] = self.sharding.modules[
                t.module
            ].fused_optimizer.state_dict()["state"]
        st = self._fused_state[t.module].get(t.fqn[len(t.module) + 1:],
                                             {}).get(f"{t.name}.momentum1")
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
        meta = ShardedTensorMetadata(gmd, torch.Size([t.rows, 1]),
                                     TensorProperties(dtype=torch.float32))
        pg = self.sharding.sharding_pg if self.sharding.dims.sparse_2d else None
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            local, meta, process_group=pg
        )

    @torch.no_grad()
    def _sync_cw(self, to_kernels: bool) -> None:
        """Column-wise tables: kernels → canonical sum (width-weighted mean) or back
        (a collective)."""
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
                             f"{[len(g['params']) for g in loaded_groups]} tables; expected 1 "
                             f"group of {len(own)}")
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
