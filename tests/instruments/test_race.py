"""GEM against DLRM-DCN: learning curves, time to quality (mid-run and budgeted), the tuning of each
side's rates, the repeated race and its summary, equal-parameter peers."""

import json
import math

import pytest
from instruments import race as race_mod
from instruments.race import budget_crossing

from opengem.discipline import DisciplineError
from opengem.recipes import recipe

FP8_TOL = 3e-2  # the fp8 lever's stated tolerance (tests/unit/bench/test_levers.py)


def test_time_to_quality_interpolates_the_first_crossing():
    from instruments.race import time_to_quality

    gem = {"curve": [(1.0, 100, 0.99), (2.0, 200, 0.95), (3.0, 300, 0.90)], "final_ne": 0.90}
    peer = {"curve": [(0.5, 300, 0.95)], "final_ne": 0.95, "train_s": 4.0}
    ttq = time_to_quality(gem, peer)
    assert (
        ttq["gem_s_to_target"] == 2.0
        and ttq["speedup"] == 2.0
        and ttq["gem_pass_fraction_to_target"] == 0.667
    )
    # never reached: no figure
    assert time_to_quality(gem, {**peer, "final_ne": 0.5})["speedup"] is None
    # 40 % of the way from the 2nd to the 3rd eval
    between = time_to_quality(gem, {**peer, "final_ne": 0.93})
    assert between["gem_s_to_target"] == 2.4 and between["gem_s_at_eval"] == 3.0
    assert between["gem_pass_fraction_to_target"] == 0.8 and between["speedup"] == round(
        4.0 / 2.4, 3
    )
    # reached at the first eval: nothing before it
    first = time_to_quality(gem, {**peer, "final_ne": 0.995})
    assert first["gem_s_to_target"] == 1.0
    assert ttq["speedup_sustained"] == ttq["speedup"]  # a monotone curve: one crossing


def test_time_to_quality_sustained_crossing_ignores_a_dip():
    from instruments.race import time_to_quality

    # Dips below 0.93 at t = 2, spikes back to 0.97 at t = 3, then stays below from t = 4 on.
    gem = {"curve": [(1.0, 100, 0.99), (2.0, 200, 0.92), (3.0, 300, 0.97), (4.0, 400, 0.91),
                     (5.0, 500, 0.90)],
           "final_ne": 0.90}
    ttq = time_to_quality(gem, {"final_ne": 0.93, "train_s": 7.0})
    assert abs(ttq["gem_s_to_target"] - (1.0 + 6 / 7)) < 1e-3  # the first dip, interpolated
    # 4/6 of the way from t = 3 (0.97) to t = 4 (0.91)
    assert ttq["gem_s_to_target_sustained"] == 3.667
    assert ttq["gem_pass_fraction_to_target_sustained"] == round(366.67 / 500, 3)
    assert ttq["speedup_sustained"] == 1.909  # 7 / 3.667
    ends_above = time_to_quality({**gem, "curve": gem["curve"] + [(6.0, 600, 0.95)]},
                                 {"final_ne": 0.93, "train_s": 7.0})
    assert ends_above["speedup"] is not None and ends_above["speedup_sustained"] is None


def test_train_with_evals_records_a_learning_curve(tmp_path):
    from instruments.race import train_with_evals

    from opengem.world.generate import generate
    from opengem.world.presets import world_config

    generate(world_config("tiny", seed=0), tmp_path, progress=False)
    out = train_with_evals(recipe("tiny"), tmp_path, eval_every=5)
    times, rows, nes = zip(*out["curve"])
    assert len(nes) >= 3 and list(times) == sorted(times) and list(rows) == sorted(rows)
    assert (
        all(0 < v < 1.5 for v in nes) and out["final_ne"] == nes[-1] and out["examples_per_s"] > 0
    )
    # The same pass with FP8 saved activations ends near the fp32 NE (the quick
    # bench's fp8_ne_cost_pct).
    from opengem.config import apply_overrides

    fp8 = train_with_evals(apply_overrides(recipe("tiny"), ["train.fp8_activations=true"]),
                           tmp_path, eval_every=10**6)
    assert len(fp8["curve"]) == 1 and abs(fp8["final_ne"] / out["final_ne"] - 1) < FP8_TOL


def test_widen_to_params_matches_gems_dense_size(tmp_path):
    from instruments.race import training_examples_per_s, widen_to_params

    from opengem.config import apply_overrides
    from opengem.features.schema import FeatureSchema
    from opengem.model.build import build_gem, count_parameters
    from opengem.world.generate import generate
    from opengem.world.presets import world_config

    generate(world_config("tiny", seed=0), tmp_path, progress=False)
    schema = FeatureSchema.load(tmp_path)
    target = count_parameters(build_gem(schema, recipe("tiny").model))["dense"]
    dcn = apply_overrides(recipe("tiny"), ["model.arch=dlrm_dcn"])
    wide = widen_to_params(dcn, schema, target)
    got = count_parameters(build_gem(schema, wide.model))["dense"]
    assert abs(got - target) <= 0.03 * target and wide.model.arch == "dlrm_dcn"
    assert training_examples_per_s(wide, tmp_path, steps=2, warmup=1) > 0


def test_eval_schedule_and_reading_a_curve_at_a_time():
    from instruments.race import eval_schedule, ne_at

    # dense, then sparse, then the end
    assert eval_schedule(100, 40, 10, 25) == [10, 20, 30, 40, 65, 90, 100]
    assert eval_schedule(30, 100, 20, 20) == [20, 30]
    curve = [(1.0, 10, 0.9), (3.0, 30, 0.8)]
    assert ne_at(curve, 0.5) == 0.9  # before the first evaluation: the first
    assert abs(ne_at(curve, 2.0) - 0.85) < 1e-12 and ne_at(curve, 3.0) == 0.8
    assert ne_at(curve, 3.5) is None  # past the end: unknown


def test_budget_crossing_interpolates_in_log_seconds():
    import math

    points = [(2.0, 0.90), (4.0, 0.86), (8.0, 0.82)]
    halfway = budget_crossing(points, 0.84)  # halfway from 4 s to 8 s in log t
    assert (
        abs(halfway["gem_s_to_target"] - math.sqrt(4.0 * 8.0)) < 1e-12
        and halfway["bound"] == "exact"
    )
    assert budget_crossing(points, 0.86)["gem_s_to_target"] == 4.0  # a budget exactly at the target
    # The smallest budget already reaches it: an upper bound on GEM's time.
    assert budget_crossing(points, 0.95) == {"gem_s_to_target": 2.0, "bound": "upper"}
    # none reaches it: no figure
    assert budget_crossing(points, 0.80) == {"gem_s_to_target": None, "bound": None}


def test_a_budget_run_stops_and_decays_at_its_budget(tmp_path):
    from instruments.race import race_steps, train_with_evals

    from opengem.train.optim import lr_factor
    from opengem.world.generate import generate
    from opengem.world.presets import world_config

    generate(world_config("tiny", seed=0), tmp_path, progress=False)
    cfg = recipe("tiny")
    cfg.optim.warmup_steps = 1
    assert race_steps(tmp_path) > 3
    out = train_with_evals(cfg, tmp_path, eval_every=10**6, max_steps=3)
    # three batches, one evaluation
    assert len(out["curve"]) == 1 and out["curve"][-1][1] == 3 * cfg.data.batch_size
    # The cosine decay is fitted to the budget: the 3rd step of 3 (1 warm-up step) is halfway down
    # it; sized to the whole pass (14 steps) it would still be near the top.
    assert (
        out["last_lr_factor"]
        == lr_factor(2, 3, cfg.optim)
        == 0.1 + 0.9 * 0.5
        < lr_factor(2, 14, cfg.optim)
    )


def test_budget_race_doubles_gems_budget_until_it_reaches_dcns_ne_read_on_test(
    tmp_path, monkeypatch
):
    import itertools

    from instruments.race import budget_race

    from opengem.world.generate import generate
    from opengem.world.presets import world_config

    generate(world_config("tiny", seed=0), tmp_path, progress=False)
    splits, evaluator = [], race_mod.held_out_evaluator

    def recording(data, split, *a, **kw):
        splits.append(split)
        return evaluator(data, split, *a, **kw)

    monkeypatch.setattr(race_mod, "held_out_evaluator", recording)
    race = budget_race(tmp_path, smallest=1 / 8, min_steps=2)
    ttq, gem = race["ttq"], race["runs"]["gem"]
    # The target and every budget are read on test, the split the race says it reads.
    assert ttq["split"] == "test" and splits == ["test"] * (1 + len(gem))
    assert {r["split"] for r in [race["runs"]["dlrm_dcn"], *gem]} == {"test"}
    steps = [b["steps"] for b in ttq["budgets"]]
    assert steps == sorted(steps) and all(b == 2 * a or b == ttq["steps"] for a,
                                          b in itertools.pairwise(steps))
    # DLRM-DCN first by default
    assert ttq["sequence"] == [["dlrm_dcn", ttq["steps"]], *(["gem", n] for n in steps)]
    assert [r["final_ne"] for r in gem] == [b["final_ne"] for b in ttq["budgets"]]
    # it stopped at the first crossing
    assert all(b["final_ne"] > ttq["target_ne"] for b in ttq["budgets"][:-1])
    peer = race["runs"]["dlrm_dcn"]
    assert peer["steps"] == ttq["steps"] and ttq["target_ne"] == peer["final_ne"]
    if ttq["speedup"] is not None:
        assert ttq["budgets"][-1]["final_ne"] <= ttq["target_ne"]
        assert abs(ttq["speedup"] - ttq["peer_s"] / ttq["gem_s_to_target"]) < 1e-2
    else:
        assert steps[-1] == ttq["steps"] and ttq["budgets"][-1]["final_ne"] > ttq["target_ne"]


PASS = 64  # steps of the fake pass below


def fake_training(monkeypatch, dcn_ne=(0.90, 0.91, 0.89, 0.90), gem_ne=lambda lr, sparse_lr, steps,
                  seed: 0.0, steps=PASS):
    """``train_with_evals`` replaced by a table: DLRM-DCN ends at ``dcn_ne[seed]``; GEM's NE falls
    by 0.02 per doubling of its budget from 0.98 at 2 steps (plus ``gem_ne``). Each step costs 0.1 s
    for DLRM-DCN, 0.5 s for GEM. Returns the calls: (arch, steps, split, seed, lr, sparse_lr)."""
    calls = []

    def fake(cfg, data, eval_every, split="valid", eval_every_kth_file=1, max_steps=None, **kw):
        arch, n, seed, o = cfg.model.arch, max_steps, cfg.train.seed, cfg.optim
        assert cfg.data.seed == seed  # both sides see the same batches
        calls.append((arch, n, split, seed, o.lr, o.sparse_lr))
        ne = (
            dcn_ne[seed]
            if arch == "dlrm_dcn"
            else 0.98 - 0.02 * math.log2(n / 2) + gem_ne(o.lr, o.sparse_lr, n, seed)
        )
        return {"arch": arch, "split": split, "final_ne": ne,
                "train_s": n * (0.1 if arch == "dlrm_dcn" else 0.5),
                "parameters": {}, "curve": [], "examples_per_s": 1.0}

    monkeypatch.setattr(race_mod, "train_with_evals", fake)
    monkeypatch.setattr(race_mod, "race_steps", lambda data: steps)
    monkeypatch.setattr(race_mod, "FeatureSchema",
                        type("S", (), {"load": staticmethod(lambda d: _Meta(d))}))
    return calls


class _Meta:
    def __init__(self, data):
        self.meta = {"source": "synthetic", "seed": int(str(data).rsplit("-", 1)[-1])}


def test_tuning_refuses_the_test_split_and_held_out_worlds(monkeypatch):
    from instruments.race import tune_rates

    calls = fake_training(monkeypatch)
    with pytest.raises(DisciplineError, match="test split"):
        tune_rates("world-0", split="test")
    with pytest.raises(DisciplineError, match="held-out seed"):
        tune_rates("world-1000")
    with pytest.raises(DisciplineError, match="development world seeds 0-99, got 100"):
        tune_rates("world-100")
    with pytest.raises(ValueError, match="same number of points"):
        tune_rates("world-0", grids={"gem": ((1e-3, 3e-3), (0.3,)), "dlrm_dcn": ((1e-3,), (0.3,))})
    assert calls == []  # refused before anything trained


def test_tuning_scores_every_point_one_pass_on_valid_and_keeps_each_sides_best(monkeypatch):
    from instruments.race import tune_rates

    # GEM's NE: best at lr 3e-3 and table lr 0.8; DLRM-DCN's does not depend on the rates here,
    # so its first point (the lowest NE, ties to the first) is kept.
    def gem_ne(lr, sparse_lr, steps, seed):
        return abs(math.log10(lr / 3e-3)) * 0.01 + (0.8 - sparse_lr) * 0.01

    calls = fake_training(monkeypatch, gem_ne=gem_ne)
    grids = {"gem": ((1e-3, 3e-3, 1e-2), (0.3, 0.8)), "dlrm_dcn": ((3e-4, 1e-3, 3e-3), (0.3, 0.8))}
    out = tune_rates("world-7", grids=grids)
    # one full pass each, on valid
    assert len(calls) == 12 and {(c[1], c[2]) for c in calls} == {(PASS, "valid")}
    assert [(c[0], c[4], c[5]) for c in calls[:2]] == [("gem", 1e-3, 0.3), ("gem", 1e-3, 0.8)]
    assert out["best"] == {"gem": ("optim.lr=0.003", "optim.sparse_lr=0.8"),
                           "dlrm_dcn": ("optim.lr=0.0003", "optim.sparse_lr=0.3")}
    assert out["world_seeds"] == {"seed": 7} and out["split"] == "valid" and len(out["grid"]) == 12


def test_race_order_alternates_which_side_trains_first():
    from instruments.race import race_order

    assert [race_order(i)[0] for i in range(1, 5)] == ["gem", "dlrm_dcn", "gem", "dlrm_dcn"]
    assert race_order(2) == ("dlrm_dcn", "gem")
    with pytest.raises(ValueError, match="counted from 1"):
        race_order(0)


def test_the_race_interleaves_its_runs_and_reads_them_on_test(monkeypatch):
    from instruments.race import race

    calls = fake_training(monkeypatch)
    seen = []
    out = race("world-1000", runs=4, smallest=1 / 32, min_steps=2, on_run=seen.append)
    runs = out["runs"]
    assert seen == runs  # each run reported as it ends
    assert (
        [r["seed"] for r in runs] == [0, 1, 2, 3]
        and {c[2] for c in calls} == {"test"}
        and out["split"] == "test"
    )
    assert [r["sequence"][0][0] for r in runs] == ["gem", "dlrm_dcn", "gem", "dlrm_dcn"]
    # Budgets 2, 4, 8, 16, 32, 64 steps end at NE 0.98, 0.96, 0.94, 0.92, 0.90, 0.88.
    # Run 1, GEM first with no guess: through 1/8 of the pass (8 steps), then DLRM-DCN (0.90), then
    # on to 32.
    assert runs[0]["sequence"] == [["gem", 2], ["gem", 4], ["gem", 8], ["dlrm_dcn", PASS],
                                   ["gem", 16], ["gem", 32]]
    # Run 3, GEM first, stops its first climb at run 2's target (0.91: 32 steps); run 3's own
    # is 0.89.
    assert runs[2]["sequence"] == [*(["gem", n] for n in (2, 4, 8, 16, 32)), ["dlrm_dcn", PASS],
                                   ["gem", 64]]
    assert runs[1]["sequence"] == [["dlrm_dcn", PASS], *(["gem", n] for n in (2, 4, 8, 16, 32))]
    # GEM's 16 / 32 / 64 steps take 8 / 16 / 32 s, DLRM-DCN's pass 6.4 s. Run 2's target 0.91 is
    # halfway in NE from 8 s (0.92) to 16 s (0.90): √(8 · 16) s in log-seconds; run 1's 0.90 is the
    # 32-step budget itself; run 3's 0.89 halfway from 16 s to 32 s.
    assert runs[1]["gem_s_to_target"] == pytest.approx(8 * math.sqrt(2), abs=1e-3)
    assert runs[1]["speedup"] == round(6.4 / (8 * math.sqrt(2)), 3)
    assert runs[0]["speedup"] == round(6.4 / 16, 3) and runs[2]["speedup"] == round(
        6.4 / (16 * math.sqrt(2)), 3
    )
    s = out["speedup"]
    speedups = sorted(r["speedup"] for r in runs)
    assert s["runs"] == 4 and s["min"] == speedups[0] and s["max"] == speedups[-1]
    assert s["median"] == pytest.approx((speedups[1] + speedups[2]) / 2)


def test_a_gem_first_run_without_a_guess_stops_at_the_rounded_eighth(monkeypatch):
    from instruments.race import budget_ladder, budget_race

    # a target no budget reaches: GEM climbs the whole ladder
    fake_training(monkeypatch, dcn_ne=(0.0,), steps=1939)
    # 1/8 of 1,939 steps rounds to 242, not 242.4
    assert budget_ladder(1939)[:4] == [61, 121, 242, 485]
    seq = budget_race("world-1000", gem_first=True)["ttq"]["sequence"]
    assert seq[:4] == [["gem", 61], ["gem", 121], ["gem", 242], ["dlrm_dcn", 1939]]


def test_spread_is_the_median_and_min_max_with_missing_runs_ranked_slowest():
    from instruments.race import spread

    assert spread([1.2, 0.9, 1.5]) == {"median": 1.2, "min": 0.9, "max": 1.5, "runs": 3,
                                       "missing": 0}
    assert spread([1.0, 4.0, 2.0, 3.0])["median"] == 2.5
    assert spread([None, 1.0, 2.0]) == {"median": 1.0, "min": None, "max": 2.0, "runs": 3,
                                        "missing": 1}
    assert spread([None, None, 2.0])["median"] is None
    with pytest.raises(ValueError, match="no runs"):
        spread([])


def test_a_race_runs_at_the_rates_chosen_on_its_own_world_family(world, tmp_path):
    from instruments.race import RATES_BY_FAMILY, race_rates, world_family

    from opengem.data.parquet import DatasetManifest
    from opengem.world.generate import generate
    from opengem.world.presets import world_config

    wide = tmp_path / "f2"
    generate(world_config("tiny", seed=0, overrides=["sizes.num_users=200", "family=2"]), wide,
             progress=False)
    assert (world_family(world), world_family(wide)) == (1, 2)
    assert race_rates(world) == RATES_BY_FAMILY[1] and race_rates(wide) == RATES_BY_FAMILY[2]
    assert RATES_BY_FAMILY[1] != RATES_BY_FAMILY[2]
    # data that is not synthetic has no family: the demo form's rates (family 1)
    real = tmp_path / "real"
    real.mkdir()
    m = DatasetManifest.load(wide)
    (real / "dataset.json").write_text(
        json.dumps({**m.to_dict(), "source": {"kind": "movielens"}}))
    assert world_family(real) == 1
