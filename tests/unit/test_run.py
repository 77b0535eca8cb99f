"""The run directory: files round-trip, a missing config or checkpoint is an error naming the run,
``load_run_model`` returns the checkpoint's model and adds the recalibration offsets
when present."""

import re

import pytest
import torch

from opengem.checkpoint import CheckpointError, checkpoint_dir, save_best, save_checkpoint
from opengem.model.build import build_gem, materialize
from opengem.model.heads import Heads, HeadsConfig
from opengem.model.logit_shift import RecalibrationError, offsets_tensor
from opengem.recipes import recipe
from opengem.run import (
    BASE_RATES_FILE,
    CONFIG_FILE,
    FINAL_FILE,
    RECALIBRATION_FILE,
    SCHEMA_FILE,
    apply_recalibration,
    load_base_rates,
    load_config,
    load_final,
    load_recalibration,
    load_run_model,
    load_schema,
    save_base_rates,
    save_config,
    save_final,
    save_recalibration,
    save_schema,
    use_best,
)
from opengem.testing import tiny_schema

RATES = {"click": 0.1, "d0/click": 0.12, "conversion": 0.01}


def _run(path, checkpoint=True):
    """A run directory as training leaves it (config, schema, base rates, one checkpoint), no
    data needed."""
    cfg, schema = recipe("tiny"), tiny_schema()
    save_config(path, cfg)
    save_schema(path, schema)
    save_base_rates(path, RATES)
    model = materialize(build_gem(schema, cfg.model), "cpu", seed=3, base_rates=[0.1, 0.01])
    if checkpoint:
        save_checkpoint(path, 1, model, [],
                        {"schema": schema.fingerprint(), "step": 1, "examples": 0})
    return model, cfg, schema


def test_files_round_trip(tmp_path):
    _, cfg, schema = _run(tmp_path, checkpoint=False)
    assert load_config(tmp_path) == cfg
    assert load_schema(tmp_path).fingerprint() == schema.fingerprint()
    assert load_base_rates(tmp_path) == RATES
    assert load_final(tmp_path) is None and load_recalibration(tmp_path) is None  # not written yet
    save_final(tmp_path, {"steps": 4, "checkpoint": "step-00000004"})
    assert load_final(tmp_path) == {"steps": 4, "checkpoint": "step-00000004"}
    record = {"split": "valid", "offsets": {"d1/click": 0.2, "d0/click": -0.1}}
    save_recalibration(tmp_path, record)
    assert load_recalibration(tmp_path) == record
    # written in the fitting's order
    assert list(load_recalibration(tmp_path)["offsets"]) == ["d1/click", "d0/click"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [BASE_RATES_FILE, CONFIG_FILE, FINAL_FILE, RECALIBRATION_FILE, SCHEMA_FILE])  # no .tmp left


def test_missing_config_or_checkpoint_names_the_run(tmp_path):
    with pytest.raises(CheckpointError,
                       match=re.escape(f"{tmp_path}: no {CONFIG_FILE} (not a training run")):
        load_run_model(tmp_path)
    _run(tmp_path, checkpoint=False)
    with pytest.raises(CheckpointError,
                       match=re.escape(f"{tmp_path}: no checkpoint (did training finish?)")):
        load_run_model(tmp_path)
    with pytest.raises(CheckpointError,
                       match=re.escape(f"{tmp_path / 'elsewhere'}: no {BASE_RATES_FILE}")):
        load_base_rates(tmp_path / "elsewhere")


def test_load_run_model_adds_the_recalibration_when_present(tmp_path):
    trained, cfg, schema = _run(tmp_path)
    assert (checkpoint_dir(tmp_path) / "LATEST").exists()
    model, got_cfg, got_schema = load_run_model(tmp_path)
    assert (
        not model.training and got_cfg == cfg and got_schema.fingerprint() == schema.fingerprint()
    )
    want = trained.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())

    save_recalibration(tmp_path, {"offsets": {"d0/click": 0.5, "d1/conversion": -0.25}})
    shifted = load_run_model(tmp_path)[0].heads.out_b - trained.heads.out_b
    assert torch.allclose(shifted, torch.tensor([[0.5, 0.0], [0.0, -0.25]]))
    raw = load_run_model(tmp_path, recalibrated=False)[0]
    # the checkpoint itself is never changed
    assert torch.equal(raw.heads.out_b, trained.heads.out_b)


def test_best_means_the_kept_best_else_the_last(tmp_path, caplog):
    """``--checkpoint best`` on a run that kept no best reads the last; once it kept one, the best.
    Offsets fitted on one checkpoint and added to the other still apply, with a warning."""
    trained, cfg, schema = _run(tmp_path)
    assert not use_best(tmp_path, "best") and not use_best(tmp_path, "last")
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        use_best(tmp_path, "first")
    kept = materialize(build_gem(schema, cfg.model), "cpu", seed=4, base_rates=[0.1, 0.01])
    save_best(tmp_path, kept, {"schema": schema.fingerprint(), "step": 1, "examples": 0})
    assert use_best(tmp_path, "best") and not use_best(tmp_path, "last")
    assert torch.equal(load_run_model(tmp_path, best=True)[0].heads.out_w, kept.heads.out_w)
    assert torch.equal(load_run_model(tmp_path)[0].heads.out_w, trained.heads.out_w)
    # no "checkpoint": fitted on the last
    save_recalibration(tmp_path, {"offsets": {"d0/click": 0.5}})
    with caplog.at_level("WARNING", logger="opengem.run"):
        load_run_model(tmp_path)
        assert not [r for r in caplog.records if r.name == "opengem.run"]
        shifted = load_run_model(tmp_path, best=True)[0].heads.out_b - kept.heads.out_b
    assert "fitted on the last checkpoint, added here to the best one" in caplog.text
    assert torch.allclose(shifted, torch.tensor([[0.5, 0.0], [0.0, 0.0]]))


def test_offsets_are_validated():
    schema = tiny_schema()
    heads = Heads(8, schema, HeadsConfig())
    t = offsets_tensor(heads, {"d1/conversion": 0.25, "d0/click": -0.5}, schema)
    assert t.tolist() == [[-0.5, 0.0], [0.0, 0.25]]
    with pytest.raises(RecalibrationError, match="unknown slice 'd7/click'"):
        offsets_tensor(heads, {"d7/click": 1.0}, schema)


def test_apply_recalibration(tmp_path):
    schema = tiny_schema()
    holder = torch.nn.Module()
    holder.heads = Heads(8, schema, HeadsConfig())
    before = holder.heads.out_b.detach().clone()
    assert apply_recalibration(holder, tmp_path, schema) is None  # no file: unchanged
    assert torch.equal(holder.heads.out_b, before)
    save_recalibration(tmp_path, {"offsets": {"d0/click": 0.5}})
    assert apply_recalibration(holder, tmp_path, schema)["offsets"] == {"d0/click": 0.5}
    assert torch.allclose(holder.heads.out_b - before, torch.tensor([[0.5, 0.0], [0.0, 0.0]]))
    with pytest.raises(RecalibrationError, match="no GEM heads"):
        apply_recalibration(torch.nn.Linear(2, 2), tmp_path, schema)


def test_a_platt_record_is_folded_into_heads_and_shortcut(tmp_path):
    """A slope per task scales the heads' output weights and bias and the shortcut's weights of that
    task: the folded model's logits equal chain(a · raw + offsets) of the unfolded one."""
    from opengem.data.batch import collate
    from opengem.testing import random_table

    cfg, schema = recipe("tiny"), tiny_schema()
    save_config(tmp_path, cfg)
    save_schema(tmp_path, schema)
    save_base_rates(tmp_path, RATES)
    model = materialize(build_gem(schema, cfg.model), "cpu", seed=3, base_rates=[0.1, 0.01])
    assert model.shortcut is not None and model.shortcut.pairs is not None
    # a trained shortcut: non-zero weights, or scaling them would test nothing
    with torch.no_grad():
        model.shortcut.linear.weight.normal_(std=0.3)
        model.shortcut.pairs.weight.normal_(std=0.3)
    save_checkpoint(tmp_path, 1, model, [],
                    {"schema": schema.fingerprint(), "step": 1, "examples": 0})
    batch = collate(random_table(schema, 64, seed=5), schema)
    raw_model = load_run_model(tmp_path)[0]
    seen = []
    hook = raw_model.heads.register_forward_hook(lambda m, args, out: seen.append(args))
    with torch.no_grad():
        raw_model(batch)
        hook.remove()
        feats, domain, shortcut = seen[0]
        assert shortcut.abs().max() > 0.1
        raw = raw_model.heads.raw_logits(feats, domain, shortcut).double()
    a = torch.tensor([0.6, 1.3], dtype=torch.float64)
    add = torch.tensor([[0.2, -0.1], [-0.3, 0.4]], dtype=torch.float64)
    save_recalibration(tmp_path,
                       {"offsets": {"d0/click": 0.2, "d0/conversion": -0.1, "d1/click": -0.3,
                                              "d1/conversion": 0.4},
                        "slopes": {"click": 0.6, "conversion": 1.3}})
    with torch.no_grad():
        got = load_run_model(tmp_path)[0](batch).double()
        want = raw_model.heads.chain(raw * a + add[raw_model.heads.output_group(batch.domain)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    save_recalibration(tmp_path, {"offsets": {}, "slopes": {"click": 0.0}})
    with pytest.raises(RecalibrationError, match="slope 'click'"):
        load_run_model(tmp_path)
