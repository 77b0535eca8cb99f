"""The auction replay on a synthetic world: the truth scored through the model path reaches the
ceiling exactly, the logged candidate's truth is the generator's, the market is the seed's,
a trained run beats random ranking and shows in the report, and bad inputs (K < S, another schema's run, non-synthetic
data) are refused by name."""

import json

import numpy as np
import pytest

from opengem.cli import main
from opengem.data.loader import read_split
from opengem.data.parquet import DatasetManifest
from opengem.features.schema import FeatureSchema
from opengem.testing import TrueLogits
from opengem.world.generate import columns_from_table, generate, world_from_manifest
from opengem.world.presets import world_config
from opengem.world.replay import (
    MarketConfig,
    candidate_table,
    draw_candidates,
    market_of,
    model_scorer,
    replay,
    true_by_slot,
)


@pytest.fixture(scope="module")
def world(tiny_v2_world):
    return tiny_v2_world


@pytest.fixture(scope="module")
def run(tiny_v2_run):
    return tiny_v2_run


def test_the_truth_through_the_model_path_is_the_ceiling(world):
    schema = FeatureSchema.load(world / "schema.json")
    out = replay(world, {"truth_model": model_scorer(TrueLogits(), schema)}, requests=300,
                 resamples=20)
    for m in ("clicks", "conversions", "spend", "value"):
        assert out["totals"]["truth_model"][m] == pytest.approx(out["totals"]["truth"][m],
                                                               rel=1e-9)
    assert out["totals"]["truth"]["conversions"] > out["totals"]["random"]["conversions"]
    assert out["totals"]["truth"]["value"] > out["totals"]["base_rates"]["value"]


def test_the_logged_candidate_has_the_generators_truth(world):
    manifest = DatasetManifest.load(world)
    w = world_from_manifest(manifest)
    schema = FeatureSchema.load(world / "schema.json")
    rows = read_split(world, schema, "test")
    c = columns_from_table(rows)
    ads = draw_candidates(w, c, 4, np.random.default_rng(0))
    assert (ads[:, 0] == c["ad_id"]).all()
    assert ((ads[:, 1:] >= 0) & (ads[:, 1:] < len(w.ad_campaign))).all()
    p = true_by_slot(w, candidate_table(w, schema, rows, ads), len(ads), 4, 3)
    at = c["position"] < 3  # the logged ad in its logged slot: the probability the log holds
    got = p[np.flatnonzero(at), 0, c["position"][at], 0]
    np.testing.assert_allclose(got, c["p_click"][at], rtol=1e-6)
    # the drawn candidates follow the targeting: most share the logged ad's live window
    launch = w.ad_launch[ads[:, 1:]]
    t = (c["request_ts"] - w.cfg.sizes.start_ts)[:, None]
    assert (launch <= t).mean() > 0.99


def test_the_market_is_the_data_seeds(world):
    w = world_from_manifest(DatasetManifest.load(world))
    bid, obj = market_of(w, MarketConfig())
    bid2, obj2 = market_of(w, MarketConfig())
    assert np.array_equal(bid, bid2) and np.array_equal(obj, obj2) and (bid > 0).all()
    assert 0.2 < obj.mean() < 0.8  # about half the campaigns optimise conversions
    # a conversion bid is about 1 / target_cvr of a click bid
    ratio = np.median(bid[obj == 1]) / np.median(bid[obj == 0])
    assert ratio == pytest.approx(1 / w.cfg.conversion.target_cvr, rel=0.5)


def test_a_trained_run_replays_from_the_command_line(world, run, tmp_path, capsys):
    out = tmp_path / "outcomes.json"
    assert main(["--quiet", "outcomes", "--run", str(run), "--data", str(world),
                 "--requests", "300", "--resamples", "20", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "auction replay" in text and "truth" in text
    got = json.loads(out.read_text())
    t = got["totals"]
    assert t["random"]["clicks"] < t["run"]["clicks"] <= t["truth"]["clicks"] * 1.01
    assert set(got["calibration_share"]["run"]) == {"conversions", "value"}
    assert got["vs_baseline"]["baseline"] == "run"
    ne = got["expected_ne"]
    assert ne["truth"]["click"] < ne["run"]["click"] and ne["truth"]["click"] < 1
    # the report shows the replay: its table and conversions against NE, one point per model
    report = tmp_path / "report"
    assert main(["--quiet", "report", "--run", str(run), "--out", str(report),
                 "--bench", str(out)]) == 0
    page = (report / "report.html").read_text()
    assert "Outcomes (auction replay)" in page and "run+recal" in page
    assert (report / "outcomes.png").stat().st_size > 0


def test_bad_inputs_are_refused(world, run, tmp_path, capsys):
    schema = FeatureSchema.load(world / "schema.json")
    with pytest.raises(ValueError, match="at least the slots"):
        replay(world, {"m": model_scorer(TrueLogits(), schema)}, market=MarketConfig(candidates=2,
                                                                                  slots=3))
    with pytest.raises(ValueError, match="own policies"):
        replay(world, {"truth": model_scorer(TrueLogits(), schema)})
    other = tmp_path / "other"
    generate(world_config("tiny", 4, ["sizes.num_users=300", "sizes.num_categories=7"]), other,
             progress=False, layout="v2")
    assert main(["--quiet", "outcomes", "--run", str(run), "--data", str(other)]) == 2
    assert "another schema" in capsys.readouterr().err
    # a dataset that is not a synthetic world has no truth to replay against
    m = DatasetManifest.load(world)
    (tmp_path / "plain").mkdir()
    m.source = {"kind": "import"}
    (tmp_path / "plain" / "dataset.json").write_text(json.dumps(m.to_dict()))
    (tmp_path / "plain" / "schema.json").write_text((world / "schema.json").read_text())
    with pytest.raises(ValueError, match="not a synthetic dataset"):
        replay(tmp_path / "plain", {"m": model_scorer(TrueLogits(), schema)})
