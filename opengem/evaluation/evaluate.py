"""Evaluate a training run on a split: exact metrics per (domain, task), plus the Bayes limit.

NE is normalised by the *training* base rate of the same slice (He et al. 2014), read from
``RUN/base_rates.json``. On synthetic data (true probabilities stored next to the labels) every
slice also reports ``ne_bayes`` and ``captured = (1 − ne) / (1 − ne_bayes)``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm

from opengem.data.loader import ShardLoader
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
    out["run"] = str(run_dir)
    out["recipe"] = cfg.recipe
    recal = load_recalibration(run_dir)
    if recal is not None:
        out["recalibration"] = recal
    if signal:
        out["signal"] = signal_decomposition(model, schema, data_dir, split, batch_size)
    return out
