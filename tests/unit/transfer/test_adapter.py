"""The student adapter: identity at start, fitted on fresh labels before the student, stop-gradient target."""

import torch
from _transfer import make_batch

from opengem.model.student import build_student
from opengem.recipes import student_recipe
from opengem.transfer import trainer as trainer_mod
from opengem.transfer.adapter import StudentAdapter
from opengem.transfer.config import AdapterConfig, techniques_config
from opengem.transfer.teacher import TeacherOutput
from opengem.transfer.trainer import StudentTrainer


def test_identity_at_init_and_learns_a_calibration(schema):
    a = StudentAdapter(schema, AdapterConfig(lr=0.1, hidden=4, ids=("ad_id",)))
    b = make_batch(schema, 64)
    z = torch.full((64, 2), 2.0)  # a stale teacher: p = 0.88 on rows whose labels are mostly 0
    assert torch.allclose(a.target(z, b), torch.sigmoid(z))
    before = {n: p.clone() for n, p in a.named_parameters()}
    for _ in range(30):
        a.update(z, b)
    moved = {n for n, p in a.named_parameters() if not torch.equal(p, before[n])}
    assert {"scale", "bias", "mlp.2.weight", "ids.ad_id.weight"} <= moved
    assert a.target(z, b)[:, 0].mean() < torch.sigmoid(z)[:, 0].mean() - 0.2  # pulled toward the fresh rate


def test_target_is_a_stop_gradient(schema):
    a = StudentAdapter(schema, AdapterConfig())
    z = torch.randn(16, 2, requires_grad=True)
    t = a.target(z, make_batch(schema))
    assert not t.requires_grad and t.grad_fn is None


def test_adapter_updates_before_the_student_and_gets_no_student_gradient(schema, monkeypatch):
    cfg = student_recipe("vm_xs")
    tcfg = techniques_config("kd+adapter", domains=tuple(schema.domains.names))
    tr = StudentTrainer("s", build_student(schema, cfg, [0.1, 0.01]), cfg, tcfg, schema, total_steps=4)
    b = make_batch(schema, 32)
    tout = TeacherOutput(torch.randn(32, 2))
    seen = {}
    real = trainer_mod.distill_loss

    def spy(logits, aux, soft, *rest):
        seen["soft"] = soft
        seen["params_at_loss"] = [p.clone() for p in tr.adapter.parameters()]
        return real(logits, aux, soft, *rest)

    monkeypatch.setattr(trainer_mod, "distill_loss", spy)
    init = [p.clone() for p in tr.adapter.parameters()]
    tr.step(b, tout)
    # (1) the adapter had already moved when the student's loss was computed ...
    assert any(not torch.equal(p, q) for p, q in zip(seen["params_at_loss"], init))
    # (2) ... the student's target is its output then, without a gradient path ...
    assert not seen["soft"].requires_grad
    assert torch.allclose(seen["soft"], tr.adapter.target(tout.logits, b))
    # (3) ... and the student's backward left the adapter untouched (its grads are its own update's)
    assert all(torch.equal(p, q) for p, q in zip(tr.adapter.parameters(), seen["params_at_loss"]))
