"""The signal decomposition: a model that outputs the true logits has slope 1 on every term."""

import numpy as np
import pytest

from opengem.cli import main
from opengem.features.schema import FeatureSchema
from opengem.testing import TrueLogits
from opengem.world.signal import signal_decomposition, term_slopes


def test_term_slopes_recover_known_mix():
    rng = np.random.default_rng(0)
    terms = {"a": rng.normal(size=5000), "b": rng.normal(size=5000) * 2, "c": rng.normal(size=5000)}
    z = 1.0 + 1.0 * terms["a"] + 0.5 * terms["b"] + 0.0 * terms["c"]
    out = term_slopes(z, terms)
    assert out["slopes"] == pytest.approx({"a": 1.0, "b": 0.5, "c": 0.0}, abs=1e-6)
    assert out["term_var"]["b"] == pytest.approx(4.0, rel=0.1)




def test_true_logits_have_slope_one_on_every_term(tmp_path):
    data = tmp_path / "data"
    assert main(["--quiet", "generate", "--preset", "tiny", "--out", str(data), "--seed", "3"]) == 0
    schema = FeatureSchema.load(data)
    out = signal_decomposition(TrueLogits(), schema, data, "test")
    for part in ("click", "conversion_given_click"):
        slopes = out[part]["slopes"]
        varying = [k for k, v in out[part]["term_var"].items() if v > 1e-6]
        assert varying and all(abs(slopes[k] - 1) < 1e-3 for k in varying), (part, slopes)
        assert out[part]["corr"] > 0.999
