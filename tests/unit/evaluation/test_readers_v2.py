"""The evaluation readers that open shard files themselves (the signal decomposition, the oracle
refit) give the same numbers on a v2 world as on the v1 world of the same config."""

import pytest

from opengem.cli import main
from opengem.data.parquet import LAYOUT_V2, DatasetManifest
from opengem.features.schema import FeatureSchema
from opengem.testing import TrueLogits
from opengem.world.generate import _plain, generate
from opengem.world.oracle import OracleCollector, refit
from opengem.world.presets import world_config
from opengem.world.signal import signal_decomposition


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    root = tmp_path_factory.mktemp("readers")
    cfg = world_config("tiny", 3, ["sizes.num_users=600"])
    out = {}
    for layout in ("v1", "v2"):
        m = generate(cfg, root / layout, progress=False, layout=layout, observer=OracleCollector)
        out[layout] = (root / layout, m)
    assert out["v2"][1].layout == LAYOUT_V2
    return out


def test_oracle_refit_reads_v2(worlds):
    (p1, m1), (p2, m2) = worlds["v1"], worlds["v2"]
    o = m2.source["stats"]["oracle"]
    assert o == m1.source["stats"]["oracle"]
    assert _plain(refit(p2)) == o == _plain(refit(p1))
    assert o["test"]["all/click"]["ne"] < 1  # a real oracle, not an empty one


def test_signal_decomposition_reads_v2(worlds):
    p1, p2 = worlds["v1"][0], worlds["v2"][0]
    schema = FeatureSchema.load(p2)
    a = signal_decomposition(TrueLogits(), schema, p1, "test")
    b = signal_decomposition(TrueLogits(), schema, p2, "test")
    assert a == b
    varying = [k for k, v in b["click"]["term_var"].items() if v > 1e-6]
    # the history terms were computed from joined rows
    assert {"sequence", "ads_history"} <= set(varying)
    assert all(abs(b["click"]["slopes"][k] - 1) < 1e-3 for k in varying)


def test_generate_cli_layout_flag(tmp_path):
    assert main(["--quiet", "generate", "--preset", "tiny", "--out", str(tmp_path / "v1"), "--seed",
                 "3", "--layout", "v1"]) == 0
    assert DatasetManifest.load(tmp_path / "v1").layout == 1
