"""The latent side of the synthetic ads world: global entities, users and their behaviour
histories, and the true click / conversion models.

``opengem.world.generate`` turns this into impressions and Parquet shards; its docstring
describes the whole generative process. This module holds:

* ``World``: everything drawn once per seed from ``rng_for(seed, TAG_GLOBAL)``: categories,
  content items, advertisers, campaigns, ads (with launch times and daily quality drift), user
  segment profiles, the low-rank interaction factors and the live-ad samplers.
* ``UserBlock``: one block of users drawn from ``rng_for(seed, TAG_BLOCK, block)``: attributes,
  activity, drifting interests, and their organic and ads-engagement event streams over the whole
  window (pre-history days and impression days).
* ``click_terms`` / ``conversion_terms`` / ``probabilities``: the true models. They read only
  what a row shows (its feature columns, its day, its stored, possibly truncated, histories) plus
  per-entity effects keyed by ids that are themselves features, so the probabilities of a written
  shard can be recomputed from the shard alone (the tests do exactly that).

Times inside this module are seconds relative to the start of day 0 ("rel"); the written
``request_ts`` / ``*.ts`` columns add ``cfg.sizes.start_ts``. The true models only use
time differences.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from opengem.world.structure import (
    SIGMOID_STEEPNESS,
    HistoryEffect,
    Interaction,
    NumericEffect,
    WorldStructure,
    draw_structure,
    draw_wide,
    today_structure,
)
from opengem.world.units import (  # noqa: F401 (the world's units, used here and read from here)
    ADS_EVENT_WEIGHTS,
    DAY,
    ORGANIC_EVENT_WEIGHTS,
    TAG_BLOCK,
    TAG_CONTENT,
    TAG_DAY,
    TAG_GLOBAL,
    TAG_ITEM_VECTORS,
    TAG_STRUCTURE,
    TAG_WIDE,
    decay,
    rng_for,
    row_of,
    share,
)

SURFACES = ("feed", "video", "messaging")
FORMATS = ("image", "video", "carousel", "text")
ORGANIC_EVENTS = ("view", "like", "share", "comment")
ADS_EVENTS = ("click", "conversion")
NUM_POSITIONS, NUM_HOURS = 8, 24
NUM_AGES, NUM_GENDERS, NUM_COUNTRIES, NUM_DEVICES = 8, 3, 20, 4

ORGANIC_EVENT_PROBS = np.array([0.80, 0.12, 0.04, 0.04])
AGE_PROBS = np.array([0.06, 0.16, 0.20, 0.18, 0.15, 0.12, 0.08, 0.05])
GENDER_PROBS = np.array([0.49, 0.49, 0.02])
DEVICE_PROBS = np.array([0.55, 0.35, 0.07, 0.03])
FORMAT_PROBS = np.array([0.40, 0.25, 0.20, 0.15])
SURFACE_SHARES = np.array([0.5, 0.3, 0.2])  # mean of the per-user surface preference
DEVICE_BIAS = np.array([0.0, 0.1, -0.15, -0.3])  # times cfg.click.beta_device
HOUR_PEAK = 20.0  # hour of day with the highest CTR
HOUR_BUCKET = 4  # hours per value of the hour_bucket interaction field


def structure_for(cfg) -> WorldStructure:
    """The world's functional form: today's for ``structure_seed`` 0, else
    drawn (``draw_structure``); family ≥ 2 adds ``draw_wide``'s effects from their own generator."""
    if cfg.structure_seed == 0:
        st = today_structure(cfg)
    else:
        st = draw_structure(cfg, rng_for(cfg.structure_seed, TAG_STRUCTURE))
    if cfg.family >= 2:
        st.wide = draw_wide(rng_for(cfg.structure_seed, TAG_WIDE))
    return st


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free and exact enough for float64


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + n)`` for each (s, n), without a Python loop."""
    lengths = lengths.astype(np.int64)
    excl = np.cumsum(lengths) - lengths
    return np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(excl - starts, lengths)


class RowCategorical:
    """Draw from many categorical distributions at once: row ``r`` of ``probs`` [R, K]."""

    def __init__(self, probs: np.ndarray):
        self.K = probs.shape[1]
        cdf = np.cumsum(probs, axis=1, dtype=np.float64)
        cdf /= cdf[:, -1:]
        cdf[:, -1] = 1.0
        cdf += np.arange(probs.shape[0], dtype=np.float64)[:, None]  # row r lives in (r, r + 1]
        self.flat = cdf.ravel()

    def sample(self, rows: np.ndarray, u: np.ndarray) -> np.ndarray:
        idx = np.searchsorted(self.flat, rows + u, side="right") - rows * self.K
        return np.clip(idx, 0, self.K - 1)


class LiveAds:
    """Uniform draw of an ad among the ads of a group (category, advertiser, ...) live at time t."""

    def __init__(self, group: np.ndarray, launch: np.ndarray, n_groups: int, t_hi: int):
        self.t_lo = int(launch.min())
        self.span = t_hi - self.t_lo + 1
        key = group.astype(np.int64) * self.span + (launch - self.t_lo)
        self.order = np.argsort(key, kind="stable")
        self.key = key[self.order]
        self.start = np.searchsorted(self.key, np.arange(n_groups, dtype=np.int64) * self.span)

    def sample(self, group: np.ndarray, t: np.ndarray,
               u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ad ids, ok); ok is False where the group has no live ad at t (the id is then junk)."""
        start = self.start[group]
        k = np.searchsorted(self.key, group * self.span + (t - self.t_lo), side="right") - start
        ok = k > 0
        idx = start + np.minimum((u * k).astype(np.int64), np.maximum(k - 1, 0))
        return self.order[np.clip(idx, 0, len(self.order) - 1)], ok


def _unit_factors(rng: np.random.Generator, n: int, rank: int) -> np.ndarray:
    """Rows whose pairwise inner products have unit variance."""
    return rng.normal(0.0, rank ** -0.25, size=(n, rank))


class World:
    """Global entities of one seed, with the functional form ``structure`` (default:
    ``structure_for(cfg)``). ``b0`` / ``c0`` (the click / conversion intercepts) are set by the
    generator's calibration (or from a manifest, see ``synthetic.world_from_manifest``).

    The structure changes no draw before the interaction factors (scales multiply the same normal
    draws), so two structures of one seed share their entities and users."""

    def __init__(self, cfg, structure: WorldStructure | None = None):
        self.cfg = cfg
        self.structure = st = (structure if structure is not None
                               else structure_for(cfg)).validate()
        rng = rng_for(cfg.seed, TAG_GLOBAL)
        sizes, beh, click = cfg.sizes, cfg.behaviour, cfg.click
        C = sizes.num_categories
        self.window_start = -sizes.history_days * DAY
        self.window_end = sizes.num_days * DAY
        self.window_days = sizes.history_days + sizes.num_days

        # Categories: popularity (log weights) and content items with Zipf popularity inside each.
        self.category_logpop = -beh.category_pop_slope * np.log1p(
            rng.permutation(C).astype(np.float64)
        )
        cat_p = softmax(self.category_logpop)
        item_cat = np.concatenate([np.arange(C),
                                   rng.choice(C, sizes.num_content_items - C, p=cat_p)])
        self.item_category = item_cat[rng.permutation(sizes.num_content_items)].astype(np.int64)
        # items grouped by category, random rank
        order = np.argsort(self.item_category, kind="stable")
        cats_sorted = self.item_category[order]
        cat_start = np.searchsorted(cats_sorted, np.arange(C))
        rank = np.arange(len(order)) - cat_start[cats_sorted]
        w = (rank + 1.0) ** -beh.content_zipf
        cat_end = np.r_[cat_start[1:], len(order)]
        cum = np.cumsum(w)
        before = np.r_[0.0, cum][cat_start]  # cumulative weight before each category
        within = (cum - before[cats_sorted]) / (cum[cat_end - 1] - before)[cats_sorted]
        within[cat_end - 1] = 1.0
        self._item_flat = cats_sorted + within  # category c's items live in (c, c + 1]
        self._item_order = order
        self._cat_start, self._cat_end = cat_start, cat_end

        # Advertisers → campaigns → ads.
        A, M = sizes.num_advertisers, sizes.num_campaigns
        self.advertiser_category = rng.choice(C, A, p=cat_p)
        self.advertiser_cluster = rng.integers(0, sizes.num_advertiser_clusters, A)
        self.advertiser_effect = rng.normal(0, click.advertiser_sigma, A)
        self.advertiser_cvr = rng.normal(0, st.conversion.advertiser_sigma, A)
        camp_adv = np.concatenate([np.arange(A), rng.integers(0, A, M - A)])[rng.permutation(M)]
        main = rng.random(M) < cfg.impressions.campaign_main_category_prob
        self.campaign_advertiser = camp_adv
        self.campaign_category = np.where(main, self.advertiser_category[camp_adv],
                                          rng.choice(C, M, p=cat_p))
        self.campaign_effect = rng.normal(0, click.campaign_sigma, M)

        n_new = sizes.new_ads_per_day * (sizes.num_days - 1)
        self.num_ads = n_ads = sizes.initial_ads + n_new
        self.ad_campaign = rng.integers(0, M, n_ads)
        self.ad_advertiser = camp_adv[self.ad_campaign]
        self.ad_category = self.campaign_category[self.ad_campaign]
        self.ad_format = rng.choice(len(FORMATS), n_ads, p=FORMAT_PROBS)
        self.ad_quality = (self.advertiser_effect[self.ad_advertiser]
                           + self.campaign_effect[self.ad_campaign]
                           + rng.normal(0, click.ad_sigma, n_ads))
        noise = rng.normal(0, click.ad_quality_obs_noise, n_ads)
        self.ad_quality_observed = (self.ad_quality + noise).astype(np.float32)
        first = self.window_start - sizes.initial_ad_span_days * DAY
        launch = np.empty(n_ads, dtype=np.int64)
        launch[: sizes.initial_ads] = rng.integers(first, 0, sizes.initial_ads)
        launch[0] = self.window_start - DAY  # at least one ad is live over the whole window
        new_day = np.repeat(np.arange(1, sizes.num_days), sizes.new_ads_per_day)
        launch[sizes.initial_ads:] = new_day * DAY + rng.integers(0, DAY, n_new)
        self.ad_launch = launch
        self.ad_launch_day = np.floor_divide(launch, DAY)
        # Daily random-walk drift of ad and advertiser quality (0 on day 0).
        D = sizes.num_days
        steps = rng.normal(0, st.drift.ad, (n_ads, D))
        steps[:, 0] = 0
        self.ad_drift = np.cumsum(steps, axis=1)
        steps = rng.normal(0, st.drift.advertiser, (A, D))
        steps[:, 0] = 0
        self.advertiser_drift = np.cumsum(steps, axis=1)

        # Users: attribute distributions and segment interest profiles (peaked on a few categories).
        S = sizes.num_segments
        self.segment_p = softmax(-0.8 * np.log1p(rng.permutation(S).astype(np.float64)))
        self.country_p = softmax(-1.1 * np.log1p(np.arange(NUM_COUNTRIES, dtype=np.float64)))
        prof = self.category_logpop[None, :] + rng.normal(0, 0.3, (S, C))
        for j in range(beh.segment_peaks):
            peak = rng.choice(C, S, p=cat_p)
            prof[np.arange(S), peak] += beh.segment_peak_height * max(1.0 - 0.2 * j, 0.2)
        self.segment_interest = prof

        # Low-rank interaction factors (inner products have unit variance before the beta scale),
        # click pairs then conversion pairs, user side then ad side: the last draws, so the rest
        # is shared.
        self.factors = {}
        for model, pairs in (("click", st.click.interactions),
                             ("conversion", st.conversion.interactions)):
            for it in pairs:
                self.factors[model, it.name] = (
                    _unit_factors(rng, field_size(cfg, it.user), it.rank),
                    _unit_factors(rng, field_size(cfg, it.ad), it.rank),
                )

        # Optional ad content vectors (``click.content_dim`` = k > 0; off by default): an observed
        # k-dim float vector per ad (as a frozen image/text encoder would give), N(0, I_k), from its
        # own generator so every other draw is unchanged; the click logit gains content_sigma ·
        # ⟨v_ad, ŵ⟩ (ŵ a random unit direction): a linear read of the vector, std content_sigma
        # over ads.
        self.ad_content = self.content_effect = None
        if click.content_dim > 0:
            crng = rng_for(cfg.seed, TAG_CONTENT)
            self.ad_content = crng.normal(0, 1, (n_ads, click.content_dim)).astype(np.float32)
            w = crng.normal(0, 1, click.content_dim)
            self.content_weight = click.content_sigma * w / np.linalg.norm(w)
            self.content_effect = self.ad_content.astype(np.float64) @ self.content_weight

        # Family 2's item and ad vectors, from their own generator: no family-1 draw moves.
        self.item_vectors = self.ad_vectors = None
        if st.wide is not None and st.wide.similarity is not None:
            from opengem.world.wide import item_vectors  # wide builds on this module

            self.item_vectors, self.ad_vectors = item_vectors(self, st.wide.similarity)

        self.live_by_category = LiveAds(self.ad_category, launch, C, self.window_end)
        self.live_by_advertiser = LiveAds(self.ad_advertiser, launch, A, self.window_end)
        self.live_any = LiveAds(np.zeros(n_ads, dtype=np.int64), launch, 1, self.window_end)
        self.b0: float | None = None
        self.c0: float | None = None

    def sample_items(self, cat: np.ndarray, u: np.ndarray) -> np.ndarray:
        idx = np.searchsorted(self._item_flat, cat + u, side="right")
        idx = np.clip(idx, self._cat_start[cat], self._cat_end[cat] - 1)
        return self._item_order[idx]

    def sample_live_ads(self, cat: np.ndarray, t: np.ndarray, u: np.ndarray) -> np.ndarray:
        """A live ad of category ``cat`` at t, or any live ad when the category has none yet."""
        ad, ok = self.live_by_category.sample(cat, t, u)
        if not ok.all():
            anyad, _ = self.live_any.sample(np.zeros(len(t), dtype=np.int64), t, u)
            ad = np.where(ok, ad, anyad)
        return ad


class UserBlock:
    """Users ``[first, first + n)`` with their organic and ads-engagement streams (rel seconds).

    Each stream is stored flat, grouped by user and sorted by time: ``<s>_key`` = local user ×
    window span + (ts − window start) is sorted, so a row's history before t is one searchsorted.
    """

    def __init__(self, world: World, block: int):
        cfg = world.cfg
        rng = rng_for(cfg.seed, TAG_BLOCK, block)
        sizes, beh, imp = cfg.sizes, cfg.behaviour, cfg.impressions
        self.first = block * sizes.users_per_block
        U = self.n = min(sizes.users_per_block, sizes.num_users - self.first)
        W, C = world.window_days, sizes.num_categories
        self.span = W * DAY
        self.ws = world.window_start

        self.segment = rng.choice(sizes.num_segments, U, p=world.segment_p)
        self.age = rng.choice(NUM_AGES, U, p=AGE_PROBS)
        self.gender = rng.choice(NUM_GENDERS, U, p=GENDER_PROBS)
        self.country = rng.choice(NUM_COUNTRIES, U, p=world.country_p)
        self.device = rng.choice(NUM_DEVICES, U, p=DEVICE_PROBS)
        self.activity = np.exp(rng.normal(np.log(beh.activity_median), beh.activity_sigma, U))
        rel = np.minimum((self.activity / beh.activity_median) ** imp.impression_activity_exp, 6.0)
        # E[rel] without the cap
        norm = np.exp((imp.impression_activity_exp * beh.activity_sigma) ** 2 / 2)
        self.impression_rate = imp.impressions_per_day * rel / norm
        pref = rng.dirichlet(imp.surface_concentration * SURFACE_SHARES, U)
        self.surface_cum = np.cumsum(pref, axis=1)[:, :2]

        # Interest over categories, one distribution per (user, window day): segment profile + user
        # noise + a per-day random walk. Row index = local user * W + window day.
        base = world.segment_interest[self.segment] + rng.normal(0, beh.interest_noise, (U, C))
        walk = np.cumsum(
            rng.normal(0, world.structure.drift.interest, (U, W, C)).astype(np.float32), axis=1
        )
        theta = base[:, None, :].astype(np.float32) + walk
        del walk
        theta -= theta.max(axis=2, keepdims=True)
        self.interest = RowCategorical(np.exp(theta).reshape(U * W, C))
        del theta

        n_org = np.minimum(rng.poisson(self.activity * W), beh.max_events)
        self.org_key, self.org_off, org_user, org_ts = self._times(rng, n_org)
        cat = self.interest.sample(org_user * W + (org_ts - self.ws) // DAY,
                                   rng.random(len(org_ts)))
        self.org_item = world.sample_items(cat, rng.random(len(org_ts)))
        self.org_event = np.searchsorted(np.cumsum(ORGANIC_EVENT_PROBS)[:-1],
                                         rng.random(len(org_ts)), side="right")
        self.org_ts = org_ts

        n_ads = np.minimum(rng.poisson(self.activity * W * beh.ads_events_per_organic),
                           beh.ads_max_events)
        self.ads_key, self.ads_off, ads_user, ads_ts = self._times(rng, n_ads)
        cat = self.interest.sample(ads_user * W + (ads_ts - self.ws) // DAY,
                                   rng.random(len(ads_ts)))
        self.ads_item = world.sample_live_ads(cat, ads_ts, rng.random(len(ads_ts)))
        self.ads_event = (rng.random(len(ads_ts)) < beh.conversion_event_prob).astype(np.int64)
        self.ads_ts = ads_ts

    def _times(self, rng, counts):
        user = np.repeat(np.arange(self.n, dtype=np.int64), counts)
        key = np.sort(user * self.span + rng.integers(0, self.span, len(user)))
        ts = key - user * self.span + self.ws
        off = np.zeros(self.n + 1, dtype=np.int64)
        np.cumsum(counts, out=off[1:])
        return key, off, user, ts

    def history(self, stream: str, user: np.ndarray, t: np.ndarray, max_len: int):
        """(count before t, stored start index, stored length) for local users at rel times t."""
        key, off = (
            (self.org_key, self.org_off) if stream == "organic" else (self.ads_key, self.ads_off)
        )
        # strictly before t
        end = np.searchsorted(key, user * self.span + (t - self.ws), side="left")
        count = end - off[user]
        length = np.minimum(count, max_len)
        return count, end - length, length


# ------------------------------------------------------------------------------ the true models
def field_size(cfg, name: str) -> int:
    """How many values an interaction field has (fields: ``structure``'s module docstring)."""
    s = cfg.sizes
    return {"segment": s.num_segments, "age": NUM_AGES, "gender": NUM_GENDERS,
            "country": NUM_COUNTRIES, "device": NUM_DEVICES, "domain": len(SURFACES),
            "hour_bucket": NUM_HOURS // HOUR_BUCKET,
            "category": s.num_categories, "format": len(FORMATS),
            "advertiser_cluster": s.num_advertiser_clusters,
            "advertiser_id": s.num_advertisers}[name]


def field_values(world: World, c: dict, name: str) -> np.ndarray:
    """An interaction field's value per row: a column, or derived from one (hour, advertiser_id)."""
    if name == "hour_bucket":
        return c["hour"] // HOUR_BUCKET
    if name == "advertiser_cluster":
        return world.advertiser_cluster[c["advertiser_id"]]
    return c[name]


def numeric_transform(e: NumericEffect, x: np.ndarray) -> np.ndarray:
    """g((x − center) / scale) of a ``NumericEffect`` (without its beta)."""
    u = (x.astype(np.float64) - e.center) / e.scale
    if e.shape == "linear":
        return u
    if e.shape == "log1p":
        return np.sign(u) * np.log1p(np.abs(u))
    if e.shape == "tanh":
        return np.tanh(u)
    if e.shape == "sigmoid":
        return sigmoid(SIGMOID_STEEPNESS * (u - e.threshold))
    if e.shape == "exp_neg":
        return np.exp(-u)
    raise ValueError(f"unknown numeric shape {e.shape!r}")


def sequence_match(world: World, items, events, ts, lengths, request_ts, ad_category,
                   tau_hours=None) -> np.ndarray:
    """m = Σ w·decay·[cat(item) = cat(ad)] / (1 + Σ w·decay) over the row's stored organic events,
    with w = ORGANIC_EVENT_WEIGHTS[event] and decay = exp(−(request_ts − ts) / τ); τ defaults to
    ``click.seq_tau_hours`` (structure seed 0's organic history)."""
    row = row_of(lengths)
    tau = world.cfg.click.seq_tau_hours if tau_hours is None else tau_hours
    w = decay(ORGANIC_EVENT_WEIGHTS, events, ts, request_ts, row, tau)
    return share(w, world.item_category[items] == ad_category[row], row, len(lengths))


def history_statistic(world: World, c: dict, h: HistoryEffect) -> np.ndarray:
    """The statistic s of ``h`` (see ``HistoryEffect``) over the rows' stored
    ``h.stream`` events."""
    items, lengths = c[f"{h.stream}.item"]
    events, ts, t = c[f"{h.stream}.event"][0], c[f"{h.stream}.ts"][0], c["request_ts"]
    row, n = row_of(lengths), len(lengths)
    if h.stream == "organic":
        match, type_weights = (
            world.item_category[items] == c["category"][row],
            ORGANIC_EVENT_WEIGHTS,
        )
    elif h.key == "advertiser":
        match, type_weights = (
            world.ad_advertiser[items] == c["advertiser_id"][row],
            ADS_EVENT_WEIGHTS,
        )
    else:
        match, type_weights = world.ad_category[items] == c["category"][row], ADS_EVENT_WEIGHTS
    if h.form == "recency":  # stored events are in time order: a row's last match is its newest
        idx = np.flatnonzero(match)
        r = row[idx]
        last = np.r_[r[1:] != r[:-1], True] if len(r) else np.zeros(0, dtype=bool)
        out = np.zeros(n)
        out[r[last]] = np.exp(-(t[r[last]] - ts[idx[last]]) / (h.tau_hours * 3600.0))
        return out
    w = decay(type_weights, events, ts, t, row, h.tau_hours)
    if h.form == "share":
        return share(w, match, row, n)
    if h.form == "log_count":
        return np.log1p(np.bincount(row, w * match, minlength=n))
    raise ValueError(f"history form {h.form!r} has no statistic")


def history_stats(world: World, c: dict) -> dict[tuple, np.ndarray]:
    """Every history statistic both true models use, by ``HistoryEffect.spec()`` (each
    computed once)."""
    st = world.structure
    out = {}
    for h in [*st.click.history, *st.conversion.history]:
        if h.form != "none" and h.spec() not in out:
            out[h.spec()] = history_statistic(world, c, h)
    if st.wide is not None:
        from opengem.world.wide import wide_stats  # wide builds on this module

        out.update(wide_stats(world, c))
    return out


def history_signals(world: World, c: dict) -> tuple[np.ndarray, ...]:
    """The click model's history statistics, one per stream (organic, ads; zeros where the form is
    ``none``): m and log1p(A) on structure seed 0."""
    stats = history_stats(world, c)
    n = len(c["request_ts"])
    return tuple(stats[h.spec()] if h.form != "none" else np.zeros(n)
                 for h in world.structure.click.history)


def history_term_name(h: HistoryEffect) -> str:
    return "sequence" if h.stream == "organic" else "ads_history"


def interaction_dot(world: World, model: str, it: Interaction, c: dict) -> np.ndarray:
    """⟨u[user value], a[ad value]⟩ of one interaction of ``model`` (click | conversion)."""
    uf, af = world.factors[model, it.name]
    return np.einsum("ij,ij->i", uf[field_values(world, c, it.user)],
                     af[field_values(world, c, it.ad)])


def position_term(p, position: np.ndarray) -> np.ndarray:
    if p.form == "log1p":
        return -p.beta * np.log1p(position)
    if p.form == "linear":
        return -p.beta * position.astype(np.float64)
    return -p.beta * (position >= p.step_at)


def click_terms(world: World, c: dict, stats: dict) -> dict[str, np.ndarray]:
    """The additive terms of the click logit (without b0). ``c`` maps column names to numpy arrays
    (list columns to (flat values, lengths)); ``stats = history_stats(world, c)``. Only the row's
    own columns are read, plus per-entity effects keyed by the row's ids. The term order is fixed
    (the logit is their sum in this order)."""
    st, model = world.structure.click, world.cfg.click
    ad, adv, surface, day = c["ad_id"], c["advertiser_id"], c["domain"], c["day"]
    hs, hc = c["hour_sin"].astype(np.float64), c["hour_cos"].astype(np.float64)
    ph = 2 * np.pi * HOUR_PEAK / 24
    terms = {
        "surface": np.asarray(st.surface_bias)[surface],
        "position": position_term(st.position, c["position"]),
        "hour": model.beta_hour * (hc * np.cos(ph) + hs * np.sin(ph)),
        "ad_quality": world.ad_quality[ad],
        "ad_drift": world.ad_drift[ad, day] + world.advertiser_drift[adv, day],
    }
    activity, *numeric = st.numeric
    for e in numeric:
        if e.shape != "none":
            terms[e.name] = e.beta * numeric_transform(e, c[e.feature])
    terms["surface_format"] = np.asarray(st.surface_format)[surface, c["format"]]
    for it in st.interactions:
        terms[it.name] = it.beta * interaction_dot(world, "click", it, c)
    for h in st.history:
        if h.form != "none":
            terms[history_term_name(h)] = h.beta * stats[h.spec()]
    device = model.beta_device * DEVICE_BIAS[c["device"]]
    terms["user"] = (device if activity.shape == "none"
                     else activity.beta * numeric_transform(activity, c[activity.feature]) + device)
    # last: without content vectors the sum is the one it always was
    if world.content_effect is not None:
        terms["content"] = world.content_effect[ad]
    if world.structure.wide is not None:  # after all: a family-1 sum is untouched
        from opengem.world.wide import wide_terms

        terms.update(wide_terms(world.structure.wide, stats))
    return terms


def conversion_terms(world: World, c: dict, stats: dict) -> dict[str, np.ndarray]:
    """Terms of the conversion-given-click logit (without c0)."""
    st = world.structure.conversion
    terms = {"advertiser": world.advertiser_cvr[c["advertiser_id"]]}
    for it in st.interactions:
        terms[it.name] = it.beta * interaction_dot(world, "conversion", it, c)
    for h in st.history:
        if h.form != "none":
            terms[history_term_name(h)] = h.beta * stats[h.spec()]
    terms["surface"] = np.asarray(st.surface)[c["domain"]]
    return terms


def probabilities(world: World, c: dict, b0: float | None = None, c0: float | None = None):
    """(p_click, p_conversion_given_click, click terms, conversion terms) for rows ``c``.

    Intercepts default to the world's calibrated ``b0`` / ``c0``."""
    b0 = world.b0 if b0 is None else b0
    c0 = world.c0 if c0 is None else c0
    if b0 is None or c0 is None:
        raise ValueError("world intercepts are not calibrated (b0/c0 unset)")
    stats = history_stats(world, c)
    ct, vt = click_terms(world, c, stats), conversion_terms(world, c, stats)
    return sigmoid(b0 + sum(ct.values())), sigmoid(c0 + sum(vt.values())), ct, vt


def solve_intercept(z: np.ndarray, target: float, weights: np.ndarray | None = None) -> float:
    """b such that the (weighted) mean of sigmoid(b + z) equals target (bisection)."""
    lo, hi = -30.0, 30.0
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        m = np.average(sigmoid(mid + z), weights=weights)
        lo, hi = (mid, hi) if m < target else (lo, mid)
    return 0.5 * (lo + hi)


# ------------------------------------------------------------------------------ a surface's own objective
TAG_SURFACE_TASK = 4
SURFACE_TASK = "engage"  # the task, label column; its true probability is ``p_engage``


@dataclass
class SurfaceTask:
    """A surface-specific objective the FM does not train on (mismatched objectives); off
    by default.

    On the rows of surface ``surface`` (an index into ``SURFACES``; NaN elsewhere: only that surface
    logs it) a label ``engage`` ~ Bernoulli(p_engage) is drawn, with

        logit = e0 + click_share · (click logit − b0) + beta_own · own,
        own   = (⟨segment, category⟩ own factors + advertiser own effect + format own effect) / √3

    the own factors drawn once from ``rng_for(seed, TAG_SURFACE_TASK)`` (no draw of the default
    world moves) and e0 solved on block 0's rows of the surface so its mean is ``target_rate``. The
    label's uniforms come from ``rng_for(seed, TAG_SURFACE_TASK, block, day)``. ``click_share`` is
    how much of click's drivers it shares: what a click FM's head can transfer."""

    enabled: bool = False
    surface: int = 1  # video
    click_share: float = 0.6
    beta_own: float = 1.0
    target_rate: float = 0.05


def _surface_factors(world) -> dict:
    own = getattr(world, "_surface_task_factors", None)
    if own is None:
        cfg = world.cfg
        rng = rng_for(cfg.seed, TAG_SURFACE_TASK)
        s = cfg.sizes
        own = {"seg_cat": rng.standard_normal((s.num_segments, s.num_categories)),
               "advertiser": rng.standard_normal(s.num_advertisers),
               "format": rng.standard_normal(len(FORMATS))}
        world._surface_task_factors = own
    return own


def surface_task_logit(world, c: dict, click_terms: dict) -> np.ndarray:
    """The surface task's logit without its intercept e0, for every row of ``c``
    (module docstring)."""
    st = world.cfg.surface_task
    f = _surface_factors(world)
    own = (f["seg_cat"][c["segment"], c["category"]] + f["advertiser"][c["advertiser_id"]]
           + f["format"][c["format"]]) / np.sqrt(3.0)
    return st.click_share * sum(click_terms.values()) + st.beta_own * own


def solve_surface_intercept(world, rows: list[tuple[dict, dict]]) -> float:
    """e0 over block 0's rows of the surface: ``rows`` are (columns, click terms) pairs."""
    st = world.cfg.surface_task
    z = [surface_task_logit(world, c, ct)[np.asarray(c["domain"]) == st.surface] for c, ct in rows]
    z = np.concatenate(z) if z else np.zeros(0)
    if len(z) == 0:
        raise ValueError("block 0 has no rows of surface_task.surface to calibrate the "
                         "surface task on")
    return solve_intercept(z, st.target_rate)


def surface_task_columns(world, c: dict, click_terms: dict, block: int,
                         day: int) -> dict[str, np.ndarray]:
    """{``engage``: float32 labels (NaN off the surface), ``p_engage``: float64 (NaN off
    the surface)}."""
    st = world.cfg.surface_task
    on = np.asarray(c["domain"]) == st.surface
    p = sigmoid(world.e0 + surface_task_logit(world, c, click_terms))
    u = rng_for(world.cfg.seed, TAG_SURFACE_TASK, block, day).random(len(p))
    label = np.where(on, (u < p).astype(np.float32), np.float32(np.nan)).astype(np.float32)
    return {SURFACE_TASK: label, f"p_{SURFACE_TASK}": np.where(on, p, np.nan)}


TAG_DENSE_MISSING = 8
MISSING_FEATURES = ("ad_quality", "user_activity")  # the dense features ``dense_missing`` blanks


@dataclass
class DenseMissing:
    """Missing-not-at-random dense values; off by default (``rate = 0``).

    Each of ``MISSING_FEATURES`` is blanked (NaN) in a row with probability
    sigmoid(logit(rate) + label_beta · z), z the row's true click logit standardised over the shard,
    so rows with a missing value click more (``label_beta > 0``) or less: the missing indicator has
    signal, as in logs where a counter is absent for new or unusual traffic. The schema then
    declares those features ``missing="indicator"``. Draws come from ``rng_for(seed,
    TAG_DENSE_MISSING, block, day)``, after the labels: no other draw of the world moves, labels and
    probabilities are unchanged."""

    rate: float = 0.0
    label_beta: float = 1.0


def blank_dense(world, table, block: int, day: int):
    """``table`` with ``MISSING_FEATURES`` blanked as ``DenseMissing`` says (the table itself
    when off)."""
    import pyarrow as pa

    dm = world.cfg.dense_missing
    if not dm.rate > 0:
        return table
    rng = rng_for(world.cfg.seed, TAG_DENSE_MISSING, block, day)
    p = table.column("p_click").to_numpy().astype(np.float64).clip(1e-9, 1 - 1e-9)
    z = np.log(p / (1 - p))
    z = (z - z.mean()) / max(z.std(), 1e-9)
    p_miss = sigmoid(np.log(dm.rate / (1 - dm.rate)) + dm.label_beta * z)
    for name in MISSING_FEATURES:
        v = table.column(name).to_numpy().copy()
        v[rng.random(len(v)) < p_miss] = np.nan
        table = table.set_column(table.schema.get_field_index(name), name, pa.array(v))
    return table
