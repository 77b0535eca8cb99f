"""Training and evaluating students on a shared stream: one teacher call feeds every student.

Why a loop of its own rather than ``opengem.train.trainer``: that loop's step is GEM's masked BCE
on one model; a distillation step takes the teacher's output, updates the student adapter *before*
the student (ExFM Algorithm 1), and steps several students on the same batch. Everything else is
the trainer's: ``build_optimizers`` (AdamW + row-wise Adagrad), ``Schedule``, ``masked_bce``, the
second half of the step (``opengem.train.step.backward`` and ``update``: clearing the gradients,
backward, grad clipping, the optimizers), ``save_checkpoint``. Students are single-process (they are
small by construction).
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from opengem.config import Config
from opengem.data.batch import Batch
from opengem.evaluation.accumulator import MetricAccumulator
from opengem.features.schema import FeatureSchema
from opengem.model.student import Student, forward_with_features, with_rep
from opengem.progress import progress_bar
from opengem.train.optim import Schedule, build_optimizers
from opengem.train.step import backward, update
from opengem.transfer.adapter import StudentAdapter
from opengem.transfer.config import TransferConfig
from opengem.transfer.losses import distill_loss
from opengem.transfer.objectives import head_map
from opengem.transfer.stream import cap_history, select_rows
from opengem.transfer.teacher import TeacherOutput


class StudentTrainer:
    """One student's training state (model, optimisers, lr schedule, adapter) and its step.

    Not the trainer's loop: each step needs the teacher's predictions on the batch, the adapter
    updated before the student, and the KD losses; from the loss on it is the trainer's step.

    Args:
        name: a label for reports.  student: the ``Student``.  cfg: its recipe (``optim`` is read).
        tcfg: its techniques.  data_schema: the schema of the rows (the student's adds rep features).
        total_steps: length of the lr schedule (``SliceStream.steps``).
        teacher_tasks: the teacher's heads, where they are not the data's tasks: each student task then
            reads its closest head (``transfer.objectives.head_map``, ``tcfg.kd.heads``).
    """

    def __init__(self, name: str, student: Student, cfg: Config, tcfg: TransferConfig,
                 data_schema: FeatureSchema, total_steps: int,
                 teacher_tasks: list[str] | None = None):
        self.name, self.student, self.cfg, self.tcfg = name, student, cfg, tcfg
        self.domains = torch.tensor([data_schema.domains.names.index(d) for d in tcfg.domains])
        dense, sparse = build_optimizers(student.dense_parameters(), student.sparse_parameters(),
                                         cfg.optim)
        self.optimizers = [o for o in (dense, sparse) if o is not None]
        self.schedule = Schedule(self.optimizers, total_steps, cfg.optim)
        # teacher head per student task, when their tasks differ
        self.head_idx: torch.Tensor | None = None
        borrowed = None  # [T]: the tasks read from another task's head
        if teacher_tasks is not None and list(teacher_tasks) != data_schema.task_names:
            idx = head_map(data_schema.task_names, list(teacher_tasks), tcfg.kd.heads)
            self.head_idx = torch.tensor(idx)
            borrowed = torch.tensor([teacher_tasks[i] != t for t,
                                     i in zip(data_schema.task_names, idx)])
        self.adapter = (StudentAdapter(data_schema, tcfg.adapter, borrowed)
                        if tcfg.kd.enabled and tcfg.adapter.enabled else None)
        self.task_w = torch.tensor([t.weight for t in data_schema.tasks])
        self.data_schema = data_schema
        self.caps = dict(student.max_seq_len())
        # tables shared from the teacher (set by whoever built the student)
        self.shared: list[str] = []
        self.step_n = self.examples = 0
        self.sums = {"loss_true": 0.0, "loss_distill": 0.0, "loss_adapter": 0.0}
        self.wall = 0.0

    # ------------------------------------------------------------------ inputs
    def view(self, batch: Batch, tout: TeacherOutput) -> tuple[Batch, TeacherOutput] | None:
        """This student's rows of a shared batch, its history caps, and its rep input."""
        rows = torch.isin(batch.domain, self.domains)
        if not bool(rows.all()):
            if not bool(rows.any()):
                return None
            idx = rows.nonzero().squeeze(1)
            batch, tout = select_rows(batch, idx), tout.select(idx)
        batch = cap_history(batch, self.data_schema, self.caps)
        # a task the teacher lacks reads its closest head (transfer.objectives)
        if self.head_idx is not None:
            tout = dataclasses.replace(tout, logits=tout.logits[:, self.head_idx])
        if self.tcfg.rep.enabled:
            rep = {"user": tout.user_rep, "row": tout.embeddings,
                   "days": tout.user_hist}[self.tcfg.rep.source]
            if rep is None:
                raise ValueError(f"student {self.name!r} needs teacher "
                                 f"embeddings ({self.tcfg.rep.source}) "
                                 "that the teacher service does not provide")
            batch = with_rep(batch, rep)
        return batch, tout

    def teacher_logits(self, batch: Batch, tout: TeacherOutput) -> torch.Tensor | None:
        """The logits the soft label is made of (``distill_loss`` tempers them); updates the adapter
        on this batch's labels first (stale → fresh)."""
        if not self.tcfg.kd.enabled:
            return None
        if self.adapter is None:
            return tout.logits
        self.sums["loss_adapter"] += self.adapter.update(tout.logits, batch)
        return self.adapter.target(tout.logits, batch)

    # ------------------------------------------------------------------ step
    def step(self, batch: Batch, tout: TeacherOutput) -> None:
        t0 = time.perf_counter()
        v = self.view(batch, tout)
        if v is None:
            return
        batch, tout = v
        teacher = self.teacher_logits(batch, tout)
        self.schedule.set(min(self.step_n, self.schedule.total - 1))
        self.student.train()
        logits, aux = self.student.forward_train(batch)
        loss = distill_loss(logits, aux, teacher, batch.labels, batch.label_mask, batch.weights,
                            self.task_w, self.tcfg)
        if not math.isfinite(loss.total.item()):
            raise FloatingPointError(f"student {self.name!r}: loss is {loss.total.item()} at "
                                     f"step {self.step_n}")
        backward(loss.total, self.optimizers)
        update(self.optimizers, list(self.student.dense_parameters()), self.cfg.optim.grad_clip)
        self.step_n += 1
        self.examples += batch.batch_size
        self.sums["loss_true"] += loss.true
        self.sums["loss_distill"] += loss.distill
        self.wall += time.perf_counter() - t0

    @torch.no_grad()
    def predict(
        self, batch: Batch, tout: TeacherOutput
    ) -> tuple[Batch, TeacherOutput, torch.Tensor] | None:
        """(this student's rows, the teacher's output on them, the student's
        serving probabilities)."""
        v = self.view(batch, tout)
        if v is None:
            return None
        self.student.eval()
        return v[0], v[1], torch.sigmoid(self.student(v[0]).double())

    @torch.no_grad()
    def teach(self, batch: Batch, tout: TeacherOutput) -> TeacherOutput | None:
        """This student as a teacher (a domain FM for its followers): its logits and features on its
        rows of ``batch``, computed before it learns from them (call before ``step``)."""
        v = self.view(batch, tout)
        if v is None:
            return None
        self.student.eval()
        logits, feats = forward_with_features(self.student.backbone, v[0])
        return TeacherOutput(logits.float(), feats.float())

    def summary(self) -> dict:
        n = max(self.step_n, 1)
        return {"steps": self.step_n, "examples": self.examples, "train_s": round(self.wall, 2),
                **{k: v / n for k, v in self.sums.items()}}


def train_students(trainers: list[StudentTrainer], stream, followers: dict | None = None,
                   progress: bool = False) -> dict:
    """One pass of ``stream`` ((batch, TeacherOutput) pairs), every student stepping on every batch.

    ``followers``: {student name: students taught by that student} — hierarchical transfer online:
    the domain FM scores each batch *before* it learns from it, as a continuously trained FM serves
    its VMs, so their soft labels are never in-sample. A follower serves the same surfaces as its FM
    and reads its logits (and, for ``rep.source=row``, its features)."""
    followers = followers or {}
    batches = 0
    bar = progress_bar(total=getattr(stream, "steps", None), desc="distill", unit="batch",
                       disable=not progress,
               dynamic_ncols=True)
    for batch, tout in stream:
        bar.update(1)
        for tr in trainers:
            taught = tr.teach(batch, tout) if followers.get(tr.name) else None
            tr.step(batch, tout)
            if taught is not None:
                rows = batch if bool(torch.isin(batch.domain, tr.domains).all()) else \
                    select_rows(batch, torch.isin(batch.domain, tr.domains).nonzero().squeeze(1))
                for f in followers[tr.name]:
                    f.step(rows, taught)
        batches += 1
    bar.close()
    return {"batches": batches}


@torch.no_grad()
def evaluate_students(trainers: list[StudentTrainer], stream, schema: FeatureSchema,
                      base_rates: dict, references: dict | None = None) -> dict:
    """Metrics of each student and, on the same rows with the same normaliser, of its teacher
    (``"teacher@<student>"``) and of each reference model (``"<name>@<student>"``, e.g. GEM when the
    teacher is a domain FM). ``references``: name → a service with
    ``predict(batch, update_cache)``."""
    def acc():
        return MetricAccumulator(list(schema.domains.names), schema.task_names, base_rates)

    refs = references or {}
    accs = {name: acc() for tr in trainers for name in [tr.name, f"teacher@{tr.name}"]
            + [f"{r}@{tr.name}" for r in refs]}
    for batch, tout in stream:
        ref_out = {r: svc.predict(batch, update_cache=False) for r, svc in refs.items()}
        for tr in trainers:
            out = tr.predict(batch, tout)
            if out is None:
                continue
            rows, t_rows, probs = out
            preds = {tr.name: probs, f"teacher@{tr.name}": torch.sigmoid(t_rows.logits.double())}
            if refs:
                idx = torch.isin(batch.domain, tr.domains).nonzero().squeeze(1)
                preds.update({f"{r}@{tr.name}": torch.sigmoid(o.logits[idx].double()) for r,
                              o in ref_out.items()})
            for name, p in preds.items():
                accs[name].update(p, rows.labels, rows.label_mask, rows.domain, rows.user_id,
                                  rows.true_probs)
    return {name: a.compute() for name, a in accs.items()}


def transfer_ratio(ne_alone: float, ne_with: float, ne_teacher: float) -> float:
    """R = (NE_alone − NE_with) / (NE_alone − NE_teacher): the share of the teacher's lead the
    student captured (dossier §8.6); NaN when the teacher is not ahead of the student alone."""
    gap = ne_alone - ne_teacher
    return (ne_alone - ne_with) / gap if gap > 0 else math.nan
