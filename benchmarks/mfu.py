"""Model FLOP utilisation of GEM's dense part (one device): FLOPs counted, step time measured.

    python benchmarks/mfu.py --quick                 # CPU-sized: `small` recipe, fp32, a few steps
    python benchmarks/mfu.py --recipe large          # on a GPU: bf16 autocast, peak from --peak-tflops

FLOPs per step come from ``torch.utils.flop_counter.FlopCounterMode`` over one forward + backward
(matmuls and attention; embedding lookups count ~0, which is right for "dense MFU"). The batch is
real: rows of the ``tiny`` synthetic world, repeated to the recipe's batch size, with the world's
long-tailed sequences. MFU = achieved FLOP/s ÷ ``--peak-tflops`` (H100/H200 SXM bf16 dense: 989;
leave 0 on CPU, where no MFU is printed). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from opengem.data.loader import ShardLoader
from opengem.features.schema import FeatureSchema
from opengem.model.build import build_gem, count_parameters, materialize
from opengem.recipes import recipe
from opengem.train.losses import masked_bce
from opengem.train.optim import build_optimizers
from opengem.world.generate import generate
from opengem.world.presets import world_config


def _step(model, batch, opts, task_w, autocast_dtype):
    device_type = batch.dense.device.type
    with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        logits = model(batch)
    loss, _ = masked_bce(logits.float(), batch.labels, batch.label_mask, batch.weights, task_w)
    for o in opts:
        o.zero_grad(set_to_none=True)
    loss.backward()
    for o in opts:
        o.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="CPU-sized: small recipe, batch 256, 3 timed steps")
    ap.add_argument("--recipe", default="large")
    ap.add_argument("--batch-size", type=int, default=0, help="0 = the recipe's")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--peak-tflops", type=float, default=0.0,
                    help="device peak for the dtype used (0: no MFU)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = "small" if args.quick else args.recipe
    cfg = recipe(name)
    bs = 256 if args.quick else (args.batch_size or cfg.data.batch_size)
    steps = 3 if args.quick else args.steps
    dtype = torch.bfloat16 if device.type == "cuda" else None

    with tempfile.TemporaryDirectory() as tmp:
        generate(world_config("tiny", seed=0), tmp, progress=False)
        model = materialize(build_gem(FeatureSchema.load(tmp), cfg.model), device)
        loader = ShardLoader(tmp, "train", bs, shuffle=False, epochs=100,
                             max_seq_len=model.max_seq_len())
        batches = [b.to(device) for _, b in zip(range(steps + 2), loader)]
    dense, sparse = build_optimizers(model.dense_parameters(), model.sparse_parameters(), cfg.optim)
    opts = [o for o in (dense, sparse) if o is not None]
    task_w = torch.ones(len(model.schema.tasks), device=device)

    with FlopCounterMode(display=False) as fc:
        _step(model, batches[0], opts, task_w, dtype)
    flops = fc.get_total_flops()
    _step(model, batches[1], opts, task_w, dtype)  # warm-up
    times = []
    for b in batches[2:]:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        _step(model, b, opts, task_w, dtype)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    achieved = flops / step_s / 1e12
    params = count_parameters(model)
    out = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "recipe": name, "batch_size": bs, "dense_params": params["dense"],
           "flops_per_example": flops / bs,
           "step_s": step_s, "examples_per_s": bs / step_s, "achieved_tflops": achieved,
           "mfu": achieved / args.peak_tflops if args.peak_tflops else None,
           "dtype": str(dtype or torch.float32)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
