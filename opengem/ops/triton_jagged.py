"""Triton kernels for the jagged attention ops of ``opengem.ops.jagged`` (forward and backward).

Legend: B rows, N events summed over rows (jagged values), M pooling queries, H heads,
D model dim, Dh = D / H, L_b the length of row b.

Both ops read packed (jagged) values [N, D] with per-row offsets and never pad a row:

- ``jagged_attention``: multi-head self-attention inside each row, causal or not. Work items are
  (row, block of BLOCK rows) pairs, so the cost is Σ_b L_b² per head (Σ_b L_b²/2 causal).
- ``pool_attention``: M learnable queries per row attend over that row's events (plus an optional
  "attend to nothing" sink slot). One program per (row, head); cost Σ_b L_b · M.

Softmax is online (flash-style): a program keeps a running max, denominator and output, so memory
is O(N·D) whatever the longest row. The forward saves the log-sum-exp (base 2) per query; the
backward recomputes the probabilities from it. Example, lengths [2, 0, 3], BLOCK = 2::

    values     [e00 e01 | e20 e21 e22]
    work items (row 0, rows 0-1) (row 2, rows 0-1) (row 2, row 2)     row 1 costs nothing

Kernels accumulate in fp32; fp32 inputs use IEEE fp32 dots (no TF32) so results match the
reference to ~1e-6. These run on CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` is set
before this module is imported (how the unit tests run them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _tile(PTR, rows, stride, col0, offs_d, mask):
    """[len(rows), BLOCK_D] values of one head (columns col0 ..) of a row-major [*, D] tensor; 0
    off ``mask``."""
    return tl.load(PTR + rows[:, None] * stride + col0 + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _work_item(offsets, blk_row, blk_start):
    """This program's (first value of its row, the row's length, first position of its block)."""
    pid = tl.program_id(0)
    row, start = tl.load(blk_row + pid), tl.load(blk_start + pid)
    seq0 = tl.load(offsets + row).to(tl.int64)
    return seq0, tl.load(offsets + row + 1) - seq0, start


@triton.jit
def _kv_block(K, V, seq0, start_n, L, sk, sv, h, offs_d, d_ok, DH: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """Positions, validity, mask and the K, V tiles (one head) of the key block at ``start_n``."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < L
    kv_mask = n_ok[:, None] & d_ok[None, :]
    return offs_n, n_ok, kv_mask, _tile(K, seq0 + offs_n, sk, h * DH, offs_d, kv_mask), _tile(
        V, seq0 + offs_n, sv, h * DH, offs_d, kv_mask)


@triton.jit
def _query_side(Q, DO, LSE, DELTA, rows_m, m_ok, q_mask, sq, sdo, h, offs_d, H: tl.constexpr,
                DH: tl.constexpr):
    """What backward reads per query block: Q, dO (one head), the saved log-sum-exp and Δ."""
    q = _tile(Q, rows_m, sq, h * DH, offs_d, q_mask)
    do = _tile(DO, rows_m, sdo, h * DH, offs_d, q_mask)
    lse = tl.load(LSE + rows_m * H + h, mask=m_ok, other=0.0)
    return q, do, lse, tl.load(DELTA + rows_m * H + h, mask=m_ok, other=0.0)


@triton.jit
def _keep(m_ok, n_ok, offs_m, offs_n, CAUSAL: tl.constexpr):
    """[BLOCK_M, BLOCK_N] pairs that count: real query and key, and key not after query
    when causal."""
    keep = m_ok[:, None] & n_ok[None, :]
    if CAUSAL:
        keep = keep & (offs_m[:, None] >= offs_n[None, :])
    return keep


@triton.jit
def _online_softmax_step(q, k, v, keep, m_i, l_i, acc, qk_scale, PREC: tl.constexpr):
    """Fold one key/value block into the running max ``m_i``, denominator ``l_i`` and output ``acc``
    (base-2 exponent; scores off ``keep`` are -inf; a query with no key yet keeps p = 0, no NaN)."""
    s = tl.where(keep, tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    return (
        m_new,
        l_i * alpha + tl.sum(p, 1),
        acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC),
    )


@triton.jit
def _probs_and_dscores(q, k, v, do, lse, delta, keep, qk_scale, PREC: tl.constexpr):
    """Backward of one (query block, key block): probabilities P from the saved log-sum-exp, and
    dS = P ⊙ (dO·Vᵀ − Δ) with Δ = rowsum(dO ⊙ O)."""
    p = tl.where(keep,
                 tl.math.exp2(tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
                              - lse[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    return p, p * (dp - delta[:, None])


@triton.jit
def _attn_fwd(Q, K, V, O, LSE, offsets, blk_row, blk_start, sq, sk, sv, so, qk_scale,
              H: tl.constexpr, DH: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    h = tl.program_id(1)
    seq0, L, start_m = _work_item(offsets, blk_row, blk_start)
    offs_m, offs_d = start_m + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    m_ok, d_ok = offs_m < L, offs_d < DH
    rows_m = seq0 + offs_m
    q = _tile(Q, rows_m, sq, h * DH, offs_d, m_ok[:, None] & d_ok[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = L
    if CAUSAL:  # a query block sees key blocks up to its own last row
        hi = tl.minimum(L, start_m + BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n, n_ok, _, k, v = _kv_block(K, V, seq0, start_n, L, sk, sv, h, offs_d, d_ok, DH,
                                          BLOCK_N)
        keep = _keep(m_ok, n_ok, offs_m, offs_n, CAUSAL)
        m_i, l_i, acc = _online_softmax_step(q, k, v, keep, m_i, l_i, acc, qk_scale, PREC)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(O + rows_m[:, None] * so + h * DH + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])
    tl.store(LSE + rows_m * H + h, m_i + tl.math.log2(l_safe), mask=m_ok)


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, offsets, blk_row, blk_start, sq, sk, sv, sdo,
                   qk_scale, sm_scale, H: tl.constexpr, DH: tl.constexpr, CAUSAL: tl.constexpr,
                   PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """One (row, key block, head): dK, dV over every query block that sees the keys."""
    h = tl.program_id(1)
    seq0, L, start_n = _work_item(offsets, blk_row, blk_start)
    offs_n, offs_d = start_n + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    n_ok, d_ok = offs_n < L, offs_d < DH
    rows_n = seq0 + offs_n
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = _tile(K, rows_n, sk, h * DH, offs_d, kv_mask)
    v = _tile(V, rows_n, sv, h * DH, offs_d, kv_mask)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo = start_n * 0
    if CAUSAL:  # a key block is seen by query blocks from its own first row on
        lo = (start_n // BLOCK_M) * BLOCK_M
    for start_m in range(lo, L, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < L
        rows_m = seq0 + offs_m
        q_mask = m_ok[:, None] & d_ok[None, :]
        q, do, lse, delta = _query_side(Q, DO, LSE, DELTA, rows_m, m_ok, q_mask, sq, sdo, h, offs_d,
                                        H, DH)
        keep = _keep(m_ok, n_ok, offs_m, offs_n, CAUSAL)
        p, ds = _probs_and_dscores(q, k, v, do, lse, delta, keep, qk_scale, PREC)
        dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PREC)
        dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PREC)
    tl.store(DK + rows_n[:, None] * DH * H + h * DH + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty),
             mask=kv_mask)
    tl.store(DV + rows_n[:, None] * DH * H + h * DH + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=kv_mask)


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, offsets, blk_row, blk_start, sq, sk, sv, sdo,
                 qk_scale, sm_scale, H: tl.constexpr, DH: tl.constexpr, CAUSAL: tl.constexpr,
                 PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """One (row, query block, head): dQ over every key block the queries see."""
    h = tl.program_id(1)
    seq0, L, start_m = _work_item(offsets, blk_row, blk_start)
    offs_m, offs_d = start_m + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    m_ok, d_ok = offs_m < L, offs_d < DH
    rows_m = seq0 + offs_m
    q_mask = m_ok[:, None] & d_ok[None, :]
    q, do, lse, delta = _query_side(Q, DO, LSE, DELTA, rows_m, m_ok, q_mask, sq, sdo, h, offs_d, H,
                                    DH)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = L
    if CAUSAL:  # a query block sees key blocks up to its own last row
        hi = tl.minimum(L, start_m + BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n, n_ok, _, k, v = _kv_block(K, V, seq0, start_n, L, sk, sv, h, offs_d, d_ok, DH,
                                          BLOCK_N)
        keep = _keep(m_ok, n_ok, offs_m, offs_n, CAUSAL)
        _, ds = _probs_and_dscores(q, k, v, do, lse, delta, keep, qk_scale, PREC)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    tl.store(DQ + rows_m[:, None] * DH * H + h * DH + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=q_mask)


@triton.jit
def _pool_fwd(Q, K, V, SL, SV, O, LSE, offsets, sqb, sqm, sk, sv, qk_scale,
              M: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, SINK: tl.constexpr,
              PREC: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr):
    """One (row, head): the row's M queries attend over its L events (+ the sink slot)."""
    b, h = tl.program_id(0), tl.program_id(1)
    seq0 = tl.load(offsets + b).to(tl.int64)
    L = tl.load(offsets + b + 1) - seq0
    offs_q, offs_d = tl.arange(0, BLOCK_Q), tl.arange(0, BLOCK_D)
    q_ok, d_ok = offs_q < M, offs_d < DH
    q_mask = q_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sqb + offs_q[:, None] * sqm + h * DH + offs_d[None, :], mask=q_mask,
                other=0.0)
    if SINK:  # the sink is one more softmax slot whose logit is not scaled by 1/√Dh
        m_i = tl.load(SL + offs_q * H + h, mask=q_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_Q], 1.0, tl.float32)
        acc = tl.load(SV + offs_q[:, None] * (H * DH) + h * DH + offs_d[None, :], mask=q_mask,
                      other=0.0)
        acc = acc.to(tl.float32)
    else:
        m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q], tl.float32)
        acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    for start_n in range(0, L, BLOCK_N):
        _, n_ok, _, k, v = _kv_block(K, V, seq0, start_n, L, sk, sv, h, offs_d, d_ok, DH, BLOCK_N)
        m_i, l_i, acc = _online_softmax_step(q, k, v, n_ok[None, :], m_i, l_i, acc, qk_scale, PREC)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(O + (b * M + offs_q)[:, None] * (H * DH) + h * DH + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=q_mask)
    tl.store(LSE + (b * M + offs_q) * H + h, m_i + tl.math.log2(l_safe), mask=q_ok)


@triton.jit
def _pool_bwd(Q, K, V, DO, LSE, DELTA, DQ, DK, DV, offsets, sqb, sqm, sk, sv, qk_scale, sm_scale,
              M: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, PREC: tl.constexpr,
              BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (row, head): dK, dV of every event (each event belongs to one row) and dQ of the row."""
    b, h = tl.program_id(0), tl.program_id(1)
    seq0 = tl.load(offsets + b).to(tl.int64)
    L = tl.load(offsets + b + 1) - seq0
    offs_q, offs_d = tl.arange(0, BLOCK_Q), tl.arange(0, BLOCK_D)
    q_ok, d_ok = offs_q < M, offs_d < DH
    q_mask = q_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sqb + offs_q[:, None] * sqm + h * DH + offs_d[None, :], mask=q_mask,
                other=0.0)
    do = tl.load(DO + (b * M + offs_q)[:, None] * (H * DH) + h * DH + offs_d[None, :], mask=q_mask,
                 other=0.0)
    lse = tl.load(LSE + (b * M + offs_q) * H + h, mask=q_ok, other=0.0)
    delta = tl.load(DELTA + (b * M + offs_q) * H + h, mask=q_ok, other=0.0)
    dq = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    for start_n in range(0, L, BLOCK_N):
        offs_n, n_ok, kv_mask, k, v = _kv_block(K, V, seq0, start_n, L, sk, sv, h, offs_d, d_ok, DH,
                                                BLOCK_N)
        rows_n = seq0 + offs_n
        p, ds = _probs_and_dscores(q, k, v, do, lse, delta, q_ok[:, None] & n_ok[None, :], qk_scale,
                                   PREC)
        dv = tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PREC)
        dk = tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PREC) * sm_scale
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
        tl.store(DK + rows_n[:, None] * (H * DH) + h * DH + offs_d[None, :],
                 dk.to(DK.dtype.element_ty), mask=kv_mask)
        tl.store(DV + rows_n[:, None] * (H * DH) + h * DH + offs_d[None, :],
                 dv.to(DV.dtype.element_ty), mask=kv_mask)
    dq_ptrs = DQ + (b * M + offs_q)[:, None] * (H * DH) + h * DH + offs_d[None, :]
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)


def _block_table(offsets: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, first position) of every BLOCK-sized piece of every row: only real events make work."""
    lengths = offsets[1:] - offsets[:-1]
    nblk = (lengths + block - 1) // block
    rows = torch.repeat_interleave(torch.arange(nblk.numel(), device=offsets.device), nblk)
    first = torch.cumsum(nblk, 0) - nblk
    start = (torch.arange(rows.numel(), device=offsets.device) - first[rows]) * block
    return rows.to(torch.int32), start.to(torch.int32)


def _check_device(t: torch.Tensor) -> None:
    if not t.is_cuda and not triton.knobs.runtime.interpret:
        raise RuntimeError("the Triton jagged kernels need CUDA tensors; CPU tensors run only in "
                           "Triton's interpreter (TRITON_INTERPRET=1 set before "
                           "opengem.ops.triton_jagged is imported, and while it runs)")


def _last_dim_contiguous(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t if t.stride(-1) == 1 else t.contiguous() for t in ts]


def _block_d(dh: int) -> int:
    return max(16, triton.next_power_of_2(dh))  # tl.dot needs every dim >= 16 on GPU


class _JaggedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, offsets, num_heads: int, causal: bool, block: int):
        q, k, v = _last_dim_contiguous(q, k, v)
        N, D = q.shape
        H, Dh = num_heads, D // num_heads
        o = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty(N, H, device=q.device, dtype=torch.float32)
        rows, starts = _block_table(offsets, block)
        if rows.numel():
            _attn_fwd[(rows.numel(), H)](
                q, k, v, o, lse, offsets, rows, starts, q.stride(0), k.stride(0), v.stride(0),
                o.stride(0), Dh**-0.5 * LOG2E, H=H, DH=Dh, CAUSAL=causal, PREC=_precision(q.dtype),
                BLOCK_M=block, BLOCK_N=block, BLOCK_D=_block_d(Dh))
        ctx.save_for_backward(q, k, v, o, lse, offsets, rows, starts)
        ctx.cfg = (H, Dh, causal, block)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, offsets, rows, starts = ctx.saved_tensors
        H, Dh, causal, block = ctx.cfg
        do = do.contiguous()
        # [N, H] = dO·O per head
        delta = (do.view(-1, H, Dh).float() * o.view(-1, H, Dh).float()).sum(-1)
        dq, dk, dv = (torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in (q, k, v))
        if rows.numel():
            args = (offsets, rows, starts, q.stride(0), k.stride(0), v.stride(0), do.stride(0),
                    Dh**-0.5 * LOG2E, Dh**-0.5)
            meta = {"H": H, "DH": Dh, "CAUSAL": causal, "PREC": _precision(q.dtype),
                    "BLOCK_M": block, "BLOCK_N": block, "BLOCK_D": _block_d(Dh)}
            _attn_bwd_dkdv[(rows.numel(), H)](q, k, v, do, lse, delta, dk, dv, *args, **meta)
            _attn_bwd_dq[(rows.numel(), H)](q, k, v, do, lse, delta, dq, *args, **meta)
        else:
            dq, dk, dv = dq.zero_(), dk.zero_(), dv.zero_()
        return dq, dk, dv, None, None, None, None


class _PoolAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, offsets, num_heads: int, sink_logit, sink_value, block: int):
        q, k, v = _last_dim_contiguous(q, k, v)
        B, M, D = q.shape
        H, Dh = num_heads, D // num_heads
        sink = sink_logit is not None
        sl = sink_logit.contiguous() if sink else q.new_zeros(1)
        sv = sink_value.contiguous() if sink else q.new_zeros(1)
        o = torch.empty(B, M, D, device=q.device, dtype=q.dtype)
        lse = torch.empty(B, M, H, device=q.device, dtype=torch.float32)
        if B and M:
            _pool_fwd[(B, H)](q, k, v, sl, sv, o, lse, offsets, q.stride(0), q.stride(1),
                              k.stride(0), v.stride(0),
                              Dh**-0.5 * LOG2E, M=M, H=H, DH=Dh, SINK=sink,
                              PREC=_precision(q.dtype),
                              BLOCK_Q=max(16, triton.next_power_of_2(M)), BLOCK_N=block,
                              BLOCK_D=_block_d(Dh))
        ctx.save_for_backward(q, k, v, o, lse, offsets, sl, sv)
        ctx.cfg = (H, Dh, sink, block)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, offsets, sl, sv = ctx.saved_tensors
        H, Dh, sink, block = ctx.cfg
        B, M, D = q.shape
        do = do.contiguous()
        do_h, o_h = do.view(B, M, H, Dh).float(), o.view(B, M, H, Dh).float()
        delta = (do_h * o_h).sum(-1)  # [B, M, H]
        dq = torch.empty(B, M, D, device=q.device, dtype=q.dtype)
        # events of empty rows are none: zeros stay right
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        if B and M:
            _pool_bwd[(B, H)](q, k, v, do, lse, delta, dq, dk, dv, offsets, q.stride(0),
                              q.stride(1), k.stride(0),
                              v.stride(0), Dh**-0.5 * LOG2E, Dh**-0.5, M=M, H=H, DH=Dh,
                              PREC=_precision(q.dtype),
                              BLOCK_Q=max(16, triton.next_power_of_2(M)), BLOCK_N=block,
                              BLOCK_D=_block_d(Dh))
        d_sl = d_sv = None
        if sink:  # the sink slot's gradients are O(B·M·D): plain PyTorch from the saved log-sum-exp
            p0 = torch.exp2(sl.float() * LOG2E - lse)  # [B, M, H]
            u = sv.view(M, H, Dh).float()
            d_sl = (p0 * ((do_h * u).sum(-1) - delta)).sum(0).to(sl.dtype)
            d_sv = (p0.unsqueeze(-1) * do_h).sum(0).reshape(M, D).to(sv.dtype)
        return dq, dk, dv, None, None, d_sl, d_sv, None


def jagged_attention(q_ND: torch.Tensor, k_ND: torch.Tensor, v_ND: torch.Tensor,
                     lengths: torch.Tensor, num_heads: int, causal: bool = True,
                     block: int = 64) -> torch.Tensor:
    """Triton version of ``opengem.ops.jagged.jagged_attention`` (same arguments, [N, D] out)."""
    _check_device(q_ND)
    offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).to(torch.int32)
    return _JaggedAttention.apply(q_ND, k_ND, v_ND, offsets, num_heads, causal, block)


def pool_attention(q_BMD: torch.Tensor, k_ND: torch.Tensor, v_ND: torch.Tensor,
                   lengths: torch.Tensor, num_heads: int, sink_logit_MH: torch.Tensor | None = None,
                   sink_value_MD: torch.Tensor | None = None, block: int = 64) -> torch.Tensor:
    """Triton version of ``opengem.ops.jagged.pool_attention`` (same arguments, [B, M, D] out)."""
    _check_device(q_BMD)
    offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).to(torch.int32)
    return _PoolAttention.apply(q_BMD, k_ND, v_ND, offsets, num_heads, sink_logit_MH, sink_value_MD,
                                block)
