"""``opengem distill``: GEM → vertical model (direct) or GEM → domain FM → vertical
model (hierarchical).

Staleness is the data split: the teacher run was trained on the ``train`` days 1..T; the student
trains on the ``valid`` days T+1..T+k (``transfer.train_split``) and is evaluated on the ``test``
days after them, while the synthetic world drifts (``WorldConfig`` ``behaviour.interest_drift``,
``click.ad_drift``, ``click.advertiser_drift``, ``sizes.new_ads_per_day``;
k = ``sizes.valid_days``):
``opengem generate --preset demo --out DIR sizes.valid_days=2 click.ad_drift=0.2`` makes the
teacher staler.

A student run directory is an ordinary run directory (the served backbone is a ``GEM``), plus::

    RUN/transfer.json     teacher (and --via) runs, techniques, surfaces, splits, shared tables
    RUN/user_rep.pt       the per-user teacher embeddings the student reads (rep.source=user): the
                          feature-store snapshot that serving looks its ``teacher_rep_*`` features up in
                          (rep.source=days: the daily tables and their projection, ``UserRepHistory``)
    RUN/evaluation.json   the student, the same student alone, its teacher (and GEM) on the same
                          held-out slice, and the transfer ratio R per task

so ``opengem evaluate`` / ``opengem export`` take it as they take a GEM run, and ``--via`` takes
one as a teacher.

Staleness as a knob (``transfer.snapshot_lag``): when GEM is trained continuously
(``opengem train --continue``), its teacher is the snapshot that has seen days up to d − 1 − lag,
d the first day of the student's split (one teacher for the whole split in this version); the
snapshot read is recorded in transfer.json (``teacher_snapshot``). With ``rep.source=days`` each
day's representation table is computed by that day's own snapshot (``DailySnapshots``: the snapshot
a student of the next day reads, with the same lag; lag 0 when unset), not by the students' teacher.

A student's tasks are the data's; a task the teacher lacks (its schema a task view of the data's,
``opengem.transfer.objectives``) reads the teacher's closest head (``transfer.kd.heads``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from opengem.checkpoint import newest_snapshot, save_checkpoint
from opengem.config import Config, apply_prefixed_overrides
from opengem.data.parquet import DatasetManifest
from opengem.evaluation import EVAL_BATCH
from opengem.features.schema import FeatureSchema, SchemaError
from opengem.model.build import count_parameters
from opengem.model.heads import HeadsConfig
from opengem.model.student import build_student, rep_dim_of, student_schema
from opengem.recipes import student_recipe
from opengem.run import (
    EVALUATION_FILE,
    TRANSFER_FILE,
    USER_REP_FILE,
    load_run_model,
    save_base_rates,
    save_config,
    save_final,
    save_schema,
    write_json,
)
from opengem.train.trainer import params_sha256
from opengem.transfer.config import TransferConfig, techniques_config
from opengem.transfer.objectives import check_teacher_schema
from opengem.transfer.share import share_parameters
from opengem.transfer.stream import SliceStream, domain_ids, slice_rates
from opengem.transfer.teacher import (
    DailySnapshots,
    TeacherService,
    UserRepHistory,
    teacher_snapshot,
)
from opengem.transfer.trainer import (
    StudentTrainer,
    evaluate_students,
    train_students,
    transfer_ratio,
)

log = logging.getLogger(__name__)


def make_trainer(name: str, cfg: Config, tcfg: TransferConfig, data_schema: FeatureSchema,
                 teacher: TeacherService, rates: dict, total_steps: int) -> StudentTrainer:
    """A student for ``tcfg``'s techniques: its schema (+ rep features), aux head, shared tables.
    ``teacher`` needs ``model`` (tables to share) and ``feature_dim`` (rep width) only: a service,
    or a domain FM that is still learning (benchmarks/transfer.py's online hierarchy)."""
    schema = student_schema(data_schema, rep_width(tcfg, teacher.feature_dim))
    aux = None
    if tcfg.kd.enabled and tcfg.aux.enabled:
        h = cfg.model.heads
        aux = HeadsConfig(trunk_dims=tcfg.aux.trunk_dims, task_dims=tcfg.aux.task_dims,
                          domain_mode=h.domain_mode, chain_required=h.chain_required)
    student = build_student(schema, cfg, [rates.get(t, 0.5) for t in schema.task_names],
                            cfg.train.seed, aux, tcfg.aux.label_scale, tcfg.aux.grad_scale)
    shared = (
        share_parameters(student.backbone, teacher.model, tcfg.share) if tcfg.share.enabled else []
    )
    # after sharing: frozen tables stay out
    tr = StudentTrainer(name, student, cfg, tcfg, data_schema, total_steps,
                        teacher.model.schema.task_names)
    tr.shared = shared
    return tr


def rep_width(tcfg: TransferConfig, feature_dim: int) -> int:
    """How many ``teacher_rep_*`` features the student reads (0 without ``rep``)."""
    if not tcfg.rep.enabled:
        return 0
    return tcfg.rep.days * tcfg.rep.dim if tcfg.rep.source == "days" else feature_dim


def keep_history(tcfg: TransferConfig, teacher: TeacherService,
                 snapshots: DailySnapshots | None = None) -> bool:
    """Give ``teacher`` daily representation tables if the student reads them (rep.source=days),
    each day's computed by its own snapshot when ``snapshots`` is given; True if so."""
    if not (tcfg.rep.enabled and tcfg.rep.source == "days"):
        return False
    if snapshots is not None and teacher.rep_in:
        raise ValueError("daily snapshots compute GEM's own representations: not those of a "
                         "teacher fed by another")
    if teacher.history is None:
        teacher.history = UserRepHistory(teacher.feature_dim, tcfg.rep.days, tcfg.rep.dim,
                                         snapshots)
    return True


def reads_user_cache(tcfg: TransferConfig, teacher: TeacherService) -> bool:
    """Whether the student, or its teacher (a domain FM fed by GEM), reads per-user embeddings."""
    own = tcfg.rep.enabled and tcfg.rep.source == "user"
    return own or bool(teacher.rep_in and teacher.upstream_source == "user")


def gem_snapshot(
    teacher_run: str | Path, data_dir: str | Path, tcfg: TransferConfig
) -> tuple[Path, dict] | None:
    """The snapshot of GEM the students read (``transfer.snapshot_lag``; None: a run
    without snapshots)."""
    if tcfg.snapshot_lag is None:
        return newest_snapshot(teacher_run)
    day = min(DatasetManifest.load(data_dir).splits[tcfg.train_split])
    return teacher_snapshot(teacher_run, day, tcfg.snapshot_lag)


def load_teachers(teacher_run: str | Path, via: str | Path | None, data_schema: FeatureSchema,
                  snapshot: str | Path | None = None, best: bool = False):
    """(GEM service, the student's teacher service: GEM itself, or the domain FM fed by GEM); GEM
    from ``snapshot`` if given, else from its best kept checkpoint with ``best``
    (``train.keep_best``), else as ``TeacherService.from_run`` picks (its newest snapshot, else its
    last checkpoint)."""
    if snapshot is None and best:
        gem = TeacherService(load_run_model(teacher_run, best=True)[0])
    else:
        gem = TeacherService.from_run(teacher_run, snapshot=snapshot)
    try:
        check_teacher_schema(gem.schema, data_schema)
    except SchemaError as e:
        raise SchemaError(f"teacher {teacher_run}: {e}") from None
    return gem, (TeacherService.from_run(via, upstream=gem) if via else gem)


def distill(teacher_run: str | Path, recipe_name: str, data_dir: str | Path, out_dir: str | Path,
            overrides: list[str] | tuple[str, ...] = (), via: str | Path | None = None,
            tcfg: TransferConfig | None = None, best: bool = False) -> dict:
    """Distil a student from ``teacher_run`` (through ``via``, a distilled domain FM, if given) on
    ``data_dir``; write the student run into ``out_dir``; return its evaluation. ``best``: the
    teacher is the run's best held-out evaluation's model (``train.keep_best``) unless a snapshot
    is read."""
    t0 = time.perf_counter()
    trees = apply_prefixed_overrides({"": student_recipe(recipe_name),
                                      "transfer": tcfg or TransferConfig()}, overrides)
    cfg, tcfg = trees[""], trees["transfer"]
    tcfg.validate()
    torch.manual_seed(cfg.train.seed)
    data_schema = FeatureSchema.load(data_dir)
    snap = gem_snapshot(teacher_run, data_dir, tcfg)
    if snap:
        log.info("teacher %s: snapshot %s (days up to %d; transfer.snapshot_lag=%s)", teacher_run,
                 snap[0].name, snap[1]["last_day"], tcfg.snapshot_lag)
    gem, teacher = load_teachers(teacher_run, via, data_schema, snap[0] if snap else None, best)
    domains = domain_ids(data_schema, tcfg.domains)
    rates, n_slice, n_all = slice_rates(data_dir, data_schema, tcfg.train_split, domains)
    # GEM's daily tables from each day's own snapshot (a run trained continuously); --via: the
    # domain FM's
    daily = (
        DailySnapshots(teacher_run, tcfg.snapshot_lag or 0, {snap[0]: gem.model})
        if snap and not via
        else None
    )
    days = keep_history(tcfg, teacher, daily)
    stream = SliceStream(data_dir, tcfg.train_split, data_schema, domains, teacher,
                         cfg.data.batch_size, seed=cfg.data.seed, slice_rows=n_slice,
                         all_rows=n_all, warmup_days=tcfg.rep.days if days
                                         else int(reads_user_cache(tcfg, teacher)))
    trainers = [make_trainer("student", cfg, tcfg, data_schema, teacher, rates, stream.steps)]
    if tcfg.baseline:
        alone = techniques_config([], domains=tcfg.domains)
        trainers.append(make_trainer("alone", cfg, alone, data_schema, teacher, rates,
                                     stream.steps))
    train_students(trainers, stream,
                   progress=logging.getLogger("opengem").isEnabledFor(logging.INFO))
    t_train = time.perf_counter() - t0
    scored = {"teacher_calls": teacher.calls - stream.warm_calls,
              "teacher_rows": teacher.rows - stream.warm_rows,
              "teacher_warmup_rows": stream.warm_rows}
    test = SliceStream(data_dir, tcfg.eval_split, data_schema, domains, teacher, EVAL_BATCH,
                       shuffle=False, update_cache=False)
    ev = evaluate_students(trainers, test, data_schema, rates, {"gem": gem} if via else None)
    out = report(ev, tcfg, via is not None, test.rows)
    out["times"] = {"train_s": t_train, "total_s": time.perf_counter() - t0}
    read = (
        {"path": str(snap[0]), "last_day": snap[1]["last_day"], "step": snap[1]["step"]}
        if snap
        else None
    )
    save_run(Path(out_dir), trainers[0], cfg, tcfg, rates, teacher, out,
             {"teacher": str(teacher_run), "via": str(via) if via else None, "data": str(data_dir),
              "teacher_snapshot": read,
              "teacher_checkpoint": None if snap else "best" if best else "last"},
             scored)
    return out


def report(ev: dict, tcfg: TransferConfig, via: bool, rows: int) -> dict:
    """Student, alone, teacher (and GEM) metrics on the student's slice; R per task (vs GEM)."""
    out = {"split": tcfg.eval_split, "rows": rows, "domains": list(tcfg.domains),
           "techniques": tcfg.techniques(), "metrics": ev["student"],
           "teacher": ev["teacher@student"]}
    if via:
        out["gem"] = ev["gem@student"]
    if "alone" in ev:
        out["alone"] = ev["alone"]
        ref = out.get("gem", out["teacher"])
        out["transfer_ratio"] = {
            k.split("/", 1)[1]: transfer_ratio(
                ev["alone"][k]["ne"], ev["student"][k]["ne"], ref[k]["ne"]
            )
            for k in ev["student"]
            if k.startswith("all/")
        }
    return out


def save_run(run: Path, tr: StudentTrainer, cfg: Config, tcfg: TransferConfig, rates: dict,
             teacher: TeacherService, evaluation: dict, sources: dict, scored: dict) -> None:
    """The student's run directory (see the module docstring)."""
    run.mkdir(parents=True, exist_ok=True)
    backbone = tr.student.backbone
    schema = backbone.schema
    save_config(run, cfg)
    save_schema(run, schema)
    save_base_rates(run, rates)
    write_json(run / TRANSFER_FILE,
               {**sources, "recipe": cfg.recipe, "transfer": dataclasses.asdict(tcfg),
                                     "shared": tr.shared, "rep_dim": rep_dim_of(schema)})
    if tcfg.rep.enabled and tcfg.rep.source == "user":
        torch.save(teacher.cache.state_dict(), run / USER_REP_FILE)
    # the daily tables serving looks the stream up in
    if tcfg.rep.enabled and tcfg.rep.source == "days":
        torch.save(teacher.history.state_dict(), run / USER_REP_FILE)
    ckpt = save_checkpoint(run, tr.step_n, backbone, [],
                           {"schema": schema.fingerprint(), "step": tr.step_n,
                                                          "examples": tr.examples})
    evaluation = {**evaluation, "run": str(run)}
    write_json(run / EVALUATION_FILE, evaluation)
    save_final(run,
               {"steps": tr.step_n, "examples": tr.examples,
                "parameters": count_parameters(backbone),
                     "params_sha256": params_sha256(backbone), "checkpoint": ckpt.name,
                     "recipe": cfg.recipe, "schema": schema.fingerprint(),
                     **scored, **tr.summary()})

