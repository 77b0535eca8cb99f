"""The training entry point: one function from (config, data, run dir) to a trained run.

One loop serves both launches::

    opengem train …                                    one process: the plain model, CPU
    torchrun --nproc-per-node N -m opengem train …     N ranks: TorchRec tables + FSDP2 dense
                                                       (``parallel.*`` overrides; docs/distributed.md)

Files: config, schema, base rates, the down-sampling record (``data.negative_rate`` < 1), metrics
(one line per logging step, and one per held-out evaluation when they are on: ``hooks``,
``train.eval_every`` …), TensorBoard scalars, quarantined rows and final.json (written by rank 0)
and checkpoints (by every rank; ``best/`` with ``train.keep_best``), in the run directory laid out
in ``opengem.run``.

Distributed rules (the loop is the same; ``opengem.parallel.train_step`` makes it exact):

- every rank runs the same number of steps: the planned total is the minimum over ranks (each
  reads its own shards, so row counts differ), and a step only starts once every rank has a batch;
- ``schedule.set(step)`` comes before the forward: the fused CPU table kernel reads the lr then;
- the loss is scaled so the mean over ranks is the global-batch loss; that mean is what is logged.

Resume (``--resume``) at the same world size is exact: each rank continues its own shard stream.
At another world size the data position is re-derived from every rank's saved position (see
``train.resume.shared_data_boundary``): exact where they meet at a shard boundary, else refused, or
with ``train.resume_reshard=rewind`` restarted at the last shared boundary (rows after it repeat).

Held-out evaluation, early stopping and the best checkpoint are hooks (``opengem.train.hooks``): the
caller passes ``evaluator=`` (the CLI: ``evaluation.evaluate.held_out_evaluator``) and
``train.eval_*`` keys say when; with them off the loop runs exactly as without them.

``train.ema_decay`` > 0 (the ``tiny`` and ``demo`` recipes): an average of the dense weights is what
evaluations score and what checkpoints, snapshots and ``final.json``'s ``params_sha256`` hold;
training itself is unchanged and its weights travel beside the average (``opengem.train.ema``).
``train.soft_label_runs``: before each step the batch's labels are mixed with the mean probability
of those trained runs (``opengem.train.soft_labels``); the step itself is the same.

Continuous training (``days=``; ``opengem train --continue RUN --days …``): one pass over each of
those days in order, warm-started from the run's checkpoint, a snapshot published after each day's
last step; ``opengem.train.continual`` says how (schedule, snapshots, resume). Without ``days`` the
loop is exactly the plain one.

SIGTERM (a preemption notice; torchrun forwards it to every worker and SIGKILLs after 30 s) sets a
flag; the step in flight finishes, every rank agrees on the flag (a collective, so all stop after
the same step), a checkpoint is written and the process exits with ``EXIT_PREEMPTED`` (75, "try
again"). ``--resume`` then continues exactly. A SIGKILL loses the steps since the last checkpoint.

The run's parts and counters, and their restore from a checkpoint, are an ``opengem.train.state.
TrainState``; after each step the loop asks its components, in a fixed order, whether they are due:
evaluation, a stream's day end, the checkpoint cadence, preemption (``_after_step``).
"""

from __future__ import annotations

import hashlib
import logging
import math
import resource
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from opengem.checkpoint import latest_checkpoint, list_snapshots, save_best, save_checkpoint
from opengem.config import Config, ConfigError
from opengem.data.base_rates import train_base_rates
from opengem.data.batch import Batch
from opengem.data.downsampling import NegativeSampler
from opengem.data.loader import ShardLoader
from opengem.features.schema import FeatureSchema
from opengem.model.build import (
    build_gem,
    count_parameters,
    dense_norm_stats,
    fit_dense_norm,
    materialize,
)
from opengem.model.logit_shift import LogitShift, RecalibrationError, gem_heads, offsets_tensor
from opengem.parallel import ParallelDims, SparseOptimizerSpec, build_parallel_gem
from opengem.parallel import train_step as dist_step
from opengem.parallel.launch import (
    DistInfo,
    comm_device,
    destroy_distributed,
    init_distributed,
    min_over_ranks,
)
from opengem.progress import progress_bar
from opengem.run import (
    QUARANTINE_DIR,
    downsampling_record,
    load_config,
    load_downsampling,
    save_base_rates,
    save_config,
    save_dense_stats,
    save_downsampling,
    save_final,
    save_schema,
)
from opengem.train.continual import (
    DayEnd,
    DayStream,
    check_stream_config,
    continue_config,
    publish,
    start_stream,
    stream_of,
)
from opengem.train.hooks import CheckpointEvery, EvalHook, Evaluator
from opengem.train.observe import RunLog
from opengem.train.optim import Schedule, build_optimizers
from opengem.train.resume import EXIT_PREEMPTED, Preempted, SigtermFlag, resume_run
from opengem.train.state import TrainState
from opengem.train.step import TrainingError, train_step

log = logging.getLogger(__name__)

# Above this many parameters final.json skips params_sha256 in distributed runs: hashing needs every
# full table on every rank at once.
HASH_LIMIT = 200_000_000


def state_sha256(state: dict[str, torch.Tensor]) -> str:
    """The parameter fingerprint: names and bytes in sorted name order (any world size,
    same format)."""
    h = hashlib.sha256()
    for name, t in sorted(state.items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def loop_parts(cfg: Config) -> tuple[CheckpointEvery, DayEnd, SigtermFlag]:
    """The parts the loop asks after each step whether they are due, in ``TrainState``'s order:
    the checkpoint cadence, a stream's day end, pre-emption."""
    return CheckpointEvery(cfg.train.ckpt_every), DayEnd(), SigtermFlag()


def params_sha256(model: torch.nn.Module) -> str:
    return state_sha256(model.state_dict())


def train(cfg: Config, data_dir: str | Path, run_dir: str | Path, resume: bool = False,
          evaluator: Evaluator | None = None, *, days: list[int] | None = None, warm: bool = False,
          publish_end: bool = False) -> dict:
    """Train from ``cfg``; under torchrun every rank calls this. Returns final.json's content.

    ``evaluator`` scores the model on held-out data when ``train.eval_every``, ``eval_each_epoch``
    or ``eval_at`` asks for it (``opengem.train.hooks``); it is not called otherwise. ``days``:
    train a stream over those days (``opengem.train.continual``); ``warm``: continuing the run in
    ``run_dir`` from its checkpoint (``continue_training``). ``publish_end``: a plain run also
    publishes its final model as the snapshot of its last day, for readers of snapshots (the
    demo's teacher)."""
    cfg.validate()
    if not (resume or warm):
        refuse_a_used_run_dir(Path(run_dir))
    if cfg.train.evaluates and evaluator is None:
        raise ConfigError("train.eval_every/eval_each_epoch/eval_at need an evaluator: pass "
                          "train(…, evaluator=…), "
                          "e.g. opengem.evaluation.evaluate.held_out_evaluator(data_dir, "
                          "cfg.train.eval_split)")
    owned = not (dist.is_available() and dist.is_initialized())
    info = init_distributed(cfg.parallel.backend)
    try:
        final = _train(cfg, Path(data_dir), Path(run_dir), resume, info, evaluator, days, warm,
                       publish_end)
    except BaseException:
        if owned and info.backend is not None:  # no barrier: the other ranks may be gone already
            dist.destroy_process_group()
        raise
    if owned:
        destroy_distributed()
    return final


def refuse_a_used_run_dir(run: Path) -> None:
    """A fresh run refuses a directory that already holds a run's checkpoints or
    published snapshots.

    Why: a fresh run writes its files over the old ones but not every old file is rewritten (a
    snapshot already published is kept by design, old step-N checkpoints, the best one), so a reader
    of RUN/snapshots would load the old run's model: silently when the config is the same, with a
    size mismatch when not. ``--resume`` continues the run; a new directory starts a new one."""
    found = [p.name for p in (run / "checkpoints" / "LATEST", run / "snapshots") if p.exists()
             and (p.is_file() or any(p.glob("day-*")))]
    if found:
        raise ConfigError(f"{run} already holds a training run ({', '.join(found)}): pass --resume "
                          f"to continue "
                          "it, or train into a new or empty directory (its old checkpoints and "
                          "snapshots would mix with this run's)")


def continue_training(run_dir: str | Path, data_dir: str | Path, days: list[int], overrides=(),
                      resume: bool = False, evaluator: Evaluator | None = None) -> dict:
    """Continue the run in ``run_dir`` over ``days`` (``opengem train --continue``), warm-started
    from its latest checkpoint with ``continue_config``. Returns final.json's content."""
    cfg = continue_config(run_dir, overrides)
    return train(cfg, data_dir, run_dir, resume, evaluator, days=list(days), warm=True)


def _train(cfg: Config, data_dir: Path, run: Path, resume: bool, info: DistInfo,
           evaluator: Evaluator | None, days: list[int] | None = None, warm: bool = False,
           publish_end: bool = False) -> dict:
    if days is not None:
        return _train_stream(cfg, data_dir, run, resume, info, evaluator, days, warm)
    schema, rates, model, optimizers, sparse, sampling = _parts(cfg, data_dir, run, info)
    loader = ShardLoader(data_dir, cfg.data.train_split, cfg.data.batch_size, schema,
                         rank=info.rank, world_size=info.world_size, shuffle=cfg.data.shuffle,
                         seed=cfg.data.seed, epochs=cfg.train.epochs, drop_last=info.world_size > 1,
                         max_seq_len=model.max_seq_len(),
                         quarantine_dir=run / QUARANTINE_DIR, prefetch=cfg.data.prefetch,
                         negative_rate=cfg.data.negative_rate,
                         negative_rate_by_domain=cfg.data.negative_rate_by_domain)
    total = _planned_steps(cfg, loader, sparse is not None)
    # Built before a checkpoint is loaded: Schedule keeps the config's base lrs.
    schedule = Schedule(optimizers, total, cfg.optim)
    r = TrainState(cfg, schema, run, info, model, optimizers, sparse, loader, schedule, total,
                   *loop_parts(cfg), publish_end=publish_end)
    if sampling is not None:
        try:  # before any step: a correction that cannot be served must not cost a training run
            r.downsampling = downsampling_record(gem_heads(model), schema, sampling[0], sampling[1])
        except RecalibrationError as e:
            raise ConfigError(f"data.negative_rate < 1 needs a correction in the heads' "
                              f"biases: {e}") from None
    if cfg.train.evaluates:
        r.evals = EvalHook(cfg.train, evaluator, rates, info)
    if resume:
        resume_run(r, latest_checkpoint(run))
    return _run(r, rates)


def _parts(cfg: Config, data_dir: Path, run: Path, info: DistInfo):
    """(schema, base rates, model, optimizers, sparse sharding or None, down-sampling or None: see
    ``_negative_sampling``), seeded, in this order (the order every earlier run used: their
    parameters depend on it; the down-sampling count draws from numpy, not from
    torch's generator)."""
    run.mkdir(parents=True, exist_ok=True)
    schema = FeatureSchema.load(data_dir)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(cfg.train.seed + info.rank)
    rates = train_base_rates(data_dir, schema, cfg.data.train_split, info.rank, info.world_size)
    sampling, init_rates = _negative_sampling(cfg, schema, data_dir, rates)
    model, optimizers, sparse = _build(cfg, schema,
                                       [init_rates.get(t, 0.5) for t in schema.task_names], info)
    # a resume or continuation loads the checkpoint's
    fit_dense_norm(model, data_dir, schema, cfg.data.train_split)
    return schema, rates, model, optimizers, sparse, sampling


def _run(r: TrainState, rates: dict, config: bool = True) -> dict:
    if r.info.is_main:  # after the resume checks: a refused resume leaves the run as it was
        if config:
            save_config(r.run, r.cfg)
            stats = dense_norm_stats(r.model)
            if stats is not None:
                save_dense_stats(r.run, stats)
        save_schema(r.run, r.schema)
        save_base_rates(r.run, rates)  # the true rates, NE's normaliser, whatever the sampling
        if r.downsampling is not None:
            save_downsampling(r.run, r.downsampling)
    t_start = time.perf_counter()
    with r.sigterm:  # held over the final save too: a late SIGTERM lets it finish
        _loop(r)
        return _finish(r, time.perf_counter() - t_start)


def _negative_sampling(cfg: Config, schema: FeatureSchema, data_dir: Path,
                       rates: dict[str, float]) -> tuple[tuple[dict, dict] | None,
                                                         dict[str, float]]:
    """With ``data.negative_rate(_by_domain)`` < 1: ((rates by domain, rows read and kept), the
    rates the heads' biases start at); else (None, ``rates``).

    NE keeps the true rates (``RUN/base_rates.json``: evaluation reads all rows). The biases start
    at the rates the loss sees on the kept rows instead: a bias started at the true rate would
    first have to travel log(1/r) (2.3 at r = 0.1), which takes the tiny recipes most of their
    steps. Counted over all files of the split on every rank (labels only): no collective."""
    try:
        sampler = NegativeSampler(schema, cfg.data.negative_rate, cfg.data.negative_rate_by_domain,
                                  cfg.data.seed)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not sampler.active:
        return None, rates
    counts = sampler.count_split(data_dir, cfg.data.train_split, cfg.train.epochs)
    kept = [sum(k[e] for k in counts.kept.values()) for e in range(cfg.train.epochs)]
    sampled = counts.sampled_rates(schema.task_names)
    record = {"rows_read_per_epoch": sum(counts.read.values()), "rows_kept_per_epoch": kept,
              "train_base_rates": {t: rates[t] for t in schema.task_names if t in rates},
              "sampled_base_rates": sampled}
    return (sampler.rates(), record), {**rates, **sampled}


def _refuse_sampled_stream(cfg: Config, run: Path, warm: bool) -> None:
    """A stream (``DayStream``) reads every row: down-sampling it, or continuing a down-sampled run
    (whose RUN/downsampling.json would then correct a model trained on all rows), is refused."""
    by_domain = cfg.data.negative_rate_by_domain.values()
    if (
        cfg.data.negative_rate < 1
        or any(float(r) < 1 for r in by_domain)
        or (warm and load_downsampling(run))
    ):
        raise ConfigError("negative down-sampling (data.negative_rate < 1, RUN/downsampling.json) "
                          "is not supported by continuous training (--continue/--days) yet: its "
                          "DayStream reads every row")


def _train_stream(cfg: Config, data_dir: Path, run: Path, resume: bool, info: DistInfo,
                  evaluator: Evaluator | None,
                  days: list[int], warm: bool) -> dict:
    """``_train`` for a stream (``opengem.train.continual``): the same parts, a ``DayStream`` for a
    loader. A warm leg leaves config.json as the run wrote it: its overrides are the leg's (as
    ``--resume``'s are the resumed command's), and a plain run's schedule horizon is recomputed
    from it."""
    check_stream_config(cfg, info.world_size)
    _refuse_sampled_stream(cfg, run, warm)
    prev = load_config(run) if warm else cfg
    schema, rates, model, optimizers, sparse, _ = _parts(cfg, data_dir, run, info)
    loader = DayStream(data_dir, days, cfg.data.batch_size, schema, [], cfg.data.train_split,
                       shuffle=cfg.data.shuffle, seed=cfg.data.seed,
                       max_seq_len=model.max_seq_len(), quarantine_dir=run / QUARANTINE_DIR,
                       prefetch=cfg.data.prefetch)
    schedule = Schedule(optimizers, 0, cfg.optim)  # its horizon is set by start_stream
    r = TrainState(cfg, schema, run, info, model, optimizers, sparse, loader, schedule, 0,
                   *loop_parts(cfg))
    if cfg.train.evaluates:
        r.evals = EvalHook(cfg.train, evaluator, rates, info)

    def plain_run() -> tuple[Config, int]:
        ld = ShardLoader(data_dir, prev.data.train_split, prev.data.batch_size, schema,
                         shuffle=prev.data.shuffle,
                         seed=prev.data.seed, epochs=prev.train.epochs)
        return prev, _planned_steps(prev, ld, False)

    start_stream(r, latest_checkpoint(run) if (warm or resume) else None, warm, resume, plain_run)
    return _run(r, rates, config=not warm)


def _build(cfg: Config, schema: FeatureSchema, base_rates: list[float], info: DistInfo):
    """(model, optimizers, sparse sharding or None): the plain model on one process, else the
    parallel one."""
    if info.backend is None:
        model = materialize(build_gem(schema, cfg.model), "cpu", cfg.train.seed, base_rates)
        dense, sparse_opt = build_optimizers(model.dense_parameters(), model.sparse_parameters(),
                                             cfg.optim)
        return model, [o for o in (dense, sparse_opt) if o is not None], None
    dims = ParallelDims.from_config(cfg.parallel, info.world_size)
    if info.is_main:
        log.info("%s", dims.describe())
    model, sparse = build_parallel_gem(schema, cfg.model, dims, cfg.parallel,
                                       SparseOptimizerSpec.from_optim(cfg.optim),
                                       # logs the sparse plan on rank 0
                                       info.device, cfg.train.seed, base_rates)
    dense = build_optimizers(model.dense_parameters(), [], cfg.optim)[0]
    return model, [dense, sparse.optimizer], sparse


def _planned_steps(cfg: Config, loader: ShardLoader, distributed: bool) -> int:
    """Length of the lr schedule: this rank's batches, the minimum over ranks, capped by max_steps.

    Ranks drop their last partial batch (``drop_last``): every step has the same rows on every
    rank, which row-wise sharded sequence tables need (their all-gathers take equal sizes)."""
    B = cfg.data.batch_size
    rows = loader.planned_rows(cfg.train.epochs)  # the kept rows when negatives are down-sampled
    mine = sum(rows) // B if loader.drop_last else sum(math.ceil(n / B) for n in rows)
    return min_over_ranks(min(cfg.train.max_steps or 10**15, mine), distributed)


# ---------------------------------------------------------------------------------- the loop
def _loop(r: TrainState) -> None:
    cfg = r.cfg
    stop = min(r.total, cfg.train.stop_at or r.total)
    task_w = torch.tensor([t.weight for t in r.schema.tasks], device=r.info.device)
    dense_params = list(r.model.dense_parameters())
    bar = progress_bar(total=r.total, initial=r.step, desc="train", unit="step", smoothing=0.05,
               disable=not (cfg.train.progress and r.info.is_main))
    clock = [time.perf_counter(), r.examples, r.eval_s]
    started, ended = clock[0], r.step >= r.total
    batches = iter(r.loader)
    r.model.train()
    try:
        # purge_step: after a resume TensorBoard hides the old events of the steps about to
        # be redone
        with RunLog(r.run, enabled=r.info.is_main, purge_step=r.step + 1) as mlog:
            # the untrained model is a candidate too
            if r.evals and r.step == 0 and r.evals.due_at_start():
                _evaluate(r, mlog, started)
            # checked before the loader hands out (and counts) another batch
            while r.step < stop and not (r.evals and r.evals.stopped):
                batch, rows = _next_batch(batches, r)
                if batch is None:
                    ended = True
                    break
                loss, table, lr_f = _step(r, batch, task_w, dense_params)
                r.step += 1
                r.examples += rows
                bar.update(1)
                ended = r.step >= r.total
                if r.step % cfg.train.log_every == 0 or r.step == r.total:
                    _log(r, mlog, bar, clock, {"loss": loss, "lr_factor": lr_f},
                         _global_table(r, table, batch))
                if not _after_step(r, mlog, started, stop):
                    break
            # the final model, not a stop_at pause
            if r.evals and ended and r.evals.due_at_end(r.step):
                _evaluate(r, mlog, started)
    finally:
        batches.close()
        bar.close()


def _after_step(r: TrainState, mlog, started: float, stop: int) -> bool:
    """Ask each component whether it is due after this step; False: the loop stops here. The order
    is fixed: every rank asks the same questions in it (some are collectives)."""
    if r.evals and r.evals.due(r.step, r.loader.state_dict()["epoch"]):
        _evaluate(r, mlog, started)
    if r.day_end.due(r):  # before a checkpoint can say the day is done
        r.day_end.publish(r)
    if r.step >= stop or (r.evals and r.evals.stopped):
        return False
    saved = r.checkpoints.due(r)
    if saved:
        _save(r)
    if r.sigterm.due(r):
        _preempt(r, saved)
    return True


def _evaluate(r: TrainState, mlog, started: float) -> None:
    """A held-out evaluation after this step (``hooks``), and the best checkpoint when it is the
    best; their seconds are not training time: ``train_s`` and every examples/s leave them out."""
    t0 = time.perf_counter()
    # Down-sampled negatives: score the corrected model, as every later stage
    # does (model.logit_shift.LogitShift).
    model = r.model if r.downsampling is None else LogitShift(r.model, offsets_tensor(
        gem_heads(r.model), r.downsampling["offsets"], r.schema))
    with r.ema.applied():  # the weights that are kept and served are the ones judged
        record, best = r.evals.evaluate(model, r.step)
        if best and r.cfg.train.keep_best:
            save_best(r.run, r.model, {**r.identity(), "step": r.step, "examples": r.examples,
                                       "eval_metric": record["eval_metric"]})
    train_s, dt = t0 - started - r.eval_s, time.perf_counter() - t0
    r.eval_s += dt
    mlog.log(r.step, {"examples": r.examples, "train_s": train_s, "eval_s": dt, **record})


def _save(r: TrainState) -> None:
    """A checkpoint: ``model`` holds the weights that are served (the EMA when on), the training
    weights travel beside them (``opengem.train.ema``)."""
    with r.ema.applied():
        save_checkpoint(r.run, r.step, r.model, r.optimizers, r.trainer_state(),
                        extra=r.ema.extra())


def _preempt(r: TrainState, saved: bool) -> None:
    if not saved:
        _save(r)
    msg = (f"SIGTERM: stopped after step {r.step} of {r.total} and "
           f"saved {latest_checkpoint(r.run)}; "
           f"exiting with code {EXIT_PREEMPTED}; continue with `opengem train … --resume`")
    if r.info.is_main:
        log.warning("%s", msg)
    raise Preempted(msg)


def _next_batch(batches, r: TrainState) -> tuple[Batch | None, int]:
    """This rank's next batch and the rows of the whole step (all ranks); (None, 0) as soon as any
    rank has run out, so that every rank stops at the same step (a collective)."""
    batch = next(batches, None)
    rows = 0 if batch is None else batch.batch_size
    if not r.distributed:
        return batch, rows
    t = torch.tensor([float(batch is not None), float(rows)], dtype=torch.float64,
                     device=comm_device())
    dist.all_reduce(t)
    if int(t[0].item()) < r.info.world_size:
        return None, 0
    if r.info.device.type != "cpu":
        batch = batch.to(r.info.device, non_blocking=True)
    return batch, int(t[1].item())


def _step(r: TrainState, batch: Batch, task_w: torch.Tensor,
          dense_params: list) -> tuple[float, torch.Tensor, float]:
    """One optimizer step; returns (loss of the global batch, this rank's per-(domain, task) table,
    lr factor)."""
    # before the forward: the fused CPU table kernel takes its lr there
    lr_f = r.schedule.set(r.step)
    if r.soft is not None:
        batch = r.soft(batch)
    try:
        value, table = train_step(r.model, r.optimizers, batch, task_w, r.schema.num_domains,
                                  grad_clip=r.cfg.optim.grad_clip, fp8=r.cfg.train.fp8_activations,
                                  dense_params=dense_params)
    except TrainingError as e:
        raise TrainingError(f"{e} at step {r.step}; last "
                            f"checkpoint: {latest_checkpoint(r.run)}") from None
    r.ema.update()
    return value, table, lr_f


def _global_table(r: TrainState, table: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The per-(domain, task) loss table of the global batch (a collective when distributed)."""
    if not r.distributed:
        return table
    dom = (
        batch.domain
        if batch.domain is not None
        else torch.zeros(batch.batch_size, dtype=torch.long)
    )
    w = batch.label_mask.to(table.dtype) * batch.weights.unsqueeze(1)
    den = table.new_zeros(table.shape).index_add_(0, dom.to(table.device), w)
    both = torch.stack([torch.nan_to_num(table) * den, den]).to(comm_device())
    dist.all_reduce(both)
    num, den = both.cpu()
    return torch.where(den > 0, num / den.clamp(min=1e-12), torch.full_like(num, float("nan")))


def _log(r: TrainState, mlog, bar, clock: list, values: dict, table: torch.Tensor) -> None:
    if not r.info.is_main:
        return
    now = time.perf_counter()
    eps = (r.examples - clock[1]) / max(now - clock[0] - (r.eval_s - clock[2]), 1e-9)
    clock[:] = [now, r.examples, r.eval_s]
    mlog.log(r.step, {"examples": r.examples, **values, "examples_per_s": eps,
                      "loss_by_domain_task": _table(table, r.schema)})
    bar.set_postfix(loss=f"{values['loss']:.4f}", eps=f"{eps:,.0f}")


def _table(table: torch.Tensor, schema: FeatureSchema) -> dict[str, float]:
    out = {}
    for g, dname in enumerate(schema.domains.names):
        for t, tname in enumerate(schema.task_names):
            v = table[g, t].item()
            if not math.isnan(v):
                out[f"{dname}/{tname}"] = round(v, 6)
    return out


# ---------------------------------------------------------------------------------- summary
def _finish(r: TrainState, wall: float) -> dict:
    """Final checkpoint, final.json (rank 0); every rank returns the same summary."""
    _save(r)
    quarantined, repaired, rss = _gather_counts(r)
    parameters = count_parameters(build_gem(r.schema, r.cfg.model))  # on meta: no memory
    with r.ema.applied():  # the fingerprint of the weights that are served
        sha, why = _fingerprint(r, parameters["total"])
    final = {
        "steps": r.step, "examples": r.examples, "params_sha256": sha, "parameters": parameters,
        "wall_s": wall, "examples_per_s": (r.examples - r.start_examples)
                        / max(wall - r.eval_s, 1e-9), "recipe": r.cfg.recipe,
        "schema": r.schema.fingerprint(), "checkpoint": str(latest_checkpoint(r.run).name),
        "quarantined": quarantined, "repaired": repaired, "world_size": r.info.world_size,
        "peak_rss_mb": rss,
    }
    if why:
        final["params_sha256_skipped"] = why
    if r.downsampling is not None:
        final["downsampling"] = r.downsampling
    if r.evals:
        final["evaluation"] = {**r.evals.summary(), "eval_s": r.eval_s}
    if r.resumed:
        final["resharded"] = r.resumed
    if r.distributed:
        final["parallel"] = {"dims": r.sparse.dims.describe(),
                             "sparse_plan": r.sparse.describe().splitlines()}
    # not a pause
    if r.publish_end and (r.step >= r.total or r.loader.state_dict()["epoch"] >= r.loader.epochs):
        publish(r, sorted({f.day for f in r.loader.files}))
    if stream_of(r) is not None or r.publish_end:
        snaps = list_snapshots(r.run)
        final["days"] = (
            stream_of(r).completed if stream_of(r) is not None else (snaps[-1][1]["days"] if snaps else [])
        )
        final["snapshot"] = snaps[-1][0].name if snaps else None
    if r.info.is_main:
        save_final(r.run, final)
    if r.distributed:
        box = [final]
        dist.broadcast_object_list(box, src=0)
        final = box[0]
    return final


def _gather_counts(r: TrainState) -> tuple[dict, dict, list[float]]:
    """Quarantined rows and repairs summed over ranks; peak RSS (MB) per rank."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    mine = (dict(r.loader.quarantined), r.loader.stats.as_dict(), round(rss, 1))
    every = [mine]
    if r.distributed:
        every = [None] * r.info.world_size
        dist.all_gather_object(every, mine)
    quarantined = sum((Counter(q) for q, _, _ in every), Counter())
    return dict(quarantined), _sum_nested([s for _, s, _ in every]), [x for _, _, x in every]


def _sum_nested(dicts: list[dict]) -> dict:
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = _sum_nested([out.get(k, {}), v]) if isinstance(v, dict) else out.get(k, 0) + v
    return out


def _fingerprint(r: TrainState, n_params: int) -> tuple[str | None, str | None]:
    """params_sha256 over the full parameters, keyed as on one process (a collective
    when distributed)."""
    if not r.distributed:
        return params_sha256(r.model), None
    if n_params > HASH_LIMIT:
        return (
            None,
            f"{n_params:,} parameters > {HASH_LIMIT:,}: hashing would gather every full table "
            f"on every rank",
        )
    full = dist_step.gather_full_state_dict(r.model, r.sparse.sharding_pg)
    return (state_sha256(full) if r.info.is_main else None), None
