"""The world's units and primitives, below the simulator (``latent``) and its family-2 effects
(``wide``), which both read them: seconds per day, the rng tags that keep each draw on its own
stream, the event-type weights of the history terms, and the decayed-match arithmetic."""

from __future__ import annotations

import numpy as np

DAY = 86400
TAG_GLOBAL, TAG_BLOCK, TAG_DAY, TAG_STRUCTURE = 0, 1, 2, 3
# the optional ad content vectors (click.content_dim > 0); 4 is the oracle's subsample
TAG_CONTENT = 5
# family 2 (``opengem.world.wide``): its structure draws, its item and ad vectors
TAG_WIDE, TAG_ITEM_VECTORS = 9, 10
# the auction replay's market (``opengem.world.replay``): bids and objectives, never written
TAG_MARKET = 11

ORGANIC_EVENT_WEIGHTS = np.array([1.0, 2.0, 3.0, 2.5])  # w_type in the sequence-match term
ADS_EVENT_WEIGHTS = np.array([1.0, 3.0])  # click, conversion in the ads-history term


def rng_for(seed: int, *tags: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed), *[int(t) for t in tags]]))


def row_of(lengths: np.ndarray) -> np.ndarray:
    """Each event's row, for events stored row after row with ``lengths`` per row."""
    return np.repeat(np.arange(len(lengths)), lengths)


def decay(type_weights, events, ts, request_ts, row, tau_hours) -> np.ndarray:
    """Each event's weight: its type's weight × exp(−age / τ), age in seconds before the request."""
    return type_weights[events] * np.exp(-(request_ts[row] - ts) / (tau_hours * 3600.0))


def share(w, match, row, n) -> np.ndarray:
    """Per row, Σ w·match / (1 + Σ w): the weighted share of matching events."""
    return np.bincount(row, w * match, minlength=n) / (1.0 + np.bincount(row, w, minlength=n))
