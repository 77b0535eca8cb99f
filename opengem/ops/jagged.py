"""Jagged sequence ops, plain-PyTorch reference implementations (the default path).

Legend: B rows, N events summed over rows (jagged values), M pooling queries, H heads,
D model dim, Dh = D / H, K recent-window length.

A jagged tensor is (values [N, D], lengths [B]); row b owns values[offsets[b]:offsets[b+1]],
oldest → newest. Example with lengths [2, 0, 3]::

    values  = [e00 e01 | e20 e21 e22]       row ids = [0 0 2 2 2]

Costs grow with N (the real number of events), never with B × max_len:
``pool_attention`` is O(N·M·D); ``recent_window`` copies O(B·K·D).
"""

from __future__ import annotations

import torch


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
    sink_logit_MH: torch.Tensor | None = None, sink_value_MD: torch.Tensor | None = None,
) -> torch.Tensor:
    """Learnable-query (PMA-style) attention pooling over each row's events.

    out[b, m] = Σ_{n in row b} softmax_n(q[b, m]·k[n] / √Dh) v[n], per head.
    With a sink (logit s[m, h], value u[m]) the softmax has one more slot: out = Σ a_n v_n + a_0 u,
    so a row can attend to "nothing" and a decayed *fraction* Σ w·x / (1 + Σ w) is representable.
    Rows with no events return zeros (or the sink value). Returns [B, M, D].
    """
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
