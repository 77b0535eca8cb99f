"""Family 2's history effects (``structure.WideEffects``): their item and ad vectors and their
statistics, each computed from what a row shows, as ``latent.history_statistic`` does.

Every statistic reads only the row's ``request_ts``, its ad's ids (``ad_id``, ``advertiser_id``,
``category``) and its stored, possibly truncated, event lists (item ids, event types, times), plus
per-entity attributes keyed by ids that are features (an item's category and vector, an ad's
advertiser and vector). So ``latent.probabilities`` recomputes a family-2 world's probabilities
from a shard, and the oracle (``opengem.world.oracle``) gets each statistic as an exact column.

Statistics are keyed ``("wide", name)`` in ``latent.history_stats``'s dict; the click term of
effect ``name`` is ``SIGN[name] · beta · stat``.
"""

from __future__ import annotations

import numpy as np

from opengem.world.structure import Fatigue, LastK, Repeat, Similarity, WideEffects
from opengem.world.units import (
    ADS_EVENT_WEIGHTS,
    DAY,
    ORGANIC_EVENT_WEIGHTS,
    TAG_ITEM_VECTORS,
    decay,
    rng_for,
    row_of,
    share,
)

SIGN = {"similarity": 1.0, "fatigue": -1.0, "repeat": 1.0, "last_k": 1.0}
CHUNK = 1 << 20  # events per gather: bounds the [events, dim] temporaries on long histories


def key(name: str) -> tuple[str, str]:
    return "wide", name


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def item_vectors(world, sim: Similarity) -> tuple[np.ndarray, np.ndarray]:
    """(content item vectors [items, dim], ad vectors [ads, dim]): unit vectors around their
    category's unit vector (``Similarity``), from ``rng_for(seed, TAG_ITEM_VECTORS)``."""
    rng = rng_for(world.cfg.seed, TAG_ITEM_VECTORS)
    cat = _unit(rng.normal(0, 1, (world.cfg.sizes.num_categories, sim.dim)))

    def around(category: np.ndarray) -> np.ndarray:
        noise = rng.normal(0, sim.dim ** -0.5, (len(category), sim.dim))
        return _unit(cat[category] + sim.spread * noise)

    return around(world.item_category), around(world.ad_category)


def _rowwise_dot(a: np.ndarray, a_idx: np.ndarray, b: np.ndarray, b_idx: np.ndarray) -> np.ndarray:
    """⟨a[a_idx[i]], b[b_idx[i]]⟩ for every i, in chunks."""
    out = np.empty(len(a_idx))
    for lo in range(0, len(a_idx), CHUNK):
        hi = lo + CHUNK
        out[lo:hi] = np.einsum("ij,ij->i", a[a_idx[lo:hi]], b[b_idx[lo:hi]])
    return out


def similarity(world, c: dict, e: Similarity) -> np.ndarray:
    """Σ_e w_e·⟨v_item(e), v_ad⟩ / (1 + Σ_e w_e) over the row's stored ``e.stream`` events."""
    items, lengths = c[f"{e.stream}.item"]
    events, ts = c[f"{e.stream}.event"][0], c[f"{e.stream}.ts"][0]
    row = row_of(lengths)
    organic = e.stream == "organic"
    vectors = world.item_vectors if organic else world.ad_vectors
    weights = ORGANIC_EVENT_WEIGHTS if organic else ADS_EVENT_WEIGHTS
    w = decay(weights, events, ts, c["request_ts"], row, e.tau_hours)
    dot = _rowwise_dot(vectors, items, world.ad_vectors, c["ad_id"][row])
    return share(w, dot, row, len(lengths))


def _recent(c: dict, stream: str, seconds: float) -> tuple[np.ndarray, np.ndarray]:
    """(row of each stored event, whether it is at most ``seconds`` before its request)."""
    lengths = c[f"{stream}.item"][1]
    row = row_of(lengths)
    return row, c["request_ts"][row] - c[f"{stream}.ts"][0] <= seconds


def fatigue(world, c: dict, e: Fatigue) -> np.ndarray:
    """log1p(the row's stored events of both streams within ``window_hours``)."""
    n = len(c["request_ts"])
    count = np.zeros(n)
    for stream in ("organic", "ads"):
        row, recent = _recent(c, stream, e.window_hours * 3600.0)
        count += np.bincount(row, recent, minlength=n)
    return np.log1p(count)


def repeat(world, c: dict, e: Repeat) -> np.ndarray:
    """1 where a stored ads-stream event (click or conversion) of the ad's advertiser is at most
    ``days`` days old, else 0."""
    row, recent = _recent(c, "ads", e.days * float(DAY))
    same = world.ad_advertiser[c["ads.item"][0]] == c["advertiser_id"][row]
    return (np.bincount(row, recent & same, minlength=len(c["request_ts"])) > 0).astype(np.float64)


def last_k(world, c: dict, e: LastK) -> np.ndarray:
    """Share of the row's last min(k, n) stored organic events whose item's category is the ad's."""
    items, lengths = c["organic.item"]
    row = row_of(lengths)
    pos = np.arange(len(items)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    last = pos >= lengths[row] - e.k  # stored events are in time order
    match = world.item_category[items] == c["category"][row]
    hits = np.bincount(row, last & match, minlength=len(lengths))
    return hits / np.maximum(np.minimum(lengths, e.k), 1)


STATISTICS = {"similarity": similarity, "fatigue": fatigue, "repeat": repeat, "last_k": last_k}


def wide_stats(world, c: dict) -> dict[tuple, np.ndarray]:
    """Every statistic of the world's ``WideEffects`` that is on, by ``key(name)``."""
    return {key(name): STATISTICS[name](world, c, e)
            for name, e in world.structure.wide.on().items()}


def wide_terms(wide: WideEffects, stats: dict) -> dict[str, np.ndarray]:
    """The click logit's family-2 terms, in ``WideEffects`` order."""
    return {name: SIGN[name] * e.beta * stats[key(name)] for name, e in wide.on().items()}
