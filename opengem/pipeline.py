"""``opengem demo``: the whole pipeline on one machine, as one library call.

    result = demo("./opengem-demo", preset="tiny")
    print(format_demo(result))

    OUT/data              a synthetic ads world (``opengem generate``)
    OUT/run               GEM trained on its train days, recalibrated on the valid days; its final
                          model published as RUN/snapshots/day-N (``opengem.train.continual``)
    OUT/vm                the default vertical model distilled from that snapshot (``distill_demo``:
                          a teacher reads published snapshots, as it would of a GEM trained continuously)
    OUT/artifact          the vertical model exported, served once and scored (``serve_smoke``)
    OUT/evaluation.json   GEM's test metrics and segments, the VM's (``distill``), serving, training
                          and timings
    OUT/explain.json      GEM's explanations of a sample of test rows (``opengem explain``), for the
                          report

An earlier demo's OUT/run, OUT/vm and OUT/artifact are removed first: the demo owns them, and a
run directory holding another run's snapshots is refused by training (``refuse_a_used_run_dir``).

Each step is the library function its own sub-command calls; this module only strings them
together, times them and prints the summary. It sits above every other module of the package.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from opengem.config import apply_overrides
from opengem.data.parquet import DatasetManifest
from opengem.evaluation.evaluate import evaluate_run, held_out_evaluator
from opengem.evaluation.explain import explain_run
from opengem.evaluation.recalibrate import recalibrate_run
from opengem.export.artifact import export_run
from opengem.export.client import free_port, http, wait_ready
from opengem.export.request import synthetic_request
from opengem.features.schema import SCHEMA_FILE, FeatureSchema
from opengem.recipes import recipe
from opengem.report.text import (
    distill_line,
    format_table,
    recalibration_line,
    worst_segment_line,
)
from opengem.run import EVALUATION_FILE, EXPLAIN_FILE
from opengem.train.trainer import train
from opengem.transfer.distill import distill
from opengem.world.generate import generate
from opengem.world.oracle import OracleCollector
from opengem.world.presets import world_config

# The demo's vertical model: the default techniques (kd + adapter + share), one pass over the
# student's day of the video surface (30% of the demo world's rows: the teacher scores fewer rows).
DEMO_RECIPE, DEMO_OVERRIDES = "vm_s", ("transfer.domains=video",)
# The held-out NE over training scores 1 file in 3 of valid (6 of the demo world's 18, ~27k rows):
# the same rows at every evaluation, a few seconds each on 2 CPU cores.
DEMO_EVAL_EVERY_KTH_FILE = 3
# Test rows the demo explains for its report: a few seconds of occlusion on 2 cores (docs/trust.md)
DEMO_EXPLAIN_ROWS = 32


def demo(out: str | Path, preset: str = "demo", seed: int = 0, overrides: Sequence[str] = (), *,
         recalibrate: bool = True, distil: bool = True, serve: bool = True, progress: bool = True,
         layout: str = "v2", world_overrides: Sequence[str] = ()) -> dict:
    """generate → train → recalibrate → evaluate → distil → export, serve, score one request, into
    ``out`` (see the module docstring). ``preset`` names both the world and the training recipe;
    ``overrides`` (``key=value``) go to the recipe, ``world_overrides`` to the world (e.g.
    ``structure_seed=1000``: a world of another form, ``benchmarks/heldout_demo.py``). Returns
    ``evaluation`` (what OUT/evaluation.json holds), ``recalibration`` and ``served`` (None when
    skipped) and ``out``. The data is written in ``layout`` (v2 by default: ~12x smaller, the same
    batches as v1)."""
    out = Path(out)
    data, run = out / "data", out / "run"
    # the demo's own outputs of an earlier demo: made anew
    for owned in (run, out / "vm", out / "artifact"):
        if owned.exists():
            shutil.rmtree(owned)
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    with _timed(times, "generate_s"):
        world = world_config(preset, seed=seed, overrides=world_overrides)
        generate(world, data, progress=progress, observer=OracleCollector, layout=layout)
    cfg = apply_overrides(recipe(preset), list(overrides))
    cfg.train.progress = progress
    with _timed(times, "train_s"):
        # publish_end: the same weights as the last checkpoint (~4 MB on demo), so every number
        # stays as it was used where the recipe evaluates periodically (demo: every 250 steps): a
        # third of valid's files
        evaluator = held_out_evaluator(data, cfg.train.eval_split,
                                       every_kth_file=DEMO_EVAL_EVERY_KTH_FILE)
        final = train(cfg, data, run, evaluator=evaluator, publish_end=True)
    recal = None
    if recalibrate and cfg.data.eval_split != "valid" and _has_split(data, "valid"):
        with _timed(times, "recalibrate_s"):
            recal = recalibrate_run(run, data, "valid", progress=progress)
    with _timed(times, "evaluate_s"):
        # the segment table reuses this pass's scores (opengem.evaluation.segments)
        ev = evaluate_run(run, data, cfg.data.eval_split, progress=progress, segments=True)
    with _timed(times, "explain_s"):
        explained = explain_run(run, data, sample=DEMO_EXPLAIN_ROWS, split=cfg.data.eval_split)
        (out / EXPLAIN_FILE).write_text(json.dumps(explained.to_dict(), indent=1))
        ev["explain"] = {"file": EXPLAIN_FILE, "rows": len(explained.rows),
                         "first": _first_group(explained.to_dict()["summary"])}
    served = None
    if distil:
        with _timed(times, "distill_s"):
            ev["distill"] = distill_demo(run, data, out / "vm")
    if serve:
        # the portable torch.export program: AOTInductor would add ~1 min here
        with _timed(times, "serve_s"):
            served = serve_smoke(out / "vm" if distil else run, out / "artifact", compile=False)
        ev["serving"] = {k: served[k] for k in ("artifact", "model_version", "runtime", "times")}
    times["total_s"] = time.perf_counter() - t0
    ev["train"] = {k: final[k]
                   for k in ("steps", "examples", "examples_per_s", "parameters", "params_sha256")}
    ev["times"] = times
    (out / EVALUATION_FILE).write_text(json.dumps(ev, indent=2, default=str))
    return {"evaluation": ev, "recalibration": recal, "served": served, "out": str(out)}


def _first_group(summary: dict) -> dict:
    """Per task, the input group that ranks first on the most explained rows, and that share."""
    out = {}
    for task, groups in summary.items():
        g = max(groups, key=lambda k: groups[k]["first_share"])
        out[task] = {"group": g, "share": groups[g]["first_share"]}
    return out


def _has_split(data: Path, split: str) -> bool:
    manifest = DatasetManifest.load(data)
    return split in manifest.splits and bool(manifest.split_files(split))


@contextmanager
def _timed(times: dict[str, float], key: str) -> Iterator[None]:
    t = time.perf_counter()
    yield
    times[key] = time.perf_counter() - t


def distill_demo(teacher_run: str | Path, data_dir: str | Path, out_dir: str | Path) -> dict:
    """Distil the default vertical model from a trained GEM run on the same data (one pass over
    the student's days), its teacher the run's newest published snapshot (else its checkpoint);
    returns the student's evaluation with the teacher's on the same slice (``metrics``, ``teacher``,
    ``alone``, ``transfer_ratio``; ``report.text.distill_line`` prints it)."""
    return distill(teacher_run, DEMO_RECIPE, data_dir, out_dir, DEMO_OVERRIDES)


def serve_smoke(run_dir: str | Path, artifact_dir: str | Path, compile: bool = True,
                candidates: int = 8) -> dict:
    """Export ``run_dir`` to ``artifact_dir`` (replacing it), serve it on a free loopback port,
    score one request of ``candidates`` ads, stop the server with SIGTERM. Returns the response
    and timings."""
    t0 = time.perf_counter()
    manifest = export_run(run_dir, artifact_dir, compile=compile, overwrite=True)
    times = {"export_s": time.perf_counter() - t0}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "opengem", "--quiet", "serve", "--artifact", str(artifact_dir),
           "--port", str(port)]
    status, response, runtime = 0, {}, None
    # a file, not a pipe: a chatty server never blocks on a full pipe
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env={**os.environ})
        try:
            times["startup_s"] = wait_ready(url, proc)
            runtime = http("GET", f"{url}/readyz")[1].get("runtime")
            schema = FeatureSchema.load(Path(artifact_dir) / SCHEMA_FILE)
            t1 = time.perf_counter()
            status, response = http("POST", f"{url}/v1/score",
                                    synthetic_request(schema, candidates, 20, seed=1))
            times["request_ms"] = (time.perf_counter() - t1) * 1e3
        finally:
            t2 = time.perf_counter()
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            times["shutdown_s"] = time.perf_counter() - t2
            log.seek(0)
            stderr = log.read().decode(errors="replace")[-2000:]
    if status != 200:
        raise RuntimeError(f"smoke request failed with {status}: {response}\n{stderr}")
    return {"artifact": str(artifact_dir), "model_version": manifest["model_version"], "url": url,
            "status": status, "response": response, "exit_code": code, "times": times,
            "runtime": runtime}


def format_demo(result: dict) -> str:
    """What ``opengem demo`` prints: GEM's table, the recalibration, sizes and timings, the VM, the
    served request."""
    ev, recal, served, out = (
        result["evaluation"],
        result["recalibration"],
        result["served"],
        Path(result["out"]),
    )
    tr = ev["train"]
    lines = [format_table(ev["metrics"])]
    if "segments" in ev:
        lines.append(worst_segment_line(ev["segments"]))
    if "explain" in ev:
        firsts = ", ".join(f"{t} {f['group']} ({f['share']:.0%})"
                           for t, f in ev["explain"]["first"].items())
        lines.append(f"explained {ev['explain']['rows']} test rows ({EXPLAIN_FILE}); the input "
                     f"group most often first: {firsts}")
    if recal is not None:
        lines.append("\n" + recalibration_line(recal))
    lines.append(f"\nparameters {tr['parameters']['total']:,} "
                 f"(dense {tr['parameters']['dense']:,}); "
                 f"{tr['examples']:,} examples at {tr['examples_per_s']:,.0f}/s; "
                 + ", ".join(f"{k} {v:.0f}s" for k, v in ev["times"].items()))
    if "distill" in ev:
        lines.append("vertical model " + distill_line(ev["distill"]))
    if served is not None:
        preds = served["response"]["predictions"]
        first = ", ".join(f"p({t}) {v[0]:.4f}" for t, v in preds.items())
        lines.append(f"served {out / 'artifact'} "
                     f"({'the vertical model' if 'distill' in ev else 'GEM'}, "
                     f"{served['runtime']}): one request of {len(next(iter(preds.values())))} "
                     f"candidates in {served['times']['request_ms']:.1f} ms; first "
                     f"candidate {first}")
    lines.append(f"wrote {out / EVALUATION_FILE}")
    return "\n".join(lines)
