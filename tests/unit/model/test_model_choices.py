"""The model choices of the generalisation issue, each pinned: PFFN orientation, RoPE, the
cross-layer span, the small-embedding init and the fitted dense normaliser."""

import math

import pytest
import torch

from opengem.model.build import build_gem, materialize
from opengem.model.dense_norm import DenseNormalizer
from opengem.model.foundation import GEMConfig
from opengem.model.interaction_arch import InteractionArch, WukongConfig
from opengem.model.sequence_arch import PersonalizedFFN, SequenceConfig, apply_rope, rope_positions
from opengem.testing import tiny_schema


def test_pffn_follows_the_paper_orientation():
    """W_PFFN = X_sum W (X_sum as D × C columns) applied as W_PFFN s; ``transposed`` is the
    old map."""
    torch.manual_seed(0)
    B, C, S, D = 3, 2, 5, 4
    x_sum, s = torch.randn(B, C, D), torch.randn(B, S, D)
    paper, old = PersonalizedFFN(C, D, "paper"), PersonalizedFFN(C, D, "transposed")
    old.w.data.copy_(paper.w.data)
    for b in range(B):
        w_pffn = x_sum[b].t() @ paper.w  # [D, D]
        torch.testing.assert_close(paper(x_sum, s)[b], (w_pffn @ s[b].t()).t(), atol=1e-6,
                                   rtol=1e-5)
        torch.testing.assert_close(old(x_sum, s)[b], s[b] @ w_pffn, atol=1e-6, rtol=1e-5)
    # a different function, same parameters
    assert (paper(x_sum, s) - old(x_sum, s)).abs().max() > 0.1


def test_rope_scores_depend_on_relative_position_only():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(pq, pk):
        return (apply_rope(q, torch.tensor([float(pq)]))
                * apply_rope(k, torch.tensor([float(pk)]))).sum().item()

    assert score(3, 1) == pytest.approx(score(7, 5), abs=1e-5)
    assert score(3, 1) != pytest.approx(score(3, 2), abs=1e-3)
    # position 0 (summary tokens): unrotated
    torch.testing.assert_close(apply_rope(q, torch.zeros(1)), q)
    x = torch.randn(2, 2, 6, 8)
    # a rotation
    torch.testing.assert_close(apply_rope(x, torch.arange(6.0)).norm(dim=-1), x.norm(dim=-1))


def test_rope_positions_count_from_the_newest_event_and_survive_the_pyramid():
    pos = rope_positions(2, 1, 4, torch.device("cpu"))
    assert pos.tolist() == [0, 0, 0, 3, 2, 1, 0]
    # the two newest after a halving
    assert rope_positions(2, 1, 2, torch.device("cpu")).tolist()[-2:] == [1, 0]


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_span_all_makes_every_connection_after_the_first_a_live_softmax(layers):
    cfg = WukongConfig(num_layers=layers, num_fm=2, num_lc=2, fm_rank=2, mlp_dims=(8,))
    arch = InteractionArch(5, 0, 8, cfg)
    assert len(arch.connections) == layers + 1  # + the output connection
    assert arch.connections[0].proj is None  # X_0 alone: nothing to mix
    assert all(hasattr(c, "q") for c in arch.connections[1:])
    old = InteractionArch(5, 0, 8,
                          WukongConfig(num_layers=layers, num_fm=2, num_lc=2, fm_rank=2,
                                       mlp_dims=(8,),
                                                cross_layer_span="earlier"))
    assert len(old.connections) == layers and sum(hasattr(c, "q") for c in old.connections) == max(
        layers - 2, 0
    )
    assert arch(torch.randn(4, 5, 8)).shape == (4, 4, 8)


def _cfg(**kw):
    kw.setdefault("wukong",
                  WukongConfig(num_layers=2, num_fm=4, num_lc=4, fm_rank=4, mlp_dims=(32,)))
    kw.setdefault("sequence", SequenceConfig(num_heads=2, recent_len=8, min_recent=2, num_pooled=2))
    return GEMConfig(embedding_dim=16, **kw)


def test_table_init_puts_the_domain_and_time_embeddings_on_the_tables_scale():
    schema = tiny_schema()
    torch_init = materialize(build_gem(schema, _cfg()))
    table_init = materialize(build_gem(schema, _cfg(embedding_init="table")))
    assert torch_init.domain_emb.weight.std().item() > 0.5  # nn.Embedding's N(0, 1)
    for m in (table_init.domain_emb, *[t.time_emb for t in table_init.interformer.towers]):
        assert 0.03 < m.weight.std().item() < 0.07  # N(0, 0.05²), as the id tables


def test_bad_choices_are_named():
    with pytest.raises(ValueError, match="pffn"):
        _cfg(sequence=SequenceConfig(pffn="sideways")).validate()
    with pytest.raises(ValueError, match="position"):
        _cfg(sequence=SequenceConfig(position="absolute")).validate()
    with pytest.raises(ValueError, match="cross_layer_span"):
        _cfg(wukong=WukongConfig(cross_layer_span="some")).validate()
    with pytest.raises(ValueError, match="embedding_init"):
        _cfg(embedding_init="xavier").validate()
    with pytest.raises(ValueError, match="dense_norm"):
        DenseNormalizer(2, "minmax")


def _stats(values):
    import numpy as np

    v = np.asarray(values, dtype=np.float64)
    return {"names": ["a", "b"], "mean": v.mean(0).tolist(), "std": v.std(0).tolist(),
            "quantiles": np.quantile(v, np.linspace(0, 1, 33), axis=0).T.tolist()}


def test_standardize_and_quantile_transforms():
    torch.manual_seed(0)
    train = torch.cat([torch.randn(4000, 1) * 3 + 10,
                       torch.distributions.Exponential(0.01).sample((4000, 1))], 1)
    stats = _stats(train.numpy())
    std = DenseNormalizer(2, "standardize")
    std.fit(stats, ["a", "b"])
    z = std(train)
    torch.testing.assert_close(z.mean(0), torch.zeros(2), atol=0.02, rtol=0)
    assert std(torch.tensor([[1e9, -1e9]])).abs().max().item() == 8.0  # clipped, never huge
    q = DenseNormalizer(2, "quantile")
    q.fit(stats, ["a", "b"])
    u = q(train)
    assert u.min().item() >= -math.sqrt(3) - 1e-6 and u.max().item() <= math.sqrt(3) + 1e-6
    torch.testing.assert_close(u.std(0), torch.ones(2), atol=0.03, rtol=0)  # ≈ uniform on [−√3, √3]
    torch.testing.assert_close(q(train * torch.tensor([1.0, 1.0])), u)
    scaled = DenseNormalizer(2, "quantile")  # a monotone change of units changes nothing
    scaled.fit(_stats((train * torch.tensor([1.0, 1000.0])).numpy()), ["a", "b"])
    torch.testing.assert_close(scaled(train * torch.tensor([1.0, 1000.0])), u, atol=1e-4, rtol=0)


def test_a_fitted_mode_refuses_to_run_unfitted_and_wrong_statistics():
    m = DenseNormalizer(2, "standardize")
    with pytest.raises(RuntimeError, match="not fitted"):
        m(torch.zeros(1, 2))
    with pytest.raises(ValueError, match="features"):
        m.fit({"names": ["x"], "mean": [0.0], "std": [1.0], "quantiles": [[0.0]]}, ["a", "b"])
    m.fit(_stats([[0.0, 1.0], [2.0, 3.0]]), ["a", "b"])
    fresh = DenseNormalizer(2, "standardize")
    fresh.load_state_dict(m.state_dict())  # a checkpoint carries the statistics
    torch.testing.assert_close(fresh(torch.ones(1, 2)), m(torch.ones(1, 2)))
