"""Staleness as a knob: a student of day d reads the newest snapshot that has seen up to d − 1
− lag."""

import pytest
from _transfer import gem_config, make_gem

from opengem.checkpoint import CheckpointError, save_snapshot
from opengem.config import Config, ConfigError, apply_prefixed_overrides
from opengem.data.parquet import ShardWriter
from opengem.run import save_config, save_schema
from opengem.testing import random_table
from opengem.train.trainer import params_sha256
from opengem.transfer.config import TransferConfig
from opengem.transfer.distill import gem_snapshot
from opengem.transfer.teacher import TeacherService, teacher_snapshot

PUBLISHED = (0, 1, 3)  # a run that published after days 0, 1 and 3 (day 2's publish never happened)


@pytest.fixture
def gem_run(schema, tmp_path):
    """A run directory with three snapshots, each a different model: (run, sha256 per
    snapshot day)."""
    run = tmp_path / "gem"
    run.mkdir()
    save_config(run, Config(model=gem_config()))
    save_schema(run, schema)
    shas = {}
    for i, day in enumerate(PUBLISHED):
        model = make_gem(schema, seed=i)
        save_snapshot(run, day, model, {"schema": schema.fingerprint(), "step": 10 * i},
                      {"last_day": day, "days": list(range(day + 1)), "step": 10 * i})
        shas[day] = params_sha256(model)
    return run, shas


@pytest.mark.parametrize("day, lag, want",
                         [(4, 0, 3), (4, 1, 1), (4, 2, 1), (4, 3, 0), (2, 0, 1), (1, 0, 0),
                                            (9, 0, 3), (3, 0, 1)])
def test_lag_selects_the_newest_snapshot_that_has_seen_up_to_d_minus_1_minus_lag(
    gem_run, day, lag, want
):
    run, shas = gem_run
    path, meta = teacher_snapshot(run, day, lag)
    assert path.name == f"day-{want:05d}" and meta["last_day"] == want <= day - 1 - lag
    teacher = TeacherService.from_run(run, snapshot=path)
    assert params_sha256(teacher.model) == shas[want]  # that snapshot's model, not another


def test_no_qualifying_snapshot_names_the_day_the_lag_and_the_snapshots(gem_run, schema, tmp_path):
    run, _ = gem_run
    with pytest.raises(CheckpointError) as e:
        teacher_snapshot(run, 4, 4)
    msg = str(e.value)
    assert "days up to -1" in msg and "student of day 4" in msg and "transfer.snapshot_lag=4" in msg
    assert "day-00000 (up to day 0), day-00001 (up to day 1), day-00003 (up to day 3)" in msg
    with pytest.raises(CheckpointError, match="snapshots: none"):
        teacher_snapshot(tmp_path, 4, 0)


def test_negative_lag_is_refused():
    with pytest.raises(ConfigError, match="snapshot_lag .* must be >= 0, got -1"):
        TransferConfig(snapshot_lag=-1).validate()
    with pytest.raises(ConfigError, match="got -2"):
        apply_prefixed_overrides({"": Config(), "transfer": TransferConfig()},
                                 ["transfer.snapshot_lag=-2"])
    with pytest.raises(ConfigError, match="got -1"):
        teacher_snapshot(".", 4, -1)
    trees = apply_prefixed_overrides({"": Config(), "transfer": TransferConfig()},
                                     ["transfer.snapshot_lag=2"])
    assert trees["transfer"].snapshot_lag == 2 and TransferConfig().snapshot_lag is None


def test_distill_reads_the_lagged_snapshot_of_the_students_first_day(gem_run, schema, tmp_path):
    run, shas = gem_run
    data = tmp_path / "data"
    w = ShardWriter(data, schema)
    for day in range(6):
        w.write(random_table(schema, 8, seed=day), f"d{day:03d}", day)
    w.close({"train": [0, 1, 2, 3], "valid": [4], "test": [5]})
    assert gem_snapshot(run, data, TransferConfig(snapshot_lag=0))[0].name == "day-00003"
    assert gem_snapshot(run, data, TransferConfig(snapshot_lag=1))[0].name == "day-00001"
    assert gem_snapshot(run, data, TransferConfig())[0].name == "day-00003"  # unset: the newest
    assert params_sha256(TeacherService.from_run(run).model) == shas[3]
    with pytest.raises(CheckpointError, match="student of day 5 with transfer.snapshot_lag=5"):
        gem_snapshot(run, data, TransferConfig(snapshot_lag=5, train_split="test"))
