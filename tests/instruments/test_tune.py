"""The one learning-rate search: valid only, early stopping, the best checkpoint, a fair choice."""

import json
import math

import pytest
from instruments.tune import best_evaluation, choose, lr_grid, search_overrides, train_point

from opengem.discipline import DisciplineError


def test_grid_is_the_product_and_the_search_refuses_test():
    assert lr_grid((1e-3, 3e-3), (0.1,)) == [(1e-3, 0.1), (3e-3, 0.1)]
    keys = search_overrides("valid", max_epochs=3, patience=2)
    # the untrained model is a candidate
    assert "train.eval_split=valid" in keys and "train.eval_at=[0]" in keys
    with pytest.raises(DisciplineError, match="learning-rate search"):
        search_overrides("test")


def test_choose_takes_the_best_mean_and_never_a_diverged_point():
    values = {(1e-3, 0.1): [0.90, 0.80], (3e-3, 0.1): [0.84, 0.84], (1e-2, 0.1): [math.nan, 0.1]}
    assert choose(values) == (3e-3, 0.1)  # 0.84 < 0.85; the NaN point's 0.1 does not count
    assert choose({(1, 1): [0.7], (2, 2): [0.9]}, higher_is_better=True) == (2, 2)
    with pytest.raises(ValueError, match="empty"):
        choose({})


def test_best_evaluation_reads_the_best_step(tmp_path):
    lines = [{"step": 1, "loss": 0.5},
             {"step": 10, "eval": {"all/click": {"ne": 0.9}},
              "eval_metric": {"value": 0.9, "best": 0.9, "best_step": 10}},
             {"step": 20, "eval": {"all/click": {"ne": 0.95}},
              "eval_metric": {"value": 0.95, "best": 0.9, "best_step": 10}}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    assert best_evaluation(tmp_path) == (0.9, 10, {"all/click": {"ne": 0.9}})
    (tmp_path / "metrics.jsonl").write_text(json.dumps(lines[0]) + "\n")
    with pytest.raises(ValueError, match="no held-out evaluation"):
        best_evaluation(tmp_path)


@pytest.mark.slow
def test_a_trial_stops_on_valid_and_keeps_the_best(tmp_path):
    from opengem.evaluation.evaluate import evaluate_run
    from opengem.recipes import recipe
    from opengem.world.generate import generate
    from opengem.world.presets import world_config

    data = tmp_path / "data"
    generate(world_config("tiny", seed=0), data, progress=False)
    cfg = recipe("tiny")
    cfg.train.progress, cfg.train.threads = False, 1
    t = train_point(cfg, data, tmp_path / "run", (3e-3, 0.1), max_epochs=2, patience=1)
    evals = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if '"eval"' in x]
    assert [e["eval_split"] for e in evals] == ["valid"] * len(evals) and 2 <= len(evals) <= 3
    # the untrained model, beaten
    assert evals[0]["step"] == 0 and evals[0]["eval"]["all/click"]["ne"] > t.value
    assert (
        t.value == min(e["eval"]["all/click"]["ne"] for e in evals)
        and t.valid["all/click"]["ne"] == t.value
    )
    best = evaluate_run(tmp_path / "run", data, "valid", progress=False,
                        best=True)["metrics"]["all/click"]["ne"]
    assert best == pytest.approx(t.value, abs=1e-6)  # the kept checkpoint is the evaluation's model
