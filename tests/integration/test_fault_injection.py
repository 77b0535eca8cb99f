"""Fault injection on the tiny preset: ``opengem train`` killed and resumed until done.

One run is interrupted three times at seeded moments, each followed by ``--resume``:

    SIGKILL  after k metrics lines (between checkpoints: the steps since the last one are redone)
    SIGKILL  inside a checkpoint save (``OPENGEM_FAULT_SLEEP_IN_SAVE`` holds the save between the
             complete ``step-N.tmp`` and its rename): the ``.tmp`` is never loaded, and later removed
    SIGTERM  after k more lines: a checkpoint at the step it stopped, exit code 75

(each subprocess costs seconds of imports, so three: the CI budget for this file is a minute)

and must end bit-identical to an uninterrupted run: parameters, both optimizers' state, the loader
position, every example seen once (steps, examples, quarantined and repaired counts), one log line
per step. The data has a few bad rows, so quarantine counts cross the resumes too.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from opengem.checkpoint import checkpoint_dir, latest_checkpoint
from opengem.cli import main
from opengem.data.parquet import DatasetManifest
from opengem.features.schema import FeatureSchema
from opengem.run import FINAL_FILE, METRICS_FILE
from opengem.train.resume import EXIT_PREEMPTED

REPO = Path(__file__).resolve().parents[2]
ARGS = ("data.batch_size=32", "train.log_every=1", "train.ckpt_every=5", "train.threads=1")


@pytest.fixture(scope="module")
def bad_data(tmp_path_factory):
    """The tiny world with 5 bad rows in its first training shard (same row count: the
    manifest holds)."""
    out = tmp_path_factory.mktemp("tiny") / "data"
    assert main(["--quiet", "generate", "--preset", "tiny", "--out", str(out), "--seed", "1"]) == 0
    info = DatasetManifest.load(out).split_files("train")[0]
    t = pq.read_table(out / info.path)
    dense = FeatureSchema.load(out).dense[0].name
    for name, rows, value in (("click", [3, 17, 40], 2), (dense, [5, 6], np.nan)):
        col = t.column(name).to_numpy(zero_copy_only=False).copy()
        col[rows] = value
        t = t.set_column(t.schema.get_field_index(name), name,
                         pa.array(col, t.schema.field(name).type))
    pq.write_table(t, out / info.path)
    return out


def _args(data, run, *extra):
    return ["--quiet", "train", "--recipe", "tiny", "--data", str(data), "--out", str(run), *ARGS,
            *extra]


def _start(data, run, resume: bool, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "opengem", *_args(data, run, *(["--resume"] if resume else []))]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _lines(run: Path) -> int:
    p = run / METRICS_FILE
    return p.read_text().count("\n") if p.exists() else 0


def _wait(proc: subprocess.Popen, ready, what: str, timeout: float = 120):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = ready()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) "
                                 f"before {what}:\n{proc.communicate()[1]}")
        time.sleep(0.005)
    proc.kill()
    raise AssertionError(f"timed out waiting for {what}")


def _kill_after(data, run, resume: bool, k: int, sig=signal.SIGKILL) -> tuple[int, str]:
    """Start (or resume), send ``sig`` once ``k`` more metrics lines appeared; (return
    code, stderr)."""
    start = _lines(run) if resume else 0
    proc = _start(data, run, resume)
    _wait(proc, lambda: _lines(run) >= start + k, f"{k} more metrics lines")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert not (run / FINAL_FILE).exists(), "the run finished before the signal; nothing was tested"
    return proc.returncode, err


def _state(ckpt: Path, tmp: Path) -> dict:
    """Every tensor of a checkpoint (model, both optimizers) plus its trainer state."""
    dcp_to_torch_save(ckpt, tmp)
    state = torch.load(tmp, weights_only=False)
    return {"dcp": state,
            "trainer": torch.load(ckpt / "trainer_state-rank0.pt", weights_only=False)}


def _assert_identical(a, b, where: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_identical(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_killed_and_preempted_runs_resume_bit_identical(bad_data, tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert main(_args(bad_data, ref)) == 0
    want = json.loads((ref / FINAL_FILE).read_text())
    assert sorted(want["quarantined"].values()) == [2, 3] and want["steps"] > 40
    rng = np.random.default_rng(8)

    # 1. SIGKILL between checkpoints
    rc, _ = _kill_after(bad_data, run, False, int(rng.integers(7, 14)))
    assert rc == -signal.SIGKILL

    # 2. SIGKILL inside a save: step-N.tmp is complete, not yet renamed
    proc = _start(bad_data, run, True, {"OPENGEM_FAULT_SLEEP_IN_SAVE": "30"})
    before = latest_checkpoint(run)
    tmp = _wait(proc,
                lambda: next((p.parent
                              for p in checkpoint_dir(run).glob("step-*.tmp/trainer_state-*.pt")),
                                   None), "a checkpoint save")
    proc.kill()
    proc.communicate(timeout=60)
    assert tmp.exists() and latest_checkpoint(run) == before and before.name + ".tmp" != tmp.name

    # 3. SIGTERM: the step in flight ends, a checkpoint there, exit code 75, the .tmp of 2 gone
    rc, err = _kill_after(bad_data, run, True, int(rng.integers(3, 9)), signal.SIGTERM)
    assert rc == EXIT_PREEMPTED and "SIGTERM: stopped after step" in err, err
    last = json.loads((run / METRICS_FILE).read_text().splitlines()[-1])["step"]
    assert latest_checkpoint(run).name == f"step-{last:08d}"
    assert not list(checkpoint_dir(run).glob("*.tmp"))

    # then resume to the end (in this process)
    assert main(_args(bad_data, run, "--resume")) == 0

    got = json.loads((run / FINAL_FILE).read_text())
    for key in ("steps", "examples", "params_sha256", "quarantined", "repaired", "checkpoint"):
        assert got[key] == want[key], key
    metrics = [json.loads(x) for x in (run / METRICS_FILE).read_text().splitlines()]
    ref_metrics = [json.loads(x) for x in (ref / METRICS_FILE).read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, want["steps"] + 1))
    assert [m["loss"] for m in metrics] == [m["loss"] for m in ref_metrics]
    a, b = _state(latest_checkpoint(ref),
                  tmp_path / "a.pt"), _state(latest_checkpoint(run), tmp_path / "b.pt")
    assert {"model", "optim"} <= set(a["dcp"]) and a["dcp"]["optim"]["state"]
    _assert_identical(a, b)
