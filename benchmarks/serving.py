"""Serving latency and throughput: ``opengem serve`` over loopback vs the training model in eager mode.

    python benchmarks/serving.py --quick                  tiny world, demo-recipe GEM, < 5 min on 2 cores
    python benchmarks/serving.py --artifact A --data D    an existing artifact, requests from D's test rows

What is measured, for 1, 64 and 512 candidates per request:

- served: a closed loop of ``--concurrency`` clients on keep-alive loopback connections, each sending
  the next request as soon as the previous answer arrives; latency is the client's (request written →
  response read: HTTP, JSON, validation, micro-batching, preprocessing, forward). The server runs
  pinned to ``--server-core`` with one torch/OpenMP thread; the client (a raw asyncio HTTP/1.1 client,
  so its own cost stays small) is pinned to ``--client-core``.
- predictor: the same requests through ``Predictor.predict`` in process (no HTTP), on the server core.
- eager: the same rows (one per candidate, history repeated) through the plain training model, as
  ``evaluate`` runs it: ``collate`` of the Arrow rows + ``GEM.forward`` + sigmoid, one thread, on the
  server core. Building the Arrow table is not timed.

``speedup_vs_eager_C`` = eager p50 / served p50 at concurrency 1 (HTTP included, so conservative).
The machine may be shared (the figures are then upper bounds on latency). Ends with ONE JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short runs: concurrency 1 and 8, 3 s per level")
    p.add_argument("--artifact", default=None, help="benchmark this artifact (default: train and export one)")
    p.add_argument("--data", default=None, help="world to draw requests from (default: generate the tiny world)")
    p.add_argument("--recipe", default="demo", help="model recipe when training one (today's default model)")
    p.add_argument("--steps", type=int, default=20, help="training steps when training one")
    p.add_argument("--no-compile", action="store_true", help="export without AOTInductor")
    p.add_argument("--candidates", default="1,64,512")
    p.add_argument("--concurrency", default=None, help="comma-separated client counts (default 1,4,16; quick 1,8)")
    p.add_argument("--seconds", type=float, default=None, help="per level (default 10; quick 3)")
    p.add_argument("--server-core", type=int, default=0)
    p.add_argument("--client-core", type=int, default=1)
    p.add_argument("--out", default=None, help="working directory (default: a temporary one)")
    a = p.parse_args()
    a.concurrency = a.concurrency or ("1,8" if a.quick else "1,4,16")
    a.seconds = a.seconds or (3.0 if a.quick else 10.0)
    return a


def _cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "opengem", "--quiet", *args], check=True, cwd=REPO, env=_env())


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1")


def _prepare(a, work: Path) -> tuple[Path, Path, Path | None]:
    """(artifact, data, run) — trained and exported here unless given."""
    data = Path(a.data) if a.data else work / "data"
    if not a.data:
        _cli("generate", "--preset", "tiny", "--out", str(data), "--seed", "1")
    if a.artifact:
        return Path(a.artifact), data, None
    run, art = work / "run", work / "artifact"
    _cli("train", "--recipe", a.recipe, "--data", str(data), "--out", str(run), f"train.max_steps={a.steps}",
         "data.batch_size=128")
    _cli("export", "--run", str(run), "--out", str(art), *(["--no-compile"] if a.no_compile else []))
    return art, data, run


def _requests(schema, data: Path, candidates: int, n: int = 8) -> list[dict]:
    """``n`` requests from test rows: a row's user, context and history + the ads of ``candidates`` rows."""
    from opengem.data.parquet import DatasetManifest, read_shard
    from opengem.export.request import split_row

    manifest = DatasetManifest.load(data)
    rows = []
    for info in manifest.split_files("test"):
        rows += read_shard(data, info, schema.columns()).to_pylist()
        if len(rows) >= 2048:
            break
    rng = np.random.default_rng(0)
    out = []
    for i in rng.choice(len(rows), n, replace=False):
        req, _ = split_row(schema, rows[i])
        req["candidates"] = [split_row(schema, rows[j])[1] for j in rng.choice(len(rows), candidates)]
        out.append(req)
    return out


def _pct(lat: list[float]) -> dict:
    a = np.asarray(lat) * 1e3
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)), "n": len(a)}


# ----------------------------------------------------------------------------- the client
async def _client(port: int, bodies: list[bytes], stop_at: float, warm_until: float, lat: list, errors: list):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    i = 0
    try:
        while time.perf_counter() < stop_at:
            body = bodies[i % len(bodies)]
            i += 1
            t0 = time.perf_counter()
            writer.write(b"POST /v1/score HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            dt = time.perf_counter() - t0
            if head[9:12] != b"200":
                errors.append(int(head[9:12]))
            elif t0 >= warm_until:
                lat.append(dt)
    finally:
        writer.close()


def _load(port: int, bodies: list[bytes], concurrency: int, seconds: float) -> dict:
    async def run():
        lat, errors = [], []
        t0 = time.perf_counter()
        warm, stop = t0 + min(1.0, seconds / 4), t0 + min(1.0, seconds / 4) + seconds
        await asyncio.gather(*(_client(port, bodies[k:] + bodies[:k], stop, warm, lat, errors)
                               for k in range(concurrency)))
        return lat, errors

    lat, errors = asyncio.run(run())
    return {**_pct(lat), "rps": len(lat) / seconds, "errors": len(errors)}


# ----------------------------------------------------------------------------- server + baselines
def _start_server(artifact: Path, port: int, core: int) -> subprocess.Popen:
    cmd = ["taskset", "-c", str(core), sys.executable, "-m", "opengem", "--quiet", "serve", "--artifact",
           str(artifact), "--port", str(port), "--threads", "1"]
    return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _timed(fn, n: int) -> dict:
    lat = []
    for i in range(n + 2):
        t0 = time.perf_counter()
        fn(i)
        if i >= 2:  # the first calls allocate
            lat.append(time.perf_counter() - t0)
    return _pct(lat)


def _training_model(artifact: Path, schema):
    """The plain training model (GEM built from the config, the artifact's weights), eval mode."""
    import torch

    from opengem.config import Config
    from opengem.model.build import build_gem, materialize

    cfg = Config.from_dict(json.loads((artifact / "config.json").read_text()))
    model = materialize(build_gem(schema, cfg.model))
    model.load_state_dict(torch.load(artifact / "weights.pt", weights_only=True))
    return model.eval()


def _eager(model, schema, reqs: list[dict], n: int) -> dict:
    import pyarrow as pa
    import torch

    from opengem.data.batch import collate
    from opengem.export.request import rows_of

    tables = [pa.Table.from_pylist(rows_of(schema, r)) for r in reqs]
    limits = model.max_seq_len()

    def score(i):
        with torch.inference_mode():
            torch.sigmoid(model(collate(tables[i % len(tables)], schema, limits)))

    return _timed(score, n)


def _in_process(p, reqs: list[dict], n: int) -> dict:
    bodies = [json.dumps(r).encode() for r in reqs]
    return {**_timed(lambda i: p.predict(bodies[i % len(bodies)]), n), "runtime": p.runtime}


def main() -> None:
    a = _args()
    import torch

    torch.set_num_threads(1)
    os.sched_setaffinity(0, {a.server_core})  # the in-process baselines run where the server will
    work = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="opengem-serving-"))
    t_start = time.perf_counter()
    artifact, data, _ = _prepare(a, work)

    from opengem.export.artifact import load_manifest
    from opengem.export.predictor import Predictor
    from opengem.export.smoke import free_port, wait_ready
    from opengem.features.schema import FeatureSchema

    schema = FeatureSchema.load(artifact / "schema.json")
    manifest = load_manifest(artifact)
    cands = [int(x) for x in a.candidates.split(",")]
    concs = [int(x) for x in a.concurrency.split(",")]
    reqs = {c: _requests(schema, data, c) for c in cands}
    model, predictor = _training_model(artifact, schema), Predictor(artifact)
    eager, inproc = {}, {}
    for c in cands:
        n = 10 if c >= 512 else (30 if a.quick else 100)
        eager[c] = _eager(model, schema, reqs[c], n)
        inproc[c] = _in_process(predictor, reqs[c], n)
        print(f"C={c:4d}  eager p50 {eager[c]['p50_ms']:8.2f} ms   predictor ({predictor.runtime}) "
              f"p50 {inproc[c]['p50_ms']:8.2f} ms", flush=True)
    del model, predictor

    port = free_port()
    server = _start_server(artifact, port, a.server_core)
    served = {}
    try:
        wait_ready(f"http://127.0.0.1:{port}", server, timeout=300)
        os.sched_setaffinity(0, {a.client_core})
        for c in cands:
            bodies = [json.dumps(r).encode() for r in reqs[c]]
            for k in concs:
                served[(c, k)] = r = _load(port, bodies, k, a.seconds)
                print(f"C={c:4d} concurrency {k:3d}: p50 {r['p50_ms']:8.2f} ms  p99 {r['p99_ms']:8.2f} ms  "
                      f"{r['rps']:8.1f} req/s  {r['rps'] * c:10.0f} candidates/s  errors {r['errors']}", flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)

    out = {"model": {"kind": manifest["model"]["kind"], "recipe": manifest["model"]["recipe"],
                     "parameters": manifest["model"]["parameters"]["total"], "runtime": inproc[cands[0]]["runtime"]},
           "cores": {"server": a.server_core, "client": a.client_core}, "server_threads": 1,
           "seconds_per_level": a.seconds}
    for c in cands:
        one = served[(c, concs[0])]
        out[f"p50_ms_{c}"], out[f"p99_ms_{c}"] = round(one["p50_ms"], 3), round(one["p99_ms"], 3)
        out[f"rps_{c}"] = round(max(served[(c, k)]["rps"] for k in concs), 1)
        out[f"speedup_vs_eager_{c}"] = round(eager[c]["p50_ms"] / one["p50_ms"], 2)
        out[f"eager_p50_ms_{c}"] = round(eager[c]["p50_ms"], 3)
        out[f"predictor_p50_ms_{c}"] = round(inproc[c]["p50_ms"], 3)
    out["levels"] = [{"candidates": c, "concurrency": k, **{m: round(v, 3) for m, v in r.items()}}
                     for (c, k), r in served.items()]
    out["errors"] = sum(r["errors"] for r in served.values())
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
