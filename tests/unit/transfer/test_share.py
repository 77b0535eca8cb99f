"""Parameter sharing: copy, PCA projection, rescaling, freezing."""

import torch
from _transfer import make_gem

from opengem.model.student import build_student
from opengem.recipes import student_recipe
from opengem.transfer.config import ShareConfig, techniques_config
from opengem.transfer.share import project_table, share_parameters
from opengem.transfer.trainer import StudentTrainer


def test_projection_keeps_the_leading_directions():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(50, 2, generator=g) @ torch.randn(2, 6, generator=g) + 1e-3 * torch.randn(
        50, 6, generator=g
    )
    p = project_table(w, 2)
    assert p.shape == (50, 2)
    assert torch.allclose(p @ p.T, w @ w.T, atol=1e-3)  # a rank-2 table keeps its inner products
    assert torch.equal(project_table(w, 6), w)
    # a narrower teacher gives its columns only
    assert torch.equal(project_table(w[:, :3], 5), w[:, :3])
    # fewer rows than dims: as many directions as rows
    assert project_table(w[:3], 4).shape == (3, 3)


def test_share_copies_tables_by_name_and_can_freeze(schema):
    teacher = make_gem(schema, dim=8, seed=1)
    cfg = student_recipe("vm_xs")  # D = 8: same width, plain copies
    st = build_student(schema, cfg, [0.1, 0.01])
    shared = share_parameters(st.backbone, teacher, ShareConfig(rescale=False, freeze=True))
    mine, theirs = st.backbone.sparse_arch.tables(), teacher.sparse_arch.tables()
    assert "t_ad_id" in shared and "domain_emb" in shared
    # a student without towers has no sequence tables
    assert set(shared) - {"domain_emb"} == set(mine)
    for n in mine:
        assert torch.equal(mine[n], theirs[n]) and not mine[n].requires_grad
    tr = StudentTrainer("s", st, cfg, techniques_config("kd+share", domains=("d0",)), schema, 4)
    owned = {id(p) for o in tr.optimizers for g in o.param_groups for p in g["params"]}
    assert not any(id(w) in owned for w in mine.values())  # frozen tables are not optimised


def test_rescaled_share_keeps_geometry_at_the_students_scale(schema):
    teacher = make_gem(schema, dim=16, seed=1)
    with torch.no_grad():
        for w in teacher.sparse_arch.tables().values():
            w.mul_(6.0)  # trained tables are wider than the init
    st = build_student(schema, student_recipe("vm_xs"), [0.1, 0.01])
    init_std = st.backbone.sparse_arch.tables()["t_ad_id"].std()
    share_parameters(st.backbone, teacher, ShareConfig())
    w = st.backbone.sparse_arch.tables()["t_ad_id"]
    assert torch.allclose(w.std(), init_std, rtol=1e-4)
    ref = project_table(teacher.sparse_arch.tables()["t_ad_id"].detach(), 8)
    cos = torch.nn.functional.cosine_similarity(w.flatten(), ref.flatten(), dim=0)
    assert cos > 0.9999


def test_a_wider_student_keeps_its_init_beyond_the_teachers_columns(schema):
    """D_s = 16 > D_t = 8: columns 8.. are the student's initialisation, untouched by the copy and
    the rescaling; columns ..8 are the teacher's, at the init's std."""
    teacher = make_gem(schema, dim=8, seed=1)
    with torch.no_grad():
        for w in teacher.sparse_arch.tables().values():
            w.mul_(6.0)
    st = build_student(schema, student_recipe("vm_m"), [0.1, 0.01])  # D = 16
    init = {n: w.clone() for n, w in st.backbone.sparse_arch.tables().items()}
    share_parameters(st.backbone, teacher, ShareConfig())
    w = st.backbone.sparse_arch.tables()["t_ad_id"]
    assert torch.equal(w[:, 8:], init["t_ad_id"][:, 8:])
    assert torch.allclose(w[:, :8].std(), init["t_ad_id"][:, :8].std(), rtol=1e-4)
    t = teacher.sparse_arch.tables()["t_ad_id"].detach()
    assert torch.allclose(w[:, :8] / w[:, :8].std(), t / t.std(), atol=1e-5)
