"""Jagged vs padded sequence attention (time, saved bytes), FP8 saved activations, int8 tables.

    python benchmarks/jagged.py --quick        # CPU, 2 cores, a few minutes
    python benchmarks/jagged.py                # bigger batches and more length settings

1. Attention: causal multi-head self-attention, forward + backward, over B rows whose lengths are
   long-tailed (lognormal around a median, clipped to a max; the longest row is set to the max, as a
   batch's longest row sets the padding). "jagged" is ``opengem.ops.jagged.jagged_attention``
   (reference impl: SDPA per length bucket); "padded" is SDPA with ``is_causal`` on [B, H, max_len, Dh]
   input that is already padded (the most favourable case for padding: no conversion timed).
   Times are the fastest of several fwd + bwd calls. Headline: ``padded_over_jagged_time`` at median 70 / max 3,000, against the goal
   0.8 × max_len / mean_len (cost ∝ B·max² padded vs Σ L² jagged, so the ideal ratio is at least
   max/mean). Memory is what autograd saves for backward (bytes, via saved-tensor hooks).
   The Triton kernels are not timed: they need a GPU (``benchmarks/gpu_check.sh``).
2. FP8 saved activations: bytes ratio and gradient error on one GEM step (``tiny`` recipe).
3. Tables: int8 / fp16 serving compression (``opengem.ops.quantize``) of a ``tiny`` GEM trained one
   pass over the ``tiny`` synthetic world (more passes overfit its ~2,000 rows): table bytes ratio
   and the NE cost on the held-out test day.

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
from instruments.ops import attention_case, fp8_step, table_ne, trained_tiny


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU-sized: fewer rows and length settings")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared 2-core machine two OpenMP threads time erratically, 0.2-1.5 s "
                         "for the same call)")
    ap.add_argument("--train-epochs", type=int, default=1, help="passes over the tiny world before the table NE")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    b, dim, reps = (32, 32, 2) if args.quick else (128, 64, 3)
    settings = [(70, 3000), (70, 500), (300, 3000)] if args.quick else [(70, 3000), (70, 1000), (70, 500),
                                                                         (300, 3000), (30, 3000)]
    cases = []
    for median, max_len in settings:
        cases.append(attention_case(b, median, max_len, dim, heads=2, reps=reps))
        print(json.dumps(cases[-1]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model, test, base_rates = trained_tiny(tmp, args.train_epochs)
        fp8 = fp8_step(model, test[0])
        tables = table_ne(model, test, base_rates)
    print(json.dumps(fp8), flush=True)
    print(json.dumps(tables), flush=True)
    head = cases[0]
    out = {"device": "cpu", "threads": torch.get_num_threads(), "quick": args.quick,
           "padded_over_jagged_time": head["padded_over_jagged_time"],
           "goal_0.8_max_over_mean": head["goal_0.8_max_over_mean"],
           "meets_goal": head["padded_over_jagged_time"] >= head["goal_0.8_max_over_mean"],
           "jagged_over_padded_saved_bytes": head["jagged_saved_bytes"] / head["padded_saved_bytes"],
           "cases": [{k: c[k] for k in ("median", "mean_len", "max_len", "padded_over_jagged_time",
                                        "goal_0.8_max_over_mean", "ideal_flops_ratio")} for c in cases],
           "fp8_saved_bytes_ratio": fp8["fp8_saved_bytes_ratio"], "fp8_grad_rel_l2_err": fp8["fp8_grad_rel_l2_err"],
           "int8_table_bytes_ratio": tables["int8_table_bytes_ratio"],
           "fp16_table_bytes_ratio": tables["fp16_table_bytes_ratio"],
           "ne_cost_int8_pct": tables["ne_cost_int8_pct"], "ne_cost_fp16_pct": tables["ne_cost_fp16_pct"],
           "triton": "not timed: needs a GPU (benchmarks/gpu_check.sh)"}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
