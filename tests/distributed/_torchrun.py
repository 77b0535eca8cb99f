"""Launching ``torchrun … -m opengem`` from tests: one thread per process, output kept
for errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from opengem.run import FINAL_FILE, METRICS_FILE

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT"):
        env.pop(key, None)
    return env


def command(nproc: int, *args: str) -> list[str]:
    """``torchrun --standalone --nproc-per-node N -m opengem --quiet ARGS`` with
    this interpreter."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "opengem", "--quiet", *args]


def start(nproc: int, *args: str, log: Path) -> subprocess.Popen:
    """Start without waiting (own session, so ``stop`` can end the whole tree); output goes
    to ``log``."""
    out = open(log, "w")
    return subprocess.Popen(command(nproc, *args), cwd=REPO, env=_env(), stdout=out,
                            stderr=subprocess.STDOUT,
                            start_new_session=True)


def run(nproc: int, *args: str, log: Path, timeout: float = 240) -> float:
    """Run to the end; raise with the output's tail when it fails. Returns wall seconds."""
    t0 = time.perf_counter()
    proc = start(nproc, *args, log=log)
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        stop(proc)
    # 120 lines: torchrun's own failure report is ~40, and the failing worker's error is above it
    assert rc == 0, f"torchrun exited {rc}:\n{tail(log, 120)}"
    return time.perf_counter() - t0


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def worker_pid(proc: subprocess.Popen, rank: int) -> int | None:
    """PID of the worker with ``RANK=rank`` among torchrun's children (Linux /proc)."""
    for task in Path(f"/proc/{proc.pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ:
                return int(child)
    return None


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen, log: Path,
             every: float = 0.02):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"torchrun ended (rc {proc.returncode}) "
                                 f"before {what}:\n{tail(log)}")
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}:\n{tail(log)}")


def final(run: Path) -> dict:
    return json.loads((run / FINAL_FILE).read_text())


def losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"])
            for r in map(json.loads, (run / METRICS_FILE).read_text().splitlines())]
