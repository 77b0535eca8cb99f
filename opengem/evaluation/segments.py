"""Per-segment metrics: NE, AUC, calibration and rows for each segment of each segment family, with
the worst segments and the spread of calibration across them (``opengem evaluate --segments``).

Legend: R rows of the split, T tasks, K segments of one family.

An overall NE can hide a group of users the model serves badly; a calibration of 1.00 overall can
be 0.8 on one surface and 1.2 on another. The families (``segment_families``):

    <feature>        each single-hot sparse *user* feature of the schema (not the user id column):
                     one segment per value; past ``top`` values, the ``top`` values with the most
                     rows are kept and the rest pooled as ``other`` (a table of thousands of thin
                     segments cannot be read, and each of their figures would be noise)
    surface          the schema's domain column
    activity         deciles of the user's impressions in the split (below)
    history          ``new`` (no event in any stream before the request) or ``returning``
    advertiser_size  deciles of the advertiser's impressions in the split; the advertiser is the
                     ad-side sparse feature whose name holds "advertiser" (skipped with a note
                     when the schema has none)

Activity is impressions per user in the evaluated split, not history length: it is defined on
every schema (a log without behaviour streams has no history), not cut by a stream's ``max_len``,
and constant per user, so a user sits in one decile (history grows within the split; ``history``
covers it). Deciles are cut at the 10 %, …, 90 % quantiles of the per-row value, so each holds
about a tenth of the rows; a user (advertiser) is never split between deciles, so tied values merge
deciles and a family may have fewer than ten.

One pass: ``SegmentAccumulator.update`` takes the scores the evaluation computes anyway and keeps,
per row, the predictions, labels, true probabilities and a few integer keys (feature ids, domain,
user, history length, advertiser). Segments are assigned at ``compute``, once every row is in (the
deciles need the split's counts). AUC is exact, from the kept scores: the evaluation already keeps
every row's prediction for its exact AUC and gAUC (``MetricAccumulator``), so this adds a copy of
the same order, not a new scale.

NE within a segment is normalised by the segment's own label rate on the split (1 = no better than
knowing the segment's rate): a training rate per segment is not recorded, and a shared rate would
rank segments by their base rate rather than by the model. On synthetic data every segment also
carries the truth's figures (``*_bayes``: the stored true probabilities scored the same way), so a
segment that is hard for the model can be told from one that is hard in itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from opengem.data.base_rates import initialized_dist
from opengem.evaluation.metrics import auc, calibration, entropy, logloss
from opengem.features.schema import FeatureSchema, SchemaError

BUILTIN = ("surface", "activity", "history", "advertiser_size")
# Segments with fewer rows stay in the table but out of the worst lists and the spread: with
# click rates of a few percent, 2,000 rows hold ~80 positives, and calibration's sampling noise
# is ~1/sqrt(positives) (the truth's own spread, ``calibration_bayes``, shows that floor).
MIN_ROWS = 2000
TOP_VALUES = 20
WORST = 5


@dataclass(frozen=True)
class Family:
    """One way to cut the rows: ``name``, the per-row key it reads (``source``) and how keys become
    segments (``kind``: ``values`` or ``deciles``); ``what`` says it in words."""

    name: str
    source: str
    kind: str
    what: str


def advertiser_feature(schema: FeatureSchema) -> str | None:
    """The ad-side single-hot sparse feature naming the advertiser, or None."""
    names = [f.name for f in schema.sparse
             if f.group == "ad" and not f.multi_hot and "advertiser" in f.name]
    return names[0] if names else None


def _user_features(schema: FeatureSchema) -> list[str]:
    return [f.name for f in schema.sparse if f.group == "user" and not f.multi_hot
            and f.name != schema.user_column and f.name not in BUILTIN]


def segment_families(schema: FeatureSchema,
                     names: list[str] | None = None) -> tuple[list[Family], list[str]]:
    """(families, notes). ``names`` None: every family the schema allows, a note for each that it
    does not; named ones must exist (SchemaError naming what is missing). Any single-hot sparse
    feature may be named, ad- or context-side ones included."""
    adv = advertiser_feature(schema)
    built = {"surface": Family("surface", "domain", "values",
                               f"the schema's domain column ({schema.domains.column})"),
             "activity": Family("activity", "user", "deciles",
                                "deciles of the user's impressions in the split"),
             "history": Family("history", "history", "values",
                               "new (no event before the request) vs returning")}
    notes = []
    if adv is not None:
        built["advertiser_size"] = Family("advertiser_size", f"sparse:{adv}", "deciles",
                                          f"deciles of the advertiser's ({adv}) impressions in "
                                          f"the split")
    else:
        notes.append("advertiser_size: skipped, the schema has no ad-side advertiser feature")
    if not schema.sequences:
        del built["history"]
        notes.append("history: skipped, the schema has no behaviour stream")
    features = {f.name: f for f in schema.sparse if not f.multi_hot}
    if names is None:
        multi = [f.name for f in schema.sparse if f.group == "user" and f.multi_hot]
        if multi:
            notes.append(f"{', '.join(multi)}: skipped, multi-hot (a row would sit in several "
                         f"segments)")
        return [*(_feature_family(schema, n) for n in _user_features(schema)),
                *built.values()], notes
    out = []
    for n in names:
        if n in built:
            out.append(built[n])
        elif n == "advertiser_size":
            raise SchemaError("segment family 'advertiser_size' needs an ad-side sparse feature "
                              "naming the advertiser; the schema has none")
        elif n == "history":
            raise SchemaError("segment family 'history' needs a behaviour stream; the schema "
                              "has none")
        elif n in features and n != schema.user_column:
            out.append(_feature_family(schema, n))
        else:
            raise SchemaError(f"no segment family or single-hot sparse feature named {n!r}; have "
                              f"{[*BUILTIN, *(f for f in features if f != schema.user_column)]}")
    return out, []


def _feature_family(schema: FeatureSchema, name: str) -> Family:
    f = schema.sparse_feature(name)
    return Family(name, f"sparse:{name}", "values",
                  f"{f.group} feature {name} ({f.vocab_size:,} values; id {f.vocab_size} = "
                  f"out of vocabulary)")


class SegmentAccumulator:
    """Rows of one evaluation, kept for ``compute`` (module docstring).

    Args:
        schema: the data's schema (task names, domain names, features).
        families: what ``segment_families`` returned (its first item).
    """

    def __init__(self, schema: FeatureSchema, families: list[Family]) -> None:
        self.schema, self.families = schema, families
        self.sources = sorted({f.source for f in families})
        self._parts: list[dict[str, np.ndarray]] = []

    def update(self, probs: torch.Tensor, batch) -> None:
        """Add one scored batch: ``probs`` [B, T] and the ``Batch`` it was scored on."""
        part = {"p": probs.detach().double().cpu().numpy(),
                "y": batch.labels.cpu().numpy(), "mask": batch.label_mask.cpu().numpy()}
        if batch.true_probs is not None:
            part["pt"] = batch.true_probs.double().cpu().numpy()
        for s in self.sources:
            part[s] = row_key(batch, s)
        self._parts.append(part)

    def reduce(self) -> None:
        """Gather every rank's rows (torch.distributed; no-op without it), so that ``compute`` on
        any rank covers the split; the deciles need every rank's counts."""
        dist = initialized_dist()
        if dist is None:
            return
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self._parts)
        self._parts = [p for parts in gathered for p in parts]

    def rows(self) -> dict[str, np.ndarray]:
        """Every kept row, concatenated: p, y, mask [R, T], pt [R, T] or absent, one key per
        source [R]."""
        if not self._parts:
            raise ValueError("no rows to cut into segments")
        return {k: np.concatenate([p[k] for p in self._parts]) for k in self._parts[0]}

    def compute(self, min_rows: int = MIN_ROWS, top: int = TOP_VALUES) -> dict:
        """The segment table (``segment_table``) of the rows added so far."""
        return segment_table(self.rows(), self.schema, self.families, min_rows, top)


def row_key(batch, source: str) -> np.ndarray:
    """Per-row key [B] int64 of ``source``: a sparse feature's id, the domain, the user, or the
    number of events in every stream before the request."""
    if source == "domain":
        return batch.domain.cpu().numpy().astype(np.int64)
    if source == "user":
        return batch.user_id.cpu().numpy().astype(np.int64)
    if source == "history":
        B = batch.batch_size
        return batch.seq_age.lengths().view(-1, B).sum(0).cpu().numpy().astype(np.int64)
    return batch.sparse[source.removeprefix("sparse:")].values().cpu().numpy().astype(np.int64)


def assign(family: Family, keys: np.ndarray, schema: FeatureSchema,
           top: int = TOP_VALUES) -> tuple[np.ndarray, list[str]]:
    """(code [R] in [0, K), the K segment names) of one family from its per-row keys."""
    if family.kind == "deciles":
        return _deciles(keys)
    if family.source == "domain":
        return keys, list(schema.domains.names)
    if family.source == "history":
        return (keys > 0).astype(np.int64), ["new", "returning"]
    values, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
    vocab = schema.sparse_feature(family.name).vocab_size
    names = ["oov" if v == vocab else str(int(v)) for v in values]
    if len(values) <= top:
        return inverse, names
    kept = np.argsort(-counts, kind="stable")[:top]
    remap = np.full(len(values), top, dtype=np.int64)
    remap[kept] = np.arange(top)
    return remap[inverse], [names[i] for i in kept] + ["other"]


def _deciles(keys: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """Deciles by rows of the number of rows sharing each key (module docstring)."""
    _, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
    size = counts[inverse]
    cuts = np.unique(np.quantile(size, np.arange(1, 10) / 10, method="lower"))
    code = np.searchsorted(cuts, size, side="left")
    used = np.unique(code)
    code = np.searchsorted(used, code)
    names = [f"d{i + 1} ({size[code == i].min()}-{size[code == i].max()})"
             for i in range(len(used))]
    return code, names


def segment_metrics(p: np.ndarray, y: np.ndarray, pt: np.ndarray | None) -> dict:
    """One segment's figures: n, positives, predicted (Σp), logloss, NE within the segment, AUC,
    calibration and ``calibration_z`` = (Σp − Σy) / sqrt(Σ p(1 − p)), how many standard deviations
    of label noise the miscalibration is, were the predictions true (|z| of 2 or less: a ratio
    sampling alone can give); with ``pt`` the truth's NE, AUC and calibration and ``captured``."""
    rate = float(y.mean())
    h = float(entropy(rate)) if 0.0 < rate < 1.0 else math.nan
    var = float((p * (1 - p)).sum())
    out = {"n": int(p.shape[0]), "positives": int(y.sum()), "predicted": float(p.sum()),
           "logloss": logloss(p, y),
           "calibration_z": (float(p.sum()) - float(y.sum())) / math.sqrt(var) if var > 0
           else math.nan}
    out.update(ne=out["logloss"] / h, auc=auc(p, y), calibration=calibration(p, y))
    if pt is not None:
        nb = logloss(pt, y) / h
        out.update(ne_bayes=nb, auc_bayes=auc(pt, y), calibration_bayes=calibration(pt, y),
                   captured=(1 - out["ne"]) / (1 - nb) if nb != 1 else math.nan)
    return out


def segment_table(rows: dict[str, np.ndarray], schema: FeatureSchema, families: list[Family],
                  min_rows: int = MIN_ROWS, top: int = TOP_VALUES) -> dict:
    """Per task: ``segments`` ("<family>=<segment>" → ``segment_metrics``), ``worst_calibration``
    and ``worst_ne`` (up to five keys among segments of at least ``min_rows`` rows: farthest from a
    calibration of 1 in log ratio, highest NE), and ``spread`` (max / min calibration over those
    segments; with the truth's beside it)."""
    codes = {f.name: assign(f, rows[f.source], schema, top) for f in families}
    tasks = {}
    for t, task in enumerate(schema.task_names):
        m = rows["mask"][:, t].astype(bool)
        p, y = rows["p"][m, t], rows["y"][m, t].astype(np.float64)
        pt = rows["pt"][m, t] if "pt" in rows else None
        segs = {}
        for f in families:
            code, names = codes[f.name]
            code = code[m]
            for k, name in enumerate(names):
                sel = code == k
                if sel.any():
                    segs[f"{f.name}={name}"] = segment_metrics(
                        p[sel], y[sel], None if pt is None else pt[sel])
        tasks[task] = {"segments": segs, **_summary(segs, min_rows)}
    return {"min_rows": min_rows, "top": top, "families": {f.name: f.what for f in families},
            "tasks": tasks}


def _summary(segs: dict, min_rows: int) -> dict:
    big = {k: s for k, s in segs.items() if s["n"] >= min_rows}
    cal = {k: s for k, s in big.items() if math.isfinite(s["calibration"]) and s["calibration"] > 0}
    worst_cal = sorted(cal, key=lambda k: -abs(math.log(cal[k]["calibration"])))[:WORST]
    worst_ne = sorted((k for k in big if math.isfinite(big[k]["ne"])),
                      key=lambda k: -big[k]["ne"])[:WORST]
    spread = {}
    if cal:
        hi = max(cal, key=lambda k: cal[k]["calibration"])
        lo = min(cal, key=lambda k: cal[k]["calibration"])
        spread = {"segments": len(cal), "max": cal[hi]["calibration"], "max_segment": hi,
                  "min": cal[lo]["calibration"], "min_segment": lo,
                  "ratio": cal[hi]["calibration"] / cal[lo]["calibration"]}
        truth = [s["calibration_bayes"] for s in cal.values()
                 if math.isfinite(s.get("calibration_bayes", math.nan))]
        if truth and min(truth) > 0:
            spread["ratio_bayes"] = max(truth) / min(truth)
    return {"worst_calibration": worst_cal, "worst_ne": worst_ne, "spread": spread}

