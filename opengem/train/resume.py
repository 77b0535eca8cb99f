"""Resuming a run: the same world size continues exactly; another world size re-derives the data
position from every rank's saved loader position (``shared_data_boundary``). Also the preemption
that a resume follows: SIGTERM → a flag → checkpoint → exit ``EXIT_PREEMPTED`` (see ``trainer``)."""

from __future__ import annotations

import json
import logging
import math
import signal
import threading
from collections import Counter
from pathlib import Path
from typing import Self

import numpy as np
import torch

from opengem.checkpoint import CheckpointError
from opengem.data.loader import ShardLoader
from opengem.parallel.launch import min_over_ranks
from opengem.run import METRICS_FILE
from opengem.train.state import TrainState

log = logging.getLogger(__name__)

# os.EX_TEMPFAIL: stopped on SIGTERM after a checkpoint; run again with --resume
EXIT_PREEMPTED = 75


class Preempted(SystemExit):
    """Raised after the checkpoint that follows a SIGTERM; exits the process
    with ``EXIT_PREEMPTED``."""

    def __init__(self, message: str):
        super().__init__(EXIT_PREEMPTED)
        self.message = message

    def __str__(self) -> str:
        return self.message


class SigtermFlag:
    """Sets a flag on SIGTERM while training (main thread only: Python delivers signals there);
    ``due`` tells the loop when to stop for it."""

    def __init__(self):
        self.event = threading.Event()
        self._previous: list = []

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            self._previous.append(signal.signal(signal.SIGTERM, lambda *_: self.event.set()))
        return self

    def __exit__(self, *exc) -> None:
        if self._previous:  # None: a handler not set from Python; the default is the closest
            signal.signal(signal.SIGTERM, self._previous.pop() or signal.SIG_DFL)

    def due(self, state: TrainState) -> bool:
        """Whether to checkpoint and stop after this step: any rank had a SIGTERM. A collective,
        asked after every step by every rank, so all stop after the same one."""
        return min_over_ranks(int(not self.event.is_set()), state.distributed) == 0


def resume_run(r: TrainState, ckpt: Path | None) -> None:
    """Load ``ckpt`` into the run state ``r`` (``TrainState.restore``) and place the data there.

    No checkpoint (a run killed before its first one) starts over: only its log lines
    are dropped."""
    if ckpt is None:
        if r.info.is_main:
            truncate_metrics(r.run / METRICS_FILE, 0)
        return
    state = r.restore(ckpt)
    saved_world = int(state["loader"].get("world_size", 1))
    if saved_world == r.info.world_size:
        r.loader.load_state_dict(state["loader"])
    else:
        _reshard_data(r, ckpt, saved_world)
    if r.info.is_main:
        truncate_metrics(r.run / METRICS_FILE, r.step)
    log.info("resumed from %s at step %d", ckpt, r.step)


def truncate_metrics(path: Path, step: int) -> None:
    """Drop log lines past the checkpoint (a run killed between checkpoints logged steps that
    are redone)."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    keep = [x for x in lines if _step_of(x) <= step]
    if len(keep) != len(lines):
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(keep))
        tmp.replace(path)


def _step_of(line: str) -> float:
    """The step a metrics line logged; a line torn by a kill mid-write (not JSON) is dropped."""
    try:
        return json.loads(line).get("step", 0) if line.endswith("\n") else math.inf
    except (json.JSONDecodeError, AttributeError):
        return math.inf


def shared_data_boundary(positions: list[dict], n_shards: int,
                         epochs: int) -> tuple[int, list[tuple]]:
    """Where the loader positions of ``W = len(positions)`` ranks meet in the global shard order.

    Rank r of W reads shards r, r+W, … of each epoch's order, so its position (epoch e, local shard
    s, row k) means it has read: every shard ≡ r (mod W) of epochs before e, shards r + W·j (j < s)
    of epoch e, and k rows of shard r + W·s. Units are (epoch, global shard) pairs in order.

    Returns (m, past): the first m units were all read completely, and ``past`` lists what was read
    after them, ``(epoch, global shard, rows or None for the whole shard)``. ``past`` empty means
    the ranks together read exactly the first m units: any world size can continue there exactly.
    """
    W = len(positions)
    # + 1: a finished rank sits at (epochs, 0, 0)
    done = np.zeros((epochs + 1) * n_shards, dtype=bool)
    partial = []
    for r, p in enumerate(positions):
        e, s, k = int(p["epoch"]), int(p["shard"]), int(p["row"])
        for ep in range(min(e, epochs)):
            done[ep * n_shards + r:(ep + 1) * n_shards:W] = True
        done[e * n_shards + r:e * n_shards + min(r + W * s, n_shards):W] = True
        if k:
            partial.append((e, r + W * s, k))
    m = int(np.argmin(done)) if not done.all() else done.size
    past = [(int(i) // n_shards, int(i) % n_shards, None) for i in np.flatnonzero(done[m:]) + m]
    return m, past + sorted(partial)


def position_after(m: int, n_shards: int, rank: int, world_size: int) -> dict:
    """Loader position of ``rank`` of ``world_size`` that starts right after the first m units."""
    epoch, first = divmod(m, n_shards)
    return {"epoch": epoch, "shard": max(0, -(-(first - rank) // world_size)), "row": 0}


def _reshard_data(r: TrainState, ckpt: Path, saved_world: int) -> None:
    """Continue the data of a checkpoint written by ``saved_world`` ranks on this world size."""
    old = [torch.load(ckpt / f"trainer_state-rank{i}.pt", weights_only=False)["loader"]
           for i in range(saved_world)]
    n_shards = len(r.loader.files)
    m, past = shared_data_boundary(old, n_shards, r.loader.epochs)
    one = ShardLoader(r.loader.data_dir, r.loader.split, r.loader.batch_size, r.schema,
                      shuffle=r.loader.shuffle,
                      # world size 1: the global shard order
                      seed=r.loader.seed, epochs=r.loader.epochs)
    repeated = sum(rows if rows is not None else one.shard_order(e)[s].rows for e, s, rows in past)
    if past and r.cfg.train.resume_reshard != "rewind":
        raise CheckpointError(
            f"{ckpt} was written by {saved_world} ranks; resuming on {r.info.world_size} cannot "
            f"continue the data exactly: the ranks' positions do not meet at a shard boundary "
            f"({repeated} rows were read past the "
            f"last shared one). Resume with {saved_world} processes (torchrun --nproc-per-node "
            f"{saved_world}), or "
            "pass train.resume_reshard=rewind to restart at that boundary (those rows are then "
            "seen twice).")
    pos = position_after(m, n_shards, r.info.rank, r.info.world_size)
    quarantined = (
        sum((Counter(s.get("quarantined", {})) for s in old), Counter()) if r.info.is_main else {}
    )
    r.loader.load_state_dict({**pos, "seed": r.loader.seed, "split": r.loader.split,
                              "quarantined": dict(quarantined)})
    left = sum(f.rows for e in range(pos["epoch"], r.loader.epochs)
               for f in r.loader.shard_order(e)[pos["shard"] if e == pos["epoch"] else 0:])
    B = r.cfg.data.batch_size
    mine = left // B if r.loader.drop_last else math.ceil(left / B)
    steps_left = min_over_ranks(mine, r.distributed)
    r.total = min(r.cfg.train.max_steps or 10**15, r.step + steps_left)
    r.schedule.total = r.total
    r.resumed = {"from_world_size": saved_world, "rows_repeated": repeated, "units_done": m,
                 "total_steps": r.total}
    log.warning("resharded the data from %d to %d ranks at %d of %d (epoch, shard) units; %d "
                "rows repeat; the lr schedule now ends at step %d", saved_world, r.info.world_size,
                m, n_shards * r.loader.epochs, repeated, r.total)
