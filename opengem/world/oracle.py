"""The oracle of a synthetic world: a logistic model that knows the world's exact structure but not
its parameters, fitted on the same training rows a model gets. Its ``captured`` is what a learner
that had guessed the form perfectly reaches from this much data, so the figure that travels across
the family of worlds is ``captured / oracle_captured``.

Inputs (per model; the structure is ``world.structure``, values are read from the shard's columns
and from the world's id attributes, nothing latent):

* click: one-hot ``ad_id``, ``advertiser_id``, ``campaign_id`` (the per-entity effects), ``domain``,
  ``position``, ``device``, ``format`` and the cross domain × format; for every interaction pair the
  one-hot cross of its two fields' values (one weight per cell, not the low-rank factors; a field of
  the advertiser's cluster, which no column holds, is crossed as ``advertiser_id``); the exact
  history statistic of every history effect (true form, τ and match key), the true transform of
  every numeric effect and ``hour_sin`` / ``hour_cos`` (the hour term is linear in them) as scalar
  columns; with ad content vectors (``click.content_dim`` = k > 0) the k floats of the row's
  ``ad_content`` (the content term is linear in them); in a family-2 world the exact statistic of
  each ``WideEffects`` term that is on (``opengem.world.wide``; the similarity column reads the
  items' and ads' latent vectors, the one latent value the oracle sees);
* conversion given click: one-hot ``advertiser_id`` and ``domain``, the crosses of its pairs and its
  history statistic, fitted on the clicked train rows; p(conversion) = p_click · p_cvr.

``crosses="all"`` (``refit(..., crosses="all")``; never what ``generate`` stores) is the same model
blind to which pairs interact: it crosses every user field with every observable ad field (category,
format, advertiser_id: 7 × 3 crosses, each model), still with the exact history statistics and
numeric transforms. Its captured over the oracle's is what knowing the pairs is worth at a world's
size, the part of the gap no learner that must find them can close from that many rows.

The drift by day is left out: a future day's drift cannot be known. The model is
``logit = b + Σ_groups w_g[index_g] + Σ_c β_c x_c`` with the L2 penalty ``λ/2 (Σ w² + Σ β²)``
(dense columns standardised on the train rows), fitted full-batch by L-BFGS in float64 with a
diagonal preconditioner; λ is picked from ``opengem.evaluation.logistic.L2_GRID`` by the valid log
loss (``choose_l2`` refuses any other split), warm-started from the largest λ down until the valid
loss rises. NE and ``captured`` come from evaluation's ``MetricAccumulator`` with the train split's
base rates (``RateCounter``, as the trainer records them), so they are the evaluator's numbers to
the digit.

The inputs are collected while the shards are written, so the fit adds tens of seconds to a demo
world's generation, not a second pass over it (timings: docs/experiments.md, 'Figures moved from
code docstrings').
"""

from __future__ import annotations

import logging
import time

import numpy as np

from opengem.data.base_rates import RateCounter
from opengem.data.parquet import DatasetManifest
from opengem.evaluation.accumulator import ALL_DOMAIN, MetricAccumulator
from opengem.evaluation.logistic import Design, choose_l2
from opengem.evaluation.metrics import captured, entropy
from opengem.evaluation.platt import TaskPlatt
from opengem.world.latent import (
    FORMATS,
    NUM_DEVICES,
    NUM_POSITIONS,
    SURFACES,
    World,
    field_size,
    field_values,
    history_stats,
    numeric_transform,
    rng_for,
    sigmoid,
)
from opengem.world.structure import AD_FIELDS, USER_FIELDS

log = logging.getLogger(__name__)

MAX_TRAIN_ROWS = 4_000_000  # beyond, fit on a subsample of users (demo: 497k rows, small: ~2.1M)
TAG_ORACLE = 4  # rng tag of that subsample, after latent's
REPORTED = ("ne", "ne_bayes", "captured", "auc")
# the world's own interaction pairs | every user field × observable ad field
CROSSES = ("true", "all")


def observable_field(name: str) -> str:
    """The field an oracle cross reads for an interaction field: itself, but for the advertiser's
    cluster, which no column holds (the world draws it per advertiser with the data seed, a
    parameter, not the form): the oracle crosses with ``advertiser_id`` instead, the finest grouping
    a learner sees, one weight per (user value, advertiser) cell."""
    return "advertiser_id" if name == "advertiser_cluster" else name


class Layout:
    """Which one-hot groups and scalar columns one oracle model (``click`` | ``conversion``) has;
    ``crosses`` (``CROSSES``): the world's interaction pairs, or all of them (module docstring)."""

    def __init__(self, world: World, model: str, crosses: str = "true"):
        if crosses not in CROSSES:
            raise ValueError(f"oracle crosses must be one of {CROSSES}, got {crosses!r}")
        cfg, st = world.cfg, world.structure
        self.world, self.model = world, model
        sizes = cfg.sizes
        # (name, cells, column or (user field, ad field))
        groups: list[tuple[str, int, object]] = []
        if model == "click":
            s = st.click
            groups += [("ad_id", world.num_ads, "ad_id"),
                       ("advertiser_id", sizes.num_advertisers, "advertiser_id"),
                       ("campaign_id", sizes.num_campaigns, "campaign_id"),
                       ("domain", len(SURFACES), "domain"),
                       ("position", NUM_POSITIONS, "position"), ("device", NUM_DEVICES, "device"),
                       ("format", len(FORMATS), "format"),
                       ("domain_format", len(SURFACES) * len(FORMATS),
                                                           ("domain", "format"))]
            self.numeric = [e for e in s.numeric if e.shape != "none"]
        else:
            s = st.conversion
            groups += [("advertiser_id", sizes.num_advertisers, "advertiser_id"),
                       ("domain", len(SURFACES), "domain")]
            self.numeric = []
        if crosses == "true":
            pairs = [(f"cross_{it.name}", it.user, observable_field(it.ad))
                     for it in s.interactions]
        else:  # domain x format is a group of the click model already
            ads = dict.fromkeys(observable_field(a) for a in AD_FIELDS)
            pairs = [(f"cross_{u}_{a}", u, a) for u in USER_FIELDS for a in ads
                     if not (model == "click" and (u, a) == ("domain", "format"))]
        groups += [(name, field_size(cfg, u) * field_size(cfg, a), (u, a)) for name, u, a in pairs]
        self.groups = groups
        self.history = [h for h in s.history if h.form != "none"]
        self.offsets = np.cumsum([0] + [n for _, n, _ in groups])
        self.num_weights = int(self.offsets[-1])
        self.dense_names = ([f"hour_{k}" for k in ("sin", "cos")] if model == "click" else []) + \
            [e.name for e in self.numeric] + [f"{h.stream}_{h.form}" for h in self.history]
        # family 2's terms are β·statistic: one exact scalar column each (click only)
        self.wide = (list(st.wide.on()) if model == "click" and st.wide is not None else [])
        self.dense_names += [f"wide_{name}" for name in self.wide]
        self.content = model == "click" and world.ad_content is not None
        if self.content:
            self.dense_names += [f"ad_content_{j}" for j in range(world.ad_content.shape[1])]

    def rows(self, c: dict, stats: dict) -> tuple[np.ndarray, np.ndarray]:
        """(global group indices [G, n] int64, scalar columns [n, K] float64) of rows ``c``."""
        n = len(c["request_ts"])
        idx = np.empty((len(self.groups), n), dtype=np.int64)
        for j, (_, _, src) in enumerate(self.groups):
            if isinstance(src, tuple):
                u, a = src
                v = field_values(self.world, c, u) * field_size(self.world.cfg, a) + field_values(
                    self.world, c, a
                )
            else:
                v = c[src]
            idx[j] = self.offsets[j] + v
        cols = [c["hour_sin"], c["hour_cos"]] if self.model == "click" else []
        cols += [numeric_transform(e, c[e.feature]) for e in self.numeric]
        cols += [stats[h.spec()] for h in self.history]
        cols += [stats["wide", name] for name in self.wide]
        if self.content:  # the row's ad_content column: the ad's vector, row-major k floats per row
            vals, lens = c["ad_content"]
            cols += list(np.asarray(vals, dtype=np.float64).reshape(n, -1).T)
        x = (
            np.stack([np.asarray(v, dtype=np.float64) for v in cols], 1)
            if cols
            else np.zeros((n, 0))
        )
        return idx, x


class OracleCollector:
    """Collects the oracle's inputs shard by shard (``add``), then fits and scores (``result``).

    Worlds with more than ``max_train_rows`` expected train rows (the ``large`` preset) fit on a
    uniform subsample of their users' train rows, reported as ``train_user_share``; valid and test
    are always scored in full."""

    stats_key = "oracle"  # where ``generate`` stores ``result()`` (a ``synthetic.ShardObserver``)

    def __init__(self, world: World, split_of: dict[int, str], max_train_rows: int = MAX_TRAIN_ROWS,
                 crosses: str = "true"):
        self.world, self.split_of = world, split_of
        self.layouts = {m: Layout(world, m, crosses) for m in ("click", "conversion")}
        self.parts: dict[str, list[dict]] = {}
        self.rates = RateCounter(list(SURFACES), ["click", "conversion"])
        sizes = world.cfg.sizes
        train_days = sum(1 for s in split_of.values() if s == "train")
        expected = sizes.num_users * world.cfg.impressions.impressions_per_day * train_days
        self.user_share = min(1.0, max_train_rows / max(expected, 1.0))
        self.keep = (rng_for(world.cfg.seed, TAG_ORACLE).random(sizes.num_users) < self.user_share
                     if self.user_share < 1 else None)

    def add(self, day: int, c: dict) -> None:
        """Rows of one shard: ``c`` holds the shard's columns (``synthetic.columns_from_table``)."""
        stats = history_stats(self.world, c)
        part = {"domain": c["domain"], "click": c["click"], "conversion": c["conversion"],
                "p_click": c["p_click"], "p_conversion": c["p_conversion"]}
        for m, layout in self.layouts.items():
            part[f"{m}_idx"], part[f"{m}_x"] = layout.rows(c, stats)
        split = self.split_of[day]
        # NE's normaliser: the rates of every train row, as the trainer counts them
        if split == "train":
            self.rates.update(np.stack([c["click"], c["conversion"]], 1).astype(np.float64), None,
                              c["domain"])
        if split == "train" and self.keep is not None:
            rows = self.keep[c["user_id"]]
            part = {k: v[:, rows] if k.endswith("_idx") else v[rows] for k, v in part.items()}
        self.parts.setdefault(split, []).append(part)

    def _split(self, split: str) -> dict:
        parts = self.parts.get(split, [])
        return {k: np.concatenate([p[k] for p in parts], axis=1 if k.endswith("_idx") else 0)
                for k in parts[0]} if parts else {}

    def result(self) -> dict:
        """Per split (valid, test) and slice: the oracle's NE, Bayes NE, captured (and its expected
        value) and AUC; the L2 chosen and every λ's valid log loss."""
        t0 = time.perf_counter()
        data = {s: self._split(s) for s in ("train", "valid", "test")}
        if not all(data.values()):
            raise ValueError("the oracle needs rows in each of the train, valid and test splits")
        designs = {s: {m: Design(s, d[f"{m}_idx"], d[f"{m}_x"], d[m].astype(np.float64))
                       for m in self.layouts} for s, d in data.items()}
        click, losses = {}, {}
        click_fit, losses["click"] = choose_l2(designs["train"]["click"], designs["valid"]["click"],
                                               self.layouts["click"].num_weights)
        clicked = {s: np.flatnonzero(data[s]["click"] == 1) for s in data}
        cvr_fit, losses["conversion"] = choose_l2(
            designs["train"]["conversion"].subset(clicked["train"]),
            designs["valid"]["conversion"].subset(clicked["valid"]),
            self.layouts["conversion"].num_weights,
        )
        rates = self.rates.rates()
        out = {"l2": {"click": click_fit.l2, "conversion": cvr_fit.l2},
               "valid_logloss": {m: {str(k): v for k, v in ls.items()} for m, ls in losses.items()},
               "train_rows": {"click": len(data["train"]["click"]),
                              "conversion": len(clicked["train"])},
               "train_user_share": self.user_share,
               "parameters": {m: lay.num_weights + len(lay.dense_names) + 1 for m,
                              lay in self.layouts.items()}}
        probs = {}
        for s in ("valid", "test"):
            pc = sigmoid(click_fit.logits(designs[s]["click"]))
            pv = sigmoid(cvr_fit.logits(designs[s]["conversion"]))
            probs[s] = np.stack([pc, pc * pv], 1)
            click[s] = _slices(data[s], pc, pc * pv, rates)
        out.update(click)
        # the same after a Platt fit per task on valid (``evaluation.platt``): what a model's
        # recalibrated figures are set beside, so both sides get the same correction
        platt = TaskPlatt.fit(probs["valid"],
                              np.stack([data["valid"]["click"], data["valid"]["conversion"]], 1))
        fitted = platt(probs["test"])
        out["platt"] = {"test": _slices(data["test"], fitted[:, 0], fitted[:, 1], rates),
                        "params": platt.as_dict(["click", "conversion"])}
        log.info("oracle fitted on %d train rows in %.1f s (L2 click %g, conversion %g)",
                 out["train_rows"]["click"], time.perf_counter() - t0, click_fit.l2, cvr_fit.l2)
        return out


def _slices(d: dict, p_click: np.ndarray, p_conv: np.ndarray, rates: dict) -> dict:
    """The evaluator's metrics of each slice, plus ``ne_expected``, ``ne_bayes_expected`` and
    ``captured_expected``: the same with both log losses taken in expectation over the true
    probabilities, free of label noise (``ne_expected >= ne_bayes_expected`` by Gibbs' inequality,
    where a small slice's ``ne`` can fall below ``ne_bayes`` by chance)."""
    acc = MetricAccumulator(list(SURFACES), ["click", "conversion"], rates)
    probs, truth = np.stack([p_click, p_conv], 1), np.stack([d["p_click"], d["p_conversion"]], 1)
    acc.update(probs, np.stack([d["click"], d["conversion"]], 1), None, d["domain"],
               true_probs=truth)
    out = {}
    for key, m in acc.compute().items():
        domain, task = key.split("/")
        rows = slice(None) if domain == ALL_DOMAIN else d["domain"] == SURFACES.index(domain)
        t = ["click", "conversion"].index(task)
        p, pt = probs[rows, t], truth[rows, t]
        out[key] = {f: m[f] for f in REPORTED}
        h = entropy(m["base_rate"]) if 0 < m["base_rate"] < 1 else float("nan")
        ne, nb = float(np.mean(_xent(pt, p))) / h, float(np.mean(_xent(pt, pt))) / h
        out[key].update(ne_expected=ne, ne_bayes_expected=nb, captured_expected=captured(ne, nb))
    return out


def _xent(q, p) -> np.ndarray:
    """Expected log loss of predicting p when the label is 1 with probability q."""
    p = np.clip(p, 1e-15, 1 - 1e-15)
    return -(q * np.log(p) + (1 - q) * np.log1p(-p))


def refit(data_dir, crosses: str = "true") -> dict:
    """The oracle of a written synthetic dataset, from its shards and manifest alone (what
    ``generate`` stores in ``source.stats.oracle``, before rounding); ``crosses="all"``: the
    pair-blind form (module docstring)."""
    from opengem.data.events import ShardReader
    from opengem.features.schema import FeatureSchema
    from opengem.world.generate import columns_from_table, world_from_manifest

    manifest = DatasetManifest.load(data_dir)
    split_of = {d: s for s, days in manifest.splits.items() for d in days}
    rows = OracleCollector(world_from_manifest(manifest), split_of, crosses=crosses)
    schema = FeatureSchema.load(data_dir)
    reader = ShardReader(data_dir, manifest, schema)  # v2: histories joined from the event logs
    for f in manifest.files:
        rows.add(f.day, columns_from_table(reader.read(f, schema.columns())))
    return rows.result()
