"""Recalibration: the fitted offsets recover known ones (a plain and a chained task), a thin slice
stays near 0, an unlabelled task keeps 0 (applying and validating the offsets
file: tests/unit/test_run.py)."""

import pytest
import torch

from opengem.evaluation.recalibrate import fit_offsets, fit_recalibration
from opengem.model.heads import Heads, HeadsConfig
from opengem.model.logit_shift import RecalibrationError
from opengem.testing import tiny_schema


def _rows(delta, n=40_000, seed=0):
    """Raw logits and labels drawn from σ(raw + δ[group]) through the heads' chain (click
    → conversion)."""
    g = torch.Generator().manual_seed(seed)
    group = torch.randint(0, delta.shape[0], (n,), generator=g)
    raw = torch.stack([torch.randn(n, generator=g) - 1.0, 0.7 * torch.randn(n, generator=g) - 1.0],
                      1).double()
    true = raw + delta[group]
    click = torch.bernoulli(torch.sigmoid(true[:, 0]), generator=g)
    conv = click * torch.bernoulli(torch.sigmoid(true[:, 1]), generator=g)
    return {"raw": raw, "group": group, "labels": torch.stack([click, conv], 1).double(),
            "mask": torch.ones(n, 2, dtype=torch.bool),
            "weights": torch.ones(n, dtype=torch.float64)}


def test_fit_recovers_known_offsets_for_plain_and_chained_tasks():
    heads = Heads(8, tiny_schema(), HeadsConfig())
    assert heads.parent == [-1, 0]  # conversion is chained below click
    delta = torch.tensor([[0.3, -0.2], [-0.15, 0.25]], dtype=torch.float64)
    got = fit_offsets(heads, _rows(delta), num_groups=2)
    assert torch.allclose(got, delta, atol=0.08), got
    # nothing to correct: offsets near 0
    assert fit_offsets(heads, _rows(torch.zeros(2, 2), seed=1), num_groups=2).abs().max() < 0.08


def test_a_thin_slice_is_held_near_zero_by_the_prior():
    heads = Heads(8, tiny_schema(), HeadsConfig())
    rows = _rows(torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=torch.float64), n=40)
    wide = fit_offsets(heads, rows, 2, prior_std=100.0)
    tight = fit_offsets(heads, rows, 2, prior_std=0.05)
    assert tight.abs().max() < 0.1 < wide[:, 0].abs().max()
    with pytest.raises(RecalibrationError, match="prior_std"):
        fit_offsets(heads, rows, 2, prior_std=0.0)


def test_unlabelled_task_keeps_zero():
    heads = Heads(8, tiny_schema(), HeadsConfig())
    rows = _rows(torch.full((2, 2), 0.5, dtype=torch.float64), n=2_000)
    rows["mask"][:, 1] = False
    got = fit_offsets(heads, rows, 2)
    assert got[:, 1].abs().max() == 0 and got[:, 0].abs().min() > 0.1


def test_platt_form_recovers_known_slopes_and_offsets():
    """Labels drawn from chain(a · raw + c_g): the ``platt`` form finds a per task and the additions
    c per (group, task) (a loose prior: the additions here are far from the ``offset`` form's 0)."""
    heads = Heads(8, tiny_schema(), HeadsConfig())
    a = torch.tensor([0.6, 0.8], dtype=torch.float64)
    c = torch.tensor([[0.3, -0.2], [-0.15, 0.25]], dtype=torch.float64)
    g = torch.Generator().manual_seed(4)
    n = 60_000
    group = torch.randint(0, 2, (n,), generator=g)
    raw = torch.stack([1.5 * torch.randn(n, generator=g) - 1.0, torch.randn(n, generator=g) - 1.0],
                      1).double()
    true = heads.chain(raw * a + c[group])
    click = torch.bernoulli(torch.sigmoid(true[:, 0]), generator=g)
    cond = torch.sigmoid(raw[:, 1] * a[1] + c[group, 1])
    conv = click * torch.bernoulli(cond, generator=g)
    rows = {"raw": raw, "group": group, "labels": torch.stack([click, conv], 1).double(),
            "mask": torch.ones(n, 2, dtype=torch.bool),
            "weights": torch.ones(n, dtype=torch.float64)}
    slopes, add = fit_recalibration(heads, rows, 2, prior_std=10.0, form="platt")
    assert torch.allclose(slopes, a, atol=0.05), slopes
    assert torch.allclose(add, c, atol=0.1), add
    # the offset form is the platt form with slopes held at 1
    s1, add1 = fit_recalibration(heads, rows, 2, form="offset")
    assert torch.equal(s1, torch.ones(2, dtype=torch.float64)) and torch.equal(
        add1, fit_offsets(heads, rows, 2)
    )
    with pytest.raises(RecalibrationError, match="form"):
        fit_recalibration(heads, rows, 2, form="isotonic")


def test_per_segment_offsets_help_where_segments_are_miscalibrated():
    """Labels drawn with an offset per segment on top of one per group: cross-fitted on halves by
    user, offsets per segment lower the held-out log loss and the calibration spread; with no
    segment offsets to find, the prior keeps them from hurting."""
    from opengem.evaluation.recalibrate import crossfit_segment_rows

    heads = Heads(8, tiny_schema(), HeadsConfig())
    g = torch.Generator().manual_seed(5)
    n = 40_000
    seg = torch.randint(0, 4, (n,), generator=g)
    by_seg = torch.tensor([[-0.5, 0.0], [0.0, 0.0], [0.3, 0.0], [0.6, 0.0]], dtype=torch.float64)
    rows = _rows(torch.tensor([[0.2, 0.0], [-0.1, 0.0]], dtype=torch.float64), n=n, seed=6)
    true = rows["raw"] + by_seg[seg]
    rows["labels"][:, 0] = torch.bernoulli(torch.sigmoid(true[:, 0] + 0.2 * (rows["group"] == 0)
                                                         - 0.1 * (rows["group"] == 1)),
                                           generator=g)
    rows["labels"][:, 1] = rows["labels"][:, 0] * rows["labels"][:, 1]
    rows.update(segment=seg, user_id=torch.arange(n))
    got = crossfit_segment_rows(heads, rows, ["click", "conversion"], 4, min_rows=1000)["click"]
    assert got["segment"]["logloss"] < got["domain"]["logloss"] - 0.005
    assert got["segment"]["calibration_ratio"] < 1.15 < got["domain"]["calibration_ratio"]
    flat = _rows(torch.zeros(2, 2), n=n, seed=7)
    flat.update(segment=seg, user_id=torch.arange(n))
    same = crossfit_segment_rows(heads, flat, ["click", "conversion"], 4)["click"]
    assert same["segment"]["logloss"] < same["domain"]["logloss"] + 2e-4
