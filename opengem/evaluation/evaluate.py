"""Evaluate a training run on a split: exact metrics per (domain, task), plus the Bayes limit.

NE is normalised by the *training* base rate of the same slice (He et al. 2014), read from
``RUN/base_rates.json``: the true rate of the training split, also when its negatives were
down-sampled (``data.negative_rate``; the model is scored with that corrected, ``opengem.run``).
On synthetic data (true probabilities stored next to the labels) every slice also reports ``ne_bayes``
and ``captured = (1 − ne) / (1 − ne_bayes)``, and, where the dataset's manifest holds the world's oracle
for the split (``opengem.evaluation.oracle``), ``oracle_captured`` and ``captured_over_oracle = captured
/ oracle_captured``: the figure that compares across worlds.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from tqdm.auto import tqdm

from opengem.data.loader import ShardLoader
from opengem.data.parquet import DatasetManifest
from opengem.evaluation import EVAL_BATCH
from opengem.evaluation.accumulator import MetricAccumulator
from opengem.evaluation.signal import signal_decomposition
from opengem.features.schema import FeatureSchema, SchemaError
from opengem.run import load_base_rates, load_downsampling, load_recalibration, load_run_model


@torch.no_grad()
def evaluate_model(model, schema: FeatureSchema, data_dir: str | Path, split: str, base_rates: dict | None,
                   batch_size: int = EVAL_BATCH, progress: bool = True, rank: int = 0, world_size: int = 1,
                   device: torch.device | None = None) -> dict:
    """Metrics of ``model`` on the files ``rank``, ``rank + world_size``, … of ``split``; under
    torch.distributed the ranks' rows are reduced (every rank returns the metrics of all of them)."""
    loader = ShardLoader(data_dir, split, batch_size, schema, shuffle=False, epochs=1,
                         max_seq_len=model.max_seq_len(), prefetch=2, rank=rank, world_size=world_size)
    acc = MetricAccumulator(list(schema.domains.names), schema.task_names, base_rates)
    n = 0
    for batch, counted in _in_step(tqdm(loader, desc=f"evaluate {split}", unit="batch", disable=not progress), split):
        if device is not None and device.type != "cpu":
            batch = batch.to(device, non_blocking=True)
        probs = torch.sigmoid(model(batch).double())
        if counted:
            acc.update(probs, batch.labels, batch.label_mask, batch.domain, batch.user_id, batch.true_probs)
            n += batch.batch_size
    acc.reduce()
    return {"split": split, "rows": n, "metrics": acc.compute(), "calibration_bins": acc.calibration_bins(),
            "quarantined": dict(loader.quarantined),
            "repaired": loader.stats.as_dict()}


def _in_step(batches, split: str):
    """(batch, counted) for each of ``batches``; under torch.distributed, as many as the rank with the
    most has: a sharded model's forward is a collective (TorchRec all-to-alls, FSDP all-gathers), so a
    rank that has run out scores its last batch again, not counted, until every rank has run out."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        yield from ((b, True) for b in batches)
        return
    it, last = iter(batches), None
    while True:
        batch = next(it, None)
        more = torch.tensor([float(batch is not None)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(more, op=dist.ReduceOp.MAX)
        if not more.item():
            return
        if batch is None and last is None:
            raise ValueError(f"rank {dist.get_rank()} has no file of split {split!r} while others do: "
                             "the split has fewer files than there are ranks")
        last = batch if batch is not None else last
        yield last, batch is not None


def held_out_evaluator(data_dir: str | Path, split: str = "valid", every_kth_file: int = 1,
                       batch_size: int = EVAL_BATCH):
    """The trainer's evaluator (``opengem.train.hooks.Evaluator``): ``evaluate_model``'s metrics on
    ``split`` of ``data_dir``, each rank scoring its share. ``every_kth_file`` > 1 scores 1 file in k
    (files 0, k, 2k, … on one process), to keep many evaluations of a big split affordable."""
    def evaluate(model, *, base_rates: dict, rank: int, world_size: int, device: torch.device) -> dict:
        out = evaluate_model(model, FeatureSchema.load(data_dir), data_dir, split, base_rates, batch_size,
                             progress=False, rank=rank, world_size=world_size * every_kth_file, device=device)
        return out["metrics"]

    return evaluate


def evaluate_run(run_dir: str | Path, data_dir: str | Path, split: str = "test", batch_size: int = EVAL_BATCH,
                 progress: bool = True, signal: bool = False, best: bool = False) -> dict:
    """Metrics of a run's model on ``split``; with ``signal`` (synthetic data) also the per-term
    slopes of ``opengem.evaluation.signal``; with ``best``, of the best held-out evaluation's model
    (``train.keep_best``) instead of the last."""
    model, cfg, schema = load_run_model(run_dir, best=best)
    data_schema = FeatureSchema.load(data_dir)
    if data_schema.fingerprint() != schema.fingerprint():
        raise SchemaError(f"{data_dir}: its schema differs from the one run {run_dir} was trained on")
    out = evaluate_model(model, schema, data_dir, split, load_base_rates(run_dir), batch_size, progress)
    add_oracle(out["metrics"], data_dir, split)
    out["run"] = str(run_dir)
    out["recipe"] = cfg.recipe
    recal, sampled = load_recalibration(run_dir), load_downsampling(run_dir)
    if recal is not None:
        out["recalibration"] = recal
    if sampled is not None:  # the scores above include its correction (load_run_model)
        out["downsampling"] = sampled
    if signal:
        out["signal"] = signal_decomposition(model, schema, data_dir, split, batch_size)
    return out


def add_oracle(metrics: dict, data_dir: str | Path, split: str) -> dict:
    """Add ``oracle_captured`` and ``captured_over_oracle`` to each slice of ``metrics`` (``compute()``'s
    output) that has ``captured`` and an oracle entry in the manifest's ``source.stats.oracle[split]``.
    The oracle's NE uses the dataset's train base rates, a run's those of its training split: the
    same rates when the run trained on the dataset's train split."""
    oracle = DatasetManifest.load(data_dir).source.get("stats", {}).get("oracle", {}).get(split) or {}
    for key, m in metrics.items():
        oc = (oracle.get(key) or {}).get("captured")
        if oc is None or "captured" not in m:
            continue
        m["oracle_captured"] = oc
        m["captured_over_oracle"] = m["captured"] / oc if oc != 0 else math.nan
    return metrics
