"""Triton jagged kernels vs the plain-PyTorch reference, values and gradients, on CPU.

The kernels run in Triton's interpreter, in one child process started with ``TRITON_INTERPRET=1``:
``triton.jit`` reads the variable when a function is defined, Triton's own ``tl.zeros`` & co.
included (so at ``import triton``), and the interpreter reads it again at launch. Setting it inside
pytest fails as soon as anything (``torch.compile``, another test) imported triton first, with
"Cannot call @triton.jit'd outside of the scope of a kernel". The child runs every ``_check_*``
below once (this file is its script); each test reports one check.

Tolerances (fp32, IEEE dots in the kernels): values atol 2e-5 / rtol 1e-4; gradients atol 1e-4 /
rtol 1e-3 (a 2,100-event row sums 2,100 products per gradient entry).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import opengem.ops
from opengem.ops.jagged import jagged_attention, offsets_of, pool_attention

VALUE_TOL = {"atol": 2e-5, "rtol": 1e-4}
GRAD_TOL = {"atol": 1e-4, "rtol": 1e-3}


def _per_row_sdpa(q, k, v, lengths, H, causal):
    off, outs = offsets_of(lengths).tolist(), []
    for s, e in itertools.pairwise(off):
        if s == e:
            continue
        qh, kh, vh = (t[s:e].view(e - s, H, -1).transpose(0, 1) for t in (q, k, v))
        outs.append(
            F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)
            .transpose(0, 1)
            .reshape(e - s, -1)
        )
    return torch.cat(outs)


def _lengths(seed: int, b: int, hi: int) -> torch.Tensor:
    """b random lengths in [0, hi) plus 0, 1, one block (64) and one block + 1, shuffled."""
    g = torch.Generator().manual_seed(seed)
    extra = torch.randint(0, hi, (b,), generator=g)
    return torch.cat([torch.tensor([0, 1, 64, 65]), extra])[torch.randperm(b + 4, generator=g)]


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def _assert_values_and_grads(out, ref, inputs):
    torch.testing.assert_close(out, ref, **VALUE_TOL)
    g = torch.randn_like(out)
    grads = torch.autograd.grad((out * g).sum(), inputs)
    grads_ref = torch.autograd.grad((ref * g).sum(), inputs)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, **GRAD_TOL)


@pytest.mark.parametrize("causal", [True, False])
def test_reference_jagged_attention_equals_per_row_sdpa(causal):
    lengths = _lengths(0, 12, 150)
    q, k, v = (_randn(int(lengths.sum()), 8, seed=s) for s in (1, 2, 3))
    out = jagged_attention(q, k, v, lengths, 2, causal)
    _assert_values_and_grads(out, _per_row_sdpa(q, k, v, lengths, 2, causal), (q, k, v))


def test_unknown_impl_and_missing_triton_are_clear_errors(monkeypatch):
    q = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="impl must be one of"):
        jagged_attention(q, q, q, torch.tensor([3]), 1, impl="cuda")
    # what a missing triton looks like to an import
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.delitem(sys.modules, "opengem.ops.triton_jagged", raising=False)
    monkeypatch.delattr(opengem.ops, "triton_jagged", raising=False)
    with pytest.raises(RuntimeError, match="needs the optional 'triton' package"):
        pool_attention(q.view(1, 3, 4), q, q, torch.tensor([3]), 1, impl="triton")


# ---- checks run by the interpreter child process -------------------------------------------------

def _check_attention(causal: bool) -> None:
    lengths = _lengths(2, 6, 140)
    q, k, v = (_randn(int(lengths.sum()), 32, seed=s) for s in (3, 4, 5))
    out = jagged_attention(q, k, v, lengths, 2, causal, impl="triton")
    _assert_values_and_grads(out, jagged_attention(q, k, v, lengths, 2, causal), (q, k, v))


def _check_attention_long_row() -> None:
    """One 2,100-event row beside an empty and a single-event row; one head, Dh = 16."""
    lengths = torch.tensor([2100, 0, 1])
    q, k, v = (_randn(2101, 16, seed=s) for s in (6, 7, 8))
    out = jagged_attention(q, k, v, lengths, 1, True, impl="triton")
    _assert_values_and_grads(out, jagged_attention(q, k, v, lengths, 1, True), (q, k, v))


def _check_attention_strided_inputs() -> None:
    """q, k, v as column slices of one fused projection (row stride 3·D), as a qkv Linear
    gives them."""
    lengths = torch.tensor([3, 0, 20])
    qkv = _randn(23, 48, seed=9)
    q, k, v = qkv.chunk(3, dim=-1)
    out = jagged_attention(q, k, v, lengths, 2, True, impl="triton")
    _assert_values_and_grads(out, jagged_attention(q, k, v, lengths, 2, True), (qkv,))


def _check_pool(sink: bool) -> None:
    lengths = torch.cat([_lengths(10, 4, 200), torch.tensor([2500])])
    B, M, D, H = lengths.numel(), 3, 32, 2
    q, k, v = _randn(B, M, D, seed=11), _randn(int(lengths.sum()), D,
                                               seed=12), _randn(int(lengths.sum()), D, seed=13)
    extra = (_randn(M, H, seed=14), _randn(M, D, seed=15)) if sink else (None, None)
    out = pool_attention(q, k, v, lengths, H, *extra, impl="triton")
    inputs = [q, k, v] + ([*extra] if sink else [])
    _assert_values_and_grads(out, pool_attention(q, k, v, lengths, H, *extra), inputs)


def _check_pool_without_events() -> None:
    q, kv = torch.randn(2, 4, 16), torch.zeros(0, 16)
    sink_logit, sink_value = torch.randn(4, 1), torch.randn(4, 16)
    out = pool_attention(q, kv, kv, torch.tensor([0, 0]), 1, sink_logit, sink_value, impl="triton")
    torch.testing.assert_close(out, sink_value.expand(2, 4, 16))
    assert pool_attention(q, kv, kv, torch.tensor([0, 0]), 1, impl="triton").abs().sum() == 0


CHECKS = {
    "attention_causal": lambda: _check_attention(True),
    "attention_bidirectional": lambda: _check_attention(False),
    "attention_long_row_2100": _check_attention_long_row,
    "attention_strided_inputs": _check_attention_strided_inputs,
    "pool": lambda: _check_pool(False),
    "pool_with_sink": lambda: _check_pool(True),
    "pool_without_events": _check_pool_without_events,
}


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__], check=False, env=env, capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).resolve().parents[3])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(CHECKS))
def test_triton_kernel_matches_reference(interpreted, name):
    assert interpreted[name] == "ok", interpreted[name]


if __name__ == "__main__":  # the interpreter child: run every check, one JSON line of results
    torch.set_num_threads(1)
    results = {}
    for name, check in CHECKS.items():
        t0 = time.perf_counter()
        try:
            check()
            results[name] = "ok"
        except Exception:  # noqa: BLE001 (each check reports its own failure)
            results[name] = traceback.format_exc()
        print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(json.dumps(results))
