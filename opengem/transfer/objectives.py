"""Mismatched objectives: a student's task the FM never trained on, taught by the FM's closest head.

GEM's students serve surfaces whose objectives GEM need not share. The synthetic
world's ``surface_task`` (``opengem.world.latent.SurfaceTask``) adds one: ``engage`` on one
surface, sharing part of click's drivers and adding its own. The FM trains on a *view* of the data
without it (``fm_view``: the same shards, a schema without the task), and the student's tasks are
the data's; KD maps each student task to a teacher head (``head_map``): the head of the same name,
else the one named in ``transfer.kd.heads`` (``"engage:click"``), else the teacher's first task (its
serving head). With the adapter on, that head is recalibrated to the new task's labels first, which
is what turns a click logit into an ``engage`` soft label.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

from opengem.config import ConfigError
from opengem.data.parquet import MANIFEST
from opengem.features.schema import SCHEMA_FILE, FeatureSchema, SchemaError


def without_tasks(schema: FeatureSchema, drop) -> FeatureSchema:
    """``schema`` without the tasks ``drop`` (the FM's view)."""
    drop = set(drop)
    unknown = drop - set(schema.task_names)
    if unknown:
        raise ConfigError(f"tasks {sorted(unknown)} are not in the schema ({schema.task_names})")
    return dataclasses.replace(schema, tasks=tuple(t for t in schema.tasks if t.name not in drop))


def fm_view(data_dir: str | Path, out_dir: str | Path, drop) -> Path:
    """A data directory that is ``data_dir`` without the tasks ``drop``: the same shards (linked)
    and manifest, a schema without those tasks, so an FM trained on it never sees their labels."""
    data_dir, out = Path(data_dir).resolve(), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    without_tasks(FeatureSchema.load(data_dir), drop).save(out / SCHEMA_FILE)
    shutil.copyfile(data_dir / MANIFEST, out / MANIFEST)
    for p in data_dir.iterdir():
        if p.name not in (SCHEMA_FILE, MANIFEST) and not (out / p.name).exists():
            os.symlink(p, out / p.name)
    return out


def head_map(student_tasks: list[str], teacher_tasks: list[str],
             heads: tuple[str, ...] = ()) -> list[int]:
    """For each student task, the index of the teacher head KD reads (module docstring)."""
    named = {}
    for pair in heads:
        s, _, t = pair.partition(":")
        if not t or t not in teacher_tasks:
            raise ConfigError(f"transfer.kd.heads entry {pair!r} must be STUDENT_TASK:TEACHER_TASK "
                              f"with a teacher task of {teacher_tasks}")
        named[s] = t
    return [teacher_tasks.index(s if s in teacher_tasks else named.get(s, teacher_tasks[0]))
            for s in student_tasks]


def check_teacher_schema(teacher: FeatureSchema, data: FeatureSchema) -> None:
    """The teacher must read the data's features; its tasks may be a subset of the data's
    (a view)."""
    names = set(teacher.task_names)
    if not names <= set(data.task_names) or without_tasks(data,
                                                          set(data.task_names)
                                                          - names).fingerprint() \
            != teacher.fingerprint():
        raise SchemaError("the teacher was trained on another schema than this data's (or one of "
                          "its task views)")
