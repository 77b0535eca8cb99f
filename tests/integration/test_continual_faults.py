"""Fault injection on continuous training (tiny preset): ``opengem train --continue`` killed
and resumed.

A stream over days 0, 1 is continued over days 2, 3 three times interrupted, each followed by the
same command with ``--resume`` (the machinery of ``test_fault_injection``):

    SIGKILL  after k metrics lines of day 2 (between checkpoints: the steps since the last are redone)
    SIGKILL  inside the publish of day 2's snapshot (``OPENGEM_FAULT_SLEEP_IN_PUBLISH`` holds it
             between the complete ``day-00002.tmp`` and its rename): readers see day 1 as the newest
    SIGTERM  after k more lines: a checkpoint at the step it stopped, exit code 75

and must end bit-identical to an uninterrupted continuation: parameters, both optimizers' state, the
stream position, days seen, one log line per step, and the same published snapshots.
"""

import json
import shutil
import signal

import numpy as np
import pytest
import test_fault_injection as fi

from opengem.checkpoint import latest_checkpoint, list_snapshots, newest_snapshot, snapshot_dir
from opengem.cli import main
from opengem.run import FINAL_FILE, METRICS_FILE, load_run_model
from opengem.train.resume import EXIT_PREEMPTED
from opengem.train.trainer import params_sha256
from opengem.transfer.teacher import TeacherService


def _train(data, run, *extra):
    return ["--quiet", "train", "--data", str(data), *extra, *fi.ARGS]


def _start(data, run, resume: bool, env: dict | None = None):
    """``opengem train --continue RUN --days 2,3`` in a subprocess (as fi._start does for a
    plain run)."""
    cmd = [fi.sys.executable, "-m", "opengem",
           *_train(data, run, "--continue", str(run), "--days", "2,3",
                   *(["--resume"] if resume else []))]
    full_env = dict(fi.os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    return fi.subprocess.Popen(cmd, cwd=fi.REPO, env=full_env, stdout=fi.subprocess.PIPE,
                               stderr=fi.subprocess.PIPE,
                               text=True)


def _kill_after(data, run, resume: bool, k: int, sig=signal.SIGKILL):
    start = fi._lines(run)
    proc = _start(data, run, resume)
    fi._wait(proc, lambda: fi._lines(run) >= start + k, f"{k} more metrics lines")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert not (run / FINAL_FILE).exists(), "the run finished before the signal; nothing was tested"
    return proc.returncode, err


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    """The tiny world and a stream trained over days 0, 1 (snapshots day-00000, day-00001)."""
    root = tmp_path_factory.mktemp("stream")
    data, run = root / "data", root / "base"
    assert (
        main(
            [
                "--quiet",
                "generate",
                "--preset",
                "tiny",
                "--out",
                str(data),
                "--seed",
                "1",
                "--no-oracle",
            ]
        )
        == 0
    )
    assert main(_train(data, run, "--recipe", "tiny", "--out", str(run), "--days", "0,1")) == 0
    return data, run


def test_killed_and_preempted_continuation_resumes_bit_identical(stream, tmp_path):
    data, base = stream
    ref, run = tmp_path / "ref", tmp_path / "run"
    shutil.copytree(base, ref)
    shutil.copytree(base, run)
    assert main(_train(data, ref, "--continue", str(ref), "--days", "2,3")) == 0
    want = json.loads((ref / FINAL_FILE).read_text())
    assert want["days"] == [0, 1, 2, 3] and want["steps"] > 100
    rng = np.random.default_rng(24)

    # 1. SIGKILL between checkpoints, inside day 2
    rc, _ = _kill_after(data, run, False, int(rng.integers(7, 14)))
    assert rc == -signal.SIGKILL and newest_snapshot(run)[1]["last_day"] == 1

    # 2. SIGKILL inside the publish of day 2: day-00002.tmp is complete, not yet renamed
    proc = _start(data, run, True, {"OPENGEM_FAULT_SLEEP_IN_PUBLISH": "30"})
    tmp = snapshot_dir(run) / "day-00002.tmp"
    fi._wait(proc, lambda: (tmp / "snapshot.json").exists(), "a snapshot publish")
    proc.kill()
    proc.communicate(timeout=60)
    assert tmp.exists() and [m["last_day"] for _, m in list_snapshots(run)] == [0, 1]
    teacher = TeacherService.from_run(run)  # a reader now: the newest complete snapshot, day 1's
    day1 = newest_snapshot(base)[0]
    assert params_sha256(teacher.model) == params_sha256(load_run_model(base, snapshot=day1)[0])

    # 3. SIGTERM: the step in flight ends, a checkpoint there, exit code 75, day 2
    #    published meanwhile
    rc, err = _kill_after(data, run, True, int(rng.integers(20, 30)), signal.SIGTERM)
    assert rc == EXIT_PREEMPTED and "SIGTERM: stopped after step" in err, err
    last = json.loads((run / METRICS_FILE).read_text().splitlines()[-1])["step"]
    assert latest_checkpoint(run).name == f"step-{last:08d}"

    # then resume to the end (in this process)
    assert main(_train(data, run, "--continue", str(run), "--days", "2,3", "--resume")) == 0

    got = json.loads((run / FINAL_FILE).read_text())
    for key in ("steps", "examples", "params_sha256", "days", "snapshot", "quarantined", "repaired",
                "checkpoint"):
        assert got[key] == want[key], key
    metrics = [json.loads(x) for x in (run / METRICS_FILE).read_text().splitlines()]
    ref_metrics = [json.loads(x) for x in (ref / METRICS_FILE).read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, want["steps"] + 1))
    assert [m["loss"] for m in metrics] == [m["loss"] for m in ref_metrics]
    a, b = fi._state(latest_checkpoint(ref),
                     tmp_path / "a.pt"), fi._state(latest_checkpoint(run), tmp_path / "b.pt")
    assert a["dcp"]["optim"]["state"] and a["trainer"]["loader"]["days"] == [2, 3]
    fi._assert_identical(a, b)
    snaps, ref_snaps = list_snapshots(run), list_snapshots(ref)
    assert [m for _, m in snaps] == [m for _, m in ref_snaps] and [
        m["last_day"] for _, m in snaps
    ] == [0, 1, 2, 3]
    assert not list(snapshot_dir(run).glob("*.tmp"))
    for (p, _), (q, _) in zip(snaps[2:], ref_snaps[2:]):
        assert params_sha256(load_run_model(run, snapshot=p)[0]) == params_sha256(
            load_run_model(ref, snapshot=q)[0]
        )
