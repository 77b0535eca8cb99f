"""Jagged sequence ops, plain-PyTorch reference implementations (the default path).

Legend: B rows, N events summed over rows (jagged values), M pooling queries, H heads,
D model dim, Dh = D / H, K recent-window length.

A jagged tensor is (values [N, D], lengths [B]); row b owns values[offsets[b]:offsets[b+1]],
oldest → newest. Example with lengths [2, 0, 3]::

    values  = [e00 e01 | e20 e21 e22]       row ids = [0 0 2 2 2]

Costs grow with N (the real number of events), never with B × max_len:
``pool_attention`` is O(N·M·D) and ``jagged_attention`` O(Σ_b L_b²·D), each up to a factor < 2 of
in-bucket padding; ``recent_window`` copies O(B·K·D).

``impl="triton"`` runs the same op as a Triton kernel (``opengem.ops.triton_jagged``, forward and
backward, no padding at all); it needs the optional ``triton`` package and CUDA tensors, or CPU
tensors with ``TRITON_INTERPRET=1`` set before the first call (tests only: the interpreter is slow).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IMPLS = ("reference", "triton")


def _triton_ops():
    """The Triton module, or a clear error when the optional dependency is missing."""
    try:
        from opengem.ops import triton_jagged
    except ImportError as e:  # only triton itself is optional here
        raise RuntimeError(f"impl='triton' needs the optional 'triton' package (pip install "
                           f"triton): {e}") from e
    return triton_jagged


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"jagged op impl must be one of {IMPLS}, got {impl!r}")


def row_ids(lengths: torch.Tensor) -> torch.Tensor:
    """[N] row index of each jagged value."""
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)


def offsets_of(lengths: torch.Tensor) -> torch.Tensor:
    """[B+1] exclusive cumulative sum of lengths."""
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])


def _length_buckets(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                    list[tuple[int, int, torch.Tensor]]]:
    """Non-empty rows grouped into buckets whose lengths differ by < √2, each padded to its own
    longest row.

    Returns (rows [R], idx [Σ_b R_b·L_b], buckets): ``rows`` lists the rows bucket after bucket,
    ``idx`` points each padded slot into the jagged values (0 for padding: mask it), and each bucket
    is (R_b, L_b, valid [R_b, L_b]). Callers gather once with ``idx`` and ``split`` per bucket: one
    gather (and one scatter in backward) instead of one per bucket, which dominated the step on CPU.
    """
    offsets = offsets_of(lengths)
    bucket = torch.ceil(2 * torch.log2(lengths.clamp(min=1).double())).long()
    bucket = torch.where(lengths > 0, bucket, -1)
    order = torch.argsort(bucket, stable=True)
    counts = torch.bincount(bucket + 1).tolist()
    start, rows_all, idx_all, buckets = counts[0], [], [], []
    for c in counts[1:]:
        if c == 0:
            continue
        rows = order[start:start + c]
        start += c
        lens = lengths[rows]
        L = int(lens.max())
        pos = torch.arange(L, device=lengths.device)
        valid = pos.unsqueeze(0) < lens.unsqueeze(1)  # [R, L]
        rows_all.append(rows)
        idx_all.append(torch.where(valid, offsets[rows].unsqueeze(1) + pos, 0).view(-1))
        buckets.append((c, L, valid))
    if not buckets:
        empty = lengths.new_zeros(0)
        return empty, empty, []
    return torch.cat(rows_all), torch.cat(idx_all), buckets


def pool_attention(
    q_BMD: torch.Tensor, k_ND: torch.Tensor, v_ND: torch.Tensor, lengths: torch.Tensor,
    num_heads: int, sink_logit_MH: torch.Tensor | None = None,
    sink_value_MD: torch.Tensor | None = None, impl: str = "reference",
) -> torch.Tensor:
    """Learnable-query (PMA-style) attention pooling over each row's events.

    out[b, m] = Σ_{n in row b} softmax_n(q[b, m]·k[n] / √Dh) v[n], per head.
    With a sink (logit s[m, h], value u[m]) the softmax has one more slot: out = Σ a_n v_n + a_0 u,
    so a row can attend to "nothing" and a decayed *fraction* Σ w·x / (1 + Σ w) is representable.
    Rows with no events return zeros (or the sink value). Returns [B, M, D].

    The reference runs batched matmuls [R, H, M, Dh] × [R, H, Dh, L] per length bucket (see
    ``_length_buckets``): for the same O(N·M·D) cost, matmuls beat scoring every event against its
    row's queries elementwise ([N, M, H, Dh] products) on CPU (docs/experiments.md, 'Figures moved
    from code docstrings').
    """
    _check_impl(impl)
    if impl == "triton":
        return _triton_ops().pool_attention(q_BMD, k_ND, v_ND, lengths, num_heads, sink_logit_MH,
                                            sink_value_MD)
    B, M, D = q_BMD.shape
    H, Dh = num_heads, D // num_heads
    sink = sink_logit_MH is not None
    out = sink_value_MD.view(1, M, D).expand(B, M, D) if sink else q_BMD.new_zeros(B, M, D)
    rows, idx, buckets = _length_buckets(lengths)
    if not buckets:
        return out.contiguous()
    q_all = q_BMD.view(B, M, H, Dh).transpose(1, 2)[rows]  # [R, H, M, Dh]
    kv_all = torch.cat([k_ND, v_ND], dim=1)[idx]  # [Σ R·L, 2D], one gather for every bucket
    outs = []
    for (R, L, valid), q, kv in zip(buckets, q_all.split([b[0] for b in buckets]),
                                    kv_all.split([b[0] * b[1] for b in buckets])):
        k, v = kv.view(R, L, 2, H, Dh).unbind(2)
        s = torch.matmul(q, k.permute(0, 2, 3, 1)) * Dh**-0.5  # [R, H, M, L]
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
        if sink:
            s = torch.cat([s, sink_logit_MH.t().reshape(1, H, M, 1).expand(R, H, M, 1)], dim=-1)
        a = torch.softmax(s, dim=-1)
        o = torch.matmul(a[..., :L], v.transpose(1, 2))  # [R, H, M, Dh]
        if sink:
            o = o + a[..., L:] * sink_value_MD.view(M, H, Dh).transpose(0, 1)
        outs.append(o)
    return out.index_copy(0, rows, torch.cat(outs).transpose(1, 2).reshape(-1, M, D))


def jagged_attention(q_ND: torch.Tensor, k_ND: torch.Tensor, v_ND: torch.Tensor,
                     lengths: torch.Tensor, num_heads: int, causal: bool = True,
                     impl: str = "reference") -> torch.Tensor:
    """Multi-head self-attention inside each row of a jagged batch (rows never see each other).

    out[n] = Σ_{m in n's row, m <= n if causal} softmax_m(q[n]·k[m] / √Dh) v[m], per head. With
    lengths [2, 0, 3], causal: e20 sees e20; e21 sees e20 e21; e22 sees e20 e21 e22. Returns [N, D].

    The reference sorts rows into buckets whose lengths differ by < √2 and runs SDPA on each bucket
    padded to its own longest row, so it costs < 2·Σ L_b² (never B × max_len²); right padding and
    the causal or key mask keep padded slots out of every real row's softmax.
    """
    _check_impl(impl)
    if impl == "triton":
        return _triton_ops().jagged_attention(q_ND, k_ND, v_ND, lengths, num_heads, causal)
    N, D = q_ND.shape
    H, Dh = num_heads, D // num_heads
    _, idx, buckets = _length_buckets(lengths)
    if not buckets:
        return q_ND.new_zeros(N, D)
    qkv_all = torch.cat([q_ND, k_ND, v_ND], dim=1)[idx]  # [Σ R·L, 3D]
    outs, keep = [], []
    for (R, L, valid), qkv in zip(buckets, qkv_all.split([b[0] * b[1] for b in buckets])):
        q, k, v = (t.transpose(1, 2) for t in qkv.view(R, L, 3, H, Dh).unbind(2))  # [R, H, L, Dh]
        if causal:  # padding sits after each row's last event, so real queries never reach it
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :])
        outs.append(a.transpose(1, 2).reshape(R * L, D))
        keep.append(valid.view(-1))
    keep_all = torch.cat(keep)
    return q_ND.new_zeros(N, D).index_copy(0, idx[keep_all], torch.cat(outs)[keep_all])


def recent_window(values_ND: torch.Tensor, lengths: torch.Tensor,
                  k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last ``k`` events of each row, right-aligned (newest in the last slot).

    Returns (x [B, k, D], valid [B, k] bool). Always ``k`` slots, never the batch's longest row: a
    row's tokens (and so its score) must not depend on which rows share its batch.
    """
    B, D = lengths.numel(), values_ND.shape[-1]
    kk = k
    ends = torch.cumsum(lengths, 0)  # [B]
    pos = torch.arange(kk, device=lengths.device) - kk  # [-K' .. -1]
    idx = ends.unsqueeze(1) + pos.unsqueeze(0)  # [B, K']
    valid = pos.unsqueeze(0) >= -lengths.unsqueeze(1)
    idx = torch.where(valid, idx, torch.zeros_like(idx))
    if values_ND.shape[0] == 0:
        return values_ND.new_zeros(B, kk, D), valid
    x = values_ND[idx.view(-1)].view(B, kk, D) * valid.unsqueeze(-1).to(values_ND.dtype)
    return x, valid
