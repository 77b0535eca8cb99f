"""Metric values against hand computation and brute force; input validation."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from opengem.evaluation.metrics import (
    auc,
    calibration,
    calibration_slope,
    captured,
    entropy,
    gauc,
    logloss,
    ne,
    ne_bayes,
    summarize,
)

# The 4-row example used throughout.
P4 = np.array([0.9, 0.2, 0.6, 0.4])
Y4 = np.array([1, 0, 0, 1])


def brute_auc(p, y, w=None):
    """Pairwise definition: Σ_{pos i, neg j} w_i w_j ([p_i > p_j] + ½[p_i = p_j]) / (W+ W-)."""
    w = np.ones(len(p)) if w is None else np.asarray(w, dtype=float)
    num = den = 0.0
    for i, j in itertools.product(range(len(p)), repeat=2):
        if y[i] == 1 and y[j] == 0:
            pair = w[i] * w[j]
            num += pair * (1.0 if p[i] > p[j] else 0.5 if p[i] == p[j] else 0.0)
            den += pair
    return num / den if den else math.nan


# ----------------------------------------------------------------------------- logloss / ne


def test_logloss_by_hand():
    # row losses: -ln(0.9) [y=1,p=.9], -ln(1-0.2) [y=0], -ln(1-0.6) [y=0], -ln(0.4) [y=1]
    # = 0.1053605 + 0.2231436 + 0.9162907 + 0.9162907 = 2.1610855 ; / 4 = 0.5402714
    expected = -(math.log(0.9) + math.log(0.8) + math.log(0.4) + math.log(0.4)) / 4
    assert expected == pytest.approx(0.5402713827, abs=1e-10)
    assert logloss(P4, Y4) == pytest.approx(expected, rel=1e-12)


def test_logloss_weighted_by_hand():
    w = [2.0, 1.0, 1.0, 0.0]
    # (2·0.1053605 + 0.2231436 + 0.9162907 + 0·0.9162907) / (2+1+1+0) = 1.3501554 / 4
    expected = (2 * -math.log(0.9) + -math.log(0.8) + -math.log(0.4)) / 4
    assert logloss(P4, Y4, w) == pytest.approx(expected, rel=1e-12)
    assert math.isnan(logloss(P4, Y4, [0, 0, 0, 0]))


def test_logloss_clips_to_eps():
    # p = 1 with y = 0 would be infinite; clipped to 1 - eps it is -ln(eps)
    assert logloss([1.0], [0]) == pytest.approx(-math.log(1e-7), rel=1e-6)
    assert logloss([0.0], [1], eps=1e-3) == pytest.approx(-math.log(1e-3), rel=1e-12)
    assert math.isnan(logloss([], []))


def test_ne_by_hand():
    # H(0.25) = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.3465736 + 0.2157616 = 0.5623351
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert h == pytest.approx(0.5623351446, abs=1e-10)
    # NE = 0.5402714 / 0.5623351 = 0.9607640
    assert ne(P4, Y4, base_rate=0.25) == pytest.approx(0.5402713827 / h, rel=1e-9)
    assert ne(P4, Y4, base_rate=0.25) == pytest.approx(0.9607640352, abs=1e-9)
    # base rate 0.5: H = ln 2
    assert ne(P4, Y4, 0.5) == pytest.approx(0.5402713827 / math.log(2), rel=1e-9)
    # ne_bayes is ne on the true probabilities
    assert ne_bayes(P4, Y4, 0.25) == ne(P4, Y4, 0.25)


def test_ne_of_base_rate_predictor_is_one():
    y = np.array([1, 0, 0, 0, 1, 0, 0, 0])  # rate 0.25
    assert ne(np.full(8, 0.25), y, 0.25) == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize("rate", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_ne_rejects_degenerate_base_rate(rate):
    with pytest.raises(ValueError, match="base_rate"):
        ne(P4, Y4, rate)


# --------------------------------------------------------------------------------- entropy


def test_entropy_edge_cases():
    assert entropy(0.0) == 0.0
    assert entropy(1.0) == 0.0
    assert entropy(0.5) == pytest.approx(math.log(2), rel=1e-15)
    assert entropy(0.25) == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
    arr = entropy(np.array([0.0, 0.5, 1.0]))
    assert not np.isnan(arr).any()
    np.testing.assert_allclose(arr, [0.0, math.log(2), 0.0])
    assert entropy(1e-300) > 0.0  # tiny rates do not underflow to NaN
    for bad in (-0.1, 1.1, float("nan")):
        with pytest.raises(ValueError, match="rate"):
            entropy(bad)


# ------------------------------------------------------------------------------------- auc


def test_auc_with_ties_by_hand():
    p = np.array([0.1, 0.4, 0.4, 0.4, 0.8, 0.8])
    y = np.array([0, 0, 1, 1, 0, 1])
    # positives {0.4, 0.4, 0.8}, negatives {0.1, 0.4, 0.8}
    # each pos 0.4: vs 0.1 → 1, vs 0.4 → ½, vs 0.8 → 0 = 1.5 (twice → 3)
    # pos 0.8: vs 0.1 → 1, vs 0.4 → 1, vs 0.8 → ½ = 2.5 ; total 5.5 of 9 pairs
    assert auc(p, y) == pytest.approx(5.5 / 9, rel=1e-15)
    assert brute_auc(p, y) == pytest.approx(5.5 / 9, rel=1e-15)


def test_auc_simple_cases():
    assert auc(P4, Y4) == pytest.approx(0.75)  # 0.9 beats both negatives, 0.4 beats only 0.2
    assert auc([0.1, 0.9], [0, 1]) == 1.0
    assert auc([0.9, 0.1], [0, 1]) == 0.0
    assert auc([0.5, 0.5, 0.5], [0, 1, 1]) == 0.5
    assert math.isnan(auc([0.1, 0.2], [1, 1]))
    assert math.isnan(auc([0.1, 0.2], [0, 0]))
    assert math.isnan(auc([], []))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auc_random_vs_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = 200
    p = np.round(rng.random(n), 1)  # coarse rounding → many ties
    y = (rng.random(n) < p).astype(int)
    assert auc(p, y) == pytest.approx(brute_auc(p, y), rel=1e-12)
    w = rng.random(n) * 3
    assert auc(p, y, w) == pytest.approx(brute_auc(p, y, w), rel=1e-12)
    # invariant under row order
    perm = rng.permutation(n)
    assert auc(p[perm], y[perm]) == pytest.approx(auc(p, y), rel=1e-15)


# ------------------------------------------------------------------------------------ gauc


def test_gauc_by_hand():
    # user 7:  pos {0.9, 0.5}, neg {0.3, 0.7}: 0.9 beats both (2), 0.5 beats 0.3 (1) → AUC 3/4, P=2
    # user 3:  pos {0.2}, neg {0.4, 0.2, 0.1}: 0 + ½ + 1 = 1.5 of 3 → AUC 1/2, P=1
    # user 11: negatives only → skipped
    # gAUC = (2·3/4 + 1·1/2) / (2 + 1) = 2/3
    rows = [
        (7, 0.9, 1), (3, 0.4, 0), (7, 0.3, 0), (11, 0.6, 0), (3, 0.2, 1),
        (7, 0.5, 1), (11, 0.8, 0), (3, 0.2, 0), (7, 0.7, 0), (3, 0.1, 0),
    ]  # fmt: skip
    g, p, y = (np.array(c) for c in zip(*rows))
    assert gauc(p, y, g) == pytest.approx(2 / 3, rel=1e-15)


def test_gauc_random_vs_loop():
    rng = np.random.default_rng(5)
    n = 3000
    g = rng.integers(0, 300, n)
    p = np.round(rng.random(n), 1)
    y = (rng.random(n) < p).astype(int)
    num = den = 0.0
    for u in np.unique(g):
        s = g == u
        a = brute_auc(p[s], y[s]) if 0 < y[s].sum() < s.sum() else math.nan
        if not math.isnan(a):
            num += y[s].sum() * a
            den += y[s].sum()
    assert gauc(p, y, g) == pytest.approx(num / den, rel=1e-12)
    # a single group is the plain AUC
    assert gauc(p, y, np.zeros(n, int)) == pytest.approx(auc(p, y), rel=1e-12)


def test_gauc_no_qualifying_group_is_nan():
    assert math.isnan(gauc([0.1, 0.2, 0.3], [1, 0, 0], [1, 2, 2]))
    assert math.isnan(gauc([], [], []))


# ----------------------------------------------------------------------- calibration etc.


def test_calibration():
    # Σp = 0.9 + 0.2 + 0.6 + 0.4 = 2.1 ; Σy = 2 → 1.05
    assert calibration(P4, Y4) == pytest.approx(1.05, rel=1e-15)
    # weighted: (2·0.9 + 0.2 + 0.6 + 0) / (2·1 + 0 + 0 + 0) = 2.6 / 2
    assert calibration(P4, Y4, [2, 1, 1, 0]) == pytest.approx(1.3, rel=1e-15)
    assert calibration([0.1, 0.3], [0, 0]) == math.inf
    assert math.isnan(calibration([0.0, 0.0], [0, 0]))


def test_captured():
    assert captured(0.8, 0.6) == pytest.approx(0.2 / 0.4)
    assert captured(0.6, 0.6) == 1.0
    assert captured(1.0, 0.6) == 0.0
    assert math.isnan(captured(0.9, 1.0))
    assert math.isnan(captured(float("nan"), 0.5))


# ------------------------------------------------------------------------------- summarize


def test_summarize_keys_and_types():
    g = np.array([1, 1, 2, 2])
    out = summarize(P4, Y4, 0.25, groups=g)
    assert set(out) == {"ne", "auc", "gauc", "calibration", "calibration_slope", "logloss", "n",
                        "positives"}
    assert out["n"] == 4 and type(out["n"]) is int
    assert out["positives"] == 2 and type(out["positives"]) is int
    assert out["ne"] == pytest.approx(0.9607640352, abs=1e-9)
    assert out["auc"] == pytest.approx(0.75)
    # user 1: pos 0.9 vs neg 0.2 → 1 ; user 2: pos 0.4 vs neg 0.6 → 0 ; (1·1 + 1·0) / 2
    assert out["gauc"] == pytest.approx(0.5)
    assert out["calibration"] == pytest.approx(1.05)
    assert all(type(v) in (int, float) for v in out.values())
    json.dumps(out)


def test_summarize_with_true_probs():
    p_true = np.array([0.8, 0.1, 0.3, 0.7])
    out = summarize(P4, Y4, 0.25, p_true=p_true)
    assert math.isnan(out["gauc"])
    nb = ne(p_true, Y4, 0.25)
    assert out["ne_bayes"] == pytest.approx(nb)
    assert out["captured"] == pytest.approx((1 - out["ne"]) / (1 - nb))
    # unknown base rate → NE-based values are NaN, the rest still computed
    out = summarize(P4, Y4, None, p_true=p_true)
    assert math.isnan(out["ne"]) and math.isnan(out["ne_bayes"]) and math.isnan(out["captured"])
    assert out["auc"] == pytest.approx(0.75)
    json.dumps(out)


def test_summarize_empty():
    out = summarize([], [], 0.3, groups=[])
    assert out["n"] == 0 and out["positives"] == 0
    assert all(math.isnan(out[k])
               for k in ("ne", "auc", "gauc", "calibration", "calibration_slope", "logloss"))


# ---------------------------------------------------------------------------------- errors


FUNCS_PY = [logloss, auc, calibration, lambda p, y: ne(p, y, 0.3), lambda p,
            y: gauc(p, y, np.arange(len(p)))]


@pytest.mark.parametrize("fn", FUNCS_PY)
def test_errors_name_the_problem(fn):
    with pytest.raises(ValueError, match="length mismatch"):
        fn(np.array([0.1, 0.2, 0.3]), np.array([0, 1]))
    with pytest.raises(ValueError, match="NaN"):
        fn(np.array([0.1, np.nan]), np.array([0, 1]))
    with pytest.raises(ValueError, match="0 or 1"):
        fn(np.array([0.1, 0.2]), np.array([0, 2]))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        fn(np.array([0.1, 1.2]), np.array([0, 1]))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        fn(np.array([-0.1, 0.5]), np.array([0, 1]))
    with pytest.raises(ValueError, match="1-D"):
        fn(np.array([[0.1, 0.2]]), np.array([[0, 1]]))


def test_other_input_errors():
    with pytest.raises(ValueError, match="length mismatch"):
        gauc([0.1, 0.2], [0, 1], [1, 2, 3])
    with pytest.raises(ValueError, match="length mismatch"):
        logloss([0.1, 0.2], [0, 1], w=[1.0])
    with pytest.raises(ValueError, match="weights"):
        auc([0.1, 0.2], [0, 1], w=[1.0, -1.0])
    with pytest.raises(ValueError, match="labels"):
        logloss([0.1, 0.2], [0, np.nan])
    with pytest.raises(ValueError, match="p_true"):
        summarize(P4, Y4, 0.3, p_true=[0.1, 0.2, 0.3, np.nan])
    with pytest.raises(ValueError, match="length mismatch"):
        summarize(P4, Y4, 0.3, p_true=[0.1, 0.2])
    with pytest.raises(ValueError, match="base_rate"):
        summarize(P4, Y4, 0.0)


def test_calibration_slope_reads_how_spread_the_logits_are():
    rng = np.random.default_rng(0)
    z = rng.normal(-2.0, 1.5, 50_000)
    y = rng.random(z.size) < 1 / (1 + np.exp(-z))  # labels drawn from σ(z)
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    assert calibration_slope(sig(z), y) == pytest.approx(1.0, abs=0.04)  # calibrated
    # logits twice too spread
    assert calibration_slope(sig(2 * z), y) == pytest.approx(0.5, abs=0.02)
    # an offset does not matter
    assert calibration_slope(sig(0.5 * z + 1.0), y) == pytest.approx(2.0, abs=0.08)
    assert math.isnan(calibration_slope(sig(z), np.zeros(z.size)))  # one class
    assert math.isnan(calibration_slope(np.full(z.size, 0.1), y))  # constant predictions
    # separable: no finite fit
    assert math.isnan(calibration_slope([0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1]))
