"""Training on an ensemble's soft labels (``train.soft_label_runs``): distilling several runs
into one.

Legend: B rows, T tasks, K teacher runs.

    batch ─► each teacher run's model (frozen, eval) ─► σ(logits) [K, B, T] ─► mean [B, T] = q
    target = w·q + (1 − w)·y    (w = ``train.soft_label_weight``; rows whose label is masked keep theirs)

Why: on little data a trained GEM's error is mostly variance, not bias, so an ensemble of its seeds
scores better than one run, and one run trained on the ensemble's mean probability keeps most of
that at one model's serving cost (docs/experiments.md, "Variance, and one model distilled from an
ensemble of its seeds"). This is Hinton et al.'s (2015) distillation of an ensemble, here with the
same architecture as student and teacher.

The teachers are loaded as evaluation loads a run (``opengem.run.load_run_model``: the best held-out
checkpoint where the run kept one, else its latest; with its recalibration and down-sampling
correction), on every rank in full: the use is small data, where the teachers are small. Their
schema must be the data's (checked at start, the run named). The targets are probabilities, so the
loss stays the trainer's BCE; the labels the trainer counts and logs are the mixed ones. Negative
down-sampling is refused beside it (``Config.validate``): the teachers' probabilities are of
all rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch

from opengem.checkpoint import best_checkpoint
from opengem.config import ConfigError
from opengem.data.batch import Batch
from opengem.features.schema import FeatureSchema, SchemaError
from opengem.run import load_run_model


class SoftLabels:
    """The frozen teacher runs and the mixing weight; ``__call__`` gives a batch with
    mixed labels."""

    def __init__(self, runs: Sequence[str | Path], weight: float, schema: FeatureSchema,
                 device: torch.device | None = None):
        self.weight, self.models = weight, []
        for run in runs:
            if not Path(run).is_dir():
                raise ConfigError(f"train.soft_label_runs: {run} is not a run directory")
            model, _, teacher_schema = load_run_model(run, best=best_checkpoint(run) is not None)
            if teacher_schema.fingerprint() != schema.fingerprint():
                raise SchemaError(f"train.soft_label_runs: run {run} was trained on another schema "
                                  f"than this data's")
            self.models.append(model.to(device or torch.device("cpu")).eval().requires_grad_(False))

    @torch.no_grad()
    def probabilities(self, batch: Batch) -> torch.Tensor:
        """q [B, T]: the teachers' mean probability of each task."""
        return torch.stack([torch.sigmoid(m(batch).float()) for m in self.models]).mean(0)

    def __call__(self, batch: Batch) -> Batch:
        q = self.probabilities(batch).to(batch.labels.dtype)
        mixed = torch.where(batch.label_mask, self.weight * q + (1 - self.weight) * batch.labels,
                            batch.labels)
        return dataclasses.replace(batch, labels=mixed)


def soft_labels(runs: Sequence[str], weight: float, schema: FeatureSchema,
                device: torch.device | None = None) -> SoftLabels | None:
    """``SoftLabels`` of ``train.soft_label_runs``, or None when there are none (the trainer's
    labels as they are)."""
    return SoftLabels(runs, weight, schema, device) if runs else None
