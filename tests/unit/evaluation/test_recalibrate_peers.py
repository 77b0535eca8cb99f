"""``opengem recalibrate`` takes every model the trainer trains: a tiny DIN and DLRM-DCN run are
recalibrated (CLI and library, both forms), loading the run applies the fit (evaluation reads the
calibration the fit reported, closer to 1 than before), a down-sampled peer run is corrected as
GEM's is, and a model with no per-(domain, task) output is still refused by name."""

import json
import math

import pytest
import torch

from opengem.cli import main
from opengem.config import apply_overrides
from opengem.evaluation import recalibrate
from opengem.evaluation.evaluate import evaluate_run, held_out_evaluator
from opengem.evaluation.recalibrate import recalibrate_run
from opengem.model.logit_shift import RecalibrationError, offsets_tensor
from opengem.recipes import recipe
from opengem.run import DOWNSAMPLING_FILE, RECALIBRATION_FILE, load_run_model
from opengem.train.trainer import train
from opengem.world.generate import generate
from opengem.world.presets import world_config

STEPS = 12
BASE = [f"train.max_steps={STEPS}", "train.threads=1", "train.progress=false",
        "optim.warmup_steps=2"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    data = tmp_path_factory.mktemp("peers") / "data"
    generate(world_config("tiny", seed=3), data, progress=False)
    return data


@pytest.fixture(scope="module")
def runs(world, tmp_path_factory):
    """arch → a tiny run of it; dlrm_dcn's negatives down-sampled, with a held-out evaluation at
    its last step (the trainer's ``LogitShift`` path)."""
    root = tmp_path_factory.mktemp("runs")
    extra = {"din": [], "dlrm_dcn": ["data.negative_rate=0.4", f"train.eval_at={STEPS}"]}
    for arch, more in extra.items():
        cfg = apply_overrides(recipe("tiny"), [*BASE, f"model.arch={arch}", *more])
        evaluator = held_out_evaluator(world, "valid") if more else None
        train(cfg, world, root / arch, evaluator=evaluator)
    return root


def _distance(cal: dict) -> float:
    return sum(abs(c - 1) for c in cal.values()) / len(cal)


def _offsets(model, rec, schema) -> torch.Tensor:
    return offsets_tensor(model, rec["offsets"], schema).float()


@pytest.mark.parametrize("arch", ["din", "dlrm_dcn"])
def test_a_peer_run_is_recalibrated_and_loading_it_applies_the_offsets(runs, world, arch):
    run = runs / arch
    assert main(["--quiet", "recalibrate", "--run", str(run), "--data", str(world)]) == 0
    rec = json.loads((run / RECALIBRATION_FILE).read_text())
    raw, _, schema = load_run_model(run, recalibrated=False)
    assert rec["form"] == "offset" and list(rec["offsets"]) == [  # one per (domain, task)
        f"{d}/{t}" for d in schema.domains.names for t in schema.task_names]
    before, after = rec["calibration_before"], rec["calibration_after"]
    assert _distance(after) < _distance(before)
    for key in (k for k in before if k.endswith("/click")):  # unchained: strictly towards 1
        assert abs(after[key] - 1) < abs(before[key] - 1), (key, before[key], after[key])
    served = load_run_model(run)[0]
    torch.testing.assert_close(served.out_b - raw.out_b, _offsets(raw, rec, schema))
    # the scores every stage reads (load_run_model) have the calibration the fit reported
    metrics = evaluate_run(run, world, "valid", progress=False)["metrics"]
    for key, cal in after.items():
        assert metrics[key]["calibration"] == pytest.approx(cal, abs=2e-4)


@pytest.mark.parametrize("arch", ["din", "dlrm_dcn"])
def test_the_platt_form_folds_into_a_peer(runs, world, arch):
    rec = recalibrate_run(runs / arch, world, "valid", progress=False, form="platt")
    assert set(rec["slopes"]) == {"click", "conversion"} and all(
        a > 0 for a in rec["slopes"].values())
    assert _distance(rec["calibration_after"]) < _distance(rec["calibration_before"])
    metrics = evaluate_run(runs / arch, world, "valid", progress=False)["metrics"]
    for key, cal in rec["calibration_after"].items():
        assert metrics[key]["calibration"] == pytest.approx(cal, abs=2e-4)


def test_a_downsampled_peer_run_is_corrected_as_gem_is(runs, world):
    """log r on click's own logit, 0 on the chained conversion, folded by ``load_run_model``; the
    trainer's held-out evaluation (``LogitShift``) and ``evaluate_run`` score the same; the
    recalibration is fitted on top of the corrected model."""
    run = runs / "dlrm_dcn"
    (run / RECALIBRATION_FILE).unlink(missing_ok=True)  # another test's fit: not this one's
    rec = json.loads((run / DOWNSAMPLING_FILE).read_text())
    assert rec["offsets"]["feed/click"] == pytest.approx(math.log(0.4))
    assert rec["offsets"]["feed/conversion"] == 0
    raw = load_run_model(run, recalibrated=False, corrected=False)[0]
    corrected, _, schema = load_run_model(run, recalibrated=False)
    torch.testing.assert_close(corrected.out_b - raw.out_b, _offsets(raw, rec, schema))
    during = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()
              if '"eval"' in x][-1]["eval"]
    after = evaluate_run(run, world, "valid", progress=False)["metrics"]
    for key in ("all/click", "all/conversion"):
        assert during[key]["ne"] == pytest.approx(after[key]["ne"], abs=1e-5)
    fitted = recalibrate_run(run, world, "valid", progress=False)
    served = load_run_model(run)[0]
    torch.testing.assert_close(served.out_b - raw.out_b,
                               _offsets(raw, rec, schema) + _offsets(raw, fitted, schema))


def test_a_model_without_a_logit_output_is_refused(runs, world, monkeypatch):
    class Scores(torch.nn.Module):  # one score per row: no logit per (domain, task)
        def max_seq_len(self):
            return {}

    run = runs / "din"
    monkeypatch.setattr(recalibrate, "load_run_model",
                        lambda *a, **k: (Scores(), None, load_run_model(run)[2]))
    with pytest.raises(RecalibrationError, match="Scores has no GEM heads and no per-"):
        recalibrate_run(run, world, "valid", progress=False)
