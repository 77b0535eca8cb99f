"""The student adapter: identity at start, fitted on fresh labels before the student,
stop-gradient target."""

import pytest
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
    a = StudentAdapter(schema, AdapterConfig(lr=0.1, hidden=4, ids=("ad_id",), ids_tasks="all"))
    b = make_batch(schema, 64)
    z = torch.full((64, 2), 2.0)  # a stale teacher: p = 0.88 on rows whose labels are mostly 0
    assert torch.allclose(a.target(z, b), z)
    before = {n: p.clone() for n, p in a.named_parameters()}
    for _ in range(30):
        a.update(z, b)
    moved = {n for n, p in a.named_parameters() if not torch.equal(p, before[n])}
    assert {"scale", "bias", "mlp.2.weight", "ids.ad_id.weight"} <= moved
    # toward the fresh rate
    assert torch.sigmoid(a.target(z, b))[:, 0].mean() < torch.sigmoid(z)[:, 0].mean() - 0.2


def test_target_is_a_stop_gradient(schema):
    a = StudentAdapter(schema, AdapterConfig())
    z = torch.randn(16, 2, requires_grad=True)
    t = a.target(z, make_batch(schema))
    assert not t.requires_grad and t.grad_fn is None


def test_adapter_updates_before_the_student_and_gets_no_student_gradient(schema, monkeypatch):
    cfg = student_recipe("vm_xs")
    tcfg = techniques_config("kd+adapter", domains=tuple(schema.domains.names))
    tr = StudentTrainer("s", build_student(schema, cfg, [0.1, 0.01]), cfg, tcfg, schema,
                        total_steps=4)
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


def _adapted_trainer(schema, tau):
    """A kd+adapter student at temperature ``tau`` whose adapter is far from the identity."""
    cfg = student_recipe("vm_xs")
    tcfg = techniques_config("kd+adapter", domains=tuple(schema.domains.names))
    tcfg.kd.temperature = tau
    tr = StudentTrainer("s", build_student(schema, cfg, [0.1, 0.01]), cfg, tcfg, schema,
                        total_steps=4)
    with torch.no_grad():
        tr.adapter.scale.fill_(0.7)
        tr.adapter.bias.fill_(-0.8)
    return tr


def test_a_student_equal_to_the_adapted_teacher_gets_no_kd_gradient(schema):
    """At τ = 2 the adapter's output is tempered like the student's logit: agreeing with it
    costs nothing."""
    tr = _adapted_trainer(schema, 2.0)
    b, tout = make_batch(schema, 32), TeacherOutput(torch.randn(32, 2))
    z = tr.teacher_logits(b, tout)
    s = z.clone().requires_grad_(True)
    no_labels = torch.zeros_like(b.label_mask)
    trainer_mod.distill_loss(s, None, z, b.labels, no_labels, b.weights, tr.task_w,
                             tr.tcfg).total.backward()
    assert s.grad.abs().max() < 1e-7


def test_a_kd_only_student_is_calibrated_to_the_adapted_teacher_at_tau_2(schema):
    """Fitted to the soft label alone (no labelled rows), the student's probabilities are the
    adapter's at τ = 2, not sharpened (the untempered σ(z') target made it converge to τ·z')."""
    tr = _adapted_trainer(schema, 2.0)
    b, tout = make_batch(schema, 64), TeacherOutput(2 * torch.randn(64, 2))
    z = tr.teacher_logits(b, tout)
    s = torch.zeros_like(z, requires_grad=True)
    opt = torch.optim.LBFGS([s], lr=1.0, max_iter=200, tolerance_grad=1e-10, tolerance_change=1e-12)
    no_labels = torch.zeros_like(b.label_mask)

    def closure():
        opt.zero_grad()
        loss = trainer_mod.distill_loss(s, None, z, b.labels, no_labels, b.weights, tr.task_w,
                                        tr.tcfg).total
        loss.backward()
        return loss

    opt.step(closure)
    assert (torch.sigmoid(s) - torch.sigmoid(z)).abs().max() < 1e-3
    assert torch.sigmoid(s).mean().item() == pytest.approx(torch.sigmoid(z).mean().item(), abs=1e-4)


def _platt_stream(schema, batches=40, n=256, a=0.5, c=-1.0, seed=0):
    """(teacher logits, batch) pairs whose task-0 labels are Bernoulli(σ(a·z + c)): a teacher that
    ranks but is miscalibrated, as a click head is for another task."""
    import dataclasses

    gen = torch.Generator().manual_seed(seed)
    b0 = make_batch(schema, n)
    out = []
    for _ in range(batches):
        z = torch.randn(n, 2, generator=gen) * 1.5 - 2.0
        y = (torch.rand(n, 2, generator=gen) < torch.sigmoid(a * z + c)).float()
        mask = torch.zeros(n, 2, dtype=torch.bool)
        mask[:, 0] = True
        out.append((z, dataclasses.replace(b0, labels=y, label_mask=mask, weights=torch.ones(n))))
    return out


def _mle(stream, domain):
    from opengem.evaluation.platt import fit_platt

    z = torch.cat([zz[b.domain == domain, 0] for zz, b in stream])
    y = torch.cat([b.labels[b.domain == domain, 0] for _, b in stream])
    return torch.tensor(fit_platt(z, y), dtype=torch.float64)


def test_newton_fit_reaches_the_platt_mle_in_one_pass_where_adam_stays_at_the_identity(schema):
    """The mismatched-objective case: 40 batches whose labels follow σ(0.5·z − 1). The online Newton
    fit ends within 0.05 of the batch maximum-likelihood (a, c) on the same rows; Adam at the
    default lr moves (a, c) by under 0.15 from (1, 0) (ExFM's per-step update, one pass)."""
    stream = _platt_stream(schema)
    newton = StudentAdapter(schema, AdapterConfig(ids=()))
    adam = StudentAdapter(schema, AdapterConfig(ids=(), fit="adam"))
    for z, b in stream:
        newton.update(z, b)
        adam.update(z, b)
    for g in stream[0][1].domain.unique().tolist():
        a, c = _mle(stream, g)
        assert abs(a - 0.5) < 0.15 and abs(c + 1.0) < 0.3  # the MLE itself is near the truth
        assert newton.scale[g, 0].item() == pytest.approx(a.item(), abs=0.05)
        assert newton.bias[g, 0].item() == pytest.approx(c.item(), abs=0.05)
        assert abs(adam.scale[g, 0].item() - 1) < 0.15 and abs(adam.bias[g, 0].item()) < 0.15
    # a task without labels in these rows keeps the identity
    assert torch.equal(newton.scale[:, 1], torch.ones_like(newton.scale[:, 1]))
    assert torch.equal(newton.bias[:, 1], torch.zeros_like(newton.bias[:, 1]))


def test_newton_adapter_has_no_adam_state_for_its_platt_part(schema):
    a = StudentAdapter(schema, AdapterConfig(ids=("ad_id",), ids_fit="adam", ids_tasks="all"))
    names = {id(p) for g in a.optimizer.param_groups for p in g["params"]}
    assert (
        id(a.scale) not in names and id(a.bias) not in names and id(a.ids["ad_id"].weight) in names
    )
    assert StudentAdapter(schema, AdapterConfig(ids=())).optimizer is None


@pytest.mark.parametrize("bad", ["transfer.adapter.fit=sgd", "transfer.adapter.prior=0",
                                 "transfer.adapter.ids_tasks=some", "transfer.adapter.ids_prior=0"])
def test_bad_adapter_fit_is_refused(bad):
    from opengem.config import ConfigError, apply_prefixed_overrides

    with pytest.raises(ConfigError, match="transfer.adapter"):
        apply_prefixed_overrides({"transfer": techniques_config("kd+adapter")},
                                 [bad])["transfer"].validate()


def test_newton_id_corrections_recover_per_id_effects(schema):
    """Labels σ(0.5·z − 1 + e[ad]) with e ~ N(0, 1): the diagonal Newton fit of the id corrections
    correlates with e at > 0.8 after one pass of 60 batches; Adam at the default lr leaves
    them near 0."""
    import dataclasses

    gen = torch.Generator().manual_seed(1)
    b0 = make_batch(schema, 256)
    adv = b0.sparse.to_dict()["ad_id"].values()
    e = torch.randn(int(adv.max()) + 1, generator=gen)
    cfgs = {k: AdapterConfig(ids=("ad_id",), ids_fit=k, ids_tasks="all")
            for k in ("newton", "adam")}
    adapters = {k: StudentAdapter(schema, c) for k, c in cfgs.items()}
    for _ in range(60):
        z = torch.randn(256, 2, generator=gen) * 1.5 - 2.0
        y = (
            torch.rand(256, 2, generator=gen) < torch.sigmoid(0.5 * z - 1.0 + e[adv].unsqueeze(1))
        ).float()
        mask = torch.zeros(256, 2, dtype=torch.bool)
        mask[:, 0] = True
        b = dataclasses.replace(b0, labels=y, label_mask=mask, weights=torch.ones(256))
        for a in adapters.values():
            a.update(z, b)
    seen = adv.unique()
    for k, a in adapters.items():
        learned = a.ids["ad_id"].weight[seen, 0].detach()
        if k == "newton":
            assert torch.corrcoef(torch.stack([learned, e[seen]]))[0, 1] > 0.8
        else:
            assert learned.abs().max() < 0.25
    assert StudentAdapter(schema, cfgs["newton"]).optimizer is None  # nothing left for Adam


def test_by_default_only_a_task_read_from_another_tasks_head_gets_id_corrections(schema):
    """A student of the teacher's own tasks gets a Platt-only adapter; with the second task read
    from the first's head (the FM lacks it), that task's id corrections move and the first task's
    stay exactly 0."""
    tasks = schema.task_names
    cfg = student_recipe("vm_xs")
    tcfg = techniques_config("kd+adapter", domains=tuple(schema.domains.names))
    own = StudentTrainer("s", build_student(schema, cfg, [0.1, 0.01]), cfg, tcfg, schema, 4,
                         teacher_tasks=tasks)
    assert own.head_idx is None and len(own.adapter.ids) == 0
    tcfg.kd.heads = (f"{tasks[1]}:{tasks[0]}",)
    tr = StudentTrainer("s", build_student(schema, cfg, [0.1, 0.01]), cfg, tcfg, schema, 4,
                        teacher_tasks=tasks[:1])
    assert tr.head_idx.tolist() == [0, 0] and tr.adapter.ids_scope.tolist() == [0.0, 1.0]
    gen = torch.Generator().manual_seed(0)
    b = make_batch(schema, 128)
    b.label_mask[:] = True
    b.labels[:] = (torch.rand(b.labels.shape, generator=gen) < 0.3).float()
    for _ in range(5):
        tr.adapter.update(torch.randn(128, 2, generator=gen), b)
    for f, emb in tr.adapter.ids.items():
        assert torch.count_nonzero(emb.weight[:, 0]) == 0, f
        assert torch.count_nonzero(emb.weight[:, 1]) > 0, f
