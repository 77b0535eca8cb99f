"""Small models and batches for the transfer tests (no data files)."""

from opengem.data.batch import collate
from opengem.model.build import build_gem, materialize
from opengem.model.foundation import GEMConfig
from opengem.model.interaction_arch import WukongConfig
from opengem.model.sequence_arch import SequenceConfig
from opengem.testing import random_table


def make_batch(schema, n=16, seed=0):
    return collate(random_table(schema, n, seed=seed), schema)


def gem_config(dim=8):
    return GEMConfig(embedding_dim=dim,
                     wukong=WukongConfig(num_layers=1, num_fm=2, num_lc=2, fm_rank=2,
                                         mlp_dims=(16,)),
                     sequence=SequenceConfig(num_heads=2, recent_len=4, min_recent=2, num_pooled=1))


def make_gem(schema, dim=8, seed=0):
    return materialize(build_gem(schema, gem_config(dim)), seed=seed, base_rates=[0.1, 0.01])


def write_dataset(out, schema, rows_per_day=(96, 64), seed=0):
    """A dataset directory of random rows: day 0 = ``valid`` (the students' days), day
    1 = ``test``."""
    from opengem.data.parquet import ShardWriter

    w = ShardWriter(out, schema)
    for day, n in enumerate(rows_per_day):
        w.write(random_table(schema, n, seed=seed + day), f"d{day:03d}", day)
    w.close({"train": [0], "valid": [0], "test": [1]})
    return out
