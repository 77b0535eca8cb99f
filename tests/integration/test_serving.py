"""Serving on the tiny preset: train → export → Predictor equality, the HTTP server's endpoints,
every bad-request class, micro-batching, hot reload under traffic, an OpenAPI fuzz,
graceful stop."""

import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import numpy as np
import pyarrow as pa
import pytest
import torch
import uvicorn

from opengem.cli import main
from opengem.data.batch import collate
from opengem.data.events import ShardReader
from opengem.data.parquet import DatasetManifest
from opengem.export import ArtifactError, Predictor
from opengem.export.artifact import load_manifest
from opengem.export.client import free_port, wait_ready
from opengem.export.request import Limits, rows_of, split_row, synthetic_request
from opengem.export.server import create_app
from opengem.pipeline import serve_smoke
from opengem.run import load_run_model

TOL = 1e-5


def _export(run, out, *extra):
    return main(["--quiet", "export", "--run", str(run), "--out", str(out), "--no-compile", *extra])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    data, run = root / "data", root / "run"
    assert main(["--quiet", "generate", "--preset", "tiny", "--out", str(data), "--seed", "1"]) == 0
    assert main(["--quiet", "train", "--recipe", "tiny", "--data", str(data), "--out", str(run),
                 "train.max_steps=4"]) == 0
    assert _export(run, root / "artifact", "--data", str(data)) == 0
    return SimpleNamespace(root=root, data=data, run=run, artifact=root / "artifact")


@pytest.fixture(scope="module")
def artifact_b(tiny):
    """A second model with the same schema (another seed), for hot reload."""
    run = tiny.root / "run_b"
    assert main(["--quiet", "train", "--recipe", "tiny", "--data", str(tiny.data), "--out",
                 str(run), "train.max_steps=2", "train.seed=1"]) == 0
    assert _export(run, tiny.root / "artifact_b") == 0
    return tiny.root / "artifact_b"


@contextmanager
def live_server(app):
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    t0 = time.time()
    while not server.started:
        assert thread.is_alive() and time.time() - t0 < 60, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def server(tiny):
    app = create_app(tiny.artifact, limits=Limits(max_candidates=64), window_ms=5.0,
                     max_body_bytes=4 << 20)
    with live_server(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield SimpleNamespace(url=url, client=client, app=app)


def _log_requests(schema, data, n_requests=6, per=5):
    """Requests made of log rows: a row's user, context and history with the ads of ``per`` rows.

    The users with the longest organic histories come first, so truncation is exercised.
    """
    # either layout: v2 histories are joined from the event logs
    manifest = DatasetManifest.load(data)
    info = max(manifest.files, key=lambda f: f.path)
    rows = ShardReader(data, manifest, schema).read(info, schema.columns()).to_pylist()
    users = sorted(range(len(rows)), key=lambda i: -len(rows[i]["organic.item"]))
    out = []
    for k, i in enumerate(users[:n_requests]):
        req, _ = split_row(schema, rows[i])
        req["candidates"] = [split_row(schema, r)[1] for r in rows[k * per:(k + 1) * per]]
        out.append(req)
    return out


def _reference(model, schema, reqs):
    """The training model on the requests' rows (one extra row with a long history, as in any
    training batch: see tests/unit/export/test_program.py::reference)."""
    anchor = synthetic_request(schema, 1, model.cfg.sequence.recent_len, seed=99)
    rows = [r for req in reqs + [anchor] for r in rows_of(schema, req)]
    with torch.no_grad():
        return torch.sigmoid(
            model(collate(pa.Table.from_pylist(rows), schema, model.max_seq_len())).double()
        )[:-1]


# ------------------------------------------------------------------------------- export + predictor
def test_round_trip_train_export_predictor_equality(tiny):
    model, _, schema = load_run_model(tiny.run)
    reqs = _log_requests(schema, tiny.data)
    # unknown ids: scored through the OOV row, as in training
    reqs[0]["candidates"][0]["ad_id"] = 10**9
    reqs[1]["organic.item"][-1] = -5
    ref = _reference(model, schema, reqs)
    for runtime in ("exported", "eager"):
        p = Predictor(tiny.artifact, runtime=runtime)
        assert p.runtime == runtime
        out = [p.predict(r) for r in reqs]
        got = np.concatenate([np.stack([o["predictions"][t] for t in schema.task_names], 1)
                              for o in out])
        assert np.abs(got - ref.numpy()).max() < TOL, runtime
        assert out[0]["oov"] == {"ad_id": 1} and out[1]["oov"] == {"organic.item": 1}
        # tiny histories reach 4,096 > the model's 256
        assert any(o["truncated"].get("organic") for o in out)
        batched = p.score([p.parse(r) for r in reqs])  # one forward for all: the same answers
        assert all(np.allclose(b["predictions"]["click"], o["predictions"]["click"], atol=1e-6)
                   for b, o in zip(batched, out))


def test_manifest_records_hashes_versions_metrics(tiny):
    m = load_manifest(tiny.artifact,
                      verify=("schema.json", "config.json", "weights.pt", "program.pt2"))
    assert m["format"] == "opengem-artifact" and len(m["model_version"]) == 16
    assert {"torch", "torchrec", "numpy", "python"} <= set(m["versions"])
    assert m["parity"]["max_abs_diff_exported"] < TOL
    assert m["evaluation"]["metrics"]["all/click"]["n"] > 0
    assert m["layout"]["max_seq_len"] == {"organic": 256, "ads": 256}
    assert m["run"]["steps"] == 4 and m["model"]["kind"] == "GEM"


def test_tampered_or_missing_artifacts_are_refused(tiny, tmp_path, capsys):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny.artifact, bad)
    with open(bad / "program.pt2", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02")
    with pytest.raises(ArtifactError, match="sha256"):
        Predictor(bad, runtime="exported")
    with pytest.raises(ArtifactError, match="no manifest"):
        Predictor(tmp_path / "nothing")
    assert _export(tiny.run, tiny.artifact) == 2  # artifacts are immutable
    assert "not empty" in capsys.readouterr().err


# ------------------------------------------------------------------------------- HTTP
def test_endpoints(server, tiny):
    c = server.client
    assert c.get("/healthz").json() == {"status": "ok"}
    ready = c.get("/readyz").json()
    assert ready["ready"] and ready["runtime"] == "exported"
    req = synthetic_request(Predictor(tiny.artifact).schema, 4, 10, seed=3)
    r = c.post("/v1/score", json=req)
    assert r.status_code == 200
    body = r.json()
    assert body["tasks"] == ["click", "conversion"] and len(body["predictions"]["click"]) == 4
    assert all(0 < p < 1 for p in body["predictions"]["conversion"])
    spec = c.get("/openapi.json").json()
    assert {"/v1/score", "/healthz", "/readyz", "/metrics", "/admin/reload"} <= set(spec["paths"])
    fields = spec["components"]["schemas"]["ScoreRequest"]["properties"]
    assert {"user_id", "request_ts", "domain", "organic.item", "ads.ts", "candidates"} <= set(
        fields
    )
    assert set(spec["components"]["schemas"]["Candidate"]["required"]) >= {
        "ad_id",
        "campaign_id",
        "ad_quality",
    }
    c.post("/v1/score", content=b"{")
    text = c.get("/metrics").text
    assert 'opengem_request_duration_seconds_bucket{le="0.005",route="/v1/score"}' in text
    assert 'opengem_requests_total{route="/v1/score",status="200"}' in text
    assert 'opengem_request_errors_total{route="/v1/score",status="400"}' in text
    assert "opengem_model_info{" in text and "opengem_batch_candidates_bucket" in text


def _bad_requests(schema):
    good = synthetic_request(schema, 3, 5, seed=1)

    def with_(**kv):
        return json.dumps({**good, **kv}).encode()

    no_age = {k: v for k, v in good.items() if k != "age"}
    too_long = {f"organic.{c}": [0] * 4097 for c in ("item", "event", "ts", "category")}
    return {
        "missing field": (json.dumps(no_age).encode(), 422, "age"),
        "wrong type": (with_(age="old"), 422, "age"),
        "empty candidates": (with_(candidates=[]), 422, "candidates"),
        "oversized history": (with_(**too_long), 413, "organic."),
        "oversized batch": (with_(candidates=good["candidates"] * 30), 413, "candidates"),
        "malformed JSON": (b'{"user_id": 3,,}', 400, "body"),
        "huge body": (b" " * (5 << 20), 413, "body"),
        "unknown field": (with_(favourite_colour="red"), 422, "favourite_colour"),
        "events out of order": (with_(**{"ads.ts": good["ads.ts"][::-1]}), 422, "ads.ts"),
        "NaN": (json.dumps({**good, "user_activity": float("nan")}).encode(), 422, "user_activity"),
    }


def test_every_bad_request_is_a_4xx_naming_the_problem(server, tiny):
    schema = Predictor(tiny.artifact).schema
    for name, (body, status, field) in _bad_requests(schema).items():
        r = server.client.post("/v1/score", content=body,
                               headers={"content-type": "application/json"})
        assert r.status_code == status, (name, r.text)
        err = r.json()["error"]
        assert err["field"].startswith(field) and err["message"], (name, err)

    def chunks():  # no content-length: the limit is enforced while reading
        for _ in range(6):
            yield b" " * (1 << 20)

    r = server.client.post("/v1/score", content=chunks(),
                           headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["field"] == "body"
    # unknown ids are not errors: scored through the OOV rows and counted
    r = server.client.post("/v1/score", json=synthetic_request(schema, 2, 4, oov=True))
    assert r.status_code == 200 and r.json()["oov"]["ad_id"] == 2
    assert server.client.get("/healthz").status_code == 200  # still serving


def test_concurrent_requests_share_a_forward(server, tiny):
    schema = Predictor(tiny.artifact).schema
    reqs = [synthetic_request(schema, 8, 20, seed=i) for i in range(24)]
    alone = [server.client.post("/v1/score", json=r).json()["predictions"] for r in reqs[:4]]
    before = _batches_over_one(server.client)
    results = [None] * len(reqs)

    def worker(i):
        with httpx.Client(base_url=server.url, timeout=30) as c:
            results[i] = c.post("/v1/score", json=reqs[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.status_code == 200 for r in results)
    assert _batches_over_one(server.client) > before  # some forward scored several requests
    for a, r in zip(alone, results[:4]):  # a request's scores do not depend on its neighbours
        assert np.allclose(a["click"], r.json()["predictions"]["click"], atol=1e-6)


def _batches_over_one(client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith('opengem_batch_requests_bucket{le="1.0"}'):
            total = float(line.split()[-1])
        if line.startswith("opengem_batch_requests_count"):
            return float(line.split()[-1]) - total
    raise AssertionError("no opengem_batch_requests metric")


@pytest.mark.slow
def test_hot_reload_under_traffic_drops_nothing(tiny, artifact_b):
    pa_, pb = Predictor(tiny.artifact), Predictor(artifact_b)
    req = synthetic_request(pa_.schema, 6, 12, seed=5)
    expected = {p.version: p.predict(req)["predictions"]["click"] for p in (pa_, pb)}
    app = create_app(tiny.artifact, window_ms=2.0)
    stop, seen, failures = threading.Event(), [], []

    def traffic(url):
        with httpx.Client(base_url=url, timeout=30) as c:
            while not stop.is_set():
                r = c.post("/v1/score", json=req)
                if r.status_code != 200:
                    failures.append(r.status_code)
                    continue
                body = r.json()  # each answer comes whole from one model
                if not np.allclose(body["predictions"]["click"], expected[body["model_version"]],
                                   atol=1e-6):
                    failures.append("mixed")
                seen.append(body["model_version"])

    with live_server(app) as url, httpx.Client(base_url=url, timeout=60) as admin:
        threads = [threading.Thread(target=traffic, args=(url,)) for _ in range(4)]
        for t in threads:
            t.start()
        for target in (artifact_b, tiny.artifact, artifact_b):
            time.sleep(0.3)
            r = admin.post("/admin/reload", json={"artifact": str(target)})
            assert r.status_code == 200, r.text
        bad = admin.post("/admin/reload", json={"artifact": str(tiny.root / "missing")})
        assert bad.status_code == 400 and "no manifest" in bad.json()["error"]["message"]
        time.sleep(0.3)
        stop.set()
        for t in threads:
            t.join()
        assert admin.get("/readyz").json()["model_version"] == pb.version
    assert not failures, failures[:5]
    assert {pa_.version, pb.version} <= set(seen) and len(seen) > 20


def test_openapi_fuzz_has_no_server_errors(server):
    """Schemathesis generates requests from the served OpenAPI spec, valid and invalid: never
    a 5xx."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    spec = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    statuses = []
    for result in spec.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=100, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def check(case):
                r = case.call(base_url=server.url)
                statuses.append(r.status_code)
                assert r.status_code < 500, (r.status_code, r.text[:300])

            try:
                check()
            except Unsatisfiable:  # an operation without inputs has no invalid form
                pass
    assert 200 in statuses and any(400 <= s < 500 for s in statuses)
    assert server.client.get("/healthz").status_code == 200


# ------------------------------------------------------------------------------- the process
def _raw_post(port: int, body: bytes, sent: threading.Event, out: list, i: int) -> None:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/score HTTP/1.1\r\nHost: t\r\nContent-Type: "
              b"application/json\r\nConnection: close\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    sent.set()
    data = b""
    while chunk := s.recv(1 << 16):
        data += chunk
    s.close()
    out[i] = int(data.split(b" ", 2)[1]) if data else None


def test_cli_serve_drains_open_requests_on_sigterm(tiny):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "opengem", "--quiet", "serve", "--artifact",
                             str(tiny.artifact), "--port", str(port), "--threads", "1"],
                            stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        body = json.dumps(synthetic_request(Predictor(tiny.artifact).schema, 64, 200,
                                            seed=2)).encode()
        n = 12
        out, sent = [None] * n, [threading.Event() for _ in range(n)]
        threads = [threading.Thread(target=_raw_post, args=(port, body, sent[i], out, i))
                   for i in range(n)]
        for t in threads:
            t.start()
        for e in sent:
            e.wait(10)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)  # while most of them are still queued
        for t in threads:
            t.join(60)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
    assert out == [200] * n


@pytest.mark.slow
def test_serve_smoke(tiny):
    r = serve_smoke(tiny.run, tiny.root / "smoke_artifact", compile=False, candidates=5)
    assert r["status"] == 200 and r["exit_code"] == 0
    assert len(r["response"]["predictions"]["click"]) == 5
    assert r["runtime"] == "exported" and r["times"]["request_ms"] > 0


@pytest.mark.slow
def test_aoti_artifact_matches_the_training_model(tiny):
    out = tiny.root / "aoti"
    assert main(["--quiet", "export", "--run", str(tiny.run), "--out", str(out)]) == 0
    m = load_manifest(out, verify=("program.aoti.pt2",))
    assert m["parity"]["max_abs_diff_aoti"] < TOL
    model, _, schema = load_run_model(tiny.run)
    reqs = _log_requests(schema, tiny.data, n_requests=3)
    p = Predictor(out)
    assert p.runtime == "aoti"
    got = np.concatenate([np.stack([p.predict(r)["predictions"][t] for t in schema.task_names], 1)
                          for r in reqs])
    assert np.abs(got - _reference(model, schema, reqs).numpy()).max() < TOL


# ------------------------------------------------------------------------------- history store
@pytest.fixture(scope="module")
def history_world(tiny):
    """The tiny world in layout v2 (same preset and seed: the artifact's schema) and its
    history store."""
    data, store = tiny.root / "data_v2", tiny.root / "history"
    assert (
        main(
            [
                "--quiet",
                "generate",
                "--preset",
                "tiny",
                "--layout",
                "v2",
                "--out",
                str(data),
                "--seed",
                "1",
            ]
        )
        == 0
    )
    assert main(["--quiet", "history-store", "--data", str(data), "--out", str(store)]) == 0
    return SimpleNamespace(data=data, store=store)


def test_server_reads_histories_by_user_id_from_a_store(tiny, history_world):
    from opengem.data.events import ShardReader
    from opengem.data.parquet import DatasetManifest
    from opengem.export.request import history_columns

    schema = Predictor(tiny.artifact, runtime="exported").schema
    m = DatasetManifest.load(history_world.data)
    rows = ShardReader(history_world.data, m, schema).read(m.split_files("test")[0],
                                                           schema.columns()).to_pylist()
    rows = sorted(rows, key=lambda r: -len(r["organic.ts"]))[:6]
    app = create_app(tiny.artifact, runtime="exported", history=history_world.store)
    with live_server(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        for row in rows:
            full, _ = split_row(schema, row)
            full["candidates"] = [split_row(schema, r)[1] for r in rows]
            bare = {k: v for k,
                    v in full.items() if not any(k in history_columns(s) for s in schema.sequences)}
            a, b = client.post("/v1/score", json=full), client.post("/v1/score", json=bare)
            assert a.status_code == b.status_code == 200, b.text
            assert (
                np.abs(
                    np.array(a.json()["predictions"]["click"]) - b.json()["predictions"]["click"]
                ).max()
                < 1e-6
            )
            assert b.json()["looked_up"]["organic"] == len(row["organic.ts"]) > 0
        # user_id optional: required for a lookup
        if schema.user_column not in {f.name for f in schema.sparse}:
            r = client.post("/v1/score",
                            json={k: v for k, v in bare.items() if k != schema.user_column})
            assert r.status_code == 422 and r.json()["error"]["field"] == schema.user_column
        spec = client.get("/openapi.json").json()["components"]["schemas"]["ScoreRequest"]
        assert "organic.item" not in spec.get("required", [])


def test_serve_refuses_a_store_of_another_schema(tiny, history_world, tmp_path):
    from opengem.export.history import META, HistoryStoreError

    store = tmp_path / "store"
    shutil.copytree(history_world.store, store)
    meta = json.loads((store / META).read_text())
    meta["streams"]["organic"]["num_event_types"] += 1
    (store / META).write_text(json.dumps(meta))
    with pytest.raises(HistoryStoreError, match="organic.*num_event_types"):
        create_app(tiny.artifact, runtime="exported", history=store)
