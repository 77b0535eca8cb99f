"""``opengem bench --quick``: the project's headline figures in one call (meant for 5 minutes on 2 CPU cores).

Each figure comes from the module that measures it: the levers and the loader (``levers``), jagged
attention (``ops``), GEM's time to DLRM-DCN's quality and examples/s at equal parameters (``race``).
The time to quality here is ONE race run (``time_to_dcn_quality_speedup_single_run``) on a 12,000-user
world: three runs of the demo-sized world do not fit in the 5 minutes beside the other figures (one
of them alone took the bench to 467 s). The reported figure, the median of three with its spread, is
``benchmarks/time_to_quality.py`` on the demo-sized world; the speed-up grows with the data, so the
bench's single run reads lower than it. Negative down-sampling's figures (examples/s, NE and calibration
at rates 1, 0.5, 0.1) are left to ``benchmarks/downsampling.py``: its three trainings and six evaluations
took ~25 s alone on the tiny world, over the 20 s this bench may grow by.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from opengem.bench.levers import run_bench
from opengem.bench.ops import attention_case
from opengem.bench.race import (
    RATES,
    budget_config,
    race,
    train_with_evals,
    training_examples_per_s,
    widen_to_params,
)
from opengem.config import apply_overrides
from opengem.data.synthetic import generate
from opengem.discipline import held_out_world_seeds
from opengem.features.schema import FeatureSchema
from opengem.model.build import build_gem, count_parameters, materialize
from opengem.ops.quantize import quantize_tables, table_bytes
from opengem.recipes import recipe, world_config

QUICK_USERS = 12_000  # the demo's 36,000 took 467 s in all on a lightly loaded 2-core machine: over the 5 minutes


def quick_bench(cfg_name: str = "tiny", users: int | None = QUICK_USERS, eval_every_kth_file: int = 4) -> dict:
    """``opengem bench --quick``: the headline figures on 2 CPU cores in under 5 minutes.

    The levers and the loader on the ``cfg_name`` recipe's world; the rest on a demo world cut to
    ``users`` (12,000; None: the demo's 36,000) drawn with data seed 1000 (a world no rate was tuned
    on; its structure is the demo's, structure seed 0): one run of the race (``race.race``, the first
    of the reported three at another size: GEM trains first, training seed 0; target and budgets read
    on every ``eval_every_kth_file``-th file of ``test``), FP8's NE cost on the budget that crossed,
    int8 tables' memory, examples/s at equal dense parameters."""
    levers = run_bench(recipe(cfg_name), None, ("eager", "fp8"), warmup=2, steps=4, loader_seconds=2.0)
    att = attention_case(32, 70, 3000, 32, heads=2, reps=2)
    world_seed = held_out_world_seeds(1)[0]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        generate(world_config("demo", seed=world_seed, overrides=[f"sizes.num_users={users}"] if users else []), data,
                 progress=False)
        schema = FeatureSchema.load(data)
        fp32 = materialize(build_gem(schema, recipe("demo").model))
        int8_saved = table_bytes(fp32) / table_bytes(quantize_tables(fp32, "int8"))
        one = race(data, runs=1, eval_every_kth_file=eval_every_kth_file)["results"][0]
        peer, ttq = one["runs"]["dlrm_dcn"], one["ttq"]
        # FP8's NE cost: the budget that crossed (else the last) again with saved activations stored as e4m3.
        gem = next((r for r in one["runs"]["gem"] if r["final_ne"] <= ttq["target_ne"]), one["runs"]["gem"][-1])
        n = gem["steps"]
        fp8_cfg = budget_config("gem", n, [*RATES["gem"], "train.fp8_activations=true", f"train.seed={ttq['seed']}",
                                           f"data.seed={ttq['seed']}"])
        fp8_run = train_with_evals(fp8_cfg, data, n + 1, split=ttq["split"], eval_every_kth_file=eval_every_kth_file,
                                   max_steps=n)
        # Examples/s at equal dense parameters: DLRM-DCN's heads widened to GEM's dense size, timed
        # alternately with GEM on the same data (round robin, as the levers are).
        dcn_wide = widen_to_params(apply_overrides(recipe("demo"), ["model.arch=dlrm_dcn"]), schema,
                                   gem["parameters"]["dense"])
        eq = {"gem": [], "dlrm_dcn": []}
        for _ in range(2):
            eq["gem"].append(training_examples_per_s(recipe("demo"), data))
            eq["dlrm_dcn"].append(training_examples_per_s(dcn_wide, data))
        equal = {"dense_parameters": {"gem": gem["parameters"]["dense"],
                                      "dlrm_dcn": count_parameters(build_gem(schema, dcn_wide.model))["dense"]},
                 "dcn_head_dims": [*dcn_wide.model.heads.trunk_dims, *dcn_wide.model.heads.task_dims],
                 "examples_per_s": {k: round(max(v), 1) for k, v in eq.items()}}
    lv, eps = levers["levers"], equal["examples_per_s"]
    return {"padded_over_jagged_time": round(att["padded_over_jagged_time"], 2),
            "max_over_mean_len": round(att["max_len"] / att["mean_len"], 2),
            "loader_over_train_eps": levers["loader_over_training"],
            "time_to_dcn_quality_speedup_single_run": ttq["speedup"], "world_seed": world_seed,
            "fp8_act_mem_saved": round(lv["eager"]["saved_activation_mb"] / lv["fp8"]["saved_activation_mb"], 2),
            "int8_table_mem_saved": round(int8_saved, 2),
            "fp8_ne_cost_pct": round(100 * (fp8_run["final_ne"] / gem["final_ne"] - 1), 3),
            "dcn_final_ne": round(peer["final_ne"], 4), "dcn_s": peer["train_s"],
            "gem_s_to_dcn_ne": ttq["gem_s_to_target"],
            "gem_examples_per_s": gem["examples_per_s"], "dcn_examples_per_s": peer["examples_per_s"],
            "gem_over_dcn_eps_equal_params": round(eps["gem"] / eps["dlrm_dcn"], 3),
            "ttq": ttq, "equal_params": equal,
            "params": {"gem": gem["parameters"]["total"], "dlrm_dcn": peer["parameters"]["total"]}, "attention": att,
            "levers": {k: {kk: v[kk] for kk in ("examples_per_s", "saved_activation_mb")} for k, v in lv.items()}}
