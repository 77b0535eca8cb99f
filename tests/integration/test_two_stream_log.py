"""A log of two behaviour streams from two events tables, through the whole chain: ``opengem
import --source generic`` → ``validate`` → ``train`` (tiny, ``model.target_match_items``) →
``export`` → ``history-store``; requests that give only the user id score as the same requests with their
histories inline, the organic stream's dwell seconds (a per-event value) included. The log and
spec are ``examples/two_streams.py``'s, so the example's are exercised too."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
from _examples import load_example

from opengem.cli import main
from opengem.data.events import ShardReader
from opengem.data.parquet import LAYOUT_V2, DatasetManifest
from opengem.export import Predictor
from opengem.export.history import ArrowHistoryStore
from opengem.export.request import Limits, history_columns, split_row
from opengem.features.schema import FeatureSchema

pytest.importorskip("duckdb")

TOL = 1e-6


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    example = load_example("two_streams")
    root = tmp_path_factory.mktemp("two_streams")
    log = example.write_log(root / "log", users=30, impressions=300, seed=3)
    data, run, art, store = (root / x for x in ("data", "run", "artifact", "history"))
    assert main(["--quiet", "import", "--source", "generic", "--in", str(log), "--spec",
                 str(log / "spec.json"), "--out", str(data)]) == 0
    assert main(["--quiet", "validate", str(data)]) == 0  # warns: ids first seen after train
    assert main(["--quiet", "train", "--recipe", "tiny", "--data", str(data), "--out", str(run),
                 "train.max_steps=3", "data.batch_size=32", "model.target_match_items=true"]) == 0
    assert main(["--quiet", "export", "--run", str(run), "--out", str(art), "--no-compile"]) == 0
    assert main(["--quiet", "history-store", "--data", str(data), "--out", str(store)]) == 0
    schema = FeatureSchema.load(data)
    predictor = Predictor(art, history=ArrowHistoryStore(store, schema))  # its exported program
    return SimpleNamespace(data=data, artifact=art, schema=schema, predictor=predictor)


def test_both_streams_are_imported_and_served_with_their_id_spaces(chain):
    m, schema = DatasetManifest.load(chain.data), chain.schema
    assert m.layout == LAYOUT_V2 and set(m.events) == {"organic", "ad_clicks"}
    organic, ads = schema.stream("organic"), schema.stream("ad_clicks")
    assert organic.matches is None and ads.matches == "ad_id"
    assert [(a.name, a.matches) for a in organic.attributes] == [("content_category", "category")]
    assert [(a.name, a.matches) for a in ads.attributes] == [("advertiser", "advertiser")]
    assert organic.values == ("dwell",) and ads.values == ()
    st = m.source["storage"]["streams"]["organic"]  # views without a dwell: dropped, counted
    assert st["dwell_missing_or_non_finite"] == st[
        "events_with_missing_or_non_finite_values_dropped"] > 0
    assert chain.predictor.schema.fingerprint() == schema.fingerprint()
    assert chain.predictor.runtime == "exported"
    cfg = json.loads((chain.artifact / "config.json").read_text())
    assert cfg["model"]["target_match_items"] is True


def _requests(chain, n=10):
    """Test rows as the training loader joins them, the longest histories first (organic's exceed
    the recent window), each a request with the ads of other rows as candidates."""
    m, schema = DatasetManifest.load(chain.data), chain.schema
    rows = ShardReader(chain.data, m, schema).read(m.split_files("test")[0],
                                                   schema.columns()).to_pylist()
    rows.sort(key=lambda r: -(len(r["organic.ts"]) + len(r["ad_clicks.ts"])))
    out = []
    for k, row in enumerate(rows[:n]):
        req, _ = split_row(schema, row)
        req["candidates"] = [split_row(schema, r)[1] for r in rows[k:k + 6]]
        out.append(req)
    return out


def test_scores_by_user_id_equal_scores_with_inline_histories(chain):
    schema, p = chain.schema, chain.predictor
    reqs = _requests(chain)
    assert min(len(r["ad_clicks.ts"]) for r in reqs) > 0
    assert max(len(r["organic.ts"]) for r in reqs) > json.loads(
        (chain.artifact / "manifest.json").read_text())["layout"]["recent_len"]
    worst = 0.0
    for full in reqs:
        bare = {k: v for k, v in full.items()
                if not any(k in history_columns(s) for s in schema.sequences)}
        inline, looked = p.predict(full), p.predict(bare)
        assert looked["looked_up"] == {s.name: len(full[s.ts_column]) for s in schema.sequences}
        for t in p.tasks:
            worst = max(worst, float(np.abs(np.array(inline["predictions"][t])
                                            - looked["predictions"][t]).max()))
    assert worst <= TOL
    # each stream's history moves the scores far more than TOL, so the equality is not vacuous
    full = reqs[0]
    ref = np.array(p.predict(full)["predictions"]["click"])
    for s in schema.sequences:
        empty = p.predict({**full, **{c: [] for c in history_columns(s)}})
        assert np.abs(ref - empty["predictions"]["click"]).max() > 100 * TOL, s.name
    # and so do the dwell values: served from the store as the loader joined them
    dwell = schema.stream("organic").value_column("dwell")
    assert len(full[dwell]) == len(full["organic.ts"]) > 0
    other = p.predict({**full, dwell: [10 * x + 60.0 for x in full[dwell]]})
    assert np.abs(ref - other["predictions"]["click"]).max() > 100 * TOL


def test_warmup_stays_within_the_limits(chain):
    """The server warms up before it is ready: its synthetic requests must pass a stream shorter
    than their 8 events and fewer allowed candidates than their 64."""
    p = Predictor(chain.artifact, limits=Limits(max_candidates=4, max_history=5))
    assert p.warmup() > 0
