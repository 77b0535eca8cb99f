"""GEM's sequence side jagged vs padded (time, saved bytes), FP8 saved activations, int8 tables.

    python benchmarks/jagged.py --quick        # CPU, 2 cores, a few minutes
    python benchmarks/jagged.py                # more rounds and batches, and longer history caps

1. GEM's sequence side (``instruments.ops.sequence_side_case``): per behaviour stream, what GEM runs
   from the looked-up event embeddings on: time-bucket embedding + LayerNorm, the target-aware
   pooled attention over the whole history (M learnable queries keyed by X_sum, with a "nothing"
   slot), the recent window of K events and every tower layer (PFFN, MHA over [CLS | pooled |
   recent], FFN, pyramid drop). "jagged" is GEM's own ``SequenceTower`` code on (values [N, D],
   lengths [B]); "padded" is ``instruments.ops.padded_tower``: the same parameters and math on dense
   right-aligned [B, L_max, D] events with a key-padding mask (tested equal to GEM's outputs and
   gradients). Data:
   the first training batches of the demo world's shape at 2,048 users (data seed 1000) through the
   demo recipe (batch 256, histories capped at 256, K = 16, M = 4, D = 32, 2 layers, 2 streams).
   Forward (no grad) and forward + backward are timed in rounds, jagged and padded round robin; the
   ratio padded time / jagged time is formed per round; the headline is its median with min-max (and
   IQR in the record). Event embedding lookups are not timed (a padded lookup would cost B × L_max
   rows). The full run adds the history caps 1,024 and 4,096 (the world stores up to 4,096 organic
   events). Memory: bytes autograd saves for backward, one batch.
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
from pathlib import Path

import torch
from instruments.ops import fp8_step, median_min_max, sequence_side_case, table_ne, trained_tiny

from opengem.world.generate import generate
from opengem.world.presets import world_config

USERS, DATA_SEED = 2048, 1000  # the bench's layout world: one user block of the demo's shape


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="CPU-sized: fewer rounds and batches, one history cap (256)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared 2-core machine two OpenMP threads time "
                         "erratically, 0.2-1.5 s for the same call)")
    ap.add_argument("--train-epochs", type=int, default=1,
                    help="passes over the tiny world before the table NE")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    batches, rounds = (4, 7) if args.quick else (8, 9)
    caps = [256] if args.quick else [256, 1024, 4096]
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "demo"
        generate(world_config("demo", seed=DATA_SEED, overrides=[f"sizes.num_users={USERS}"]), data,
                 progress=False)
        for cap in caps:
            cases.append(sequence_side_case(data, "demo", [f"model.max_seq_len={cap}"],
                                            batches=batches, repeats=rounds, inner=1))
            print(json.dumps(cases[-1]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model, test, base_rates = trained_tiny(tmp, args.train_epochs)
        fp8 = fp8_step(model, test[0])
        tables = table_ne(model, test, base_rates)
    print(json.dumps(fp8), flush=True)
    print(json.dumps(tables), flush=True)
    head = cases[0]
    out = {
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "quick": args.quick,
        **{
            f"gem_sequence_side_padded_over_jagged_{m}{suffix}": v
            for m in ("fwd", "fwd_bwd")
            for suffix, v in median_min_max(head[m]["padded_over_jagged_time"])
        },
        **{
            f"gem_sequence_history_padded_over_jagged_fwd{suffix}": v
            for suffix, v in median_min_max(head["history_fwd"]["padded_over_jagged_time"])
        },
        "gem_sequence_side_padded_over_jagged_saved_bytes": head["saved_bytes"][
            "padded_over_jagged"
        ],
        "rounds": rounds,
        "batches": batches,
        "rows_per_batch": head["rows_per_batch"],
        "lengths": head["lengths"],
        "caps": [
            {
                "max_seq_len": c["max_seq_len"]["organic"],
                **{
                    m: round(c[m]["padded_over_jagged_time"]["median"], 2)
                    for m in ("fwd", "fwd_bwd", "history_fwd")
                },
                "padded_slots_over_events": {
                    k: v["padded_slots_over_events"] for k, v in c["lengths"].items()
                },
            }
            for c in cases
        ],
        "fp8_saved_bytes_ratio": fp8["fp8_saved_bytes_ratio"],
        "fp8_grad_rel_l2_err": fp8["fp8_grad_rel_l2_err"],
        "int8_table_bytes_ratio": tables["int8_table_bytes_ratio"],
        "fp16_table_bytes_ratio": tables["fp16_table_bytes_ratio"],
        "ne_cost_int8_pct": tables["ne_cost_int8_pct"],
        "ne_cost_fp16_pct": tables["ne_cost_fp16_pct"],
        "triton": "not timed: needs a GPU (benchmarks/gpu_check.sh)",
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
