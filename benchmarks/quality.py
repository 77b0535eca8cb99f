"""Quality benchmark: GEM against TorchRec's DLRM and DLRM-DCN and against its own ablations.

    python benchmarks/quality.py --quick      # 1 seed, a 1,500-user synthetic world: ~2 min on 2 idle cores
    python benchmarks/quality.py              # 3 seeds, a 6,000-user world: ~5-10 min on 2 idle cores

Every model trains through ``opengem.train.trainer.train`` and is scored by
``opengem.evaluation.evaluate.evaluate_run`` on the test split, with the SAME budget per dataset:
one recipe (sizes, batch, dense AdamW + row-wise Adagrad tables, lr schedule), one pass over the
training rows (the recipes' rule), the same seeds (``train.seed`` = ``data.seed`` = seed). Only the
model overrides of ``MODELS`` differ. Nothing is tuned on the test split (the valid split is unused).

Models (``MODELS``; each is a named set of config overrides):
  gem                GEM as the recipe builds it
  dlrm, dlrm_dcn     the peers (``opengem.model.peers``): TorchRec's DLRM / DLRM-DCN on our tables
  gem_no_seq         (a) no sequence towers: Wukong stack only (``model.use_sequences=false``)
  gem_no_wukong      (b) sequence towers, no Wukong stack (``model.interformer.wukong=false``)
  gem_no_interleave  (c) both stacks, no cross-arch exchange (``model.interformer.interleave=false``)

Datasets (``DATASETS``), each skipped with a message when its source is missing:
  ml100k     MovieLens-100K (``opengem.data.sources.movielens``): click = rating >= 4, ratings stream
  obd        Open Bandit small (``opengem.data.sources.open_bandit``): 3 campaigns, no sequences
  synthetic  the synthetic world (true probabilities known): NE_bayes and captured as well
Real data is read from ``shared/data`` next to the repository (``--shared`` to point elsewhere).

ML-100K recipe (``DATASETS["ml100k"]``): ``tiny`` sizes (D = 16, batch 128) with ``max_seq_len=64``;
the ``demo`` sizes (≈ 430k dense parameters) are large for 80k training rows. The history cap is
the same for every model (DLRM's mean-pooled history included).

Printed: per dataset and task, mean ± std over seeds of AUC, gAUC, NE, log loss, calibration
(and on synthetic data NE_bayes and captured), with train time. The last line is ONE JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path

from opengem.features.schema import FeatureSchema

MODELS: dict[str, list[str]] = {
    "gem": [],
    "dlrm": ["model.arch=dlrm"],
    "dlrm_dcn": ["model.arch=dlrm_dcn"],
    "gem_no_seq": ["model.use_sequences=false"],
    "gem_no_wukong": ["model.interformer.wukong=false"],
    "gem_no_interleave": ["model.interformer.interleave=false"],
}
PEERS = ("dlrm", "dlrm_dcn")
METRICS = ("auc", "gauc", "ne", "logloss", "calibration")
SYNTHETIC_METRICS = ("ne_bayes", "captured")


@dataclass
class Dataset:
    source: str  # movielens | open_bandit | synthetic
    path: str  # under --shared (real data) or a synthetic preset
    recipe: str
    overrides: list[str] = field(default_factory=list)  # every model, both modes
    world: list[str] = field(default_factory=list)  # synthetic only: WorldConfig overrides (full mode)
    quick_world: list[str] = field(default_factory=list)

    def describe(self, quick: bool) -> str:
        world = self.quick_world if quick else self.world
        return " ".join([f"recipe {self.recipe}", *self.overrides] + ([f"world {self.path} {world}"] if world else []))


# One pass over the training rows (the recipes' rule), in both modes.
DATASETS: dict[str, Dataset] = {
    "ml100k": Dataset("movielens", "movielens-100k", "tiny", ["model.max_seq_len=64"]),
    "obd": Dataset("open_bandit", "open-bandit-small", "tiny"),
    "synthetic": Dataset("synthetic", "tiny", "tiny", world=["sizes.num_users=6000"],
                         quick_world=["sizes.num_users=1500"]),
}
# Without behaviour streams these build exactly GEM (no towers to drop or to cut off), so they are skipped.
SEQUENCE_ABLATIONS = ("gem_no_seq", "gem_no_interleave")


# ------------------------------------------------------------------------------- data
def prepare(name: str, ds: Dataset, shared: Path, work: Path, quick: bool) -> Path | None:
    """The dataset directory (converted or generated once under ``work``); None if the source is missing."""
    out = work / "data" / (f"{name}-quick" if quick and ds.source == "synthetic" else name)
    if (out / "manifest.json").exists():
        return out
    if ds.source == "synthetic":
        from opengem.data.synthetic import generate
        from opengem.recipes import world_config

        generate(world_config(ds.path, seed=0, overrides=ds.quick_world if quick else ds.world), out, progress=False)
        return out
    src = shared / ds.path
    if not src.exists():
        print(f"[quality] skipping {name}: {src} not found", flush=True)
        return None
    from opengem.data.sources import convert

    convert(ds.source, src, out)
    return out


# ------------------------------------------------------------------------------- one run
def run_one(data: str, run: str, recipe_name: str, overrides: list[str]) -> dict:
    """Train one model and evaluate it on the test split (runs in a worker process)."""
    import torch

    from opengem.config import apply_overrides
    from opengem.evaluation.evaluate import evaluate_run
    from opengem.recipes import recipe
    from opengem.train.trainer import train

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")  # DCP's "single process" notice on every save and load
    torch.set_num_threads(1)
    cfg = apply_overrides(recipe(recipe_name), ["train.threads=1", *overrides])
    cfg.train.progress = False
    final = train(cfg, data, run)
    ev = evaluate_run(run, data, "test", progress=False)
    return {"metrics": ev["metrics"], "wall_s": final["wall_s"], "steps": final["steps"],
            "examples": final["examples"], "parameters": final["parameters"]["total"]}


# ------------------------------------------------------------------------------- report
def mean_std(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarize(results: dict, synthetic: bool) -> dict:
    """model → task → metric → (mean, std) over seeds, on the ``all/<task>`` slices."""
    out: dict = {}
    for model, runs in results.items():
        tasks = sorted({k.split("/", 1)[1] for r in runs for k in r["metrics"] if k.startswith("all/")})
        names = METRICS + (SYNTHETIC_METRICS if synthetic else ())
        out[model] = {t: {m: mean_std([r["metrics"][f"all/{t}"].get(m) for r in runs]) for m in names}
                      for t in tasks}
        out[model]["_train_s"] = mean_std([r["wall_s"] for r in runs])
        out[model]["_params"] = runs[0]["parameters"]
    return out


def print_table(name: str, summary: dict, synthetic: bool) -> None:
    names = METRICS + (SYNTHETIC_METRICS if synthetic else ())
    tasks = [t for t in next(iter(summary.values())) if not t.startswith("_")]
    for task in tasks:
        print(f"\n{name} / {task}  (test split; mean ± std over seeds)")
        print(f"{'model':<18}" + "".join(f"{m:>18}" for m in names) + f"{'train s':>10}{'params':>10}")
        for model, s in summary.items():
            cells = "".join(f"{s[task][m][0]:>10.4f} ± {s[task][m][1]:.4f}" for m in names)
            print(f"{model:<18}{cells}{s['_train_s'][0]:>10.1f}{s['_params']:>10,}")


def headline(summaries: dict) -> dict:
    """The JSON keys: GEM vs the best peer (by AUC on real data, by captured on synthetic)."""
    out: dict = {}
    for name, s in summaries.items():
        synthetic = name == "synthetic"
        key = "captured" if synthetic else "auc"
        best = max(PEERS, key=lambda p: s[p]["click"][key][0])
        out[f"{name}_best_peer"] = best
        for metric in ("auc", "ne") + (("captured",) if synthetic else ()):
            out[f"{name}_{metric}_gem"] = round(s["gem"]["click"][metric][0], 5)
            out[f"{name}_{metric}_best_peer"] = round(s[best]["click"][metric][0], 5)
        gem = s["gem"]["click"]
        out[f"{name}_gem_beats_every_peer_auc_ne"] = all(
            gem["auc"][0] > s[p]["click"]["auc"][0] and gem["ne"][0] < s[p]["click"]["ne"][0] for p in PEERS)
        out[f"{name}_click_auc"] = {m: round(v["click"]["auc"][0], 5) for m, v in s.items()}
        out[f"{name}_click_ne"] = {m: round(v["click"]["ne"][0], 5) for m, v in s.items()}
        if synthetic:
            out[f"{name}_click_captured"] = {m: round(v["click"]["captured"][0], 5) for m, v in s.items()}
    return out


# ------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 seed and a smaller synthetic world (~2 min on 2 cores)")
    ap.add_argument("--seeds", type=int, default=0, help="0 = 3 (full) or 1 (--quick)")
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel, one thread each")
    ap.add_argument("--datasets", default=",".join(DATASETS))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--shared", default=str(Path(__file__).resolve().parents[2] / "shared" / "data"))
    ap.add_argument("--work", default=None, help="where data and runs go (default: a temporary directory)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    seeds = list(range(args.seeds or (1 if args.quick else 3)))
    models = args.models.split(",")
    work = Path(args.work or tempfile.mkdtemp(prefix="opengem-quality-"))
    t0 = time.perf_counter()

    jobs: dict = {}
    settings: dict = {}
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        for name in args.datasets.split(","):
            ds = DATASETS[name]
            data = prepare(name, ds, Path(args.shared), work, args.quick)
            if data is None:
                continue
            settings[name] = ds.describe(args.quick)
            for model in models:
                if model in SEQUENCE_ABLATIONS and not FeatureSchema.load(data).sequences:
                    print(f"[quality] {name}: no sequences, {model} is gem itself; skipped", flush=True)
                    continue
                for seed in seeds:
                    run = work / "runs" / name / f"{model}-s{seed}"
                    ov = [*ds.overrides, *MODELS[model], f"train.seed={seed}", f"data.seed={seed}"]
                    jobs[(name, model, seed)] = pool.submit(run_one, str(data), str(run), ds.recipe, ov)
        results: dict = {}
        for (name, model, _), fut in jobs.items():
            results.setdefault(name, {}).setdefault(model, []).append(fut.result())

    summaries = {}
    for name, res in results.items():
        summaries[name] = summarize(res, name == "synthetic")
        print_table(name, summaries[name], name == "synthetic")
    mode = (f"quick: {len(seeds)} seed(s) (full: 3), synthetic world of 1,500 users (full: 6,000)" if args.quick
            else f"full: {len(seeds)} seed(s)")
    print(f"\n[quality] {mode}; runs in {work}")
    out = {"mode": mode, "seeds": len(seeds), "settings": settings, "datasets": sorted(summaries), "models": models,
           "wall_s": round(time.perf_counter() - t0, 1), **(headline(summaries) if set(PEERS) <= set(models)
                                                             and "gem" in models else {})}
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
