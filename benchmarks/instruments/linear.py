"""Logistic-regression peer: one-hot ids, their user × ad crosses and history counters, fitted to
convergence with an L2 strength chosen on valid; graded by GEM's evaluator.

Legend: n rows of a split, G one-hot groups, K numeric columns, T tasks.

    ShardLoader (GEM's, unshuffled) ─► Batch ─► LinearColumns.batch ─► X [n, G + K]: G cell ids, K numbers
        ─► per task oracle.choose_l2 (L-BFGS, the L2 path on valid) ─► p [n, T] ─► MetricAccumulator

Why this peer: the sparse logistic regression over crossed ids and counters is what ads click models
were before deep ones (McMahan et al. 2013; He et al. 2014), and on little data it is hard to beat:
a convex fit to convergence with one regularisation strength. The other peers are deep models and
a GBDT.

Columns, generic (built from the schema alone, nothing from how a synthetic world draws its labels):

- one-hot (one weight per cell): every single-valued sparse feature (its OOV row included) and the
  domain; every cross of a user- or context-side field or the domain with an ad-side field that has
  at most ``MAX_CROSS_CELLS`` cells (``user_id`` × ``item_id`` on MovieLens has 1.6M and is left
  out). Multi-hot features are left out (one index per group and row);
- numbers, standardised on train: each dense feature raw and as ``signed_log`` (missing → 0); per
  stream GEM's own history counters (``HistoryCounts.stream_counts``: per event type and decay τ in
  ``DECAY_HOURS``, over all events and those matching the candidate, log1p of the decayed sums and
  the newest such event's e^(−age/τ)) and per τ and matched attribute the share Σ matching / (1 +
  Σ all); with ``history="practitioner"`` (the default) also ``instruments.history_features``'
  columns, the counts among them as log1p. Those overlap the counters without repeating one: its
  ``decay_{τ}`` sums are the counters' per-event-type sums added up before the log1p, and its
  ``since_match_log1p_h`` is a function of the counters' ``newest`` (the largest over types); the
  window counts, repeat engagement per event type, last-event match, last-k shares and the item
  match (``ads.item`` ≡ ``ad_id``; the counters match attributes only) are new.

Tasks as the LightGBM peer has them (``bench.gbdt``): one model per task, a chained task's fitted on
the rows where the required label is 1 and read as p(required) · p(task | required).

Tuning: the L2 strength λ is the one knob, chosen on the tuning split by the oracle's path
(``oracle.choose_l2``: largest λ of ``L2_GRID`` first, warm starts, stops once the valid log loss
rises; it refuses any split but valid). It is chosen on each dataset's own valid split, as early
stopping chooses each neural run's step there; nothing is chosen on development worlds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from instruments.gbdt import (
    FEATURE_BATCH,
    GBDTRows,
    chain,
    features,
    metrics,
    task_parents,
    task_rows,
)
from instruments.history_features import PractitionerHistory, check_history
from opengem.data.base_rates import train_base_rates
from opengem.data.batch import Batch
from opengem.discipline import REPORT_SPLIT, require_tuning_split
from opengem.evaluation.logistic import Design, Fit, choose_l2
from opengem.evaluation.platt import TaskPlatt
from opengem.features.schema import FeatureSchema
from opengem.model.foundation import HistoryCounts, match_attributes, match_flags, signed_log

# a cross with more cells is left out (its cells would see a row or two each)
MAX_CROSS_CELLS = 100_000
DECAY_HOURS = (1.0, 6.0, 24.0, 168.0, 720.0)  # the counters' τ: an hour to a month, log-spaced
# sum-form λ, largest first: wider than the oracle's (far more weights; a rare task's few rows
# want more)
L2_GRID = (10000.0, 3000.0, 1000.0, 300.0, 100.0, 30.0, 10.0, 3.0, 1.0)
USER_SIDE = ("user", "context")


class LinearColumns:
    """The peer's columns for one schema (module docstring): ``groups`` (name, cells, source), the
    numeric ``names``, and ``batch(batch)`` → [B, G + K] float64 (G local cell ids, then
    K numbers). ``history``: ``"practitioner"`` adds ``instruments.history_features``' columns,
    ``"basic"`` leaves them out."""

    def __init__(self, schema: FeatureSchema, max_cross_cells: int = MAX_CROSS_CELLS,
                 history: str = "practitioner"):
        self.schema = schema
        single = [f for f in schema.sparse if not f.multi_hot]
        rows = {f.name: f.vocab_size + 1 for f in single}
        dom = schema.domains.column
        rows[dom] = schema.num_domains
        self.rows = rows
        users = [f.name for f in single if f.group in USER_SIDE] + [dom]
        ads = [f.name for f in single if f.group == "ad"]
        groups: list[tuple[str, int, object]] = [(f.name, rows[f.name], f.name) for f in single]
        groups.append((dom, rows[dom], dom))
        groups += [(f"{u}_x_{a}", rows[u] * rows[a], (u, a)) for u in users for a in ads
                   if rows[u] * rows[a] <= max_cross_cells]
        self.groups = groups
        self.offsets = np.cumsum([0] + [n for _, n, _ in groups])
        self.num_weights = int(self.offsets[-1])
        streams = [s.name for s in schema.sequences]
        self.match_pairs = {s: match_attributes(schema, s) for s in streams}
        self.counts = HistoryCounts(schema, streams, self.match_pairs, DECAY_HOURS, dim=1,
                                    recency=True)
        names = [n for f in schema.dense for n in (f.name, f"{f.name}.signed_log")]
        for s in streams:
            sel = ["all"] + [col for col, _, _ in self.match_pairs[s]]
            cells = [f"{m}.e{e}.tau{h:g}h" for m in sel for e in range(self.counts.num_events[s])
                     for h in DECAY_HOURS]
            names += [f"{s}.log1p_sum.{c}" for c in cells] + [f"{s}.newest.{c}" for c in cells]
            names += [f"{s}.share.{col}.tau{h:g}h" for col in sel[1:] for h in DECAY_HOURS]
        self.history = (PractitionerHistory(schema) if check_history(history) == "practitioner"
                        else None)
        names += self.history.names if self.history is not None else []
        self.names = [name for name, _, _ in groups] + names
        self.categorical = [name for name, _, _ in groups]

    def _stream(self, batch: Batch, stream: str) -> list[torch.Tensor]:
        ages = batch.seq_age.to_dict()[stream]
        lengths, age = ages.lengths(), ages.values()
        events = batch.sequences.to_dict()[self.schema.stream(stream).event_column].values()
        pairs = self.match_pairs[stream]
        flags = match_flags(pairs, batch, lengths) if pairs else None
        c = self.counts.stream_counts(stream, events, age, flags, lengths).double()
        half = c.shape[1] // 2
        sums = c[:, :half]
        out = [torch.log1p(sums), c[:, half:]]
        per = sums.view(sums.shape[0], 1 + len(pairs), self.counts.num_events[stream],
                        len(DECAY_HOURS)).sum(2)
        out += [per[:, 1 + a] / (1 + per[:, 0]) for a in range(len(pairs))]  # [B, K] each
        return out

    def batch(self, batch: Batch) -> np.ndarray:
        """[B, G + K] float64: the rows' local cell id of each group, then the numeric columns."""
        sparse = {k: v.values() for k, v in batch.sparse.to_dict().items()}
        sparse[self.schema.domains.column] = batch.domain
        ids = []
        for _, _, src in self.groups:
            if isinstance(src, tuple):
                u, a = src
                ids.append(sparse[u] * self.rows[a] + sparse[a])
            else:
                ids.append(sparse[src])
        cols = [torch.stack(ids, 1).double()]
        if self.schema.dense:
            dense = torch.nan_to_num(batch.dense.double(), nan=0.0)
            cols.append(torch.stack([dense, signed_log(dense)], 2).flatten(1))
        for s in self.schema.sequences:
            cols += self._stream(batch, s.name)
        if self.history is not None:
            x = self.history.batch(batch)
            # counts are heavy-tailed: a linear weight on the raw count is set by the tail
            # (a bool mask even when empty: a dataset without streams has no such columns)
            counts = torch.tensor(self.history.counts, dtype=torch.bool)
            cols.append(torch.where(counts, torch.log1p(x), x))
        return torch.cat(cols, 1).numpy()

    def design(self, split: str, rows: GBDTRows, sel: np.ndarray, task: int) -> Design:
        G = len(self.groups)
        idx = rows.X[sel, :G].astype(np.int64).T + self.offsets[:-1, None]
        return Design(split, idx, rows.X[sel, G:], rows.labels[sel, task].astype(np.float64))


def fit(train: GBDTRows, valid: GBDTRows, cols: LinearColumns,
        tune_split: str = "valid") -> tuple[list[Fit], list]:
    """One L2-chosen fit per task, and each task's valid log loss per λ tried."""
    fits, paths = [], []
    for t, p in enumerate(task_parents(cols.schema)):
        tr, va = task_rows(train, t, p), task_rows(valid, t, p)
        f, losses = choose_l2(cols.design("train", train, tr, t),
                              cols.design(tune_split, valid, va, t),
                              cols.num_weights, L2_GRID)
        fits.append(f)
        paths.append(losses)
    return fits, paths


def predict(fits: list[Fit], rows: GBDTRows, cols: LinearColumns, split: str) -> np.ndarray:
    """[n, T] probabilities; a chained task's is p(required) · p(task | required)."""
    every = np.arange(len(rows.labels))
    return chain([np.exp(-np.logaddexp(0.0, -f.logits(cols.design(split, rows, every, t))))
                  for t, f in enumerate(fits)], cols.schema)


@dataclass
class Fitted:
    """The regression fitted on train with λ chosen on ``tune_split``: each split's rows
    and probabilities."""

    schema: FeatureSchema
    fits: list[Fit]
    paths: list
    rows: dict[str, GBDTRows]
    probs: dict[str, np.ndarray]
    history: str = "practitioner"

    def valid_loss(self) -> float:
        """The chosen λ's valid log loss, summed over tasks: what the history set is chosen by."""
        return sum(min(path.values()) for path in self.paths)


def fit_data(data_dir: str | Path, tune_split: str = "valid",
             max_seq_len: dict[str, int] | None = None,
             score_test: bool = True, batch_size: int = FEATURE_BATCH,
             history: str = "auto") -> Fitted:
    """Fit on train with λ chosen on ``tune_split``; rows and probabilities of it and
    (``score_test``) test. ``history``: as ``LinearColumns`` has it, or ``"auto"``: the set of
    history columns with the lower valid loss, chosen as λ is (with ~85 more columns on a few
    thousand rows, λ rises and shrinks the id crosses, so more columns can read worse on valid)."""
    require_tuning_split(tune_split, "the logistic regression's L2 strength")
    if history == "auto":
        tried = [fit_data(data_dir, tune_split, max_seq_len, False, batch_size, h)
                 for h in ("basic", "practitioner")]
        history = min(tried, key=Fitted.valid_loss).history
    schema = FeatureSchema.load(data_dir)
    cols = LinearColumns(schema, history=history)
    train, valid = (features(data_dir, s, schema, max_seq_len, batch_size, cols)
                    for s in ("train", tune_split))
    fits, paths = fit(train, valid, cols, tune_split)
    rows = {tune_split: valid}
    if score_test:
        rows[REPORT_SPLIT] = features(data_dir, REPORT_SPLIT, schema, max_seq_len, batch_size, cols)
    return Fitted(schema, fits, paths, rows,
                  {s: predict(fits, r, cols, s) for s, r in rows.items()}, history)


def run_linear(data_dir: str | Path, tune_split: str = "valid",
               max_seq_len: dict[str, int] | None = None,
               score_test: bool = True, batch_size: int = FEATURE_BATCH,
               history: str = "auto") -> dict:
    """Fit on train with λ chosen on ``tune_split``, then read test once (not
    without ``score_test``).

    Returns what ``gbdt.run_gbdt`` does: {"metrics", "metrics_platt", "platt" (with ``score_test``),
    "valid", "chosen": {"l2": task → λ}, "trials": [{"l2": task → {λ: valid log loss}}], "wall_s"}.
    """
    t0 = time.perf_counter()
    lr = fit_data(data_dir, tune_split, max_seq_len, score_test, batch_size, history)
    schema, valid, p_valid = lr.schema, lr.rows[tune_split], lr.probs[tune_split]
    rates = train_base_rates(data_dir, schema, "train")
    out = {}
    if score_test:
        test, p_test = lr.rows[REPORT_SPLIT], lr.probs[REPORT_SPLIT]
        out["metrics"] = metrics(p_test, test, schema, rates)
        # as every peer's figures are recalibrated
        platt = TaskPlatt.fit(p_valid, valid.labels, valid.mask)
        out["metrics_platt"] = metrics(platt(p_test), test, schema, rates)
        out["platt"] = platt.as_dict(schema.task_names)
    names = schema.task_names
    return {**out, "valid": metrics(p_valid, valid, schema, rates),
            "chosen": {"l2": {names[t]: f.l2 for t, f in enumerate(lr.fits)},
                       "history": lr.history},
            "trials": [{"l2": {names[t]: {str(k): v for k, v in p.items()} for t,
                               p in enumerate(lr.paths)}}],
            "wall_s": round(time.perf_counter() - t0, 3)}
