"""``opengem`` command line: one sub-command per stage, no logic of its own.

    opengem [--log-level debug|info|warning] [--quiet] [--log-format text|json] COMMAND …
    opengem generate --preset P --out DIR [--seed N] [--world-seed N] [--layout v1|v2] [key=value …]
    opengem train    --recipe R --data DIR --out RUN [--resume] [--days D] [key=value …]
    opengem train    --data DIR --continue RUN --days D [--resume] [key=value …]   continuous training
    opengem evaluate --run RUN --data DIR [--split test] [--json FILE] [--signal]
                     [--checkpoint best|last]
    opengem explain  --run RUN --data DIR (--rows 0,5,9 | --sample N) [--split test] [--k 5]
                     [--background 16] [--json FILE]   per row: each input group's contribution
    opengem outcomes --run RUN --data DIR [--baseline RUN2 …] [--requests N] [--candidates K]
                     [--slots S]   synthetic worlds: auction replay, expected clicks/conversions/spend
    opengem recalibrate --run RUN --data DIR [--split valid] [--form offset|platt]
                     [--checkpoint best|last]
    opengem distill  --teacher RUN --student-recipe R --data DIR --out RUN [--via FM_RUN]
                     [--checkpoint best|last] [key=value …]
    opengem export   --run RUN --out ARTIFACT [--data DIR] [--no-compile] [--table-dtype fp32|fp16|int8]
                     [--checkpoint best|last]
    opengem serve    --artifact ARTIFACT [--host 127.0.0.1] [--port 8000] [--history STORE]
    opengem history-store --data DATA --out STORE   a v2 dataset's event logs → a memory-mapped history store
    opengem forget   --users FILE [--data DATA] [--history-store STORE] [--raw-ids --key-file F]
    opengem bench    [--quick] [--recipe R] [--levers eager,compile,ac,bf16,fp8]   benchmarks/speed.py
    opengem import   --source S --in PATH --out DIR [--spec FILE]   real data → our Parquet layout + schema
    opengem validate DATA [--strict]      check a dataset's files, columns, ids, times and event logs
    opengem report   --run RUN [--eval EVAL_JSON] [--out DIR] [--data DIR] [--bench FILE …]
    opengem demo     [--out DIR]          generate → train → evaluate → distil a VM → export it, serve, score a request
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from opengem.data import forget as forget_cli
from opengem.data.sources import cli as import_cli
from opengem.report import cli as report_cli
from opengem.report.logs import FORMATS, LEVELS, configure_logging
from opengem.report.text import (
    distill_line,
    format_table,
    recalibration_line,
    segment_lines,
    segment_recalibration_lines,
    signal_lines,
)

log = logging.getLogger("opengem")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="opengem", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log-level", choices=LEVELS, default=None,
                   help="info (default); warning: no progress bars either; debug: also the INFO "
                        "lines fbgemm_gpu and torchrec log at import and the warnings torch raises "
                        "in a single process")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars, warnings only (--log-level warning)")
    p.add_argument("--log-format", choices=FORMATS, default="text",
                   help="json: one JSON object per log line on stderr, for scripts (no "
                        "progress bars)")
    sub = p.add_subparsers(dest="cmd", required=True)
    for add in _STAGES:  # each sets its handler: set_defaults(handler=…)
        add(sub)
    return p


def _add_checkpoint(parser: argparse.ArgumentParser, whose: str = "the run's model") -> None:
    # run.CHECKPOINTS, spelled here so that parsing imports no torch (test_cli_surface.py)
    parser.add_argument("--checkpoint", choices=("best", "last"), default="best",
                        help=f"{whose}: best (default) is the best held-out evaluation's model "
                             "when the run kept one (train.keep_best), else its last checkpoint; "
                             "last: the last checkpoint")


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="write a synthetic ads world as Parquet shards")
    g.add_argument("--preset", default="demo")
    g.add_argument("--out", required=True)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--world-seed", type=int, default=None,
                   help="structure seed: the world's functional form (0: the demo world's; dev "
                        "0-99, report >= 1000)")
    g.add_argument("--no-oracle", action="store_true",
                   help="skip fitting the world's oracle (its captured is what evaluate divides "
                        "by; ~20-80 s on demo)")
    g.add_argument("--layout", choices=["v1", "v2"], default="v2",
                   help="v2 (default): event logs stored once per user, joined at read time, ~12x "
                        "smaller; v1: histories copied into every row (docs/dataset-layout.md); "
                        "the same batches either way")
    g.add_argument("overrides", nargs="*",
                   help="world config overrides key=value (e.g. sizes.num_users=3000)")
    g.set_defaults(handler=cmd_generate)


def cmd_generate(args) -> dict:
    from opengem.world.generate import generate
    from opengem.world.oracle import OracleCollector
    from opengem.world.presets import world_config

    structure = [] if args.world_seed is None else [f"structure_seed={args.world_seed}"]
    cfg = world_config(args.preset, seed=args.seed, overrides=[*args.overrides, *structure])
    t0 = time.perf_counter()
    manifest = generate(cfg, args.out, progress=not args.quiet,
                        observer=None if args.no_oracle else OracleCollector,
                        layout=args.layout)
    rows = sum(f.rows for f in manifest.files)
    log.info("wrote %d rows in %d shards to %s in %.1f s", rows, len(manifest.files), args.out,
             time.perf_counter() - t0)
    return {"rows": rows, "shards": len(manifest.files), "out": args.out}


def _add_train(sub) -> None:
    t = sub.add_parser("train", help="train a GEM foundation model")
    t.add_argument("--recipe", default=None,
                   help="the preset (default demo); a --continue run keeps its own")
    t.add_argument("--data", required=True)
    t.add_argument("--out", default=None, help="the run directory (required unless --continue)")
    t.add_argument("--resume", action="store_true",
                   help="continue from the run's latest checkpoint")
    t.add_argument("--continue", dest="continue_run", default=None, metavar="RUN",
                   help="continuous training: warm-start RUN from its last checkpoint and train "
                        "--days, one pass each, publishing RUN/snapshots/day-N after "
                        "each (opengem.train.continual)")
    t.add_argument("--days", default=None,
                   help="the days to train, in order: 4,5 or 2-4 (a stream: one pass a day)")
    t.add_argument("overrides", nargs="*", help="config overrides key=value (e.g. optim.lr=1e-3)")
    t.set_defaults(handler=cmd_train)


def cmd_train(args) -> dict:
    from opengem.config import ConfigError, apply_overrides
    from opengem.evaluation.evaluate import held_out_evaluator
    from opengem.recipes import recipe
    from opengem.train.continual import continue_config, parse_days
    from opengem.train.trainer import train

    days = parse_days(args.days) if args.days is not None else None
    overrides = list(args.overrides) + (["train.progress=false"] if args.quiet else [])
    if args.continue_run is not None:
        if days is None:
            raise ConfigError("--continue needs --days: the new days to train on")
        if args.recipe is not None or (args.out is not None
                                       and Path(args.out) != Path(args.continue_run)):
            raise ConfigError("--continue RUN trains RUN itself with its own recipe: drop "
                              "--recipe and --out")
        cfg = continue_config(args.continue_run, overrides)
        evaluator = held_out_evaluator(args.data, cfg.train.eval_split)
        final = train(cfg, args.data, args.continue_run, args.resume, evaluator, days=days,
                      warm=True)
        log.info("trained to step %d (%d examples), days seen %s", final["steps"],
                 final["examples"], final["days"])
        return final
    if args.out is None:
        raise ConfigError("train needs --out RUN (or --continue RUN)")
    cfg = apply_overrides(recipe(args.recipe or "demo"), overrides)
    # used when train.eval_* asks for it
    evaluator = held_out_evaluator(args.data, cfg.train.eval_split)
    final = train(cfg, args.data, args.out, resume=args.resume, evaluator=evaluator, days=days)
    log.info("trained %d steps (%d examples) in %.1f s", final["steps"], final["examples"],
             final["wall_s"])
    return final


def _add_outcomes(sub) -> None:
    o = sub.add_parser("outcomes",
                       help="synthetic data: auction replay of runs' rankings (expected clicks, "
                            "conversions, spend) against the truth, random and each other")
    o.add_argument("--run", required=True, help="the run to replay")
    o.add_argument("--data", required=True, help="the synthetic world it was trained on")
    o.add_argument("--baseline", action="append", default=[], metavar="RUN2",
                   help="another run on the same data (repeatable); lifts are over the first "
                        "(default: over --run)")
    o.add_argument("--split", default="test")
    o.add_argument("--requests", type=int, default=2000, help="requests sampled from the split")
    o.add_argument("--candidates", type=int, default=8, help="K: candidates per request")
    o.add_argument("--slots", type=int, default=3, help="S: slots filled per request")
    o.add_argument("--reserve-frac", type=float, default=0.25,
                   help="reserve, in bid x probability, as a share of target CTR x a unit bid")
    o.add_argument("--resamples", type=int, default=200, help="bootstrap resamples of requests")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--json", default=None, help="write the outcomes JSON here")
    _add_checkpoint(o)
    o.set_defaults(handler=cmd_outcomes)


def cmd_outcomes(args) -> dict:
    from opengem.world.replay import MarketConfig, format_outcomes, replay, run_scorers

    scorers = run_scorers([args.run, *args.baseline], args.data, args.checkpoint)
    names = list(scorers)
    out = replay(args.data, scorers, args.split, args.requests,
                 MarketConfig(candidates=args.candidates, slots=args.slots,
                              reserve_frac=args.reserve_frac),
                 args.seed, baseline=names[1] if args.baseline else names[0],
                 resamples=args.resamples)
    print(format_outcomes(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return out


def _add_evaluate(sub) -> None:
    e = sub.add_parser("evaluate", help="evaluate a run on a split")
    e.add_argument("--run", required=True)
    e.add_argument("--data", required=True)
    e.add_argument("--split", default="test")
    e.add_argument("--json", default=None, help="write the evaluation JSON here")
    e.add_argument("--batch-size", type=int, default=None,
                   help="rows per forward (default: EVAL_BATCH, 1024)")
    e.add_argument("--signal", action="store_true",
                   help="synthetic data: slope of the model's logit on each true term of the world")
    e.add_argument("--segments", nargs="?", const="all", default=None, metavar="FAMILIES",
                   help="NE, AUC and calibration per segment: every family the schema allows, or "
                        "those named (comma-separated: a user feature, surface, activity, "
                        "history, advertiser_size)")
    _add_checkpoint(e)
    e.set_defaults(handler=cmd_evaluate)


def cmd_evaluate(args) -> dict:
    from opengem.evaluation import EVAL_BATCH
    from opengem.evaluation.evaluate import evaluate_run
    from opengem.run import load_run_model, use_best

    batch, best = args.batch_size or EVAL_BATCH, use_best(args.run, args.checkpoint)
    segments = (False if args.segments is None else True if args.segments == "all"
                else args.segments.split(","))
    out = evaluate_run(args.run, args.data, args.split, batch, progress=not args.quiet, best=best,
                       segments=segments)
    # the world's instrument, not evaluation's: it reads the synthetic world's terms
    if args.signal:
        from opengem.world.signal import signal_decomposition

        model, _, schema = load_run_model(args.run, best=best)
        out["signal"] = signal_decomposition(model, schema, args.data, args.split, batch)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    print(format_table(out["metrics"]))
    if "segments" in out:
        print("\n" + segment_lines(out["segments"]))
    if out.get("signal"):
        print(signal_lines(out["signal"]))
    return out


def _add_explain(sub) -> None:
    e = sub.add_parser("explain",
                       help="per row: each input group's and the top history events' "
                            "contribution to a run's logits (occlusion)")
    e.add_argument("--run", required=True)
    e.add_argument("--data", required=True)
    e.add_argument("--split", default="test")
    e.add_argument("--rows", default=None,
                   help="row indices of --split: 0,5,9 or a range 10-19 (or both)")
    e.add_argument("--sample", type=int, default=None, metavar="N",
                   help="N rows of --split drawn with --seed instead of --rows")
    e.add_argument("--k", type=int, default=5, help="history events reported per stream and row")
    e.add_argument("--background", type=int, default=16, metavar="B",
                   help="train rows each feature is replaced from (0: streams and events only)")
    e.add_argument("--seed", type=int, default=0, help="draws the background (and --sample)")
    e.add_argument("--json", default=None, help="write the explanations JSON here")
    _add_checkpoint(e)
    e.set_defaults(handler=cmd_explain)


def cmd_explain(args) -> dict:
    from opengem.evaluation.explain import explain_run, format_explanation, parse_rows

    ex = explain_run(args.run, args.data, None if args.rows is None else parse_rows(args.rows),
                     args.sample, args.split, args.k, args.background, args.seed, args.checkpoint)
    out = ex.to_dict()
    print(format_explanation(ex))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


def _add_recalibrate(sub) -> None:
    r = sub.add_parser("recalibrate",
                       help="fit a logit offset per (domain, task) (--form platt: and a slope "
                            "per task) "
                                           "on held-out days (RUN/recalibration.json)")
    r.add_argument("--run", required=True)
    r.add_argument("--data", required=True)
    r.add_argument("--split", default="valid", help="the days to fit on (never test)")
    r.add_argument("--prior-std", type=float, default=0.1,
                   help="Gaussian prior on each offset (keeps thin slices near 0)")
    r.add_argument("--form", choices=("offset", "platt"), default="offset",
                   help="offset: one per (domain, task); platt: also a slope per task (logits "
                        "too spread)")
    r.add_argument("--segments", default=None, metavar="FAMILY",
                   help="measure offsets per segment of FAMILY (evaluate --segments) on top of "
                        "the per-domain ones, cross-fitted on halves of --split; writes nothing")
    _add_checkpoint(r, "the model to fit on (later stages should read the same one)")
    r.set_defaults(handler=cmd_recalibrate)


def cmd_recalibrate(args) -> dict:
    from opengem.evaluation.recalibrate import crossfit_segments, recalibrate_run
    from opengem.run import use_best

    if args.segments:
        out = crossfit_segments(args.run, args.data, args.segments, args.split, args.prior_std)
        print(segment_recalibration_lines(out))
        return out
    rec = recalibrate_run(args.run, args.data, args.split, args.prior_std, progress=not args.quiet,
                          form=args.form, best=use_best(args.run, args.checkpoint))
    print(recalibration_line(rec))
    return rec


def _add_distill(sub) -> None:
    k = sub.add_parser("distill",
                       help="distil a vertical model from a trained GEM (directly or --via "
                            "a domain FM)")
    k.add_argument("--teacher", required=True, help="the GEM run")
    k.add_argument("--student-recipe", default="vm_s",
                   help="vm_xs | vm_s | vm_m | fm_domain (or a train recipe)")
    k.add_argument("--data", required=True)
    k.add_argument("--out", required=True)
    k.add_argument("--via", default=None, help="a distilled domain FM run: GEM → FM → this student")
    k.add_argument("overrides", nargs="*", help="student recipe or transfer.* overrides key=value")
    _add_checkpoint(k,
                    "the teacher's model, when it publishes no snapshots (else the "
                    "one transfer.snapshot_lag "
                       "picks)")
    k.set_defaults(handler=cmd_distill)


def cmd_distill(args) -> dict:
    from opengem.run import use_best
    from opengem.transfer.distill import distill

    out = distill(args.teacher, args.student_recipe, args.data, args.out, list(args.overrides),
                  via=args.via, best=use_best(args.teacher, args.checkpoint))
    print(format_table(out["metrics"]))
    print("\n" + distill_line(out))
    return out


def _add_export(sub) -> None:
    x = sub.add_parser("export",
                       help="write a serving artifact of a run (torch.export program, "
                            "schema, manifest)")
    x.add_argument("--run", required=True)
    x.add_argument("--out", required=True)
    x.add_argument("--data", default=None,
                   help="evaluate on --split now and record the metrics in the manifest")
    x.add_argument("--split", default="test")
    x.add_argument("--no-compile", action="store_true",
                   help="skip the AOTInductor package (faster export)")
    x.add_argument("--table-dtype", choices=["fp32", "fp16", "int8"], default="fp32",
                   help="embedding tables in the artifact: fp32, or TorchRec-quantised fp16 / int8 "
                        "rows (serving only)")
    x.add_argument("--force", action="store_true", help="replace a non-empty --out")
    _add_checkpoint(x)
    x.set_defaults(handler=cmd_export)


def cmd_export(args) -> dict:
    from opengem.export.artifact import export_run
    from opengem.run import use_best

    m = export_run(args.run, args.out, args.data, args.split, compile=not args.no_compile,
                   overwrite=args.force, table_dtype=args.table_dtype,
                   best=use_best(args.run, args.checkpoint))
    par = max(v for k, v in m["parity"].items() if k.startswith("max_abs_diff"))
    log.info("wrote %s: model %s, parity max |Δp| %.2g vs the training model", args.out,
             m["model_version"], par)
    return m


def _add_serve(sub) -> None:
    s = sub.add_parser("serve", help="serve an artifact over HTTP (FastAPI + uvicorn)")
    s.add_argument("--artifact", required=True)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--runtime", default="auto", choices=["auto", "aoti", "exported", "eager"])
    s.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (0 = torch's default)")
    s.add_argument("--batch-window-ms", type=float, default=2.0,
                   help="longest wait to batch concurrent requests")
    s.add_argument("--max-candidates", type=int, default=1024,
                   help="candidates per request; more is a 413")
    s.add_argument("--no-admin", action="store_true", help="no /admin/reload endpoint")
    s.add_argument("--history", default=None,
                   help="a history store (opengem history-store): requests with "
                                                   "user_id may leave histories out")
    s.set_defaults(handler=cmd_serve)


def cmd_serve(args) -> dict:
    from opengem.export.request import Limits
    from opengem.export.server import serve

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    serve(args.artifact, args.host, args.port, args.runtime, args.batch_window_ms,
          Limits(max_candidates=args.max_candidates), admin=not args.no_admin,
          log_level="warning" if args.quiet else args.log_level, history=args.history)
    return {}


def _add_history_store(sub) -> None:
    h = sub.add_parser("history-store",
                       help="build the serving history store from a v2 dataset's event logs")
    h.add_argument("--data", required=True)
    h.add_argument("--out", required=True)
    h.set_defaults(handler=cmd_history_store)


def cmd_history_store(args) -> dict:
    from opengem.export.history import build_history_store

    meta = build_history_store(args.data, args.out)
    for name, st in meta["streams"].items():
        log.info("%s: stream %s, %d events of %d users (%d bytes)", args.out, name, st["events"],
                 st["users"], st["bytes"])
    return meta


def _add_forget(sub) -> None:
    # the parser is data's; the handler is here because the store's part is export's, which
    # imports torch (parsing must not)
    forget_cli.add_parser(sub).set_defaults(handler=cmd_forget)


def cmd_forget(args) -> dict:
    from opengem.export.forget import run

    return run(args)


def _add_bench(sub) -> None:
    # no arguments of its own: main collects them all (--help included) for
    # benchmarks/speed.py's parser
    b = sub.add_parser("bench", help="speed figures: runs benchmarks/speed.py of a source checkout",
                       add_help=False)
    b.set_defaults(handler=cmd_bench)


def cmd_bench(args) -> dict:
    """Run ``benchmarks/speed.py``: the instruments stand beside the library, not in it, so the
    command finds them in the checkout the package was installed from (``pip install -e .``)."""
    from opengem.config import ConfigError

    bench_dir = Path(__file__).resolve().parents[1] / "benchmarks"
    if not (bench_dir / "speed.py").is_file():
        raise ConfigError(f"opengem bench runs benchmarks/speed.py of a source checkout; "
                          f"{bench_dir} has none "
                          "(the instruments are not part of the installed package)")
    sys.path.insert(0, str(bench_dir))
    import speed

    return speed.main(args.bench_args)


def _add_validate(sub) -> None:
    v = sub.add_parser("validate",
                       help="check a dataset (schema, manifest, columns, ids, times, event logs)")
    v.add_argument("data")
    v.add_argument("--strict", action="store_true",
                   help="warnings (e.g. exact duplicate events) fail too")
    v.set_defaults(handler=cmd_validate)


def cmd_validate(args) -> dict:
    from opengem.data.parquet import DataError
    from opengem.data.validate import validate_dataset

    report = validate_dataset(args.data)
    print(report.format())
    failed = len(report.errors) + (len(report.warnings) if args.strict else 0)
    if failed:
        raise DataError(f"{args.data}: {failed} problems (listed above)")
    return {"counts": dict(report.counts)}


def _add_demo(sub) -> None:
    d = sub.add_parser("demo",
                       help="the main job: generate, train, evaluate, distil, export, serve "
                            "(demo world)")
    d.add_argument("--out", default="./opengem-demo")
    d.add_argument("--preset", default="demo",
                   help="world preset and recipe (tiny for a smoke run)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--no-recalibrate", action="store_true",
                   help="skip fitting the per-(domain, task) offsets on valid")
    d.add_argument("--no-distill", action="store_true",
                   help="skip distilling a vertical model (then GEM is served)")
    d.add_argument("--no-serve", action="store_true",
                   help="skip the last step: export, serve, score one request")
    d.add_argument("overrides", nargs="*", help="training config overrides key=value")
    d.set_defaults(handler=cmd_demo)


def cmd_demo(args) -> dict:
    from opengem.pipeline import demo, format_demo

    result = demo(args.out, args.preset, args.seed, args.overrides,
                  recalibrate=not args.no_recalibrate,
                  distil=not args.no_distill, serve=not args.no_serve, progress=not args.quiet)
    print(format_demo(result))
    return result


_STAGES = (_add_generate, _add_train, _add_evaluate, _add_explain, _add_outcomes,
           _add_recalibrate,
           _add_distill, _add_export, _add_serve, _add_history_store, _add_forget, _add_bench,
           _add_demo, _add_validate,
           import_cli.add_parser, report_cli.add_parser)  # the order --help lists them in


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``bench``'s arguments, ``--help`` included, are its script's to parse
    (``args.bench_args``): argparse would refuse them, or answer ``--help`` itself."""
    p = _parser()
    args, rest = p.parse_known_args(argv)
    if args.cmd == "bench":
        args.bench_args = rest
    elif rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    args.log_level = args.log_level or ("warning" if args.quiet else "info")
    configure_logging(LEVELS[args.log_level], args.log_format)
    # progress bars would interleave with JSON lines; the level set above stays
    args.quiet = args.quiet or args.log_level == "warning" or args.log_format == "json"
    from opengem.checkpoint import CheckpointError
    from opengem.config import ConfigError
    from opengem.data.parquet import DataError
    from opengem.export.artifact import ArtifactError
    from opengem.features.schema import SchemaError
    from opengem.train.resume import Preempted

    try:
        args.handler(args)
    except (ConfigError, DataError, SchemaError, CheckpointError, ArtifactError, ValueError) as e:
        print(f"opengem {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except Preempted as e:  # SIGTERM: a checkpoint was saved; --resume continues
        print(f"opengem {args.cmd}: preempted: {e.message}", file=sys.stderr)
        return e.code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
