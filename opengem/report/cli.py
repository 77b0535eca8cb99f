"""``opengem report --run RUN [--eval EVAL_JSON] [--out DIR] [--data DIR] [--bench FILE …]``."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    r = subparsers.add_parser("report",
                              help="write an HTML report of a run (figures beside it, "
                                   "no JavaScript)")
    r.add_argument("--run", required=True, metavar="RUN",
                   help="a training or distillation run directory")
    r.add_argument("--eval", default=None, metavar="EVAL_JSON",
                   help="evaluation JSON (default: RUN/evaluation.json, "
                        "else RUN/../evaluation.json)")
    r.add_argument("--out", default=None, metavar="DIR",
                   help="report directory (default: RUN/report)")
    r.add_argument("--data", default=None, metavar="DIR",
                   help="data directory: compute calibration bins with one pass of the model "
                        "over --split")
    r.add_argument("--split", default="test")
    r.add_argument("--bench", action="append", default=[], metavar="FILE",
                   help="benchmarks/transfer.py or benchmarks/scaling.py output (JSON, or the log "
                        "ending in it); repeatable")
    r.set_defaults(handler=run)
    return r


def run(args) -> dict:
    from opengem.report.build import build_report

    path = build_report(args.run, args.out, args.eval, benchmarks=args.bench, data=args.data,
                        split=args.split)
    print(f"wrote {path}")
    return {"report": str(path)}
