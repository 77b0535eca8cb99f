"""GEM against DLRM-DCN: learning curves, time to quality (mid-run and budgeted), equal-parameter peers."""

from opengem.bench.race import budget_crossing
from opengem.recipes import recipe

FP8_TOL = 3e-2  # the fp8 lever's stated tolerance (tests/unit/bench/test_levers.py)


def test_time_to_quality_interpolates_the_first_crossing():
    from opengem.bench.race import time_to_quality

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
    from opengem.bench.race import time_to_quality

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
    from opengem.bench.race import train_with_evals
    from opengem.data.synthetic import generate
    from opengem.recipes import world_config

    generate(world_config("tiny", seed=0), tmp_path, progress=False)
    out = train_with_evals(recipe("tiny"), tmp_path, eval_every=5)
    times, rows, nes = zip(*out["curve"])
    assert len(nes) >= 3 and list(times) == sorted(times) and list(rows) == sorted(rows)
    assert all(0 < v < 1.5 for v in nes) and out["final_ne"] == nes[-1] and out["examples_per_s"] > 0
    # The same pass with FP8 saved activations ends near the fp32 NE (the quick bench's fp8_ne_cost_pct).
    from opengem.config import apply_overrides

    fp8 = train_with_evals(apply_overrides(recipe("tiny"), ["train.fp8_activations=true"]), tmp_path, eval_every=10**6)
    assert len(fp8["curve"]) == 1 and abs(fp8["final_ne"] / out["final_ne"] - 1) < FP8_TOL


def test_widen_to_params_matches_gems_dense_size(tmp_path):
    from opengem.bench.race import training_examples_per_s, widen_to_params
    from opengem.config import apply_overrides
    from opengem.data.synthetic import generate
    from opengem.features.schema import FeatureSchema
    from opengem.model.build import build_gem, count_parameters
    from opengem.recipes import world_config

    generate(world_config("tiny", seed=0), tmp_path, progress=False)
    schema = FeatureSchema.load(tmp_path)
    target = count_parameters(build_gem(schema, recipe("tiny").model))["dense"]
    dcn = apply_overrides(recipe("tiny"), ["model.arch=dlrm_dcn"])
    wide = widen_to_params(dcn, schema, target)
    got = count_parameters(build_gem(schema, wide.model))["dense"]
    assert abs(got - target) <= 0.03 * target and wide.model.arch == "dlrm_dcn"
    assert training_examples_per_s(wide, tmp_path, steps=2, warmup=1) > 0


def test_eval_schedule_and_reading_a_curve_at_a_time():
    from opengem.bench.race import eval_schedule, ne_at

    assert eval_schedule(100, 40, 10, 25) == [10, 20, 30, 40, 65, 90, 100]  # dense, then sparse, then the end
    assert eval_schedule(30, 100, 20, 20) == [20, 30]
    curve = [(1.0, 10, 0.9), (3.0, 30, 0.8)]
    assert ne_at(curve, 0.5) == 0.9  # before the first evaluation: the first
    assert abs(ne_at(curve, 2.0) - 0.85) < 1e-12 and ne_at(curve, 3.0) == 0.8
    assert ne_at(curve, 3.5) is None  # past the end: unknown


def test_budget_crossing_interpolates_in_log_seconds():
    import math

    points = [(2.0, 0.90), (4.0, 0.86), (8.0, 0.82)]
    halfway = budget_crossing(points, 0.84)  # halfway from 4 s to 8 s in log t
    assert abs(halfway["gem_s_to_target"] - math.sqrt(4.0 * 8.0)) < 1e-12 and halfway["bound"] == "exact"
    assert budget_crossing(points, 0.86)["gem_s_to_target"] == 4.0  # a budget exactly at the target
    assert budget_crossing(points, 0.95) == {"gem_s_to_target": 2.0, "bound": "upper"}  # the smallest already reaches it
    assert budget_crossing(points, 0.80) == {"gem_s_to_target": None, "bound": None}  # none reaches it: no figure


def test_a_budget_run_stops_and_decays_at_its_budget(tmp_path):
    from opengem.bench.race import race_steps, train_with_evals
    from opengem.data.synthetic import generate
    from opengem.recipes import world_config
    from opengem.train.optim import lr_factor

    generate(world_config("tiny", seed=0), tmp_path, progress=False)
    cfg = recipe("tiny")
    cfg.optim.warmup_steps = 1
    assert race_steps(tmp_path) > 3
    out = train_with_evals(cfg, tmp_path, eval_every=10**6, max_steps=3)
    assert len(out["curve"]) == 1 and out["curve"][-1][1] == 3 * cfg.data.batch_size  # three batches, one evaluation
    # The cosine decay is fitted to the budget: the 3rd step of 3 (1 warm-up step) is halfway down it;
    # sized to the whole pass (14 steps) it would still be near the top.
    assert out["last_lr_factor"] == lr_factor(2, 3, cfg.optim) == 0.1 + 0.9 * 0.5 < lr_factor(2, 14, cfg.optim)


def test_budget_race_doubles_gems_budget_until_it_reaches_dcns_ne(tmp_path):
    import itertools

    from opengem.bench.race import budget_race
    from opengem.data.synthetic import generate
    from opengem.recipes import world_config

    generate(world_config("tiny", seed=0), tmp_path, progress=False)
    race = budget_race(tmp_path, smallest=1 / 8, min_steps=2)
    ttq, gem = race["ttq"], race["runs"]["gem"]
    steps = [b["steps"] for b in ttq["budgets"]]
    assert steps == sorted(steps) and all(b == 2 * a or b == ttq["steps"] for a, b in itertools.pairwise(steps))
    assert [r["final_ne"] for r in gem] == [b["final_ne"] for b in ttq["budgets"]]
    assert all(b["final_ne"] > ttq["target_ne"] for b in ttq["budgets"][:-1])  # it stopped at the first crossing
    assert race["runs"]["dlrm_dcn"]["steps"] == ttq["steps"] and ttq["target_ne"] == race["runs"]["dlrm_dcn"]["final_ne"]
    if ttq["speedup"] is not None:
        assert ttq["budgets"][-1]["final_ne"] <= ttq["target_ne"]
        assert abs(ttq["speedup"] - ttq["peer_s"] / ttq["gem_s_to_target"]) < 1e-2
    else:
        assert steps[-1] == ttq["steps"] and ttq["budgets"][-1]["final_ne"] > ttq["target_ne"]
