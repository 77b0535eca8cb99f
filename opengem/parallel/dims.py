"""``ParallelConfig`` (what the user asks for) and ``ParallelDims`` (the named axes and meshes).

Two independent layouts share the same ranks (W = world size):

    dense  (FSDP2/HSDP)   mesh ("dp_replicate", "dp_shard")            dp_replicate × dp_shard = W
    sparse (TorchRec)     mesh ("sparse_replicate", "sparse_shard")   (W / sparse_group) × sparse_group = W

With W = 4, dp_replicate = 2 and sparse_group = 2::

    dense mesh   [[0, 1],      replicas {0,2} {1,3} all-reduce gradients; shards {0,1} {2,3}
                  [2, 3]]
    sparse mesh  [[0, 1],      tables are sharded inside {0,1} and inside {2,3} (the same plan twice);
                  [2, 3]]      replicas {0,2} {1,3} average tables every ``replica_sync_every`` steps

Sharding groups are runs of consecutive ranks, so on GPUs a sharding group that fits in one host
keeps the per-step all-to-all on the fast intra-host links; only the occasional replica average
crosses hosts (TorchRec ``DMPCollection(use_inter_host_allreduce=True)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise")


class ParallelConfigError(ValueError):
    """A parallel setting is invalid or does not fit the world size; the message names
    the numbers."""


@dataclass
class ParallelConfig:
    """How to distribute GEM. Every field is a plain value so it round-trips through JSON
    and overrides.

    dp_replicate:   HSDP replicate degree of the dense parameters (1 = plain FSDP).
    dp_shard:       FSDP shard degree of the dense parameters; -1 = world_size / dp_replicate.
    sparse_group:   ranks one copy of the embedding tables is sharded over; -1 = the whole world
                    (plain model-parallel tables). world_size / sparse_group copies of the tables
                    exist ("2-D" sparse parallelism, TorchRec DMPCollection).
    default_sharding: sharding of every table not named in ``sharding``: table_wise | row_wise |
                    column_wise | table_row_wise | auto (the TorchRec planner picks per table).
    sharding:       table name (e.g. ``t_user_id``) → sharding type, overriding the default.
    column_wise_dim: width of one column-wise shard; 0 = TorchRec's default (tables narrower than it
                    stay in one shard).
    replica_sync_every: steps between averages of the table copies when sparse_group < world
                    (weights and row-wise optimizer state, ReduceOp.AVG, DMPCollection.sync).
    activation_checkpoint: none | full (recompute every block in backward) | selective (keep the
                    matmul and attention outputs of every block, recompute the rest).
    compile:        torch.compile every block (before FSDP wraps it).
    mixed_precision: fp32 | bf16 (bf16 compute for FSDP blocks; fp32 master weights and reductions).
    backend:        auto (nccl with CUDA, gloo otherwise) | gloo | nccl.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    sparse_group: int = -1
    default_sharding: str = "auto"
    sharding: dict[str, str] = field(default_factory=dict)
    column_wise_dim: int = 0
    replica_sync_every: int = 1
    activation_checkpoint: str = "none"
    compile: bool = False
    mixed_precision: str = "fp32"
    backend: str = "auto"

    def validate(self) -> ParallelConfig:
        if self.dp_replicate < 1:
            raise ParallelConfigError(f"parallel.dp_replicate must be >= 1, "
                                      f"got {self.dp_replicate}")
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise ParallelConfigError(f"parallel.dp_shard must be >= 1 or -1 (fill), "
                                      f"got {self.dp_shard}")
        if self.sparse_group == 0 or self.sparse_group < -1:
            raise ParallelConfigError(f"parallel.sparse_group must be >= 1 or -1 (whole world), "
                                      f"got {self.sparse_group}")
        choices = (*SHARDING_TYPES, "auto")
        if self.default_sharding not in choices:
            raise ParallelConfigError(f"parallel.default_sharding must be one of {choices}, "
                                      f"got {self.default_sharding!r}")
        for table, kind in self.sharding.items():
            if kind not in choices:
                raise ParallelConfigError(f"parallel.sharding[{table!r}] must be one of {choices}, "
                                          f"got {kind!r}")
        if self.column_wise_dim < 0:
            raise ParallelConfigError(f"parallel.column_wise_dim must be >= 0, "
                                      f"got {self.column_wise_dim}")
        if self.replica_sync_every < 1:
            raise ParallelConfigError(f"parallel.replica_sync_every must be >= 1, "
                                      f"got {self.replica_sync_every}")
        if self.activation_checkpoint not in ("none", "full", "selective"):
            raise ParallelConfigError(
                f"parallel.activation_checkpoint must be none|full|selective, "
                f"got {self.activation_checkpoint!r}")
        if self.mixed_precision not in ("fp32", "bf16"):
            raise ParallelConfigError(f"parallel.mixed_precision must be fp32|bf16, "
                                      f"got {self.mixed_precision!r}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ParallelConfigError(f"parallel.backend must be auto|gloo|nccl, "
                                      f"got {self.backend!r}")
        return self


@dataclass
class ParallelDims:
    """Resolved degrees for one world size; ``build_meshes()`` creates the process groups.

    Create with ``ParallelDims.from_config(cfg, world_size)``; the constructor checks that the
    degrees multiply to the world size and raises ``ParallelConfigError`` naming the numbers.
    """

    dp_replicate: int
    dp_shard: int
    sparse_group: int
    world_size: int
    dense_mesh: DeviceMesh | None = field(default=None, repr=False)
    sparse_mesh: DeviceMesh | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        W = self.world_size
        if W < 1:
            raise ParallelConfigError(f"world_size must be >= 1, got {W}")
        if self.dp_replicate * self.dp_shard != W:
            raise ParallelConfigError(
                f"dp_replicate ({self.dp_replicate}) × dp_shard ({self.dp_shard}) = "
                f"{self.dp_replicate * self.dp_shard}, but the world size is {W}")
        if self.sparse_group < 1 or W % self.sparse_group:
            raise ParallelConfigError(
                f"sparse_group ({self.sparse_group}) must divide the world size ({W}) so "
                f"that every table copy spans the same number of ranks")

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        cfg.validate()
        if world_size % cfg.dp_replicate:
            raise ParallelConfigError(
                f"dp_replicate ({cfg.dp_replicate}) does not divide the world size ({world_size})")
        shard = world_size // cfg.dp_replicate if cfg.dp_shard == -1 else cfg.dp_shard
        group = world_size if cfg.sparse_group == -1 else cfg.sparse_group
        return cls(cfg.dp_replicate, shard, group, world_size)

    # ------------------------------------------------------------------ derived
    @property
    def sparse_replicas(self) -> int:
        """Number of copies of the embedding tables (1 = plain model-parallel tables)."""
        return self.world_size // self.sparse_group

    @property
    def sparse_2d(self) -> bool:
        return self.sparse_replicas > 1

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    def sparse_groups(self) -> list[list[int]]:
        """Global ranks of each sharding group (consecutive runs); row i = table copy i."""
        G = self.sparse_group
        return [list(range(i, i + G)) for i in range(0, self.world_size, G)]

    # ------------------------------------------------------------------ meshes
    def build_meshes(self, device_type: str) -> ParallelDims:
        """Create both DeviceMeshes (a collective call: every rank, same order)."""
        if not dist.is_initialized():
            raise RuntimeError("ParallelDims.build_meshes needs torch.distributed; call "
                               "opengem.parallel.launch.init_distributed first")
        if dist.get_world_size() != self.world_size:
            raise ParallelConfigError(
                f"ParallelDims was resolved for world size {self.world_size}, but the "
                f"process group has {dist.get_world_size()} ranks")
        self.dense_mesh = init_device_mesh(device_type, (self.dp_replicate, self.dp_shard),
                                           mesh_dim_names=("dp_replicate", "dp_shard"))
        self.sparse_mesh = DeviceMesh(device_type, torch.tensor(self.sparse_groups()),
                                      mesh_dim_names=("sparse_replicate", "sparse_shard"))
        return self

    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh ``fully_shard`` gets: 2-D (HSDP) when replicated, else the 1-D shard axis."""
        if self.dense_mesh is None:
            raise RuntimeError("call build_meshes() first")
        return self.dense_mesh if self.hsdp else self.dense_mesh["dp_shard"]

    def describe(self) -> str:
        return (f"world {self.world_size}: dense dp_replicate {self.dp_replicate} × "
                f"dp_shard {self.dp_shard}; "
                f"sparse {self.sparse_replicas} table "
                f"cop{'ies' if self.sparse_replicas > 1 else 'y'} × "
                f"sharding group {self.sparse_group}")
