"""Measurements of the ops: jagged vs padded attention, FP8 saved activations, compressed tables.

Used by ``benchmarks/jagged.py`` (the full table) and ``opengem bench --quick`` (the headline
figures). Timings are the fastest of several forward + backward calls; memory is what autograd saves
for backward (bytes, via saved-tensor hooks).
"""

from __future__ import annotations

import copy
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from opengem.data.loader import ShardLoader
from opengem.evaluation.metrics import ne
from opengem.features.schema import FeatureSchema
from opengem.model.build import build_gem, materialize
from opengem.ops.fp8 import fp8_saved_activations
from opengem.ops.jagged import jagged_attention
from opengem.ops.quantize import quantize_tables, table_bytes
from opengem.recipes import recipe
from opengem.train.losses import masked_bce
from opengem.train.optim import build_optimizers
from opengem.train.step import train_step
from opengem.world.generate import generate
from opengem.world.presets import world_config


def lognormal_lengths(b: int, median: float, max_len: int, sigma: float = 1.0, seed: int = 0) -> torch.Tensor:
    g = np.random.default_rng(seed)
    lengths = np.clip(np.round(median * np.exp(sigma * g.standard_normal(b))), 1, max_len).astype(np.int64)
    lengths[np.argmax(lengths)] = max_len
    return torch.from_numpy(lengths)


def _saved_bytes(fn) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total, out


def _time(fn, reps: int, min_total_s: float = 1.0) -> float:
    """Fastest of ``reps``+ timed calls (more while under ``min_total_s``): the machine is shared."""
    fn()  # warm-up: SDPA's first call per shape costs several times a later one
    times: list[float] = []
    while len(times) < reps or (sum(times) < min_total_s and len(times) < 20):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def attention_case(b: int, median: float, max_len: int, dim: int, heads: int, reps: int) -> dict:
    lengths = lognormal_lengths(b, median, max_len)
    n, dh = int(lengths.sum()), dim // heads
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, dim, generator=g, requires_grad=True) for _ in range(3))
    qp, kp, vp = (torch.randn(b, heads, max_len, dh, generator=g, requires_grad=True) for _ in range(3))

    def jagged():
        out = jagged_attention(q, k, v, lengths, heads, causal=True)
        out.sum().backward()
        return out

    def padded():
        out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True)
        out.sum().backward()
        return out

    t_j, t_p = _time(jagged, reps), _time(padded, reps)
    bytes_j, _ = _saved_bytes(lambda: jagged_attention(q, k, v, lengths, heads, causal=True))
    bytes_p, _ = _saved_bytes(lambda: F.scaled_dot_product_attention(qp, kp, vp, is_causal=True))
    mean = float(lengths.float().mean())
    sum_sq = float((lengths.double() ** 2).sum())
    return {"rows": b, "median": median, "mean_len": round(mean, 1), "max_len": max_len, "events": n,
            "dim": dim, "heads": heads, "jagged_s": t_j, "padded_s": t_p,
            "padded_over_jagged_time": t_p / t_j, "goal_0.8_max_over_mean": 0.8 * max_len / mean,
            "ideal_flops_ratio": b * max_len**2 / sum_sq,
            "jagged_saved_bytes": bytes_j, "padded_saved_bytes": bytes_p}


def trained_tiny(tmp: str, epochs: int):
    cfg = recipe("tiny")
    generate(world_config("tiny", seed=0), tmp, progress=False)
    schema = FeatureSchema.load(tmp)
    model = materialize(build_gem(schema, cfg.model))
    loader = ShardLoader(tmp, "train", cfg.data.batch_size, shuffle=False, epochs=epochs,
                         max_seq_len=model.max_seq_len())
    dense, sparse = build_optimizers(model.dense_parameters(), model.sparse_parameters(), cfg.optim)
    opts = [o for o in (dense, sparse) if o is not None]
    task_w = torch.ones(len(schema.tasks))
    pos = torch.zeros(len(schema.tasks))
    seen = 0
    for batch in loader:
        train_step(model, opts, batch, task_w, schema.num_domains)
        pos += (batch.labels * batch.label_mask).sum(0)
        seen += batch.labels.shape[0]
    test = list(ShardLoader(tmp, "test", 512, shuffle=False, epochs=1, max_seq_len=model.max_seq_len()))
    return model, test, (pos / seen).tolist()


def fp8_step(model, batch) -> dict:
    task_w = torch.ones(batch.labels.shape[1])

    def loss():
        return masked_bce(model(batch), batch.labels, batch.label_mask, batch.weights, task_w)[0]

    model.zero_grad()
    loss().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    with fp8_saved_activations(model, min_bytes=1024) as stats:
        out = loss()
    out.backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    err = math.sqrt(sum(float((got[n] - ref[n]).pow(2).sum()) for n in ref) / sum(float(r.pow(2).sum())
                                                                                    for r in ref.values()))
    cos = min(float(F.cosine_similarity(got[n].flatten(), ref[n].flatten(), dim=0)) for n in ref
              if ref[n].abs().sum() > 0)
    return {"fp8_saved_bytes_ratio": stats.ratio, "fp8_saved_mb_fp32": stats.original / 2**20,
            "fp8_saved_mb_fp8": stats.stored / 2**20, "fp8_tensors": stats.quantised,
            "fp8_grad_rel_l2_err": err, "fp8_grad_min_cosine": cos}


@torch.no_grad()
def table_ne(model, test, base_rates) -> dict:
    model.eval()

    def predict(m):
        return torch.cat([torch.sigmoid(m(b)) for b in test]).numpy()

    y = torch.cat([b.labels for b in test]).numpy()
    mask = torch.cat([b.label_mask for b in test]).numpy()
    p32 = predict(model)
    out = {"table_dim": model.cfg.embedding_dim, "table_mb_fp32": table_bytes(model) / 2**20, "ne_rows": len(y)}
    nes32 = [ne(p32[mask[:, t], t], y[mask[:, t], t], base_rates[t]) for t in range(y.shape[1])]
    out["ne_fp32"] = nes32
    for dtype in ("int8", "fp16"):
        q = quantize_tables(copy.deepcopy(model), dtype)
        p = predict(q)
        nes = [ne(p[mask[:, t], t], y[mask[:, t], t], base_rates[t]) for t in range(y.shape[1])]
        out[f"{dtype}_table_bytes_ratio"] = table_bytes(model) / table_bytes(q)
        out[f"ne_{dtype}"] = nes
        out[f"ne_cost_{dtype}_pct"] = [100 * (a / b - 1) for a, b in zip(nes, nes32)]
        out[f"max_abs_dp_{dtype}"] = float(np.abs(p - p32).max())
    return out
