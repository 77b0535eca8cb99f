"""The scaling curve: held-out NE against training FLOPs along the recipes' size dial (as Wukong
fits it).

    python benchmarks/scaling_law.py --quick        # 2 CPU cores, < 5 min: a 1/18-size demo world, 3 sizes
    python benchmarks/scaling_law.py                # 2 CPU cores, < 30 min: a 4/9-size demo world, 3 sizes
    python benchmarks/scaling_law.py --preset small --recipes demo,small,medium,large   # a GPU host

Every size trains one pass over the same ``train`` days with its recipe's batch and optimizer and is
evaluated on the ``test`` day. Training compute C = FLOPs per example (``FlopCounterMode`` over one
forward + backward of a real batch: matmuls and attention; lookups count ~0) × examples seen.

The synthetic world knows its irreducible loss (``ne_bayes``), so the fit is a plain power law on
the reducible part, a straight line in log-log:

    NE(C) − NE_bayes = a · C^(−α)          α > 0: bigger models trained on the same rows do better

With 3–4 points α is a rough slope, not a law; the script prints each point so the reader can judge.
Writes ``scaling_law.png`` and ``scaling_law.json`` into ``--out`` and ends with ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from opengem.config import apply_overrides
from opengem.data.loader import ShardLoader
from opengem.evaluation.evaluate import evaluate_run
from opengem.features.schema import FeatureSchema
from opengem.model.build import build_gem, count_parameters, materialize
from opengem.recipes import recipe
from opengem.train.losses import masked_bce
from opengem.train.trainer import train
from opengem.world.generate import generate
from opengem.world.presets import world_config

QUICK = {"users": 2000, "recipes": ["tiny", "demo", "small"]}  # ~27k training rows
FULL = {"users": 16000, "recipes": ["tiny", "demo", "small"]}  # ~220k training rows


def flops_per_example(cfg, data: Path, batch_size: int = 256) -> float:
    """Forward + backward FLOPs of one real batch of the ``train`` split, per row."""
    model = materialize(build_gem(FeatureSchema.load(data), cfg.model))
    loader = ShardLoader(data, "train", batch_size, shuffle=False, max_seq_len=model.max_seq_len())
    batch = next(iter(loader))
    task_w = torch.ones(len(model.schema.tasks))
    with FlopCounterMode(display=False) as fc:
        loss, _ = masked_bce(model(batch), batch.labels, batch.label_mask, batch.weights, task_w)
        loss.backward()
    return fc.get_total_flops() / batch.batch_size


def fit_power_law(compute: list[float], excess: list[float]) -> dict:
    """Least squares of log(excess) on log(compute): excess = a · C^(−alpha)."""
    x, y = np.log(compute), np.log(np.maximum(excess, 1e-9))
    slope, intercept = np.polyfit(x, y, 1)
    pred = slope * x + intercept
    ss = float(((y - y.mean()) ** 2).sum())
    r2 = 1 - float(((y - pred) ** 2).sum()) / ss if ss > 0 else float("nan")
    return {"alpha": float(-slope), "a": float(math.exp(intercept)), "r2": r2}


def plot(points: list[dict], fit: dict, ne_bayes: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = np.array([p["train_flops"] for p in points])
    ne = np.array([p["ne"] for p in points])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter(c, ne, zorder=3)
    for p in points:
        ax.annotate(p["recipe"], (p["train_flops"], p["ne"]), textcoords="offset points",
                    xytext=(4, 4))
    grid = np.geomspace(c.min() / 2, c.max() * 4, 50)
    ax.plot(grid, ne_bayes + fit["a"] * grid ** (-fit["alpha"]), "--",
            label=f"NE_bayes + a·C^(−{fit['alpha']:.3f})  (R² {fit['r2']:.2f})")
    ax.axhline(ne_bayes, color="grey", lw=0.8, label=f"NE_bayes {ne_bayes:.4f}")
    ax.set_xscale("log")
    ax.set(xlabel="training FLOPs (forward + backward)", ylabel="test NE (click)",
           title="GEM along the size dial")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 CPU cores, < 5 minutes")
    ap.add_argument("--preset", default="demo",
                    help="synthetic world preset (its num_users is cut to --users)")
    ap.add_argument("--users", type=int, default=0,
                    help="0: the mode's default; -1: the preset's own")
    ap.add_argument("--recipes", default="",
                    help="comma-separated, small to large (default: the mode's)")
    ap.add_argument("--out", default="scaling_law", help="directory for the PNG and JSON")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    mode = QUICK if args.quick else FULL
    names = args.recipes.split(",") if args.recipes else mode["recipes"]
    users = mode["users"] if args.users == 0 else args.users
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    points = []
    with tempfile.TemporaryDirectory() as tmp:
        data, t0 = Path(tmp) / "data", time.perf_counter()
        world = world_config(args.preset, seed=args.seed,
                             overrides=[] if users < 0 else [f"sizes.num_users={users}"])
        generate(world, data, progress=False)
        for name in names:
            cfg = apply_overrides(recipe(name), [f"train.seed={args.seed}"])
            cfg.train.progress = False
            t1 = time.perf_counter()
            final = train(cfg, data, Path(tmp) / name)
            m = evaluate_run(Path(tmp) / name, data, "test", progress=False)["metrics"]["all/click"]
            fpe = flops_per_example(cfg, data)
            points.append(
                {
                    "recipe": name,
                    "dense_params": count_parameters(
                        build_gem(FeatureSchema.load(data), cfg.model)
                    )["dense"],
                    "flops_per_example": fpe,
                    "examples": final["examples"],
                    "train_flops": fpe * final["examples"],
                    "ne": m["ne"],
                    "ne_bayes": m["ne_bayes"],
                    "captured": m["captured"],
                    "auc": m["auc"],
                    "train_s": time.perf_counter() - t1,
                }
            )
            p = points[-1]
            print(f"{name:>8}: dense {p['dense_params']:>11,}  C {p['train_flops']:.3e}  "
                  f"NE {p['ne']:.4f}  captured {p['captured']:.3f}  AUC {p['auc']:.4f}  "
                  f"({p['train_s']:.0f} s)", flush=True)
    ne_bayes = points[0]["ne_bayes"]
    fit = fit_power_law([p["train_flops"] for p in points], [p["ne"] - ne_bayes for p in points])
    plot(points, fit, ne_bayes, out / "scaling_law.png")
    result = {"alpha": round(fit["alpha"], 4), "a": fit["a"], "r2": round(fit["r2"], 3),
              "ne_bayes": ne_bayes, "points": points,
              "world": {"preset": args.preset, "num_users": world.sizes.num_users},
              "device": "cuda" if torch.cuda.is_available() else "cpu",
              "wall_s": round(time.perf_counter() - t0, 1)}
    (out / "scaling_law.json").write_text(json.dumps(result, indent=2))
    print(f"NE − NE_bayes = {fit['a']:.3g} · C^(−{fit['alpha']:.4f})  (R² {fit['r2']:.3f}); plot "
          f"{out / 'scaling_law.png'}")
    print(json.dumps({k: result[k] for k in ("alpha", "r2", "ne_bayes", "wall_s")}
                     | {"ne_" + p["recipe"]: round(p["ne"], 4) for p in points}
                     | {"flops_" + p["recipe"]: float(f"{p['train_flops']:.4g}") for p in points}))


if __name__ == "__main__":
    main()
