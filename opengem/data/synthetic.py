"""The embedded synthetic ads world: impressions whose TRUE click / conversion probabilities are
stored next to their labels, so the Bayes-optimal normalized entropy of any split is exact.

Generative process (latent parts in ``opengem.data.synthetic_world``; every knob is a
``WorldConfig`` field; times are seconds, day 0 starts at ``cfg.start_ts``):

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

Everything the true models read is in the row: ``synthetic_world.probabilities(world, cols)``
recomputes the probability columns from a shard (``columns_from_table``) and the calibrated world
(``world_from_manifest``). Shards: one per (user block, day), ``d{day:03d}-b{block:05d}``, rows in
time order; output is bit-reproducible for a seed. The manifest's ``source.stats`` holds rows,
CTR/CVR (observed and true means), Bayes NE per split (``bayes_ne``: the true probabilities'
log loss on the drawn labels over the entropy of the split's own label rate;
``bayes_ne_expected``: the same in expectation), the share of rows showing ads launched after the
last train day, stored sequence-length quantiles, the share of the logit variance of each term
(Var(term) / Var(logit); covariances make them not sum to 1) and the calibrated intercepts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import pyarrow as pa

from opengem.data.parquet import DatasetManifest, ShardWriter, list_array
from opengem.data.synthetic_world import (
    DAY, FORMATS, NUM_AGES, NUM_COUNTRIES, NUM_DEVICES, NUM_GENDERS, NUM_HOURS, NUM_POSITIONS, ORGANIC_EVENTS,
    ADS_EVENTS, SURFACES, TAG_DAY, UserBlock, World, probabilities, ranges, rng_for, sigmoid, solve_intercept,
)
from opengem.features.schema import DenseFeature, Domains, FeatureSchema, SequenceStream, SparseFeature, Task


@dataclass
class WorldConfig:
    """All knobs of the synthetic world (defaults = the ``demo`` preset)."""

    seed: int = 0
    # --- sizes and time
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
    initial_ad_span_days: int = 60  # initial ads launch uniformly over this many days before the window
    latent_rank: int = 4  # rank of the interaction factors
    # --- users and behaviour
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
    # --- impressions
    impressions_per_day: float = 2.3  # mean per user per day
    impression_activity_exp: float = 0.25  # rate ∝ activity^exp (normalised)
    surface_concentration: float = 3.0  # Dirichlet concentration of the per-user surface preference
    target_frac: float = 0.55  # share of impressions targeted to the user's interest
    retarget_frac: float = 0.15  # share retargeting an advertiser from the ads history
    retarget_recent: int = 3  # ... drawn from the user's most recent stored ads engagements
    position_decay: float = 0.6  # P(position = k) ∝ decay^k, k in 0..7
    campaign_main_category_prob: float = 0.85
    # --- click model
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
    # --- conversion model (given click)
    target_cvr: float = 0.08
    cvr_advertiser_sigma: float = 0.6
    cvr_beta_segment_category: float = 0.5
    cvr_beta_seq: float = 1.5
    cvr_beta_surface: float = 1.0

    def validate(self) -> "WorldConfig":
        def bad(name, why):
            raise ValueError(f"WorldConfig.{name} {why}, got {getattr(self, name)!r}")

        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("bool", bool):
                if not isinstance(v, bool):
                    bad(f.name, "must be bool")
                continue
            want = int if f.type in ("int", int) else float
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (want is int and not isinstance(v, int)):
                bad(f.name, f"must be {want.__name__}")
            if not np.isfinite(v):
                bad(f.name, "must be finite")
        positive = ["num_users", "users_per_block", "num_days", "num_categories", "num_segments",
                    "num_content_items", "num_advertisers", "num_campaigns", "num_advertiser_clusters",
                    "initial_ads", "latent_rank", "activity_median", "max_events", "organic_max_len",
                    "ads_max_len", "impressions_per_day", "seq_tau_hours", "ads_tau_hours", "segment_peaks",
                    "surface_concentration", "ads_max_events", "ads_events_per_organic", "position_decay",
                    "initial_ad_span_days", "retarget_recent"]
        for n in positive:
            if not getattr(self, n) > 0:
                bad(n, "must be > 0")
        for f in fields(self):
            if f.name not in positive and f.type not in ("bool", bool) and getattr(self, f.name) < 0:
                bad(f.name, "must be >= 0")
        for n in ("target_ctr", "target_cvr"):
            if not 0 < getattr(self, n) < 1:
                bad(n, "must be in (0, 1)")
        for n in ("conversion_event_prob", "campaign_main_category_prob", "target_frac", "retarget_frac"):
            if not 0 <= getattr(self, n) <= 1:
                bad(n, "must be in [0, 1]")
        if self.target_frac + self.retarget_frac > 1:
            bad("retarget_frac", f"+ target_frac ({self.target_frac}) must be <= 1")
        if self.num_campaigns < self.num_advertisers:
            bad("num_campaigns", f"must be >= num_advertisers ({self.num_advertisers})")
        if self.num_content_items < self.num_categories:
            bad("num_content_items", f"must be >= num_categories ({self.num_categories})")
        if self.start_ts < self.history_days * DAY:
            bad("start_ts", "must be >= history_days * 86400 so that every timestamp is >= 0")
        if self.num_days < self.valid_days + self.test_days + 1:
            bad("num_days", f"must leave >= 1 train day after valid_days={self.valid_days} "
                            f"and test_days={self.test_days}")
        return self


def _preset(**kw) -> Callable[[], WorldConfig]:
    return lambda: WorldConfig(**kw)


PRESETS: dict[str, Callable[[], WorldConfig]] = {
    # ~4k rows in a fraction of a second: tests and smoke runs
    "tiny": _preset(num_users=400, users_per_block=160, num_days=4, history_days=14, num_categories=16,
                    num_segments=8, num_content_items=1500, num_advertisers=30, num_campaigns=90,
                    initial_ads=300, new_ads_per_day=30, initial_ad_span_days=30, latent_rank=4,
                    max_events=300, ads_max_events=60, impressions_per_day=2.5),
    # ~660k rows: the demo trains on days 0-5, validates on day 6, tests on day 7
    "demo": _preset(),
    # ~2.6M rows
    "small": _preset(num_users=115000, num_days=10, num_categories=64, num_segments=48,
                     num_content_items=20000, num_advertisers=600, num_campaigns=2000, initial_ads=4000,
                     new_ads_per_day=300, latent_rank=6),
    # ~23M rows, streamed block by block
    "large": _preset(num_users=1000000, num_days=10, num_categories=128, num_segments=64,
                     num_content_items=100000, num_advertisers=2000, num_campaigns=8000, initial_ads=16000,
                     new_ads_per_day=1200, latent_rank=8),
}


def world_config(preset: str, seed: int | None = None, **overrides) -> WorldConfig:
    """A preset's config with ``seed`` and field overrides applied, validated. String override
    values (from a command line) are parsed as the field's type."""
    if preset not in PRESETS:
        raise ValueError(f"unknown synthetic preset {preset!r}; choose from {sorted(PRESETS)}")
    names = {f.name for f in fields(WorldConfig)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(f"unknown WorldConfig keys {unknown}; valid keys: {sorted(names)}")
    cfg = PRESETS[preset]()
    types = {f.name: f.type for f in fields(WorldConfig)}
    overrides = {k: _parse(k, v, types[k]) if isinstance(v, str) else v for k, v in overrides.items()}
    if seed is not None:
        overrides["seed"] = seed
    return dataclasses.replace(cfg, **overrides).validate()


def _parse(key: str, text: str, kind) -> int | float | bool:
    """A command-line override value (``num_users=5000``) as the field's type."""
    kind = getattr(kind, "__name__", kind)
    try:
        if kind == "bool":
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return text.lower() in ("true", "1", "yes")
        if kind == "int":
            v = float(text)
            if not v.is_integer():
                raise ValueError
            return int(text) if text.lstrip("+-").isdigit() else int(v)
        return float(text)
    except ValueError:
        raise ValueError(f"WorldConfig.{key}: cannot parse {text!r} as {kind}") from None


def build_schema(cfg: WorldConfig) -> FeatureSchema:
    n_ads = cfg.initial_ads + cfg.new_ads_per_day * (cfg.num_days - 1)
    # No user_id feature: the world has no per-user effect outside the histories, and a 36k-row id table
    # seen ~14 times per row memorises (measured: a probe collapsed in its 2nd epoch with it, not without).
    # The column stays in every row (gAUC groups by it; real-data schemas may list it as a feature).
    sparse = [SparseFeature("age", NUM_AGES, "user"),
              SparseFeature("gender", NUM_GENDERS, "user"), SparseFeature("country", NUM_COUNTRIES, "user"),
              SparseFeature("device", NUM_DEVICES, "user"), SparseFeature("segment", cfg.num_segments, "user"),
              SparseFeature("ad_id", n_ads, "ad"), SparseFeature("advertiser_id", cfg.num_advertisers, "ad"),
              SparseFeature("campaign_id", cfg.num_campaigns, "ad"),
              SparseFeature("category", cfg.num_categories, "ad"), SparseFeature("format", len(FORMATS), "ad"),
              SparseFeature("position", NUM_POSITIONS, "context"), SparseFeature("hour", NUM_HOURS, "context")]
    dense = [DenseFeature("user_activity", "user"), DenseFeature("ad_age", "ad"), DenseFeature("ad_quality", "ad"),
             DenseFeature("hour_sin", "context"), DenseFeature("hour_cos", "context")]
    org_attrs, ads_attrs = {}, {}
    if cfg.event_attributes:
        from opengem.features.schema import EventAttribute

        org_attrs = {"attributes": (EventAttribute("category", cfg.num_categories),)}
        ads_attrs = {"attributes": (EventAttribute("advertiser_id", cfg.num_advertisers),)}
    seqs = [SequenceStream("organic", cfg.num_content_items, len(ORGANIC_EVENTS), cfg.organic_max_len, **org_attrs),
            SequenceStream("ads", n_ads, len(ADS_EVENTS), cfg.ads_max_len, **ads_attrs)]
    tasks = [Task("click", "click", "p_click"), Task("conversion", "conversion", "p_conversion", requires="click")]
    return FeatureSchema(sparse=tuple(sparse), dense=tuple(dense), sequences=tuple(seqs), tasks=tuple(tasks),
                         domains=Domains(SURFACES, "domain"),
                         meta={"source": "synthetic", "seed": cfg.seed, "formats": list(FORMATS),
                               "organic_events": list(ORGANIC_EVENTS), "ads_events": list(ADS_EVENTS)})


def splits_for(cfg: WorldConfig) -> dict[str, list[int]]:
    d = cfg.num_days
    return {"train": list(range(d - cfg.valid_days - cfg.test_days)),
            "valid": list(range(d - cfg.valid_days - cfg.test_days, d - cfg.test_days)),
            "test": list(range(d - cfg.test_days, d))}


# ------------------------------------------------------------------------------ impressions
def _impressions(world: World, ub: UserBlock, day: int, block: int) -> dict:
    """Rows of one (block, day), as column arrays in their final dtypes (lists: (values, lengths))."""
    cfg = world.cfg
    rng = rng_for(cfg.seed, TAG_DAY, block, day)
    n_per = rng.poisson(ub.impression_rate)
    user = np.repeat(np.arange(ub.n, dtype=np.int64), n_per)
    t = day * DAY + rng.integers(0, DAY, len(user))
    order = np.lexsort((user, t))
    user, t = user[order], t[order]
    n = len(user)
    r = rng.random((6, n))  # every row draws the same uniforms, whatever branch it takes

    surface = (r[0] > ub.surface_cum[user, 0]).astype(np.int64) + (r[0] > ub.surface_cum[user, 1])
    pos_p = cfg.position_decay ** np.arange(NUM_POSITIONS)
    position = np.searchsorted(np.cumsum(pos_p / pos_p.sum())[:-1], r[1], side="right").astype(np.int64)
    n_org, org_lo, org_len = ub.history("organic", user, t, cfg.organic_max_len)
    n_ads, ads_lo, ads_len = ub.history("ads", user, t, cfg.ads_max_len)

    # Ad choice: targeted (interest category that day), retargeted (stored ads history), random.
    cat = ub.interest.sample(user * world.window_days + (day + cfg.history_days), r[2])
    ad = world.sample_live_ads(cat, t, r[3])
    recent = np.minimum(ads_len, cfg.retarget_recent)  # retarget one of the most recent engagements
    j = ads_lo + ads_len - 1 - np.minimum((r[4] * recent).astype(np.int64), np.maximum(recent - 1, 0))
    if len(ub.ads_item):
        adv = world.ad_advertiser[ub.ads_item[np.clip(j, 0, len(ub.ads_item) - 1)]]
    else:
        adv = np.zeros(n, dtype=np.int64)
    re_ad, re_ok = world.live_by_advertiser.sample(adv, t, r[3])
    rand_ad, _ = world.live_any.sample(np.zeros(n, dtype=np.int64), t, r[3])
    mode = r[5]
    retarget = (mode >= cfg.target_frac) & (mode < cfg.target_frac + cfg.retarget_frac) & (ads_len > 0) & re_ok
    rand = mode >= cfg.target_frac + cfg.retarget_frac
    ad = np.where(retarget, re_ad, np.where(rand, rand_ad, ad))

    sec = t % DAY
    ang = 2 * np.pi * sec / DAY
    age_days = (t - world.ad_launch[ad]) / DAY
    act_mu, act_sd = np.log1p(cfg.activity_median * cfg.history_days), cfg.activity_sigma
    oi, ai = ranges(org_lo, org_len), ranges(ads_lo, ads_len)
    gu = ub.first + user
    c = {
        "user_id": gu, "request_ts": cfg.start_ts + t, "day": np.full(n, day, dtype=np.int32), "domain": surface,
        "age": ub.age[user], "gender": ub.gender[user], "country": ub.country[user], "device": ub.device[user],
        "segment": ub.segment[user], "ad_id": ad, "advertiser_id": world.ad_advertiser[ad],
        "campaign_id": world.ad_campaign[ad], "category": world.ad_category[ad], "format": world.ad_format[ad],
        "position": position, "hour": sec // 3600,
        "user_activity": ((np.log1p(n_org) - act_mu) / act_sd).astype(np.float32),
        "ad_age": np.log1p(age_days).astype(np.float32),
        "ad_quality": world.ad_quality_observed[ad],
        "hour_sin": np.sin(ang).astype(np.float32), "hour_cos": np.cos(ang).astype(np.float32),
        "organic.item": (ub.org_item[oi], org_len), "organic.event": (ub.org_event[oi], org_len),
        "organic.ts": (cfg.start_ts + ub.org_ts[oi], org_len),
        "ads.item": (ub.ads_item[ai], ads_len), "ads.event": (ub.ads_event[ai], ads_len),
        "ads.ts": (cfg.start_ts + ub.ads_ts[ai], ads_len),
    }
    if cfg.event_attributes:
        c["organic.category"] = (world.item_category[c["organic.item"][0]], org_len)
        c["ads.advertiser_id"] = (world.ad_advertiser[c["ads.item"][0]], ads_len)
    for k, v in c.items():  # ids int64 everywhere (the reserved day column is int32)
        if isinstance(v, tuple):
            c[k] = (v[0].astype(np.int64, copy=False), v[1].astype(np.int64, copy=False))
        elif k != "day" and v.dtype.kind in "iu":
            c[k] = v.astype(np.int64, copy=False)
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
    return pa.table(out)


# ------------------------------------------------------------------------------ statistics
class _Stats:
    def __init__(self, cfg: WorldConfig, world: World):
        self.split_of = {d: s for s, days in splits_for(cfg).items() for d in days}
        self.last_train_day = max(splits_for(cfg)["train"])
        self.world = world
        self.acc: dict[str, np.ndarray] = {}
        self.len_hist = {"organic": np.zeros(cfg.organic_max_len + 1, np.int64),
                         "ads": np.zeros(cfg.ads_max_len + 1, np.int64)}
        self.truncated = {"organic": 0, "ads": 0}
        self.terms: dict[str, dict[str, np.ndarray]] = {"click": {}, "conversion": {}}

    def add(self, day, c, table, ct, vt):
        s = self.split_of[day]
        pc, pv = table["p_click"].to_numpy(), table["p_conversion"].to_numpy()
        yc, yv = table["click"].to_numpy().astype(np.float64), table["conversion"].to_numpy().astype(np.float64)
        new = (self.world.ad_launch_day[c["ad_id"]] > self.last_train_day).astype(np.float64)
        vals = [len(pc), pc.sum(), yc.sum(), pv.sum(), yv.sum(), _xent(pc, yc).sum(), _xent(pv, yv).sum(),
                _xent(pc, pc).sum(), _xent(pv, pv).sum(), new.sum()]
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
        out: dict = {"rows": {}, "ctr": {}, "p_click_mean": {}, "cvr": {}, "p_cvr_mean": {}, "bayes_ne": {},
                     "bayes_ne_expected": {}, "new_ad_row_share": {}}
        total = sum(self.acc.values())
        for s, a in [*sorted(self.acc.items()), ("all", total)]:
            n, spc, syc, spv, syv, xc, xv, hc, hv, new = a
            out["rows"][s] = int(n)
            out["ctr"][s], out["p_click_mean"][s] = syc / n, spc / n
            out["cvr"][s], out["p_cvr_mean"][s] = syv / max(syc, 1), spv / spc
            out["bayes_ne"][s] = {"click": xc / n / _h(syc / n), "conversion": xv / n / _h(syv / n)}
            out["bayes_ne_expected"][s] = {"click": hc / n / _h(spc / n), "conversion": hv / n / _h(spv / n)}
            out["new_ad_row_share"][s] = new / n
        out["seq_len"] = {}
        for st, h in self.len_hist.items():
            cdf = np.cumsum(h) / max(h.sum(), 1)
            out["seq_len"][st] = {"mean": float((h * np.arange(len(h))).sum() / max(h.sum(), 1)),
                                  "median": int(np.searchsorted(cdf, 0.5)), "p99": int(np.searchsorted(cdf, 0.99)),
                                  "max": int(np.nonzero(h)[0].max()) if h.any() else 0,
                                  "truncated_rows": self.truncated[st]}
        for kind in ("click", "conversion"):
            var = {k: a[2] / a[0] - (a[1] / a[0]) ** 2 for k, a in self.terms[kind].items()}
            tot = var.pop("_total")
            out[f"{kind}_logit_var"] = tot
            out[f"{kind}_logit_var_share"] = {k: v / tot for k, v in var.items()}
        out = _plain(out)
        out["calibration"] = {"b0": float(world.b0), "c0": float(world.c0)}  # exact: JSON floats round-trip
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
def generate(cfg: WorldConfig, out_dir: str | Path, progress: bool = True) -> DatasetManifest:
    """Write the world's shards, schema and manifest into ``out_dir``; one block of users at a time."""
    cfg.validate()
    schema = build_schema(cfg)
    world = World(cfg)
    n_blocks = -(-cfg.num_users // cfg.users_per_block)

    # Calibrate the intercepts on all rows of block 0 (its rows are regenerated, bit-identical, below).
    ub = UserBlock(world, 0)
    z, zc = [], []
    for d in range(cfg.num_days):
        _, _, ct, vt = probabilities(world, _impressions(world, ub, d, 0), b0=0.0, c0=0.0)
        z.append(sum(ct.values()))
        zc.append(sum(vt.values()))
    z, zc = np.concatenate(z), np.concatenate(zc)
    if len(z) == 0:
        raise ValueError("block 0 has no impressions to calibrate on; raise num_users or impressions_per_day")
    world.b0 = solve_intercept(z, cfg.target_ctr)
    world.c0 = solve_intercept(zc, cfg.target_cvr, weights=sigmoid(world.b0 + z))
    del z, zc

    writer = ShardWriter(out_dir, schema)
    stats = _Stats(cfg, world)
    blocks = range(n_blocks)
    if progress:
        from tqdm import tqdm

        blocks = tqdm(blocks, desc="synthetic blocks", unit="block")
    for b in blocks:
        if b > 0:
            ub = UserBlock(world, b)
        for d in range(cfg.num_days):
            c = _impressions(world, ub, d, b)
            p_click, p_cvr, ct, vt = probabilities(world, c)
            table = _table(schema, c, p_click, p_cvr)
            stats.add(d, c, table, ct, vt)
            writer.write(table, f"d{d:03d}-b{b:05d}", d)
        del ub
    return writer.close(splits_for(cfg), source={"kind": "synthetic", "config": asdict(cfg),
                                                 "stats": stats.result(world)})


def world_from_manifest(manifest: DatasetManifest) -> World:
    """The calibrated ``World`` a synthetic dataset was generated from (for exact decompositions)."""
    src = manifest.source
    if src.get("kind") != "synthetic":
        raise ValueError("not a synthetic dataset (manifest source kind is not 'synthetic')")
    names = {f.name for f in fields(WorldConfig)}
    world = World(WorldConfig(**{k: v for k, v in src["config"].items() if k in names}))
    world.b0, world.c0 = src["stats"]["calibration"]["b0"], src["stats"]["calibration"]["c0"]
    return world


def columns_from_table(table: pa.Table) -> dict:
    """A shard's columns as numpy (list columns as (flat values, lengths)), for ``probabilities``."""
    out = {}
    for name in table.column_names:
        col = table.column(name).combine_chunks()
        if pa.types.is_list(col.type):
            off = col.offsets.to_numpy().astype(np.int64)
            out[name] = (col.values.to_numpy()[off[0]:off[-1]], np.diff(off))
        else:
            out[name] = col.to_numpy()
    return out
