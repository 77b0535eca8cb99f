"""The training entry point: one function from (config, data, run dir) to a trained run.

    RUN/config.json       the full config (recipe + overrides) — evaluation rebuilds the model from it
    RUN/schema.json       the data's schema
    RUN/base_rates.json   training base rate per task and per domain/task (NE's normaliser)
    RUN/metrics.jsonl     one line per logging step: loss (per domain/task), lr, examples/s
    RUN/checkpoints/      DCP checkpoints (see ``checkpoint.py``)
    RUN/final.json        steps, examples seen, params_sha256, parameters, wall time, examples/s

Distribution stays out of this file's model code path: the model is single-device; a later
``opengem.parallel.parallelize`` wraps it between build and materialise.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from opengem.config import Config
from opengem.data.loader import ShardLoader
from opengem.data.parquet import DatasetManifest, read_shard
from opengem.evaluation.accumulator import RateCounter
from opengem.features.schema import FeatureSchema
from opengem.model.build import build_gem, count_parameters, materialize
from opengem.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from opengem.train.losses import masked_bce
from opengem.train.optim import Schedule, build_optimizers

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. the loss became NaN); the message says where."""


def train_base_rates(data_dir: str | Path, schema: FeatureSchema, split: str) -> dict[str, float]:
    """Label means of the training split per task and per domain/task, reading only label columns."""
    manifest = DatasetManifest.load(data_dir)
    counter = RateCounter(list(schema.domains.names), schema.task_names)
    cols = [schema.domains.column] + [t.label_column for t in schema.tasks]
    for info in manifest.split_files(split):
        table = read_shard(data_dir, info, cols)
        labels = np.stack([table.column(t.label_column).to_numpy(zero_copy_only=False).astype(np.float64)
                           for t in schema.tasks], 1)
        mask = ~np.isnan(labels) & ((labels == 0) | (labels == 1))
        counter.update(np.nan_to_num(labels), mask, table.column(schema.domains.column).to_numpy())
    return counter.rates()


def params_sha256(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))
    tmp.replace(path)


def train(cfg: Config, data_dir: str | Path, run_dir: str | Path, resume: bool = False) -> dict:
    cfg.validate()
    data_dir, run = Path(data_dir), Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    schema = FeatureSchema.load(data_dir)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(cfg.train.seed)

    rates = train_base_rates(data_dir, schema, cfg.data.train_split)
    _write_json(run / "config.json", cfg.to_dict())
    schema.save(run / "schema.json")
    _write_json(run / "base_rates.json", rates)

    model = materialize(build_gem(schema, cfg.model), "cpu", cfg.train.seed,
                        [rates.get(t, 0.5) for t in schema.task_names])
    loader = ShardLoader(data_dir, cfg.data.train_split, cfg.data.batch_size, schema,
                         shuffle=cfg.data.shuffle, seed=cfg.data.seed, epochs=cfg.train.epochs,
                         max_seq_len=model.max_seq_len(), quarantine_dir=run / "quarantine",
                         prefetch=cfg.data.prefetch)
    steps_per_epoch = math.ceil(loader.rows_per_epoch / cfg.data.batch_size)
    total = min(cfg.train.max_steps or 10**18, steps_per_epoch * cfg.train.epochs)
    dense_opt, sparse_opt = build_optimizers(model.dense_parameters(), model.sparse_parameters(), cfg.optim)
    optimizers = [dense_opt, sparse_opt]
    schedule = Schedule(optimizers, total, cfg.optim)
    expect = {"schema": schema.fingerprint()}

    step, examples = 0, 0
    ckpt = latest_checkpoint(run) if resume else None
    if ckpt is not None:
        state = load_checkpoint(ckpt, model, optimizers, expect=expect)
        step, examples = state["step"], state["examples"]
        loader.load_state_dict(state["loader"])
        torch.set_rng_state(state["rng"])
        log.info("resumed from %s at step %d", ckpt, step)

    def trainer_state() -> dict:
        return {**expect, "step": step, "examples": examples, "loader": loader.state_dict(),
                "rng": torch.get_rng_state()}

    task_w = torch.tensor([t.weight for t in schema.tasks])
    dense_params = model.dense_parameters()
    t_start, t_log, ex_log = time.perf_counter(), time.perf_counter(), examples
    bar = tqdm(total=total, initial=step, desc="train", unit="step", disable=not cfg.train.progress, smoothing=0.05)
    model.train()
    with open(run / "metrics.jsonl", "a") as mlog:
        stop = min(total, cfg.train.stop_at or total)
        for batch in loader if step < stop else ():
            lr_f = schedule.set(step)
            logits = model(batch)
            loss, table = masked_bce(logits, batch.labels, batch.label_mask, batch.weights, task_w,
                                     batch.domain, schema.num_domains)
            if not torch.isfinite(loss):
                raise TrainingError(f"loss is {loss.item()} at step {step}; last checkpoint: {latest_checkpoint(run)}")
            for o in optimizers:
                if o is not None:
                    o.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.optim.grad_clip:
                torch.nn.utils.clip_grad_norm_(dense_params, cfg.optim.grad_clip)
            for o in optimizers:
                if o is not None:
                    o.step()
            step += 1
            examples += batch.batch_size
            bar.update(1)
            if step % cfg.train.log_every == 0 or step == total:
                now = time.perf_counter()
                eps = (examples - ex_log) / max(now - t_log, 1e-9)
                t_log, ex_log = now, examples
                rec = {"step": step, "examples": examples, "loss": loss.item(), "lr_factor": lr_f,
                       "examples_per_s": eps, "loss_by_domain_task": _table(table, schema)}
                mlog.write(json.dumps(rec) + "\n")
                mlog.flush()
                bar.set_postfix(loss=f"{loss.item():.4f}", eps=f"{eps:,.0f}")
            if step >= stop:  # checked before the loader hands out (and counts) another batch
                break
            if cfg.train.ckpt_every and step % cfg.train.ckpt_every == 0:
                save_checkpoint(run, step, model, optimizers, trainer_state())
    bar.close()
    wall = time.perf_counter() - t_start
    save_checkpoint(run, step, model, optimizers, trainer_state())
    final = {
        "steps": step, "examples": examples, "params_sha256": params_sha256(model),
        "parameters": count_parameters(model), "wall_s": wall,
        "examples_per_s": (examples - (state["examples"] if ckpt is not None else 0)) / max(wall, 1e-9),
        "recipe": cfg.recipe, "schema": schema.fingerprint(), "checkpoint": str(latest_checkpoint(run).name),
        "quarantined": dict(loader.quarantined), "repaired": loader.stats.as_dict(),
    }
    _write_json(run / "final.json", final)
    return final


def _table(table: torch.Tensor, schema: FeatureSchema) -> dict[str, float]:
    out = {}
    for g, dname in enumerate(schema.domains.names):
        for t, tname in enumerate(schema.task_names):
            v = table[g, t].item()
            if not math.isnan(v):
                out[f"{dname}/{tname}"] = round(v, 6)
    return out
