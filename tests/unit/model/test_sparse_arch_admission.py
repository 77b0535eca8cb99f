"""Frequency admission (model.sparse.min_count): rare ids read the OOV row, counted in training
only, and the counts travel in the state dict."""

import pytest
import torch
from torchrec import KeyedJaggedTensor

from opengem.model.build import build_gem, materialize
from opengem.model.foundation import GEMConfig
from opengem.model.sparse_arch import SparseArch, SparseArchConfig
from opengem.testing import tiny_schema


def _kjt(user_ids):
    """One row per user id; ad_id 3, category 1, no tags."""
    n = len(user_ids)
    values = torch.tensor(list(user_ids) + [3] * n + [1] * n)
    lengths = torch.tensor([1] * (3 * n) + [0] * n)
    return KeyedJaggedTensor(keys=["user_id", "ad_id", "category", "tags"], values=values,
                             lengths=lengths)


def _arch(k, **kw):
    arch = SparseArch(tiny_schema(), SparseArchConfig(min_count=k, **kw), dim=4)
    arch.init_weights(seed=0)
    return arch


def test_off_by_default_adds_nothing():
    arch = _arch(0)
    assert arch.admitted == [] and not any(n.startswith("seen_") for n in arch.state_dict())


def test_an_id_reads_its_own_row_after_k_sightings_in_training():
    arch = _arch(2)
    table, oov = arch.tables()["t_user_id"], arch.rows["user_id"] - 1
    arch.train()
    for sighting in range(4):
        out = arch.forward_sparse(_kjt([7]), 1)[0, 0]
        want = table[7] if sighting >= 2 else table[oov]
        assert torch.equal(out, want), sighting
    assert arch.seen("user_id")[7].item() == 4 and arch.seen("user_id").sum().item() == 4
    # other features are untouched: ad_id 3 reads its own row from the first sighting
    assert torch.equal(arch.forward_sparse(_kjt([7]), 1)[0, 1], arch.tables()["t_ad_id"][3])


def test_evaluation_neither_counts_nor_admits_rare_ids():
    arch = _arch(3)
    arch.train()
    arch.forward_sparse(_kjt([5, 5, 5, 9]), 4)  # a batch counts after its own lookups
    arch.eval()
    with torch.no_grad():
        out = arch.forward_sparse(_kjt([5, 9, 9, 9]), 4)[:, 0]
    table, oov = arch.tables()["t_user_id"], arch.rows["user_id"] - 1
    assert torch.equal(out[0], table[5]) and all(torch.equal(out[i], table[oov]) for i in (1, 2, 3))
    assert arch.seen("user_id")[9].item() == 1  # unchanged by the evaluation


def test_counts_travel_in_the_state_dict_and_survive_the_meta_build():
    schema, cfg = tiny_schema(), GEMConfig(embedding_dim=8, sparse=SparseArchConfig(min_count=2))
    a = materialize(build_gem(schema, cfg), seed=0)
    # to_empty's garbage is cleared by init_weights
    assert a.sparse_arch.seen("user_id").abs().sum() == 0
    a.train()
    a.sparse_arch.forward_sparse(_kjt([1, 1, 2]), 3)
    b = materialize(build_gem(schema, cfg), seed=0)
    b.load_state_dict(a.state_dict())
    assert torch.equal(b.sparse_arch.seen("user_id"), a.sparse_arch.seen("user_id"))
    a.eval(), b.eval()
    with torch.no_grad():
        assert torch.equal(a.sparse_arch.forward_sparse(_kjt([1, 2]), 2),
                           b.sparse_arch.forward_sparse(_kjt([1, 2]), 2))


def test_features_the_schema_lacks_are_skipped_and_bad_configs_refused():
    assert _arch(2, min_count_features=("user_id", "no_such")).admitted == ["user_id"]
    with pytest.raises(ValueError, match="min_count must be >= 0"):
        _arch(-1)
    with pytest.raises(ValueError, match="sequence columns"):
        _arch(2, min_count_features=("s0.item",))
