"""Continuous training (``opengem.train.continual``): a continued run equals one stream over the
same days, the schedule past its horizon, snapshots published per day and never read half-written,
and the clear errors of a continuation that cannot be."""

import json
import math
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from opengem.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_snapshots,
    newest_snapshot,
    save_snapshot,
)
from opengem.cli import main
from opengem.config import ConfigError, apply_overrides
from opengem.data.parquet import DatasetManifest
from opengem.recipes import recipe
from opengem.run import load_run_model
from opengem.train.continual import check_days, parse_days
from opengem.train.optim import lr_factor
from opengem.train.trainer import continue_training, params_sha256, train
from opengem.transfer.teacher import TeacherService
from opengem.world.generate import generate
from opengem.world.presets import world_config

B = 64
# constant after a short warm-up: the two runs compared below then have the same lr at every step
SAME_SCHEDULE = (f"data.batch_size={B}", "optim.schedule=constant", "optim.warmup_steps=5",
                 "train.log_every=1", "train.threads=1")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny world: days 0, 1 train, 2 valid, 3 test."""
    data = tmp_path_factory.mktemp("tiny") / "data"
    generate(world_config("tiny", seed=1), data, progress=False)
    return data


def _cfg(*overrides):
    cfg = apply_overrides(recipe("tiny"), [*SAME_SCHEDULE, *overrides])
    cfg.train.progress = False
    return cfg


def _day_steps(data, days):
    rows = {}
    for f in DatasetManifest.load(data).files:
        rows[f.day] = rows.get(f.day, 0) + f.rows
    return [math.ceil(rows[d] / B) for d in days]


def _state(ckpt, path):
    """Every tensor of a checkpoint (model, both optimizers)."""
    dcp_to_torch_save(ckpt, path)
    return torch.load(path, weights_only=False)


def _flat(x, where=""):
    if isinstance(x, dict):
        for k in sorted(x, key=str):
            yield from _flat(x[k], f"{where}.{k}")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _flat(v, f"{where}[{i}]")
    else:
        yield where, x


def _assert_same_state(a, b):
    fa, fb = dict(_flat(a)), dict(_flat(b))
    assert fa.keys() == fb.keys()
    for k in fa:
        if isinstance(fa[k], torch.Tensor):
            assert torch.equal(fa[k], fb[k]), k
        else:
            assert fa[k] == fb[k], k


@pytest.fixture(scope="module")
def streams(tiny, tmp_path_factory):
    """A: a stream over days 0, 1 continued over day 2; B: one stream over days 0-2
    (same schedule)."""
    root = tmp_path_factory.mktemp("streams")
    first = train(_cfg(), tiny, root / "A", days=[0, 1])
    a = continue_training(root / "A", tiny, [2], ["train.progress=false"])
    b = train(_cfg(), tiny, root / "B", days=[0, 1, 2])
    return root, first, a, b


def test_continued_run_equals_one_stream_over_the_same_days(tiny, streams, tmp_path):
    root, first, a, b = streams
    steps = _day_steps(tiny, [0, 1, 2])
    assert first["steps"] == steps[0] + steps[1] and first["days"] == [0, 1]
    assert (
        a["steps"] == b["steps"] == sum(steps)
        and a["examples"] == b["examples"] == 966 + 1008 + 1025
    )
    assert a["params_sha256"] == b["params_sha256"] and a["days"] == b["days"] == [0, 1, 2]
    # the whole checkpoint: model and both optimizers' state (the AdamW step count ran on across
    # the legs)
    sa = _state(latest_checkpoint(root / "A"), tmp_path / "a.pt")
    sb = _state(latest_checkpoint(root / "B"), tmp_path / "b.pt")
    _assert_same_state(sa, sb)
    adam = [v for v in sa["optim"]["state"].values() if "exp_avg" in v]
    assert adam and all(int(v["step"]) == sum(steps) for v in adam)
    # row-wise Adagrad
    tables = [v for k, v in sa["optim"]["state"].items() if k.startswith("sparse_arch")]
    assert tables and all("sum" in v for v in tables)
    # one snapshot per day, each saying what it has seen, the same model in both runs
    for run in ("A", "B"):
        metas = [m for _, m in list_snapshots(root / run)]
        assert [m["last_day"] for m in metas] == [0, 1, 2]
        assert [m["days"] for m in metas] == [[0], [0, 1], [0, 1, 2]]
        assert [m["step"] for m in metas] == [steps[0], steps[0] + steps[1], sum(steps)]
    for (pa, _), (pb, _) in zip(list_snapshots(root / "A"), list_snapshots(root / "B")):
        ma = load_run_model(root / "A", snapshot=pa)[0]
        assert params_sha256(ma) == params_sha256(load_run_model(root / "B", snapshot=pb)[0])
    last = list_snapshots(root / "A")[-1][0]
    assert params_sha256(load_run_model(root / "A", snapshot=last)[0]) == a["params_sha256"]


def test_continuing_a_plain_run_reads_its_schedule_past_the_horizon(tiny, tmp_path):
    """A plain cosine run ends near the floor; its continuation stays on it: no second warm-up."""
    cfg = apply_overrides(recipe("tiny"),
                          [f"data.batch_size={B}", "optim.warmup_steps=5", "train.log_every=1",
                                           "train.threads=1"])
    cfg.train.progress = False
    plain = train(cfg, tiny, tmp_path / "run")
    # a plain run publishes nothing
    assert "days" not in plain and not list_snapshots(tmp_path / "run")
    config = (tmp_path / "run" / "config.json").read_text()
    (tmp_path / "run"
     / "recalibration.json").write_text(json.dumps({"offsets": {"all/click": 0.1}}))
    final = continue_training(tmp_path / "run", tiny, [2],
                              ["train.progress=false", "data.prefetch=0"])
    # the leg's overrides are the leg's
    assert (tmp_path / "run" / "config.json").read_text() == config
    # fitted on the model the run moved past
    assert not (tmp_path / "run" / "recalibration.json").exists()
    assert (tmp_path / "run" / f"recalibration-step-{plain['steps']:08d}.json").exists()
    day2 = _day_steps(tiny, [2])[0]
    assert final["steps"] == plain["steps"] + day2 and final["days"] == [0, 1, 2]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    new = [x for x in lines if x["step"] > plain["steps"]]
    assert [x["step"] for x in new] == list(range(plain["steps"] + 1, final["steps"] + 1))
    assert [x["lr_factor"] for x in new] == pytest.approx([cfg.optim.min_lr_ratio] * len(new))
    last = lines[plain["steps"] - 1]["lr_factor"]  # the plain run's last step, just above the floor
    assert (
        last == pytest.approx(lr_factor(plain["steps"] - 1, plain["steps"], cfg.optim))
        and 0.1 < last < 0.11
    )
    (path, meta), = list_snapshots(tmp_path / "run")
    assert path.name == "day-00002" and meta["days"] == [0, 1, 2] and meta["step"] == final["steps"]


def test_a_capped_plain_run_continues_past_its_cap(tiny, tmp_path):
    """max_steps was the first pass's length (the horizon); the stream goes on without it."""
    cfg = apply_overrides(recipe("tiny"),
                          [f"data.batch_size={B}", "optim.warmup_steps=2", "train.max_steps=5",
                                           "train.log_every=1", "train.threads=1"])
    cfg.train.progress = False
    assert train(cfg, tiny, tmp_path / "run")["steps"] == 5
    with pytest.raises(ConfigError, match="max_steps cannot cut a stream"):
        continue_training(tmp_path / "run", tiny, [2], ["train.max_steps=3"])
    final = continue_training(tmp_path / "run", tiny, [2], ["train.progress=false"])
    assert final["steps"] == 5 + _day_steps(tiny, [2])[0] and final["days"] == [0, 1, 2]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["lr_factor"] for x in lines[5:]] == pytest.approx(
        [cfg.optim.min_lr_ratio] * (final["steps"] - 5)
    )


def test_a_half_written_snapshot_is_never_read(streams, tmp_path):
    root, _, _, b = streams
    run = tmp_path / "B"
    shutil.copytree(root / "B", run)
    snaps = run / "snapshots"
    # a publish killed before its rename: day-00003.tmp is complete but for its snapshot.json
    shutil.copytree(snaps / "day-00002", snaps / "day-00003.tmp")
    (snaps / "day-00003.tmp" / "snapshot.json").unlink()
    # and one whose files never all arrived under the final name (e.g. copied by hand)
    (snaps / "day-00004").mkdir()
    (snaps / "day-00004" / "snapshot.json").write_text(json.dumps({"last_day": 4}))
    assert [p.name for p, _ in list_snapshots(run)] == ["day-00000", "day-00001", "day-00002"]
    path, meta = newest_snapshot(run)
    assert path.name == "day-00002" and meta["last_day"] == 2
    teacher = TeacherService.from_run(run)  # reads the newest complete snapshot
    assert params_sha256(teacher.model) == b["params_sha256"]
    # the next publish clears the stale .tmp and renames its own
    model = load_run_model(run, snapshot=path)[0]
    save_snapshot(run, 3, model, {"step": 99}, {"last_day": 3, "days": [0, 1, 2, 3], "step": 99})
    assert not (snaps / "day-00003.tmp").exists()
    assert [m["last_day"] for _, m in list_snapshots(run)] == [0, 1, 2, 3]


def test_a_day_without_a_valid_row_is_passed_over(tiny, tmp_path):
    """Every row of day 2 quarantined: nothing to train or publish there, day 3 goes on (no
    endless loop)."""
    data = tmp_path / "data"
    shutil.copytree(tiny, data)
    day2 = [f for f in DatasetManifest.load(data).files if f.day == 2]
    for info in day2:
        t = pq.read_table(data / info.path)
        bad = pa.array([2] * t.num_rows, t.schema.field("click").type)
        t = t.set_column(t.schema.get_field_index("click"), "click", bad)
        pq.write_table(t, data / info.path)
    # the empty day after one that ended
    final = train(_cfg(), data, tmp_path / "run", days=[1, 2, 3])
    assert final["days"] == [1, 2, 3] and final["steps"] == sum(_day_steps(data, [1, 3]))
    assert sum(final["quarantined"].values()) == sum(f.rows for f in day2)
    assert [(p.name, m["days"]) for p, m in list_snapshots(tmp_path / "run")] == [
        ("day-00001", [1]),
        ("day-00003", [1, 2, 3]),
    ]


def test_days_parse_and_check():
    assert (
        parse_days("4,5") == [4, 5]
        and parse_days("2-4") == [2, 3, 4]
        and parse_days("0-1,3") == [0, 1, 3]
    )
    with pytest.raises(ConfigError, match="cannot read"):
        parse_days("2..4")


def test_bad_days_are_clear_errors(tiny):
    check_days([2, 3], [0, 1], tiny)
    with pytest.raises(ConfigError,
                       match=r"--days \[1\]: the run has already seen them \(it has seen days "
                             r"\[0, 1\]\)"):
        check_days([1, 2], [0, 1], tiny)
    with pytest.raises(ConfigError, match="day 2 is before the run's last day 3"):
        check_days([2], [0, 3], tiny)
    with pytest.raises(ConfigError, match=r"--days \[9\]: not in"):
        check_days([2, 9], [0, 1], tiny)
    with pytest.raises(ConfigError, match="increasing order"):
        check_days([3, 2], [0, 1], tiny)


def test_bad_continuations_are_clear_errors(tiny, streams, tmp_path, capsys):
    root, _, _, _ = streams

    def cli(*args):
        code = main(["--quiet", "train", "--data", str(tiny), *args, "train.threads=1"])
        return code, capsys.readouterr().err

    code, err = cli("--continue", str(tmp_path / "nope"), "--days", "3")
    assert code == 2 and "no such training run" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(recipe("tiny").to_dict()))
    code, err = cli("--continue", str(empty), "--days", "3")
    assert code == 2 and "has no checkpoint" in err
    run = tmp_path / "A"
    shutil.copytree(root / "A", run)
    code, err = cli("--continue", str(run), "--days", "2,3")
    assert (
        code == 2
        and "--days [2]: the run has already seen them (it has seen days [0, 1, 2])" in err
    )
    code, err = cli("--continue", str(run))
    assert code == 2 and "--continue needs --days" in err
    code, err = cli("--continue", str(run), "--days", "3", "--recipe", "tiny")
    assert code == 2 and "drop --recipe" in err
    with pytest.raises(ConfigError, match="max_steps"):
        train(_cfg("train.max_steps=3"), tiny, tmp_path / "x", days=[0])
    # paused inside day 3: a new continuation is refused until that pass is resumed
    code, _ = cli("--continue", str(run), "--days", "3", "train.stop_at=60")
    assert code == 0 and not (run / "snapshots" / "day-00003").exists()
    with pytest.raises(CheckpointError,
                       match=r"stopped inside its pass over days \[3\] \(at step 60, day 3\)"):
        continue_training(run, tiny, [3])
    final = continue_training(run, tiny, [3], ["train.progress=false"], resume=True)
    assert final["days"] == [0, 1, 2, 3] and final["steps"] == sum(_day_steps(tiny, [0, 1, 2, 3]))
