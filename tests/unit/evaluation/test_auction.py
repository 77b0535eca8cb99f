"""The auction of the outcome replay: prices and outcomes by hand on one request, a constant
model ranks like random among equal bids in expectation, lifts of a policy over itself are 1, and
bad markets are refused by name."""

import numpy as np
import pytest

from opengem.evaluation.auction import CLICK, CONVERSION, Market, lifts, run_auction, totals


def _market(n=1, k=3, s=2, bid=None, objective=None, p=None, eligible=None):
    return Market(bid=np.ones((n, k)) if bid is None else bid,
                  objective=np.zeros((n, k), dtype=np.int64) if objective is None else objective,
                  eligible=np.ones((n, k), dtype=bool) if eligible is None else eligible,
                  p_true=np.full((n, k, s, 2), 0.1) if p is None else p)


def test_one_request_by_hand():
    """Scores 2×0.10, 1×0.30, 4×0.02 = 0.20, 0.30, 0.08: slot 0 is ad 1, slot 1 ad 0; ad 1 pays
    0.20 / 0.30 per click (capped by its bid 1), ad 0 pays 0.08 / 0.10 = 0.8 per conversion."""
    bid = np.array([[2.0, 1.0, 4.0]])
    obj = np.array([[CONVERSION, CLICK, CLICK]])
    q = np.array([[0.10, 0.30, 0.02]])
    p = np.zeros((1, 3, 2, 2))
    p[0, :, 0, CLICK], p[0, :, 1, CLICK] = [0.2, 0.4, 0.1], [0.1, 0.2, 0.05]
    p[0, :, 0, CONVERSION], p[0, :, 1, CONVERSION] = [0.02, 0.04, 0.01], [0.01, 0.02, 0.005]
    out = run_auction(_market(bid=bid, objective=obj, p=p), q)
    assert out["clicks"][0] == pytest.approx(0.4 + 0.1)  # ad 1 in slot 0, ad 0 in slot 1
    assert out["conversions"][0] == pytest.approx(0.04 + 0.01)
    spend = (0.20 / 0.30) * 0.4 + (0.08 / 0.10) * 0.01  # price × the objective's probability
    assert out["spend"][0] == pytest.approx(spend)
    assert out["value"][0] == pytest.approx(1.0 * 0.4 + 2.0 * 0.01)
    # a reserve above the third score: the last winner pays the reserve, not the third's score
    out = run_auction(_market(bid=bid, objective=obj, p=p), q, reserve=0.1)
    assert out["spend"][0] == pytest.approx((0.20 / 0.30) * 0.4 + (0.1 / 0.10) * 0.01)
    # and a reserve above every score but one leaves slot 1 empty
    out = run_auction(_market(bid=bid, objective=obj, p=p), q, reserve=0.25)
    assert out["clicks"][0] == pytest.approx(0.4)


def test_a_constant_model_ranks_like_random_among_equal_bids():
    rng = np.random.default_rng(0)
    n, k, s = 400, 6, 3
    p = np.sort(rng.uniform(0.01, 0.2, (n, k, s, 2)), axis=2)[:, :, ::-1]
    m = _market(n, k, s, p=p)
    const = np.mean([run_auction(m, np.full((n, k), 0.05), rng=np.random.default_rng(i))["clicks"]
                     .sum() for i in range(50)])
    rand = np.mean([run_auction(m, None, score=np.random.default_rng(100 + i).random((n, k)))
                    ["clicks"].sum() for i in range(50)])
    # each run sums 3 × 400 draws of p; over 50 runs the means differ by well under 0.5 %
    assert const == pytest.approx(rand, rel=0.005)
    truth = run_auction(m, p[:, :, 0, CLICK])["clicks"].sum()
    assert truth > 1.1 * rand  # 1.19 on this draw


def test_lifts_of_a_policy_over_itself_are_one():
    rng = np.random.default_rng(1)
    n, k = 200, 5
    m = _market(n, k, 2, p=rng.uniform(0.01, 0.1, (n, k, 2, 2)), bid=rng.uniform(0.5, 2, (n, k)))
    a = run_auction(m, rng.uniform(0.01, 0.1, (n, k)))
    b = run_auction(m, m.p_true[:, :, 0, CLICK])
    out = lifts({"a": a, "b": b}, "a", resamples=50)
    assert out["a"]["clicks"] == {"ratio": 1.0, "lo": 1.0, "hi": 1.0}
    r = out["b"]["clicks"]
    assert r["lo"] <= r["ratio"] <= r["hi"] and r["ratio"] > 1
    assert totals(b)["cost_per_conversion"] == pytest.approx(b["spend"].sum()
                                                            / b["conversions"].sum())


@pytest.mark.parametrize("bad, match", [
    (dict(bid=np.array([[1.0, 0.0, 1.0]])), "bid > 0"),
    (dict(bid=np.array([[1.0, np.nan, 1.0]])), "bid > 0"),
    (dict(objective=np.array([[0, 2, 0]])), "objective"),
    (dict(p=np.zeros((1, 3, 2))), "p_true"),
    (dict(eligible=np.ones((1, 2), dtype=bool)), "must all be"),
])
def test_bad_markets_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        _market(**bad)


def test_bad_policies_are_refused():
    m = _market()
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        run_auction(m, np.array([[0.1, 1.5, 0.2]]))
    with pytest.raises(ValueError, match="not both"):
        run_auction(m, np.full((1, 3), 0.1), score=np.ones((1, 3)))
    with pytest.raises(ValueError, match="reserve"):
        run_auction(m, np.full((1, 3), 0.1), reserve=-1.0)
    with pytest.raises(ValueError, match="baseline"):
        lifts({"a": run_auction(m, np.full((1, 3), 0.1))}, "b")
