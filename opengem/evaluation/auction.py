"""What a ranking is worth in an ads auction: expected clicks, conversions and spend per request.

Each request has K candidate ads, each with a bid per objective event (a click or a conversion,
the campaign's choice) and a policy's ranking score. The auction is the generalised second-price
auction ads platforms run: eligible candidates (score at least the reserve) are ranked by score,
the top S take slots 0 … S − 1, and the ad in slot j pays, per objective event,
``min(bid_j, max(score_{j+1}, reserve) / q_j)`` where ``q_j`` is the policy's own predicted
objective probability (score = bid × q), so an ad pays what it needed to keep its slot.

Outcomes are *expected* ones, from the true probabilities of each candidate in each slot
(``p_true[n, k, j, task]``, task 0 click, task 1 conversion = click and convert): no labels are
drawn, so two policies differ only by how they rank, not by sampling noise of the outcomes.
Spend is also the platform's revenue (pay-per-event, nothing else is charged).

Pure numpy, no world and no model: ``opengem.world.replay`` builds the candidates and the truth.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

OUTCOMES = ("clicks", "conversions", "spend", "value")
CLICK, CONVERSION = 0, 1


@dataclass(frozen=True)
class Market:
    """The candidates of N requests: ``bid`` [N, K] per objective event (> 0), ``objective``
    [N, K] (0 click, 1 conversion), ``eligible`` [N, K] (False: padding or a duplicate ad) and
    ``p_true`` [N, K, S, 2], each candidate's true click and conversion probability in each slot."""

    bid: np.ndarray
    objective: np.ndarray
    eligible: np.ndarray
    p_true: np.ndarray

    def __post_init__(self):
        n, k = self.bid.shape
        if self.objective.shape != (n, k) or self.eligible.shape != (n, k):
            raise ValueError(f"bid {self.bid.shape}, objective {self.objective.shape} and "
                             f"eligible {self.eligible.shape} must all be [requests, candidates]")
        if self.p_true.ndim != 4 or self.p_true.shape[:2] != (n, k) or self.p_true.shape[3] != 2:
            raise ValueError(f"p_true must be [requests, candidates, slots, 2], got "
                             f"{self.p_true.shape}")
        if not (np.isfinite(self.bid) & (self.bid > 0))[self.eligible].all():
            raise ValueError("every eligible candidate needs a finite bid > 0")
        if not np.isin(self.objective, (CLICK, CONVERSION)).all():
            raise ValueError("objective must be 0 (click) or 1 (conversion)")

    @property
    def slots(self) -> int:
        return self.p_true.shape[2]

    def objective_prob(self, p: np.ndarray) -> np.ndarray:
        """The probability of each candidate's own objective from [N, K, 2] (click, conversion)."""
        return np.where(self.objective == CONVERSION, p[..., CONVERSION], p[..., CLICK])


def run_auction(market: Market, q: np.ndarray | None, reserve: float = 0.0,
                rng: np.random.Generator | None = None,
                score: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Per-request expected outcomes ([N] each of ``OUTCOMES``) of ranking by ``bid × q``.

    ``q`` [N, K] is the policy's predicted probability of each candidate's objective at the top
    slot. ``score`` instead ranks by any other key (a random order: the floor); such a policy
    predicts nothing to price by, so its spend is NaN. Ties are broken uniformly at random
    (``rng``), so a constant model ranks like random ranking among equal bids in expectation.
    ``value`` is the bid-weighted objective events delivered: what advertisers said the outcomes
    are worth to them.
    """
    n, k = market.bid.shape
    if (q is None) == (score is None):
        raise ValueError("give the policy's probabilities q or a ranking score, not both")
    if q is not None:
        if q.shape != (n, k):
            raise ValueError(f"q must be [requests, candidates] = {(n, k)}, got {q.shape}")
        if not (np.isfinite(q) & (q >= 0) & (q <= 1))[market.eligible].all():
            raise ValueError("predicted probabilities must be finite and in [0, 1]")
        score = market.bid * q
    if not np.isfinite(reserve) or reserve < 0:
        raise ValueError(f"reserve must be a finite number >= 0, got {reserve}")
    rng = rng if rng is not None else np.random.default_rng(0)
    ok = market.eligible & (score >= reserve) if q is not None else market.eligible.copy()
    key = np.where(ok, score, -np.inf)
    # random tie-break: a random permutation, then a stable sort on the score
    perm = np.argsort(rng.random((n, k)), axis=1)
    order = np.take_along_axis(perm, np.argsort(-np.take_along_axis(key, perm, 1), axis=1,
                                                kind="stable"), 1)
    s = market.slots
    pad = max(s + 1 - k, 0)  # fewer candidates than slots + 1: the next score is "none"
    ranked = np.pad(order, ((0, 0), (0, pad)), constant_values=0)
    ranked_ok = np.pad(np.take_along_axis(ok, order, 1), ((0, 0), (0, pad)))
    rows = np.arange(n)[:, None]
    win, won = ranked[:, :s], ranked_ok[:, :s]
    slot = np.arange(s)[None, :]
    p_click = np.where(won, market.p_true[rows, win, slot, CLICK], 0.0)
    p_conv = np.where(won, market.p_true[rows, win, slot, CONVERSION], 0.0)
    obj = market.objective[rows, win]
    p_obj = np.where(obj == CONVERSION, p_conv, p_click)
    bid = market.bid[rows, win]
    out = {"clicks": p_click.sum(1), "conversions": p_conv.sum(1),
           "value": np.where(won, bid * p_obj, 0.0).sum(1)}
    if q is None:
        out["spend"] = np.full(n, np.nan)
        return out
    nxt = np.where(ranked_ok[:, 1:s + 1], score[rows, ranked[:, 1:s + 1]], 0.0)
    q_win = q[rows, win]
    with np.errstate(divide="ignore", invalid="ignore"):
        price = np.minimum(bid, np.maximum(nxt, reserve) / q_win)
    price = np.where(won & (q_win > 0), price, 0.0)
    out["spend"] = (price * p_obj).sum(1)
    return out


def totals(per_request: dict[str, np.ndarray], idx: np.ndarray | None = None) -> dict[str, float]:
    """Sums over requests (``idx``: a resample's rows), with cost per conversion = spend ÷
    conversions over all ads (the platform's figure, click campaigns' spend included)."""
    t = {k: float(v[idx].sum() if idx is not None else v.sum()) for k, v in per_request.items()}
    t["cost_per_conversion"] = t["spend"] / t["conversions"] if t["conversions"] > 0 else np.nan
    return t


def lifts(policies: dict[str, dict[str, np.ndarray]], baseline: str, resamples: int = 200,
          seed: int = 0, level: float = 0.9) -> dict[str, dict]:
    """Each policy's totals ÷ the baseline's on the same requests, with a percentile interval over
    ``resamples`` bootstrap resamples of the requests (paired: one resample for every policy, so
    the interval is that of the difference between rankings, not of the requests' own spread)."""
    if baseline not in policies:
        raise ValueError(f"baseline {baseline!r} is not one of the policies {sorted(policies)}")
    n = len(next(iter(policies.values()))["clicks"])
    rng = np.random.default_rng(seed)
    draws = [rng.integers(0, n, n) for _ in range(resamples)]
    base = [totals(policies[baseline], i) for i in draws]
    lo_q, hi_q = (1 - level) / 2, (1 + level) / 2
    out = {}
    for name, pr in policies.items():
        point, whole = totals(pr), totals(policies[baseline])
        drawn = [totals(pr, i) for i in draws]
        entry = {}
        for m in (*OUTCOMES, "cost_per_conversion"):
            if not np.isfinite(point[m]) or not np.isfinite(whole[m]) or whole[m] == 0:
                continue
            r = np.array([d[m] / b[m] for d, b in zip(drawn, base) if b[m]])
            entry[m] = {"ratio": point[m] / whole[m],
                        "lo": float(np.quantile(r, lo_q)), "hi": float(np.quantile(r, hi_q))}
        out[name] = entry
    return out
