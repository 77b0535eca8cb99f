"""The down-sampling correction: which heads get log r (the ESMM chain, derived in
opengem.model.logit_shift and checked here numerically), q = p / (p + (1 − p)/w) with w = r (He et
al.'s w is the rate, not the weight 1/r), the shift on chained logits, evaluation and the serving
path (biases folded by load_run_model) scoring the same, and a run recording it end to end."""

import copy
import json
import math

import pytest
import torch

from opengem.config import ConfigError, apply_overrides
from opengem.data.batch import collate
from opengem.evaluation.evaluate import evaluate_run, held_out_evaluator
from opengem.evaluation.recalibrate import fit_offsets, recalibrate_run
from opengem.model.build import build_gem, materialize
from opengem.model.heads import Heads, HeadsConfig
from opengem.model.logit_shift import (
    LogitShift,
    RecalibrationError,
    downsampling_offsets,
    shift_logits,
)
from opengem.recipes import recipe
from opengem.run import DOWNSAMPLING_FILE, load_run_model
from opengem.testing import random_table, tiny_schema
from opengem.train.trainer import continue_training, train
from opengem.world.generate import generate
from opengem.world.presets import world_config

LOG = math.log


def test_offsets_go_on_the_base_task_only_when_conversion_is_chained():
    schema = tiny_schema()
    chained = Heads(8, schema, HeadsConfig())
    got = downsampling_offsets(chained, schema, {"d0": 0.5, "d1": 0.1})
    assert torch.allclose(got,
                          torch.tensor([[LOG(0.5), 0.0], [LOG(0.1), 0.0]], dtype=torch.float64))
    # both tasks their own: both shifted
    plain = Heads(8, schema, HeadsConfig(chain_required=False))
    assert torch.allclose(downsampling_offsets(plain, schema, {"d0": 0.5, "d1": 0.5}),
                          torch.full((2, 2), LOG(0.5), dtype=torch.float64))
    shared = Heads(8, schema, HeadsConfig(domain_mode="shared"))
    assert downsampling_offsets(shared, schema, {"d0": 0.2, "d1": 0.2}).shape == (1, 2)
    with pytest.raises(RecalibrationError, match="domain_mode=output"):
        downsampling_offsets(shared, schema, {"d0": 0.2, "d1": 0.5})


def test_the_offset_is_q_equals_p_over_p_plus_1_minus_p_over_w_with_w_the_rate():
    p = torch.linspace(0.001, 0.999, 101, dtype=torch.float64)
    for r in (1.0, 0.5, 0.1):
        q = p / (p + (1 - p) / r)  # w = r; with w = 1/r the same formula would inflate p instead
        assert torch.allclose(torch.sigmoid(torch.logit(p) + LOG(r)), q, atol=1e-12)
        assert (q <= p).all()


def test_shift_of_chained_logits_is_the_chain_of_shifted_own_logits():
    heads = Heads(8, tiny_schema(), HeadsConfig())
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(500, 2, generator=g, dtype=torch.float64) * 2 - 1
    delta = torch.randn(500, 2, generator=g, dtype=torch.float64)
    got = shift_logits(heads.chain(raw), delta, heads.parent)
    assert torch.allclose(got, heads.chain(raw + delta), atol=1e-9)


def _world(n=200_000, r=0.1, seed=0):
    """Clicks and chained conversions from known logits; the down-sampled rows (negatives of click
    at r)."""
    g = torch.Generator().manual_seed(seed)
    own = torch.stack([torch.randn(n, generator=g) * 0.8 - 2.5,
                       torch.randn(n, generator=g) * 0.5 - 2.0], 1)
    click = torch.bernoulli(torch.sigmoid(own[:, 0]), generator=g)
    conv = click * torch.bernoulli(torch.sigmoid(own[:, 1]), generator=g)
    # a row with conv = 1 has click = 1: never dropped
    keep = (click == 1) | (torch.rand(n, generator=g) < r)
    return click, conv, keep


def test_a_model_fitted_on_downsampled_rows_is_calibrated_after_the_correction():
    """A constant model (one bias per task, through the heads' chain) fitted by log loss on rows
    whose click negatives were kept at r = 0.1: with log r on click's own logit and 0 on
    conversion's conditional, its mean predictions are the true rates; shifting conversion as
    well (the wrong derivation) under-predicts it by about r."""
    r = 0.1
    heads = Heads(8, tiny_schema(num_domains=1), HeadsConfig())
    click, conv, keep = _world(r=r)
    m = int(keep.sum())
    rows = {"raw": torch.zeros(m, 2, dtype=torch.float64),
            "group": torch.zeros(m, dtype=torch.long),
            "labels": torch.stack([click[keep], conv[keep]], 1).double(),
            "mask": torch.ones(m, 2, dtype=torch.bool),
            "weights": torch.ones(m, dtype=torch.float64)}
    fitted = fit_offsets(heads, rows, 1, prior_std=1e3)  # [1, 2]: the constant model's own logits
    schema = tiny_schema(num_domains=1)
    delta = downsampling_offsets(heads, schema, {"d0": r})
    p_raw = torch.sigmoid(heads.chain(fitted))[0]
    p = torch.sigmoid(heads.chain(fitted + delta))[0]
    wrong = torch.sigmoid(heads.chain(fitted + math.log(r)))[0]
    true = torch.stack([click.mean(), conv.mean()]).double()
    assert torch.allclose(p, true, rtol=0.04), (p, true)
    assert p_raw[0] > 3 * true[0]  # uncorrected: odds × 1/r
    assert wrong[1] < 0.5 * true[1]


def test_evaluation_wrapper_and_folded_biases_score_the_same():
    """LogitShift (the trainer's held-out evaluations) and the offsets added to ``heads.out_b``
    (``load_run_model``: evaluation, export, serving, teachers) give the same scores."""
    schema = tiny_schema()
    model = materialize(build_gem(schema, recipe("tiny").model), "cpu", 0, [0.1, 0.01]).eval()
    batch = collate(random_table(schema, 64, seed=3), schema)
    delta = downsampling_offsets(model.heads, schema, {"d0": 0.5, "d1": 0.1})
    folded = copy.deepcopy(model)
    with torch.no_grad():
        folded.heads.out_b.add_(delta.to(folded.heads.out_b.dtype))
        a = torch.sigmoid(LogitShift(model, delta)(batch).double())
        b = torch.sigmoid(folded(batch).double())
        plain = torch.sigmoid(model(batch).double())
    assert (a - b).abs().max() < 1e-5
    assert (a - plain).abs().max() > 1e-2


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    data = tmp_path_factory.mktemp("ds") / "data"
    generate(world_config("tiny", seed=3), data, progress=False)
    return data


def test_a_downsampled_run_is_recorded_and_corrected_everywhere(world, tmp_path):
    steps = 12
    cfg = apply_overrides(recipe("tiny"),
                          ["data.negative_rate=0.3", f"train.max_steps={steps}", "train.threads=1",
                                           "train.progress=false", f"train.eval_at={steps}",
                           "optim.warmup_steps=2"])
    final = train(cfg, world, tmp_path / "run", evaluator=held_out_evaluator(world, "valid"))
    rec = json.loads((tmp_path / "run" / DOWNSAMPLING_FILE).read_text())
    assert final["downsampling"] == rec and rec["rates"] == {d: 0.3 for d in rec["rates"]}
    assert (
        rec["offsets"]["feed/click"] == pytest.approx(LOG(0.3))
        and rec["offsets"]["feed/conversion"] == 0
    )
    assert rec["weights"]["feed"] == pytest.approx(1 / 0.3) and rec["exact"] is True
    read, kept = rec["rows_read_per_epoch"], rec["rows_kept_per_epoch"][0]
    assert kept < 0.5 * read and final["examples"] <= kept
    base = json.loads((tmp_path / "run" / "base_rates.json").read_text())
    assert base["click"] == rec["train_base_rates"]["click"] < rec["sampled_base_rates"]["click"]
    # the in-training evaluation (LogitShift) and evaluate_run (biases folded, as served) agree
    during = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if "eval" in x]
    after = evaluate_run(tmp_path / "run", world, "valid", progress=False)["metrics"]
    for key in ("all/click", "all/conversion"):
        for m in ("ne", "calibration"):
            assert during[-1]["eval"][key][m] == pytest.approx(after[key][m], abs=1e-5)
        # NE keeps the true rate
        assert after[key]["base_rate"] == pytest.approx(base[key.split("/")[1]])
    corrected, _, _ = load_run_model(tmp_path / "run", recalibrated=False)
    raw, _, _ = load_run_model(tmp_path / "run", recalibrated=False, corrected=False)
    diff = (corrected.heads.out_b - raw.heads.out_b).detach().double()
    assert (
        torch.allclose(diff[:, 0], torch.full_like(diff[:, 0], LOG(0.3)), atol=1e-6)
        and diff[:, 1].abs().max() == 0
    )
    # the recalibration is fitted on top of the corrected model, and both reach what is served
    by_domain = evaluate_run(tmp_path / "run", world, "valid", progress=False)
    rec = recalibrate_run(tmp_path / "run", world, "valid", progress=False)
    assert by_domain["downsampling"]["rates"] == {d: 0.3 for d in rec_domains(by_domain)}
    for key, cal in rec["calibration_before"].items():
        assert cal == pytest.approx(by_domain["metrics"][key]["calibration"], abs=2e-4)
    served, _, _ = load_run_model(tmp_path / "run")
    total = (served.heads.out_b - raw.heads.out_b).detach().double()
    delta = torch.tensor([[rec["offsets"][f"{d}/{t}"] for t in ("click", "conversion")]
                          for d in rec_domains(by_domain)], dtype=torch.float64)
    assert torch.allclose(total, diff + delta, atol=1e-5)


def rec_domains(evaluation: dict) -> list[str]:
    return list(evaluation["downsampling"]["rates"])


@pytest.mark.parametrize("overrides, match", [
    (["model.heads.domain_mode=shared", 'data.negative_rate_by_domain={"feed": 0.5}'],
     "domain_mode=output"),
    (['data.negative_rate_by_domain={"nowhere": 0.5}'], "unknown domain 'nowhere'"),
])
def test_a_correction_that_cannot_be_made_stops_training_before_it_starts(
    world, tmp_path, overrides, match
):
    cfg = apply_overrides(recipe("tiny"),
                          ["data.negative_rate=0.3", "train.max_steps=2", "train.progress=false",
                                           *overrides])
    with pytest.raises(ConfigError, match=match):
        train(cfg, world, tmp_path / "run")
    assert not (tmp_path / "run" / "final.json").exists()


def test_continuous_training_refuses_down_sampling(world, tmp_path):
    """DayStream reads every row: a down-sampled stream, or continuing a down-sampled run (whose
    correction would then be applied to a model trained on all rows), is a clear error."""
    base = ["train.progress=false", "train.threads=1", "data.negative_rate=0.5"]
    with pytest.raises(ConfigError, match="continuous training"):
        train(apply_overrides(recipe("tiny"), base), world, tmp_path / "s", days=[0])
    assert not (tmp_path / "s" / "config.json").exists()
    train(apply_overrides(recipe("tiny"), [*base, "train.max_steps=2"]), world, tmp_path / "run")
    with pytest.raises(ConfigError, match="continuous training"):
        continue_training(tmp_path / "run", world, [2], ["data.negative_rate=1"])
