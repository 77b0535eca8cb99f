"""The world's surface task (mismatched objectives): off, the world is byte-identical; on,
a third label on one surface drawn from its stored probability, absent from the FM's view and
present for the student, whose KD reads the FM's closest head."""

import hashlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from opengem.data.loader import ShardLoader
from opengem.features.schema import FeatureSchema, SchemaError
from opengem.model.build import build_gem, materialize
from opengem.recipes import student_recipe
from opengem.transfer.config import techniques_config
from opengem.transfer.distill import make_trainer
from opengem.transfer.objectives import check_teacher_schema, fm_view, head_map, without_tasks
from opengem.transfer.teacher import TeacherOutput
from opengem.world.generate import generate
from opengem.world.latent import SURFACE_TASK, SURFACES
from opengem.world.presets import world_config

# sha256 over the shards, dataset.json and schema.json of world_config("tiny", seed=5,
# num_users=150), as written at c52dc7d (layout v1), before the surface task existed (the option off
# must not move a byte)
DEFAULT_DIGEST = "0e8d7487e6460fc8f867a5f6c43f2ed620e694d232a2e0c30219e5016e4bc7e9"


def _digest(out: Path, manifest) -> str:
    h = hashlib.sha256()
    for f in sorted(manifest.files, key=lambda f: f.path):
        h.update((out / f.path).read_bytes())
    h.update((out / "dataset.json").read_bytes())
    h.update((out / "schema.json").read_bytes())
    return h.hexdigest()


def test_option_off_is_the_default_world_byte_for_byte(tmp_path):
    m = generate(world_config("tiny", seed=5, overrides=["sizes.num_users=150"]), tmp_path,
                 progress=False,
                 # the layout the digest was written in (another issue may change the default)
                 layout="v1")
    assert _digest(tmp_path, m) == DEFAULT_DIGEST
    assert "surface_task" not in m.source["config"] and "e0" not in m.source["stats"]["calibration"]
    assert FeatureSchema.load(tmp_path).task_names == ["click", "conversion"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("surface_task")
    cfg = world_config("tiny", seed=1,
                       overrides=["sizes.num_users=1200", "surface_task.enabled=true",
                                                  "surface_task.target_rate=0.1"])
    m = generate(cfg, out, progress=False)
    t = pa.concat_tables([pq.read_table(out / f.path) for f in m.files])
    return out, cfg, m, t


def test_the_surface_label_follows_its_drawn_probability_on_its_surface_only(world):
    out, cfg, m, t = world
    assert FeatureSchema.load(out).task_names == ["click", "conversion", SURFACE_TASK]
    y = t[SURFACE_TASK].to_numpy(zero_copy_only=False).astype(np.float64)
    p = t[f"p_{SURFACE_TASK}"].to_numpy()
    on = t["domain"].to_numpy() == cfg.surface_task.surface
    assert SURFACES[cfg.surface_task.surface] == "video" and on.sum() > 3000
    assert np.isnan(y[~on]).all() and np.isnan(p[~on]).all()  # only that surface logs it
    assert set(np.unique(y[on])) == {0.0, 1.0} and ((p[on] > 0) & (p[on] < 1)).all()
    n, mean_p = on.sum(), p[on].mean()
    # 4 σ of the mean of independent Bernoulli draws
    tol = 4 * np.sqrt((p[on] * (1 - p[on])).sum()) / n
    assert abs(y[on].mean() - mean_p) < tol
    assert abs(mean_p - 0.1) < 0.03  # e0 calibrated on block 0 to target_rate
    # rows with a higher drawn probability are positive more often (the label is drawn from p,
    # not apart)
    hi = p[on] > np.median(p[on])
    assert y[on][hi].mean() > 1.5 * y[on][~hi].mean()
    # it shares part of click's drivers, and is not click
    corr = np.corrcoef(np.log(p[on]), np.log(t["p_click"].to_numpy()[on]))[0, 1]
    assert 0.2 < corr < 0.95
    assert (
        m.source["config"]["surface_task"]["enabled"] is True
        and "e0" in m.source["stats"]["calibration"]
    )


def test_the_fm_view_lacks_the_task_and_the_student_has_it_reading_the_closest_head(
    world, tmp_path
):
    out, cfg, m, _ = world
    data = FeatureSchema.load(out)
    view = fm_view(out, tmp_path / "fm_view", [SURFACE_TASK])
    fm_schema = FeatureSchema.load(view)
    assert (
        fm_schema.task_names == ["click", "conversion"] and SURFACE_TASK not in fm_schema.columns()
    )
    assert fm_schema.fingerprint() == without_tasks(data, [SURFACE_TASK]).fingerprint()
    assert sorted(p.name for p in view.iterdir()) == sorted(p.name for p in out.iterdir())
    check_teacher_schema(fm_schema, data)  # a task view of the data: accepted
    with pytest.raises(SchemaError):
        check_teacher_schema(data, fm_schema)
    assert head_map(data.task_names, fm_schema.task_names) == [0, 1, 0]
    assert head_map(data.task_names, fm_schema.task_names, ("engage:conversion",)) == [0, 1, 1]

    rcfg = student_recipe("vm_xs")
    fm = materialize(build_gem(fm_schema, rcfg.model), "cpu", 0, [0.1, 0.01])
    teacher = type("T", (), {"model": fm, "feature_dim": fm.feature_dim})()
    tr = make_trainer("s", rcfg, techniques_config("kd", domains=("video",)), data, teacher, {}, 10)
    assert tr.student.schema.task_names == data.task_names  # the student's own task is there
    batch = next(iter(ShardLoader(out, "train", 64, data, shuffle=False, epochs=1, prefetch=0)))
    logits = torch.randn(batch.batch_size, 2)
    b, tout = tr.view(batch, TeacherOutput(logits))
    rows = torch.isin(batch.domain, tr.domains)
    assert tout.logits.shape[1] == 3 and torch.equal(tout.logits[:, 2], logits[rows][:, 0])
    # video rows: every one labelled
    assert b.labels.shape[1] == 3 and bool(b.label_mask[:, 2].all())
