"""FP8 storage of the activations autograd saves for backward.

Inside ``fp8_saved_activations()``, every floating tensor that autograd saves and that is at least
``min_bytes`` large is stored as float8_e4m3fn with one scale per tensor (amax / 448, e4m3's
largest finite value) and dequantised to its own dtype when backward unpacks it. Compute stays in
the original precision; only what waits for backward shrinks, ~4x against fp32 (2x against bf16).

    with fp8_saved_activations(model, min_bytes=1 << 16) as stats:
        loss = loss_fn(model(batch))
    loss.backward()
    stats.ratio  # bytes autograd would have kept / bytes kept

Not quantised: parameters (and views of them: they stay alive anyway, a copy would add memory),
integer and bool tensors (indices, masks), and tensors under ``min_bytes``. A tensor saved twice
(the same live tensor: storage, offset, shape, version) is packed once.
The error this adds to gradients is measured in ``tests/unit/ops/test_fp8_quantize.py`` and
``benchmarks/jagged.py``; e4m3 has a 3-bit mantissa, so each stored value is off by ≤ 2⁻⁴ relative.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448.0
_POS_INF_CODE, _NEG_INF_CODE = 0x7F, 0xFF  # e4m3fn's NaN encodings, one per sign
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class SavedBytes:
    """Bytes of the tensors autograd saved inside the context: as given (``original``), as
    kept (``stored``)."""

    original: int = 0
    stored: int = 0
    quantised: int = 0  # number of tensors stored in fp8

    @property
    def ratio(self) -> float:
        return self.original / max(self.stored, 1)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / scale as float8_e4m3fn, fp32 scale), scale = amax of the finite values / 448 (1 if
    all zero).

    e4m3fn has no infinity (a cast saturates ±inf to ±448), so ±inf (additive masks) are written as
    the two NaN codes 0x7F / 0xFF and restored by ``dequantize_fp8``; no host sync is needed.
    """
    x = x.detach().float()
    finite = torch.isfinite(x)
    amax = torch.where(finite, x.abs(), 0.0).amax()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    bits = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
    bits = torch.where(finite, bits,
                       torch.where(x < 0, _NEG_INF_CODE, _POS_INF_CODE).to(torch.uint8))
    return bits.view(FP8), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    bits = q.view(torch.uint8)
    x = q.float() * scale
    x = torch.where(bits == _POS_INF_CODE, float("inf"),
                    torch.where(bits == _NEG_INF_CODE, float("-inf"), x))
    return x.to(dtype)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@contextlib.contextmanager
def fp8_saved_activations(model: nn.Module | None = None,
                          min_bytes: int = 1 << 16) -> Iterator[SavedBytes]:
    """Store saved activations ≥ ``min_bytes`` in fp8 while the block runs; yields the byte counts.

    ``model``'s parameters are never quantised (pass the module being run). Backward may run after
    the block ends: the packed tensors carry everything unpacking needs.
    """
    stats = SavedBytes()
    params = {_storage_ptr(p) for p in model.parameters()} if model is not None else set()
    cache: dict[tuple, tuple] = {}

    def pack(t: torch.Tensor):
        # tensor subclasses (DTensor, ...) pass through
        if type(t) not in (torch.Tensor, nn.Parameter):
            return t
        key = (_storage_ptr(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t._version,
               t.dtype)
        hit = cache.get(key)
        if hit is not None and hit[0]() is t:  # the same live tensor, not a new one in freed memory
            return hit[1]
        keep = (t.dtype not in _FLOATS or _nbytes(t) < min_bytes or key[0] in params or t.is_sparse
                or t.layout != torch.strided)
        if keep:
            packed = t
            stored = _nbytes(t) if key[0] not in params else 0
        else:
            q, scale = quantize_fp8(t)
            packed = (q, scale, t.dtype)
            stored = _nbytes(q) + _nbytes(scale)
            stats.quantised += 1
        if key[0] not in params:
            stats.original += _nbytes(t)
        stats.stored += stored
        cache[key] = (weakref.ref(t), packed)
        return packed

    def unpack(packed):
        if isinstance(packed, tuple):
            return dequantize_fp8(*packed)
        return packed

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield stats
    finally:
        cache.clear()
