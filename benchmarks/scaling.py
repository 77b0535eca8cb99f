"""Data-parallel scaling of ``opengem train`` under torchrun: examples/s and peak RSS per rank.

    python benchmarks/scaling.py --quick            tiny world, 1/2/4 gloo processes, < 5 min on 2 cores
    python benchmarks/scaling.py --procs 1,2,4,8    on a GPU host (backend auto: NCCL, one GPU per rank)

Weak scaling: every rank trains ``--batch-size`` rows per step, so the global batch grows with the
number of processes, and examples/s counts the rows of all ranks. Each run goes through the
distributed path, the 1-process run included (TorchRec tables + FSDP2 on a world of one), and each
process uses one intra-op thread (``OMP_NUM_THREADS=1``) so that per-rank work stays the same. The
rate is the steady-state rate: rows over time of the logged steps after ``--warmup`` steps.

On a machine with C cores, more than C processes cannot be faster: they share the cores, and every
step adds all-to-alls and reduce-scatters. On the 2-core CPU machines this project is tested on,
``scaling_2`` ≤ 1 and ``scaling_4`` < 1 are what to expect; the numbers there measure overhead,
not speed-up. Ends with ONE JSON line: eps_N, scaling_N = eps_N / eps_1, peak_rss_mb per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from opengem.run import FINAL_FILE, METRICS_FILE

REPO = Path(__file__).resolve().parents[1]


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny world and recipe, few steps")
    p.add_argument("--procs", default="1,2,4", help="comma-separated process counts")
    p.add_argument("--preset", default="demo", help="world preset (--quick: tiny)")
    p.add_argument("--recipe", default=None, help="training recipe (default: the preset's name)")
    p.add_argument("--steps", type=int, default=40, help="training steps per run (--quick: 14)")
    p.add_argument("--warmup", type=int, default=4, help="first steps left out of the rate")
    p.add_argument("--batch-size", type=int, default=None,
                   help="rows per rank and step (default: the recipe's; --quick: 64)")
    p.add_argument("--out", default=None,
                   help="working directory (default: a temporary one, removed)")
    p.add_argument("overrides", nargs="*", help="extra training overrides key=value")
    a = p.parse_args()
    if a.quick:
        a.preset, a.steps, a.batch_size = "tiny", min(a.steps, 14), a.batch_size or 64
    a.recipe = a.recipe or a.preset
    return a


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT"):
        env.pop(key, None)
    return env


def _run(cmd: list[str], log: Path) -> float:
    t0 = time.perf_counter()
    with open(log, "w") as out:
        rc = subprocess.run(cmd, cwd=REPO, env=_env(), stdout=out,
                            stderr=subprocess.STDOUT).returncode
    if rc:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise SystemExit(f"scaling: {' '.join(cmd[:8])} … failed ({rc}):\n{tail}")
    return time.perf_counter() - t0


def generate(preset: str, out: Path) -> Path:
    data = out / f"data-{preset}"
    if not (data / "dataset.json").exists():
        _run([sys.executable, "-m", "opengem", "--quiet", "generate", "--preset", preset, "--out",
              str(data)],
             out / "generate.log")
    return data


def train(n: int, data: Path, out: Path, a: argparse.Namespace) -> dict:
    """One torchrun job on ``n`` processes; returns its rate, peak RSS per rank and wall time."""
    run = out / f"run-{n}"
    overrides = [f"train.max_steps={a.steps}", "train.log_every=1", "train.epochs=100",
                 "train.progress=false",
                 *([f"data.batch_size={a.batch_size}"] if a.batch_size else []), *a.overrides]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           "-m", "opengem", "--quiet", "train", "--recipe", a.recipe, "--data", str(data), "--out",
           str(run), *overrides]
    wall = _run(cmd, out / f"train-{n}.log")
    final = json.loads((run / FINAL_FILE).read_text())
    recs = [json.loads(x) for x in (run / METRICS_FILE).read_text().splitlines()]
    prev = [0] + [r["examples"] for r in recs[:-1]]
    # (rows, rows/s) per step
    steps = [(r["examples"] - p, r["examples_per_s"]) for r, p in zip(recs, prev)]
    steady = steps[a.warmup:] or steps[-1:]
    eps = sum(n_rows for n_rows, _ in steady) / sum(n_rows / rate for n_rows, rate in steady)
    return {"eps": eps, "peak_rss_mb": final["peak_rss_mb"], "wall_s": wall,
            "steps": final["steps"], "world_size": final["world_size"]}


def main() -> None:
    a = _args()
    procs = [int(x) for x in a.procs.split(",")]
    with tempfile.TemporaryDirectory(prefix="opengem-scaling-") as tmp:
        out = Path(a.out) if a.out else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        data = generate(a.preset, out)
        results = {}
        for n in procs:
            results[n] = train(n, data, out, a)
            r = results[n]
            print(f"{n} process(es): {r['eps']:,.0f} examples/s, peak RSS per rank "
                  f"{r['peak_rss_mb']} MB, {r['steps']} steps, {r['wall_s']:.0f} s wall",
                  file=sys.stderr)
    import torch

    base = results[procs[0]]["eps"]
    line = {f"eps_{n}": round(r["eps"], 1) for n, r in results.items()}
    line.update({f"scaling_{n}": round(r["eps"] / base, 3) for n,
                 r in results.items() if n != procs[0]})
    line["peak_rss_mb"] = {str(n): r["peak_rss_mb"] for n, r in results.items()}
    line.update({"per_rank_batch": a.batch_size or f"recipe {a.recipe}", "steps": a.steps,
                 "preset": a.preset, "device": "cuda" if torch.cuda.is_available() else "cpu",
                 "cpu_cores": os.cpu_count()})
    if not torch.cuda.is_available() and max(procs) > (os.cpu_count() or 1):
        print(f"note: {os.cpu_count()} CPU cores; runs with more processes than cores share them "
              f"and cannot be "
              "faster (the figures measure communication and scheduling overhead)", file=sys.stderr)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
