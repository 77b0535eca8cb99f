"""The functional form of a synthetic world, drawn from a structure seed: a family of worlds,
not one.

A world is ``(structure_seed, seed)``. The structure seed fixes *which* terms the true click and
conversion models have and *how* each acts (which user × ad fields interact and at what rank, how
a history acts and with which decay, the shape of each numeric effect, the position form, the
surface tables, the drift scales); the sampling seed then draws the entities, factors and rows.
``WorldStructure`` is that form as plain data: it is stored in the manifest beside the config
(``source.structure``) and a world reloads with it. Structure seed 0 is today's demo world, built
from the ``ClickModel`` / ``ConversionModel`` knobs (``today_structure``); any other seed is drawn
by ``draw_structure``, whose docstring is the distribution. Develop on structure seeds 0–99; report
on seeds ≥ 1000 that no choice was made on.

``WorldConfig.family`` widens the menu: family 1 (the default) is the menu above; family 2 adds
``WideEffects`` (item-level similarity, fatigue, repeat engagement, last-k), drawn by
``draw_wide`` from its own generator (``rng_for(structure_seed, TAG_WIDE)``), so the family-1 part
of a family-2 structure is exactly the family-1 draw of its seed.

Fields an interaction may cross (values read from the row by ``latent.field_values``):
user / context ``segment, age, gender, country, device, domain`` (the surface),
``hour_bucket`` (``hour // 4``) × ad ``category, format, advertiser_cluster`` (the advertiser's
cluster, an attribute of the ``advertiser_id`` feature), ``advertiser_id``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

import numpy as np

USER_FIELDS = ("segment", "age", "gender", "country", "device", "domain", "hour_bucket")
AD_FIELDS = ("category", "format", "advertiser_cluster", "advertiser_id")
HISTORY_FORMS = ("share", "log_count", "recency", "none")
NUMERIC_SHAPES = ("linear", "log1p", "tanh", "sigmoid", "none")  # "exp_neg": today's novelty only
POSITION_FORMS = ("log1p", "linear", "step")
# Where each numeric feature is centred and scaled before its shape (its rough median and spread).
NUMERIC_FEATURES = {"user_activity": (0.5, 1.0), "ad_age": (3.0, 1.2), "ad_quality": (0.0, 0.6)}
SIGMOID_STEEPNESS = 4.0

# Today's fixed, interpretable context tables (multiplied by their cfg.click.beta_* knob).
SURFACE_BIAS = np.array([0.3, 0.0, -0.5])
SURFACE_FORMAT = np.array([  # rows: feed, video, messaging; cols: image, video, carousel, text
    [0.3, -0.2, 0.4, -0.3],
    [-0.5, 1.0, -0.3, -0.8],
    [0.0, -0.7, -0.2, 0.7],
])
CVR_SURFACE = np.array([0.0, -0.4, 0.4])


@dataclass
class Interaction:
    """``beta · ⟨u[user value], a[ad value]⟩`` with rank-``rank`` factors of
    unit-variance products."""

    user: str
    ad: str
    rank: int
    beta: float
    name: str = ""  # the term's name; default "<user>_<ad>"

    def __post_init__(self):
        self.name = self.name or f"{self.user}_{self.ad}"


@dataclass
class HistoryEffect:
    """``beta · s`` with ``s`` a statistic of the row's stored ``stream`` events that match its ad.

    An event matches when its ``key`` equals the ad's (organic: the item's category; ads: the
    engaged ad's advertiser or category); ``w`` = event-type weight × exp(−Δt/τ), Δt = request −
    event time:
    ``share`` s = Σ w·match / (1 + Σ w); ``log_count`` s = log1p(Σ w·match);
    ``recency`` s = exp(−Δt_last_match / τ) (0 without a match); ``none``: no term.
    """

    stream: str  # organic | ads
    form: str
    tau_hours: float
    key: str  # category | advertiser
    beta: float

    def spec(self) -> tuple:
        """What the statistic depends on (not beta): equal specs share one computation."""
        return self.stream, self.form, self.tau_hours, self.key


@dataclass
class NumericEffect:
    """``beta · g((x − center) / scale)`` of a dense feature x: g = u (``linear``),
    sign(u)·log1p(|u|) (``log1p``), tanh(u) (``tanh``), sigmoid(4·(u − threshold)) (``sigmoid``),
    exp(−u) (``exp_neg``: today's novelty bump on ad_age) or no term (``none``)."""

    feature: str
    shape: str
    beta: float
    center: float = 0.0
    scale: float = 1.0
    threshold: float = 0.0
    name: str = ""  # the term's name; default "<feature>_<shape>"

    def __post_init__(self):
        self.name = self.name or f"{self.feature}_{self.shape}"


@dataclass
class PositionEffect:
    """−beta·log1p(pos) (``log1p``), −beta·pos (``linear``) or −beta·[pos ≥ step_at] (``step``)."""

    form: str
    beta: float
    step_at: int = 0


@dataclass
class ClickStructure:
    """The click logit's form; the terms a structure does not draw (hour, device, the ad effects)
    keep their ``ClickModel`` knobs."""

    interactions: list[Interaction]
    history: list[HistoryEffect]  # one per stream: organic, ads
    # user_activity (in the "user" term with the device), ad_age, ad_quality
    numeric: list[NumericEffect]
    position: PositionEffect
    surface_bias: list[float]  # per surface
    surface_format: list[list[float]]  # surface × format


@dataclass
class ConversionStructure:
    """The conversion-given-click logit's form."""

    advertiser_sigma: float  # sd of the per-advertiser conversion effect
    interactions: list[Interaction]
    history: list[HistoryEffect]
    surface: list[float]


@dataclass
class Drift:
    """Daily random-walk steps: user interest logits, each ad's and each advertiser's
    click effect."""

    interest: float
    ad: float
    advertiser: float


@dataclass
class Similarity:
    """Item-level similarity (family 2): ``beta · s``, s = Σ_e w_e·⟨v_item(e), v_ad⟩ / (1 + Σ_e w_e)
    over the row's stored ``stream`` events, w_e = event-type weight × exp(−Δt/τ). Every item and ad
    has a unit ``dim``-vector: its category's unit vector plus ``spread`` × noise, renormalised, so
    same-category pairs are similar (⟨·,·⟩ ≈ 1/(1 + spread²)) but not equal, and categories are
    similar to each other by chance (⟨·,·⟩ ~ ±1/√dim)."""

    stream: str  # organic | ads
    tau_hours: float
    beta: float
    dim: int
    spread: float


@dataclass
class Fatigue:
    """−beta·log1p(n), n = the row's stored events (both streams) in the last ``window_hours``."""

    window_hours: float
    beta: float


@dataclass
class Repeat:
    """+beta·[a stored ads-stream event of the ad's advertiser within the last ``days`` days]."""

    days: int
    beta: float


@dataclass
class LastK:
    """beta · (share of the row's last min(k, n) stored organic events whose category is the
    ad's; 0 without events)."""

    k: int
    beta: float


@dataclass
class WideEffects:
    """Family 2's click history effects; ``None`` = off. Each is one term of the click logit, named
    after its field, added after every family-1 term."""

    similarity: Similarity | None = None
    fatigue: Fatigue | None = None
    repeat: Repeat | None = None
    last_k: LastK | None = None

    def on(self) -> dict[str, object]:
        """The effects that are on, by term name, in term order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}

    @classmethod
    def from_dict(cls, d: dict) -> WideEffects:
        kinds = {"similarity": Similarity, "fatigue": Fatigue, "repeat": Repeat, "last_k": LastK}
        return cls(**{k: None if d.get(k) is None else kind(**d[k]) for k, kind in kinds.items()})


@dataclass
class WorldStructure:
    """A world's functional form (module docstring): ``seed`` is the structure seed it was
    drawn from."""

    seed: int
    click: ClickStructure
    conversion: ConversionStructure
    drift: Drift
    wide: WideEffects | None = None  # family 2's effects; None: a family-1 world

    def to_dict(self) -> dict:
        """A family-1 structure has no ``wide`` key: its manifest is the one it always was."""
        d = asdict(self)
        if self.wide is None:
            del d["wide"]
        return d

    def validate(self) -> WorldStructure:
        """Term names must be unique within each model (the logit is a dict of named terms)."""
        fixed = ["surface", "position", "hour", "ad_quality", "ad_drift", "surface_format", "user",
                 "sequence", "ads_history"]
        fixed += list(self.wide.on()) if self.wide is not None else []
        for model, names in (("click", fixed + [e.name for e in self.click.numeric[1:]]
                              + [it.name for it in self.click.interactions]),
                             ("conversion", ["advertiser", "surface", "sequence", "ads_history"]
                              + [it.name for it in self.conversion.interactions])):
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"WorldStructure: {model} term names {dup} are not unique")
        return self

    @classmethod
    def from_dict(cls, d: dict) -> WorldStructure:
        """From ``to_dict`` (a manifest's ``source.structure``)."""
        c, v = d["click"], d["conversion"]
        return cls(
            seed=d["seed"],
            click=ClickStructure(
                [Interaction(**x) for x in c["interactions"]],
                [HistoryEffect(**x) for x in c["history"]],
                [NumericEffect(**x) for x in c["numeric"]], PositionEffect(**c["position"]),
                c["surface_bias"], c["surface_format"]),
            conversion=ConversionStructure(
                v["advertiser_sigma"], [Interaction(**x) for x in v["interactions"]],
                [HistoryEffect(**x) for x in v["history"]], v["surface"]),
            drift=Drift(**d["drift"]),
            wide=None if d.get("wide") is None else WideEffects.from_dict(d["wide"]))


def today_structure(cfg) -> WorldStructure:
    """Structure seed 0: the demo world's form, with today's scales from the config's knobs."""
    click, conv = cfg.click, cfg.conversion
    r = cfg.sizes.latent_rank
    organic = HistoryEffect("organic", "share", click.seq_tau_hours, "category", click.beta_seq)
    return WorldStructure(
        seed=0,
        click=ClickStructure(
            interactions=[Interaction("segment", "category", r, click.beta_segment_category),
                          Interaction("age", "format", r, click.beta_age_format),
                          Interaction("country", "advertiser_cluster", r,
                                      click.beta_country_cluster,
                                      "country_cluster")],
            history=[organic,
                     HistoryEffect("ads", "log_count", click.ads_tau_hours, "advertiser",
                                   click.beta_ads)],
            numeric=[NumericEffect("user_activity", "linear", click.beta_activity),
                     NumericEffect("ad_age", "exp_neg", click.beta_novelty, name="ad_novelty"),
                     NumericEffect("ad_quality", "none", 0.0)],
            position=PositionEffect("log1p", click.beta_position),
            surface_bias=(click.beta_surface * SURFACE_BIAS).tolist(),
            surface_format=(click.beta_surface_format * SURFACE_FORMAT).tolist()),
        conversion=ConversionStructure(
            advertiser_sigma=conv.cvr_advertiser_sigma,
            interactions=[Interaction("segment", "category", r, conv.cvr_beta_segment_category)],
            history=[dataclasses.replace(organic, beta=conv.cvr_beta_seq)],
            surface=(conv.cvr_beta_surface * CVR_SURFACE).tolist()),
        drift=Drift(cfg.behaviour.interest_drift, click.ad_drift, click.advertiser_drift))


def _u(rng, lo, hi) -> float:
    return round(float(rng.uniform(lo, hi)), 3)


def _log_u(rng, lo, hi) -> float:
    return round(float(np.exp(rng.uniform(np.log(lo), np.log(hi)))), 3)


def _interactions(rng, k: int, beta: tuple[float, float]) -> list[Interaction]:
    pairs = [(u, a) for u in USER_FIELDS for a in AD_FIELDS]
    picked = sorted(rng.choice(len(pairs), k, replace=False).tolist())
    return [Interaction(*pairs[i], int(rng.integers(1, 7)), _u(rng, *beta)) for i in picked]


def _history(rng, stream: str) -> HistoryEffect:
    form = HISTORY_FORMS[rng.choice(4, p=[0.3, 0.3, 0.3, 0.1])]
    tau = _log_u(rng, 1.0, 720.0)
    key = "category" if stream == "organic" else ("advertiser", "category")[int(rng.integers(2))]
    beta = {"share": (1.5, 4.0), "log_count": (0.5, 2.0), "recency": (0.5, 2.0),
            "none": (0.0, 0.0)}[form]
    return HistoryEffect(stream, form, tau, key, _u(rng, *beta))


def _numeric(rng, feature: str) -> NumericEffect:
    shape = NUMERIC_SHAPES[int(rng.integers(len(NUMERIC_SHAPES)))]
    beta = _u(rng, 0.1, 0.5) * (1 if rng.random() < 0.5 else -1)
    center, scale = NUMERIC_FEATURES[feature]
    threshold = _u(rng, -1.0, 1.0) if shape == "sigmoid" else 0.0
    return NumericEffect(feature, shape, 0.0 if shape == "none" else beta, center, scale, threshold)


def _position(rng) -> PositionEffect:
    form = POSITION_FORMS[int(rng.integers(3))]
    if form == "step":
        return PositionEffect(form, _u(rng, 0.3, 1.0), int(rng.integers(1, 5)))
    return PositionEffect(form, _u(rng, 0.3, 0.9) if form == "log1p" else _u(rng, 0.05, 0.2))


def draw_structure(cfg, rng: np.random.Generator) -> WorldStructure:
    """A world's form for a structure seed ≠ 0 (``rng = rng_for(structure_seed, TAG_STRUCTURE)``).

    The distribution (U = uniform, logU = log-uniform; betas rounded to 3 decimals):

    * click interactions: 2–5 distinct pairs of a user/context field × an ad field (module
      docstring), each of rank U{1..6} and beta U[0.2, 0.8];
    * click history, per stream: form share / log_count / recency / none with probabilities
      0.3 / 0.3 / 0.3 / 0.1, τ logU[1 h, 30 d], key (organic: category; ads: advertiser or category,
      1/2 each), beta U[1.5, 4] (share), U[0.5, 2] (log_count, recency);
    * numeric effects of user_activity, ad_age and ad_quality (the observed feature): shape
      linear / log1p / tanh / sigmoid / none (1/5 each) on the feature centred and scaled by
      ``NUMERIC_FEATURES``, |beta| U[0.1, 0.5] with a random sign, sigmoid threshold U[−1, 1];
    * position: log1p (beta U[0.3, 0.9]), linear (beta U[0.05, 0.2]) or step at U{1..4}
      (beta U[0.3, 1]), 1/3 each; surface biases N(0, 0.4²); surface × format table N(0, 0.5²);
    * conversion given click: advertiser effect sd U[0.3, 0.9]; 0–2 interaction pairs (rank
      U{1..6}, beta U[0.2, 0.7]); the click's organic statistic with beta U[0.5, 2] (none if that
      form is none); surface effects N(0, 0.4²);
    * drift: interest, ad and advertiser steps = the config's ``behaviour.interest_drift``,
      ``click.ad_drift``, ``click.advertiser_drift`` × logU[0.5, 2] each.

    Everything else (hour, device, ad / campaign / advertiser click effects, target rates) keeps its
    config knob. The click knobs the structure replaces (``beta_seq``, ``beta_position``, …) act
    on structure seed 0 only.
    """
    interactions = _interactions(rng, int(rng.integers(2, 6)), (0.2, 0.8))
    history = [_history(rng, "organic"), _history(rng, "ads")]
    numeric = [_numeric(rng, f) for f in NUMERIC_FEATURES]
    position = _position(rng)
    surface_bias = np.round(rng.normal(0, 0.4, 3), 3).tolist()
    surface_format = np.round(rng.normal(0, 0.5, (3, 4)), 3).tolist()
    cvr_sigma = _u(rng, 0.3, 0.9)
    cvr_inter = _interactions(rng, int(rng.integers(0, 3)), (0.2, 0.7))
    cvr_beta = _u(rng, 0.5, 2.0)
    cvr_history = (
        [] if history[0].form == "none" else [dataclasses.replace(history[0], beta=cvr_beta)]
    )
    cvr_surface = np.round(rng.normal(0, 0.4, 3), 3).tolist()
    drift = Drift(*(round(base * _log_u(rng, 0.5, 2.0), 4) for base in (
        cfg.behaviour.interest_drift, cfg.click.ad_drift, cfg.click.advertiser_drift)))
    return WorldStructure(
        seed=int(cfg.structure_seed),
        click=ClickStructure(interactions, history, numeric, position, surface_bias,
                             surface_format),
        conversion=ConversionStructure(cvr_sigma, cvr_inter, cvr_history, cvr_surface), drift=drift)


def draw_wide(rng: np.random.Generator, on_prob: float = 0.6) -> WideEffects:
    """Family 2's effects (``rng = rng_for(structure_seed, TAG_WIDE)``). Each class is on with
    probability ``on_prob``; its parameters are drawn whether it is on or not, so one class's switch
    moves no other class's draw:

    * similarity: stream organic / ads (0.7 / 0.3), τ logU[1 h, 30 d], beta U[1.5, 4], vector dim
      U{4..16}, spread U[0.3, 1.5];
    * fatigue: window 1 h, beta U[0.3, 1];
    * repeat: D U{1..14} days, beta U[0.3, 1];
    * last-k: k U{1..5}, beta U[0.5, 2].
    """
    on = rng.random(4) < on_prob
    sim = Similarity(("organic", "ads")[int(rng.random() < 0.3)], _log_u(rng, 1.0, 720.0),
                     _u(rng, 1.5, 4.0), int(rng.integers(4, 17)), _u(rng, 0.3, 1.5))
    fatigue = Fatigue(1.0, _u(rng, 0.3, 1.0))
    repeat = Repeat(int(rng.integers(1, 15)), _u(rng, 0.3, 1.0))
    last_k = LastK(int(rng.integers(1, 6)), _u(rng, 0.5, 2.0))
    return WideEffects(*(e if o else None for e, o in zip((sim, fatigue, repeat, last_k), on)))


__all__ = ["AD_FIELDS", "USER_FIELDS", "ClickStructure", "ConversionStructure", "Drift", "Fatigue",
           "HistoryEffect", "Interaction", "LastK", "NumericEffect", "PositionEffect", "Repeat",
           "Similarity", "WideEffects", "WorldStructure", "draw_structure", "draw_wide",
           "today_structure"]
