"""Where a training step's time goes, each speed/memory lever on/off, and the headline
speed figures.

    python benchmarks/speed.py --quick          # a few CPU minutes, ends with one JSON line
    python benchmarks/speed.py --recipe demo --levers eager,compile,ac,bf16,fp8 [key=value …]

``opengem bench …`` runs this script from a source checkout (the instruments are not part of the
installed package); figures and their history are in docs/speed.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def parser() -> argparse.ArgumentParser:
    b = argparse.ArgumentParser(prog="opengem bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--recipe", default="demo")
    b.add_argument("--data", default=None,
                   help="a dataset directory (default: a fresh tiny synthetic world)")
    b.add_argument("--levers", default="eager,compile,ac,bf16,fp8",
                   help="comma-separated; combine with '+'")
    b.add_argument("--steps", type=int, default=10)
    b.add_argument("--warmup", type=int, default=3)
    b.add_argument("--json", default=None, help="write the figures here")
    b.add_argument("--quick", action="store_true",
                   help="the headline figures in a few CPU minutes: GEM's attention jagged vs "
                        "padded, loader vs training, FP8 and int8 memory, time to DLRM-DCN's "
                        "quality; ends with one JSON line")
    b.add_argument("overrides", nargs="*", help="config overrides key=value")
    return b


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    if args.quick:
        from instruments.quick import quick_bench

        out = quick_bench()
        print(json.dumps({k: v for k, v in out.items() if not isinstance(v, dict)}))
    else:
        import torch
        from instruments.levers import format_bench, run_bench

        from opengem.config import apply_overrides
        from opengem.recipes import recipe

        cfg = apply_overrides(recipe(args.recipe), list(args.overrides))
        if cfg.train.threads:  # as ``train`` does, so bench and training figures are comparable
            torch.set_num_threads(cfg.train.threads)
        out = run_bench(cfg, args.data, tuple(args.levers.split(",")), args.warmup, args.steps)
        out["threads"] = torch.get_num_threads()
        print(format_bench(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
