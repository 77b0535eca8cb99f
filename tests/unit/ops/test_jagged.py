import torch

from opengem.ops.jagged import offsets_of, pool_attention, recent_window, row_ids


def _rows(values, lengths):
    off = offsets_of(lengths).tolist()
    return [values[off[b]:off[b + 1]] for b in range(len(lengths))]


def test_row_ids_and_offsets():
    lengths = torch.tensor([2, 0, 3])
    assert row_ids(lengths).tolist() == [0, 0, 2, 2, 2]
    assert offsets_of(lengths).tolist() == [0, 2, 2, 5]


def test_pool_attention_matches_dense_reference_values_and_grads():
    torch.manual_seed(1)
    B, M, D, H = 7, 3, 8, 2
    # empty and very long rows; 6 & 7 and 2400 & 2500 share a length bucket (padded to its longest)
    lengths = torch.tensor([5, 0, 1, 2500, 6, 7, 2400])
    N = int(lengths.sum())
    q = torch.randn(B, M, D, requires_grad=True)
    k = torch.randn(N, D, requires_grad=True)
    v = torch.randn(N, D, requires_grad=True)
    out = pool_attention(q, k, v, lengths, H)
    ref = []
    for b, (kb, vb) in enumerate(zip(_rows(k, lengths), _rows(v, lengths))):
        if len(kb) == 0:
            ref.append(torch.zeros(M, D))
            continue
        qh = q[b].view(M, H, D // H).transpose(0, 1)
        kh = kb.view(-1, H, D // H).transpose(0, 1)
        vh = vb.view(-1, H, D // H).transpose(0, 1)
        a = torch.softmax(qh @ kh.transpose(1, 2) / (D // H) ** 0.5, dim=-1) @ vh
        ref.append(a.transpose(0, 1).reshape(M, D))
    ref = torch.stack(ref)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad((out * g).sum(), (q, k, v))
    grads_ref = torch.autograd.grad((ref * g).sum(), (q, k, v))
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_recent_window_right_aligned_and_masked():
    lengths = torch.tensor([2, 0, 5])
    values = torch.arange(7, dtype=torch.float32).unsqueeze(1)  # row0: 0,1  row2: 2..6
    x, valid = recent_window(values, lengths, 3)
    assert x.shape == (3, 3, 1)
    assert valid.tolist() == [[False, True, True], [False, False, False], [True, True, True]]
    assert x[0, :, 0].tolist() == [0, 0, 1]
    assert x[2, :, 0].tolist() == [4, 5, 6]  # the three most recent, newest last
    assert x[1].abs().sum() == 0


def test_recent_window_has_k_slots_whatever_the_batch():
    """A row's window must not depend on its batch-mates (serving scores rows in other batches)."""
    alone, _ = recent_window(torch.tensor([[7.0]]), torch.tensor([1]), 4)
    both, valid = recent_window(torch.arange(7, dtype=torch.float32).unsqueeze(1),
                                torch.tensor([1, 6]), 4)
    assert alone.shape == (1, 4, 1) and both.shape == (2, 4, 1)
    assert both[0, :, 0].tolist() == [0, 0, 0, 0.0] and valid[0].tolist() == [
        False,
        False,
        False,
        True,
    ]
    assert torch.equal(alone[0, :, 0], torch.tensor([0, 0, 0, 7.0]))
    x, valid = recent_window(torch.zeros(0, 4), torch.tensor([0, 0]), 64)
    assert x.shape == (2, 64, 4) and not valid.any()


def test_pool_attention_sink_is_one_more_softmax_slot():
    torch.manual_seed(2)
    B, M, D, H = 4, 2, 4, 1
    lengths = torch.tensor([2, 0, 3, 4])  # 3 and 4 share a bucket
    q, k, v = torch.randn(B, M, D), torch.randn(9, D), torch.randn(9, D)
    sink_logit, sink_value = torch.randn(M, H), torch.randn(M, D)
    out = pool_attention(q, k, v, lengths, H, sink_logit, sink_value)
    off = offsets_of(lengths).tolist()
    for b in range(B):
        kb, vb = k[off[b]:off[b + 1]], v[off[b]:off[b + 1]]
        for m in range(M):
            s = torch.cat([kb @ q[b, m] / D**0.5, sink_logit[m]])
            a = torch.softmax(s, 0)
            ref = (a[:-1, None] * vb).sum(0) + a[-1] * sink_value[m]
            torch.testing.assert_close(out[b, m], ref, atol=1e-5, rtol=1e-5)
    # no events at all: every row returns the sink value
    out0 = pool_attention(q, k[:0], v[:0], torch.zeros(B, dtype=torch.long), H, sink_logit,
                          sink_value)
    torch.testing.assert_close(out0, sink_value.expand(B, M, D))
