"""InterFormer pieces checked against the PyTorch modules they stand in for."""

from __future__ import annotations

import torch

from opengem.model.interformer import InterFormerConfig, SequenceSummary


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
