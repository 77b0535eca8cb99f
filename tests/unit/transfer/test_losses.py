"""Each distillation loss against values computed by hand."""

import math

import pytest
import torch

from opengem.config import ConfigError
from opengem.train.losses import masked_bce
from opengem.transfer.config import techniques_config
from opengem.transfer.losses import distill_loss, kd_loss, scaled_label, soft_bce
from opengem.transfer.trainer import transfer_ratio


def _sig(z):
    return 1 / (1 + math.exp(-z))


def _h(z, p):
    """BCE(σ(z), p) for a soft label p."""
    return -(p * math.log(_sig(z)) + (1 - p) * math.log(1 - _sig(z)))


S = torch.tensor([[0.5, -1.0], [-0.2, -3.0]])  # student logits [B=2, T=2]
Z = torch.tensor([[1.0, -2.0], [0.0, -4.0]])  # teacher logits
Y = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
M = torch.tensor([[True, True], [True, False]])
W = torch.tensor([1.0, 3.0])
TW = torch.tensor([1.0, 0.5])


def test_soft_bce_weighted_mean_by_hand():
    p = torch.tensor([[0.2, 0.9], [0.5, 0.0]])
    want = ((_h(0.5, 0.2) + 3 * _h(-0.2, 0.5)) / 4) + 0.5 * (
        (_h(-1.0, 0.9) + 3 * _h(-3.0, 0.0)) / 4
    )
    assert soft_bce(S, p, W, TW).item() == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_kd_loss_is_tau_squared_bce_to_the_tempered_teacher(tau):
    want = sum(
        tw
        * sum(
            w * _h(S[b, t].item() / tau, _sig(Z[b, t].item() / tau)) for b, w in enumerate([1, 3])
        )
        / 4
        for t, tw in enumerate([1.0, 0.5])
    )
    assert kd_loss(S, Z, W, TW, tau).item() == pytest.approx(tau ** 2 * want, rel=1e-6)


def _kd_grad(s, z, cfg):
    """d(KD term)/ds: the distillation loss's gradient less the true loss's."""
    s = s.clone().requires_grad_(True)
    (distill_loss(s, None, z, Y, M, W, TW, cfg).total - masked_bce(s, Y, M, W, TW)[0]).backward()
    return s.grad


@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_a_student_equal_to_its_teacher_gets_no_kd_gradient(tau):
    cfg = techniques_config("kd")
    cfg.kd.temperature = tau
    assert _kd_grad(Z, Z, cfg).abs().max() < 1e-7
    assert _kd_grad(S, Z, cfg).abs().min() > 1e-3  # and one that differs does


def test_tau_squared_keeps_the_kd_gradient_scale_near_agreement():
    """d/ds τ² h(s/τ, σ(t/τ)) = τ(σ(s/τ) − σ(t/τ)) ≈ σ'(t/τ)(s − t): at t = 0 the same at
    every τ."""
    z, s = torch.zeros(2, 2), torch.full((2, 2), 1e-3)
    grads = {}
    for tau in (1.0, 2.0, 4.0):
        cfg = techniques_config("kd")
        cfg.kd.weight, cfg.kd.temperature = 1.0, tau
        grads[tau] = _kd_grad(s, z, cfg)
    want = 0.25 * 1e-3 * (W / W.sum())[:, None] * TW[None, :]  # σ'(0) = 1/4, row and task weights
    for tau, g in grads.items():
        assert torch.allclose(g, want, rtol=1e-3), tau


def test_label_scaling_clips_at_one():
    assert scaled_label(torch.tensor([0.1, 0.3, 0.5]), 3.0).tolist() == pytest.approx(
        [0.3, 0.9, 1.0]
    )


def test_kd_adds_the_weighted_soft_term_to_the_true_loss():
    cfg = techniques_config("kd")
    cfg.kd.weight, cfg.kd.temperature = 2.0, 2.0
    p = torch.sigmoid(Z / 2)
    true, _ = masked_bce(S, Y, M, W, TW)
    out = distill_loss(S, None, Z, Y, M, W, TW, cfg)
    want = true.item() + 2.0 * 4 * sum(tw * sum(w * _h(S[b, t].item() / 2, p[b, t].item())
                                                for b, w in enumerate([1, 3])) / 4 for t,
                                       tw in enumerate([1.0, 0.5]))
    assert out.total.item() == pytest.approx(want, rel=1e-6)
    assert out.true == pytest.approx(true.item())


def test_aux_head_gets_the_scaled_soft_label_and_the_serving_head_ground_truth_only():
    cfg = techniques_config("kd+aux")
    cfg.aux.label_scale, cfg.aux.weight = 5.0, 10.0
    aux = torch.tensor([[0.3, -0.5], [1.0, -2.0]])
    p = torch.sigmoid(Z)
    out = distill_loss(S, aux, Z, Y, M, W, TW, cfg)
    true, _ = masked_bce(S, Y, M, W, TW)
    d = sum(
        tw
        * sum(w * _h(aux[b, t].item(), min(5 * p[b, t].item(), 1.0)) for b, w in enumerate([1, 3]))
        / 4
        for t, tw in enumerate([1.0, 0.5])
    )
    assert out.total.item() == pytest.approx(true.item() + 10.0 * d, rel=1e-6)
    # the serving logits get no gradient from the soft label
    s, s2 = S.clone().requires_grad_(True), S.clone().requires_grad_(True)
    distill_loss(s, aux, Z, Y, M, W, TW, cfg).total.backward()
    masked_bce(s2, Y, M, W, TW)[0].backward()
    assert torch.allclose(s.grad, s2.grad)


def test_no_kd_is_the_trainer_loss():
    out = distill_loss(S, None, Z, Y, M, W, TW, techniques_config(""))
    assert (
        out.total.item() == pytest.approx(masked_bce(S, Y, M, W, TW)[0].item())
        and out.distill == 0.0
    )


def test_temperature_with_the_aux_head_is_refused():
    cfg = techniques_config("kd+aux")
    cfg.kd.temperature = 2.0
    with pytest.raises(ConfigError, match="temperature=1"):
        cfg.validate()


def test_transfer_ratio_by_hand():
    assert transfer_ratio(0.95, 0.90, 0.80) == pytest.approx(1 / 3)
    assert transfer_ratio(0.95, 0.80, 0.80) == pytest.approx(1.0)
    assert transfer_ratio(0.95, 0.97, 0.80) == pytest.approx(-2 / 15)
    assert math.isnan(transfer_ratio(0.80, 0.79, 0.85))  # teacher not ahead: undefined
