"""``opengem`` command line: one sub-command per stage, no logic of its own.

    opengem generate --preset P --out DIR [--seed N] [key=value …]
    opengem train    --recipe R --data DIR --out RUN [--resume] [key=value …]
    opengem evaluate --run RUN --data DIR [--split test] [--json FILE] [--signal]
    opengem distill  --teacher RUN --student-recipe R --data DIR --out RUN [--via FM_RUN] [key=value …]
    opengem export   --run RUN --out ARTIFACT [--data DIR] [--no-compile] [--table-dtype fp32|fp16|int8]
    opengem serve    --artifact ARTIFACT [--host 127.0.0.1] [--port 8000]
    opengem bench    [--recipe R] [--data DIR] [--levers eager,compile,ac,bf16,fp8]
    opengem import   --source S --in PATH --out DIR [--spec FILE]   real data → our Parquet layout + schema
    opengem report   --run RUN [--eval EVAL_JSON] [--out DIR] [--data DIR] [--bench FILE …]
    opengem demo     [--out DIR]          generate → train → evaluate → distil a VM → export it, serve, score a request
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

from opengem.data.sources import cli as import_cli
from opengem.report import cli as report_cli
from opengem.report.logs import FORMATS, configure_logging

log = logging.getLogger("opengem")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="opengem", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quiet", action="store_true", help="no progress bars, warnings only")
    p.add_argument("--log-format", choices=FORMATS, default="text",
                   help="json: one JSON object per log line on stderr, for scripts (no progress bars)")
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="write a synthetic ads world as Parquet shards")
    g.add_argument("--preset", default="demo")
    g.add_argument("--out", required=True)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("overrides", nargs="*", help="world config overrides key=value")

    t = sub.add_parser("train", help="train a GEM foundation model")
    t.add_argument("--recipe", default="demo")
    t.add_argument("--data", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    t.add_argument("overrides", nargs="*", help="config overrides key=value (e.g. optim.lr=1e-3)")

    e = sub.add_parser("evaluate", help="evaluate a run on a split")
    e.add_argument("--run", required=True)
    e.add_argument("--data", required=True)
    e.add_argument("--split", default="test")
    e.add_argument("--json", default=None, help="write the evaluation JSON here")
    e.add_argument("--batch-size", type=int, default=None, help="rows per forward (default: EVAL_BATCH, 1024)")
    e.add_argument("--signal", action="store_true",
                   help="synthetic data: slope of the model's logit on each true term of the world")

    r = sub.add_parser("recalibrate", help="fit one logit offset per (domain, task) on held-out days (RUN/recalibration.json)")
    r.add_argument("--run", required=True)
    r.add_argument("--data", required=True)
    r.add_argument("--split", default="valid", help="the days to fit on (never test)")
    r.add_argument("--prior-std", type=float, default=0.1, help="Gaussian prior on each offset (keeps thin slices near 0)")

    k = sub.add_parser("distill", help="distil a vertical model from a trained GEM (directly or --via a domain FM)")
    k.add_argument("--teacher", required=True, help="the GEM run")
    k.add_argument("--student-recipe", default="vm_s", help="vm_xs | vm_s | vm_m | fm_domain (or a train recipe)")
    k.add_argument("--data", required=True)
    k.add_argument("--out", required=True)
    k.add_argument("--via", default=None, help="a distilled domain FM run: GEM → FM → this student")
    k.add_argument("overrides", nargs="*", help="student recipe or transfer.* overrides key=value")

    x = sub.add_parser("export", help="write a serving artifact of a run (torch.export program, schema, manifest)")
    x.add_argument("--run", required=True)
    x.add_argument("--out", required=True)
    x.add_argument("--data", default=None, help="evaluate on --split now and record the metrics in the manifest")
    x.add_argument("--split", default="test")
    x.add_argument("--no-compile", action="store_true", help="skip the AOTInductor package (faster export)")
    x.add_argument("--table-dtype", choices=["fp32", "fp16", "int8"], default="fp32",
                   help="embedding tables in the artifact: fp32, or TorchRec-quantised fp16 / int8 rows (serving only)")
    x.add_argument("--force", action="store_true", help="replace a non-empty --out")

    s = sub.add_parser("serve", help="serve an artifact over HTTP (FastAPI + uvicorn)")
    s.add_argument("--artifact", required=True)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--runtime", default="auto", choices=["auto", "aoti", "exported", "eager"])
    s.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    s.add_argument("--batch-window-ms", type=float, default=2.0, help="longest wait to batch concurrent requests")
    s.add_argument("--max-candidates", type=int, default=1024, help="candidates per request; more is a 413")
    s.add_argument("--no-admin", action="store_true", help="no /admin/reload endpoint")

    b = sub.add_parser("bench", help="training step time by phase, each speed/memory lever, the loader alone")
    b.add_argument("--recipe", default="demo")
    b.add_argument("--data", default=None, help="a dataset directory (default: a fresh tiny synthetic world)")
    b.add_argument("--levers", default="eager,compile,ac,bf16,fp8", help="comma-separated; combine with '+'")
    b.add_argument("--steps", type=int, default=10)
    b.add_argument("--warmup", type=int, default=3)
    b.add_argument("--json", default=None, help="write the figures here")
    b.add_argument("--quick", action="store_true",
                   help="the headline figures in a few CPU minutes: jagged vs padded, loader vs training, FP8 and "
                        "int8 memory, time to DLRM-DCN's quality; ends with one JSON line")
    b.add_argument("overrides", nargs="*", help="config overrides key=value")

    d = sub.add_parser("demo", help="the main job: generate, train, evaluate, distil, export, serve (demo world)")
    d.add_argument("--out", default="./opengem-demo")
    d.add_argument("--preset", default="demo", help="world preset and recipe (tiny for a smoke run)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--no-recalibrate", action="store_true", help="skip fitting the per-(domain, task) offsets on valid")
    d.add_argument("--no-distill", action="store_true", help="skip distilling a vertical model (then GEM is served)")
    d.add_argument("--no-serve", action="store_true", help="skip the last step: export, serve, score one request")
    d.add_argument("overrides", nargs="*", help="training config overrides key=value")

    import_cli.add_parser(sub)
    report_cli.add_parser(sub)
    return p


def _overrides(items: list[str]) -> dict:
    out = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"opengem: override {item!r} must look like key=value")
        k, v = item.split("=", 1)
        out[k] = v
    return out


def cmd_generate(args) -> dict:
    from opengem.data.synthetic import generate, world_config

    cfg = world_config(args.preset, seed=args.seed, **_overrides(args.overrides))
    t0 = time.perf_counter()
    manifest = generate(cfg, args.out, progress=not args.quiet)
    rows = sum(f.rows for f in manifest.files)
    log.info("wrote %d rows in %d shards to %s in %.1f s", rows, len(manifest.files), args.out, time.perf_counter() - t0)
    return {"rows": rows, "shards": len(manifest.files), "out": args.out}


def cmd_train(args) -> dict:
    from opengem.config import apply_overrides
    from opengem.evaluation.evaluate import held_out_evaluator
    from opengem.recipes import recipe
    from opengem.train.trainer import train

    cfg = apply_overrides(recipe(args.recipe), list(args.overrides))
    if args.quiet:
        cfg.train.progress = False
    evaluator = held_out_evaluator(args.data, cfg.train.eval_split)  # used when train.eval_* asks for it
    final = train(cfg, args.data, args.out, resume=args.resume, evaluator=evaluator)
    log.info("trained %d steps (%d examples) in %.1f s", final["steps"], final["examples"], final["wall_s"])
    return final


def cmd_evaluate(args) -> dict:
    from opengem.evaluation.evaluate import EVAL_BATCH, evaluate_run

    out = evaluate_run(args.run, args.data, args.split, args.batch_size or EVAL_BATCH, progress=not args.quiet,
                       signal=args.signal)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=_json_default))
    print(format_table(out["metrics"]))
    for part, d in out.get("signal", {}).items():
        print(f"\n{part}: slope of the model's logit on each true term (1 = fully learned), corr {d['corr']:.3f}")
        print("  " + ", ".join(f"{k} {v:+.2f}" for k, v in d["slopes"].items()))
    return out


def cmd_recalibrate(args) -> dict:
    from opengem.evaluation.recalibrate import recalibrate_run

    rec = recalibrate_run(args.run, args.data, args.split, args.prior_std, progress=not args.quiet)
    print(_recalibration_line(rec))
    return rec


def _recalibration_line(rec: dict) -> str:
    before, after = rec["calibration_before"], rec["calibration_after"]
    return (f"recalibrated on {rec['split']} ({rec['rows']:,} rows): "
            + ", ".join(f"{k} {rec['offsets'][k]:+.3f} (calibration {before[k]:.3f} → {after[k]:.3f})"
                        for k in before))


def cmd_distill(args) -> dict:
    from opengem.transfer.distill import distill, summary_line

    out = distill(args.teacher, args.student_recipe, args.data, args.out, list(args.overrides), via=args.via)
    print(format_table(out["metrics"]))
    print("\n" + summary_line(out))
    return out


def cmd_export(args) -> dict:
    from opengem.export.artifact import export_run

    m = export_run(args.run, args.out, args.data, args.split, compile=not args.no_compile, overwrite=args.force,
                   table_dtype=args.table_dtype)
    par = max(v for k, v in m["parity"].items() if k.startswith("max_abs_diff"))
    log.info("wrote %s: model %s, parity max |Δp| %.2g vs the training model", args.out, m["model_version"], par)
    return m


def cmd_serve(args) -> dict:
    from opengem.export.request import Limits
    from opengem.export.server import serve

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    serve(args.artifact, args.host, args.port, args.runtime, args.batch_window_ms,
          Limits(max_candidates=args.max_candidates), admin=not args.no_admin,
          log_level="warning" if args.quiet else "info")
    return {}


def cmd_bench(args) -> dict:
    from opengem.config import apply_overrides
    from opengem.recipes import recipe
    from opengem.bench.levers import format_bench, run_bench

    if args.quick:
        from opengem.bench.quick import quick_bench

        out = quick_bench()
        print(json.dumps({k: v for k, v in out.items() if not isinstance(v, dict)}))
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2))
        return out
    import torch

    cfg = apply_overrides(recipe(args.recipe), list(args.overrides))
    if cfg.train.threads:  # as ``train`` does, so bench and training figures are comparable
        torch.set_num_threads(cfg.train.threads)
    out = run_bench(cfg, args.data, tuple(args.levers.split(",")), args.warmup, args.steps)
    out["threads"] = torch.get_num_threads()
    print(format_bench(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


def cmd_demo(args) -> dict:
    from opengem.config import apply_overrides
    from opengem.data.parquet import DatasetManifest
    from opengem.data.synthetic import generate, world_config
    from opengem.evaluation.evaluate import evaluate_run
    from opengem.recipes import recipe
    from opengem.train.trainer import train

    out = Path(args.out)
    data, run = out / "data", out / "run"
    times = {}
    t0 = time.perf_counter()
    generate(world_config(args.preset, seed=args.seed), data, progress=not args.quiet)
    times["generate_s"] = time.perf_counter() - t0
    cfg = apply_overrides(recipe(args.preset), list(args.overrides))
    cfg.train.progress = not args.quiet
    t1 = time.perf_counter()
    final = train(cfg, data, run)
    times["train_s"] = time.perf_counter() - t1
    recal = None
    manifest = DatasetManifest.load(data)
    if not args.no_recalibrate and cfg.data.eval_split != "valid" and "valid" in manifest.splits \
            and manifest.split_files("valid"):
        from opengem.evaluation.recalibrate import recalibrate_run

        t = time.perf_counter()
        recal = recalibrate_run(run, data, "valid", progress=not args.quiet)
        times["recalibrate_s"] = time.perf_counter() - t
    t2 = time.perf_counter()
    ev = evaluate_run(run, data, cfg.data.eval_split, progress=not args.quiet)
    times["evaluate_s"] = time.perf_counter() - t2
    served, vm = None, None
    if not args.no_distill:
        from opengem.transfer.distill import distill_demo, summary_line

        t3 = time.perf_counter()
        vm = distill_demo(run, data, out / "vm")
        times["distill_s"] = time.perf_counter() - t3
        ev["distill"] = vm
    if not args.no_serve:
        from opengem.export.smoke import serve_smoke

        t4 = time.perf_counter()  # the portable torch.export program: AOTInductor would add ~1 min here
        served = serve_smoke(out / "vm" if vm is not None else run, out / "artifact", compile=False)
        times["serve_s"] = time.perf_counter() - t4
        ev["serving"] = {k: served[k] for k in ("artifact", "model_version", "runtime", "times")}
    times["total_s"] = time.perf_counter() - t0
    ev["train"] = {k: final[k] for k in ("steps", "examples", "examples_per_s", "parameters", "params_sha256")}
    ev["times"] = times
    (out / "evaluation.json").write_text(json.dumps(ev, indent=2, default=_json_default))
    print(format_table(ev["metrics"]))
    if recal is not None:
        print("\n" + _recalibration_line(recal))
    print(f"\nparameters {final['parameters']['total']:,} (dense {final['parameters']['dense']:,}); "
          f"{final['examples']:,} examples at {final['examples_per_s']:,.0f}/s; "
          + ", ".join(f"{k} {v:.0f}s" for k, v in times.items()))
    if vm is not None:
        print("vertical model " + summary_line(vm))
    if served is not None:
        preds = served["response"]["predictions"]
        first = ", ".join(f"p({t}) {v[0]:.4f}" for t, v in preds.items())
        print(f"served {out / 'artifact'} ({'the vertical model' if vm is not None else 'GEM'}, {served['runtime']}): one request of {len(next(iter(preds.values())))} "
              f"candidates in {served['times']['request_ms']:.1f} ms; first candidate {first}")
    print(f"wrote {out / 'evaluation.json'}")
    return ev


def _json_default(o):
    if isinstance(o, float) and math.isnan(o):
        return None
    return str(o)


def format_table(metrics: dict) -> str:
    cols = ["ne", "auc", "gauc", "calibration", "logloss", "ne_bayes", "captured", "n"]
    lines = [f"{'slice':<22}" + "".join(f"{c:>12}" for c in cols)]
    for key in sorted(metrics):
        m = metrics[key]
        cells = []
        for c in cols:
            v = m.get(c)
            cells.append(f"{'-':>12}" if v is None else (f"{v:>12,d}" if isinstance(v, int) else f"{v:>12.4f}"))
        lines.append(f"{key:<22}" + "".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging(logging.WARNING if args.quiet else logging.INFO, args.log_format)
    if args.log_format == "json":
        args.quiet = True  # progress bars would interleave with the JSON lines; the level set above stays
    from opengem.config import ConfigError
    from opengem.data.parquet import DataError
    from opengem.export.artifact import ArtifactError
    from opengem.features.schema import SchemaError
    from opengem.train.checkpoint import CheckpointError
    from opengem.train.resume import Preempted

    try:
        {"generate": cmd_generate, "train": cmd_train, "evaluate": cmd_evaluate, "recalibrate": cmd_recalibrate,
         "distill": cmd_distill,
         "export": cmd_export, "serve": cmd_serve, "bench": cmd_bench, "demo": cmd_demo,
         "import": import_cli.run, "report": report_cli.run}[args.cmd](args)
    except (ConfigError, DataError, SchemaError, CheckpointError, ArtifactError, ValueError) as e:
        print(f"opengem {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except Preempted as e:  # SIGTERM: a checkpoint was saved; --resume continues
        print(f"opengem {args.cmd}: preempted: {e.message}", file=sys.stderr)
        return e.code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
