"""benchmarks/heldout_demo.py --tune: chooses on valid of development worlds only, each trial
run once."""

import importlib.util
import sys
from pathlib import Path

import pytest
from instruments.tune import Trial

from opengem.data.parquet import MANIFEST

HELDOUT_DEMO = Path(__file__).resolve().parents[2] / "benchmarks" / "heldout_demo.py"


def _heldout_demo():
    spec = importlib.util.spec_from_file_location("heldout_demo_bench", HELDOUT_DEMO)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_tune_refuses_held_out_worlds_and_reuses_its_trials(tmp_path, monkeypatch):
    h = _heldout_demo()
    with pytest.raises(SystemExit, match="development worlds"):
        h.tune_world(tmp_path, 1000)

    calls = []

    def fake_generate(world, out, **_):
        out.mkdir(parents=True)
        (out / MANIFEST).write_text("{}")

    def fake_train_point(cfg, data, run, point, max_epochs=1):
        calls.append((point, max_epochs, cfg.model.embedding_dim))
        # the demo recipe, rates set by train_point
        assert cfg.optim.lr == 3e-3 and cfg.train.ema_decay == 0.99
        # world 1 prefers the smaller dense lr a little less than world 0 prefers the larger: the
        # mean decides
        world = int(Path(data).parent.name.split("-")[1])
        click = (
            0.75
            - (0.004 if (world, point[0]) == (0, 6e-3) else 0.0)
            - (0.003 if (world, point[0]) == (1, 3e-3) else 0.0)
        )
        return Trial(point, click, 10, {"all/conversion": {"ne": 0.7}}, str(run), 1.0)

    monkeypatch.setattr("opengem.world.generate.generate", fake_generate)
    monkeypatch.setattr("instruments.tune.train_point", fake_train_point)
    grid = ((3e-3, 0.3), (6e-3, 0.3))
    out = h.tune(tmp_path, [0, 1], grid)
    assert out["chosen"] == [6e-3, 0.3]
    assert (
        out["grid"][1]["click_ne"] == pytest.approx([0.746, 0.75])
        and out["grid"][1]["conversion_ne_mean"] == 0.7
    )
    assert len(calls) == 4
    # every trial read back, none trained again
    assert h.tune(tmp_path, [0, 1], grid) == out and len(calls) == 4
    h.tune(tmp_path, [0], grid[:1], epochs=2)
    assert calls[-1] == ((3e-3, 0.3), 2, 32) and len(calls) == 5  # more epochs: another trial
    out = h.tune(tmp_path, [0], grid[:1], overrides=("model.embedding_dim=48",))
    assert (
        calls[-1] == ((3e-3, 0.3), 1, 48)
        and len(calls) == 6
        and out["overrides"] == ["model.embedding_dim=48"]
    )


def test_a_point_outside_tune_is_refused_not_ignored(monkeypatch):
    h = _heldout_demo()
    monkeypatch.setattr(sys, "argv", ["heldout_demo.py", "--point", "0.006", "0.3"])
    with pytest.raises(SystemExit, match="--point is a --tune trial"):
        h.main()
