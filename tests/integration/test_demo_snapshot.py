"""The demo's distil step reads GEM's published snapshot, and its numbers are those of
the checkpoint.

``demo`` trains with ``publish_end=True``: the final model is also published as the snapshot of the
last train day, which ``distill_demo``'s teacher then reads (recalibration included, since that
snapshot is the run's final model). Distilling from a copy of the run without snapshots (the teacher
then reads the latest checkpoint, as before) must give the same student, to the digit.
"""

import json
import shutil

import pytest
import torch

from opengem.checkpoint import list_snapshots, snapshot_dir
from opengem.evaluation.recalibrate import recalibrate_run
from opengem.pipeline import distill_demo
from opengem.recipes import recipe
from opengem.run import TRANSFER_FILE, load_run_model
from opengem.train.trainer import params_sha256, train
from opengem.world.generate import generate
from opengem.world.presets import world_config


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_demo_distils_from_the_published_snapshot_with_unchanged_numbers(tmp_path):
    data, run, bare = tmp_path / "data", tmp_path / "run", tmp_path / "bare"
    generate(world_config("tiny", seed=2), data, progress=False)
    cfg = recipe("tiny")
    cfg.train.progress = False
    final = train(cfg, data, run, publish_end=True)
    (path, meta), = list_snapshots(run)
    assert final["snapshot"] == path.name == "day-00001" and final["days"] == meta["days"] == [0, 1]
    assert meta["step"] == final["steps"]
    assert (
        params_sha256(load_run_model(run, recalibrated=False, snapshot=path)[0])
        == final["params_sha256"]
    )
    recalibrate_run(run, data, "valid", progress=False)
    shutil.copytree(run, bare)
    shutil.rmtree(snapshot_dir(bare))

    got, want = distill_demo(run, data,
                             tmp_path / "vm"), distill_demo(bare, data, tmp_path / "vm_bare")
    assert json.loads((tmp_path / "vm" / TRANSFER_FILE).read_text())["teacher_snapshot"][
        "path"
    ] == str(path)
    assert (
        json.loads((tmp_path / "vm_bare" / TRANSFER_FILE).read_text())["teacher_snapshot"] is None
    )
    for part in ("metrics", "teacher", "alone"):
        assert got[part] == want[part], part  # recalibrated teacher, same student, every metric
    assert got["transfer_ratio"] == want["transfer_ratio"]


def test_a_fresh_run_refuses_a_directory_holding_another_runs_snapshots(tmp_path):
    """A fresh train into a used run directory would keep the old run's published snapshot (a
    snapshot already published is never rewritten), and the demo's distil step would then read the
    old model."""
    from opengem.config import ConfigError

    data, run = tmp_path / "data", tmp_path / "run"
    generate(world_config("tiny", seed=2, overrides=["sizes.num_users=120"]), data, progress=False)
    cfg = recipe("tiny")
    cfg.train.progress, cfg.train.max_steps = False, 3
    train(cfg, data, run, publish_end=True)
    # another model: its snapshot must not be mixed with the old one
    cfg.model.count_decay_hours = (1.0,)
    with pytest.raises(ConfigError,
                       match=r"already holds a training run \(LATEST, snapshots\).*--resume"):
        train(cfg, data, run, publish_end=True)
    assert len(list_snapshots(run)) == 1  # refused before anything was written
