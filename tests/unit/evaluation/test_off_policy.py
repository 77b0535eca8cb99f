"""The off-policy estimators on simulated logs whose target value is known exactly, and their
refusals of bad input.

The simulation: contexts x ~ N(0, I_3); K = 5 actions; click probability σ(θ_a·x + b_a) (base
rates a few percent, as ad clicks are); a softmax logging policy with known propensities; a
deterministic target policy (argmax of other linear scores). The true value is the population
mean of the target's click probability, computed on 2·10^6 contexts drawn apart from the logs, so
its own error is far below the tolerances. Each of ``SEEDS`` seeds logs ``N`` rows and scores
them; the reward model of DR is deliberately wrong (the truth, shifted and squashed) so the test
leans on DR's double robustness, not on a perfect q̂.

Tolerances, from the spread the test measures itself: the mean over seeds must be within
``4 × (std over seeds) / √SEEDS`` of the truth (a 4-sigma Monte-Carlo band; SNIPS's O(1/n) bias is
far inside it at n = 2,000), and the 95 % percentile-bootstrap intervals must cover the truth in
[0.88, 0.99] of the seeds (the binomial sd of a 0.95 rate over 200 seeds is 0.015, and percentile
intervals run slightly short on skewed, rare-reward estimates).
"""

import numpy as np
import pytest

from opengem.evaluation.off_policy import bootstrap_ci, check_log, dr, ips, snips

K, D, N, SEEDS, BOOT = 5, 3, 2000, 200, 300


def _world():
    rng = np.random.default_rng(12345)
    return {"theta": rng.normal(0, 0.7, (K, D)), "bias": rng.uniform(-3.5, -2.5, K),
            "logger": rng.normal(0, 0.5, (K, D)), "target": rng.normal(0, 1.0, (K, D))}


def _click_prob(w, x):
    return 1 / (1 + np.exp(-(x @ w["theta"].T + w["bias"])))


def _logging_probs(w, x):
    z = x @ w["logger"].T
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def _target_action(w, x):
    return np.argmax(x @ w["target"].T, 1)


def _true_value(w):
    x = np.random.default_rng(999).normal(size=(2_000_000, D))
    p = _click_prob(w, x)
    return p[np.arange(len(x)), _target_action(w, x)].mean()


def _log(w, seed, true_reward_model=False):
    """A logged sample; the reward model is wrong (DR must stay unbiased anyway) unless
    ``true_reward_model``."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, D))
    pb = _logging_probs(w, x)
    a = (rng.random((N, 1)) > pb.cumsum(1)).sum(1).clip(max=K - 1)
    p = _click_prob(w, x)
    r = (rng.random(N) < p[np.arange(N), a]).astype(float)
    target_a = _target_action(w, x)
    q = p if true_reward_model else 0.5 * p + 0.02
    return {"reward": r, "pscore": pb[np.arange(N), a], "target": (a == target_a).astype(float),
            "q_logged": q[np.arange(N), a], "q_target": q[np.arange(N), target_a]}


@pytest.fixture(scope="module")
def runs():
    w = _world()
    truth = _true_value(w)
    out = {"ips": [], "snips": [], "dr": []}
    for seed in range(SEEDS):
        log = _log(w, seed)
        base = (log["reward"], log["pscore"], log["target"])
        for name, fn, args in (("ips", ips, base), ("snips", snips, base),
                               ("dr", dr, (*base, log["q_logged"], log["q_target"]))):
            out[name].append(bootstrap_ci(fn, *args, n_boot=BOOT, seed=seed))
    return truth, out


@pytest.mark.parametrize("name", ["ips", "snips", "dr"])
def test_unbiased_on_a_simulated_log(runs, name):
    truth, out = runs
    values = np.array([iv.value for iv in out[name]])
    band = 4 * values.std(ddof=1) / np.sqrt(SEEDS)
    assert abs(values.mean() - truth) < band, (name, values.mean(), truth, band)


@pytest.mark.parametrize("name", ["ips", "snips", "dr"])
def test_intervals_cover_at_about_the_nominal_rate(runs, name):
    truth, out = runs
    coverage = np.mean([iv.covers(truth) for iv in out[name]])
    assert 0.88 <= coverage <= 0.99, (name, coverage)


def test_dr_with_the_true_reward_model_has_less_spread_than_ips():
    """Why DR is worth its reward model: with q̂ = the truth its error is the reward noise only."""
    w = _world()
    spread = {"ips": [], "dr": []}
    for seed in range(40):
        log = _log(w, seed, true_reward_model=True)
        base = (log["reward"], log["pscore"], log["target"])
        spread["ips"].append(ips(*base))
        spread["dr"].append(dr(*base, log["q_logged"], log["q_target"]))
    assert np.std(spread["dr"]) < np.std(spread["ips"])


def test_exact_values_on_a_tiny_log():
    r, p, t = [1.0, 0.0, 1.0, 0.0], [0.5, 0.5, 0.25, 1.0], [1.0, 1.0, 0.0, 1.0]
    assert ips(r, p, t) == pytest.approx((2 + 0 + 0 + 0) / 4)
    assert snips(r, p, t) == pytest.approx(2 / (2 + 2 + 0 + 1))
    ql, qt = [0.5, 0.5, 0.5, 0.5], [0.1, 0.1, 0.1, 0.1]
    assert dr(r, p, t, ql, qt) == pytest.approx(0.1 + (2 * 0.5 + 2 * -0.5 + 0 + 1 * -0.5) / 4)


def test_resamples_score_in_one_call():
    r = np.array([[1.0, 0.0], [0.0, 0.0]])
    assert ips(r, np.full((2, 2), 0.5), np.ones((2, 2))).tolist() == [1.0, 0.0]


def test_bootstrap_is_reproducible_and_brackets_its_value():
    rng = np.random.default_rng(0)
    r = (rng.random(500) < 0.1).astype(float)
    p, t = np.full(500, 0.2), (rng.random(500) < 0.2).astype(float)
    a, b = bootstrap_ci(ips, r, p, t, n_boot=200, seed=3), bootstrap_ci(ips, r, p, t, n_boot=200,
                                                                        seed=3)
    assert a == b and a.low <= a.value <= a.high


@pytest.mark.parametrize("pscore, words", [
    ([0.5, 0.0, 0.5], ["pscore", "outside (0, 1]", "1 of them 0", "row 1"]),
    ([0.5, -0.1, 0.5], ["pscore", "outside (0, 1]", "row 1"]),
    ([0.5, 0.5, 1.5], ["pscore", "outside (0, 1]", "row 2"]),
    ([0.5, np.nan, 0.5], ["pscore", "NaN", "row 1"]),
])
def test_bad_propensities_are_named(pscore, words):
    with pytest.raises(ValueError) as e:
        ips([0.0, 1.0, 0.0], pscore, [1.0, 1.0, 1.0])
    assert all(w in str(e.value) for w in words), str(e.value)


def test_nan_rewards_are_named():
    with pytest.raises(ValueError, match=r"reward: 1 NaN value\(s\) \(first at row 2\)"):
        snips([0.0, 1.0, np.nan], [0.5] * 3, [1.0] * 3)


def test_mismatched_lengths_are_named():
    with pytest.raises(ValueError, match="different lengths: reward .3,., pscore .2,."):
        ips([0.0, 1.0, 0.0], [0.5, 0.5], [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="q_target"):
        dr([0.0, 1.0], [0.5, 0.5], [1.0, 1.0], [0.1, 0.1], [0.1])


def test_target_probabilities_outside_the_unit_interval_are_named():
    with pytest.raises(ValueError, match="target: 1 value.* outside \\[0, 1\\]"):
        ips([0.0, 1.0], [0.5, 0.5], [1.0, 2.0])


def test_empty_and_scalar_inputs_are_named():
    with pytest.raises(ValueError, match="no logged rows"):
        check_log([], [], [])
    with pytest.raises(ValueError, match="scalar"):
        ips(1.0, 0.5, 1.0)


def test_snips_is_nan_when_the_target_never_takes_a_logged_action():
    assert np.isnan(snips([1.0, 0.0], [0.5, 0.5], [0.0, 0.0]))


def test_bootstrap_settings_are_checked():
    args = ([1.0, 0.0], [0.5, 0.5], [1.0, 1.0])
    with pytest.raises(ValueError, match="level"):
        bootstrap_ci(ips, *args, level=1.0)
    with pytest.raises(ValueError, match="n_boot"):
        bootstrap_ci(ips, *args, n_boot=0)
    with pytest.raises(ValueError, match="pscore"):
        bootstrap_ci(ips, [1.0, 0.0], [0.5, 0.0], [1.0, 1.0])
