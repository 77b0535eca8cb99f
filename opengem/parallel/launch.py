"""Process-group start and teardown: from torchrun's environment or from explicit arguments.

    torchrun --nproc-per-node 4 -m opengem train …     RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT set
    init_distributed(rank=r, world_size=4, init_method=f"file://{tmp}/store")   spawn / tests

Backend: ``nccl`` with CUDA (one device per local rank), ``gloo`` on CPU. A single process without
any of this runs the plain single-device path; ``init_distributed`` then returns a world of one
without creating a process group.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str | None  # None: no process group (one process)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_backend(requested: str = "auto") -> tuple[str, str]:
    """(backend, device type): nccl/cuda when CUDA is usable, gloo/cpu otherwise."""
    if requested == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("parallel.backend=nccl needs CUDA, and torch.cuda.is_available() "
                           "is False")
    if requested == "nccl" or (requested == "auto" and torch.cuda.is_available()):
        return "nccl", "cuda"
    return "gloo", "cpu"


def init_distributed(
    backend: str = "auto",
    *,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    local_world_size: int | None = None,
    threads: int | None = None,
) -> DistInfo:
    """Join (or create) the default process group.

    Explicit ``rank``/``world_size``/``init_method``/``local_world_size`` win over the torchrun
    environment. ``LOCAL_WORLD_SIZE``/``LOCAL_RANK`` are always exported (``mp.spawn`` sets
    neither): TorchRec's table-row-wise sharding reads them to find host boundaries
    (table-row-wise fails with an ``IndexError`` under spawn); without them every rank counts as one
    host. ``threads`` sets torch's intra-op threads; under spawn nothing else limits them and 4
    ranks on 2 cores oversubscribe badly.
    """
    env = os.environ
    rank = int(env.get("RANK", 0)) if rank is None else rank
    world_size = int(env.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if local_world_size is None:
        local_world_size = int(env.get("LOCAL_WORLD_SIZE", world_size))
        local_rank = int(env.get("LOCAL_RANK", rank % local_world_size))
    else:  # explicit (spawned workers, tests emulating several hosts)
        local_rank = rank % local_world_size
    env["LOCAL_WORLD_SIZE"], env["LOCAL_RANK"] = str(local_world_size), str(local_rank)
    if threads:
        torch.set_num_threads(threads)
    name, device_type = pick_backend(backend)
    device = torch.device(device_type, local_rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, local_world_size,
                        device, dist.get_backend())
    if world_size == 1 and init_method is None and "MASTER_ADDR" not in env:
        return DistInfo(0, 1, 0, 1, device, None)
    kwargs = {"device_id": device} if device_type == "cuda" else {}
    dist.init_process_group(name, init_method=init_method or "env://", rank=rank,
                            world_size=world_size, **kwargs)
    log.info("rank %d/%d joined (%s, %s)", rank, world_size, name, device)
    return DistInfo(rank, world_size, local_rank, local_world_size, device, name)


def destroy_distributed() -> None:
    """Leave the process group (a barrier first, so no rank tears down a collective in flight)."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def comm_device() -> torch.device:
    """Where collective buffers live: the current GPU under NCCL, else CPU (gloo, or no
    process group)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def min_over_ranks(value: int, distributed: bool) -> int:
    """The minimum of an int over all ranks (``value`` itself when not distributed)."""
    if not distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
