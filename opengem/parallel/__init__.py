"""Distribution applied from outside the single-device model.

    launch        init_distributed / destroy_distributed (torchrun env or explicit args; gloo or nccl)
    dims          ParallelConfig (what to do), ParallelDims (named axes, meshes, validation)
    sparse        apply_sparse_sharding: TorchRec tables, 1-D or 2-D, fused row-wise Adagrad, and
                  FusedSparseOptimizer (the view of that optimizer the trainer steps and checkpoints)
    activation_checkpoint, compile, dense (FSDP2/HSDP)
    parallelize   parallelize (the fixed order), materialize_parallel, init_parallel_model,
                  build_parallel_gem (all of it)
    train_step    what a distributed step adds: global loss, clipping, gathering for checks

Only ``train/``, ``transfer/`` and the CLI import this package; ``model/`` never does.
"""

from opengem.parallel.dims import ParallelConfig, ParallelConfigError, ParallelDims
from opengem.parallel.launch import DistInfo, destroy_distributed, init_distributed
from opengem.parallel.parallelize import (
    build_parallel_gem,
    init_parallel_model,
    materialize_parallel,
    parallelize,
)
from opengem.parallel.sparse import (
    FusedSparseOptimizer,
    SparseOptimizerSpec,
    SparseSharding,
    SparseShardingError,
    apply_sparse_sharding,
)

__all__ = [
    "DistInfo", "FusedSparseOptimizer", "ParallelConfig", "ParallelConfigError", "ParallelDims",
    "SparseOptimizerSpec", "SparseSharding", "SparseShardingError", "apply_sparse_sharding",
    "build_parallel_gem", "destroy_distributed", "init_distributed", "init_parallel_model",
    "materialize_parallel", "parallelize",
]
