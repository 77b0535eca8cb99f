"""Storage and loader speed of dataset layout v1 (histories copied into every row) vs v2 (event logs
stored once per user, joined at read time; ``opengem.data.events``), on one synthetic world.

    python benchmarks/dataset_layout.py --quick     # the demo world's shape at 6,144 users, ~1 min on 1 core
    python benchmarks/dataset_layout.py             # the demo world itself (~660k rows; minutes, ~0.8 GB)

The world is written in both layouts from the same seed (same rows, same draws). Bytes are every
Parquet file of a layout (v1: shards; v2: shards + event logs), per column group. Loader speed is
one pass over the train split (``ShardLoader``, batch 256, the ``demo`` recipe's history cap of 256,
no prefetch, one thread), best of ``--repeats`` alternating passes, in examples per second, after
checking the first batches are equal. ``--quick`` keeps the demo's files (2,048-user blocks, 8 days)
but 3 blocks, not 18: still more buckets than the loader caches, so its cache misses as on the demo.
Ends with one JSON line: ``dataset_bytes_v1_over_v2``, ``loader_examples_per_s_v1`` / ``_v2``.
What it measured: docs/experiments.md, 'Figures moved from code docstrings'.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from instruments.layout import parquet_bytes

from opengem.data.loader import ShardLoader
from opengem.features.schema import FeatureSchema
from opengem.world.generate import generate
from opengem.world.presets import world_config

QUICK_USERS = 6144  # 3 user buckets of the demo's 2,048: more than the loader caches (2 per stream)


def loader_speed(data: Path, max_len: int) -> tuple[float, int]:
    """Examples/s of one pass over the train split, and its rows."""
    caps = {s.name: max_len for s in FeatureSchema.load(data).sequences}
    t0, n = time.perf_counter(), 0
    for b in ShardLoader(data, "train", 256, max_seq_len=caps, shuffle=True, seed=0):
        n += b.batch_size
    return n / (time.perf_counter() - t0), n


def first_batches_equal(v1: Path, v2: Path, k: int = 3) -> bool:
    for a, b in zip(ShardLoader(v1, "train", 256), ShardLoader(v2, "train", 256)):
        if not (torch.equal(a.sequences.values(), b.sequences.values())
                and torch.equal(a.dense, b.dense)):
            return False
        k -= 1
        if k == 0:
            return True
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help=f"the demo world's shape at {QUICK_USERS} users")
    ap.add_argument("--out", default=None,
                    help="keep the two datasets here (default: a temporary directory)")
    ap.add_argument("--max-len", type=int, default=256,
                    help="the loader's history cap (the demo recipe's)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="loader passes per layout (the best is reported)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = world_config("demo", overrides=[f"sizes.num_users={QUICK_USERS}"] if args.quick else [])
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        out: dict = {"world": "demo" + (f", {QUICK_USERS} users" if args.quick else ""),
                     "threads": 1}
        for layout in ("v1", "v2"):
            t0 = time.perf_counter()
            m = generate(cfg, root / layout, progress=False, layout=layout)
            out[f"generate_s_{layout}"] = round(time.perf_counter() - t0, 1)
            out["rows"] = sum(f.rows for f in m.files)
            out[f"bytes_{layout}"] = parquet_bytes(root / layout)
        out["first_batches_equal"] = first_batches_equal(root / "v1", root / "v2")
        for _ in range(args.repeats):  # alternating passes, best of each: the machine may be shared
            for layout in ("v1", "v2"):
                eps, out["loader_rows"] = loader_speed(root / layout, args.max_len)
                key = f"loader_examples_per_s_{layout}"
                out[key] = max(out.get(key, 0.0), round(eps, 1))
    b1, b2 = out["bytes_v1"]["total"], out["bytes_v2"]["total"]
    out["dataset_bytes_v1_over_v2"] = round(b1 / b2, 2)
    out["history_share_of_v1_bytes"] = round(out["bytes_v1"]["history_columns_in_shards"] / b1, 3)
    out["history_bytes_v1_over_event_logs_v2"] = round(out["bytes_v1"]["history_columns_in_shards"]
                                                       / out["bytes_v2"]["event_logs"], 1)
    out["loader_v2_over_v1"] = round(out["loader_examples_per_s_v2"]
                                     / out["loader_examples_per_s_v1"], 3)
    print(json.dumps(out, indent=2))
    print(json.dumps({k: out[k]
                      for k in ("rows", "dataset_bytes_v1_over_v2", "loader_examples_per_s_v1",
                                          "loader_examples_per_s_v2", "loader_v2_over_v1",
                                "first_batches_equal")}))


if __name__ == "__main__":
    main()
