"""The one ordered recipe that distributes a GEM built on the meta device.

    model = build_gem(schema, cfg)                          meta: no memory
    sparse = parallelize(model, dims, pcfg, sparse_optim)   1 → 4 below, in this order
    materialize_parallel(model, sparse)                      dense parameters: meta → device
    init_parallel_model(model, sparse, seed, base_rates)     same values as one process
    (the trainer then loads a checkpoint if it resumes)

``build_parallel_gem`` runs all of it. Order inside ``parallelize`` and why:

1. **sparse** (``apply_sparse_sharding``) first: the TorchRec planner must see the plain
   ``EmbeddingBagCollection``/``EmbeddingCollection`` modules, and FSDP must later leave their
   parameters alone (they are ``ignored_params``). Sharding allocates the local table shards on
   the device right away (FBGEMM kernels cannot live on meta), with arbitrary values: on CPU
   TorchRec's CPU sharding re-initialises the module's weights anyway, and the model is still on
   meta here.
2. **activation checkpointing** wraps blocks before compile, so each compiled graph contains its
   checkpointed region (torchtitan's order).
3. **compile** each block before FSDP wraps it; compiling the FSDP root silently runs eager
   (a graph break on FSDP's hooks).
4. **FSDP2/HSDP** last, leaves first and the root last.

Materialise after that (``to_empty`` of everything but the already-real sharded tables: an
``to_empty`` there would replace the kernels' weights and optimizer state under TorchRec's views),
then initialise: the dense parameters from a CPU copy of the dense part only, initialised exactly
as ``materialize(build_gem(...), seed=s)`` does on one process (each rank keeps its FSDP slice),
the tables shard by shard from ``table_init_slice``. ``GEM.init_weights`` seeds every table on its
own, so the dense stream does not depend on the tables: the start is bit-identical to one process
and no table ever exists in full anywhere (the dense part is held once per rank for a moment).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from opengem.parallel.activation_checkpoint import apply_activation_checkpoint
from opengem.parallel.compile import apply_compile
from opengem.parallel.dense import apply_fsdp
from opengem.parallel.dims import ParallelConfig, ParallelConfigError, ParallelDims
from opengem.parallel.sparse import SparseOptimizerSpec, SparseSharding, apply_sparse_sharding

log = logging.getLogger(__name__)

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def parallelize(model: nn.Module, dims: ParallelDims, cfg: ParallelConfig,
                sparse_optim: SparseOptimizerSpec | None = None,
                device: torch.device | str = "cpu") -> SparseSharding:
    """Distribute ``model`` (built on meta) in place: sparse → AC → compile → FSDP. Returns the
    sparse sharding (plan, table optimizer, replica sync); the dense parameters stay on meta."""
    device = torch.device(device)
    cfg.validate()
    if dims.dense_mesh is None:
        dims.build_meshes(device.type)
    if (
        cfg.mixed_precision == "bf16"
        and device.type == "cuda"
        and not torch.cuda.is_bf16_supported()
    ):
        raise RuntimeError("parallel.mixed_precision=bf16 but this GPU does not support bf16")
    sparse = apply_sparse_sharding(model, dims, cfg, sparse_optim, device)
    apply_activation_checkpoint(model, cfg)
    apply_compile(model, cfg)
    sparse_params = {p for m in sparse.modules.values() for p in m.parameters()}
    apply_fsdp(model, dims.fsdp_mesh(), cfg, ignored_params=sparse_params)
    return sparse


@contextlib.contextmanager
def _detached(model: nn.Module, paths: list[str]):
    """Temporarily replace the modules at ``paths`` by empty ones (``to_empty`` must not
    reach them)."""
    saved = []
    for p in paths:
        parent_name, _, name = p.rpartition(".")
        parent = model.get_submodule(parent_name)
        saved.append((parent, name, parent._modules[name]))
        parent._modules[name] = nn.Module()
    try:
        yield
    finally:
        for parent, name, m in saved:
            parent._modules[name] = m


def materialize_parallel(model: nn.Module, sparse: SparseSharding,
                         device: torch.device | str = "cpu") -> nn.Module:
    """Allocate the dense (FSDP) parameters on ``device``; the sharded tables are already real."""
    with _detached(model, list(sparse.modules)):
        model.to_empty(device=torch.device(device))
    return model


def _clean(name: str) -> str:
    for p in _WRAPPER_PREFIXES:
        name = name.replace(p, "")
    return name


def _dense_reference(model: nn.Module, seed: int, base_rates: list[float] | None) -> nn.Module:
    """The single-process initial values of the dense parameters; the tables stay on meta."""
    from opengem.model.build import build_gem

    ref = build_gem(model.schema, model.cfg)
    for name, child in ref.named_children():
        if name != "sparse_arch":
            child.to_empty(device="cpu")
    # tables are initialised shard by shard instead
    ref.sparse_arch.init_weights = lambda seed=0: None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        ref.init_weights(base_rates, seed)
    return ref


@torch.no_grad()
def init_parallel_model(model: nn.Module, sparse: SparseSharding, seed: int = 0,
                        base_rates: list[float] | None = None) -> nn.Module:
    """Give the parallel model the values ``materialize(build_gem(...), seed=seed, base_rates=...)``
    gives one process."""
    ref = _dense_reference(model, seed, base_rates)
    full = {k: v for k, v in ref.state_dict().items()}
    skip = {id(p) for m in sparse.modules.values() for p in m.parameters()}
    named = list(model.named_parameters()) + list(model.named_buffers())
    for name, t in named:
        if id(t) in skip:
            continue
        src = full[_clean(name)]
        if isinstance(t, DTensor):
            local = distribute_tensor(src.to(t.device, t.dtype), t.device_mesh, t.placements,
                                      src_data_rank=None)
            local = local.to_local()
            t.to_local().copy_(local)
        else:
            t.copy_(src.to(t.device, t.dtype))
    sparse.init_tables(seed, model.sparse_arch.cfg.init_std)
    return model


def build_parallel_gem(schema, model_cfg, dims: ParallelDims, cfg: ParallelConfig,
                       sparse_optim: SparseOptimizerSpec,
                       device: torch.device | str = "cpu", seed: int = 0,
                       base_rates: list[float] | None = None) -> tuple[nn.Module, SparseSharding]:
    """The whole life cycle: build on meta → parallelize → materialise → init. Logs the plan
    on rank 0."""
    import torch.distributed as dist

    from opengem.model.build import build_gem

    if model_cfg.arch != "gem":  # parallelize() wraps GEM's own blocks (InterFormer, heads) by name
        raise ParallelConfigError(f"model.arch={model_cfg.arch} (a peer baseline) trains in one "
                                  f"process only; "
                                  "run `opengem train` without torchrun")
    model = build_gem(schema, model_cfg)
    sparse = parallelize(model, dims, cfg, sparse_optim, device)
    materialize_parallel(model, sparse, device)
    init_parallel_model(model, sparse, seed, base_rates)
    if dist.get_rank() == 0:
        log.info("%s", sparse.describe())
    return model, sparse
