"""Reliability bins (predicted vs observed rate) per slice, for the report's calibration curves.

The evaluation JSON carries one calibration ratio per slice (Σp / Σy), not bins.
``reliability_bins`` is the pure function; ``compute_bins`` runs a run's model over a split to get
them per ``"<domain>/<task>"`` and ``"all/<task>"`` — the format the report reads from an evaluation
JSON's ``calibration_bins`` key (``{slice: {"p": [...], "y": [...], "n": [...]}}``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from opengem.data.loader import ShardLoader
from opengem.evaluation import EVAL_BATCH
from opengem.evaluation.metrics import reliability_bins
from opengem.run import load_run_model

__all__ = ["compute_bins", "reliability_bins", "slice_bins"]

ALL = "all"
MIN_ROWS = 100  # fewer rows per bin and a bin's observed rate is mostly noise


def compute_bins(run_dir: str | Path, data_dir: str | Path, split: str = "test", n_bins: int = 20,
                 batch_size: int = EVAL_BATCH) -> dict[str, dict[str, list]]:
    """Reliability bins per slice of a run's model on ``split`` (one pass over the split's rows)."""
    model, _, schema = load_run_model(run_dir)
    loader = ShardLoader(data_dir, split, batch_size, schema, shuffle=False, epochs=1,
                         max_seq_len=model.max_seq_len(), prefetch=2)
    domains, tasks = list(schema.domains.names), schema.task_names
    rows: dict[tuple[int, int], list[tuple[np.ndarray, np.ndarray]]] = {}
    for batch in loader:
        with torch.no_grad():
            probs = torch.sigmoid(model(batch).double()).numpy()
        labels, mask = batch.labels.double().numpy(), batch.label_mask.numpy().astype(bool)
        dom = batch.domain.numpy()
        for t in range(len(tasks)):
            for d in np.unique(dom[mask[:, t]]):
                sel = mask[:, t] & (dom == d)
                rows.setdefault((int(d), t), []).append((probs[sel, t], labels[sel, t]))
    return slice_bins(rows, domains, tasks, n_bins)


def slice_bins(rows: dict, domains: list[str], tasks: list[str], n_bins: int,
               min_rows: int = MIN_ROWS) -> dict[str, dict[str, list]]:
    """Bins per ``"<domain>/<task>"`` and pooled ``"all/<task>"`` from {(domain, task): [(p, y),
    …]}; a slice of few rows gets fewer bins (at least ``min_rows`` each, one at the least)."""
    out = {}
    for t, task in enumerate(tasks):
        pooled = []
        for d, name in enumerate(domains):
            parts = rows.get((d, t), [])
            if parts:
                pooled.append((np.concatenate([a for a, _ in parts]),
                               np.concatenate([b for _, b in parts])))
                out[f"{name}/{task}"] = pooled[-1]
        if pooled:
            out[f"{ALL}/{task}"] = (np.concatenate([a for a, _ in pooled]),
                                    np.concatenate([b for _, b in pooled]))
    return {k: reliability_bins(p, y, max(1, min(n_bins, p.size // min_rows))) for k,
            (p, y) in out.items()}
