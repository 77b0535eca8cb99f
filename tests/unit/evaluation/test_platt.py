"""Platt scaling per task (``evaluation.platt``): the fit recovers a known slope and offset, a task
without both classes is left alone, and on a trained run the raw figures equal ``evaluate_run``'s
while the in-sample fitted figures cannot be worse; the oracle and LightGBM get the same fit."""

import logging
import math

import numpy as np
import pytest
import torch

from opengem.discipline import DisciplineError
from opengem.evaluation.platt import TaskPlatt, crossfit, evaluate_recalibrated, fit_platt


def _draw(a, c, n=40_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = 1.5 * torch.randn(n, generator=g, dtype=torch.float64) - 2.0
    return z, torch.bernoulli(torch.sigmoid(a * z + c), generator=g)


def test_fit_recovers_a_known_slope_and_offset():
    z, y = _draw(0.6, 0.4)  # an over-spread model: its logits are 1/0.6 too wide, shifted
    a, c = fit_platt(z, y)
    assert a == pytest.approx(0.6, abs=0.04) and c == pytest.approx(0.4, abs=0.08)
    a, c = fit_platt(*_draw(1.0, 0.0, seed=1))  # already calibrated: the identity
    assert a == pytest.approx(1.0, abs=0.04) and c == pytest.approx(0.0, abs=0.08)
    z, y = _draw(-0.5, -1.0, seed=2)  # a reversed ranking is not undone by a negative slope
    a, c = fit_platt(z, y)
    rate = float(y.mean())
    assert a == 0.0 and c == pytest.approx(math.log(rate / (1 - rate)), abs=1e-4)


def test_task_platt_per_task_keeps_type_and_leaves_a_one_class_task_alone():
    z, y = _draw(0.6, 0.4)
    p = torch.sigmoid(z)
    probs = torch.stack([p, p], 1).numpy()
    # task 1 has no positive on this split
    labels = torch.stack([y, torch.zeros_like(y)], 1).numpy()
    platt = TaskPlatt.fit(probs, labels)
    assert platt.params[1] is None and platt.params[0][0] == pytest.approx(0.6, abs=0.04)
    out = platt(probs)
    assert isinstance(out, np.ndarray) and out.shape == probs.shape
    np.testing.assert_allclose(out[:, 1], probs[:, 1])
    expected = torch.sigmoid(platt.params[0][0] * z + platt.params[0][1]).numpy()
    np.testing.assert_allclose(out[:, 0], expected, rtol=1e-6, atol=1e-9)
    # no labelled rows at all
    masked = TaskPlatt.fit(probs, labels, np.zeros_like(labels, dtype=bool))
    assert masked.params == [None, None]
    with pytest.raises(ValueError, match="labels in"):
        fit_platt(z, y + 1.0)
    # scores that separate the labels have no finite fit: they are kept as they are
    assert fit_platt(torch.tensor([-3.0, -2.0, 1.0, 2.0]), torch.tensor([0.0, 0.0, 1.0, 1.0])) == (
        1.0,
        0.0,
    )


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from opengem.config import apply_overrides
    from opengem.recipes import recipe
    from opengem.train.trainer import train
    from opengem.world.generate import generate
    from opengem.world.oracle import OracleCollector
    from opengem.world.presets import world_config

    logging.disable(logging.WARNING)
    root = tmp_path_factory.mktemp("platt")
    generate(world_config("tiny", seed=0, overrides=["sizes.num_users=300"]), root / "data",
             progress=False, observer=OracleCollector)
    train(apply_overrides(recipe("tiny"),
                          ["train.threads=1", "train.progress=false", "train.max_steps=30"]),
          root / "data", root / "run")
    logging.disable(logging.NOTSET)
    return root / "run", root / "data"


def test_raw_figures_are_evaluate_runs_and_the_in_sample_fit_is_no_worse(tiny_run):
    from opengem.evaluation.evaluate import evaluate_run

    run, data = tiny_run
    ref = evaluate_run(run, data, "valid", progress=False)["metrics"]
    # fitted and scored on valid: in sample
    got = evaluate_recalibrated(run, data, "valid", best=False)
    for key in ("all/click", "all/conversion"):
        assert got["metrics"][key]["ne"] == pytest.approx(ref[key]["ne"], abs=1e-9)
        assert got["metrics"][key]["auc"] == pytest.approx(ref[key]["auc"], abs=1e-9, nan_ok=True)
        # the identity is one of the fits, so the maximum-likelihood one has no higher log loss
        assert got["metrics_platt"][key]["ne"] <= got["metrics"][key]["ne"] + 1e-9
        # a map increasing in the logits (a > 0): the ranking (AUC) is unchanged
        if got["platt"][key.split("/")[1]]["a"] > 0:
            assert got["metrics_platt"][key]["auc"] == pytest.approx(
                got["metrics"][key]["auc"], abs=1e-6, nan_ok=True
            )
    assert set(got["platt"]) == {"click", "conversion"} and got["platt"]["click"]["a"] > 0
    # the oracle's own fitted figures are what the fitted model is set beside
    assert got["metrics_platt"]["all/click"].get("oracle_captured") is None  # no oracle for valid
    test = evaluate_recalibrated(run, data, "test", best=False)
    from opengem.data.parquet import DatasetManifest

    oracle = DatasetManifest.load(data).source["stats"]["oracle"]
    assert (
        test["metrics_platt"]["all/click"]["oracle_captured"]
        == oracle["platt"]["test"]["all/click"]["captured"]
    )
    assert (
        test["metrics"]["all/click"]["oracle_captured"] == oracle["test"]["all/click"]["captured"]
    )
    assert oracle["platt"]["params"]["click"]["a"] > 0
    with pytest.raises(DisciplineError):
        evaluate_recalibrated(run, data, "test", fit_split="test", best=False)


def test_crossfit_scores_each_half_with_the_other_halfs_fit(tiny_run):
    run, data = tiny_run
    got = crossfit(run, data, "valid", best=False)
    ref = evaluate_recalibrated(run, data, "valid", best=False)["metrics"]["all/click"]["ne"]
    # raw: the two halves' NE weighted by their rows is close to the whole split's
    # (normalised alike)
    assert got["click"]["ne"] == pytest.approx(ref, abs=0.02)
    assert 0 < got["click"]["ne_platt"] < 2
    with pytest.raises(DisciplineError):
        crossfit(run, data, "test", best=False)
