"""InterFormer pieces checked against the PyTorch modules they stand in for."""

from __future__ import annotations

import torch

from opengem.model.interaction_arch import WukongConfig
from opengem.model.interformer import InterFormer, InterFormerConfig, SequenceSummary
from opengem.model.sequence_arch import SequenceConfig


def test_summary_pma_equals_multihead_attention_values_and_grads():
    """``SequenceSummary.pma`` is ``nn.MultiheadAttention(Q, S, S, key_padding_mask=~valid)`` with
    the same weights, computed directly; a row with only its first token valid included."""
    torch.manual_seed(0)
    B, S, D, H = 5, 11, 16, 2
    m = SequenceSummary(D, H, InterFormerConfig(num_pma=3))
    with torch.no_grad():
        m.attn.in_proj_bias.normal_()  # nn.MultiheadAttention starts its biases at zero
        m.attn.out_proj.bias.normal_()
    s = torch.randn(B, S, D, requires_grad=True)
    valid = torch.rand(B, S) > 0.4
    valid[:, 0] = True
    valid[1, 1:] = False
    q = m.q.unsqueeze(0).expand(B, -1, -1)
    ref = m.attn(q, s, s, key_padding_mask=~valid, need_weights=False)[0]
    out = m.pma(s, valid)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    g = torch.randn_like(out)
    params = [s, m.q, m.attn.in_proj_weight, m.attn.in_proj_bias, m.attn.out_proj.weight,
              m.attn.out_proj.bias]
    for a, b in zip(torch.autograd.grad((out * g).sum(), params),
                    torch.autograd.grad((ref * g).sum(), params)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_pooled_only_towers_keep_their_first_tokens_through_every_layer():
    """``tower_layers=False``: no tower layer is built; the last summary of the streams is the
    summary of the first tokens ([CLS | pooled | recent]) themselves, and it still reads the
    events (changing one event changes it)."""
    torch.manual_seed(0)
    B, n_x, D = 3, 5, 16
    inter = InterFormer(n_x, D, 2, WukongConfig(num_layers=2, num_fm=4, num_lc=4, fm_rank=4,
                                                mlp_dims=(32,)),
                        SequenceConfig(num_heads=2, recent_len=4, min_recent=2, num_pooled=2),
                        InterFormerConfig(tower_layers=False)).eval()
    assert all(len(t.layers) == 0 for t in inter.towers)
    x = torch.randn(B, n_x, D)
    lengths = torch.tensor([3, 0, 6])
    seqs = [(torch.randn(int(lengths.sum()), D), lengths) for _ in range(2)]
    with torch.no_grad():
        _, s_sum, _ = inter(x, seqs)
        x_sum0 = inter.cross[0].summarize_x(x)
        first = [t.first_tokens(tok, n, x_sum0) for t, (tok, n) in zip(inter.towers, seqs)]
        torch.testing.assert_close(s_sum, inter.cross[-1].summarize_s(first))
        tok = seqs[0][0].clone()
        tok[-1] += 1.0  # the newest event of row 2
        _, s_sum2, _ = inter(x, [(tok, lengths), seqs[1]])
    assert (s_sum2[2] - s_sum[2]).abs().max() > 1e-4
    torch.testing.assert_close(s_sum2[:2], s_sum[:2])
