"""``"explain": true`` in a scoring request (``opengem.export.explain``): the served program's
occlusion explanation per candidate, its event and stream effects equal to re-scoring the edited
request, an artifact without the background still explains streams and ad features, and a
non-boolean ``explain`` is a 422 like any bad field."""

from types import SimpleNamespace

import numpy as np
import pytest

from opengem.cli import main
from opengem.evaluation.explain import read_rows
from opengem.export import Predictor, RequestError
from opengem.export.explain import BACKGROUND_FILE
from opengem.export.request import history_columns, split_row
from opengem.features.schema import FeatureSchema
from opengem.world.generate import generate
from opengem.world.presets import world_config

TOL = 2e-5  # effects are rounded to 5 decimals in the response


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("explain-serving")
    data, run = root / "data", root / "run"
    generate(world_config("tiny", 3, ["sizes.num_users=400"]), data, progress=False, layout="v2")
    assert main(["--quiet", "train", "--recipe", "tiny", "--data", str(data), "--out", str(run),
                 "train.max_steps=10", "train.threads=1"]) == 0
    for name, extra in (("with_bg", ["--data", str(data)]), ("without_bg", [])):
        assert main(["--quiet", "export", "--run", str(run), "--out", str(root / name),
                     "--no-compile", *extra]) == 0
    return SimpleNamespace(root=root, data=data, schema=FeatureSchema.load(data))


def _request(served, n_cands=6):
    rows = read_rows(served.data, served.schema, "test", list(range(40))).to_pylist()
    owner = max(rows, key=lambda r: len(r["organic.item"]) + len(r["ads.item"]))
    req, _ = split_row(served.schema, owner)
    req["candidates"] = [split_row(served.schema, r)[1] for r in rows[:n_cands]]
    return req


def _logits(pred, req):
    p = np.array([pred.predict(req)["predictions"][t] for t in pred.tasks], dtype=np.float64).T
    return np.log(p) - np.log1p(-p)


def test_an_explained_request_matches_rescoring_its_edits(served):
    pred = Predictor(served.root / "with_bg", runtime="exported")
    req = _request(served)
    assert "explanation" not in pred.predict(req)  # off by default
    out = pred.predict({**req, "explain": True})
    ex = out["explanation"]
    assert ex["features_available"] == {"user_context": True, "ad": True}
    assert ex["background"] == {"user_context": 16, "ad": 5} and not ex["notes"]
    base = _logits(pred, req)
    for c, cand in enumerate(ex["candidates"]):
        assert np.allclose([cand["logit"][t] for t in pred.tasks], base[c], atol=TOL)
        for g in cand["groups"].values():
            assert all(np.isfinite(v) for v in g.values())
        assert set(cand["sides"]) == {"user", "ad", "context"}
    for s in served.schema.sequences:
        empty = {**req, **{col: [] for col in history_columns(s)}}
        got = np.array([[c["groups"][s.name][t] for t in pred.tasks] for c in ex["candidates"]])
        assert np.allclose(got, base - _logits(pred, empty), atol=TOL)
        for c, cand in enumerate(ex["candidates"][:2]):
            for e in cand["events"][s.name]:
                i = e["index"]
                cut = {**req, **{col: req[col][:i] + req[col][i + 1:]
                                 for col in history_columns(s)}}
                assert req[s.item_column][i] == e["item"]
                assert np.allclose([e["effect"][t] for t in pred.tasks],
                                   base[c] - _logits(pred, cut)[c], atol=TOL)
    assert ex["candidates_scored"] > 6 * 16 and ex["ms"] > 0


def test_an_artifact_without_background_explains_what_it_can(served):
    assert not (served.root / "without_bg" / BACKGROUND_FILE).exists()
    pred = Predictor(served.root / "without_bg", runtime="exported")
    ex = pred.predict({**_request(served), "explain": True})["explanation"]
    assert ex["features_available"] == {"user_context": False, "ad": True}
    assert "user and context features unavailable" in ex["notes"][0]
    groups = ex["candidates"][0]["groups"]
    assert {"organic", "ads", "ad_id"} <= set(groups) and "segment" not in groups
    one = pred.predict({**_request(served, 1), "explain": True})["explanation"]
    assert one["features_available"]["ad"] is False
    assert "ad_id" not in one["candidates"][0]["groups"]


@pytest.mark.parametrize("value", ["yes", 1, None, [True]])
def test_a_non_boolean_explain_is_a_422(served, value):
    pred = Predictor(served.root / "without_bg", runtime="exported")
    with pytest.raises(RequestError) as e:
        pred.parse({**_request(served, 2), "explain": value})
    assert e.value.status == 422 and e.value.field == "explain"


def test_the_server_answers_explain_and_refuses_a_bad_one(served):
    from fastapi.testclient import TestClient

    from opengem.export.server import create_app

    with TestClient(create_app(served.root / "with_bg", runtime="exported")) as c:
        req = _request(served, 3)
        r = c.post("/v1/score", json={**req, "explain": True})
        assert r.status_code == 200 and len(r.json()["explanation"]["candidates"]) == 3
        bad = c.post("/v1/score", json={**req, "explain": "true"})
        assert bad.status_code == 422 and bad.json()["error"]["field"] == "explain"
        assert "explain" in c.get("/openapi.json").json()["components"]["schemas"][
            "ScoreRequest"]["properties"]
