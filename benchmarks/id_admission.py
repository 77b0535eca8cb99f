"""Per-user id tables on worlds with few impressions per user: dropped, included, included with
frequency admission (``model.sparse.min_count`` k), on development worlds, valid split only.

    python benchmarks/id_admission.py                    # world seeds 0-2, k ∈ {2, 5, 10}, ~15 min on 1 core
    python benchmarks/id_admission.py --worlds 0 --ks 5

Per world seed w: the ``tiny`` world at 1,500 users with ``structure_seed=w`` and its oracle; its
schema omits ``user_id`` as a feature (``opengem.world.generate.build_schema``), so a second data
directory shares the shards and lists ``user_id`` (the column every row carries) as a sparse
feature. Each variant is one ``bench.tune.train_point`` at the recipe's learning rates (up to 2
epochs, early stopping and the best checkpoint on valid); it reports the best valid all/click and
all/conversion NE, the step it was reached at, and ``captured_over_oracle`` of that checkpoint on
valid. Nothing reads the test split. Prints one JSON line per run and a mean table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import statistics
import warnings
from pathlib import Path

import torch
from instruments.tune import train_point

from opengem.config import apply_overrides
from opengem.data.parquet import MANIFEST
from opengem.discipline import require_dev_world
from opengem.evaluation.evaluate import evaluate_run
from opengem.features.schema import SCHEMA_FILE, FeatureSchema, SparseFeature
from opengem.recipes import recipe
from opengem.world.generate import generate
from opengem.world.oracle import OracleCollector
from opengem.world.presets import world_config


def world_dirs(root: Path, w: int, users: int) -> tuple[Path, Path]:
    """(the world as generated, the same shards with ``user_id`` listed as a sparse feature)."""
    data, uid = root / f"w{w}", root / f"w{w}_uid"
    if not (data / MANIFEST).exists():
        cfg = world_config("tiny", seed=w,
                           overrides=[f"sizes.num_users={users}", f"structure_seed={w}"])
        generate(cfg, data, progress=False, observer=OracleCollector)
    if not (uid / MANIFEST).exists():
        uid.mkdir(parents=True, exist_ok=True)
        (uid / "shards").unlink(missing_ok=True)
        (uid / "shards").symlink_to((data / "shards").resolve())
        shutil.copy(data / MANIFEST, uid / MANIFEST)
        schema = FeatureSchema.load(data)
        with_uid = dataclasses.replace(schema,
                                       sparse=(SparseFeature("user_id", users, "user"),
                                               *schema.sparse))
        with_uid.save(uid / SCHEMA_FILE)
    return data, uid


def run_variant(name: str, data: Path, run: Path, w: int, overrides: list[str]) -> dict:
    cfg = apply_overrides(recipe("tiny"),
                          ["train.threads=1", "train.progress=false", f"train.seed={w}",
                                           f"data.seed={w}", *overrides])
    base = recipe("tiny").optim
    t = train_point(cfg, data, run, (base.lr, base.sparse_lr), split="valid", max_epochs=2)
    m = evaluate_run(run, data, "valid", progress=False, best=True)["metrics"]
    evals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
             if "eval" in r]
    return {"world": w, "variant": name, "ne_click": m["all/click"]["ne"],
            "ne_conversion": m["all/conversion"]["ne"],
            "captured_over_oracle_click": m["all/click"].get("captured_over_oracle"),
            "best_epoch": round(t.step / (evals[-1]["step"] / len(evals)), 2),
            "ne_click_per_epoch": [r["eval"]["all/click"]["ne"] for r in evals],
            "wall_s": round(t.wall_s, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="*", default=[0, 1, 2])
    p.add_argument("--ks", type=int, nargs="*", default=[2, 5, 10])
    p.add_argument("--users", type=int, default=1500)
    p.add_argument("--out", required=True, help="worlds and runs go here (reused when present)")
    p.add_argument("--variants", nargs="*", default=None, help="run only these variant names")
    p.add_argument("--quick", action="store_true", help="world seed 0 and k = 10 only")
    args = p.parse_args()
    if args.quick:
        args.worlds, args.ks = [0], [10]
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    root = Path(args.out)
    rows = []
    for w in args.worlds:
        require_dev_world(w, "the id-admission threshold")
        data, uid = world_dirs(root, w, args.users)
        variants = [("dropped", data, []), ("user_id", uid, [])] + [
            (f"user_id k={k}", uid, [f"model.sparse.min_count={k}"]) for k in args.ks]
        for name, d, ov in variants:
            if args.variants and name not in args.variants:
                continue
            run = root / "runs" / f"w{w}_{name.replace(' ', '_').replace('=', '')}"
            shutil.rmtree(run, ignore_errors=True)
            rows.append(run_variant(name, d, run, w, ov))
            print(json.dumps(rows[-1]), flush=True)
    summary = {}
    print(f"\n{'variant':<16}{'NE click':>10}{'NE conv':>10}{'cap/oracle':>12}{'best epoch':>12}  "
          f"(valid, mean)")
    for name in dict.fromkeys(r["variant"] for r in rows):
        rs = [r for r in rows if r["variant"] == name]
        mean = {
            k: statistics.fmean(r[k] for r in rs)
            for k in ("ne_click", "ne_conversion", "captured_over_oracle_click", "best_epoch")
        }
        print(f"{name:<16}{mean['ne_click']:>10.4f}{mean['ne_conversion']:>10.4f}"
              f"{mean['captured_over_oracle_click']:>12.3f}{mean['best_epoch']:>12.2f}")
        summary[name] = {k: round(v, 5) for k, v in mean.items()}
    print(json.dumps({"worlds": args.worlds, "split": "valid", "mean": summary}))


if __name__ == "__main__":
    main()
