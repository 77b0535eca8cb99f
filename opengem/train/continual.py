"""Continuous training: a run goes on over new days, one pass each, publishing a snapshot per day.

    opengem train --data DIR --continue RUN --days 4,5        warm start from RUN's last checkpoint
    opengem train --recipe R --data DIR --out RUN --days 0-3  a run that is a stream from its first day
    … the same command + --resume                             after a kill: continues exactly

GEM is refreshed by continuous online training and its students read what it has published, so a
run must be able to go on over the days that arrive and say, for every model it hands out, which
days it has seen. Here:

- **Warm start**: the model, both optimizers (dense AdamW, the tables' row-wise Adagrad), RNG and
  step come from the run's latest checkpoint; the run's ``config.json`` is the config, with the
  command's overrides on top for this leg only (config.json is left as it was; a model change is
  refused by the checkpoint's identity check). A recalibration fitted on the model the run moves
  past is set aside (``recalibration-step-N.json``): offsets of one model are wrong for the next.
- **Days**: in the order given, each one pass of its own ``ShardLoader`` (shards of the day in a
  seeded order, rows permuted, as a plain run orders a day), so a batch never spans two days. New
  days must come after every day the run has seen (a plain run has seen its ``data.train_split``).
- **Schedule** (``train.optim.lr_factor`` at the global step): its horizon is fixed by the run's
  first pass (a plain run's planned steps, or a stream's first leg) and never stretched; later steps
  read the schedule past its end, i.e. the cosine floor ``min_lr_ratio`` (1 for ``constant``), with
  no second warm-up: the lr goes on where the run ended, as the optimizers' moments do. So a run
  continued over day 2 equals one stream over days 0-2 exactly when the two schedules agree there
  (``optim.schedule=constant``, or both past the horizon).
- **Snapshots**: after the last step of each day the model is published to RUN/snapshots/day-N
  (``opengem.checkpoint.save_snapshot``: written aside, then renamed), its ``snapshot.json`` saying
  the last day it has seen. Teachers read snapshots (``transfer.teacher``), never a checkpoint.
- **Resume**: the stream position (day, loader position, quarantine and repair counts) is part of
  every checkpoint, so a killed continuation resumes bit-identical, as plain training does.

A stream keeps the plain run's base rates (NE's normaliser, of ``data.train_split``). Single process
only for now (one day's end must be the same step on every rank); early stopping is refused (a
stream has no end to stop before); ``train.max_steps`` is refused (a day is trained whole); a
continuation starts both at 0 (``continue_config``). A plain run has "seen" its ``data.train_split``
days, even if ``max_steps`` or early stopping ended its pass before their last row.
"""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

from opengem.checkpoint import CheckpointError, latest_checkpoint, save_snapshot, snapshot_dir
from opengem.config import Config, ConfigError, apply_overrides
from opengem.data.batch import Batch, CollateStats
from opengem.data.loader import ShardLoader
from opengem.data.parquet import DatasetManifest
from opengem.features.schema import FeatureSchema
from opengem.run import (
    CONFIG_FILE,
    FINAL_FILE,
    METRICS_FILE,
    RECALIBRATION_FILE,
    load_config,
    load_final,
)
from opengem.train.resume import truncate_metrics
from opengem.train.state import TrainState

log = logging.getLogger(__name__)


def parse_days(text: str) -> list[int]:
    """``"4,5"`` or ``"2-4"`` (or a mix: ``"0-2,5"``) → the days in the order written."""
    days: list[int] = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            days += list(range(int(lo), int(hi) + 1)) if sep else [int(part)]
        except ValueError:
            raise ConfigError(f"--days: cannot read {part!r} (write days as 4,5 or 2-4)") from None
    if not days:
        raise ConfigError("--days names no day")
    return days


def check_stream_config(cfg: Config, world_size: int) -> None:
    """What a stream cannot do in this version, refused before anything is written."""
    if world_size > 1:
        raise ConfigError("continuous training (--days / --continue) runs on one process in "
                          "this version")
    if cfg.train.max_steps:
        raise ConfigError("train.max_steps cannot cut a stream: each day is trained whole (use "
                          "train.stop_at to pause)")
    if cfg.train.early_stop_patience:
        raise ConfigError("train.early_stop_patience stops a pass early; a stream has no end to "
                          "stop before (set train.early_stop_patience=0)")


class DayStream:
    """The loader of a stream: one pass over each of ``days`` in order, batches never spanning
    two days.

    It stands in for the trainer's ``ShardLoader`` (``__iter__``, ``state_dict``, ``quarantined``,
    ``stats``). Each day is a ``ShardLoader`` of that day's shards; it reads one batch ahead, so
    that ``day_ended`` is known when a batch is handed out (the day's snapshot follows that batch's
    step), while ``state_dict()`` is the position right after the batch handed out, not the one
    read ahead.

    Args:
        data_dir, schema, batch_size: as for ``ShardLoader``; ``loader_kw`` its other arguments.
        days: this leg's days, in order.  seen: the days the run had seen before this leg.
        split: the split named in each day loader's state (the days may be in any split).
    """

    def __init__(self, data_dir: str | Path, days: list[int], batch_size: int,
                 schema: FeatureSchema, seen: list[int], split: str, **loader_kw):
        manifest = DatasetManifest.load(data_dir)
        self.data_dir, self.batch_size, self.schema, self.split = (
            Path(data_dir),
            batch_size,
            schema,
            split,
        )
        self.days, self.seen = list(days), list(seen)
        self.files = {d: [f for f in manifest.files if f.day == d] for d in self.days}
        self.kw = loader_kw
        self.index, self.pos = 0, {"epoch": 0, "shard": 0, "row": 0}
        self.quarantined: Counter = Counter()
        self.stats = CollateStats()
        self.horizon = self.end_step = 0
        self.day_ended = False  # whether the batch last handed out was its day's last

    @property
    def completed(self) -> list[int]:
        """Every day the run has trained to its end, in order."""
        return self.seen + self.days[: self.index]

    def planned_steps(self) -> int:
        """Steps of this leg from its start: one per ``batch_size`` rows of each day (short
        last batch)."""
        return sum(math.ceil(sum(f.rows for f in self.files[d]) / self.batch_size)
                   for d in self.days)

    def _loader(self) -> ShardLoader:
        ld = ShardLoader(self.data_dir, self.split, self.batch_size, self.schema, epochs=1,
                         **self.kw)
        ld.files = self.files[self.days[self.index]]  # shard_order reads this list
        ld.load_state_dict({**self.pos, "seed": ld.seed, "split": self.split,
                            "quarantined": dict(self.quarantined),
                            "repaired": self.stats.as_dict()})
        return ld

    def _take(self, state: dict) -> None:
        self.pos = {k: state[k] for k in ("epoch", "shard", "row")}
        self.quarantined, self.stats = (
            Counter(state["quarantined"]),
            CollateStats.from_dict(state["repaired"]),
        )

    def __iter__(self) -> Iterator[Batch]:
        while self.index < len(self.days):
            ld = self._loader()
            ended = False
            with contextlib.closing(iter(ld)) as it:
                batch = next(it, None)
                while batch is not None:
                    after = ld.state_dict()  # before reading ahead
                    ahead = next(it, None)
                    ended = self.day_ended = ahead is None
                    if ended:  # the counts of the whole day, then the next day from its start
                        self._take({**ld.state_dict(), "epoch": 0, "shard": 0, "row": 0})
                        self.index += 1
                    else:
                        self._take(after)
                    yield batch
                    batch = ahead
            if not ended:  # no valid row left in the day: nothing to train or publish
                self._take({**ld.state_dict(), "epoch": 0, "shard": 0, "row": 0})
                self.index += 1

    def state_dict(self) -> dict:
        # "epoch": days finished so far, so train.eval_each_epoch evaluates after each day
        return {"stream": 1, "epoch": len(self.completed), "days": self.days, "seen": self.seen,
                "index": self.index, **self.pos, "quarantined": dict(self.quarantined),
                "repaired": self.stats.as_dict(),
                "horizon": self.horizon, "end_step": self.end_step, "seed": self.kw.get("seed", 0),
                "split": self.split}

    def load_state_dict(self, state: dict) -> None:
        self.days, self.seen, self.index = (
            list(state["days"]),
            list(state["seen"]),
            int(state["index"]),
        )
        self.horizon, self.end_step = int(state["horizon"]), int(state["end_step"])
        self._take(state)


# ---------------------------------------------------------------------------------- starting a leg
def continue_config(run_dir: str | Path, overrides=()) -> Config:
    """The config a continuation of ``run_dir`` trains with: its config.json with ``overrides`` on
    top; a clear error when there is no such run or it has no checkpoint to warm-start from. Three
    keys of config.json belong to the run's first pass, not to the stream, and start at 0:
    ``train.stop_at`` (a pause of the command that set it), ``train.max_steps`` (the pass's length,
    hence the schedule's horizon) and ``train.early_stop_patience`` (the pass's end)."""
    run = Path(run_dir)
    if not (run / CONFIG_FILE).exists():
        raise CheckpointError(f"--continue {run}: no such training run (no {run}/{CONFIG_FILE})")
    if latest_checkpoint(run) is None:
        raise CheckpointError(f"--continue {run}: the run has no checkpoint to continue from")
    cfg = load_config(run)
    cfg.train.stop_at = cfg.train.max_steps = cfg.train.early_stop_patience = 0
    return apply_overrides(cfg, list(overrides))


def check_days(days: list[int], seen: list[int], data_dir: str | Path) -> None:
    """New days: in the data, in increasing order, none the run has seen, all after its last day."""
    have = {f.day for f in DatasetManifest.load(data_dir).files}
    missing = [d for d in days if d not in have]
    if missing:
        raise ConfigError(f"--days {missing}: not in {data_dir} (its days: {sorted(have)})")
    if days != sorted(set(days)):
        raise ConfigError(f"--days {days}: a stream trains each day once, in increasing order")
    again = sorted(set(days) & set(seen))
    if again:
        raise ConfigError(f"--days {again}: the run has already seen them (it has seen "
                          f"days {seen}); continue with days after {max(seen)}")
    if seen and days[0] <= max(seen):
        raise ConfigError(f"--days {days}: day {days[0]} is before the run's last day {max(seen)}; "
                          "a stream only goes forward")


def start_stream(r: TrainState, ckpt: Path | None, warm: bool, resume: bool,
                 plain_run: Callable[[], tuple[Config, int]]) -> None:
    """Put the trainer's run state ``r`` (its loader a fresh ``DayStream``) where this leg starts.

    ``ckpt`` None: a new run whose first leg sets the schedule's horizon. Otherwise the run's state
    is loaded; with ``resume`` a leg the checkpoint is inside (the same days) continues exactly,
    else the checkpoint must be at the end of a finished pass and the leg starts there (``warm``).
    ``plain_run()``: the config a plain run was trained with and its schedule's planned steps."""
    stream: DayStream = r.loader
    days = stream.days
    if ckpt is None:
        if warm:
            raise CheckpointError(f"--continue {r.run}: the run has no checkpoint to continue from")
        _fresh(r, stream)
        check_days(days, [], stream.data_dir)
        stream.horizon = stream.end_step = r.total = stream.planned_steps()
        r.schedule.total = stream.horizon
        return
    saved = r.restore(ckpt)["loader"]
    if int(saved.get("world_size", 1)) != 1:
        raise CheckpointError(f"{ckpt} was written by {saved['world_size']} ranks; continuous "
                              f"training runs on one")
    inside = saved.get("stream") and saved["index"] < len(saved["days"])
    if saved.get("stream") and resume and saved["days"] == days:
        # mid-leg, or a finished leg whose final.json a kill prevented
        stream.load_state_dict(saved)
    elif inside:
        verb = "resume it with the same --days and --resume" if saved["days"] == days else \
            f"finish it first (--days {','.join(map(str, saved['days']))} --resume)"
        raise CheckpointError(f"{r.run} stopped inside its pass over days {saved['days']} (at "
                              f"step {r.step}, day {saved['days'][saved['index']]}); {verb}")
    else:
        _new_leg(r, stream, saved, plain_run)
    r.total, r.schedule.total = stream.end_step, stream.horizon
    truncate_metrics(r.run / METRICS_FILE, r.step)
    log.info("%s days %s from %s at step %d (schedule horizon %d; days seen %s)",
             "resumed" if stream.index or stream.pos["shard"] or stream.pos["row"]
             else "continuing", days, ckpt,
             r.step, stream.horizon, stream.completed)


def _fresh(r: TrainState, stream: DayStream) -> None:
    """A new stream into ``r.run``: snapshots of an earlier run there would lie about this one."""
    if snapshot_dir(r.run).exists():
        log.warning("%s: removing the snapshots of an earlier run (a new run starts there)", r.run)
        shutil.rmtree(snapshot_dir(r.run))
    truncate_metrics(r.run / METRICS_FILE, 0)


def _new_leg(r: TrainState, stream: DayStream, saved: dict,
             plain_run: Callable[[], tuple[Config, int]]) -> None:
    """A leg after a finished pass: a stream's last leg, or a plain run that went through its epochs
    (or wrote its final.json at this step: stopped early, or at ``max_steps``)."""
    if saved.get("stream"):
        seen, horizon = saved["seen"] + saved["days"], int(saved["horizon"])
    else:
        prev, horizon = plain_run()
        final = load_final(r.run)
        done = int(saved.get("epoch", 0)) >= prev.train.epochs or (
            final is not None and final["steps"] == r.step
        )
        if not done:
            raise CheckpointError(f"--continue {r.run}: its training has not finished (step "
                                  f"{r.step} of {horizon}); "
                                  "finish it with `opengem train … --resume` first")
        seen = sorted(DatasetManifest.load(stream.data_dir).splits[prev.data.train_split])
    check_days(stream.days, seen, stream.data_dir)
    stream.seen, stream.horizon = seen, horizon
    stream.end_step = r.step + stream.planned_steps()
    stream.quarantined = Counter(saved.get("quarantined", {}))
    stream.stats = CollateStats.from_dict(saved.get("repaired", {}))
    if (r.run / FINAL_FILE).exists():  # absent while training, as for any run
        (r.run / FINAL_FILE).unlink()
    recal = r.run / RECALIBRATION_FILE
    if recal.exists():  # fitted on the model of this step, which the run is about to move past
        stale = r.run / f"recalibration-step-{r.step:08d}.json"
        recal.replace(stale)
        log.warning("%s was fitted on the model at step %d: moved to %s (run `opengem recalibrate` "
                    "again after this leg)", recal, r.step, stale.name)


# ---------------------------------------------------------------------------------- publishing
def stream_of(state: TrainState) -> DayStream | None:
    """The run's stream when it trains one (a ``DayStream`` loader), else None (a plain run)."""
    return state.loader if isinstance(state.loader, DayStream) else None


class DayEnd:
    """When a stream publishes: after the step that ends a day (``DayStream.day_ended``), before a
    checkpoint of that step can say the day is done. A plain run (no stream) never is."""

    def due(self, state: TrainState) -> bool:
        stream = stream_of(state)
        return stream is not None and stream.day_ended

    def publish(self, state: TrainState) -> Path:
        """The snapshot of every day the stream has finished (``publish``)."""
        return publish(state, stream_of(state).completed)


def publish(r: TrainState, days: list[int]) -> Path:
    """Publish the model of ``r`` as the snapshot of the last of ``days`` (every day it
    has seen)."""
    meta = {"last_day": days[-1], "days": days, "step": r.step, "examples": r.examples,
            "schema": r.schema.fingerprint(), "recipe": r.cfg.recipe}
    with r.ema.applied():  # a snapshot is what gets served: the EMA weights when on
        path = save_snapshot(r.run, days[-1], r.model,
                             {**r.identity(), "step": r.step, "examples": r.examples}, meta)
    log.info("published %s (days up to %d, step %d)", path, days[-1], r.step)
    return path
