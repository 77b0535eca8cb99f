"""Evaluate a training run on a split: exact metrics per (domain, task), plus the Bayes limit.

NE is normalised by the *training* base rate of the same slice (He et al. 2014), read from
``RUN/base_rates.json``: the true rate of the training split, also when its negatives were
down-sampled (``data.negative_rate``; the model is scored with that corrected, ``opengem.run``).
On synthetic data (true probabilities stored next to the labels) every slice also reports
``ne_bayes`` and ``captured = (1 − ne) / (1 − ne_bayes)``, and, where the dataset's manifest holds
the world's oracle for the split (``opengem.world.oracle``), ``oracle_captured`` and
``captured_over_oracle = captured / oracle_captured``: the figure that compares across worlds.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from opengem.data.loader import ShardLoader
from opengem.data.parquet import DatasetManifest
from opengem.evaluation import EVAL_BATCH
from opengem.evaluation.accumulator import MetricAccumulator
from opengem.evaluation.segments import MIN_ROWS, SegmentAccumulator, segment_families
from opengem.features.schema import FeatureSchema, SchemaError
from opengem.progress import progress_bar
from opengem.run import load_base_rates, load_downsampling, load_recalibration, load_run_model


@torch.no_grad()
def evaluate_model(model, schema: FeatureSchema, data_dir: str | Path, split: str,
                   base_rates: dict | None, batch_size: int = EVAL_BATCH, progress: bool = True,
                   rank: int = 0, world_size: int = 1,
                   device: torch.device | None = None, segments: bool | list[str] = False,
                   min_rows: int = MIN_ROWS) -> dict:
    """Metrics of ``model`` on the files ``rank``, ``rank + world_size``, … of ``split``; under
    torch.distributed the ranks' rows are reduced (every rank returns the metrics of all
    of them). ``segments`` (True: every family the schema allows; a list: those families) adds
    ``segments``: the per-segment table of the same pass (``opengem.evaluation.segments``; a
    named family the schema lacks fails before any row is scored)."""
    acc = MetricAccumulator(list(schema.domains.names), schema.task_names, base_rates)
    seg, notes = None, []
    if segments is not False:
        families, notes = segment_families(schema, None if segments is True else list(segments))
        seg = SegmentAccumulator(schema, families)
    n = 0
    scored = _Scored(model, schema, data_dir, split, batch_size, progress, rank, world_size, device)
    for probs, batch, counted in scored:
        if counted:
            acc.update(probs, batch.labels, batch.label_mask, batch.domain, batch.user_id,
                       batch.true_probs)
            if seg is not None:
                seg.update(probs, batch)
            n += batch.batch_size
    acc.reduce()
    out = {"split": split, "rows": n, "metrics": acc.compute(),
           "calibration_bins": acc.calibration_bins(),
           "quarantined": dict(scored.loader.quarantined),
           "repaired": scored.loader.stats.as_dict()}
    if seg is not None:
        seg.reduce()
        out["segments"] = {**seg.compute(min_rows), "notes": notes}
    return out


class _Scored:
    """(probabilities [B, T] float64, batch, counted) for each batch of ``split`` (``_in_step``);
    ``loader`` is kept for its quarantine and repair counts."""

    def __init__(self, model, schema, data_dir, split, batch_size, progress, rank=0, world_size=1,
                 device=None):
        self.model, self.split, self.progress, self.device = model, split, progress, device
        self.loader = ShardLoader(data_dir, split, batch_size, schema, shuffle=False, epochs=1,
                                  max_seq_len=model.max_seq_len(), prefetch=2, rank=rank,
                                  world_size=world_size)

    def __iter__(self):
        batches = progress_bar(self.loader, desc=f"evaluate {self.split}", unit="batch",
                               disable=not self.progress)
        for batch, counted in _in_step(batches, self.split):
            if self.device is not None and self.device.type != "cpu":
                batch = batch.to(self.device, non_blocking=True)
            yield torch.sigmoid(self.model(batch).double()), batch, counted


@torch.no_grad()
def score_rows(model, schema: FeatureSchema, data_dir: str | Path, split: str,
               batch_size: int = EVAL_BATCH,
               progress: bool = False) -> dict[str, torch.Tensor]:
    """Every row of ``split`` in one process: ``probs`` [R, T] and what ``metrics_of`` needs beside
    them (labels, mask, domain, user_id, true_probs or None), to score one pass under
    several calibrations."""
    parts: dict[str, list] = {k: []
                              for k in ("probs", "labels", "mask", "domain", "user_id",
                                        "true_probs")}
    for probs, batch, _ in _Scored(model, schema, data_dir, split, batch_size, progress):
        for k, v in (("probs", probs), ("labels", batch.labels), ("mask", batch.label_mask),
                     ("domain", batch.domain), ("user_id", batch.user_id),
                     ("true_probs", batch.true_probs)):
            parts[k].append(v)
    if not parts["probs"]:
        raise ValueError(f"{data_dir}: split {split!r} has no rows to score")
    return {k: torch.cat(v) if v[0] is not None else None for k, v in parts.items()}


def metrics_of(rows: dict, schema: FeatureSchema, base_rates: dict | None, probs=None) -> dict:
    """``evaluate_model``'s metrics of ``rows`` (``score_rows``), with ``probs`` in place of theirs
    if given."""
    acc = MetricAccumulator(list(schema.domains.names), schema.task_names, base_rates)
    acc.update(rows["probs"] if probs is None else probs, rows["labels"], rows["mask"],
               rows["domain"], rows["user_id"], rows["true_probs"])
    return acc.compute()


def _in_step(batches, split: str):
    """(batch, counted) for each of ``batches``; under torch.distributed, as many as the rank with
    the most has: a sharded model's forward is a collective (TorchRec all-to-alls, FSDP
    all-gathers), so a rank that has run out scores its last batch again, not counted, until every
    rank has run out."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        yield from ((b, True) for b in batches)
        return
    it, last = iter(batches), None
    while True:
        batch = next(it, None)
        more = torch.tensor([float(batch is not None)],
                            device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(more, op=dist.ReduceOp.MAX)
        if not more.item():
            return
        if batch is None and last is None:
            raise ValueError(f"rank {dist.get_rank()} has no file of split {split!r} while "
                             f"others do: "
                             "the split has fewer files than there are ranks")
        last = batch if batch is not None else last
        yield last, batch is not None


def held_out_evaluator(data_dir: str | Path, split: str = "valid", every_kth_file: int = 1,
                       batch_size: int = EVAL_BATCH):
    """The trainer's evaluator (``opengem.train.hooks.Evaluator``): ``evaluate_model``'s metrics on
    ``split`` of ``data_dir``, each rank scoring its share. ``every_kth_file`` > 1 scores 1 file in
    k (files 0, k, 2k, … on one process), to keep many evaluations of a big split affordable."""
    def evaluate(model, *, base_rates: dict, rank: int, world_size: int,
                 device: torch.device) -> dict:
        out = evaluate_model(model, FeatureSchema.load(data_dir), data_dir, split, base_rates,
                             batch_size, progress=False, rank=rank,
                             world_size=world_size * every_kth_file, device=device)
        return out["metrics"]

    return evaluate


def evaluate_run(run_dir: str | Path, data_dir: str | Path, split: str = "test",
                 batch_size: int = EVAL_BATCH,
                 progress: bool = True, best: bool = False, segments: bool | list[str] = False,
                 min_rows: int = MIN_ROWS) -> dict:
    """Metrics of a run's model on ``split``; with ``best``, of the best held-out evaluation's model
    (``train.keep_best``) instead of the last (``run.use_best`` picks it for ``--checkpoint``);
    ``segments`` and ``min_rows`` as in ``evaluate_model``."""
    model, cfg, schema = load_run_model(run_dir, best=best)
    data_schema = FeatureSchema.load(data_dir)
    if data_schema.fingerprint() != schema.fingerprint():
        raise SchemaError(f"{data_dir}: its schema differs from the one run {run_dir} was "
                          f"trained on")
    out = evaluate_model(model, schema, data_dir, split, load_base_rates(run_dir), batch_size,
                         progress, segments=segments, min_rows=min_rows)
    add_oracle(out["metrics"], data_dir, split)
    out["run"] = str(run_dir)
    out["recipe"] = cfg.recipe
    out["checkpoint"] = "best" if best else "last"
    recal, sampled = load_recalibration(run_dir), load_downsampling(run_dir)
    if recal is not None:
        out["recalibration"] = recal
    if sampled is not None:  # the scores above include its correction (load_run_model)
        out["downsampling"] = sampled
    return out


def add_oracle(metrics: dict, data_dir: str | Path, split: str, platt: bool = False) -> dict:
    """Add ``oracle_captured`` and ``captured_over_oracle`` to each slice of ``metrics``
    (``compute()``'s output) that has ``captured`` and an oracle entry in the manifest's
    ``source.stats.oracle[split]`` (with ``platt``, ``…oracle.platt[split]``: the oracle after its
    own Platt fit on valid, to set beside a model's ``evaluation.platt`` figures). The oracle's NE
    uses the dataset's train base rates, a run's those of its training split: the same rates when
    the run trained on the dataset's train split."""
    oracle = DatasetManifest.load(data_dir).source.get("stats", {}).get("oracle", {})
    oracle = (oracle.get("platt", {}) if platt else oracle).get(split) or {}
    for key, m in metrics.items():
        oc = (oracle.get(key) or {}).get("captured")
        if oc is None or "captured" not in m:
            continue
        m["oracle_captured"] = oc
        m["captured_over_oracle"] = m["captured"] / oc if oc != 0 else math.nan
    return metrics
