"""Checkpoints with ``torch.distributed.checkpoint`` (DCP), written atomically.

Layout::

    RUN/checkpoints/step-00000100/   DCP files: model + both optimizers (dense AdamW, sparse row-wise Adagrad)
                                     (+ the training weights when ``model`` holds an EMA: ``train.ema``)
        trainer_state-rank0.pt       step, examples seen, loader position, RNG, schema fingerprint
    RUN/checkpoints/LATEST           name of the newest complete checkpoint
    RUN/checkpoints/best/            ``train.keep_best``: the model (no optimizer) of the best held-out
                                     evaluation, replaced at each better one (``save_best``, ``best_checkpoint``)

A checkpoint is written into ``step-N.tmp`` and renamed only once complete; ``LATEST`` is
replaced atomically after the rename. A crash mid-save therefore leaves the previous checkpoint
as ``LATEST``, and a ``.tmp`` directory is never loaded (the next save removes stale ones). Only
the newest ``keep`` are kept. A failed write (e.g. a full disk) removes its ``.tmp`` and raises a
``CheckpointError`` that says where; the previous checkpoint stays ``LATEST``.

Published snapshots (continuous training, ``opengem.train.continual``) are what other stages read of
a run that is still training; a checkpoint may be being written, a snapshot never is::

    RUN/snapshots/day-00004/         DCP files: the model only (no optimizer), as trained to the end of day 4
        snapshot.json                ``last_day`` (the newest day it has seen), ``days`` (all of them), step
        trainer_state-rank0.pt       schema fingerprint, model config, step (what ``load_checkpoint`` checks)

``save_snapshot`` writes ``day-N.tmp`` and renames it once complete; ``list_snapshots`` lists only
renamed directories with both ``.metadata`` and ``snapshot.json``, so a reader never sees half a
snapshot, and one killed mid-publish is simply absent until it is published again.

Test hooks: ``OPENGEM_FAULT_SLEEP_IN_SAVE=seconds`` sleeps after ``step-N.tmp`` is complete and
before the rename, so a fault-injection test can kill a run inside that window;
``OPENGEM_FAULT_SLEEP_IN_PUBLISH`` does the same for ``day-N.tmp``.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

# RUN/checkpoints/best: the one file name of the best model; readers call best_checkpoint()
BEST = "best"
# RUN/snapshots: one published model per trained day; readers call list_snapshots()
SNAPSHOTS = "snapshots"
SNAPSHOT_META = "snapshot.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or belongs to another schema/model."""


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    root = checkpoint_dir(run_dir)
    pointer = root / "LATEST"
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    if not (path / ".metadata").exists():
        raise CheckpointError(f"{pointer} names {path.name}, which is incomplete or missing")
    return path


def best_checkpoint(run_dir: str | Path) -> Path | None:
    """RUN/checkpoints/best when a run with ``train.keep_best`` has written it, else None."""
    path = checkpoint_dir(run_dir) / BEST
    return path if (path / ".metadata").exists() else None


def _failures(e: BaseException) -> list[BaseException]:
    """``e`` and, for DCP's ``CheckpointException``, the per-rank exceptions it wraps."""
    return [e] + [f[0] if isinstance(f, tuple) else f
                  for f in (getattr(e, "failures", None) or {}).values()]


def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module, optimizers: list,
                    trainer_state: dict, keep: int = 2, extra: dict | None = None) -> Path:
    """``extra``: more named tensors to save beside model and optimizers (read back
    with ``load_tensors``)."""
    root = checkpoint_dir(run_dir)
    name = f"step-{step:08d}"
    final, tmp = root / name, root / f"{name}.tmp"
    if _rank() == 0:
        for stale in root.glob("step-*.tmp"):  # left by a run killed mid-save
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    msd, osd = get_state_dict(model, [o for o in optimizers if o is not None])
    _write(tmp, {"model": msd, "optim": osd, **(extra or {})}, trainer_state, root)
    if os.environ.get("OPENGEM_FAULT_SLEEP_IN_SAVE"):
        time.sleep(float(os.environ["OPENGEM_FAULT_SLEEP_IN_SAVE"]))
    _barrier()
    if _rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer_tmp = root / "LATEST.tmp"
        pointer_tmp.write_text(name)
        os.replace(pointer_tmp, root / "LATEST")
        done = sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def save_best(run_dir: str | Path, model: torch.nn.Module, trainer_state: dict) -> Path:
    """Replace RUN/checkpoints/best with ``model`` (every rank calls this). Written into
    ``best.tmp``; a crash before the swap keeps the previous best, and one inside it leaves
    ``best.old`` (not loaded)."""
    root = checkpoint_dir(run_dir)
    final, tmp, old = root / BEST, root / f"{BEST}.tmp", root / f"{BEST}.old"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    _write(tmp, {"model": get_model_state_dict(model)}, trainer_state, root)
    _barrier()
    if _rank() == 0:
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def snapshot_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / SNAPSHOTS


def snapshot_name(day: int) -> str:
    return f"day-{day:05d}"


def save_snapshot(run_dir: str | Path, day: int, model: torch.nn.Module, trainer_state: dict,
                  meta: dict) -> Path:
    """Publish ``model`` as RUN/snapshots/day-N (every rank calls this); ``meta`` becomes
    its snapshot.json.

    Written into ``day-N.tmp`` and renamed once complete. A snapshot already published is left as it
    is: a resume that redoes a day publishes the same model, and a reader may be loading the
    old one."""
    root = snapshot_dir(run_dir)
    name = snapshot_name(day)
    final, tmp = root / name, root / f"{name}.tmp"
    if (final / SNAPSHOT_META).exists() and (final / ".metadata").exists():
        return final
    if _rank() == 0:
        for stale in root.glob("day-*.tmp"):  # left by a run killed mid-publish
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    _write(tmp, {"model": get_model_state_dict(model)}, trainer_state, root)
    if _rank() == 0:
        (tmp
         / SNAPSHOT_META).write_text(json.dumps({**meta, "name": name}, indent=2, sort_keys=True))
    if os.environ.get("OPENGEM_FAULT_SLEEP_IN_PUBLISH"):
        time.sleep(float(os.environ["OPENGEM_FAULT_SLEEP_IN_PUBLISH"]))
    _barrier()
    if _rank() == 0:
        if final.exists():  # a directory without its files (removed by hand): replaced
            shutil.rmtree(final)
        os.replace(tmp, final)
    _barrier()
    return final


def list_snapshots(run_dir: str | Path) -> list[tuple[Path, dict]]:
    """(path, snapshot.json) of every complete snapshot, oldest last day first; ``.tmp``
    never listed."""
    root = snapshot_dir(run_dir)
    out = []
    for p in root.glob("day-*") if root.exists() else []:
        if (
            p.name.endswith(".tmp")
            or not (p / ".metadata").exists()
            or not (p / SNAPSHOT_META).exists()
        ):
            continue
        out.append((p, json.loads((p / SNAPSHOT_META).read_text())))
    return sorted(out, key=lambda s: s[1]["last_day"])


def newest_snapshot(run_dir: str | Path, up_to_day: int | None = None) -> tuple[Path, dict] | None:
    """The complete snapshot with the newest ``last_day`` (at most ``up_to_day`` if given),
    or None."""
    fit = [s for s in list_snapshots(run_dir) if up_to_day is None or s[1]["last_day"] <= up_to_day]
    return fit[-1] if fit else None


def _write(tmp: Path, state: dict, trainer_state: dict, root: Path) -> None:
    """DCP files of ``state`` and this rank's trainer state into ``tmp``; on failure ``tmp``
    is removed."""
    try:
        dcp.save(state, checkpoint_id=tmp)
        torch.save(trainer_state, tmp / f"trainer_state-rank{_rank()}.pt")
    except (Exception, dcp.CheckpointException) as e:  # the latter is a BaseException
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk needs the space back
        raise _save_error(e, tmp, root) from e


def _save_error(e: BaseException, tmp: Path, root: Path) -> CheckpointError:
    full = any(isinstance(x, OSError) and x.errno == errno.ENOSPC for x in _failures(e))
    pointer = root / "LATEST"
    previous = (
        f"{pointer.read_text().strip()} is intact"
        if pointer.exists()
        else "there is no previous checkpoint"
    )
    why = "; ".join(map(str, _failures(e)[1:] or [e]))
    return CheckpointError(f"{'disk full' if full else 'write failed'} while saving checkpoint "
                           f"{tmp} ({why}); removed it, {previous} in {root}")


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizers: list | None = None,
                    expect: dict | None = None) -> dict:
    """Load model (and optimizers if given) in place; returns this rank's trainer state.

    ``expect`` holds values (the schema fingerprint, the model config) the checkpoint must match;
    a mismatch, or tensors that do not fit ``model``, is a ``CheckpointError`` naming both sides.
    """
    path = Path(path)
    if not (path / ".metadata").exists():
        raise CheckpointError(f"{path}: not a complete checkpoint")
    state_file = path / f"trainer_state-rank{_rank()}.pt"
    if not state_file.exists():
        state_file = path / "trainer_state-rank0.pt"
    try:
        trainer_state = torch.load(state_file, weights_only=False)
    except Exception as e:
        raise CheckpointError(f"{state_file}: unreadable ({e})") from e
    for k, v in (expect or {}).items():
        # keys older checkpoints lack are not checked
        if k in trainer_state and trainer_state[k] != v:
            raise CheckpointError(f"{path} is from another {k}: "
                                  f"{_diff(trainer_state[k], v, k + '.')} "
                                  "(checkpoint vs this run)")
    opts = [o for o in (optimizers or []) if o is not None]
    msd, osd = get_state_dict(model, opts)
    state = {"model": msd, "optim": osd} if opts else {"model": msd}
    try:
        dcp.load(state, checkpoint_id=path,
                 planner=dcp.DefaultLoadPlanner(flatten_sharded_tensors=False))
    except (Exception, dcp.CheckpointException) as e:
        raise CheckpointError(f"{path} does not fit this model "
                              f"({'; '.join(map(str, _failures(e)[1:] or [e]))}); "
                              "a checkpoint from another model config?") from e
    if opts:
        set_state_dict(model, opts, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    else:
        model.load_state_dict(state["model"])
    return trainer_state


def load_tensors(path: str | Path, state: dict) -> None:
    """Load the entries of ``state`` (nested dicts of tensors, e.g. a ``save_checkpoint`` extra)
    from the checkpoint at ``path``, in place; a ``CheckpointError`` when they are missing or do
    not fit."""
    try:
        dcp.load(state, checkpoint_id=path,
                 planner=dcp.DefaultLoadPlanner(flatten_sharded_tensors=False))
    except (Exception, dcp.CheckpointException) as e:
        why = "; ".join(map(str, _failures(e)[1:] or [e]))
        raise CheckpointError(f"{path}: cannot load {sorted(state)} ({why})") from e


def _diff(saved: object, expected: object, where: str = "") -> str:
    """What differs between two values, by dotted key for nested dicts (both sides named)."""
    if isinstance(saved, dict) and isinstance(expected, dict):
        keys = sorted(set(saved) | set(expected), key=str)
        parts = [_diff(saved.get(k), expected.get(k), f"{where}{k}.") for k in keys
                 if saved.get(k) != expected.get(k)]
        return ", ".join(parts)
    return f"{where.rstrip('.') or 'value'} {saved!r} vs {expected!r}"
