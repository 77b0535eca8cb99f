"""``opengem bench``: every lever trains the same model on the same batches to (nearly) the same
losses as fp32 eager, and the memory levers save what they claim."""

import pytest

from opengem.recipes import recipe
from opengem.train.bench import format_bench, run_bench

# Stated tolerances on the loss after each of 4 steps, relative to fp32 eager (tiny recipe):
# activation checkpointing recomputes the same fp32 ops (exact up to reduction order); bf16 autocast
# and fp8 saved activations change the arithmetic.
# (compile: tests/distributed/test_parallel_compile.py checks compiled blocks against eager.)
TOL = {"ac": 1e-5, "sac": 1e-5, "bf16": 3e-2, "fp8": 3e-2}


@pytest.fixture(scope="module")
def bench():
    return run_bench(recipe("tiny"), levers=("eager", "ac", "sac", "bf16", "fp8"), warmup=1, steps=3, loader_seconds=1.0)


def test_levers_match_eager_within_tolerance(bench):
    ref = bench["levers"]["eager"]["losses"]
    assert len(ref) == 4 and all(0 < x < 1 for x in ref)
    for lever in ("ac", "sac", "bf16", "fp8"):
        got = bench["levers"][lever]["losses"]
        worst = max(abs(a - b) / b for a, b in zip(got, ref))
        assert worst < TOL[lever], (lever, got, ref)


def test_memory_levers_save_activation_memory(bench):
    lv = bench["levers"]
    assert lv["ac"]["saved_activation_mb"] < 0.8 * lv["eager"]["saved_activation_mb"]
    assert lv["fp8"]["saved_activation_mb"] < 0.6 * lv["eager"]["saved_activation_mb"]
    # What a forward holds, whoever holds it: full < selective (keeps matmul outputs) < none.
    held = {k: lv[k]["held_activation_mb"] for k in ("eager", "ac", "sac", "fp8")}
    assert held["ac"] < held["sac"] < 0.95 * held["eager"], held
    assert held["fp8"] < 0.6 * held["eager"], held
    assert lv["eager"]["speedup_vs_eager"] == 1.0 and bench["loader_examples_per_s"] > 0
    assert set(lv["eager"]["phase_ms"]) == {"data", "embed", "dense", "backward", "optim"}
    assert "loader alone" in format_bench(bench)


def test_unknown_lever_is_named():
    with pytest.raises(ValueError, match="warp"):
        run_bench(recipe("tiny"), levers=("eager+warp",), warmup=0, steps=1)
    with pytest.raises(ValueError, match="exclude each other"):
        run_bench(recipe("tiny"), levers=("ac+sac",), warmup=0, steps=1)


def test_forward_held_bytes_counts_what_outlives_the_call():
    import torch

    from opengem.train.bench import forward_held_bytes

    x = torch.randn(256, 256, requires_grad=True)

    def f():
        kept = x.exp()  # saved by exp's backward, and the result: one 256 KiB buffer
        tmp = x * 2  # freed on return
        return kept + 0 * tmp.sum()

    _, held = forward_held_bytes(f, torch.device("cpu"))
    assert 2 * 256 * 256 * 4 <= held < 3.2 * 256 * 256 * 4  # ``kept`` and the output (+ a few scalars)


def test_trainer_fp8_activations_stay_near_fp32(tmp_path):
    """``train.fp8_activations=true`` through the trainer: same losses as fp32 within the bench tolerance."""
    import json

    from opengem.config import apply_overrides
    from opengem.data.synthetic import generate, world_config
    from opengem.train.trainer import train

    generate(world_config("tiny", seed=0), tmp_path / "data", progress=False)
    losses = {}
    for flag in ("false", "true"):
        cfg = apply_overrides(recipe("tiny"), ["train.max_steps=4", "train.log_every=1",
                                               f"train.fp8_activations={flag}"])
        cfg.train.progress = False
        train(cfg, tmp_path / "data", tmp_path / flag)
        losses[flag] = [json.loads(x)["loss"] for x in (tmp_path / flag / "metrics.jsonl").read_text().splitlines()]
    assert len(losses["true"]) == 4
    assert max(abs(a - b) / b for a, b in zip(losses["true"], losses["false"])) < TOL["fp8"]


def test_time_to_quality_interpolates_the_first_crossing():
    from opengem.train.bench import time_to_quality

    gem = {"curve": [(1.0, 100, 0.99), (2.0, 200, 0.95), (3.0, 300, 0.90)], "final_ne": 0.90}
    peer = {"curve": [(0.5, 300, 0.95)], "final_ne": 0.95, "train_s": 4.0}
    ttq = time_to_quality(gem, peer)
    assert ttq["gem_s_to_target"] == 2.0 and ttq["speedup"] == 2.0 and ttq["gem_pass_fraction_to_target"] == 0.667
    assert time_to_quality(gem, {**peer, "final_ne": 0.5})["speedup"] is None  # never reached: no figure
    between = time_to_quality(gem, {**peer, "final_ne": 0.93})  # 40 % of the way from the 2nd to the 3rd eval
    assert between["gem_s_to_target"] == 2.4 and between["gem_s_at_eval"] == 3.0
    assert between["gem_pass_fraction_to_target"] == 0.8 and between["speedup"] == round(4.0 / 2.4, 3)
    first = time_to_quality(gem, {**peer, "final_ne": 0.995})  # reached at the first eval: nothing before it
    assert first["gem_s_to_target"] == 1.0
    assert ttq["speedup_sustained"] == ttq["speedup"]  # a monotone curve: one crossing


def test_time_to_quality_sustained_crossing_ignores_a_dip():
    from opengem.train.bench import time_to_quality

    # Dips below 0.93 at t = 2, spikes back to 0.97 at t = 3, then stays below from t = 4 on.
    gem = {"curve": [(1.0, 100, 0.99), (2.0, 200, 0.92), (3.0, 300, 0.97), (4.0, 400, 0.91), (5.0, 500, 0.90)],
           "final_ne": 0.90}
    ttq = time_to_quality(gem, {"final_ne": 0.93, "train_s": 7.0})
    assert abs(ttq["gem_s_to_target"] - (1.0 + 6 / 7)) < 1e-3  # the first dip, interpolated
    assert ttq["gem_s_to_target_sustained"] == 3.667  # 4/6 of the way from t = 3 (0.97) to t = 4 (0.91)
    assert ttq["gem_pass_fraction_to_target_sustained"] == round(366.67 / 500, 3)
    assert ttq["speedup_sustained"] == 1.909  # 7 / 3.667
    ends_above = time_to_quality({**gem, "curve": gem["curve"] + [(6.0, 600, 0.95)]}, {"final_ne": 0.93, "train_s": 7.0})
    assert ends_above["speedup"] is not None and ends_above["speedup_sustained"] is None


def test_train_with_evals_records_a_learning_curve(tmp_path):
    from opengem.data.synthetic import generate, world_config
    from opengem.train.bench import train_with_evals

    generate(world_config("tiny", seed=0), tmp_path, progress=False)
    out = train_with_evals(recipe("tiny"), tmp_path, eval_every=5)
    times, rows, nes = zip(*out["curve"])
    assert len(nes) >= 3 and list(times) == sorted(times) and list(rows) == sorted(rows)
    assert all(0 < v < 1.5 for v in nes) and out["final_ne"] == nes[-1] and out["examples_per_s"] > 0
    # The same pass with FP8 saved activations ends near the fp32 NE (the quick bench's fp8_ne_cost_pct).
    from opengem.config import apply_overrides

    fp8 = train_with_evals(apply_overrides(recipe("tiny"), ["train.fp8_activations=true"]), tmp_path, eval_every=10**6)
    assert len(fp8["curve"]) == 1 and abs(fp8["final_ne"] / out["final_ne"] - 1) < TOL["fp8"]


def test_widen_to_params_matches_gems_dense_size(tmp_path):
    from opengem.config import apply_overrides
    from opengem.data.synthetic import generate, world_config
    from opengem.features.schema import FeatureSchema
    from opengem.model.build import build_gem, count_parameters
    from opengem.train.bench import training_examples_per_s, widen_to_params

    generate(world_config("tiny", seed=0), tmp_path, progress=False)
    schema = FeatureSchema.load(tmp_path)
    target = count_parameters(build_gem(schema, recipe("tiny").model))["dense"]
    dcn = apply_overrides(recipe("tiny"), ["model.arch=dlrm_dcn"])
    wide = widen_to_params(dcn, schema, target)
    got = count_parameters(build_gem(schema, wide.model))["dense"]
    assert abs(got - target) <= 0.03 * target and wide.model.arch == "dlrm_dcn"
    assert training_examples_per_s(wide, tmp_path, steps=2, warmup=1) > 0


def test_eval_schedule_and_reading_a_curve_at_a_time():
    from opengem.train.bench import eval_schedule, ne_at

    assert eval_schedule(100, 40, 10, 25) == [10, 20, 30, 40, 65, 90, 100]  # dense, then sparse, then the end
    assert eval_schedule(30, 100, 20, 20) == [20, 30]
    curve = [(1.0, 10, 0.9), (3.0, 30, 0.8)]
    assert ne_at(curve, 0.5) == 0.9  # before the first evaluation: the first
    assert abs(ne_at(curve, 2.0) - 0.85) < 1e-12 and ne_at(curve, 3.0) == 0.8
    assert ne_at(curve, 3.5) is None  # past the end: unknown
