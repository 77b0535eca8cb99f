"""benchmarks/quality.py makes each world once under ``--work``: a rerun reuses it, a cut-off one is
made again."""

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

from opengem.data.parquet import MANIFEST

QUALITY = Path(__file__).resolve().parents[2] / "benchmarks" / "quality.py"


def _quality():
    spec = importlib.util.spec_from_file_location("quality_bench", QUALITY)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_a_world_is_generated_once_and_a_half_written_one_again(tmp_path):
    q = _quality()
    mode = q.Mode(dev_worlds=[0], held_out=[], train_seeds=[0], world=["sizes.num_users=80"],
                  dense_lrs=(1e-3,), table_lrs=(0.1,), max_epochs=1)
    out = q.synthetic_world(tmp_path, 0, mode)
    first = (out / MANIFEST).stat().st_mtime_ns
    assert q.synthetic_world(tmp_path, 0, mode) == out
    # reused: the check looked for a file generate never writes
    assert (out / MANIFEST).stat().st_mtime_ns == first
    (out / MANIFEST).unlink()  # as if generation had been killed before its last write
    q.synthetic_world(tmp_path, 0, mode)
    assert (out / MANIFEST).exists()


def test_the_demo_mode_makes_the_demo_world_and_trains_the_demo_recipe(tmp_path):
    q = _quality()
    assert (q.DEMO.preset, q.DEMO.recipe, q.DEMO.world, q.DEMO.max_epochs) == (
        "demo",
        "demo",
        [],
        1,
    )
    assert min(q.DEMO.held_out) >= 1000 and max(q.DEMO.dev_worlds) < 100 and q.DEMO.real == {}
    small = dataclasses.replace(q.DEMO, world=["sizes.num_users=60"])
    out = q.synthetic_world(tmp_path, 0, small)
    tiny = q.synthetic_world(tmp_path / "tiny", 0, dataclasses.replace(small, preset="tiny"))
    demo_cfg = json.loads((out / MANIFEST).read_text())["source"]["config"]
    tiny_cfg = json.loads((tiny / MANIFEST).read_text())["source"]["config"]
    assert demo_cfg["sizes"]["num_users"] == tiny_cfg["sizes"]["num_users"] == 60
    assert demo_cfg["sizes"] != tiny_cfg["sizes"]  # the preset's other sizes, not the tiny world's


def _summary(ratio_gem, ratio_peer, auc_gem=0.8, conv=0.5):
    def s(ratio, auc, ne):
        return {"click": {"captured": [ratio * 0.5, 0.0], "oracle_captured": [0.5, 0.0],
                          "auc": [auc, 0.0], "ne": [ne, 0.0],
                          "captured_over_oracle": [ratio, 0.01]},
                "conversion": {"captured_over_oracle": [conv, 0.1]}}
    return {"gem": s(ratio_gem, auc_gem, 0.8), "din": s(ratio_peer, 0.75, 0.85)}


def test_the_json_line_holds_raw_and_recalibrated_ratios_and_the_dev_crossfit_rule():
    q = _quality()
    mode = q.Mode(dev_worlds=[0, 1], held_out=[1000, 1001], train_seeds=[0], world=[],
                  dense_lrs=(1e-3,), table_lrs=(0.1,), max_epochs=1)
    raw = {1000: _summary(0.6, 0.4), 1001: _summary(0.7, 0.5, auc_gem=0.7)}
    recal = {1000: _summary(0.65, 0.45), 1001: _summary(0.75, 0.55)}
    out = q.headline("quick", mode, ["gem", "din"], {}, raw, {}, 1.0, recal, {})
    assert (out["gem_over_oracle_mean"], out["gem_over_oracle_min"]) == (0.65, 0.6)
    assert (out["gem_over_oracle_recalibrated_mean"], out["gem_over_oracle_recalibrated_min"]) == (
        0.7,
        0.65,
    )
    assert (
        out["worlds"]["1000"]["gem_beats_every_peer"]
        and not out["worlds"]["1001"]["gem_beats_every_peer"]
    )
    assert out["recalibrated"]["worlds"]["1001"]["gem_beats_every_peer"]
    assert out["gem_over_oracle_conversion"] == {"mean": 0.5, "std": 0.0, "min": 0.5}
    fits = {("gem", 0): {"click": {"ne": 0.9, "ne_platt": 0.89},
                         "conversion": {"ne": 0.8, "ne_platt": 0.81}},
            ("gem", 1): {"click": {"ne": 0.9, "ne_platt": 0.88},
                         "conversion": {"ne": 0.8, "ne_platt": 0.82}}}
    got = q.crossfit_summary(["gem"], fits)
    assert (
        got["adopt"] and got["gem"]["click"][0] == -0.015 and got["gem"]["conversion"][0] == 0.015
    )
    fits[("gem", 1)]["click"]["ne_platt"] = 0.95  # mean gain now < 0: not adopted
    assert not q.crossfit_summary(["gem"], fits)["adopt"]


def test_the_pair_blind_reference_is_its_test_captured_over_the_oracles(tmp_path):
    # The reference beside the models' ratios: the oracle's formulas without its pairs, on test.
    from opengem.world.oracle import refit

    q = _quality()
    mode = q.Mode(dev_worlds=[], held_out=[1000], train_seeds=[0], world=["sizes.num_users=400"],
                  dense_lrs=(1e-3,), table_lrs=(0.1,), max_epochs=1)
    data = q.synthetic_world(tmp_path, 1000, mode)
    got = q.pair_blind_trial(str(data))
    blind, oracle = (
        refit(data, crosses="all"),
        json.loads((data / MANIFEST).read_text())["source"]["stats"]["oracle"],
    )
    for t in ("click", "conversion"):
        assert (
            got[t] == blind["test"][f"all/{t}"]["captured"] / oracle["test"][f"all/{t}"]["captured"]
        )
    assert 0.3 < got["click"] < 1.2  # measured 0.86-1.01 on worlds 1000-1002 at 1,500 users
    summary = q.pair_blind_summary({1000: got, 1001: {"click": 0.5, "conversion": None}})
    assert summary["min"] == 0.5 and summary["mean"] == round((got["click"] + 0.5) / 2, 5)
    assert summary["worlds"]["1001"] == {"click": 0.5, "conversion": None}


def test_the_json_line_holds_the_stacks_and_whether_gems_beats_every_peer_stacked_or_not():
    q = _quality()
    mode = q.Mode(dev_worlds=[0], held_out=[1000, 1001], train_seeds=[0], world=[],
                  dense_lrs=(1e-3,), table_lrs=(0.1,), max_epochs=1)
    raw = {w: _summary(0.6, 0.4) for w in (1000, 1001)}
    for w, (gem_stack, din_stack) in {1000: (0.8, 0.7), 1001: (0.8, 0.9)}.items():
        s = _summary(gem_stack, din_stack, auc_gem=0.9 if w == 1000 else 0.7)
        raw[w]["gem+logreg"], raw[w]["din+logreg"] = s["gem"], s["din"]
    models = ["gem", "din", "gem+logreg", "din+logreg"]
    out = q.headline("quick", mode, models, {}, raw, {}, 1.0, raw, {})
    assert (out["gem_stacked_over_oracle_mean"], out["gem_stacked_over_oracle_min"]) == (0.8, 0.8)
    assert out["din+logreg_over_oracle"]["min"] == 0.7
    assert out["worlds"]["1000"]["gem_stacked_beats_every_peer"]  # din and din+logreg both behind
    assert not out["worlds"]["1001"]["gem_stacked_beats_every_peer"]  # din+logreg's AUC 0.75 > 0.7
    assert q.stacked_name("gem") == "gem+" + q.LINEAR


def test_seeds_reads_only_seeds_of_the_block_it_reports_on():
    """``--seeds``: the rest of the fresh block (2003, 2004) is accepted; a development seed, a seed
    of another block, a repeat or a word is refused with the block named."""
    import pytest

    q = _quality()
    assert q.block_seeds("2003,2004", worn=False) == [2003, 2004]
    assert q.block_seeds("1001", worn=True) == [1001]
    for bad, worn in [("5", False), ("1001", False), ("2003", True), ("2003,2003", False),
                      ("2003,x", False), ("", False)]:
        with pytest.raises(SystemExit, match="--seeds"):
            q.block_seeds(bad, worn)
