"""``opengem import``: turn a public data set (or any table + a JSON spec) into a dataset directory.

    opengem import --source movielens --in ml-100k/ --out data/ml100k
    opengem import --source generic --in events.csv --spec spec.json --out data/mine
"""

from __future__ import annotations

import argparse
import logging
import time

from opengem.data.sources import SOURCES, convert

log = logging.getLogger("opengem")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("import",
                              help="convert a real data set (or a table + JSON spec) into "
                                   "Parquet shards")
    p.add_argument("--source", required=True, choices=SOURCES)
    p.add_argument("--in", dest="in_path", required=True, help="the source's file or directory")
    p.add_argument("--out", required=True, help="the dataset directory to write")
    p.add_argument("--spec", default=None, help="generic only: the JSON spec naming the columns")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of random splits (sources without time)")
    p.add_argument("--key-file", default=None, metavar="FILE",
                   help="the key of a spec's pseudonymise (keyed hash of user ids); kept outside "
                        "the dataset, never written into it (default: $OPENGEM_PSEUDONYM_KEY)")
    p.set_defaults(handler=run)
    return p


def run(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    manifest = convert(args.source, args.in_path, args.out, spec=args.spec, seed=args.seed,
                       key_file=args.key_file)
    rows = manifest.source.get("rows", {})
    log.info("imported %s: %s rows (%s) in %d shards to %s in %.1f s", args.source,
             sum(rows.values()), ", ".join(f"{k} {v}" for k, v in rows.items()),
             len(manifest.files), args.out,
             time.perf_counter() - t0)
    return {"rows": rows, "shards": len(manifest.files), "out": args.out, "layout": manifest.layout,
            "storage": manifest.source.get("storage")}
