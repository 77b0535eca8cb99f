"""The run directory: the third contract beside the feature schema and the ``Batch``.

``opengem train`` (and ``opengem distill``, for a student) writes a run directory; every later stage
reads one: evaluation, recalibration, export, teachers, reports. Its files, each name spelled once:
here, but for ``schema.json`` (the schema's own name) and ``checkpoints/`` (the
checkpoint format's)::

    RUN/config.json         the full config (recipe + overrides); the model is rebuilt from it
    RUN/schema.json         the data's schema (``features.schema.SCHEMA_FILE``)
    RUN/base_rates.json     training base rate per task and per domain/task (NE's normaliser;
                            ``data.base_rates``)
    RUN/metrics.jsonl       one line per logging step: loss (per domain/task) of the global batch, lr,
                            examples/s (``train.observe.RunLog``; truncated to the checkpoint on resume);
                            one per held-out evaluation when they are on (``train.hooks``)
    RUN/tensorboard/        the same numbers as TensorBoard scalars (purged past the step on resume)
    RUN/checkpoints/        DCP checkpoints, loader position and RNG per rank (layout and name in
                            ``opengem.checkpoint``: ``checkpoint_dir``, ``latest_checkpoint``); ``best/``,
                            the best held-out evaluation's model, with ``train.keep_best``
    RUN/snapshots/          continuous training: the model published at the end of each day, with the
                            last day it has seen (layout in ``opengem.checkpoint``: ``list_snapshots``);
                            what teachers read of a run that may still be training
    RUN/quarantine/         rows the loader set aside, Parquet per shard and rank, with a ``reason`` column
    RUN/final.json          steps, examples seen (all ranks), params_sha256, parameters, wall time,
                            examples/s, world size, peak RSS per rank (absent while training)
    RUN/recalibration.json  a logit offset per (domain, task) (and a slope per task), fitted on held-out days
                            (``opengem recalibrate``, ``evaluation.recalibrate``)
    RUN/downsampling.json   negative down-sampling of the training split (``data.negative_rate``): rate
                            and weight 1/r per domain, the correcting logit offsets, rows read and kept
                            (absent when it was off)
    RUN/evaluation.json     a distilled student's evaluation (``opengem demo`` writes one beside its run)
    RUN/transfer.json       a student run: teacher runs, techniques, surfaces, splits, shared tables
    RUN/user_rep.pt         a student reading teacher embeddings: the per-user feature-store snapshot
    RUN/report/             ``opengem report``'s default output

Training writes config, schema and base rates on rank 0 once its resume checks pass, metrics while
it trains, checkpoints on every rank, final.json last. ``load_run_model`` is how every stage gets
the trained model back: rebuilt from config.json and schema.json, the latest checkpoint loaded, the
down-sampling correction (if any) and then the recalibration offsets (if any, fitted on top of the
corrected model) added to the output biases (GEM's heads', a peer's own ``out_b``), so
evaluation, export, serving and teachers all read the corrected, recalibrated model while the
checkpoint itself is never changed.

The maths of both corrections (offsets folded into the output biases, the down-sampling offsets, the
trainer's ``LogitShift``) is ``opengem.model.logit_shift``'s; this module reads and writes
their records.

This module sits above ``model/`` and the checkpoint format (``opengem.checkpoint``), below
everything that writes or reads a run (``train/trainer.py``, ``evaluation/``, ``transfer/``,
``export/``, ``report/``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from opengem.checkpoint import (
    SNAPSHOT_META,
    CheckpointError,
    best_checkpoint,
    latest_checkpoint,
    load_checkpoint,
)
from opengem.config import Config
from opengem.features.schema import SCHEMA_FILE, FeatureSchema
from opengem.model.build import build_gem, materialize
from opengem.model.logit_shift import LogitOutput, downsampling_offsets, fold_offsets, offset_groups

__all__ = [
    "BASE_RATES_FILE", "CHECKPOINTS", "CONFIG_FILE", "DOWNSAMPLING_FILE", "EVALUATION_FILE",
    "FINAL_FILE", "METRICS_FILE", "QUARANTINE_DIR", "RECALIBRATION_FILE", "REPORT_DIR",
    "SCHEMA_FILE", "TENSORBOARD_DIR", "TRANSFER_FILE", "USER_REP_FILE", "apply_downsampling",
    "apply_recalibration", "downsampling_record", "load_base_rates", "load_config",
    "load_downsampling", "load_final", "load_recalibration", "load_run_model", "load_schema",
    "save_base_rates", "save_config", "save_downsampling", "save_final", "save_recalibration",
    "save_schema", "use_best", "write_json",
]

CONFIG_FILE = "config.json"
BASE_RATES_FILE = "base_rates.json"
DENSE_STATS_FILE = "dense_stats.json"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
QUARANTINE_DIR = "quarantine"
FINAL_FILE = "final.json"
RECALIBRATION_FILE = "recalibration.json"
DOWNSAMPLING_FILE = "downsampling.json"
EVALUATION_FILE = "evaluation.json"
EXPLAIN_FILE = "explain.json"  # opengem explain --json; the demo writes one beside its evaluation
TRANSFER_FILE = "transfer.json"
USER_REP_FILE = "user_rep.pt"
REPORT_DIR = "report"
CHECKPOINTS = ("best", "last")  # which model of a run a stage reads: ``use_best``

log = logging.getLogger(__name__)


def write_json(path: Path, obj: dict, sort_keys: bool = True) -> None:
    """Write ``obj`` atomically (a reader never sees half a file); values JSON lacks are written
    as str."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=sort_keys, default=str))
    tmp.replace(path)


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


# ------------------------------------------------------------------------------------- files
def save_config(run_dir: str | Path, cfg: Config) -> None:
    write_json(Path(run_dir) / CONFIG_FILE, cfg.to_dict())


def load_config(run_dir: str | Path) -> Config:
    path = Path(run_dir) / CONFIG_FILE
    if not path.exists():
        raise CheckpointError(f"{run_dir}: no {CONFIG_FILE} (not a training run directory)")
    return Config.from_dict(json.loads(path.read_text()))


def save_schema(run_dir: str | Path, schema: FeatureSchema) -> None:
    schema.save(Path(run_dir) / SCHEMA_FILE)


def load_schema(run_dir: str | Path) -> FeatureSchema:
    return FeatureSchema.load(Path(run_dir) / SCHEMA_FILE)


def save_base_rates(run_dir: str | Path, rates: dict[str, float]) -> None:
    write_json(Path(run_dir) / BASE_RATES_FILE, rates)


def save_dense_stats(run_dir: str | Path, stats: dict) -> None:
    """The dense normaliser's training-split figures, for reading (the checkpoint holds them
    as buffers)."""
    write_json(Path(run_dir) / DENSE_STATS_FILE, stats)


def load_base_rates(run_dir: str | Path) -> dict[str, float]:
    path = Path(run_dir) / BASE_RATES_FILE
    if not path.exists():
        raise CheckpointError(f"{run_dir}: no {BASE_RATES_FILE} (NE's normaliser; written when "
                              f"training starts)")
    return json.loads(path.read_text())


def save_final(run_dir: str | Path, final: dict) -> None:
    write_json(Path(run_dir) / FINAL_FILE, final)


def load_final(run_dir: str | Path) -> dict | None:
    """The run's summary, or None while it trains (or if it was killed before the end)."""
    return _read_json(Path(run_dir) / FINAL_FILE)


def save_recalibration(run_dir: str | Path, record: dict) -> None:
    # the fitting's order reads best
    write_json(Path(run_dir) / RECALIBRATION_FILE, record, sort_keys=False)


def load_recalibration(run_dir: str | Path) -> dict | None:
    """The record ``evaluation.recalibrate`` wrote (``offsets``, calibration before and after),
    or None."""
    return _read_json(Path(run_dir) / RECALIBRATION_FILE)


def save_downsampling(run_dir: str | Path, record: dict) -> None:
    write_json(Path(run_dir) / DOWNSAMPLING_FILE, record, sort_keys=False)


def load_downsampling(run_dir: str | Path) -> dict | None:
    """The record ``downsampling_record`` built for the run (rates, weights, offsets), or
    None (off)."""
    return _read_json(Path(run_dir) / DOWNSAMPLING_FILE)


# ------------------------------------------------------------------------------------- the model
def load_run_model(run_dir: str | Path, recalibrated: bool = True, best: bool = False,
                   snapshot: str | Path | None = None,
                   corrected: bool = True) -> tuple[torch.nn.Module, Config, FeatureSchema]:
    """The trained model of a run (latest checkpoint; with ``best``, the best held-out evaluation's,
    ``train.keep_best``; with ``snapshot``, that published snapshot of RUN/snapshots), single
    process, in eval mode; with ``corrected``, plus the down-sampling correction of
    ``RUN/downsampling.json`` if negatives were down-sampled (any checkpoint or snapshot of the run:
    all were trained so); with ``recalibrated``, plus the offsets of ``RUN/recalibration.json`` if
    the run has been recalibrated (for a snapshot: only if it holds the run's final model, which
    they were fitted on)."""
    run = Path(run_dir)
    cfg = load_config(run)
    schema = load_schema(run)
    ckpt = (
        Path(snapshot)
        if snapshot is not None
        else best_checkpoint(run)
        if best
        else latest_checkpoint(run)
    )
    if ckpt is None:
        raise CheckpointError(f"{run}: no {'best ' if best else ''}checkpoint "
                              f"({'was train.keep_best on?' if best else 'did training finish?'})")
    model = materialize(build_gem(schema, cfg.model), "cpu")
    load_checkpoint(ckpt, model, expect={"schema": schema.fingerprint()})
    if corrected:
        apply_downsampling(model, run, schema)
    if recalibrated and (snapshot is None or _is_final(run, Path(snapshot))):
        record = apply_recalibration(model, run, schema)
        _check_fitted_on(record, run, "best" if best and snapshot is None else "last")
    return model.eval(), cfg, schema


def use_best(run_dir: str | Path, checkpoint: str = "best") -> bool:
    """``load_run_model``'s ``best`` for a ``--checkpoint`` choice (``CHECKPOINTS``): ``best`` is
    the best held-out evaluation's model when the run kept one (``train.keep_best``), else the last
    checkpoint, the only model such a run has to give; ``last`` is the last."""
    if checkpoint not in CHECKPOINTS:
        raise ValueError(f"checkpoint must be one of {CHECKPOINTS}, got {checkpoint!r}")
    return checkpoint == "best" and best_checkpoint(run_dir) is not None


def _check_fitted_on(record: dict | None, run: Path, loaded: str) -> None:
    """Warn when the offsets were fitted on another checkpoint than the one they are added to: they
    still apply (the same run, the same heads) but correct the other model's miscalibration."""
    fitted = (record or {}).get("checkpoint", "last")  # records before the field: always the last
    if record is not None and fitted != loaded:
        log.warning("%s: %s was fitted on the %s checkpoint, added here to the %s one "
                    "(opengem recalibrate --checkpoint %s fits it again)",
                    run, RECALIBRATION_FILE, fitted, loaded, loaded)


def _is_final(run: Path, snapshot: Path) -> bool:
    """Whether ``snapshot`` holds the model of the run's final.json (the one recalibration was
    fitted on)."""
    final, meta = load_final(run), snapshot / SNAPSHOT_META
    return (
        final is not None
        and meta.exists()
        and json.loads(meta.read_text())["step"] == final["steps"]
    )


def apply_recalibration(
    model: torch.nn.Module, run_dir: str | Path, schema: FeatureSchema
) -> dict | None:
    """Add the run's fitted offsets (and slopes, if any) to the model's output biases
    (``logit_shift.fold_offsets``); returns the file's record."""
    return fold_offsets(model, load_recalibration(run_dir), schema)


# ------------------------------------------------------------------------------------- down-sampling
def downsampling_record(heads: LogitOutput, schema: FeatureSchema, rates: dict[str, float],
                        counts: dict) -> dict:
    """What ``RUN/downsampling.json`` holds: rate and weight per domain, the offsets, rows read
    and kept."""
    delta = downsampling_offsets(heads, schema, rates)
    groups = offset_groups(heads, schema)
    return {"negative": "a row with no label equal to 1 (with click -> conversion: click = 0)",
            "rates": dict(rates), "weights": {d: 1.0 / r for d, r in rates.items()},
            "offsets": {f"{g}/{t}": float(delta[i, j]) for i, g in enumerate(groups)
                        for j, t in enumerate(schema.task_names)},
            "exact": sum(p < 0 for p in heads.parent) == 1, **counts}


def apply_downsampling(
    model: torch.nn.Module, run_dir: str | Path, schema: FeatureSchema
) -> dict | None:
    """Add the run's down-sampling correction (if it down-sampled) to the model's output biases."""
    return fold_offsets(model, load_downsampling(run_dir), schema)
