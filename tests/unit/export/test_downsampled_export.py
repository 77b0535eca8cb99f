"""A run trained on down-sampled negatives serves corrected scores: the artifact
(``load_run_model``'s biases) gives logit + log r on click and the chained conversion that follows
from it, against the same run exported without its ``RUN/downsampling.json``."""

import shutil

import numpy as np
import torch

from opengem.config import apply_overrides
from opengem.export import Predictor
from opengem.export.artifact import export_run
from opengem.export.request import synthetic_request
from opengem.model.logit_shift import shift_logits
from opengem.recipes import recipe
from opengem.run import DOWNSAMPLING_FILE
from opengem.train.trainer import train
from opengem.world.generate import generate
from opengem.world.presets import world_config

RATE = 0.25


def _logits(p: Predictor, request: dict) -> torch.Tensor:
    # [C, T]
    probs = np.array([p.predict(request)["predictions"][t] for t in p.tasks], dtype=np.float64).T
    return torch.logit(torch.from_numpy(probs))


def test_served_scores_carry_the_correction(tmp_path):
    generate(world_config("tiny", seed=2), tmp_path / "data", progress=False)
    cfg = apply_overrides(recipe("tiny"),
                          [f"data.negative_rate={RATE}", "train.max_steps=6", "train.threads=1",
                                           "train.progress=false"])
    train(cfg, tmp_path / "data", tmp_path / "run")
    export_run(tmp_path / "run", tmp_path / "served", compile=False)
    shutil.copytree(tmp_path / "run", tmp_path / "raw_run")
    (tmp_path / "raw_run" / DOWNSAMPLING_FILE).unlink()
    export_run(tmp_path / "raw_run", tmp_path / "raw", compile=False)
    served, raw = Predictor(tmp_path / "served",
                            runtime="exported"), Predictor(tmp_path / "raw", runtime="exported")
    request = synthetic_request(served.schema, 12, 20, seed=4)
    z_served, z_raw = _logits(served, request), _logits(raw, request)
    delta = torch.tensor([[np.log(RATE), 0.0]], dtype=torch.float64).expand_as(z_raw)
    assert torch.allclose(z_served[:, 0] - z_raw[:, 0], delta[:, 0], atol=1e-4)
    assert torch.allclose(z_served, shift_logits(z_raw, delta, [-1, 0]), atol=1e-4)
