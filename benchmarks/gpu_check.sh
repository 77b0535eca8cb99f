#!/usr/bin/env bash
# Triton jagged kernels on one GPU: correctness against the reference, then time against SDPA on
# padded input. For a session with a GPU; prepared, not yet run. About 2–3 minutes (first compile
# of each kernel variant included). The last line is one JSON object.
#
#   bash benchmarks/gpu_check.sh            # from the repository root, python with torch + triton
#
# Checks, as max |triton - reference| / max |reference| per tensor: jagged_attention causal and
# bidirectional, pool_attention with and without the sink; lengths 0, 1, 64, 65, random and one row
# of 3,000. fp32 (IEEE dots): values 1e-5, grads 1e-4. bf16 inputs against the fp32 reference on the
# same rounded inputs: 2e-2, 3e-2. (bf16 can't be checked on CPU: the interpreter's bf16 tl.dot is wrong.)
# Timing (bf16, fwd + bwd, median ms via triton.testing.do_bench): B = 256 rows, lognormal lengths
# (median 70, longest 3,000), D = 256, H = 4: triton jagged vs torch SDPA (flash) on [B, H, 3000, 64]
# padded with is_causal, vs the reference jagged op; and pool_attention (M = 8) triton vs reference.
set -euo pipefail
PY=${PYTHON:-python}
"$PY" - <<'EOF'
import json

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from opengem.ops.jagged import jagged_attention, pool_attention  # torch only: runs without the project's deps


def lognormal_lengths(b, median, max_len, sigma=1.0, seed=0):
    """As benchmarks/jagged.py: lognormal, clipped to [1, max_len], the longest row set to max_len."""
    g = torch.Generator().manual_seed(seed)
    lengths = (median * torch.exp(sigma * torch.randn(b, generator=g))).round().clamp(1, max_len).long()
    lengths[lengths.argmax()] = max_len
    return lengths

assert torch.cuda.is_available(), "needs a GPU"
dev = torch.device("cuda")
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}


def grads(y, xs, g):
    return torch.autograd.grad((y.float() * g).sum(), xs)


def rel(a, b):
    """max |a - b| / max |b|: one number per tensor, whatever its scale."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12)).item()


def record(name, tri, ref, tri_grads, ref_grads, tol_v, tol_g):
    err_v = rel(tri, ref)
    err_g = max(rel(a, b) for a, b in zip(tri_grads, ref_grads))
    out[name] = {"rel_err_value": err_v, "rel_err_grad": err_g, "ok": err_v <= tol_v and err_g <= tol_g}


torch.manual_seed(0)
lengths = torch.cat([torch.tensor([0, 1, 64, 65, 3000]), torch.randint(0, 300, (27,))]).to(dev)
N, D, H, M = int(lengths.sum()), 64, 2, 4
for dtype, tol_v, tol_g in ((torch.float32, 1e-5, 1e-4), (torch.bfloat16, 2e-2, 3e-2)):
    tag = str(dtype).split(".")[-1]
    q, k, v = (torch.randn(N, D, device=dev).to(dtype).requires_grad_() for _ in range(3))
    qp = torch.randn(lengths.numel(), M, D, device=dev).to(dtype).requires_grad_()
    sl = torch.randn(M, H, device=dev).to(dtype).requires_grad_()
    sv = torch.randn(M, D, device=dev).to(dtype).requires_grad_()
    # the reference runs in fp32 on the same (rounded) inputs
    q32, k32, v32, qp32, sl32, sv32 = (t.detach().float().requires_grad_() for t in (q, k, v, qp, sl, sv))
    for causal in (True, False):
        ref = jagged_attention(q32, k32, v32, lengths, H, causal)
        tri = jagged_attention(q, k, v, lengths, H, causal, impl="triton")
        g = torch.randn_like(ref)
        record(f"attention_{'causal' if causal else 'bidir'}_{tag}", tri, ref, grads(tri, (q, k, v), g),
               grads(ref, (q32, k32, v32), g), tol_v, tol_g)
    for sink in (False, True):
        ref = pool_attention(qp32, k32, v32, lengths, H, *((sl32, sv32) if sink else (None, None)))
        tri = pool_attention(qp, k, v, lengths, H, *((sl, sv) if sink else (None, None)), impl="triton")
        g = torch.randn_like(ref)
        xs, xs32 = ([qp, k, v, sl, sv], [qp32, k32, v32, sl32, sv32]) if sink else ([qp, k, v], [qp32, k32, v32])
        record(f"pool_{'sink' if sink else 'nosink'}_{tag}", tri, ref, grads(tri, xs, g), grads(ref, xs32, g),
               tol_v, tol_g)

B, D, H, L = 256, 256, 4, 3000
lengths = lognormal_lengths(B, 70, L).to(dev)
N, Dh = int(lengths.sum()), D // H
bf = {"device": dev, "dtype": torch.bfloat16, "requires_grad": True}
q, k, v = (torch.randn(N, D, **bf) for _ in range(3))
qp, kp, vp = (torch.randn(B, H, L, Dh, **bf) for _ in range(3))
go, gp = torch.randn(N, D, device=dev, dtype=torch.bfloat16), torch.randn(B, H, L, Dh, device=dev, dtype=torch.bfloat16)


def fwd_bwd(fn, g):
    return lambda: fn().backward(g)


t_tri = do_bench(fwd_bwd(lambda: jagged_attention(q, k, v, lengths, H, True, impl="triton"), go))
t_ref = do_bench(fwd_bwd(lambda: jagged_attention(q, k, v, lengths, H, True), go))
t_pad = do_bench(fwd_bwd(lambda: F.scaled_dot_product_attention(qp, kp, vp, is_causal=True), gp))
t_tri_f = do_bench(lambda: jagged_attention(q, k, v, lengths, H, True, impl="triton"))
t_pad_f = do_bench(lambda: F.scaled_dot_product_attention(qp, kp, vp, is_causal=True))
mean = float(lengths.float().mean())
qm = torch.randn(B, 8, D, **bf)
gm = torch.randn(B, 8, D, device=dev, dtype=torch.bfloat16)
t_pool_tri = do_bench(fwd_bwd(lambda: pool_attention(qm, k, v, lengths, H, impl="triton"), gm))
t_pool_ref = do_bench(fwd_bwd(lambda: pool_attention(qm, k, v, lengths, H), gm))
out["timing"] = {"rows": B, "mean_len": mean, "max_len": L, "events": N, "dim": D, "heads": H,
                 "triton_fwd_bwd_ms": t_tri, "reference_fwd_bwd_ms": t_ref, "padded_sdpa_fwd_bwd_ms": t_pad,
                 "triton_fwd_ms": t_tri_f, "padded_sdpa_fwd_ms": t_pad_f,
                 "padded_over_triton_time": t_pad / t_tri, "goal_0.8_max_over_mean": 0.8 * L / mean,
                 "pool_triton_fwd_bwd_ms": t_pool_tri, "pool_reference_fwd_bwd_ms": t_pool_ref}
out["all_ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict) and "ok" in v)
print(json.dumps(out))
EOF
