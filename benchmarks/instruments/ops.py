"""Measurements of the ops: GEM's sequence side jagged vs padded, FP8 saved activations,
compressed tables.

Used by ``benchmarks/jagged.py`` (the full table) and ``opengem bench --quick`` (the headline
figures). Memory is what autograd saves for backward (bytes, via saved-tensor hooks).

GEM's sequence side (``sequence_side_case``) is what ``InterFormer`` runs per behaviour stream from
the looked-up event embeddings on: ``SequenceTower.embed`` (time-bucket embedding + LayerNorm), the
target-aware pooled attention over the full history (``first_tokens``: ``pool_kv``,
``pool_attention`` with its sink, ``pool_out``), the recent window, and every tower layer (PFFN,
MHA, FFN, pyramid drop). "jagged" is GEM's own code on (values [N, D], lengths [B]); "padded" is
``padded_tower`` below, the same parameters and math on dense right-aligned [B, L_max, D] input with
a key-padding mask (the layout a user without jagged tensors would write). GEM cannot take padded
input, so the padded form lives here; ``tests/instruments/test_ops.py`` checks that its outputs and
gradients equal GEM's.

Legend: B rows, N events (jagged), L the batch's longest row, D dim, H heads, M pooled tokens,
K recent tokens, C summary tokens, S = C + M + K.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from opengem.config import apply_overrides
from opengem.data.loader import ShardLoader
from opengem.evaluation.metrics import ne
from opengem.features.schema import FeatureSchema
from opengem.model.build import build_gem, materialize
from opengem.model.sequence_arch import SequenceTower
from opengem.ops.fp8 import fp8_saved_activations
from opengem.ops.quantize import quantize_tables, table_bytes
from opengem.recipes import recipe
from opengem.train.losses import masked_bce
from opengem.train.optim import build_optimizers
from opengem.train.step import train_step
from opengem.world.generate import generate
from opengem.world.presets import world_config


def _saved_bytes(fn) -> tuple[int, object]:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total, out


def spread(xs: list[float]) -> dict:
    """Median, min-max and interquartile range of repeated measurements."""
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0],) * 3
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "q1": q1, "q3": q3,
            "n": len(xs)}


def median_min_max(s: dict) -> list[tuple[str, object]]:
    """A ``spread`` as (key suffix, value) pairs for a headline JSON line: "" → median, "_min_max" →
    [min, max]."""
    return [("", round(s["median"], 2)), ("_min_max", [round(s["min"], 2), round(s["max"], 2)])]


def paired_times(fns: dict[str, Callable[[], object]], repeats: int,
                 inner: int) -> dict[str, list[float]]:
    """Seconds per call of each of ``fns``, ``repeats`` rounds of ``inner`` calls each, round robin
    (the order flips every round) so the shared machine's load falls on every variant alike."""
    names = list(fns)
    # warm-up: SDPA's and the allocator's first call per shape cost several later ones
    for name in names:
        fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            for _ in range(inner):
                fns[name]()
            times[name].append((time.perf_counter() - t0) / inner)
    return times


# ----------------------------------------------------------------- GEM's sequence side, jagged vs padded
def pad_right_aligned(values_ND: torch.Tensor, lengths: torch.Tensor,
                      width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Jagged (values [N, ...], lengths [B]) as dense [B, width, ...] with each row's newest event
    in the last slot (so the recent window is a slice), and valid [B, width]. Zeros in
    the padding."""
    B = lengths.numel()
    pos = torch.arange(width) - width  # [-width .. -1]
    valid = pos.unsqueeze(0) >= -lengths.unsqueeze(1)
    idx = torch.cumsum(lengths, 0).unsqueeze(1) + pos.unsqueeze(0)
    out = values_ND.new_zeros(B, width, *values_ND.shape[1:])
    out[valid] = values_ND[idx[valid]]
    return out, valid


def padded_pool_attention(q_BMD: torch.Tensor, k_BLD: torch.Tensor, v_BLD: torch.Tensor,
                          valid_BL: torch.Tensor, num_heads: int, sink_logit_MH: torch.Tensor,
                          sink_value_MD: torch.Tensor) -> torch.Tensor:
    """``opengem.ops.jagged.pool_attention`` written on padded [B, L, D] keys and values with a
    key-padding mask: the same softmax with its "nothing" slot, over every row's L slots. Returns
    [B, M, D].

    Written out rather than through SDPA: the sink's value differs per query, which SDPA's one value
    per key does not express directly; with M = 4 queries the scores are one [B, H, M, L] matmul
    either way."""
    B, M, D = q_BMD.shape
    L, H, Dh = k_BLD.shape[1], num_heads, D // num_heads
    q = q_BMD.view(B, M, H, Dh).transpose(1, 2)
    k, v = (t.view(B, L, H, Dh).transpose(1, 2) for t in (k_BLD, v_BLD))  # [B, H, L, Dh]
    s = torch.matmul(q, k.transpose(-1, -2)) * Dh**-0.5
    s = s.masked_fill(~valid_BL[:, None, None, :], float("-inf"))
    a = torch.softmax(
        torch.cat([s, sink_logit_MH.t().reshape(1, H, M, 1).expand(B, H, M, 1)], dim=-1), dim=-1
    )
    o = torch.matmul(a[..., :L], v) + a[..., L:] * sink_value_MD.view(M, H, Dh).transpose(0, 1)
    return o.transpose(1, 2).reshape(B, M, D)


def padded_tower(tower: SequenceTower, values_BLD: torch.Tensor, ages_BL: torch.Tensor,
                 valid_BL: torch.Tensor, x_sum_BCD: torch.Tensor,
                 layers: bool = True) -> torch.Tensor:
    """A tower's last-layer tokens [B, S, D] from right-aligned padded events [B, L, D] (L >= K):
    GEM's ``SequenceTower`` math with its parameters, every padded slot embedded and projected, the
    pooled attention masked, the recent window the last K slots (zeroed where invalid, as
    ``recent_window``). ``layers=False``: the first tokens [B, C + M + K, D] only (the part that
    reads the history)."""
    cfg, (B, L, D), M = tower.cfg, values_BLD.shape, tower.cfg.num_pooled
    tok = tower.embed(values_BLD, ages_BL)
    parts, valid = [x_sum_BCD], [valid_BL.new_ones(B, tower.n_sum)]
    if M:
        q = tower.pool_q + tower.pool_cond(x_sum_BCD.flatten(1)).view(B, M, D)
        k, v = tower.pool_kv(tok).chunk(2, dim=-1)
        pooled = padded_pool_attention(q, k, v, valid_BL, cfg.num_heads, tower.sink_logit,
                                       tower.sink_value)
        parts.append(tower.pool_out(pooled))
        valid.append(valid_BL.new_ones(B, M))
    rvalid = valid_BL[:, L - cfg.recent_len:]
    parts.append(tower.add_position(tok[:, L - cfg.recent_len:]
                                    * rvalid.unsqueeze(-1).to(tok.dtype)))
    valid.append(rvalid)
    s, s_valid = torch.cat(parts, dim=1), torch.cat(valid, dim=1)
    for i in range(len(tower.layers) if layers else 0):
        s, s_valid = tower.layer(i, s, s_valid, x_sum_BCD)
    return s


def jagged_tower(tower: SequenceTower, values_ND: torch.Tensor, ages_N: torch.Tensor,
                 lengths: torch.Tensor, x_sum_BCD: torch.Tensor,
                 layers: bool = True) -> torch.Tensor:
    """A tower's last-layer tokens [B, S, D] as GEM runs it (``GEM.inputs`` → ``InterFormer``),
    X_sum fixed; ``layers=False``: its first tokens only."""
    s, s_valid = tower.first_tokens(tower.embed(values_ND, ages_N), lengths, x_sum_BCD)
    for i in range(len(tower.layers) if layers else 0):
        s, s_valid = tower.layer(i, s, s_valid, x_sum_BCD)
    return s


def sequence_side_inputs(model, batch, seed: int = 0) -> dict:
    """Per stream (values [N, D], ages [N], lengths [B]) of ``batch`` through ``model``'s tables,
    their right-aligned padded copies (width max(L, K)), and an X_sum [B, C, D] (random: the towers'
    cost does not depend on its values). Leaves that require grad, as embeddings and X_sum do
    in training."""
    with torch.no_grad():
        emb = model.sparse_arch.forward_sequences(batch.sequences)
    ages, streams = batch.seq_age.to_dict(), []
    K = model.cfg.sequence.recent_len
    for name in model.streams:
        values, lengths = emb[name]
        age = ages[name].values().float()
        width = max(int(lengths.max()) if lengths.numel() else 0, K)
        vp, valid = pad_right_aligned(values, lengths, width)
        ap, _ = pad_right_aligned(age, lengths, width)
        streams.append({"name": name, "values": values.detach().clone().requires_grad_(),
                        "ages": age, "lengths": lengths,
                        "values_pad": vp.detach().clone().requires_grad_(),
                        "ages_pad": ap, "valid": valid})
    g = torch.Generator().manual_seed(seed)
    n_sum, D = model.interformer.cfg.num_sum, model.cfg.embedding_dim
    x_sum = torch.randn(batch.batch_size, n_sum, D, generator=g).requires_grad_()
    return {"streams": streams, "x_sum": x_sum}


def sequence_side(model, inputs: dict, padded: bool, layers: bool = True) -> list[torch.Tensor]:
    """Every tower's last-layer tokens (``layers=False``: first tokens), jagged (GEM's code)
    or padded."""
    x = inputs["x_sum"]
    if padded:
        return [padded_tower(tw, s["values_pad"], s["ages_pad"], s["valid"], x, layers)
                for tw, s in zip(model.interformer.towers, inputs["streams"])]
    return [jagged_tower(tw, s["values"], s["ages"], s["lengths"], x, layers)
            for tw, s in zip(model.interformer.towers, inputs["streams"])]


def _length_stats(lengths: torch.Tensor) -> dict:
    f = lengths.double()
    return {"median": float(f.median()), "mean": round(float(f.mean()), 1),
            "max": int(lengths.max()), "p90": float(torch.quantile(f, 0.9)),
            "empty_rows": int((lengths == 0).sum())}


def sequence_side_case(data: Path, cfg_name: str = "demo", overrides: list[str] = (),
                       batches: int = 2, repeats: int = 7, inner: int = 2) -> dict:
    """GEM's sequence side, jagged vs padded, on the first ``batches`` training batches of ``data``
    (the recipe's batch size and history caps), with the recipe's towers (fresh weights: the cost
    does not depend on them). Forward (no grad, as serving runs) and forward + backward (sum of the
    outputs, gradients into the parameters, the event embeddings and X_sum), and ``history_fwd``:
    the forward of the part that reads the history alone (embedding, pooled attention, recent
    window: the first tokens; the tower layers then do the same work either way), each ``repeats``
    rounds of ``inner`` passes over the batches, jagged and padded round robin. The ratio padded
    time / jagged time is formed per round, from the same round's two timings; reported as median,
    min-max and IQR."""
    cfg = apply_overrides(recipe(cfg_name), list(overrides))
    schema = FeatureSchema.load(data)
    model = materialize(build_gem(schema, cfg.model))
    loader = ShardLoader(data, cfg.data.train_split, cfg.data.batch_size, schema, shuffle=False,
                         epochs=1, max_seq_len=model.max_seq_len())
    inputs = [sequence_side_inputs(model, b) for b, _ in zip(loader, range(batches))]

    def run(padded: bool, backward: bool, layers: bool = True) -> Callable[[], None]:
        def call() -> None:
            for inp in inputs:
                if backward:
                    model.zero_grad(set_to_none=True)
                    sum(o.sum() for o in sequence_side(model, inp, padded, layers)).backward()
                else:
                    with torch.no_grad():
                        sequence_side(model, inp, padded, layers)
        return call

    out = {"recipe": cfg_name, "overrides": list(overrides), "rows_per_batch": cfg.data.batch_size,
           "batches": len(inputs), "repeats": repeats, "inner": inner,
           "threads": torch.get_num_threads(),
           "dim": cfg.model.embedding_dim, "heads": cfg.model.sequence.num_heads,
           "recent_len": cfg.model.sequence.recent_len, "num_pooled": cfg.model.sequence.num_pooled,
           "layers": len(model.interformer.towers[0].layers), "max_seq_len": model.max_seq_len()}
    streams = {}
    for i, s in enumerate(inputs[0]["streams"]):
        lengths = torch.cat([inp["streams"][i]["lengths"] for inp in inputs])
        slots = sum(inp["streams"][i]["valid"].numel() for inp in inputs)
        streams[s["name"]] = _length_stats(lengths) | {
            "padded_slots_over_events": round(slots / int(lengths.sum()), 2)
        }
    out["lengths"] = streams
    for mode, backward, layers in (("fwd", False, True), ("fwd_bwd", True, True),
                                   ("history_fwd", False, False)):
        t = paired_times({"jagged": run(False, backward, layers),
                          "padded": run(True, backward, layers)},
                         repeats, inner)
        ratios = [p / j for p, j in zip(t["padded"], t["jagged"])]
        out[mode] = {"padded_over_jagged_time": spread(ratios),
                     "jagged_ms": spread([1e3 * x / len(inputs) for x in t["jagged"]]),
                     "padded_ms": spread([1e3 * x / len(inputs) for x in t["padded"]])}
    bytes_j, _ = _saved_bytes(lambda: sequence_side(model, inputs[0], False))
    bytes_p, _ = _saved_bytes(lambda: sequence_side(model, inputs[0], True))
    out["saved_bytes"] = {"jagged": bytes_j, "padded": bytes_p,
                          "padded_over_jagged": round(bytes_p / bytes_j, 2)}
    return out


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
    test = list(ShardLoader(tmp, "test", 512, shuffle=False, epochs=1,
                            max_seq_len=model.max_seq_len()))
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
    err = math.sqrt(
        sum(float((got[n] - ref[n]).pow(2).sum()) for n in ref)
        / sum(float(r.pow(2).sum()) for r in ref.values())
    )
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
    out = {"table_dim": model.cfg.embedding_dim, "table_mb_fp32": table_bytes(model) / 2**20,
           "ne_rows": len(y)}
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
