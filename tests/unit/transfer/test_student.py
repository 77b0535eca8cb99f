"""Students: presets, the representation features, the aux head's gradient scaling."""

import pytest
import torch
from _transfer import make_batch, make_gem

from opengem.export.program import serving_module
from opengem.model.build import build_gem, count_parameters
from opengem.model.heads import HeadsConfig
from opengem.model.student import (
    build_student,
    forward_with_features,
    grad_scale,
    rep_dim_of,
    student_schema,
    with_rep,
)
from opengem.recipes import student_recipe, student_recipe_names


def test_presets_grow_along_one_dial(schema):
    sizes = [count_parameters(build_gem(schema, student_recipe(n).model))["total"]
             for n in student_recipe_names()]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
    assert (
        not student_recipe("vm_xs").model.use_sequences
        and student_recipe("vm_s").model.use_sequences
    )
    assert student_recipe("tiny").recipe == "tiny"  # a trainer recipe is a (large) student too
    with pytest.raises(ValueError, match="vm_xs"):
        student_recipe("vm_xxl")


def test_forward_with_features_is_the_models_forward(schema):
    gem = make_gem(schema).eval()
    b = make_batch(schema)
    logits, feats = forward_with_features(gem, b)
    assert torch.equal(logits, gem(b)) and torch.equal(feats, gem.features(b))


def test_rep_features_extend_the_schema_and_the_batch(schema):
    s = student_schema(schema, 5)
    assert rep_dim_of(s) == 5 and rep_dim_of(schema) == 0 and len(s.dense) == len(schema.dense) + 5
    assert all(f.group == "user" for f in s.dense[-5:])
    b = make_batch(schema, 4)
    rep = torch.arange(20.0).view(4, 5)
    b2 = with_rep(b, rep)
    assert torch.equal(b2.dense[:, -5:], rep) and torch.equal(b2.dense[:, :-5], b.dense)


def test_grad_scale_is_identity_forward_scaled_backward():
    x = torch.tensor([1.0, -2.0], requires_grad=True)
    y = grad_scale(x, 7.0)
    assert torch.equal(y, x)
    (y * torch.tensor([3.0, 5.0])).sum().backward()
    assert x.grad.tolist() == [21.0, 35.0]


def _aux_grads(schema, beta):
    cfg = student_recipe("vm_xs")
    st = build_student(schema, cfg, [0.1, 0.01], seed=0,
                       aux_heads=HeadsConfig(trunk_dims=(8,), task_dims=(4,)),
                       aux_grad_scale=beta)
    _, aux = st.forward_train(make_batch(schema))
    aux.sum().backward()  # the distillation head's loss only
    backbone = {n: p.grad.clone() for n, p in st.backbone.named_parameters() if p.grad is not None}
    head = {n: p.grad.clone() for n, p in st.aux.named_parameters()}
    return backbone, head


def test_gradient_scaling_scales_the_backbone_gradient_not_the_heads(schema):
    b1, h1 = _aux_grads(schema, 1.0)
    b5, h5 = _aux_grads(schema, 5.0)
    assert b1 and set(b1) == set(b5)
    for n in b1:
        assert torch.allclose(b5[n], 5.0 * b1[n], rtol=1e-5, atol=1e-6), n  # float32 rounding
    norm = lambda g: torch.sqrt(sum((v.double() ** 2).sum() for v in g.values()))
    assert (norm(b5) / norm(b1)).item() == pytest.approx(5.0, rel=1e-5)
    for n in h1:
        assert torch.allclose(h5[n], h1[n]), n  # the head itself learns at its own rate


def test_aux_head_starts_at_the_scaled_base_rate(schema):
    st = build_student(schema, student_recipe("vm_xs"), [0.1, 0.01],
                       aux_heads=HeadsConfig(trunk_dims=(8,)),
                       aux_label_scale=3.0)
    assert torch.sigmoid(st.aux.out_b[0, 0]).item() == pytest.approx(0.3, rel=1e-5)
    assert serving_module(st).gem is st.backbone and st.forward(make_batch(schema)).shape == (16, 2)
