"""Evaluate a training run on a split: exact metrics per (domain, task), plus the Bayes limit.

NE is normalised by the *training* base rate of the same slice (He et al. 2014), read from
``RUN/base_rates.json``. On synthetic data (true probabilities stored next to the labels) every
slice also reports ``ne_bayes`` and ``captured = (1 − ne) / (1 − ne_bayes)``, and, where the dataset's
manifest holds the world's oracle for the split (``opengem.data.oracle``), ``oracle_captured`` and
``captured_over_oracle = captured / oracle_captured``: the figure that compares across worlds.
"""

from __future__ import annotations

from pathlib import Path

import math

import torch
from tqdm.auto import tqdm

from opengem.data.loader import ShardLoader
from opengem.data.parquet import DatasetManifest
from opengem.evaluation import EVAL_BATCH
from opengem.evaluation.accumulator import MetricAccumulator
from opengem.evaluation.signal import signal_decomposition
from opengem.features.schema import FeatureSchema, SchemaError
from opengem.run import load_base_rates, load_recalibration, load_run_model


@torch.no_grad()
def evaluate_model(model, schema: FeatureSchema, data_dir: str | Path, split: str, base_rates: dict | None,
                   batch_size: int = EVAL_BATCH, progress: bool = True, rank: int = 0, world_size: int = 1) -> dict:
    loader = ShardLoader(data_dir, split, batch_size, schema, shuffle=False, epochs=1,
                         max_seq_len=model.max_seq_len(), prefetch=2, rank=rank, world_size=world_size)
    acc = MetricAccumulator(list(schema.domains.names), schema.task_names, base_rates)
    n = 0
    for batch in tqdm(loader, desc=f"evaluate {split}", unit="batch", disable=not progress):
        probs = torch.sigmoid(model(batch).double())
        acc.update(probs, batch.labels, batch.label_mask, batch.domain, batch.user_id, batch.true_probs)
        n += batch.batch_size
    acc.reduce()
    return {"split": split, "rows": n, "metrics": acc.compute(), "calibration_bins": acc.calibration_bins(),
            "quarantined": dict(loader.quarantined),
            "repaired": loader.stats.as_dict()}


def evaluate_run(run_dir: str | Path, data_dir: str | Path, split: str = "test", batch_size: int = EVAL_BATCH,
                 progress: bool = True, signal: bool = False) -> dict:
    """Metrics of a run's model on ``split``; with ``signal`` (synthetic data) also the per-term
    slopes of ``opengem.evaluation.signal``."""
    model, cfg, schema = load_run_model(run_dir)
    data_schema = FeatureSchema.load(data_dir)
    if data_schema.fingerprint() != schema.fingerprint():
        raise SchemaError(f"{data_dir}: its schema differs from the one run {run_dir} was trained on")
    out = evaluate_model(model, schema, data_dir, split, load_base_rates(run_dir), batch_size, progress)
    add_oracle(out["metrics"], data_dir, split)
    out["run"] = str(run_dir)
    out["recipe"] = cfg.recipe
    recal = load_recalibration(run_dir)
    if recal is not None:
        out["recalibration"] = recal
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
