"""``opengem bench --quick``: the project's headline figures in one call (meant for 5 minutes on 2
CPU cores).

Each figure comes from the module that measures it: the levers (``levers``), GEM's sequence side
jagged vs padded (``ops.sequence_side_case``), GEM's time to DLRM-DCN's quality and examples/s at
equal parameters (``race``). The time to quality here is ONE race run
(``time_to_dcn_quality_speedup_single_run``) on a 12,000-user world: three runs of the demo-sized
world do not fit in the 5 minutes beside the other figures (one of them alone took the bench to 467
s). The reported figure, the median of three with its spread, is ``benchmarks/time_to_quality.py``
on the demo-sized world; the speed-up grows with the data, so the bench's single run reads lower
than it.

- ``gem_sequence_side_padded_over_jagged_{fwd,fwd_bwd}``: GEM's sequence side (both streams' towers:
  time embedding, target-aware pooled attention over the whole history, recent window, tower layers)
  on the first 4 training batches of the 12,000-user demo world (demo recipe: batch 256, histories
  capped at 256, K = 16, M = 4), padded time over jagged time, the ratio formed per round from that
  round's two timings; the median of 7 rounds, with ``..._min_max``. Full record
  under ``sequence_side``.

On the levers' ``tiny`` world (seed 0, 3,972 rows) the bench also trains the ``tiny`` recipe for
real (``opengem.train.trainer.train``, no evaluation hooks, two passes) at negative rates 1 and 0.1:

- ``loader_over_train_step_examples_per_s``: on the same batches at the same batch size (the
  ``tiny`` recipe's 128), the loader's examples/s (``ShardLoader`` as the trainer builds it,
  prefetch off so the time is the loader's own: Parquet → ``Batch``) over the training step's
  examples/s (``train_step``: forward, loss, backward, clipping, both optimizers, no data wait);
  per round 6 batches loaded then trained, the ratio per round, median of 7 rounds with
  ``..._min_max``. Above 1, the loader keeps ahead of training by that factor (docs/speed.md
  says what the figure it replaced mixed).
- ``downsampling``: rows read/s and trained/s at rates 1 and 0.1 (as ``benchmarks/downsampling.py``
  counts them), and all/click calibration (Σp/Σy) on valid at 0.1, corrected (what every stage
  reads) and raw. The full comparison (rate 0.5, NE, equal steps, seeds) stays
  in ``benchmarks/downsampling.py``.

``dataset_bytes_v1_over_v2``: the demo world's shape at 2,048 users (one user block, 8 days, data
seed 1000) written in both layouts (``instruments.layout``): all Parquet bytes of v1 over v2's.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from instruments.layout import layout_bytes
from instruments.levers import run_bench
from instruments.ops import median_min_max, sequence_side_case, spread
from instruments.race import (
    budget_config,
    fresh_model,
    race,
    race_rates,
    train_with_evals,
    training_examples_per_s,
    widen_to_params,
)
from opengem.config import apply_overrides
from opengem.data.loader import ShardLoader
from opengem.discipline import (
    held_out_world_seeds,
    race_world_seeds,
    require_dev_world,
    require_tuning_split,
)
from opengem.evaluation.evaluate import evaluate_model
from opengem.features.schema import FeatureSchema
from opengem.model.build import build_gem, count_parameters, materialize
from opengem.ops.quantize import quantize_tables, table_bytes
from opengem.recipes import recipe
from opengem.run import load_base_rates, load_run_model
from opengem.train.step import train_step
from opengem.train.trainer import train
from opengem.world.generate import generate
from opengem.world.presets import world_config

# the demo's 36,000 took 467 s in all on a lightly loaded 2-core machine: over the 5 minutes
QUICK_USERS = 12_000
# one of the demo's user blocks: its histories are the demo's, ~4 s for both layouts
LAYOUT_USERS = 2048
TRAIN_EPOCHS = 2
LOADER_BATCHES, LOADER_ROUNDS = 6, 7  # the tiny recipe's step ~30 ms: ~1.5 s in all
# the demo recipe's sequence side, jagged + padded, fwd and fwd+bwd: ~20 s
SEQ_BATCHES, SEQ_ROUNDS = 4, 7


def loader_and_step_examples_per_s(cfg, data: Path, batches: int = LOADER_BATCHES,
                                   rounds: int = LOADER_ROUNDS) -> dict:
    """Examples/s of the loader and of the training step on the same batches at
    ``cfg.data.batch_size`` (module docstring): each round loads ``batches`` batches (timed), then
    trains on exactly those (timed). Returns per-round lists and ``loader_over_train_step`` = loader
    examples/s ÷ step examples/s per round (= step seconds ÷ load seconds: the rows are
    the same)."""
    schema = FeatureSchema.load(data)
    model, opts = fresh_model(cfg, schema)
    it = iter(ShardLoader(data, cfg.data.train_split, cfg.data.batch_size, schema,
                          shuffle=cfg.data.shuffle,
                          seed=cfg.data.seed, epochs=1000, max_seq_len=model.max_seq_len(),
                          prefetch=0))
    task_w, dense = torch.tensor([t.weight for t in schema.tasks]), list(model.dense_parameters())

    def step(batch) -> None:
        train_step(model, opts, batch, task_w, schema.num_domains, grad_clip=cfg.optim.grad_clip,
                   dense_params=dense)

    step(next(it))  # warm-up: files opened, first-call allocations
    out: dict[str, list[float]] = {"loader": [], "train_step": [], "loader_over_train_step": []}
    for _ in range(rounds):
        t0 = time.perf_counter()
        got = [next(it) for _ in range(batches)]
        t_load = time.perf_counter() - t0
        t0 = time.perf_counter()
        for batch in got:
            step(batch)
        t_step = time.perf_counter() - t0
        rows = sum(b.batch_size for b in got)
        out["loader"].append(rows / t_load)
        out["train_step"].append(rows / t_step)
        out["loader_over_train_step"].append(t_step / t_load)
    return out


def trained(data: Path, run: Path, rate: float) -> dict:
    """The ``tiny`` recipe trained for real at negative rate ``rate`` (no evaluation hooks):
    final.json, with ``rows_read_per_s`` (the split's rows the loader went through per second of the
    loop) beside ``examples_per_s`` (rows the steps trained on)."""
    cfg = apply_overrides(recipe("tiny"),
                          [f"data.negative_rate={rate}", f"train.epochs={TRAIN_EPOCHS}",
                                           f"train.threads={torch.get_num_threads()}",
                           "train.progress=false"])
    final = train(cfg, data, run)
    sampled = final.get("downsampling")
    read = final["examples"] * (sampled["rows_read_per_epoch"]
                                / statistics.fmean(sampled["rows_kept_per_epoch"])
                                if sampled else 1.0)
    return final | {"rows_read_per_s": round(read / final["wall_s"], 1)}


def click_calibration(run: Path, data: Path, corrected: bool, split: str) -> float:
    model, _, schema = load_run_model(run, recalibrated=False, corrected=corrected)
    m = evaluate_model(model, schema, data, split, load_base_rates(run), progress=False)["metrics"]
    return round(m["all/click"]["calibration"], 4)


def trainer_figures(data: Path, root: Path, split: str = "valid") -> dict:
    """``loader_over_train_step_examples_per_s`` and the down-sampling figures on ``data``
    (module docstring)."""
    require_tuning_split("valid", "the down-sampling rate")
    full = trained(data, root / "rate1", 1.0)
    eps = loader_and_step_examples_per_s(recipe("tiny"), data)
    low = trained(data, root / "rate0.1", 0.1)
    return {
        "loader_examples_per_s": round(statistics.median(eps["loader"]), 1),
        "train_step_examples_per_s": round(statistics.median(eps["train_step"]), 1),
        "loader_over_train_step_examples_per_s": {
            k: round(v, 2) for k, v in spread(eps["loader_over_train_step"]).items()
        },
        "batch_size": recipe("tiny").data.batch_size,
        "batches_per_round": LOADER_BATCHES,
        "trainer_loop_examples_per_s": round(full["examples_per_s"], 1),
        "downsampling": {
            "epochs": TRAIN_EPOCHS,
            "rows": full["examples"] // TRAIN_EPOCHS,
            **{
                f"{r:g}": {
                    "rows_read_per_s": f["rows_read_per_s"],
                    "steps": f["steps"],
                    "rows_trained_per_s": round(f["examples_per_s"], 1),
                }
                for r, f in ((1.0, full), (0.1, low))
            },
            "click_calibration_valid_at_0.1": {
                "corrected": click_calibration(root / "rate0.1", data, True, split),
                "raw": click_calibration(root / "rate0.1", data, False, split),
            },
        },
    }


FP8_BUDGET = 1 / 8
# The race's world family: the wider family 2, as benchmarks/time_to_quality.py and quality.py
# default to (family 1's figures are the old ruler in docs/speed.md).
RACE_FAMILY = 2


def fp8_budget(gem_runs: list[dict]) -> dict:
    """The GEM budget run FP8's NE cost is read on: the one nearest ``FP8_BUDGET`` of the pass.
    Not the budget that crossed DLRM-DCN's NE: on a held-out structure that is half or all of the
    pass, and FP8 on a CPU (every saved tensor quantised) steps several times slower than fp32, so
    re-running it took a large share of the bench (docs/speed.md)."""
    return min(gem_runs, key=lambda r: abs(r["pass_fraction"] - FP8_BUDGET))


def quick_bench(cfg_name: str = "tiny", users: int | None = QUICK_USERS,
                eval_every_kth_file: int = 4, family: int = RACE_FAMILY) -> dict:
    """``opengem bench --quick``: the headline figures on 2 CPU cores in under 5 minutes (the race
    on a held-out structure is most of it; docs/speed.md has its time).

    The levers and the loader on the ``cfg_name`` recipe's world; the rest on a demo world cut to
    ``users`` (12,000; None: the demo's 36,000) of world ``family`` drawn with race seed 2100 (a
    world no rate was tuned on, its structure its own: ``discipline.race_world_seeds``), at that
    family's rates (``race.race_rates``): one run of the race (``race.race``, the
    first of the reported three at another size: GEM trains first, training seed 0; target and
    budgets read on every ``eval_every_kth_file``-th file of ``test``), FP8's NE cost on GEM's
    1/8-pass budget (``fp8_budget``), int8 tables' memory, examples/s at equal dense
    parameters."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        small = Path(tmp) / "tiny"
        generate(world_config(cfg_name, seed=require_dev_world(0, "the bench's levers")), small,
                 progress=False)
        levers = run_bench(recipe(cfg_name), small, ("eager", "fp8"), warmup=2, steps=4,
                           loader_seconds=2.0)
        threads = torch.get_num_threads()  # the trainer sets train.threads (the bench's own count)
        real = trainer_figures(small, Path(tmp))
        torch.set_num_threads(threads)
        sizes = layout_bytes(world_config("demo", seed=held_out_world_seeds(1)[0],
                                          overrides=[f"sizes.num_users={LAYOUT_USERS}"]),
                             Path(tmp) / "layouts")
    world_seed = race_world_seeds(1)[0]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        generate(world_config("demo", seed=world_seed,
                              overrides=[f"structure_seed={world_seed}",
                                         f"family={family}",
                                         *([f"sizes.num_users={users}"] if users else [])]),
                 data, progress=False)
        schema = FeatureSchema.load(data)
        seq = sequence_side_case(data, "demo", batches=SEQ_BATCHES, repeats=SEQ_ROUNDS, inner=1)
        fp32 = materialize(build_gem(schema, recipe("demo").model))
        int8_saved = table_bytes(fp32) / table_bytes(quantize_tables(fp32, "int8"))
        rates = race_rates(data)
        one = race(data, runs=1, eval_every_kth_file=eval_every_kth_file,
                   gem_overrides=rates["gem"], peer_overrides=rates["dlrm_dcn"])["results"][0]
        peer, ttq = one["runs"]["dlrm_dcn"], one["ttq"]
        # FP8's NE cost: GEM's budget nearest FP8_BUDGET of the pass again with saved activations
        # stored as e4m3
        gem = fp8_budget(one["runs"]["gem"])
        n = gem["steps"]
        fp8_cfg = budget_config("gem", n,
                                [*rates["gem"], "train.fp8_activations=true",
                                 f"train.seed={ttq['seed']}",
                                           f"data.seed={ttq['seed']}"])
        fp8_run = train_with_evals(fp8_cfg, data, n + 1, split=ttq["split"],
                                   eval_every_kth_file=eval_every_kth_file,
                                   max_steps=n)
        # Examples/s at equal dense parameters: DLRM-DCN's heads widened to GEM's dense size, timed
        # alternately with GEM on the same data (round robin, as the levers are).
        dcn_wide = widen_to_params(apply_overrides(recipe("demo"), ["model.arch=dlrm_dcn"]), schema,
                                   gem["parameters"]["dense"])
        eq = {"gem": [], "dlrm_dcn": []}
        for _ in range(2):
            eq["gem"].append(training_examples_per_s(recipe("demo"), data))
            eq["dlrm_dcn"].append(training_examples_per_s(dcn_wide, data))
        equal = {
            "dense_parameters": {
                "gem": gem["parameters"]["dense"],
                "dlrm_dcn": count_parameters(build_gem(schema, dcn_wide.model))["dense"],
            },
            "dcn_head_dims": [*dcn_wide.model.heads.trunk_dims, *dcn_wide.model.heads.task_dims],
            "examples_per_s": {k: round(max(v), 1) for k, v in eq.items()},
        }
    lv, eps = levers["levers"], equal["examples_per_s"]
    loader = real["loader_over_train_step_examples_per_s"]
    return {
        **{
            f"gem_sequence_side_padded_over_jagged_{m}{suffix}": v
            for m in ("fwd", "fwd_bwd")
            for suffix, v in median_min_max(seq[m]["padded_over_jagged_time"])
        },
        "loader_over_train_step_examples_per_s": loader["median"],
        "loader_over_train_step_examples_per_s_min_max": [loader["min"], loader["max"]],
        "dataset_bytes_v1_over_v2": sizes["dataset_bytes_v1_over_v2"],
        "downsampling_read_speedup_at_0.1": round(
            real["downsampling"]["0.1"]["rows_read_per_s"]
            / real["downsampling"]["1"]["rows_read_per_s"],
            2,
        ),
        "downsampling_click_calibration_at_0.1": real["downsampling"][
            "click_calibration_valid_at_0.1"
        ]["corrected"],
        "time_to_dcn_quality_speedup_single_run": ttq["speedup"],
        "world_seed": world_seed,
        "world_family": family,
        "fp8_act_mem_saved": round(
            lv["eager"]["saved_activation_mb"] / lv["fp8"]["saved_activation_mb"], 2
        ),
        "int8_table_mem_saved": round(int8_saved, 2),
        "fp8_ne_cost_pct": round(100 * (fp8_run["final_ne"] / gem["final_ne"] - 1), 3),
        "dcn_final_ne": round(peer["final_ne"], 4),
        "dcn_s": peer["train_s"],
        "gem_s_to_dcn_ne": ttq["gem_s_to_target"],
        "gem_examples_per_s": gem["examples_per_s"],
        "dcn_examples_per_s": peer["examples_per_s"],
        "gem_over_dcn_eps_equal_params": round(eps["gem"] / eps["dlrm_dcn"], 3),
        "ttq": ttq,
        "equal_params": equal,
        "params": {"gem": gem["parameters"]["total"], "dlrm_dcn": peer["parameters"]["total"]},
        "sequence_side": seq,
        "trainer": real,
        "layouts": {k: sizes[k] for k in ("rows", "bytes_v1", "bytes_v2")},
        "bench_s": round(time.perf_counter() - t0, 1),
        "levers": {
            k: {kk: v[kk] for kk in ("examples_per_s", "saved_activation_mb")}
            for k, v in lv.items()
        },
    }
