"""Occlusion explanations (``opengem.evaluation.explain``): on synthetic worlds where one effect is
planted strong, the world's own truth explained as a model puts that group first on most rows; a
trained run is explained end to end from the command line (and summarised by the report), its event and stream effects are what a
direct re-score of the edited row gives; bad inputs are refused by name."""

import json
import shutil

import numpy as np
import pyarrow as pa
import pytest

from opengem.cli import main
from opengem.data.parquet import DatasetManifest
from opengem.evaluation.explain import (
    background_rows,
    explain_rows,
    parse_rows,
    read_rows,
    table_scorer,
)
from opengem.features.schema import FeatureSchema
from opengem.run import load_run_model
from opengem.world.generate import columns_from_table, generate, world_from_manifest
from opengem.world.latent import probabilities
from opengem.world.presets import world_config

# every other effect of the tiny world turned down, so the planted one stands out
QUIET = ["sizes.num_users=400", "click.beta_position=0.1", "click.beta_surface_format=0.2",
         "click.advertiser_sigma=0.1", "click.beta_novelty=0.1", "click.beta_age_format=0.1",
         "click.beta_country_cluster=0.1", "click.beta_device=0.2", "click.beta_hour=0.05",
         "click.beta_ads=0.2"]
ROWS = list(range(300))


def _truth(data):
    """The world's true logits of any rows, as a ``table → logits`` model."""
    world = world_from_manifest(DatasetManifest.load(data))

    def score(table: pa.Table) -> np.ndarray:
        p_click, p_cvr, _, _ = probabilities(world, columns_from_table(table))
        p = np.clip(np.stack([p_click, p_click * p_cvr], 1), 1e-12, 1 - 1e-12)
        return np.log(p) - np.log1p(-p)
    return score


def _explain_truth(tmp_path, overrides):
    data = tmp_path / "data"
    generate(world_config("tiny", 3, [*QUIET, *overrides]), data, progress=False, layout="v2")
    schema = FeatureSchema.load(data / "schema.json")
    return explain_rows(_truth(data), schema, read_rows(data, schema, "test", ROWS),
                        background_rows(data, schema), row_ids=ROWS)


def _first(ex, task):
    return np.asarray(ex.groups)[ex.ranking(task)]


def test_a_planted_interaction_ranks_first(tmp_path):
    """segment × category strong: one of the pair is the largest contribution on 98 % of rows for
    click and 93 % for conversion (measured, 300 test rows)."""
    ex = _explain_truth(tmp_path, ["click.beta_segment_category=3", "click.beta_seq=0.3"])
    assert np.isin(_first(ex, "click"), ["segment", "category"]).mean() >= 0.9
    assert np.isin(_first(ex, "conversion"), ["segment", "category"]).mean() >= 0.8
    assert ex.features_available and ex.background_rows == 16


def test_a_planted_history_effect_ranks_first(tmp_path):
    """The organic stream strong (a time-decayed share of recent events in the candidate's
    category): the stream, or the category it is matched against, is first on 90 % of rows
    (measured); the stream alone is the most frequent first group and is first on 69 % of the rows
    where it moves the logit at all (a row whose history holds nothing of the category: the term
    is 0, and the category's mismatch is the reason)."""
    ex = _explain_truth(tmp_path, ["click.beta_seq=15", "click.beta_segment_category=0.1",
                                   "click.ad_sigma=0.02", "click.campaign_sigma=0.02"])
    first = _first(ex, "click")
    assert np.isin(first, ["organic", "category"]).mean() >= 0.8
    groups, counts = np.unique(first, return_counts=True)
    assert groups[counts.argmax()] == "organic"
    active = np.abs(ex.contributions[:, ex.groups.index("organic"), 0]) > 1e-9
    assert (first[active] == "organic").mean() >= 0.55


# ---------------------------------------------------------------------------------- a trained run
@pytest.fixture(scope="module")
def world(tiny_v2_world):
    return tiny_v2_world


@pytest.fixture(scope="module")
def run(tiny_v2_run):
    return tiny_v2_run


def _row_with_history(world, schema, n=40):
    t = read_rows(world, schema, "test", list(range(n)))
    lengths = [len(x) for x in t.column("organic.item").to_pylist()]
    return int(np.argmax(lengths)), t


def test_the_cli_explains_a_trained_run(world, run, tmp_path, capsys):
    out = tmp_path / "ex.json"
    assert main(["--quiet", "explain", "--run", str(run), "--data", str(world), "--rows", "0-2,7",
                 "--json", str(out)]) == 0
    ex = json.loads(out.read_text())
    assert [r["row"] for r in ex["rows"]] == [0, 1, 2, 7]
    for r in ex["rows"]:
        for c in r["groups"].values():
            assert all(np.isfinite(v) for v in c.values())
        assert set(r["sides"]) == {"user", "ad", "context"}
        assert all(len(e) <= 5 for e in r["events"].values())
    assert ex["forwards_per_row"] > 16 and ex["ms_per_row"] > 0
    assert "row 7 click" in capsys.readouterr().out
    # the report's summary of them: every group, its mean |contribution| per task
    assert main(["--quiet", "report", "--run", str(run), "--bench", str(out),
                 "--out", str(tmp_path / "report")]) == 0
    html = (tmp_path / "report" / "report.html").read_text()
    assert "<h2>Explanations</h2>" in html or "Explanations</h2>" in html
    assert all(f"<td>{g}</td>" in html for g in ex["kinds"])


def test_event_and_stream_effects_are_direct_rescores(world, run):
    model, _, schema = load_run_model(run)
    i, table = _row_with_history(world, schema)
    row = table.slice(i, 1)
    ex = explain_rows(model, schema, row, None, k=3)
    score = table_scorer(model, schema)
    base = score(row)[0]
    # equal up to float32 rounding: a batch of other rows may sum in another order (one ulp seen)
    assert np.allclose(ex.logits[0], base, rtol=0, atol=1e-6)
    plain = row.to_pylist()[0]
    for j, s in enumerate(schema.sequences):
        cols = [c for c in plain if c.startswith(f"{s.name}.")]
        empty = pa.Table.from_pylist([{**plain, **{c: [] for c in cols}}], schema=row.schema)
        assert np.allclose(ex.contributions[0, ex.groups.index(s.name)], base - score(empty)[0],
                           rtol=0, atol=1e-6)
        events = ex.events[0][s.name]
        assert len(events) == min(3, len(plain[s.item_column]))
        for e in events:
            cut = {c: plain[c][:e["index"]] + plain[c][e["index"] + 1:] for c in cols}
            z = score(pa.Table.from_pylist([{**plain, **cut}], schema=row.schema))[0]
            assert plain[s.item_column][e["index"]] == e["item"]
            assert np.allclose([e["effect"][t] for t in ex.tasks], base - z, rtol=0, atol=1e-6)
    assert not ex.features_available and ex.groups == [s.name for s in schema.sequences]
    assert ex.to_dict()["rows"][0]["sides"] == {}  # nothing measured, nothing written (no NaN)
    assert "features unavailable" in ex.notes[0]


def test_the_features_of_a_trained_run_are_finite_and_the_background_is_fixed(world, run):
    model, _, schema = load_run_model(run)
    rows = read_rows(world, schema, "test", [0, 1])
    a = explain_rows(model, schema, rows, background_rows(world, schema, 8, seed=1))
    b = explain_rows(model, schema, rows, background_rows(world, schema, 8, seed=1))
    assert np.isfinite(a.contributions).all() and np.isfinite(a.sides).all()
    assert np.array_equal(a.contributions, b.contributions)
    assert schema.domains.column not in a.groups


# ---------------------------------------------------------------------------------- bad input
def test_a_run_of_another_schema_is_refused_by_name(world, run, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(world, other)
    spec = json.loads((other / "schema.json").read_text())
    spec["sparse"][0]["vocab_size"] += 1
    (other / "schema.json").write_text(json.dumps(spec))
    assert main(["--quiet", "explain", "--run", str(run), "--data", str(other),
                 "--rows", "0"]) == 2
    assert "another schema" in capsys.readouterr().err


def test_an_unknown_row_is_refused_by_name(world, run, capsys):
    assert main(["--quiet", "explain", "--run", str(run), "--data", str(world),
                 "--rows", "0,99999999"]) == 2
    err = capsys.readouterr().err
    assert "row 99999999 is not a row of split 'test'" in err
    assert main(["--quiet", "explain", "--run", str(run), "--data", str(world)]) == 2
    assert "--rows or --sample" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not a row index"):
        parse_rows("3,x")
