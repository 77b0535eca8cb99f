"""RunLog: metrics.jsonl lines and TensorBoard scalars that read back; resume does not
duplicate steps."""

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from opengem.run import METRICS_FILE, TENSORBOARD_DIR
from opengem.train.observe import RunLog, flatten_scalars
from opengem.train.resume import truncate_metrics


def record(step: int, shift: float = 0.0) -> dict:
    return {"examples": 64 * step, "loss": 0.5 / step + shift, "lr_factor": 1.0,
            "loss_by_domain_task": {"feed/click": 0.4 / step + shift, "video/click": 0.6 / step}}


def scalars(run) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(run / TENSORBOARD_DIR))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_json_lines_and_tensorboard_scalars(tmp_path):
    with RunLog(tmp_path) as mlog:
        for step in (1, 2, 3):
            mlog.log(step, record(step))
    lines = [json.loads(x) for x in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert lines == [{"step": s, **record(s)} for s in (1, 2, 3)]
    assert list(lines[0]) == ["step", "examples", "loss", "lr_factor", "loss_by_domain_task"]
    tb = scalars(tmp_path)
    assert set(tb) == {"examples", "loss", "lr_factor", "loss_by_domain_task/feed/click",
                       "loss_by_domain_task/video/click"}
    for tag in tb:
        want = [(s, dict(flatten_scalars(record(s)))[tag]) for s in (1, 2, 3)]
        assert [st for st, _ in tb[tag]] == [1, 2, 3]
        # float32 on disk
        assert [v for _, v in tb[tag]] == pytest.approx([v for _, v in want], rel=1e-6)


def test_resume_purges_redone_steps(tmp_path):
    with RunLog(tmp_path) as mlog:
        for step in range(1, 6):
            mlog.log(step, record(step))
    truncate_metrics(tmp_path / METRICS_FILE, 3)  # what the trainer does on resume from step 3
    with RunLog(tmp_path, purge_step=4) as mlog:
        for step in (4, 5):
            mlog.log(step, record(step, shift=10.0))
    lines = [json.loads(x) for x in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4, 5] and lines[3]["loss"] == record(4, 10.0)[
        "loss"
    ]
    loss = scalars(tmp_path)["loss"]
    assert [s for s, _ in loss] == [1, 2, 3, 4, 5]
    assert [v for _, v in loss] == pytest.approx([0.5, 0.25, 0.5 / 3, 10.125, 10.1], rel=1e-6)


def test_disabled_rank_writes_nothing_and_json_only_without_tensorboard(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with RunLog(tmp_path / "a", enabled=False) as mlog:
        mlog.log(1, record(1))
    assert list((tmp_path / "a").iterdir()) == []
    with RunLog(tmp_path / "b", tensorboard=False) as mlog:
        mlog.log(1, {"loss": float("nan"), "note": "text", "flag": True})
    assert not (tmp_path / "b" / TENSORBOARD_DIR).exists()
    assert json.loads((tmp_path / "b" / METRICS_FILE).read_text())["note"] == "text"
    flat = dict(flatten_scalars({"loss": float("nan"), "flag": True, "n": 2, "d": {"x": 1.5}}))
    assert flat == {"n": 2.0, "d/x": 1.5}
