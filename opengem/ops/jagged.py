"""Jagged sequence ops, plain-PyTorch reference implementations (the default path).

Legend: B rows, N events summed over rows (jagged values), M pooling queries, H heads,
D model dim, Dh = D / H, K recent-window length.

A jagged tensor is (values [N, D], lengths [B]); row b owns values[offsets[b]:offsets[b+1]],
oldest → newest. Example with lengths [2, 0, 3]::

    values  = [e00 e01 | e20 e21 e22]       row ids = [0 0 2 2 2]

Costs grow with N (the real number of events), never with B × max_len:
``pool_attention`` is O(N·M·D); ``jagged_attention`` is O(Σ_b L_b²·D) up to a factor < 2 of
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
        raise RuntimeError(f"impl='triton' needs the optional 'triton' package (pip install triton): {e}") from e
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


def segment_softmax(scores: torch.Tensor, rows: torch.Tensor, num_rows: int,
                    sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax of ``scores`` [N, ...] over the values of each row (dim 0 grouped by ``rows``).

    ``sink`` [...] adds one extra logit to every row's softmax (an "attend to nothing" slot); its
    weight per row [B, ...] is returned second (None without a sink).
    """
    shape = (num_rows,) + tuple(scores.shape[1:])
    idx = rows.view(-1, *([1] * (scores.dim() - 1))).expand_as(scores)
    init = sink.expand(shape) if sink is not None else scores.new_full(shape, float("-inf"))
    row_max = init.scatter_reduce(0, idx, scores, "amax", include_self=True).detach()
    ex = torch.exp(scores - row_max.gather(0, idx))
    ex_sink = torch.exp(sink - row_max) if sink is not None else None
    denom = scores.new_zeros(shape).scatter_add(0, idx, ex)
    if ex_sink is not None:
        denom = denom + ex_sink
        return ex / denom.gather(0, idx), ex_sink / denom
    return ex / denom.gather(0, idx), None


def pool_attention(
    q_BMD: torch.Tensor, k_ND: torch.Tensor, v_ND: torch.Tensor, lengths: torch.Tensor, num_heads: int,
    sink_logit_MH: torch.Tensor | None = None, sink_value_MD: torch.Tensor | None = None, impl: str = "reference",
) -> torch.Tensor:
    """Learnable-query (PMA-style) attention pooling over each row's events.

    out[b, m] = Σ_{n in row b} softmax_n(q[b, m]·k[n] / √Dh) v[n], per head.
    With a sink (logit s[m, h], value u[m]) the softmax has one more slot: out = Σ a_n v_n + a_0 u,
    so a row can attend to "nothing" and a decayed *fraction* Σ w·x / (1 + Σ w) is representable.
    Rows with no events return zeros (or the sink value). Returns [B, M, D].
    """
    _check_impl(impl)
    if impl == "triton":
        return _triton_ops().pool_attention(q_BMD, k_ND, v_ND, lengths, num_heads, sink_logit_MH, sink_value_MD)
    B, M, D = q_BMD.shape
    H, Dh = num_heads, D // num_heads
    out = q_BMD.new_zeros(B, M, H, Dh)
    sink = sink_logit_MH is not None
    if k_ND.shape[0] > 0:
        rows = row_ids(lengths)
        q = q_BMD.view(B, M, H, Dh)[rows]  # [N, M, H, Dh]
        k = k_ND.view(-1, 1, H, Dh)
        scores = (q * k).sum(-1) * Dh**-0.5  # [N, M, H]
        attn, a_sink = segment_softmax(scores, rows, B, sink_logit_MH if sink else None)
        weighted = attn.unsqueeze(-1) * v_ND.view(-1, 1, H, Dh)  # [N, M, H, Dh]
        out = out.index_add(0, rows, weighted)
    elif sink:
        a_sink = out.new_ones(B, M, H)
    if sink:
        out = out + a_sink.unsqueeze(-1) * sink_value_MD.view(1, M, H, Dh)
    return out.view(B, M, D)


def jagged_attention(q_ND: torch.Tensor, k_ND: torch.Tensor, v_ND: torch.Tensor, lengths: torch.Tensor,
                     num_heads: int, causal: bool = True, impl: str = "reference") -> torch.Tensor:
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
    out = q_ND.new_zeros(N, H, Dh)
    offsets = offsets_of(lengths)
    bucket = torch.ceil(2 * torch.log2(lengths.clamp(min=1).double())).long()
    for b in torch.unique(bucket[lengths > 0]).tolist():
        rows = torch.nonzero((bucket == b) & (lengths > 0)).squeeze(1)
        lens = lengths[rows]
        L = int(lens.max())
        pos = torch.arange(L, device=lengths.device)
        valid = pos.unsqueeze(0) < lens.unsqueeze(1)  # [R, L]
        idx = torch.where(valid, offsets[rows].unsqueeze(1) + pos, 0)  # [R, L] into the jagged values
        q, k, v = (t[idx].view(-1, L, H, Dh).transpose(1, 2) for t in (q_ND, k_ND, v_ND))
        if causal:  # padding sits after each row's last event, so real queries never reach it
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :])
        out = out.index_put((idx[valid],), a.transpose(1, 2)[valid])
    return out.view(N, D)


def recent_window(values_ND: torch.Tensor, lengths: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
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
