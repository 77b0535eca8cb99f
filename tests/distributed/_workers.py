"""Worker functions for the multi-process tests (importable, so ``mp.spawn`` can pickle them).

Every job trains the same tiny GEM on the same GLOBAL batches: rank r of W takes rows
[r·B/W, (r+1)·B/W) of each global batch, the single-process reference trains on all B rows.
Labels are partly masked, so ranks hold different numbers of labelled rows per task.
Workers record what they measured with ``torch.save`` under ``out/``; the test process compares.
"""

from __future__ import annotations

import contextlib
import functools
import time
import traceback
from pathlib import Path

import numpy as np
import torch

GLOBAL_BATCH = 16
SEED = 3
BASE_RATES = [0.15, 0.03]
TOTAL_STEPS = 6  # length of the lr schedule every run uses (warm-up, then cosine)
ADAM_EPS = 1e-6


# ---------------------------------------------------------------------------------- shared setup
def tiny_model_cfg():
    from opengem.model.foundation import GEMConfig
    from opengem.model.heads import HeadsConfig
    from opengem.model.interaction_arch import WukongConfig
    from opengem.model.interformer import InterFormerConfig
    from opengem.model.sequence_arch import SequenceConfig

    return GEMConfig(
        embedding_dim=8,
        wukong=WukongConfig(num_layers=2, num_fm=2, num_lc=2, fm_rank=2, mlp_dims=(16,)),
        sequence=SequenceConfig(num_heads=2, recent_len=8, min_recent=2, num_pooled=2,
                                time_buckets=8),
        interformer=InterFormerConfig(num_sum=2, num_pma=1, num_recent=1),
        heads=HeadsConfig(trunk_dims=(16,), task_dims=(8,)),
    )


def optim_cfg():
    from opengem.config import OptimConfig

    # The warm-up changes the lr every step (the fused kernels must get each step's lr);
    # clipping is active (dense gradient norms are 0.06-0.13 here: the norm must be reduced over
    # the DTensor shards before clipping).
    return OptimConfig(lr=1e-2, weight_decay=0.01, warmup_steps=2, schedule="cosine",
                       grad_clip=0.05, sparse_lr=0.05, sparse_eps=1e-8)


def adamw(params, ocfg):
    """The trainer's AdamW (``build_optimizers``) with eps 1e-6 instead of 1e-8, for the
    equivalence runs.

    Some gradients are analytically zero and numerically rounding noise (~1e-10): the key biases
    of every attention (softmax is shift-invariant) and sums that cancel. With eps = 1e-8 Adam
    turns that noise into updates of ~1% of lr, so any other summation order (a sharded
    reduce-scatter instead of one process's sum) moves those entries by up to ~1e-3 relative
    (measured); eps = 1e-6 keeps the comparison about the distributed math, not amplified noise.
    """
    return torch.optim.AdamW(list(params), lr=ocfg.lr, betas=tuple(ocfg.betas),
                             weight_decay=ocfg.weight_decay,
                             eps=ADAM_EPS)


def well_conditioned_adam(opt) -> None:
    """Set AdamW's eps to ``ADAM_EPS`` after loading a checkpoint of the trainer's AdamW
    (see ``adamw``)."""
    for g in opt.param_groups:
        g["eps"] = ADAM_EPS


def _table(schema, step: int):
    from opengem.testing import random_table

    return random_table(schema, GLOBAL_BATCH, seed=100 + step)


def _mask(shape, step: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(step).uniform(size=tuple(shape)) > 0.25)


def global_batch(schema, step: int):
    from opengem.data.batch import collate

    b = collate(_table(schema, step), schema)
    b.label_mask &= _mask(b.label_mask.shape, step)
    return b


def rank_batch(schema, step: int, rank: int, world: int):
    """Rows [rank·B/W, (rank+1)·B/W) of global batch ``step``, with the same label mask."""
    from opengem.data.batch import collate

    n = GLOBAL_BATCH // world
    b = collate(_table(schema, step).slice(rank * n, n), schema)
    b.label_mask &= _mask((GLOBAL_BATCH, b.label_mask.shape[1]), step)[rank * n:(rank + 1) * n]
    return b


def task_weights(schema):
    return torch.tensor([t.weight for t in schema.tasks])


def run_steps(schema, model, opts, schedule, steps, distributed: bool) -> list[float]:
    """The trainer's step, single-process (global batch) or distributed (this rank's rows)."""
    import torch.distributed as dist

    from opengem.parallel import train_step
    from opengem.train.losses import global_masked_bce, masked_bce

    ocfg = optim_cfg()
    dense_params = model.dense_parameters()
    losses = []
    for step in steps:
        schedule.set(step)
        if distributed:
            b = rank_batch(schema, step, dist.get_rank(), dist.get_world_size())
            loss_fn, clip = global_masked_bce, train_step.clip_grad_norm_
        else:
            b = global_batch(schema, step)
            loss_fn, clip = masked_bce, torch.nn.utils.clip_grad_norm_
        loss, _ = loss_fn(model(b), b.labels, b.label_mask, b.weights, task_weights(schema),
                          b.domain, schema.num_domains)
        for o in opts:
            o.zero_grad(set_to_none=True)
        loss.backward()
        clip(dense_params, ocfg.grad_clip)
        for o in opts:
            o.step()
        losses.append((train_step.global_mean(loss) if distributed else loss).item())
    return losses


# ---------------------------------------------------------------------------------- single process
def plain_model(seed: int = SEED):
    from opengem.model.build import build_gem, materialize
    from opengem.testing import tiny_schema

    return materialize(build_gem(tiny_schema(), tiny_model_cfg()), "cpu", seed, BASE_RATES)


def plain_optimizers(model, sparse_kind: str = "rowwise_adagrad", trainer_adam: bool = False):
    """[dense, sparse] exactly as the trainer builds them (``build_optimizers``); see ``adamw``."""
    from opengem.train.optim import build_optimizers

    ocfg = optim_cfg()
    dense, sparse = build_optimizers(model.dense_parameters(), model.sparse_parameters(), ocfg)
    if not trainer_adam:
        dense = adamw(model.dense_parameters(), ocfg)
    if sparse_kind == "sgd":
        sparse = torch.optim.SGD(model.sparse_parameters(), lr=ocfg.sparse_lr)
    return [dense, sparse]


@contextlib.contextmanager
def one_thread():
    """Single-process runs in the test process: torch's default thread pool spins against the
    workers (and anything else) on 2 cores and runs ~5× slower than one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@functools.cache
def reference_run(steps: int, sparse_kind: str = "rowwise_adagrad"):
    """The single-process trainer's math on the global batches: (losses, final state dict). Cached
    per test session; callers must not modify the result."""
    from opengem.testing import tiny_schema
    from opengem.train.optim import Schedule

    with one_thread():
        model = plain_model()
        opts = plain_optimizers(model, sparse_kind)
        losses = run_steps(tiny_schema(), model, opts, Schedule(opts, TOTAL_STEPS, optim_cfg()),
                           range(steps), False)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------- distributed
def build_parallel(pcfg, sparse_kind: str = "rowwise_adagrad", trainer_adam: bool = False):
    """Parallel GEM + [AdamW, FusedSparseOptimizer], as the trainer would build them."""
    import torch.distributed as dist

    from opengem.parallel import ParallelDims, SparseOptimizerSpec, build_parallel_gem
    from opengem.testing import tiny_schema
    from opengem.train.optim import build_optimizers

    schema, ocfg = tiny_schema(), optim_cfg()
    dims = ParallelDims.from_config(pcfg, dist.get_world_size())
    spec = SparseOptimizerSpec(sparse_kind, ocfg.sparse_lr, ocfg.sparse_eps)
    model, sparse = build_parallel_gem(schema, tiny_model_cfg(), dims, pcfg, spec, "cpu", SEED,
                                       BASE_RATES)
    params = model.dense_parameters()
    dense = build_optimizers(params, [], ocfg)[0] if trainer_adam else adamw(params, ocfg)
    return schema, model, sparse, [dense, sparse.optimizer]


def full_state(model, opts, sparse=None) -> dict[str, object]:
    """Parameters (``model.<fqn>``) and optimizer state (``optim.…``) as full plain values."""
    from opengem.parallel import train_step

    pg = sparse.sharding_pg if sparse is not None else None
    out = {f"model.{k}": v for k, v in train_step.gather_full_state_dict(model, pg).items()}
    out.update({f"optim.{k}": v for k,
                v in train_step.gather_full_optim_state(model, opts, pg).items()})
    return out


def replica_gap(sparse) -> float:
    """Largest difference between this rank's table shards and the same shards of the
    other copies."""
    import torch.distributed as dist

    if not sparse.dims.sparse_2d:
        return 0.0
    mine = torch.cat([t.reshape(-1) for _, pieces in sparse.table_shards() for _, t in pieces])
    copies = [torch.empty_like(mine) for _ in range(sparse.dims.sparse_replicas)]
    dist.all_gather(copies, mine, group=sparse.replica_pg)
    return max((c - mine).abs().max().item() for c in copies)


def job_equivalence(rank: int, world: int, out: Path, args: dict) -> None:
    """Per case: build (record the initial state), train step by step (record losses, the gap
    between table copies after each step), record the final state."""
    import torch._dynamo

    from opengem.parallel import ParallelConfig
    from opengem.parallel.train_step import gather_full_state_dict
    from opengem.train.optim import Schedule

    results = {}
    for name, case in args["cases"].items():
        t0 = time.perf_counter()
        torch._dynamo.utils.counters.clear()
        pcfg = ParallelConfig(**case["parallel"])
        schema, model, sparse, opts = build_parallel(pcfg, case.get("sparse", "rowwise_adagrad"))
        init = gather_full_state_dict(model, sparse.sharding_pg)
        schedule = Schedule(opts, TOTAL_STEPS, optim_cfg())
        losses, gaps = [], []
        for step in range(args["steps"]):
            losses += run_steps(schema, model, opts, schedule, [step], True)
            gaps.append(replica_gap(sparse))
        final = gather_full_state_dict(model, sparse.sharding_pg)
        results[name] = {"init": init, "losses": losses, "final": final, "replica_gaps": gaps,
                         "plan": sparse.describe(), "seconds": time.perf_counter() - t0,
                         "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}
    if rank == 0:
        torch.save(results, out / f"equivalence-w{world}.pt")


def job_checkpoint(rank: int, world: int, out: Path, args: dict) -> None:
    """Build with ``args["parallel"]`` and the trainer's optimizers; train ``steps`` or load
    ``args["load"]``; record the full state; save to ``args["save"]``; then, if ``resume_step`` is
    given, train that one step and record it (a resumed run must continue like one process)."""
    from opengem.checkpoint import load_checkpoint, save_checkpoint
    from opengem.parallel import ParallelConfig
    from opengem.train.optim import Schedule

    schema, model, sparse, opts = build_parallel(ParallelConfig(**args["parallel"]),
                                                 trainer_adam=True)
    schedule = Schedule(opts, TOTAL_STEPS, optim_cfg())  # before loading: base lrs from the config
    if args.get("load"):
        step = load_checkpoint(args["load"], model, opts)["step"]
    else:
        step = args["steps"]
        run_steps(schema, model, opts, schedule, range(step), True)
    record = {"state": full_state(model, opts, sparse), "plan": sparse.describe(), "step": step}
    save_checkpoint(args["save"], step, model, opts, {"step": step})
    if args.get("resume_step"):
        well_conditioned_adam(opts[0])
        record["resume_loss"] = run_steps(schema, model, opts, schedule, [step], True)[0]
        record["resumed"] = full_state(model, opts, sparse)
    if rank == 0:
        torch.save(record, out / args["record"])


JOBS = {"equivalence": job_equivalence, "checkpoint": job_checkpoint}


# ---------------------------------------------------------------------------------- spawning
def run_job(rank: int, world: int, store: str, out: str, job: str, args: dict) -> None:
    """``mp.spawn`` entry: join the group (file:// store, 1 thread), run ``JOBS[job]``, leave."""
    import torch.distributed as dist

    from opengem.parallel.launch import destroy_distributed, init_distributed

    try:
        init_distributed("gloo", rank=rank, world_size=world, init_method=f"file://{store}",
                         local_world_size=args.get("local_world_size"), threads=1)
        JOBS[job](rank, world, Path(out), args)
        destroy_distributed()
    except BaseException:
        Path(out, f"error-rank{rank}.txt").write_text(traceback.format_exc())
        if dist.is_initialized():
            dist.destroy_process_group()
        raise


# A forkserver that has imported torch/torchrec/opengem once forks every worker of the session:
# workers skip ~3 s of imports each (4 of them share 2 cores). The server never touches
# torch.distributed or threads, so forking it is safe; "spawn" works too, only slower.
START_METHOD = "forkserver"
_PRELOAD = ["torch", "torchrec", "torchrec.distributed", "opengem.parallel", "opengem.model.build",
            "_workers"]


def _set_preload() -> None:
    import multiprocessing

    if START_METHOD == "forkserver":
        multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)


def spawn(job: str, world: int, out: Path, args: dict) -> float:
    """Run ``job`` on ``world`` gloo processes; re-raise a worker's traceback. Returns
    wall seconds."""
    import torch.multiprocessing as mp

    _set_preload()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("error-rank*.txt"):
        old.unlink()
    store = out / f"store-{job}-{world}-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    try:
        mp.start_processes(run_job, args=(world, str(store), str(out), job, args), nprocs=world,
                           join=True, start_method=START_METHOD)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        errs = sorted(out.glob("error-rank*.txt"))
        raise AssertionError(f"{job} on {world} processes "
                             f"failed:\n{errs[0].read_text() if errs else e}") from None
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------- comparing
def rel_diff(got: dict, ref: dict) -> dict[str, float]:
    """key → max |got − ref| / max |ref| (per tensor; the keys of ``ref`` must all be
    in ``got``)."""
    missing = sorted(set(ref) - set(got))
    assert not missing, f"missing keys: {missing}"
    return {k: (got[k].double() - r.double()).abs().max().item() / max(r.abs().max().item(), 1e-12)
            for k, r in ref.items()}


def mismatches(got: dict, ref: dict) -> dict[str, object]:
    """Keys whose values are not exactly equal (tensors bitwise, other values by ==)."""
    if set(got) != set(ref):
        return {"keys": sorted(set(got) ^ set(ref))}
    bad = {}
    for k, r in ref.items():
        g = got[k]
        if isinstance(r, torch.Tensor):
            if g.shape != r.shape or g.dtype != r.dtype or not torch.equal(g, r):
                bad[k] = (tuple(g.shape), tuple(r.shape),
                          (g.double() - r.double()).abs().max().item() if g.shape == r.shape
                          else None)
        elif g != r:
            bad[k] = (g, r)
    return bad
