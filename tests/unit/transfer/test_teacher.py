"""The teacher service: frozen, once per example for every student, user cache, Parquet cache."""

import pytest
import torch
from _transfer import make_batch, make_gem, write_dataset

from opengem.recipes import student_recipe
from opengem.train.trainer import params_sha256
from opengem.transfer.config import techniques_config
from opengem.transfer.distill import make_trainer
from opengem.transfer.stream import SliceStream, slice_rates
from opengem.transfer.teacher import CachedTeacher, TeacherService, UserRepCache
from opengem.transfer.trainer import evaluate_students, train_students


def test_teacher_is_frozen_and_gives_no_gradient(schema):
    t = TeacherService(make_gem(schema))
    assert not t.model.training and not any(p.requires_grad for p in t.model.parameters())
    out = t.predict(make_batch(schema))
    assert out.logits.shape == (16, 2) and out.embeddings.shape == (16, t.feature_dim)
    assert out.logits.grad_fn is None and out.embeddings.grad_fn is None


def test_teacher_runs_once_per_example_for_several_students_and_is_not_updated(schema, tmp_path):
    data = write_dataset(tmp_path / "data", schema)
    teacher = TeacherService(make_gem(schema, dim=8))
    calls = []
    teacher.model.heads.register_forward_hook(lambda m, i, o: calls.append(o.shape[0]))
    sha = params_sha256(teacher.model)
    rates, n_slice, _ = slice_rates(data, schema, "valid", [0, 1])
    stream = SliceStream(data, "valid", schema, [0, 1], teacher, 16, seed=0)
    names = ["kd", "kd+aux+adapter", "kd+rep+share", ""]
    trainers = [make_trainer(n or "alone", student_recipe("vm_xs"),
                             techniques_config(n, domains=("d0", "d1")),
                             schema, teacher, rates, stream.steps) for n in names]
    train_students(trainers, stream)
    assert sum(calls) == n_slice == teacher.rows == 96  # every example scored exactly once ...
    # ... in one call (a 2048-row chunk), shared by 4 students ...
    assert len(calls) == teacher.calls == 1
    # ... stepping on 16-row pieces
    assert all(tr.examples == 96 and tr.step_n == 6 for tr in trainers)
    stream2 = SliceStream(data, "valid", schema, [0, 1], teacher, 16, seed=0, teacher_batch=16)
    train_students(trainers[:2], stream2)
    assert teacher.calls == 1 + 6 and teacher.rows == 2 * 96  # one call per 16-row batch
    assert params_sha256(teacher.model) == sha  # the teacher did not learn
    ev = evaluate_students(trainers,
                           SliceStream(data, "test", schema, [0, 1], teacher, 64, shuffle=False,
                                                 update_cache=False), schema, rates)
    assert ev["kd"]["all/click"]["n"] == 64 and ev["teacher@kd"]["all/click"]["n"] == 64
    assert params_sha256(teacher.model) == sha


def test_students_of_one_surface_read_only_their_rows(schema, tmp_path):
    data = write_dataset(tmp_path / "data", schema, rows_per_day=(200, 64))
    teacher = TeacherService(make_gem(schema))
    rates, n_slice, n_all = slice_rates(data, schema, "valid", [1])
    stream = SliceStream(data, "valid", schema, [1], teacher, 32, seed=0)
    tr = make_trainer("s", student_recipe("vm_xs"), techniques_config("kd", domains=("d1",)),
                      schema, teacher, rates, stream.steps)
    train_students([tr], stream)
    assert 0 < n_slice < n_all and tr.examples == n_slice == teacher.rows
    assert rates["click"] == pytest.approx(rates["d1/click"])  # NE's normaliser is the slice's rate


def test_user_cache_serves_the_last_published_snapshot():
    c = UserRepCache(2)
    users = torch.tensor([7, 3, 7])
    c.update(users, torch.tensor([[1.0, 0.0], [5.0, 5.0], [3.0, 2.0]]))
    assert torch.equal(c.lookup(users), torch.zeros(3, 2))  # written, not yet published
    c.publish()
    assert c.lookup(torch.tensor([7, 3, 9])).tolist() == [[2.0, 1.0], [5.0, 5.0], [0.0, 0.0]]
    for i in range(3000):  # grows past its first buffer; unpublished users stay unknown
        c.update(torch.tensor([100 + i]), torch.ones(1, 2))
    assert c.lookup(torch.tensor([3099])).abs().sum() == 0
    d = UserRepCache.from_state_dict(c.state_dict())  # the published snapshot is what is saved
    assert torch.equal(d.lookup(torch.tensor([7, 3, 3099])), c.lookup(torch.tensor([7, 3, 3099])))


def test_teacher_publishes_the_cache_when_the_day_changes(schema):
    t = TeacherService(make_gem(schema))
    b = make_batch(schema, 8)
    first = t.predict(b, day=0)
    assert first.user_rep.abs().sum() == 0  # day 0 reads the (empty) snapshot of the days before it
    again = t.predict(b, day=0)
    assert again.user_rep.abs().sum() == 0  # the same day: rows of day 0 are not visible yet
    nxt = t.predict(b, day=1)
    assert torch.allclose(nxt.user_rep[0], first.embeddings[b.user_id == b.user_id[0]].mean(0))


def test_parquet_cache_replays_the_teacher_in_row_order(schema, tmp_path):
    data = write_dataset(tmp_path / "data", schema)
    live = TeacherService(make_gem(schema))
    writer = TeacherService(make_gem(schema))
    path = tmp_path / "cache" / "valid.parquet"
    s = SliceStream(data, "valid", schema, [0, 1], writer, 24, seed=3)
    assert writer.cache_to_parquet(s.batches(), path, meta={"split": "valid", "seed": 3}) == 96
    cached = CachedTeacher(path, schema.task_names)
    assert cached.meta == {"split": "valid", "seed": 3}
    for batch, day in SliceStream(data, "valid", schema, [0, 1], live, 24, seed=3).batches():
        a, b = live.predict(batch, day=day), cached.predict(batch, day=day)
        assert torch.allclose(a.logits, b.logits) and torch.allclose(a.embeddings, b.embeddings)
        assert torch.allclose(a.user_rep, b.user_rep)
    with pytest.raises(ValueError, match="do not match"):  # another row order is refused
        CachedTeacher(path, schema.task_names).predict(make_batch(schema, 24, seed=9))


def test_an_online_domain_fm_teaches_each_batch_before_it_learns_from_it(schema, tmp_path):
    from types import SimpleNamespace

    data = write_dataset(tmp_path / "data", schema)
    gem = TeacherService(make_gem(schema))
    rates, _, _ = slice_rates(data, schema, "valid", [0, 1])
    stream = SliceStream(data, "valid", schema, [0, 1], gem, 32, seed=0)
    doms = ("d0", "d1")
    fm = make_trainer("fm", student_recipe("vm_s"), techniques_config("kd", domains=doms), schema,
                      gem, rates, 3)
    live = SimpleNamespace(model=fm.student.backbone, feature_dim=fm.student.backbone.feature_dim)
    vm = make_trainer("vm", student_recipe("vm_xs"), techniques_config("kd", domains=doms), schema,
                      live, rates, 3)
    seen, real_step = [], vm.step

    def spy(batch, tout):
        ref = fm.teach(batch, tout)  # what the FM says *now*, i.e. after its own step on this batch
        seen.append((tout.logits.clone(), ref.logits.clone()))
        return real_step(batch, tout)

    vm.step = spy
    train_students([fm], stream, {"fm": [vm]})
    assert len(seen) == 3 and vm.examples == 96 and gem.rows == 96 and gem.calls == 1
    # taught with pre-update scores
    assert all(not torch.allclose(given, after) for given, after in seen)
