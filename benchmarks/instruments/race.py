"""Peers and time to quality: GEM against TorchRec's DLRM-DCN on the same batches (issue: time
to quality).

Examples/s alone is unfair across architectures, so the headline is time to quality: the wall clock
GEM needs to reach the NE DLRM-DCN ends one pass with, against DLRM-DCN's time for that pass.

- ``tune_rates``: each side's learning rates (dense × table, the same grid size for both), one pass
  each, chosen for the end-of-pass NE on ``valid`` of a development world. GEM is chosen like the
  peer, for its own pass, not at the budget that crosses, so the race cannot tune GEM to the target.
- ``race`` (the headline): repeated ``budget_race`` runs with different training seeds, the side
  that trains first alternating (``race_order``); the median speed-up with its min-max (``spread``).
- ``budget_race``: DLRM-DCN one pass; GEM trains budgets of 1/32, 1/16, … of the pass, each a run
  of its own with the warm-up and cosine decay fitted to its budget (as anyone with that much time
  would train), until one ends at or below DLRM-DCN's NE; the time is interpolated between the last
  two budgets in log-seconds. Target and budgets are read on ``split`` (``test`` in the race), each
  at the end of its decay, so not at the mercy of mid-run calibration swings.
- ``dcn_race`` + ``time_to_quality``: one full GEM pass evaluated along the way (MLPerf's
  time-to-train reading); the first and the sustained crossing of the target. Mid-run evaluations
  fall at full learning rate, where both models' calibration follows the last few batches' click
  rate, a few clicks per batch (docs/experiments.md, 'Figures moved from code docstrings').

Every run is the trainer's (``opengem.train.trainer.train`` in a temporary run directory, its
held-out evaluation hooks scoring the split asked for), so each gets the same recipe, batches,
warm-up (10 % of its own steps) and gradient clipping, and the clock is the trainer's ``train_s``:
evaluations stopped it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from instruments.tune import choose, lr_grid
from opengem.config import Config
from opengem.data.loader import ShardLoader
from opengem.data.parquet import DatasetManifest
from opengem.discipline import require_dev_world, require_tuning_split
from opengem.evaluation.evaluate import held_out_evaluator
from opengem.features.schema import FeatureSchema
from opengem.model.build import build_gem, count_parameters, materialize
from opengem.run import METRICS_FILE
from opengem.train.optim import build_optimizers
from opengem.train.step import train_step
from opengem.train.trainer import train
from opengem.world.generate import WorldConfig

ARCHS = ("gem", "dlrm_dcn")
# The tuning grids, dense AdamW lr × tables' row-wise Adagrad lr, the same size for each side: dense
# rates ×~3 apart around where each side did best before (GEM's recipe 3e-3; DLRM-DCN 1e-3), table
# rates from the recipe's 0.3 and the 0.8 DLRM-DCN preferred. 4 × 4 since issue 48 (3 × 2 before):
# on family 2's development world the smaller grid's picks sat on its edges (both sides' tables at
# its lowest rate), so both grids grew alike, a rate further out each way.
GRIDS = {"gem": ((1e-3, 3e-3, 1e-2, 3e-2), (0.03, 0.1, 0.3, 0.8)),
         "dlrm_dcn": ((3e-4, 1e-3, 3e-3, 1e-2), (0.03, 0.1, 0.3, 0.8))}
# Each side's rates as ``tune_rates`` chose them on the valid day of development world seed 0 of
# family 1 (the demo's form) at 6,000 users, on the 3 × 2 grid before it grew
# (``benchmarks/time_to_quality.py --tune``; the grid's NE values in docs/experiments.md). GEM's
# dense rate is that grid's top: a higher one was not tried, so if anything GEM is under-tuned.
RATES = {"gem": ("optim.lr=0.01", "optim.sparse_lr=0.8"),
         "dlrm_dcn": ("optim.lr=0.001", "optim.sparse_lr=0.8")}
# The same choice per world family: a family's race runs at the rates ``tune_rates`` chose on that
# family's development world 0 (6,000 users), so neither side races at rates tuned on another form.
# Family 2's on the 4 × 4 grid: both picks inside it.
RATES_BY_FAMILY = {1: RATES,
                   2: {"gem": ("optim.lr=0.01", "optim.sparse_lr=0.1"),
                       "dlrm_dcn": ("optim.lr=0.001", "optim.sparse_lr=0.3")}}


def world_family(data: Path) -> int:
    """The world family ``data`` was generated from (its manifest's world config, read as the
    generator reads it); 1 for data that is not synthetic."""
    src = DatasetManifest.load(data).source
    return WorldConfig.from_dict(src["config"]).family if src.get("kind") == "synthetic" else 1


def race_rates(data: Path) -> dict[str, tuple[str, str]]:
    """Each side's rate overrides for a race on ``data``: ``RATES_BY_FAMILY`` of its family."""
    return RATES_BY_FAMILY[world_family(data)]


def train_with_evals(cfg: Config, data: Path, eval_every: int, split: str = "valid",
                     task: str = "click", eval_at: Sequence[int] = (), eval_every_kth_file: int = 1,
                     max_steps: int | None = None) -> dict:
    """The trainer on ``cfg`` over ``data`` (its first ``max_steps`` batches when given, the lr
    schedule's warm-up and decay fitted to that budget), evaluating ``all/<task>`` NE on ``split``
    every ``eval_every`` steps (or at the steps in ``eval_at`` when given) and after the last step:
    {"curve": [(train seconds, examples, NE)], "train_s", "examples_per_s", "final_ne", …}.

    ``eval_every_kth_file`` > 1 scores every k-th file of ``split`` only, to keep many evaluations
    of a big split affordable; every arch sees the same files."""
    cfg = copy.deepcopy(cfg)
    cfg.train.eval_every, cfg.train.eval_at = (0, tuple(eval_at)) if eval_at else (eval_every, ())
    cfg.train.eval_split, cfg.train.max_steps, cfg.train.progress = split, max_steps or 0, False
    with tempfile.TemporaryDirectory() as run:
        final = train(cfg, data, run,
                      evaluator=held_out_evaluator(data, split, eval_every_kth_file))
        lines = [json.loads(x) for x in (Path(run) / METRICS_FILE).read_text().splitlines()]
    curve = [(round(x["train_s"], 3), x["examples"], x["eval"][f"all/{task}"]["ne"]) for x in lines
             if "eval" in x]
    clock = curve[-1][0]
    return {"arch": cfg.model.arch, "split": split, "parameters": final["parameters"],
            "curve": curve, "train_s": round(clock, 2),
            "examples_per_s": round(final["examples"] / max(clock, 1e-9), 1),
            "final_ne": curve[-1][2],
            "last_lr_factor": next(x["lr_factor"] for x in reversed(lines) if "loss" in x)}


def time_to_quality(gem: dict, peer: dict) -> dict:
    """Seconds GEM needs to reach the NE the peer ends with, against the peer's full time.

    The crossing is interpolated linearly between the two evaluations around it (the curve is
    sampled every ``eval_every`` steps, which would otherwise round GEM's time up by up to that many
    steps); ``gem_s_at_eval`` is the first evaluation at or below the target, uninterpolated. A
    noisy curve can dip below the target and come back above it: ``*_sustained`` is the crossing
    after which every later evaluation stays at or below the target (equal to the first one on a
    monotone curve)."""
    target, curve = peer["final_ne"], gem["curve"]
    below = [v <= target for _, _, v in curve]
    first = next((i for i, b in enumerate(below) if b), None)
    sustained = None
    if below and below[-1]:
        sustained = len(below) - 1
        while sustained > 0 and below[sustained - 1]:
            sustained -= 1

    def crossing(i: int | None) -> tuple[float | None, float | None]:
        if i is None:
            return None, None
        t, n = curve[i][0], curve[i][1]
        if i > 0 and curve[i - 1][2] > curve[i][2]:
            (t0, n0, v0), (t1, n1, v1) = curve[i - 1], curve[i]
            f = (v0 - target) / (v0 - v1)
            t, n = t0 + f * (t1 - t0), n0 + f * (n1 - n0)
        return t, n

    (t, n), (ts, ns) = crossing(first), crossing(sustained)
    return {"target_ne": target, "peer_s": peer["train_s"],
            "gem_s_to_target": round(t, 3) if t else None,
            "gem_s_at_eval": curve[first][0] if first is not None else None,
            "gem_pass_fraction_to_target": round(n / curve[-1][1], 3) if n else None,
            "speedup": round(peer["train_s"] / t, 3) if t else None,
            "gem_s_to_target_sustained": round(ts, 3) if ts else None,
            "gem_pass_fraction_to_target_sustained": round(ns / curve[-1][1], 3) if ns else None,
            "speedup_sustained": round(peer["train_s"] / ts, 3) if ts else None,
            "gem_final_ne": gem["final_ne"]}


def eval_schedule(steps: int, dense_until: int, dense_every: int, sparse_every: int) -> list[int]:
    """Evaluation steps: every ``dense_every`` up to ``dense_until`` (where the crossing is), then
    every ``sparse_every``, and the last step."""
    at = list(range(dense_every, min(dense_until, steps) + 1, dense_every))
    at += list(range(at[-1] + sparse_every if at else sparse_every, steps + 1, sparse_every))
    return sorted(set(at) | {steps})


def ne_at(curve: list, seconds: float) -> float | None:
    """The curve's NE at ``seconds`` of training (linear between evaluations; None past its end)."""
    prev = None
    for t, _, ne in curve:
        if t >= seconds:
            if prev is None:
                return ne
            f = (seconds - prev[0]) / max(t - prev[0], 1e-9)
            return prev[1] + f * (ne - prev[1])
        prev = (t, ne)
    return None


def race_steps(data: Path) -> int:
    """Steps of one pass over ``data``'s train split at the demo recipe's batch
    size (``dcn_race``)."""
    from opengem.recipes import recipe

    d = recipe("demo").data
    return (
        ShardLoader(data, d.train_split, d.batch_size, FeatureSchema.load(data)).rows_per_epoch
        // d.batch_size
    )


def dcn_race(data: Path, eval_every: int = 20, eval_at: Sequence[int] = (),
             eval_every_kth_file: int = 1, split: str = "test",
             gem_overrides: Sequence[str] = RATES["gem"],
             peer_overrides: Sequence[str] = RATES["dlrm_dcn"]) -> dict:
    """GEM and TorchRec's DLRM-DCN, each one pass of the demo recipe over ``data`` with evaluations
    on ``split`` (see ``train_with_evals``), and GEM's time to DLRM-DCN's final
    NE (``time_to_quality``).

    The demo recipe's warm-up (200 steps) is longer than a small world's whole pass (~160 steps at
    3,000 users): every run here warms up over its first 10 % instead, the same for each arch.
    Returns {"ttq", "runs": {arch: train_with_evals output}, "config": the shared config}."""
    from opengem.config import apply_overrides
    from opengem.recipes import recipe

    steps = race_steps(data)
    warmup = max(1, steps // 10)
    # apply_overrides copies: one per run
    base = apply_overrides(recipe("demo"), [f"optim.warmup_steps={warmup}"])
    extra = {"gem": gem_overrides, "dlrm_dcn": peer_overrides}
    runs = {arch: train_with_evals(apply_overrides(base, [f"model.arch={arch}", *extra[arch]]),
                                   data, eval_every, split=split, eval_at=eval_at,
                                   eval_every_kth_file=eval_every_kth_file,
                                   max_steps=steps)
            for arch in ARCHS}
    ttq = {**time_to_quality(runs["gem"], runs["dlrm_dcn"]), "steps": steps, "warmup_steps": warmup,
           "split": split}
    return {"ttq": ttq, "runs": runs, "config": base}


def widen_to_params(cfg: Config, schema: FeatureSchema, target_dense: int) -> Config:
    """``cfg`` (a peer) with its head widths (``heads.trunk_dims``, ``heads.task_dims``) scaled so
    its dense parameters come within 3 % of ``target_dense`` (bisection on one width factor)."""
    base_trunk, base_task = cfg.model.heads.trunk_dims, cfg.model.heads.task_dims

    def at(f: float) -> tuple[Config, int]:
        heads = dataclasses.replace(cfg.model.heads,
                                    trunk_dims=tuple(max(1, round(d * f)) for d in base_trunk),
                                    task_dims=tuple(max(1, round(d * f)) for d in base_task))
        c = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, heads=heads))
        return c, count_parameters(build_gem(schema, c.model))["dense"]

    lo, hi = 0.05, 64.0
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        c, n = at(mid)
        if abs(n - target_dense) <= 0.03 * target_dense:
            return c
        lo, hi = (mid, hi) if n < target_dense else (lo, mid)
    raise ValueError(f"no head width gives {target_dense:,} dense parameters for {cfg.model.arch}")


def fresh_model(cfg: Config, schema: FeatureSchema) -> tuple[torch.nn.Module, list]:
    """A model of ``cfg``'s arch on one process, seeded as the trainer seeds it, and its optimizers."""
    torch.manual_seed(cfg.train.seed)
    model = materialize(build_gem(schema, cfg.model), seed=cfg.train.seed)
    dense, sparse = build_optimizers(model.dense_parameters(), model.sparse_parameters(), cfg.optim)
    return model, [o for o in (dense, sparse) if o]


def timed_step(cfg: Config, data: Path) -> tuple[torch.nn.Module, Callable[[], float]]:
    """A fresh model of ``cfg`` on one process and a function that runs the trainer's step
    (``opengem.train.step.train_step``: forward, loss, backward, clipping, both optimizers) on the
    next training batch and returns its seconds (the batch's loading not included)."""
    schema = FeatureSchema.load(data)
    model, opts = fresh_model(cfg, schema)
    batches = iter(ShardLoader(data, cfg.data.train_split, cfg.data.batch_size, schema,
                               shuffle=True, epochs=1000,
                               drop_last=True, max_seq_len=model.max_seq_len()))
    task_w, dense = torch.tensor([t.weight for t in schema.tasks]), list(model.dense_parameters())

    def step() -> float:
        batch = next(batches)
        t0 = time.perf_counter()
        train_step(model, opts, batch, task_w, schema.num_domains, grad_clip=cfg.optim.grad_clip,
                   dense_params=dense)
        return time.perf_counter() - t0

    return model, step


def training_examples_per_s(cfg: Config, data: Path, steps: int = 12, warmup: int = 3) -> float:
    """The trainer's step of any arch on one process, timed alone (``timed_step``): examples/s
    (median step)."""
    _, step = timed_step(cfg, data)
    times = [step() for _ in range(warmup + steps)][warmup:]
    return cfg.data.batch_size / statistics.median(times)


def budget_crossing(points: Sequence[tuple[float, float]], target: float) -> dict:
    """GEM's time to ``target`` NE from budgeted runs: ``points`` are (train seconds, final NE), in
    ascending budget. The first budget at or below the target gives the crossing, interpolated
    linearly in log-seconds with the budget before it (NE falls about linearly in log compute). When
    the smallest budget already reaches the target its time is an upper bound on GEM's (``bound``
    "upper"); when no budget does, there is no figure."""
    first = next((i for i, (_, ne) in enumerate(points) if ne <= target), None)
    if first is None:
        return {"gem_s_to_target": None, "bound": None}
    if first == 0:
        return {"gem_s_to_target": points[0][0], "bound": "upper"}
    (t0, v0), (t1, v1) = points[first - 1], points[first]
    f = (v0 - target) / (v0 - v1)
    return {"gem_s_to_target": math.exp(math.log(t0) + f * (math.log(t1) - math.log(t0))),
            "bound": "exact"}


def budget_config(arch: str, steps: int, overrides: Sequence[str] = ()) -> Config:
    """The demo recipe for a run of ``steps`` steps of ``arch``: warm-up 10 % of them,
    then ``overrides``."""
    from opengem.config import apply_overrides
    from opengem.recipes import recipe

    return apply_overrides(recipe("demo"),
                           [f"optim.warmup_steps={max(1, steps // 10)}", f"model.arch={arch}",
                                            *overrides])


def rate_overrides(lr: float, sparse_lr: float) -> tuple[str, str]:
    return f"optim.lr={lr:g}", f"optim.sparse_lr={sparse_lr:g}"


def tune_rates(data: Path, split: str = "valid", grids: dict = GRIDS, eval_every_kth_file: int = 1,
               on_point: Callable[[dict], None] | None = None) -> dict:
    """Each side's learning rates for the race: every (dense lr, table lr) point of its grid in
    ``grids`` ({arch: (dense lrs, table lrs)}) trains one pass of the demo recipe over ``data``
    (warm-up 10 %, as in the race) and is scored by its end-of-pass ``all/click`` NE on ``split``;
    each side keeps its best point. GEM is scored at the end of its own pass like the peer, not at
    the budget that crosses: picking it there would tune GEM to the race's target.

    Refuses the test split and held-out worlds (``opengem.discipline``): ``data``'s world seeds come
    from its schema's provenance (synthetic data; other data has none to check). ``on_point`` sees
    each grid point's row as it is scored.
    Returns {"grid": [{arch, lr, sparse_lr, ne, train_s}], "best": {arch: overrides},
    "split", "steps"}."""
    what = "the race's learning rates"
    require_tuning_split(split, what)
    meta = FeatureSchema.load(data).meta
    seeds = {k: require_dev_world(int(meta[k]), what) for k in ("seed", "structure_seed")
             if k in meta}
    points = {a: len(d) * len(t) for a, (d, t) in grids.items()}
    if len(set(points.values())) > 1:
        raise ValueError(f"{what}: each side's grid needs the same number of points, got {points}")
    steps, rows = race_steps(data), []
    for arch, (dense, tables) in grids.items():
        for lr, sparse_lr in lr_grid(dense, tables):
            cfg = budget_config(arch, steps, rate_overrides(lr, sparse_lr))
            r = train_with_evals(cfg, data, eval_every=steps + 1, split=split,
                                 eval_every_kth_file=eval_every_kth_file,
                                 max_steps=steps)
            rows.append({"arch": arch, "lr": lr, "sparse_lr": sparse_lr, "ne": r["final_ne"],
                         "train_s": r["train_s"]})
            if on_point:
                on_point(rows[-1])
    best = {a: choose({(r["lr"], r["sparse_lr"]): [r["ne"]] for r in rows if r["arch"] == a})
            for a in grids}
    return {"grid": rows, "best": {a: rate_overrides(*p) for a, p in best.items()},
            "split": split, "world_seeds": seeds, "steps": steps}


def race_order(run: int) -> tuple[str, str]:
    """Which side trains first in the ``run``-th run (1-based): GEM in odd runs, DLRM-DCN in even
    ones, so a drift in the shared machine's load does not fall on one side only."""
    if run < 1:
        raise ValueError(f"runs are counted from 1, got {run}")
    return ("gem", "dlrm_dcn") if run % 2 else ("dlrm_dcn", "gem")


def spread(values: Sequence[float | None]) -> dict:
    """Median and min-max of the runs' figures. A run without one (None: GEM did not reach the
    target within its pass) ranks as the slowest, so it pulls the median down instead of vanishing;
    the median is None when it falls on such a run, and so is the min."""
    if not values:
        raise ValueError("no runs to summarise")
    ranked = sorted(values, key=lambda v: -math.inf if v is None else v)
    mid = len(ranked) // 2
    middle = ranked[mid - 1:mid + 1] if len(ranked) % 2 == 0 else ranked[mid:mid + 1]
    median = None if None in middle else statistics.mean(middle)
    return {"median": median, "min": ranked[0], "max": ranked[-1], "runs": len(values),
            "missing": sum(v is None for v in values)}


def budget_ladder(steps: int, smallest: float = 1 / 32, min_steps: int = 20) -> list[int]:
    """GEM's budgets in steps: ``smallest``, 2 × ``smallest``, … of a pass of ``steps`` (each at
    least ``min_steps``), the whole pass last."""
    return sorted({n for k in range(40)
                   if (n := min(steps, round(steps * smallest * 2**k))) >= min_steps})


def budget_race(data: Path, split: str = "test", seed: int = 0, gem_first: bool = False,
                first_stop: float | None = None, first_until: float = 1 / 8,
                eval_every_kth_file: int = 1,
                smallest: float = 1 / 32, min_steps: int = 20,
                gem_overrides: Sequence[str] = RATES["gem"],
                peer_overrides: Sequence[str] = RATES["dlrm_dcn"]) -> dict:
    """One race run: DLRM-DCN one pass of the demo recipe (with ``peer_overrides``) over ``data``,
    GEM (with ``gem_overrides``) on ``budget_ladder``'s budgets (each its own run with warm-up 10 %
    of the budget and the cosine decay ending at it) until one ends at or below DLRM-DCN's final NE
    on ``split``. Both sides train with ``train.seed`` and ``data.seed`` = ``seed`` (the
    same batches).

    ``gem_first``: GEM climbs its ladder before the peer trains, not knowing the target yet: up to
    the first budget at or below ``first_stop`` (a guess, e.g. the previous run's target), or
    without a guess through ``first_until`` of the pass; once the peer has set the target GEM climbs
    on if it has not reached it (``sequence`` records the order). Budgets past the crossing do not
    change it. Returns {"ttq": the crossing and speed-up, "runs": {"dlrm_dcn": run,
    "gem": [runs]}}."""
    steps = race_steps(data)
    ladder, gem, sequence = budget_ladder(steps, smallest, min_steps), [], []

    def run(arch: str, n: int, overrides: Sequence[str]) -> dict:
        cfg = budget_config(arch, n, [*overrides, f"train.seed={seed}", f"data.seed={seed}"])
        out = train_with_evals(cfg, data, eval_every=n + 1, split=split,
                               eval_every_kth_file=eval_every_kth_file,
                               max_steps=n)
        sequence.append([arch, n])
        return {**out, "steps": n, "pass_fraction": round(n / steps, 4)}

    def climb(stop: float | None, until: float = 1.0) -> None:
        while len(gem) < len(ladder) and not (stop is not None
                                              and any(r["final_ne"] <= stop for r in gem)):
            # the ladder's budgets are rounded
            if stop is None and gem and gem[-1]["steps"] >= round(until * steps):
                return
            gem.append(run("gem", ladder[len(gem)], gem_overrides))

    if gem_first:
        climb(first_stop, first_until)
    peer = run("dlrm_dcn", steps, peer_overrides)
    target = peer["final_ne"]
    climb(target)
    cross = budget_crossing([(r["train_s"], r["final_ne"]) for r in gem], target)
    t = cross["gem_s_to_target"]
    ttq = {"target_ne": target, "peer_s": peer["train_s"], "steps": steps, "split": split,
           "seed": seed, "gem_s_to_target": round(t, 3) if t else None, "bound": cross["bound"],
           "speedup": round(peer["train_s"] / t, 3) if t else None, "sequence": sequence,
           "budgets": [{k: r[k] for k in ("steps", "pass_fraction", "train_s", "final_ne")}
                       for r in gem],
           "overrides": {"dlrm_dcn": list(peer_overrides), "gem": list(gem_overrides)}}
    return {"ttq": ttq, "runs": {"dlrm_dcn": peer, "gem": gem}}


def race(data: Path, runs: int = 3, split: str = "test",
         on_run: Callable[[dict], None] | None = None, **kw) -> dict:
    """The time-to-quality race: ``runs`` ``budget_race`` runs on ``data`` with training seeds 0, 1,
    …, GEM first in odd runs and DLRM-DCN first in even ones (``race_order``); a GEM-first run's
    first climb stops at the previous run's target (the first run's through ``first_until``). ``kw``
    goes to ``budget_race``; ``on_run`` sees each run's ttq as it ends. The figure is the median
    speed-up with its min-max (``spread``), read on ``split``. Returns {"speedup": spread, "runs":
    [each run's ttq], "results": [budget_race outputs]}."""
    results, guess = [], None
    for i in range(1, runs + 1):
        r = budget_race(data, split=split, seed=i - 1, gem_first=race_order(i)[0] == "gem",
                        first_stop=guess, **kw)
        results.append(r)
        guess = r["ttq"]["target_ne"]
        if on_run:
            on_run(r["ttq"])
    return {"speedup": spread([r["ttq"]["speedup"] for r in results]), "split": split,
            "runs": [r["ttq"] for r in results], "results": results}
