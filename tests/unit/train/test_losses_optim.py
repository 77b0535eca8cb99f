import math

import torch

from opengem.config import OptimConfig
from opengem.train.losses import masked_bce
from opengem.train.optim import lr_factor


def _bce(z, y):
    p = 1 / (1 + math.exp(-z))
    return -(y * math.log(p) + (1 - y) * math.log(1 - p))


def test_masked_weighted_bce_by_hand():
    logits = torch.tensor([[0.0, 1.0], [2.0, -1.0], [-1.0, 0.5]])
    labels = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    mask = torch.tensor([[True, True], [True, False], [True, True]])
    w = torch.tensor([1.0, 2.0, 1.0])
    dom = torch.tensor([0, 1, 1])
    loss, table = masked_bce(logits, labels, mask, w, torch.tensor([1.0, 0.5]), dom, 2)
    t0 = (_bce(0, 1) * 1 + _bce(2, 0) * 2 + _bce(-1, 1) * 1) / 4
    t1 = (_bce(1, 0) * 1 + _bce(0.5, 1) * 1) / 2
    assert abs(loss.item() - (t0 + 0.5 * t1)) < 1e-6
    assert abs(table[0, 0].item() - _bce(0, 1)) < 1e-6
    assert abs(table[1, 0].item() - (_bce(2, 0) * 2 + _bce(-1, 1)) / 3) < 1e-6
    assert abs(table[1, 1].item() - _bce(0.5, 1)) < 1e-6  # the masked row does not count


def test_empty_slice_is_nan_not_zero():
    loss, table = masked_bce(torch.zeros(2, 1), torch.zeros(2, 1),
                             torch.ones(2, 1, dtype=torch.bool),
                             torch.ones(2), torch.ones(1), torch.tensor([0, 0]), 3)
    assert not math.isnan(table[0, 0].item()) and math.isnan(table[2, 0].item())


def test_lr_schedule_warmup_then_cosine():
    cfg = OptimConfig(warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    assert lr_factor(0, 100, cfg) == 0.1 and lr_factor(9, 100, cfg) == 1.0
    assert abs(lr_factor(10, 100, cfg) - 1.0) < 1e-9
    assert abs(lr_factor(55, 100, cfg) - 0.55) < 1e-9
    assert abs(lr_factor(100, 100, cfg) - 0.1) < 1e-9
    assert lr_factor(50, 100, OptimConfig(warmup_steps=0, schedule="constant")) == 1.0
