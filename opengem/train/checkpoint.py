"""Checkpoints with ``torch.distributed.checkpoint`` (DCP), written atomically.

Layout::

    RUN/checkpoints/step-00000100/   DCP files: model + both optimizers (dense AdamW, sparse row-wise Adagrad)
        trainer_state-rank0.pt       step, examples seen, loader position, RNG, schema fingerprint
    RUN/checkpoints/LATEST           name of the newest complete checkpoint

A checkpoint is written into ``step-N.tmp`` and renamed only once complete; ``LATEST`` is
replaced atomically after the rename. A crash mid-save therefore leaves the previous checkpoint
as ``LATEST``, and a ``.tmp`` directory is never loaded. Only the newest ``keep`` are kept.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


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


def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module, optimizers: list,
                    trainer_state: dict, keep: int = 2) -> Path:
    root = checkpoint_dir(run_dir)
    name = f"step-{step:08d}"
    final, tmp = root / name, root / f"{name}.tmp"
    if _rank() == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    msd, osd = get_state_dict(model, [o for o in optimizers if o is not None])
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp)
    torch.save(trainer_state, tmp / f"trainer_state-rank{_rank()}.pt")
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


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizers: list | None = None,
                    expect: dict | None = None) -> dict:
    """Load model (and optimizers if given) in place; returns this rank's trainer state.

    ``expect`` holds values (e.g. the schema fingerprint) the checkpoint must match.
    """
    path = Path(path)
    if not (path / ".metadata").exists():
        raise CheckpointError(f"{path}: not a complete checkpoint")
    state_file = path / f"trainer_state-rank{_rank()}.pt"
    if not state_file.exists():
        state_file = path / "trainer_state-rank0.pt"
    trainer_state = torch.load(state_file, weights_only=False)
    for k, v in (expect or {}).items():
        if trainer_state.get(k) != v:
            raise CheckpointError(f"{path}: checkpoint {k} is {trainer_state.get(k)!r}, expected {v!r} "
                                  "(a checkpoint from another schema or model)")
    opts = [o for o in (optimizers or []) if o is not None]
    msd, osd = get_state_dict(model, opts)
    state = {"model": msd, "optim": osd} if opts else {"model": msd}
    dcp.load(state, checkpoint_id=path, planner=dcp.DefaultLoadPlanner(flatten_sharded_tensors=False))
    if opts:
        set_state_dict(model, opts, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        model.load_state_dict(state["model"])
    return trainer_state
