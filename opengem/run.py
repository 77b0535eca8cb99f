"""The run directory: the third contract beside the feature schema and the ``Batch``.

``opengem train`` (and ``opengem distill``, for a student) writes a run directory; every later stage
reads one: evaluation, recalibration, export, teachers, reports. Its files, each name spelled once: here,
but for ``schema.json`` (the schema's own name) and ``checkpoints/`` (the checkpoint format's)::

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
it trains, checkpoints on every rank, final.json last. ``load_run_model`` is how every stage gets the
trained model back: rebuilt from config.json and schema.json, the latest checkpoint loaded, the
down-sampling correction (if any) and then the recalibration offsets (if any, fitted on top of the
corrected model) added to the heads' output biases, so evaluation, export, serving and teachers all
read the corrected, recalibrated model while the checkpoint itself is never changed.

The down-sampling correction (``downsampling_offsets``). Negatives (rows with no positive label,
``data.downsampling``) kept at rate r multiply the odds the model learns by 1/r (each kept negative
stands for 1/r of them: its weight), so the calibrated probability is He et al.'s q = p / (p + (1 − p)/w)
with w the rate r itself (not 1/r: that would shift the other way), i.e. logit(q) = logit(p) + log r,
an offset on the output bias. Which heads get it, with the ESMM chain
p(conv) = p(click) · p(conv | click) (``Heads.chain``):
a row with conv = 1 has click = 1, so the rows kept with click = 1 are all of them and p(conv | click)
is learnt unbiased; p(click) alone is inflated. So the offset is log r on each task's *own* logit when
the task is not chained (the base task, click) and 0 on a chained one (its logit is the conditional);
chaining the corrected click gives the corrected conversion (tests/unit/evaluation/test_downsampling_correction.py
checks it numerically). An unchained second task (``model.heads.chain_required=false``) also gets
log r, which is exact only as its rate → 0; the record says ``exact: false`` then, and a recalibration
fitted on top corrects the mean.

This module sits above ``model/`` and the checkpoint format (``opengem.checkpoint``), below everything
that writes or reads a run (``train/trainer.py``, ``evaluation/``, ``transfer/``, ``export/``, ``report/``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from opengem.checkpoint import SNAPSHOT_META, CheckpointError, best_checkpoint, latest_checkpoint, load_checkpoint
from opengem.config import Config
from opengem.features.schema import SCHEMA_FILE, FeatureSchema
from opengem.model.build import build_gem, materialize
from opengem.model.heads import Heads, chained_logit, log1mexp

__all__ = [
    "BASE_RATES_FILE", "CONFIG_FILE", "EVALUATION_FILE", "FINAL_FILE", "METRICS_FILE",
    "DOWNSAMPLING_FILE", "QUARANTINE_DIR", "RECALIBRATION_FILE", "REPORT_DIR", "SCHEMA_FILE", "TENSORBOARD_DIR",
    "TRANSFER_FILE",
    "USER_REP_FILE", "LogitShift", "RecalibrationError", "apply_downsampling", "apply_recalibration",
    "downsampling_offsets", "downsampling_record", "gem_heads", "load_downsampling", "save_downsampling",
    "shift_logits", "load_base_rates", "load_config",
    "load_final", "load_recalibration", "load_run_model", "load_schema", "offset_groups", "offsets_tensor",
    "save_base_rates", "save_config", "save_final", "save_recalibration", "save_schema", "slopes_tensor", "write_json"
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
TRANSFER_FILE = "transfer.json"
USER_REP_FILE = "user_rep.pt"
REPORT_DIR = "report"


class RecalibrationError(ValueError):
    """The run or split cannot be recalibrated, or its offsets do not fit the model; the message says why."""


def write_json(path: Path, obj: dict, sort_keys: bool = True) -> None:
    """Write ``obj`` atomically (a reader never sees half a file); values JSON lacks are written as str."""
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
    """The dense normaliser's training-split figures, for reading (the checkpoint holds them as buffers)."""
    write_json(Path(run_dir) / DENSE_STATS_FILE, stats)


def load_base_rates(run_dir: str | Path) -> dict[str, float]:
    path = Path(run_dir) / BASE_RATES_FILE
    if not path.exists():
        raise CheckpointError(f"{run_dir}: no {BASE_RATES_FILE} (NE's normaliser; written when training starts)")
    return json.loads(path.read_text())


def save_final(run_dir: str | Path, final: dict) -> None:
    write_json(Path(run_dir) / FINAL_FILE, final)


def load_final(run_dir: str | Path) -> dict | None:
    """The run's summary, or None while it trains (or if it was killed before the end)."""
    return _read_json(Path(run_dir) / FINAL_FILE)


def save_recalibration(run_dir: str | Path, record: dict) -> None:
    write_json(Path(run_dir) / RECALIBRATION_FILE, record, sort_keys=False)  # the fitting's order reads best


def load_recalibration(run_dir: str | Path) -> dict | None:
    """The record ``evaluation.recalibrate`` wrote (``offsets``, calibration before and after), or None."""
    return _read_json(Path(run_dir) / RECALIBRATION_FILE)


def save_downsampling(run_dir: str | Path, record: dict) -> None:
    write_json(Path(run_dir) / DOWNSAMPLING_FILE, record, sort_keys=False)


def load_downsampling(run_dir: str | Path) -> dict | None:
    """The record ``downsampling_record`` built for the run (rates, weights, offsets), or None (off)."""
    return _read_json(Path(run_dir) / DOWNSAMPLING_FILE)


# ------------------------------------------------------------------------------------- the model
def load_run_model(run_dir: str | Path, recalibrated: bool = True, best: bool = False,
                   snapshot: str | Path | None = None,
                   corrected: bool = True) -> tuple[torch.nn.Module, Config, FeatureSchema]:
    """The trained model of a run (latest checkpoint; with ``best``, the best held-out evaluation's,
    ``train.keep_best``; with ``snapshot``, that published snapshot of RUN/snapshots), single process,
    in eval mode; with ``corrected``, plus the down-sampling correction of ``RUN/downsampling.json`` if
    negatives were down-sampled (any checkpoint or snapshot of the run: all were trained so); with
    ``recalibrated``, plus the offsets of ``RUN/recalibration.json`` if the run has been recalibrated
    (for a snapshot: only if it holds the run's final model, which they were fitted on)."""
    run = Path(run_dir)
    cfg = load_config(run)
    schema = load_schema(run)
    ckpt = Path(snapshot) if snapshot is not None else best_checkpoint(run) if best else latest_checkpoint(run)
    if ckpt is None:
        raise CheckpointError(f"{run}: no {'best ' if best else ''}checkpoint "
                              f"({'was train.keep_best on?' if best else 'did training finish?'})")
    model = materialize(build_gem(schema, cfg.model), "cpu")
    load_checkpoint(ckpt, model, expect={"schema": schema.fingerprint()})
    if corrected:
        apply_downsampling(model, run, schema)
    if recalibrated and (snapshot is None or _is_final(run, Path(snapshot))):
        apply_recalibration(model, run, schema)
    return model.eval(), cfg, schema


def _is_final(run: Path, snapshot: Path) -> bool:
    """Whether ``snapshot`` holds the model of the run's final.json (the one recalibration was fitted on)."""
    final, meta = load_final(run), snapshot / SNAPSHOT_META
    return final is not None and meta.exists() and json.loads(meta.read_text())["step"] == final["steps"]


def gem_heads(model: torch.nn.Module) -> Heads:
    """The GEM heads a recalibration offset is added to (GEM and a student's backbone have them)."""
    heads = getattr(model, "heads", None)
    if not isinstance(heads, Heads):
        raise RecalibrationError(f"{type(model).__name__} has no GEM heads to recalibrate (peer baselines have none)")
    return heads


def offset_groups(heads: Heads, schema: FeatureSchema) -> list[str]:
    """The names of the heads' output groups, the first half of an offset's key: the domains, or
    ``["all"]`` with shared heads."""
    return list(schema.domains.names) if heads.out_b.shape[0] == schema.num_domains else ["all"]


def offsets_tensor(heads: Heads, offsets: dict[str, float], schema: FeatureSchema) -> torch.Tensor:
    """{"<group>/<task>": δ} → [G, T] in the heads' layout (``offset_groups``)."""
    groups = offset_groups(heads, schema)
    out = torch.zeros(len(groups), len(schema.task_names), dtype=torch.float64)
    for key, value in offsets.items():
        g, _, t = key.partition("/")
        if g not in groups or t not in schema.task_names:
            raise RecalibrationError(f"{RECALIBRATION_FILE}: unknown slice {key!r} (groups {groups}, "
                                     f"tasks {schema.task_names})")
        out[groups.index(g), schema.task_names.index(t)] = float(value)
    return out


def apply_recalibration(model: torch.nn.Module, run_dir: str | Path, schema: FeatureSchema) -> dict | None:
    """Add the run's fitted offsets (if any) to the heads' output biases; returns the file's record."""
    return _add_offsets(model, load_recalibration(run_dir), schema)


def _add_offsets(model: torch.nn.Module, record: dict | None, schema: FeatureSchema) -> dict | None:
    """Fold a record into the model: each task's own logit scaled by ``slopes`` (if the record has
    them: the heads' output weights and biases and the shortcut's weights for that task), then the
    per-(group, task) ``offsets`` added to the output biases; returns the record."""
    if record is None:
        return None
    heads = gem_heads(model)
    with torch.no_grad():
        if record.get("slopes"):
            a_T = slopes_tensor(record["slopes"], schema).to(heads.out_b.dtype)
            heads.out_w.mul_(a_T[None, :, None])
            heads.out_b.mul_(a_T[None, :])
            shortcut = getattr(model, "shortcut", None)
            for lin in (shortcut.linear, shortcut.pairs) if shortcut is not None else ():
                if lin is not None:
                    lin.weight.mul_(a_T[:, None].to(lin.weight.dtype))
        heads.out_b.add_(offsets_tensor(heads, record["offsets"], schema).to(heads.out_b.dtype))
    return record


def slopes_tensor(slopes: dict[str, float], schema: FeatureSchema) -> torch.Tensor:
    """{task: a} → [T] in schema order (1 for a task not named); an unknown task or a ≤ 0 is refused."""
    out = torch.ones(len(schema.task_names), dtype=torch.float64)
    for task, a in slopes.items():
        if task not in schema.task_names or not float(a) > 0:
            raise RecalibrationError(f"{RECALIBRATION_FILE}: slope {task!r}: {a!r} (tasks {schema.task_names}, "
                                     "a slope must be > 0)")
        out[schema.task_names.index(task)] = float(a)
    return out


# ------------------------------------------------------------------------------------- down-sampling
def downsampling_offsets(heads: Heads, schema: FeatureSchema, rates: dict[str, float]) -> torch.Tensor:
    """[G, T] logit offsets that undo negative down-sampling at ``rates`` ({domain: r}; module docstring):
    log r_g on each unchained task, 0 on a chained one. With shared heads (one output group) the
    domains' rates must be equal: one bias cannot carry two corrections."""
    groups = offset_groups(heads, schema)
    r_G = torch.tensor([float(rates[d]) for d in schema.domains.names], dtype=torch.float64)
    if groups == ["all"] and schema.num_domains > 1:
        if not bool((r_G == r_G[0]).all()):
            raise RecalibrationError(f"per-domain negative rates {rates} need per-domain output heads "
                                     "(model.heads.domain_mode=output): shared heads have one bias per task")
        r_G = r_G[:1]
    root = torch.tensor([p < 0 for p in heads.parent])
    return torch.where(root[None, :], torch.log(r_G)[:, None], torch.zeros((), dtype=torch.float64))


def downsampling_record(heads: Heads, schema: FeatureSchema, rates: dict[str, float], counts: dict) -> dict:
    """What ``RUN/downsampling.json`` holds: rate and weight per domain, the offsets, rows read and kept."""
    delta = downsampling_offsets(heads, schema, rates)
    groups = offset_groups(heads, schema)
    return {"negative": "a row with no label equal to 1 (with click -> conversion: click = 0)",
            "rates": dict(rates), "weights": {d: 1.0 / r for d, r in rates.items()},
            "offsets": {f"{g}/{t}": float(delta[i, j]) for i, g in enumerate(groups)
                        for j, t in enumerate(schema.task_names)},
            "exact": sum(p < 0 for p in heads.parent) == 1, **counts}


def apply_downsampling(model: torch.nn.Module, run_dir: str | Path, schema: FeatureSchema) -> dict | None:
    """Add the run's down-sampling correction (if it down-sampled) to the heads' output biases."""
    return _add_offsets(model, load_downsampling(run_dir), schema)


def shift_logits(logits_BT: torch.Tensor, delta_BT: torch.Tensor, parent: list[int]) -> torch.Tensor:
    """The chained logits the heads would give with ``delta_BT`` added to each task's own logit, from
    the chained logits alone: a chained task's own log σ is recovered as log σ(z_t) − log σ(z_parent)."""
    out: list[torch.Tensor] = []
    for t, p in enumerate(parent):
        if p < 0:
            out.append(logits_BT[:, t] + delta_BT[:, t])
            continue
        own = F.logsigmoid(logits_BT[:, t]) - F.logsigmoid(logits_BT[:, p])  # log σ(raw_t)
        raw = own - log1mexp(own)
        out.append(chained_logit(out[p], raw + delta_BT[:, t]))
    return torch.stack(out, dim=1)


class LogitShift(torch.nn.Module):
    """``model`` with per-(group, task) offsets on its heads' own logits, without touching its
    parameters (sharded ones included): what the trainer's held-out evaluations score when negatives
    are down-sampled, so they read the corrected model as every later stage does."""

    def __init__(self, model: torch.nn.Module, delta_GT: torch.Tensor):
        super().__init__()
        heads = gem_heads(model)
        self.model, self.parent, self.shared = model, list(heads.parent), heads.cfg.domain_mode != "output"
        self.register_buffer("delta_GT", delta_GT.double(), persistent=False)

    def max_seq_len(self):
        return self.model.max_seq_len()

    def forward(self, batch) -> torch.Tensor:
        z = self.model(batch)
        g = torch.zeros_like(batch.domain) if self.shared else batch.domain
        delta = self.delta_GT.to(z.device)[g.to(z.device)]
        return shift_logits(z.double(), delta, self.parent).to(z.dtype)
