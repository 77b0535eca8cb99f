"""The embedded synthetic ads world: impressions whose TRUE click / conversion probabilities are
stored next to their labels, so the Bayes-optimal normalized entropy of any split is exact.

Generative process (latent parts in ``opengem.world.latent``; every knob is a
``WorldConfig`` field, named here without its part (``num_users`` is ``sizes.num_users``); times are
seconds, day 0 starts at ``cfg.sizes.start_ts``):

1. Global entities, from ``rng(seed, global)``: ``num_categories`` categories with Zipf-ish
   popularity; content items, each in one category (every category has ≥ 1), Zipf popularity
   inside it; advertisers with a main category, a cluster (for an interaction) and a quality
   effect; campaigns owned by advertisers, mostly in the advertiser's main category; ads belong to
   campaigns (category = campaign's), a format in 4, latent quality = advertiser + campaign + small
   ad noise, and an observed noisy proxy (the ``ad_quality`` feature). The initial pool launches
   before day 0 (one ad before the pre-history window, so some ad is always live),
   ``new_ads_per_day`` more on each day ≥ 1, so later days hold ads never seen earlier. Each ad's
   and advertiser's effect drifts as a daily random walk (0 on day 0).
2. Users, in blocks of ``users_per_block`` from ``rng(seed, block)``: age, gender (a pure
   distractor: no signal), country, device, segment; activity ~ lognormal (organic events/day);
   interest over categories = segment profile (peaked on a few categories) + user noise + a
   per-day random walk (``interest_drift``). Users have ``history_days`` of pre-history.
3. Streams over the whole window: organic events (count ~ Poisson(activity × days), capped at
   ``max_events``; uniform times; category from that day's interest; item Zipf within the
   category; type view/like/share/comment with fixed probabilities) and ads engagements (rate
   ``ads_events_per_organic`` × activity, capped at ``ads_max_events``; a uniformly drawn live ad
   of an interest category; click, or conversion with ``conversion_event_prob``). The ads stream is
   exogenous (engagements elsewhere): generated impression clicks are not fed back into it.
   With ``event_attributes`` each event also carries ``organic.category`` (the item's category)
   / ``ads.advertiser_id`` (the engaged ad's advertiser), as a real event log would. Attributes are
   named after the sparse feature whose ids they hold, so a model may share those embeddings.
4. Impressions on days 0..num_days-1, from ``rng(seed, day-tag, block, day)``: per user per day
   Poisson(rate ∝ activity^0.25), uniform time, surface from a per-user Dirichlet preference,
   position truncated-geometric in 0..7, hour from the time. The ad is a live ad: targeted
   (``target_frac``: a category drawn from the user's interest that day), retargeted
   (``retarget_frac``: the advertiser of one of the ``retarget_recent`` latest stored ads events)
   or uniformly random. Features: ``user_activity`` = (log1p(organic events before the request)
   − log1p(activity_median · history_days)) / activity_sigma; ``ad_age`` = log1p(days live);
   ``hour_sin``/``hour_cos`` from the exact time of day.
5. Click logit = b0 + surface + position (−β·log1p(pos)) + hour (cosine peaking at 20h, via
   hour_sin/cos) + ad quality + ad/advertiser drift (by day) + novelty (β·exp(−ad_age)) +
   surface×format (fixed table) + ⟨segment, category⟩ + ⟨age, format⟩ + ⟨country, advertiser
   cluster⟩ (low-rank factors, unit variance × β) + β_seq·m + β_ads·log1p(A) + activity/device:
   m = Σ w·e^{−Δt/τ}·[cat(item) = cat(ad)] / (1 + Σ w·e^{−Δt/τ}) over the row's STORED organic
   history (w by event type), A = Σ w·e^{−Δt/τ_ads}·[advertiser(ad_e) = advertiser(ad)] over its
   stored ads history. b0 is solved by bisection on all rows of block 0 so mean CTR ≈
   ``target_ctr`` (so b0 depends on ``users_per_block``; it is stored in the manifest).
6. Conversion given click: logit = c0 + advertiser effect + ⟨segment, category⟩ (other factors) +
   β·m + surface; c0 solved so Σp_conversion/Σp_click ≈ ``target_cvr`` on block 0.
   p_conversion = p_click·p_cvr; click ~ Bernoulli(p_click), conversion = click·Bernoulli(p_cvr),
   so P(conversion = 1) = p_conversion exactly.
7. Steps 5 and 6 are the form of ``structure_seed`` 0. Another structure seed draws the form
   (``opengem.world.structure``: which pairs interact at what rank, how each history acts,
   numeric shapes, position form, surface tables, conversion terms, drift scales); the draws of
   steps 1–4 stay as they were, but for the drifts' scales and, through the interest drift, the
   rows. ``family=2`` widens the menu (item-level similarity, fatigue, repeat engagement,
   last-k; ``opengem.world.wide``) without moving a family-1 draw. ``opengem generate`` then
   fits an oracle with the world's exact structure on the train rows (``opengem.world.oracle``);
   its NE and ``captured`` per split land in ``source.stats.oracle``.

Everything the true models read is in the row: ``latent.probabilities(world, cols)``
recomputes the probability columns from a shard (``columns_from_table``) and the calibrated world
(``world_from_manifest``; the structure is stored in ``source.structure``). Shards: one per (user
block, day), ``d{day:03d}-b{block:05d}``, rows in time order; output is bit-reproducible for a
seed. The manifest's ``source.stats`` holds rows, CTR/CVR (observed and true means), Bayes NE per
split (``bayes_ne``: the true probabilities' log loss on the drawn labels over the entropy of the
split's own label rate; ``bayes_ne_expected``: the same in expectation), the share of rows showing
ads launched after the last train day, stored sequence-length quantiles, the share of the logit
variance of each term (Var(term) / Var(logit); covariances make them not sum to 1), the calibrated
intercepts and the oracle's figures (``oracle``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
import pyarrow as pa

from opengem.data.parquet import (
    LAYOUT_V2,
    LAYOUTS,
    DatasetManifest,
    ShardWriter,
    list_array,
    stream_columns,
)
from opengem.features.schema import (
    DenseFeature,
    Domains,
    EmbeddingFeature,
    FeatureSchema,
    SequenceStream,
    SparseFeature,
    Task,
)
from opengem.world.latent import (
    ADS_EVENTS,
    DAY,
    FORMATS,
    MISSING_FEATURES,
    NUM_AGES,
    NUM_COUNTRIES,
    NUM_DEVICES,
    NUM_GENDERS,
    NUM_HOURS,
    NUM_POSITIONS,
    ORGANIC_EVENTS,
    SURFACE_TASK,
    SURFACES,
    TAG_DAY,
    DenseMissing,
    SurfaceTask,
    UserBlock,
    World,
    blank_dense,
    probabilities,
    ranges,
    rng_for,
    sigmoid,
    solve_intercept,
    solve_surface_intercept,
    surface_task_columns,
)
from opengem.world.structure import WorldStructure


@dataclass
class WorldSizes:
    """How many of everything, and the time window (defaults: the ``demo`` world).

    Days: ``history_days`` of events only, then impression days ``0..num_days-1``, split into
    train, then ``valid_days``, then the last ``test_days``.
    """

    num_users: int = 36000
    users_per_block: int = 2048  # users generated (and held in memory) together
    num_days: int = 8  # impression days 0..num_days-1
    history_days: int = 30  # pre-history window before day 0 (events only, no impressions)
    valid_days: int = 1  # the valid split: the valid_days before the test days
    test_days: int = 1  # the test split: the last test_days days; train = the rest
    start_ts: int = 1704067200  # unix seconds of the start of day 0 (2024-01-01 UTC)
    num_categories: int = 32
    num_segments: int = 24
    num_content_items: int = 5000
    num_advertisers: int = 200
    num_campaigns: int = 600  # >= num_advertisers (every advertiser has one)
    num_advertiser_clusters: int = 8
    initial_ads: int = 1200  # launched before day 0
    new_ads_per_day: int = 100  # launched on each of days 1..num_days-1
    # initial ads launch uniformly over this many days before the window
    initial_ad_span_days: int = 60
    latent_rank: int = 4  # rank of the interaction factors


@dataclass
class Behaviour:
    """Catalogue popularity, user activity and interests, and the two event streams (step
    3 above)."""

    activity_median: float = 1.2  # organic events per day of the median user
    activity_sigma: float = 1.5  # lognormal sigma of activity (long tail)
    max_events: int = 3000  # cap on a user's organic events over the whole window
    category_pop_slope: float = 0.6  # category log-popularity = -slope * log1p(rank)
    content_zipf: float = 1.1  # item popularity within a category ∝ 1/(rank+1)^zipf
    segment_peaks: int = 3  # categories a segment profile is peaked on
    segment_peak_height: float = 3.0
    interest_noise: float = 1.0  # per-user deviation from the segment profile (logits)
    interest_drift: float = 0.15  # per-day random-walk step of interest logits
    ads_events_per_organic: float = 0.08  # ads engagements per organic event
    ads_max_events: int = 600
    conversion_event_prob: float = 0.12  # share of ads-stream events that are conversions
    organic_max_len: int = 4096  # stored history limits (most recent kept)
    event_attributes: bool = True  # per-event attribute columns organic.category, ads.advertiser_id
    ads_max_len: int = 512
    # the schema declares the ads stream's items the candidate's ``ad_id``
    # (``SequenceStream.matches``, read by ``model.target_match_items``); off, the schema is the
    # one written before the field
    declare_ad_items: bool = False


@dataclass
class Impressions:
    """Which user sees which ad, where and when (step 4 above)."""

    impressions_per_day: float = 2.3  # mean per user per day
    impression_activity_exp: float = 0.25  # rate ∝ activity^exp (normalised)
    surface_concentration: float = 3.0  # Dirichlet concentration of the per-user surface preference
    target_frac: float = 0.55  # share of impressions targeted to the user's interest
    retarget_frac: float = 0.15  # share retargeting an advertiser from the ads history
    retarget_recent: int = 3  # ... drawn from the user's most recent stored ads engagements
    position_decay: float = 0.6  # P(position = k) ∝ decay^k, k in 0..7
    campaign_main_category_prob: float = 0.85  # a campaign targets its advertiser's main category


@dataclass
class ClickModel:
    """The true click logit's scales (step 5 above); ``b0`` is calibrated to ``target_ctr``."""

    target_ctr: float = 0.04
    beta_surface: float = 1.0
    beta_position: float = 0.6
    beta_hour: float = 0.25
    advertiser_sigma: float = 0.6
    campaign_sigma: float = 0.2
    ad_sigma: float = 0.1
    ad_quality_obs_noise: float = 0.15
    ad_drift: float = 0.05  # per-day random-walk step of each ad's effect
    advertiser_drift: float = 0.03
    beta_novelty: float = 0.5  # novelty bump beta * exp(-ad_age), ad_age = log1p(days live)
    beta_surface_format: float = 1.0
    beta_segment_category: float = 0.6
    beta_age_format: float = 0.3
    beta_country_cluster: float = 0.3
    beta_seq: float = 3.0
    seq_tau_hours: float = 48.0
    beta_ads: float = 1.5
    ads_tau_hours: float = 168.0
    beta_activity: float = 0.1
    beta_device: float = 1.0
    # Ad content vectors (``latent.World``): 0 = off (the default world is unchanged); k >
    # 0 writes an ``ad_content`` list<float32> column of k floats per row (an ``EmbeddingFeature``)
    # and adds content_sigma · ⟨v_ad, ŵ⟩ to the click logit. Kept out of the manifest while 0.
    content_dim: int = 0
    content_sigma: float = 1.0


@dataclass
class ConversionModel:
    """The true conversion-given-click logit's scales (step 6 above); ``c0`` is calibrated
    to ``target_cvr``."""

    target_cvr: float = 0.08
    cvr_advertiser_sigma: float = 0.6
    cvr_beta_segment_category: float = 0.5
    cvr_beta_seq: float = 1.5
    cvr_beta_surface: float = 1.0


@dataclass
class WorldConfig:
    """All knobs of the synthetic world, by part (defaults = the ``demo`` preset; presets in
    ``opengem.world.presets``). Overrides and error messages use dotted keys: ``sizes.num_users``.

    Args:
        seed: the sampling seed: every draw of entities, users and rows is a pure function of it.
        sizes: entity counts and the day window (``WorldSizes``).
        behaviour: activity, interests and event streams (``Behaviour``).
        impressions: impression rate, surfaces, positions and ad choice (``Impressions``).
        click: the true click model (``ClickModel``).
        conversion: the true conversion-given-click model (``ConversionModel``).
        structure_seed: the functional form of the true models (``opengem.world.structure``):
            0 is today's demo world; another seed draws which terms exist and how each acts.
        family: the menu the structure draws from: 1 (today's) or 2, which adds item-level
            similarity, fatigue, repeat engagement and last-k (``structure.WideEffects``), drawn
            from their own generator so the family-1 part of the form is unchanged.
        surface_task: a surface's own objective the FM does not train on (``SurfaceTask``; off).
        dense_missing: missing-not-at-random dense values (``DenseMissing``; off).
    """

    seed: int = 0
    sizes: WorldSizes = field(default_factory=WorldSizes)
    behaviour: Behaviour = field(default_factory=Behaviour)
    impressions: Impressions = field(default_factory=Impressions)
    click: ClickModel = field(default_factory=ClickModel)
    conversion: ConversionModel = field(default_factory=ConversionModel)
    structure_seed: int = 0
    family: int = 1  # 1: not in the manifest either
    # off: not in the manifest (``source_config``)
    surface_task: SurfaceTask = field(default_factory=SurfaceTask)
    # off: not in the manifest either
    dense_missing: DenseMissing = field(default_factory=DenseMissing)

    def leaves(self) -> dict[str, tuple[str, object]]:
        """Dotted key → (declared type, value), for every knob."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if dataclasses.is_dataclass(v):
                out.update({f"{f.name}.{g.name}": (g.type, getattr(v, g.name)) for g in fields(v)})
            else:
                out[f.name] = (f.type, v)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> WorldConfig:
        """From ``asdict`` (a manifest's ``source.config``); unknown keys are ignored. A flat dict
        (manifests written before the config was nested) maps by field name: names are unique across
        the parts."""
        top = {"seed": 0, "structure_seed": 0, "family": 1}
        parts = {f.name: f.default_factory for f in fields(cls) if f.name not in top}
        flat = not any(isinstance(d.get(p), dict) for p in parts)
        given = {p: d if flat else d.get(p, {}) for p in parts}
        return cls(**{k: d.get(k, v) for k, v in top.items()},
                   **{p: kind(**{f.name: given[p][f.name] for f in fields(kind)
                                                               if f.name in given[p]}) for p,
                      kind in parts.items()})

    def validate(self) -> WorldConfig:
        leaves = self.leaves()

        def bad(name, why):
            raise ValueError(f"WorldConfig.{name} {why}, got {leaves[name][1]!r}")

        for name, (kind, v) in leaves.items():
            if kind in ("bool", bool):
                if not isinstance(v, bool):
                    bad(name, "must be bool")
                continue
            want = int if kind in ("int", int) else float
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or (want is int and not isinstance(v, int))
            ):
                bad(name, f"must be {want.__name__}")
            if not np.isfinite(v):
                bad(name, "must be finite")
        positive = ["sizes.num_users", "sizes.users_per_block", "sizes.num_days",
                    "sizes.num_categories", "sizes.num_segments", "sizes.num_content_items",
                    "sizes.num_advertisers", "sizes.num_campaigns",
                    "sizes.num_advertiser_clusters", "sizes.initial_ads", "sizes.latent_rank",
                    "behaviour.activity_median", "behaviour.max_events",
                    "behaviour.organic_max_len",
                    "behaviour.ads_max_len", "impressions.impressions_per_day",
                    "click.seq_tau_hours", "click.ads_tau_hours", "behaviour.segment_peaks",
                    "impressions.surface_concentration",
                    "behaviour.ads_max_events", "behaviour.ads_events_per_organic",
                    "impressions.position_decay",
                    "sizes.initial_ad_span_days", "impressions.retarget_recent"]
        for n in positive:
            if not leaves[n][1] > 0:
                bad(n, "must be > 0")
        for n, (kind, v) in leaves.items():
            if n not in positive and kind not in ("bool", bool) and v < 0:
                bad(n, "must be >= 0")
        for n in ("click.target_ctr", "conversion.target_cvr"):
            if not 0 < leaves[n][1] < 1:
                bad(n, "must be in (0, 1)")
        if self.family not in (1, 2):
            bad("family", "must be 1 or 2")
        if not 0 <= leaves["dense_missing.rate"][1] < 1:
            bad("dense_missing.rate", "must be in [0, 1)")
        for n in ("behaviour.conversion_event_prob", "impressions.campaign_main_category_prob",
                  "impressions.target_frac", "impressions.retarget_frac"):
            if not 0 <= leaves[n][1] <= 1:
                bad(n, "must be in [0, 1]")
        s, imp = self.sizes, self.impressions
        if imp.target_frac + imp.retarget_frac > 1:
            bad("impressions.retarget_frac",
                f"+ impressions.target_frac ({imp.target_frac}) must be <= 1")
        if (
            not self.surface_task.surface < len(SURFACES)
            or not 0 < self.surface_task.target_rate < 1
        ):
            bad("surface_task.surface",
                f"must be < {len(SURFACES)} with surface_task.target_rate in (0, 1)")
        if s.num_campaigns < s.num_advertisers:
            bad("sizes.num_campaigns", f"must be >= sizes.num_advertisers ({s.num_advertisers})")
        if s.num_content_items < s.num_categories:
            bad("sizes.num_content_items", f"must be >= sizes.num_categories ({s.num_categories})")
        if s.start_ts < s.history_days * DAY:
            bad("sizes.start_ts",
                "must be >= sizes.history_days * 86400 so that every timestamp is >= 0")
        if s.num_days < s.valid_days + s.test_days + 1:
            bad("sizes.num_days",
                f"must leave >= 1 train day after sizes.valid_days={s.valid_days} "
                                  f"and sizes.test_days={s.test_days}")
        return self


def build_schema(cfg: WorldConfig) -> FeatureSchema:
    sizes, beh = cfg.sizes, cfg.behaviour
    n_ads = sizes.initial_ads + sizes.new_ads_per_day * (sizes.num_days - 1)
    # No user_id feature: the world has no per-user effect outside the histories, and a 36k-row id
    # table seen a few times per row memorises them (docs/experiments.md, 'Figures moved from code
    # docstrings'). The column stays in every row (gAUC groups by it; real-data schemas may list it
    # as a feature).
    sparse = [SparseFeature("age", NUM_AGES, "user"),
              SparseFeature("gender", NUM_GENDERS, "user"),
              SparseFeature("country", NUM_COUNTRIES, "user"),
              SparseFeature("device", NUM_DEVICES, "user"),
              SparseFeature("segment", sizes.num_segments, "user"),
              SparseFeature("ad_id", n_ads, "ad"),
              SparseFeature("advertiser_id", sizes.num_advertisers, "ad"),
              SparseFeature("campaign_id", sizes.num_campaigns, "ad"),
              SparseFeature("category", sizes.num_categories, "ad"),
              SparseFeature("format", len(FORMATS), "ad"),
              SparseFeature("position", NUM_POSITIONS, "context"),
              SparseFeature("hour", NUM_HOURS, "context")]
    dense = [DenseFeature("user_activity", "user"), DenseFeature("ad_age", "ad"),
             DenseFeature("ad_quality", "ad"),
             DenseFeature("hour_sin", "context"), DenseFeature("hour_cos", "context")]
    if cfg.dense_missing.rate > 0:
        dense = [dataclasses.replace(f, missing="indicator") if f.name in MISSING_FEATURES else f
                 for f in dense]
    org_attrs, ads_attrs = {}, {}
    if beh.event_attributes:
        from opengem.features.schema import EventAttribute

        org_attrs = {"attributes": (EventAttribute("category", sizes.num_categories),)}
        ads_attrs = {"attributes": (EventAttribute("advertiser_id", sizes.num_advertisers),)}
    seqs = [SequenceStream("organic", sizes.num_content_items, len(ORGANIC_EVENTS),
                           beh.organic_max_len, **org_attrs),
            SequenceStream("ads", n_ads, len(ADS_EVENTS), beh.ads_max_len, **ads_attrs,
                           matches="ad_id" if beh.declare_ad_items else None)]
    tasks = [Task("click", "click", "p_click"),
             Task("conversion", "conversion", "p_conversion", requires="click")]
    embeddings = (
        (EmbeddingFeature("ad_content", cfg.click.content_dim, "ad"),)
        if cfg.click.content_dim
        else ()
    )
    if cfg.surface_task.enabled:
        tasks.append(Task(SURFACE_TASK, SURFACE_TASK, f"p_{SURFACE_TASK}"))
    return FeatureSchema(sparse=tuple(sparse), dense=tuple(dense), sequences=tuple(seqs),
                         tasks=tuple(tasks), domains=Domains(SURFACES, "domain"),
                         embeddings=embeddings,
                         meta={"source": "synthetic", "seed": cfg.seed, "formats": list(FORMATS),
                               "organic_events": list(ORGANIC_EVENTS),
                               "ads_events": list(ADS_EVENTS)})


def splits_for(cfg: WorldConfig) -> dict[str, list[int]]:
    sizes = cfg.sizes
    d = sizes.num_days
    return {"train": list(range(d - sizes.valid_days - sizes.test_days)),
            "valid": list(range(d - sizes.valid_days - sizes.test_days, d - sizes.test_days)),
            "test": list(range(d - sizes.test_days, d))}


# ------------------------------------------------------------------------------ impressions
def _impressions(world: World, ub: UserBlock, day: int, block: int) -> dict:
    """Rows of one (block, day), as column arrays in their final dtypes (lists:
    (values, lengths))."""
    cfg = world.cfg
    beh, imp = cfg.behaviour, cfg.impressions
    rng = rng_for(cfg.seed, TAG_DAY, block, day)
    n_per = rng.poisson(ub.impression_rate)
    user = np.repeat(np.arange(ub.n, dtype=np.int64), n_per)
    t = day * DAY + rng.integers(0, DAY, len(user))
    order = np.lexsort((user, t))
    user, t = user[order], t[order]
    n = len(user)
    r = rng.random((6, n))  # every row draws the same uniforms, whatever branch it takes

    surface = (r[0] > ub.surface_cum[user, 0]).astype(np.int64) + (r[0] > ub.surface_cum[user, 1])
    pos_p = imp.position_decay ** np.arange(NUM_POSITIONS)
    position = np.searchsorted(np.cumsum(pos_p / pos_p.sum())[:-1], r[1],
                               side="right").astype(np.int64)
    n_org, org_lo, org_len = ub.history("organic", user, t, beh.organic_max_len)
    n_ads, ads_lo, ads_len = ub.history("ads", user, t, beh.ads_max_len)

    # Ad choice: targeted (interest category that day), retargeted (stored ads history), random.
    cat = ub.interest.sample(user * world.window_days + (day + cfg.sizes.history_days), r[2])
    ad = world.sample_live_ads(cat, t, r[3])
    recent = np.minimum(ads_len, imp.retarget_recent)  # retarget one of the most recent engagements
    j = ads_lo + ads_len - 1 - np.minimum((r[4] * recent).astype(np.int64),
                                          np.maximum(recent - 1, 0))
    if len(ub.ads_item):
        adv = world.ad_advertiser[ub.ads_item[np.clip(j, 0, len(ub.ads_item) - 1)]]
    else:
        adv = np.zeros(n, dtype=np.int64)
    re_ad, re_ok = world.live_by_advertiser.sample(adv, t, r[3])
    rand_ad, _ = world.live_any.sample(np.zeros(n, dtype=np.int64), t, r[3])
    mode = r[5]
    retarget = (
        (mode >= imp.target_frac)
        & (mode < imp.target_frac + imp.retarget_frac)
        & (ads_len > 0)
        & re_ok
    )
    rand = mode >= imp.target_frac + imp.retarget_frac
    ad = np.where(retarget, re_ad, np.where(rand, rand_ad, ad))

    sec = t % DAY
    ang = 2 * np.pi * sec / DAY
    age_days = (t - world.ad_launch[ad]) / DAY
    act_mu, act_sd = np.log1p(beh.activity_median * cfg.sizes.history_days), beh.activity_sigma
    oi, ai = ranges(org_lo, org_len), ranges(ads_lo, ads_len)
    gu = ub.first + user
    c = {
        "user_id": gu, "request_ts": cfg.sizes.start_ts + t, "day": np.full(n, day, dtype=np.int32),
        "domain": surface, "age": ub.age[user], "gender": ub.gender[user],
        "country": ub.country[user], "device": ub.device[user],
        "segment": ub.segment[user], "ad_id": ad, "advertiser_id": world.ad_advertiser[ad],
        "campaign_id": world.ad_campaign[ad], "category": world.ad_category[ad],
        "format": world.ad_format[ad], "position": position, "hour": sec // 3600,
        "user_activity": ((np.log1p(n_org) - act_mu) / act_sd).astype(np.float32),
        "ad_age": np.log1p(age_days).astype(np.float32),
        "ad_quality": world.ad_quality_observed[ad],
        "hour_sin": np.sin(ang).astype(np.float32), "hour_cos": np.cos(ang).astype(np.float32),
        "organic.item": (ub.org_item[oi], org_len), "organic.event": (ub.org_event[oi], org_len),
        "organic.ts": (cfg.sizes.start_ts + ub.org_ts[oi], org_len),
        "ads.item": (ub.ads_item[ai], ads_len), "ads.event": (ub.ads_event[ai], ads_len),
        "ads.ts": (cfg.sizes.start_ts + ub.ads_ts[ai], ads_len),
    }
    if beh.event_attributes:
        c["organic.category"] = (world.item_category[c["organic.item"][0]], org_len)
        c["ads.advertiser_id"] = (world.ad_advertiser[c["ads.item"][0]], ads_len)
    for k, v in c.items():  # ids int64 everywhere (the reserved day column is int32)
        if isinstance(v, tuple):
            c[k] = (v[0].astype(np.int64, copy=False), v[1].astype(np.int64, copy=False))
        elif k != "day" and v.dtype.kind in "iu":
            c[k] = v.astype(np.int64, copy=False)
    # after the int64 pass: float vectors, (flat values, lengths) as lists are
    if world.ad_content is not None:
        k = world.ad_content.shape[1]
        c["ad_content"] = (world.ad_content[ad].reshape(-1), np.full(n, k, dtype=np.int64))
    u = rng.random((2, n))  # label draws, used once the intercepts are known
    c["_u_click"], c["_u_conv"], c["_n_organic"], c["_n_ads"] = u[0], u[1], n_org, n_ads
    return c


def _table(schema: FeatureSchema, c: dict, p_click, p_cvr) -> pa.Table:
    click = c["_u_click"] < p_click
    conv = click & (c["_u_conv"] < p_cvr)
    out = {}
    labels = {t.label_column for t in schema.tasks}
    for name in (col for col in schema.columns(with_probs=False) if col not in labels):
        v = c[name]
        out[name] = list_array(*v) if isinstance(v, tuple) else pa.array(v)
    out.update(click=pa.array(click.astype(np.int8)), conversion=pa.array(conv.astype(np.int8)),
               p_click=pa.array(p_click), p_conversion=pa.array(p_click * p_cvr))
    out.update({k: pa.array(v) for k, v in c.get("_surface_task", {}).items()})
    return pa.table(out)


# ------------------------------------------------------------------------------ statistics
class _Stats:
    def __init__(self, cfg: WorldConfig, world: World):
        self.split_of = {d: s for s, days in splits_for(cfg).items() for d in days}
        self.last_train_day = max(splits_for(cfg)["train"])
        self.world = world
        self.acc: dict[str, np.ndarray] = {}
        self.len_hist = {"organic": np.zeros(cfg.behaviour.organic_max_len + 1, np.int64),
                         "ads": np.zeros(cfg.behaviour.ads_max_len + 1, np.int64)}
        self.truncated = {"organic": 0, "ads": 0}
        self.terms: dict[str, dict[str, np.ndarray]] = {"click": {}, "conversion": {}}

    def add(self, day, c, table, ct, vt):
        s = self.split_of[day]
        pc, pv = table["p_click"].to_numpy(), table["p_conversion"].to_numpy()
        yc, yv = (
            table["click"].to_numpy().astype(np.float64),
            table["conversion"].to_numpy().astype(np.float64),
        )
        new = (self.world.ad_launch_day[c["ad_id"]] > self.last_train_day).astype(np.float64)
        vals = [len(pc), pc.sum(), yc.sum(), pv.sum(), yv.sum(), _xent(pc, yc).sum(),
                _xent(pv, yv).sum(), _xent(pc, pc).sum(), _xent(pv, pv).sum(), new.sum()]
        self.acc[s] = self.acc.get(s, np.zeros(len(vals))) + np.array(vals, dtype=np.float64)
        for st in ("organic", "ads"):
            lens = c[f"{st}.item"][1]
            self.len_hist[st] += np.bincount(lens, minlength=len(self.len_hist[st]))
            self.truncated[st] += int((c[f"_n_{st}"] > lens).sum())
        for kind, terms in (("click", ct), ("conversion", vt)):
            terms = {**terms, "_total": sum(terms.values())}
            for k, v in terms.items():
                v = np.broadcast_to(v, (len(pc),)).astype(np.float64)
                a = self.terms[kind].setdefault(k, np.zeros(3))
                a += [len(v), v.sum(), (v * v).sum()]

    def result(self, world: World) -> dict:
        out: dict = {"rows": {}, "ctr": {}, "p_click_mean": {}, "cvr": {}, "p_cvr_mean": {},
                     "bayes_ne": {}, "bayes_ne_expected": {}, "new_ad_row_share": {}}
        total = sum(self.acc.values())
        for s, a in [*sorted(self.acc.items()), ("all", total)]:
            n, spc, syc, spv, syv, xc, xv, hc, hv, new = a
            out["rows"][s] = int(n)
            out["ctr"][s], out["p_click_mean"][s] = syc / n, spc / n
            out["cvr"][s], out["p_cvr_mean"][s] = syv / max(syc, 1), spv / spc
            out["bayes_ne"][s] = {"click": xc / n / _h(syc / n), "conversion": xv / n / _h(syv / n)}
            out["bayes_ne_expected"][s] = {"click": hc / n / _h(spc / n),
                                           "conversion": hv / n / _h(spv / n)}
            out["new_ad_row_share"][s] = new / n
        out["seq_len"] = {}
        for st, h in self.len_hist.items():
            cdf = np.cumsum(h) / max(h.sum(), 1)
            out["seq_len"][st] = {"mean": float((h * np.arange(len(h))).sum() / max(h.sum(), 1)),
                                  "median": int(np.searchsorted(cdf, 0.5)),
                                  "p99": int(np.searchsorted(cdf, 0.99)),
                                  "max": int(np.nonzero(h)[0].max()) if h.any() else 0,
                                  "truncated_rows": self.truncated[st]}
        for kind in ("click", "conversion"):
            var = {k: a[2] / a[0] - (a[1] / a[0]) ** 2 for k, a in self.terms[kind].items()}
            tot = var.pop("_total")
            out[f"{kind}_logit_var"] = tot
            out[f"{kind}_logit_var_share"] = {k: v / tot for k, v in var.items()}
        out = _plain(out)
        # exact: JSON floats round-trip
        out["calibration"] = {"b0": float(world.b0), "c0": float(world.c0)}
        return out


def _xent(p, y):
    p = np.clip(p, 1e-15, 1 - 1e-15)
    return -(y * np.log(p) + (1 - y) * np.log1p(-p))


def _h(q):
    return float(_xent(np.array([q]), np.array([q]))[0]) if 0 < q < 1 else float("nan")


def _plain(x):
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (np.floating, float)):
        return round(float(x), 6) if np.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    return x


# ------------------------------------------------------------------------------ generate
class ShardObserver(Protocol):
    """Sees each shard as ``generate`` writes it (``add``); ``result()`` goes into the manifest's
    ``source.stats[stats_key]``. The oracle is one: it collects its inputs without reading
    shards back."""

    stats_key: str

    def add(self, day: int, columns: dict) -> None: ...

    def result(self) -> dict: ...


def generate(cfg: WorldConfig, out_dir: str | Path, progress: bool = True,
             observer: Callable[[World, dict[int, str]], ShardObserver] | None = None,
             layout: str = "v1") -> DatasetManifest:
    """Write the world's shards, schema and manifest into ``out_dir``; one block of users at a time.

    ``observer(world, split_of_day)`` builds a ``ShardObserver`` that sees every shard's columns as
    it is written; its ``result()`` is stored in ``source.stats[observer.stats_key]``. The CLI
    passes the world's oracle (``opengem.world.oracle.OracleCollector``): the data layer names
    no model.

    ``layout="v2"`` (``opengem.data.events``) writes each user block's event streams once, as bucket
    ``block`` of each stream's log, and impression shards without history columns; the rows, draws,
    statistics and oracle are those of v1. The generator writes v2 itself, rather than a v1 → v2
    converter, because it holds the true event log: a converter must rebuild logs from truncated
    per-row copies, which lose events no row kept and events after a user's last impression."""
    cfg.validate()
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    schema = build_schema(cfg)
    world = World(cfg)
    n_blocks = -(-cfg.sizes.num_users // cfg.sizes.users_per_block)

    # Calibrate the intercepts on all rows of block 0 (its rows are regenerated,
    # bit-identical, below).
    ub = UserBlock(world, 0)
    z, zc, surf = [], [], []
    for d in range(cfg.sizes.num_days):
        c = _impressions(world, ub, d, 0)
        _, _, ct, vt = probabilities(world, c, b0=0.0, c0=0.0)
        z.append(sum(ct.values()))
        zc.append(sum(vt.values()))
        if cfg.surface_task.enabled:
            surf.append((c, ct))
    z, zc = np.concatenate(z), np.concatenate(zc)
    if len(z) == 0:
        raise ValueError("block 0 has no impressions to calibrate on; raise sizes.num_users or "
                         "impressions.impressions_per_day")
    world.b0 = solve_intercept(z, cfg.click.target_ctr)
    world.c0 = solve_intercept(zc, cfg.conversion.target_cvr, weights=sigmoid(world.b0 + z))
    world.e0 = solve_surface_intercept(world, surf) if cfg.surface_task.enabled else None
    del z, zc, surf

    writer = ShardWriter(out_dir, schema, layout=LAYOUTS[layout])
    histories = sorted(stream_columns(schema))
    stats = _Stats(cfg, world)
    watcher = observer(world, stats.split_of) if observer is not None else None
    blocks = range(n_blocks)
    if progress:
        from opengem.progress import progress_bar

        blocks = progress_bar(blocks, desc="synthetic blocks", unit="block")
    for b in blocks:
        if b > 0:
            ub = UserBlock(world, b)
        if writer.layout == LAYOUT_V2:
            for stream, table in _event_logs(world, ub).items():
                writer.write_events(stream, b, table)
        for d in range(cfg.sizes.num_days):
            c = _impressions(world, ub, d, b)
            p_click, p_cvr, ct, vt = probabilities(world, c)
            if cfg.surface_task.enabled:
                c["_surface_task"] = surface_task_columns(world, c, ct, b, d)
            table = _table(schema, c, p_click, p_cvr)
            stats.add(d, c, table, ct, vt)
            # after the statistics: they describe the world, not the log
            table = blank_dense(world, table, b, d)
            if writer.layout == LAYOUT_V2:
                writer.write(table.drop_columns(histories), f"d{d:03d}-b{b:05d}", d, bucket=b)
            else:
                writer.write(table, f"d{d:03d}-b{b:05d}", d)
            if watcher is not None:
                watcher.add(d, columns_from_table(table))  # what the shard holds, nothing more
        del ub
    result = stats.result(world)
    if world.e0 is not None:
        result["calibration"]["e0"] = float(world.e0)
    if watcher is not None:
        result[watcher.stats_key] = _plain(watcher.result())
    return writer.close(splits_for(cfg),
                        source={"kind": "synthetic", "config": manifest_config(cfg),
                                                 "structure": world.structure.to_dict(),
                                "stats": result})


def manifest_config(cfg: WorldConfig) -> dict:
    """``asdict(cfg)`` as the manifest stores it: the content-vector keys, the surface task and the
    other options below only when they are on, so a world without them writes the manifest it
    always did (``from_dict`` fills in the defaults)."""
    d = asdict(cfg)
    if not cfg.click.content_dim:
        for k in ("content_dim", "content_sigma"):
            d["click"].pop(k)
    if not cfg.surface_task.enabled:
        del d["surface_task"]
    if not cfg.dense_missing.rate > 0:
        del d["dense_missing"]
    if cfg.family == 1:
        del d["family"]
    if not cfg.behaviour.declare_ad_items:
        del d["behaviour"]["declare_ad_items"]
    return d


def _event_logs(world: World, ub: UserBlock) -> dict[str, pa.Table]:
    """The block's two streams as v2 event logs (``opengem.data.events``): every event of the window
    once, sorted by (user, ts) as ``UserBlock`` holds them, with the attributes v1 rows carry."""
    start = world.cfg.sizes.start_ts
    out = {}
    for stream, off, item, event, ts in (("organic", ub.org_off, ub.org_item, ub.org_event,
                                          ub.org_ts),
                                          ("ads", ub.ads_off, ub.ads_item, ub.ads_event,
                                           ub.ads_ts)):
        user = ub.first + np.repeat(np.arange(ub.n, dtype=np.int64), np.diff(off))
        cols = {"user_id": user, "ts": start + ts, "item": item, "event": event}
        if world.cfg.behaviour.event_attributes:
            if stream == "organic":
                cols["category"] = world.item_category[item]
            else:
                cols["advertiser_id"] = world.ad_advertiser[item]
        out[stream] = pa.table({k: pa.array(np.asarray(v).astype(np.int64, copy=False)) for k,
                                v in cols.items()})
    return out


def world_from_manifest(manifest: DatasetManifest) -> World:
    """The calibrated ``World`` a synthetic dataset was generated from (for exact decompositions),
    with the structure its manifest stores (a manifest without one predates the family: structure
    seed 0)."""
    src = manifest.source
    if src.get("kind") != "synthetic":
        raise ValueError("not a synthetic dataset (manifest source kind is not 'synthetic')")
    structure = WorldStructure.from_dict(src["structure"]) if "structure" in src else None
    world = World(WorldConfig.from_dict(src["config"]), structure)
    world.b0, world.c0 = src["stats"]["calibration"]["b0"], src["stats"]["calibration"]["c0"]
    return world


def columns_from_table(table: pa.Table) -> dict:
    """A shard's columns as numpy (list columns as (flat values, lengths)),
    for ``probabilities``."""
    out = {}
    for name in table.column_names:
        col = table.column(name).combine_chunks()
        if pa.types.is_list(col.type):
            off = col.offsets.to_numpy().astype(np.int64)
            out[name] = (col.values.to_numpy()[off[0]:off[-1]], np.diff(off))
        else:
            out[name] = col.to_numpy()
    return out
