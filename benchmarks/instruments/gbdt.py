"""LightGBM peer: the strongest tabular baseline, on the rows GEM reads, graded by GEM's evaluator.

Legend: n rows of a split, k features, T tasks.

    ShardLoader (GEM's, unshuffled) ─► Batch ─► features ─► X [n, k] ─► one LightGBM per task ─► p [n, T]
        ─► MetricAccumulator with the train split's base rates (what ``evaluate_run`` computes)

History: ``history="practitioner"`` (the default) adds ``instruments.history_features``' columns,
the summaries an ads team writes by hand (decayed matches at five τ, last-event match, counts in
windows, repeat engagement per advertiser, shares of the last k events); ``"basic"`` keeps the
handful below (``batch_features``). Either way the search budget is the same ``GRID``.

Rows come through ``opengem.data.loader.ShardLoader`` → ``Batch`` in the evaluator's order, so
quarantined rows, OOV ids and history caps are GEM's. ``lightgbm`` is a benchmark dependency only
(``pip install 'opengem[bench]'``); this module imports it on first use, so the package (and this
module) import without it.

Tasks: one binary model per task. A task that ``requires`` another (conversion requires click) is
fitted on the rows where the required label is 1 and read as p(task) = p(required) · p(task |
required), the factorisation GEM's chained heads use, so NE/AUC compare with theirs on all rows.

Tuning: early stopping on the tuning split (``lightgbm.early_stopping``, ``PATIENCE`` rounds) and
``GRID``, learning rate × num_leaves with as many points as the neural models' lr grid
(``GRID_POINTS``), chosen by the tuning split's log loss of the first task that requires none
(click), under ``opengem.discipline``: never on test, and with more than one point only on a
development world.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from instruments.history_features import WINDOWS_S, PractitionerHistory, check_history
from opengem.data.base_rates import train_base_rates
from opengem.data.batch import Batch
from opengem.data.loader import ShardLoader
from opengem.discipline import REPORT_SPLIT, require_dev_world, require_tuning_split
from opengem.evaluation.accumulator import MetricAccumulator
from opengem.evaluation.metrics import logloss
from opengem.evaluation.platt import TaskPlatt
from opengem.features.schema import FeatureSchema
from opengem.model.foundation import match_attributes
from opengem.ops.jagged import row_ids

GRID_POINTS = 4  # the neural models' learning-rate grid has 4 points; the GBDT gets as many trials
GRID = tuple({"learning_rate": lr, "num_leaves": leaves} for lr in (0.03, 0.1)
             for leaves in (15, 63))
# a ceiling only: early stopping ends every fit long before it on the worlds we run
MAX_ROUNDS = 3000
PATIENCE = 50  # rounds without a better tuning-split log loss before a fit stops
# rows per loader batch while building features (the result does not depend on it)
FEATURE_BATCH = 4096


def _lightgbm():
    try:
        import lightgbm
    except ImportError as e:
        raise RuntimeError("the LightGBM peer needs the optional 'lightgbm' package: "
                           "pip install 'opengem[bench]' (lightgbm==4.7.0)") from e
    return lightgbm


# ------------------------------------------------------------------------------------ features
@dataclass
class GBDTRows:
    """One split as LightGBM (or the logistic-regression peer, ``bench.linear``) reads it,
    row-aligned with the evaluator's batches.

    X [n, k] float64 (NaN = missing), ``names``/``categorical`` the feature names, labels and mask
    [n, T] (labels 0 where the mask is false), domain and user_id [n], true_probs [n, T] or None.
    """

    X: np.ndarray
    names: list[str]
    categorical: list[str]
    labels: np.ndarray
    mask: np.ndarray
    domain: np.ndarray
    user_id: np.ndarray
    true_probs: np.ndarray | None


def feature_names(schema: FeatureSchema,
                  history: str = "practitioner") -> tuple[list[str], list[str]]:
    """(every feature name in column order, the categorical ones)."""
    cats = [f.name for f in schema.sparse if not f.multi_hot] + [schema.domains.column]
    names = [f.name for f in schema.dense] + cats
    for s in schema.sequences:
        names += [f"{s.name}.n_events", f"{s.name}.since_last_s", f"{s.name}.since_first_s"]
        names += [f"{s.name}.n_last_{w}" for w, _ in WINDOWS_S]
        for col, feat, _ in match_attributes(schema, s.name):
            names += [f"{col}.n_match_{feat}", f"{col}.since_last_match_s"]
    if check_history(history) == "practitioner":
        extra, keep = _practitioner(schema, names)
        names += [extra.names[i] for i in keep]
    return names, cats


def _practitioner(schema: FeatureSchema,
                  basic: list[str]) -> tuple[PractitionerHistory, list[int]]:
    """The practitioner's columns and which of them to add: a name already among the basic ones
    (the window counts ``{stream}.n_last_{w}``) is the same count, kept once."""
    extra = PractitionerHistory(schema)
    have = set(basic)
    return extra, [i for i, n in enumerate(extra.names) if n not in have]


def _count(row: torch.Tensor, keep: torch.Tensor, B: int) -> torch.Tensor:
    return torch.bincount(row[keep], minlength=B).double()


def _reduce(age: torch.Tensor, row: torch.Tensor, keep: torch.Tensor, B: int,
            how: str) -> torch.Tensor:
    """Per-row min or max of ``age`` over the kept events; NaN for a row with none."""
    fill = math.inf if how == "amin" else -math.inf
    out = age.new_full((B,), fill).scatter_reduce(0, row[keep], age[keep], how)
    return torch.where(torch.isinf(out), math.nan, out)


def stream_features(batch: Batch, schema: FeatureSchema, stream: str) -> list[torch.Tensor]:
    """The history summaries of one stream, [B] each, in ``feature_names`` order.

    Causal by construction: only events strictly before the request (age > 0) count, whatever the
    data holds (the loader also quarantines rows with later events).
    """
    B = batch.batch_size
    ages = batch.seq_age.to_dict()[stream]
    age, row = ages.values().double(), row_ids(ages.lengths())
    past = age > 0
    cols = [_count(row, past, B), _reduce(age, row, past, B, "amin"),
            _reduce(age, row, past, B, "amax")]
    cols += [_count(row, past & (age <= w), B) for _, w in WINDOWS_S]
    seq, cand = batch.sequences.to_dict(), batch.sparse.to_dict()
    for col, feat, oov in match_attributes(schema, stream):
        ids = seq[col].values()
        # the OOV id never matches, as in GEM
        hit = past & (ids == cand[feat].values()[row]) & (ids != oov)
        cols += [_count(row, hit, B), _reduce(age, row, hit, B, "amin")]
    return cols


def batch_features(batch: Batch, schema: FeatureSchema,
                   history: str = "practitioner") -> np.ndarray:
    """[B, k] float64 features of one batch (``feature_names`` order).

    These are the features a practitioner hands a GBDT, generic by construction: the dense values
    raw, every single-valued id and the domain as a categorical, and per stream the event count,
    the time since its last and first event, counts over the last 1 h / 24 h / 7 d and, for each
    event attribute that shares its vocabulary with a candidate-side sparse feature (GEM's target
    match, ``match_attributes``), how many events match the candidate and how long since the last
    match. Nothing depends on how a synthetic world draws its labels. Multi-hot ids are left out
    (LightGBM has no set-valued categorical). ``history="practitioner"`` appends
    ``instruments.history_features``' columns (those not already here).
    """
    sparse = batch.sparse.to_dict()
    cols = [batch.dense.double()[:, i] for i in range(len(schema.dense))]
    cols += [sparse[f.name].values().double() for f in schema.sparse if not f.multi_hot]
    cols.append(batch.domain.double())
    for s in schema.sequences:
        cols += stream_features(batch, schema, s.name)
    X = torch.stack(cols, dim=1)
    if check_history(history) == "practitioner":
        extra, keep = _practitioner(schema, feature_names(schema, "basic")[0])
        X = torch.cat([X, extra.batch(batch)[:, keep]], dim=1)
    return X.numpy()


def features(data_dir: str | Path, split: str, schema: FeatureSchema | None = None,
             max_seq_len: dict[str, int] | None = None, batch_size: int = FEATURE_BATCH,
             columns=None, history: str = "practitioner") -> GBDTRows:
    """``split`` of ``data_dir`` read through GEM's loader (unshuffled, one pass) as ``GBDTRows``.

    ``max_seq_len`` caps each stream's history as a GEM run's loader does (default: the schema's).
    ``columns``: an object with ``names``, ``categorical`` and ``batch(batch) -> [B, k]`` that
    builds X in place of this module's features (``bench.linear.LinearColumns``); ``history``
    picks this module's history columns (``batch_features``) and is ignored with ``columns``.
    """
    schema = schema or FeatureSchema.load(data_dir)
    names, cats = (feature_names(schema, history) if columns is None
                   else (columns.names, columns.categorical))
    loader = ShardLoader(data_dir, split, batch_size, schema, shuffle=False, epochs=1,
                         max_seq_len=max_seq_len)
    parts: dict[str, list[np.ndarray]] = {k: []
                                          for k in ("X", "labels", "mask", "domain", "user_id",
                                                    "true_probs")}
    for batch in loader:
        parts["X"].append(batch_features(batch, schema, history) if columns is None
                          else columns.batch(batch))
        parts["labels"].append(batch.labels.numpy())
        parts["mask"].append(batch.label_mask.numpy())
        parts["domain"].append(batch.domain.numpy())
        parts["user_id"].append(batch.user_id.numpy())
        if batch.true_probs is not None:
            parts["true_probs"].append(batch.true_probs.numpy())
    if not parts["X"]:
        raise ValueError(f"{data_dir}: split {split!r} has no valid rows")
    cat = {k: np.concatenate(v) if v else None for k, v in parts.items()}
    return GBDTRows(names=names, categorical=cats, **cat)


# ------------------------------------------------------------------------------------ fitting
def _check_labels(y: np.ndarray, what: str) -> np.ndarray:
    y = np.asarray(y, dtype=np.float64)
    bad = ~np.isin(y, (0.0, 1.0))
    if bad.any():
        raise ValueError(f"{what}: labels must be 0/1 (mask unlabelled rows out first); "
                         f"{int(np.isnan(y).sum())} NaN and {int(bad.sum())} bad values in total")
    if y.size == 0:
        raise ValueError(f"{what}: no labelled rows to fit on")
    return y


def fit_task(X: np.ndarray, y: np.ndarray, X_valid: np.ndarray, y_valid: np.ndarray,
             names: list[str], categorical: list[str], params: dict, what: str = "task"):
    """One binary LightGBM, early-stopped on (X_valid, y_valid); returns the ``Booster``."""
    lgb = _lightgbm()
    y, y_valid = _check_labels(y, f"{what} (train)"), _check_labels(y_valid, f"{what} (valid)")
    train = lgb.Dataset(X, y, feature_name=names, categorical_feature=categorical,
                        free_raw_data=False)
    valid = lgb.Dataset(X_valid, y_valid, reference=train)
    return lgb.train(params, train, MAX_ROUNDS, valid_sets=[valid],
                     callbacks=[lgb.early_stopping(PATIENCE, verbose=False)])


def task_parents(schema: FeatureSchema) -> list[int]:
    return [schema.task_names.index(t.requires) if t.requires else -1 for t in schema.tasks]


def task_rows(rows: GBDTRows, t: int, parent: int) -> np.ndarray:
    """Rows a task's model fits: labelled, and with the required task's label 1 for a
    chained one."""
    keep = rows.mask[:, t].copy()
    if parent >= 0:
        keep &= rows.mask[:, parent] & (rows.labels[:, parent] == 1)
    return np.flatnonzero(keep)


def fit(train: GBDTRows, valid: GBDTRows, schema: FeatureSchema, point: dict, seed: int = 0,
        threads: int = 1) -> list:
    """One ``Booster`` per task at grid point ``point`` (learning_rate, num_leaves)."""
    params = {"objective": "binary", "metric": "binary_logloss", **point, "seed": seed,
              "num_threads": threads, "deterministic": True, "force_row_wise": True, "verbose": -1}
    models = []
    for t, p in enumerate(task_parents(schema)):
        tr, va = task_rows(train, t, p), task_rows(valid, t, p)
        models.append(fit_task(train.X[tr], train.labels[tr, t], valid.X[va], valid.labels[va, t],
                               train.names, train.categorical, params,
                               f"task {schema.task_names[t]!r}"))
    return models


def predict(models: list, rows: GBDTRows, schema: FeatureSchema) -> np.ndarray:
    """[n, T] probabilities; a chained task's is p(required) · p(task | required)."""
    return chain([m.predict(rows.X, num_iteration=m.best_iteration) for m in models], schema)


def chain(raw: list[np.ndarray], schema: FeatureSchema) -> np.ndarray:
    """[n, T] probabilities from each task's own [n] (a chained task's: p(task | required))."""
    parents = task_parents(schema)
    out: list[np.ndarray | None] = [None] * len(raw)

    def prob(t: int) -> np.ndarray:
        if out[t] is None:
            out[t] = raw[t] if parents[t] < 0 else prob(parents[t]) * raw[t]
        return out[t]

    return np.stack([prob(t) for t in range(len(raw))], axis=1)


def metrics(probs: np.ndarray, rows: GBDTRows, schema: FeatureSchema, base_rates: dict) -> dict:
    """``evaluate_model``'s metrics of ``probs`` on ``rows`` (MetricAccumulator, the train
    base rates)."""
    acc = MetricAccumulator(list(schema.domains.names), schema.task_names, base_rates)
    acc.update(probs, rows.labels, rows.mask, rows.domain, rows.user_id, rows.true_probs)
    return acc.compute()


# ------------------------------------------------------------------------------------ the run
def choice_task(schema: FeatureSchema) -> int:
    return next(t for t, task in enumerate(schema.tasks) if task.requires is None)


def _check_grid(grid: list[dict]) -> list[dict]:
    if not grid:
        raise ValueError("the LightGBM grid is empty")
    for point in grid:
        if not isinstance(point, dict) or set(point) != {"learning_rate", "num_leaves"}:
            raise ValueError(f"each LightGBM grid point is {{'learning_rate': …, 'num_leaves': "
                             f"…}}, got {point!r}")
    return grid


def run_gbdt(data_dir: str | Path, grid: list[dict] | None = None, seed: int = 0, threads: int = 1,
             tune_split: str = "valid", max_seq_len: dict[str, int] | None = None,
             score_test: bool = True, history: str = "practitioner") -> dict:
    """Tune LightGBM on ``tune_split`` over ``grid`` (default ``GRID``), then read test once (not at
    all without ``score_test``: a search over development worlds never needs it).

    Returns {"metrics": test metrics (``evaluate_run(...)["metrics"]``'s shape), "valid": the chosen
    point's metrics on ``tune_split``, "chosen": its params and rounds, "trials": every point's
    rounds and tuning-split log losses, "wall_s": the whole run (features, fits, scoring)}; with
    ``score_test`` also "metrics_platt", the test metrics after a per-task Platt fit on
    ``tune_split`` (``evaluation.platt``), and its "platt" parameters. ``history``: which history
    columns (``batch_features``).
    """
    t0 = time.perf_counter()
    require_tuning_split(tune_split, "the LightGBM grid point (learning rate × num_leaves)")
    grid = _check_grid(list(GRID if grid is None else grid))
    schema = FeatureSchema.load(data_dir)
    if len(grid) > 1 and schema.meta.get("source") == "synthetic" and "seed" in schema.meta:
        require_dev_world(int(schema.meta["seed"]), "the LightGBM grid point")
    _lightgbm()
    rates = train_base_rates(data_dir, schema, "train")
    check_history(history)
    train, valid = (features(data_dir, s, schema, max_seq_len, history=history)
                    for s in ("train", tune_split))
    c = choice_task(schema)
    trials, best = [], None
    for point in grid:
        models = fit(train, valid, schema, point, seed, threads)
        p_valid = predict(models, valid, schema)
        losses = {name: logloss(p_valid[valid.mask[:, t], t], valid.labels[valid.mask[:, t], t])
                  for t, name in enumerate(schema.task_names)}
        trials.append({"params": dict(point), "rounds": [m.best_iteration for m in models],
                       f"{tune_split}_logloss": losses})
        if best is None or losses[schema.task_names[c]] < best[0]:
            best = (losses[schema.task_names[c]], point, models, p_valid, trials[-1]["rounds"])
    _, point, models, p_valid, rounds = best
    out = {}
    if score_test:
        test = features(data_dir, REPORT_SPLIT, schema, max_seq_len, history=history)
        p_test = predict(models, test, schema)
        out["metrics"] = metrics(p_test, test, schema, rates)
        # as evaluation.platt does for a neural run
        platt = TaskPlatt.fit(p_valid, valid.labels, valid.mask)
        out["metrics_platt"] = metrics(platt(p_test), test, schema, rates)
        out["platt"] = platt.as_dict(schema.task_names)
    return {**out, "valid": metrics(p_valid, valid, schema, rates),
            "chosen": {**point, "rounds": dict(zip(schema.task_names, rounds))},
            "trials": trials, "wall_s": round(time.perf_counter() - t0, 3)}
