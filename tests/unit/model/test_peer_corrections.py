"""The peers take the logit corrections GEM's heads take (``logit_shift.LogitOutput``): a
per-(domain, task) ``out_b`` that is 0 as built (the logits unchanged), folded offsets and slopes
equal to the same shift applied from outside, ``LogitShift`` scoring as the folded model, and a
model without such an output refused by name."""

import copy

import pytest
import torch

from opengem.data.batch import collate
from opengem.model.build import build_gem, materialize
from opengem.model.logit_shift import (
    LogitShift,
    RecalibrationError,
    fold_offsets,
    gem_heads,
    offset_groups,
    own_logits,
)
from opengem.recipes import recipe
from opengem.testing import random_table, tiny_schema

ARCHS = ["dlrm", "dlrm_dcn", "din"]
OFFSETS = {"d0/click": 0.2, "d0/conversion": -0.1, "d1/click": -0.3, "d1/conversion": 0.4}


def _peer(arch):
    cfg = recipe("tiny").model
    cfg.arch = arch
    return materialize(build_gem(tiny_schema(), cfg), seed=1, base_rates=[0.1, 0.01]).eval()


def _batch():
    return collate(random_table(tiny_schema(), 64, seed=5), tiny_schema())


@pytest.mark.parametrize("arch", ARCHS)
def test_a_peer_is_its_own_output_with_a_bias_per_domain_and_task(arch):
    model, batch = _peer(arch), _batch()
    assert gem_heads(model) is model
    assert offset_groups(model, tiny_schema()) == ["d0", "d1"]
    assert model.out_b.shape == (2, 2) and model.out_b.abs().max() == 0
    assert "out_b" in model.state_dict()  # the weights carry the corrections wherever they go
    with torch.no_grad():
        raw, group = own_logits(model, batch)
        assert torch.equal(group, batch.domain)
        assert torch.equal(model.chain(raw), model(batch))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("slopes", [None, {"click": 0.6, "conversion": 1.3}])
def test_folded_offsets_and_slopes_shift_each_task_own_logit(arch, slopes):
    """The folded model's logits are chain(a · raw + offsets[domain]) of the unfolded one's."""
    model, batch = _peer(arch), _batch()
    folded = copy.deepcopy(model)
    record = {"offsets": OFFSETS, **({"slopes": slopes} if slopes else {})}
    assert fold_offsets(folded, record, tiny_schema()) is record
    a = torch.tensor([0.6, 1.3] if slopes else [1.0, 1.0], dtype=torch.float64)
    add = torch.tensor([[0.2, -0.1], [-0.3, 0.4]], dtype=torch.float64)
    with torch.no_grad():
        raw, group = own_logits(model, batch)
        want = model.chain(raw.double() * a + add[group])
        got = folded(batch).double()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_evaluation_wrapper_scores_a_peer_as_its_folded_biases():
    model, batch = _peer("din"), _batch()
    delta = torch.tensor([[0.5, 0.0], [-0.7, 0.0]], dtype=torch.float64)
    folded = copy.deepcopy(model)
    with torch.no_grad():
        folded.out_b.add_(delta.float())
        a, b = LogitShift(model, delta)(batch), folded(batch)
        assert (a - b).abs().max() < 1e-5 and (a - model(batch)).abs().max() > 0.1


def test_a_model_without_a_logit_output_is_refused_by_name():
    with pytest.raises(RecalibrationError, match="Linear has no GEM heads and no per-"):
        gem_heads(torch.nn.Linear(2, 2))
    with pytest.raises(RecalibrationError, match="Linear has no GEM heads"):
        fold_offsets(torch.nn.Linear(2, 2), {"offsets": {}}, tiny_schema())
