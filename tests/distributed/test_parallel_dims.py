"""ParallelConfig / ParallelDims validation and the sparse-plan errors a user can cause
(no processes)."""

import pytest

from opengem.parallel import (
    ParallelConfig,
    ParallelConfigError,
    ParallelDims,
    SparseOptimizerSpec,
    SparseShardingError,
)
from opengem.parallel.sparse import apply_sparse_sharding, find_tables

pytestmark = pytest.mark.distributed


def test_fill_and_groups():
    dims = ParallelDims.from_config(ParallelConfig(dp_replicate=2, sparse_group=2), world_size=8)
    assert (dims.dp_replicate, dims.dp_shard, dims.sparse_group, dims.sparse_replicas) == (
        2,
        4,
        2,
        4,
    )
    assert dims.sparse_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.hsdp and dims.sparse_2d
    one_d = ParallelDims.from_config(ParallelConfig(), world_size=4)
    assert (one_d.dp_replicate, one_d.dp_shard, one_d.sparse_group, one_d.sparse_2d) == (
        1,
        4,
        4,
        False,
    )


@pytest.mark.parametrize("kwargs, world, words", [
    ({"dp_replicate": 2, "dp_shard": 3}, 4,
     ["dp_replicate (2)", "dp_shard (3)", "= 6", "world size is 4"]),
    ({"dp_replicate": 3}, 4, ["dp_replicate (3)", "world size (4)"]),
    ({"sparse_group": 3}, 4, ["sparse_group (3)", "world size (4)"]),
])
def test_degrees_must_fit_the_world(kwargs, world, words):
    with pytest.raises(ParallelConfigError) as e:
        ParallelDims.from_config(ParallelConfig(**kwargs), world_size=world)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_direct_construction_checks_the_product():
    with pytest.raises(ParallelConfigError,
                       match=r"dp_replicate \(1\) × dp_shard \(2\) = 2, but the world size is 4"):
        ParallelDims(dp_replicate=1, dp_shard=2, sparse_group=4, world_size=4)


@pytest.mark.parametrize("kwargs, key", [
    ({"default_sharding": "diagonal"}, "parallel.default_sharding"),
    ({"sharding": {"t_user_id": "rowwise"}}, "parallel.sharding['t_user_id']"),
    ({"dp_shard": 0}, "parallel.dp_shard"),
    ({"sparse_group": -2}, "parallel.sparse_group"),
    ({"replica_sync_every": 0}, "parallel.replica_sync_every"),
    ({"activation_checkpoint": "some"}, "parallel.activation_checkpoint"),
    ({"mixed_precision": "fp16"}, "parallel.mixed_precision"),
    ({"backend": "mpi"}, "parallel.backend"),
])
def test_config_errors_name_the_field(kwargs, key):
    with pytest.raises(ParallelConfigError) as e:
        ParallelConfig(**kwargs).validate()
    assert key in str(e.value)


def _meta_gem():
    from _workers import tiny_model_cfg

    from opengem.model.build import build_gem
    from opengem.testing import tiny_schema

    return build_gem(tiny_schema(), tiny_model_cfg())


def test_find_tables_names_every_table():
    tables = {t.name: t for t in find_tables(_meta_gem())}
    assert tables["t_user_id"].pooled and tables["t_user_id"].rows == 51
    assert tables["t_user_id"].fqn == "sparse_arch.ebc.embedding_bags.t_user_id.weight"
    assert not tables["t_s0_item"].pooled
    assert tables["t_s0_item"].fqn == "sparse_arch.ec.embeddings.t_s0_item.weight"


@pytest.mark.parametrize("cfg, words", [
    (ParallelConfig(sharding={"t_nope": "row_wise"}), ["unknown tables ['t_nope']", "t_user_id"]),
    (ParallelConfig(sharding={"t_s0_item": "table_row_wise"}), ["table t_s0_item", "table_row_wise",
                                                                "sequence tables"]),
    (ParallelConfig(sharding={"t_ad_id": "column_wise"}, column_wise_dim=3),
     ["table t_ad_id", "column_wise_dim 3",
                                                                              "dim 8"]),
])
def test_unplaceable_tables_are_named(cfg, words):
    dims = ParallelDims.from_config(cfg, world_size=2)
    with pytest.raises(SparseShardingError) as e:
        apply_sparse_sharding(_meta_gem(), dims, cfg, SparseOptimizerSpec())
    for w in words:
        assert w in str(e.value), str(e.value)
