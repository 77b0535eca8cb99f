"""The stages after ``train`` read the model a run says is its result: with ``train.keep_best``,
``--checkpoint best`` (the default) is the best held-out evaluation's, not the last checkpoint.

The run: the tiny preset, one epoch, evaluated before the first step and after the last one, and
``feed/click:gauc`` followed; measured (world seed 1, valid days) 0.75 untrained and 0.64 after the
epoch, so the kept best is the untrained model of step 0 and the last checkpoint is step 16's.
Training is deterministic; the margin covers other CPUs' float arithmetic.
"""

import json

import pytest
import torch

from opengem.checkpoint import best_checkpoint
from opengem.cli import main
from opengem.evaluation.evaluate import evaluate_run
from opengem.evaluation.recalibrate import recalibrate_run
from opengem.run import FINAL_FILE, METRICS_FILE, RECALIBRATION_FILE, load_run_model


@pytest.fixture(scope="module")
def kept_best(tmp_path_factory):
    """(data, run) of a run whose kept best is not its last checkpoint."""
    root = tmp_path_factory.mktemp("best")
    data, run = root / "data", root / "run"
    assert main(["--quiet", "generate", "--preset", "tiny", "--out", str(data), "--seed", "1"]) == 0
    assert main(["--quiet", "train", "--recipe", "tiny", "--data", str(data), "--out", str(run),
                 "train.epochs=1", "train.eval_at=[0]", "train.eval_metric=feed/click:gauc",
                 "train.keep_best=true"]) == 0
    lines = (run / METRICS_FILE).read_text().splitlines()
    evals = [json.loads(x) for x in lines if '"eval_metric"' in x]
    final = json.loads((run / FINAL_FILE).read_text())
    assert best_checkpoint(run) is not None
    kept = evals[-1]["eval_metric"]
    assert kept["best_step"] == 0 != final["steps"], kept
    return data, run


def _same(a: dict, b: dict) -> bool:
    # NaN equals NaN as JSON writes it (a slice with one class has no AUC)
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _evaluate(data, run, out, *extra) -> dict:
    argv = ["--quiet", "evaluate", "--run", str(run), "--data", str(data), "--json", str(out),
            *extra]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_recalibrate_then_evaluate_read_the_best(kept_best, tmp_path):
    data, run = kept_best
    on_last = recalibrate_run(run, data, progress=False)
    assert main(["--quiet", "recalibrate", "--run", str(run), "--data", str(data)]) == 0
    rec = json.loads((run / RECALIBRATION_FILE).read_text())
    assert (rec["checkpoint"], on_last["checkpoint"]) == ("best", "last")
    assert rec["offsets"] != on_last["offsets"]

    ev = _evaluate(data, run, tmp_path / "best.json")
    assert ev["checkpoint"] == "best"
    assert _same(ev["metrics"], evaluate_run(run, data, progress=False, best=True)["metrics"])
    last = _evaluate(data, run, tmp_path / "last.json", "--checkpoint", "last")
    assert last["checkpoint"] == "last"
    assert _same(last["metrics"], evaluate_run(run, data, progress=False, best=False)["metrics"])
    assert ev["metrics"]["all/click"]["ne"] != last["metrics"]["all/click"]["ne"]


def test_export_and_the_distill_teacher_read_the_best(kept_best, tmp_path):
    from opengem.features.schema import FeatureSchema
    from opengem.transfer.distill import load_teachers

    data, run = kept_best
    best = load_run_model(run, best=True)[0].state_dict()
    out = tmp_path / "artifact"
    assert main(["--quiet", "export", "--run", str(run), "--out", str(out), "--no-compile"]) == 0
    assert json.loads((out / "manifest.json").read_text())["run"]["checkpoint"] == "best"
    weights = torch.load(out / "weights.pt", weights_only=True)
    assert torch.equal(weights["heads.out_w"], best["heads.out_w"])
    last = load_run_model(run)[0].state_dict()
    assert not torch.equal(weights["heads.out_w"], last["heads.out_w"])

    gem, _ = load_teachers(run, None, FeatureSchema.load(data), best=True)
    assert torch.equal(gem.model.state_dict()["heads.out_w"], best["heads.out_w"])
