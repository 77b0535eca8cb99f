"""The teacher service: a frozen foundation model, run once per example, shared by every student.

Legend: B rows, T tasks, E teacher embedding width (``embedding``: ``trunk`` = the heads' shared
trunk output, ``HeadsConfig.trunk_dims[-1]``; ``features`` = what the heads
read, ``GEM.feature_dim``).

    loader ─► batch ─► TeacherService.predict (no grad, eval, once) ─► TeacherOutput ─┬─► student 1
                                                                                     ├─► student 2 …
                                                                                     └─► Parquet cache (offline)

``TeacherOutput``: ``logits`` [B, T] (soft labels), ``embeddings`` [B, E] (for representation
transfer) and ``user_rep`` [B, E], each row's entry in the per-user cache. The default embedding is
``features``, what GEM's heads read (320 wide for ``tiny``, 640 for ``demo``); ``trunk``, the heads'
narrower shared trunk output, transferred less per user in benchmarks/transfer.py (R 0.36 vs 0.46
with KD, vm_s, 5 seeds).

Representation transfer "without serving cost" (ARCHITECTURE §4): a row's own teacher features
depend on its candidate ad, so serving them would mean running the teacher per candidate. The
servable form is ``UserRepCache``: user id → mean of the teacher's embeddings over that user's rows,
a feature-store table that the teacher fills as it scores traffic and that is *published once a day*
(LoopFM's historical representations). A row of day d reads its user's vector as published at the
end of day d − 1 (zeros for a user not seen before); at serving the same vector is one key-value
lookup by user id, passed as the student's ``teacher_rep_*`` dense user features, so training and
serving see the same thing. ``rep.source=row`` (the row's own features) is the offline upper bound.
``rep.source=days`` (LoopFM's representations over time) keeps one table per published day instead
(``opengem.transfer.user_reps.UserRepHistory``): a row of day d reads its user's vectors of the last
k published days < d, each day's table computed by that day's own snapshot (``DailySnapshots``) when
the run publishes snapshots.

The teacher is built and loaded as in training and evaluation (``opengem.run.load_run_model``: meta
→ materialise → load the DCP checkpoint), from a published snapshot when the run has any (a run
still training writes checkpoints; its snapshots are complete by construction, ``teacher_snapshot``
picks one by the student's day and the lag); a large teacher can be passed in already sharded
(``opengem.parallel.build_parallel_gem`` + ``load_checkpoint``): the service only calls it. A
student run can be a teacher too (hierarchical transfer): if it reads teacher embeddings, its own
teacher is given as ``upstream``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from opengem.checkpoint import CheckpointError, list_snapshots, newest_snapshot
from opengem.config import ConfigError
from opengem.data.batch import Batch
from opengem.model.student import forward_with_features, rep_dim_of, with_rep
from opengem.run import TRANSFER_FILE, load_run_model
from opengem.transfer.user_reps import UserRepCache, UserRepHistory

__all__ = ["CachedTeacher", "DailySnapshots", "TeacherOutput", "TeacherService", "UserRepCache",
           "UserRepHistory", "teacher_snapshot"]


@dataclass
class TeacherOutput:
    logits: torch.Tensor  # [B, T]
    embeddings: torch.Tensor | None = None  # [B, E]
    user_rep: torch.Tensor | None = None  # [B, E]
    # [B, k·r]: the user's last k published daily representations
    user_hist: torch.Tensor | None = None

    def select(self, rows: torch.Tensor | None) -> TeacherOutput:
        if rows is None:
            return self
        return TeacherOutput(*(None if x is None else x[rows]
                               for x in (self.logits, self.embeddings, self.user_rep,
                                         self.user_hist)))


class TeacherService:
    """A frozen teacher, called once per batch; every student reads the same ``TeacherOutput``.

    Args:
        model: a trained ``GEM`` (its serving head gives the logits, ``features`` the embeddings).
        user_cache: keep a ``UserRepCache`` of the embeddings (for ``rep.source=user`` students).
        upstream: for a teacher that reads teacher embeddings itself (a distilled domain FM with
            ``rep``), the service that provides them; ``upstream_source`` says which (user | row).
    """

    def __init__(self, model: torch.nn.Module, user_cache: bool = True,
                 upstream: TeacherService | None = None,
                 upstream_source: str = "user", embedding: str = "features",
                 history: tuple[int, int] | None = None):
        if embedding not in ("trunk", "features"):
            raise ValueError(f"teacher embedding must be trunk|features, got {embedding!r}")
        self.model = model.eval().requires_grad_(False)
        self.embedding = embedding
        self.rep_in = rep_dim_of(model.schema)
        if self.rep_in and upstream is None:
            raise ValueError("this teacher reads teacher embeddings (teacher_rep_* features): "
                             "pass its upstream teacher")
        self.upstream, self.upstream_source = upstream, upstream_source
        self.cache = UserRepCache(self.feature_dim) if user_cache else None
        # (days, dim): also keep the daily published representations (rep.source=days students)
        self.history = UserRepHistory(self.feature_dim, *history) if history else None
        self.calls, self.rows, self.day = 0, 0, None

    @classmethod
    def from_run(cls, run_dir: str | Path, upstream: TeacherService | None = None,
                 snapshot: str | Path | None = None) -> TeacherService:
        """A training or distillation run's model, loaded as training/evaluation do: ``snapshot`` (a
        published one, ``teacher_snapshot``), else the run's newest snapshot, else (a run that
        publishes none) its latest checkpoint."""
        if snapshot is None:
            newest = newest_snapshot(run_dir)
            snapshot = newest[0] if newest else None
        model, _, _ = load_run_model(run_dir, snapshot=snapshot)
        meta = Path(run_dir) / TRANSFER_FILE
        source = (
            json.loads(meta.read_text())["transfer"]["rep"]["source"] if meta.exists() else "user"
        )
        return cls(model, upstream=upstream, upstream_source=source)

    @property
    def schema(self):
        return self.model.schema

    @property
    def feature_dim(self) -> int:
        """E: the width of ``embeddings``."""
        if self.embedding == "features":
            return self.model.feature_dim
        h = self.model.heads.cfg.trunk_dims
        return h[-1] if h else self.model.feature_dim

    def max_seq_len(self) -> dict[str, int]:
        caps = self.model.max_seq_len()
        if self.upstream is not None:
            caps = {k: max(v, self.upstream.max_seq_len()[k]) for k, v in caps.items()}
        return caps

    @torch.no_grad()
    def predict(self, batch: Batch, update_cache: bool = True,
                day: int | None = None) -> TeacherOutput:
        """The teacher's outputs for ``batch``. ``update_cache``: add these rows to the user cache
        (training passes; off when scoring held-out days). ``day``: the rows' day; the cache is
        published when it changes, so rows read the snapshot of the days before theirs."""
        if day is not None and day != self.day:
            if self.cache is not None:
                self.cache.publish()
            self.day = day
        if self.rep_in:
            up = self.upstream.predict(batch, update_cache, day)
            batch = with_rep(batch,
                             up.user_rep if self.upstream_source == "user" else up.embeddings)
        logits, feats = self._features(self.model, batch)
        user_rep = user_hist = None
        if self.cache is not None:
            user_rep = self.cache.lookup(batch.user_id)
            if update_cache:
                self.cache.update(batch.user_id, feats)
        if self.history is not None:
            if day is None:
                raise ValueError("a teacher keeping daily representations needs each batch's day")
            if self.history.live is not None and self.history.live[0] != day:
                self.history.publish()  # the teacher moved on: the day's table is published
            user_hist = self.history.lookup(batch.user_id, day)
            day_feats = self._day_features(batch, day, feats) if update_cache else None
            if day_feats is not None:
                self.history.update(day, batch.user_id, day_feats)
        self.calls += 1
        self.rows += batch.batch_size
        return TeacherOutput(logits.float(), feats.float(), user_rep, user_hist)

    def _features(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        logits, feats = forward_with_features(model, batch)
        return logits, (model.heads.trunk(feats) if self.embedding == "trunk" else feats)

    def _day_features(self, batch: Batch, day: int, feats: torch.Tensor) -> torch.Tensor | None:
        """The embeddings day ``day``'s representation table is built from: those of the day's own
        snapshot (``history.snapshots``), else this teacher's; None when no snapshot may
        publish it."""
        snaps = self.history.snapshots
        if snaps is None:
            return feats
        model = snaps.model(day)
        if model is None or model is self.model:
            return None if model is None else feats
        return self._features(model, batch)[1]

    def cache_to_parquet(self, batches, path: str | Path, update_cache: bool = True,
                         meta: dict | None = None) -> int:
        """Score ``batches`` ((batch, day) pairs, e.g. ``SliceStream.batches()``) once and write the
        outputs in row order.

        Columns: ``user_id`` (checked on read), ``logit.<task>``, ``embedding`` and ``user_rep``
        (fixed-size float lists). ``meta`` (e.g. the loader's split/seed/shuffle) is stored in the
        file's metadata: a reader must replay the same row order. Returns the rows written."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        writer, n = None, 0
        for batch, day in batches:
            out = self.predict(batch, update_cache, day)
            cols = {"user_id": pa.array(batch.user_id.numpy())}
            for t, name in enumerate(self.schema.task_names):
                cols[f"logit.{name}"] = pa.array(out.logits[:, t].numpy())
            for key in ("embeddings", "user_rep"):
                x = getattr(out, key)
                if x is not None:
                    cols[key] = pa.FixedSizeListArray.from_arrays(
                        pa.array(x.numpy().ravel()), x.shape[1]
                    )
            table = pa.table(cols)
            if writer is None:
                schema = table.schema.with_metadata(
                    {"opengem.teacher_cache": json.dumps(meta or {})}
                )
                writer = pq.ParquetWriter(tmp, schema)
            writer.write_table(table.replace_schema_metadata(writer.schema.metadata))
            n += batch.batch_size
        if writer is not None:
            writer.close()
            tmp.replace(path)
        return n


def teacher_snapshot(run_dir: str | Path, day: int, lag: int) -> tuple[Path, dict]:
    """(path, snapshot.json) of the snapshot a student of ``day`` reads with ``lag`` days of delay:
    the newest that has seen only days up to ``day − 1 − lag`` (lag 0: everything before the
    student's day)."""
    if lag < 0:
        raise ConfigError(f"transfer.snapshot_lag is days of teacher delay: it must be >= 0, "
                          f"got {lag}")
    up_to = day - 1 - lag
    found = newest_snapshot(run_dir, up_to)
    if found is None:
        have = [f"{p.name} (up to day {m['last_day']})" for p, m in list_snapshots(run_dir)]
        raise CheckpointError(f"{run_dir}: no published snapshot has seen only days up to {up_to}, "
                              f"as a student of day {day} with transfer.snapshot_lag={lag} "
                              f"needs; snapshots: {', '.join(have) or 'none'} (a run publishes "
                              f"them when trained with --days or "
                              "--continue)")
    return found


class DailySnapshots:
    """The FM snapshot that computes each day's representation table (``rep.source=days``),
    loaded once.

    The rule: the table of day t is published when day t ends, so it is computed by the snapshot a
    student of day t + 1 reads, ``teacher_snapshot(run, t + 1, lag)`` (it has seen days ≤ t − lag);
    a row of day d reads tables of days t ≤ d − 1 only, so everything it reads was computed on
    features of days ≤ d − 1 by a model trained on days ≤ d − 1 − lag: nothing of day d or later.
    A day with no such snapshot (before the run's first, with the lag) gets no table.

    Args:
        run_dir: a continuously trained run (``RUN/snapshots``).  lag: ``transfer.snapshot_lag``.
        loaded: snapshots already loaded (path → model), e.g. the students' teacher, reused as is.
    """

    def __init__(self, run_dir: str | Path, lag: int,
                 loaded: dict[Path, torch.nn.Module] | None = None):
        self.run_dir, self.lag = Path(run_dir), lag
        self.loaded = {Path(p): m for p, m in (loaded or {}).items()}
        self.by_day: dict[int, tuple[torch.nn.Module | None, int | None]] = {}

    def _pick(self, day: int) -> tuple[torch.nn.Module | None, int | None]:
        if day not in self.by_day:
            try:
                path, meta = teacher_snapshot(self.run_dir, day + 1, self.lag)
            except CheckpointError:
                self.by_day[day] = (None, None)
            else:
                if path not in self.loaded:
                    self.loaded[path] = (
                        load_run_model(self.run_dir, snapshot=path)[0].eval().requires_grad_(False)
                    )
                self.by_day[day] = (self.loaded[path], meta["last_day"])
        return self.by_day[day]

    def model(self, day: int) -> torch.nn.Module | None:
        """The model that computes day ``day``'s table (None: the day gets none)."""
        return self._pick(day)[0]

    def last_day(self, day: int) -> int | None:
        """The last day seen by the snapshot that computes day ``day``'s table."""
        return self._pick(day)[1]


class CachedTeacher:
    """Reads a ``cache_to_parquet`` file in row order; ``predict`` has the service's signature."""

    def __init__(self, path: str | Path, task_names: list[str]):
        self.path = Path(path)
        table = pq.read_table(self.path)
        self.meta = json.loads((table.schema.metadata or {}).get(b"opengem.teacher_cache", b"{}"))
        self.user_id = table.column("user_id").to_numpy()
        self.logits = torch.from_numpy(np.stack([table.column(f"logit.{t}").to_numpy()
                                                 for t in task_names], 1))
        self.parts = {k: _fixed_list(table.column(k)) for k in ("embeddings", "user_rep")
                      if k in table.column_names}
        self.pos, self.calls, self.rows = 0, 0, 0

    def predict(self, batch: Batch, update_cache: bool = True,
                day: int | None = None) -> TeacherOutput:
        lo, hi = self.pos, self.pos + batch.batch_size
        if hi > len(self.user_id) or not np.array_equal(self.user_id[lo:hi], batch.user_id.numpy()):
            raise ValueError(f"{self.path}: rows {lo}..{hi} do not match this batch (replay the "
                             f"loader that wrote the cache: {self.meta})")
        self.pos, self.calls, self.rows = hi, self.calls + 1, self.rows + batch.batch_size
        parts = {k: v[lo:hi] for k, v in self.parts.items()}
        return TeacherOutput(self.logits[lo:hi], parts.get("embeddings"), parts.get("user_rep"))


def _fixed_list(col: pa.ChunkedArray) -> torch.Tensor:
    arr = col.combine_chunks()
    return torch.from_numpy(arr.values.to_numpy().reshape(len(arr), arr.type.list_size).copy())
