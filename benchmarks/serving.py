"""Serving latency and throughput: ``opengem serve`` over loopback vs the training model in
eager mode.

    python benchmarks/serving.py --quick                  the default VM (distilled), < 5 min on 2 cores
    python benchmarks/serving.py --quick --model gem      GEM itself: tiny world, demo-recipe GEM
    python benchmarks/serving.py --artifact A --data D    an existing artifact, requests from D's test rows

The models (``--model``):

- ``vm`` (default): the default vertical model, as ``opengem demo`` builds it: ``distill_demo``
  (recipe vm_s, video surface) from a teacher GEM. Latency depends on the VM's architecture and on
  the request's shape, not on its quality, so the world is the ``demo`` preset with fewer users
  (``--users``: the demo schema's vocabularies and stored history limits, 4096 organic / 512 ads
  events, and the demo's per-user activity, so request histories have the demo's long tail) and the
  teacher is a few steps of the ``tiny`` recipe (``--teacher-recipe``, ``--steps``). Requests are
  test rows of the VM's surface. ``--student-recipe vm_xs`` measures another VM size (a separate
  row, not the default VM).
- ``gem``: GEM itself (``--recipe``, default demo) trained ``--steps`` steps on the ``tiny`` world.

What is measured, for 1, 64 and 512 candidates per request:

- served: a closed loop of ``--concurrency`` clients on keep-alive loopback connections, each
  sending the next request as soon as the previous answer arrives; latency is the client's (request
  written → response read: HTTP, JSON, validation, micro-batching, preprocessing, forward). The
  server runs pinned to ``--server-core`` with one torch/OpenMP thread; the client (a raw asyncio
  HTTP/1.1 client, so its own cost stays small) is pinned to ``--client-core``.
- predictor: the same requests through ``Predictor.predict`` in process (no HTTP), on the
  server core.
- eager: the same rows (one per candidate, history repeated) through the plain training model, as
  ``evaluate`` runs it: ``collate`` of the Arrow rows + ``GEM.forward`` + sigmoid, one thread, on
  the server core. Building the Arrow table is not timed.

- lookup (64 candidates, or the candidate count nearest 64): the same requests with their history
  fields left out, so the server reads them by ``user_id`` from the history store
  (``opengem history-store``, ``serve --history``) built from the world's event logs: served at
  concurrency 1 (``lookup_p50_ms_64``, ``lookup_p99_ms_64``), in process (``lookup_predictor_*``)
  and the store's ``lookup`` alone (``lookup_only_*``). Served and in process, each request is
  alternated with the same request carrying its histories (``lookup_given_*``,
  ``lookup_predictor_given_*``), so the pair sees the same machine load; ``lookup_max_abs_diff`` is
  the largest difference of their probabilities. The world is generated in layout v2 for this
  (its requests are the same rows as v1's); a given ``--data`` in layout v1 skips these figures.

``speedup_vs_eager_C`` = eager p50 / served p50 at concurrency 1 (HTTP included, so conservative).
The machine may be shared (the figures are then upper bounds on latency): ``healthz_p99_ms`` (GET
/healthz on the same server, no model) is the tail the HTTP stack and the machine add by themselves,
``predictor_cpu_p99_ms_C`` the tail of the work itself in CPU time, and ``loadavg_1m`` the machine's
load. Ends with ONE JSON line.
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
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="short runs: concurrency 1 and 8, 3 s per level")
    p.add_argument("--model", choices=["vm", "gem"], default="vm",
                   help="the default VM (distilled) or GEM itself")
    p.add_argument("--artifact", default=None,
                   help="benchmark this artifact (default: train and export one)")
    p.add_argument("--data", default=None,
                   help="world to draw requests from (default: generate the tiny world)")
    p.add_argument("--recipe", default="demo", help="--model gem: the GEM recipe to train")
    p.add_argument("--teacher-recipe", default="tiny", help="--model vm: the teacher GEM's recipe")
    p.add_argument("--student-recipe", default=None,
                   help="--model vm: another VM preset than the default (vm_s)")
    p.add_argument("--users", type=int, default=None,
                   help="--model vm: users of the demo world (default 1000; "
                                                             "not quick 3000)")
    p.add_argument("--steps", type=int, default=20,
                   help="training steps of the GEM (--model gem) or the teacher")
    p.add_argument("--table-dtype", choices=["fp32", "fp16", "int8"], default="fp32",
                   help="export's table dtype")
    p.add_argument("--no-compile", action="store_true", help="export without AOTInductor")
    p.add_argument("--candidates", default="1,64,512")
    p.add_argument("--concurrency", default=None,
                   help="comma-separated client counts (default 1,4,16; quick 1,8)")
    p.add_argument("--seconds", type=float, default=None, help="per level (default 10; quick 3)")
    p.add_argument("--server-core", type=int, default=0)
    p.add_argument("--client-core", type=int, default=1)
    p.add_argument("--out", default=None, help="working directory (default: a temporary one)")
    a = p.parse_args()
    a.concurrency = a.concurrency or ("1,8" if a.quick else "1,4,16")
    a.seconds = a.seconds or (3.0 if a.quick else 10.0)
    a.users = a.users or (1000 if a.quick else 3000)
    return a


def _cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "opengem", "--quiet", *args], check=True, cwd=REPO,
                   env=_env())


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1")


def _prepare(a, work: Path) -> tuple[Path, Path, dict]:
    """(artifact, data, what was built) — generated, trained, distilled and exported here
    unless given."""
    from opengem.export.artifact import export_run

    data = Path(a.data) if a.data else work / "data"
    built = {}
    if not a.data:
        world = ["--preset", "tiny"] if a.model == "gem" else \
            ["--preset", "demo", f"sizes.num_users={a.users}",
             f"sizes.users_per_block={min(a.users, 2048)}"]
        _cli("generate", "--out", str(data), "--seed", "1", "--layout", "v2", *world)
        built["world"] = " ".join(world[1:]) + " (layout v2)"
    if a.artifact:
        return Path(a.artifact), data, built
    run, art = work / "run", work / "artifact"
    recipe = a.recipe if a.model == "gem" else a.teacher_recipe
    _cli("train", "--recipe", recipe, "--data", str(data), "--out", str(run),
         f"train.max_steps={a.steps}", "data.batch_size=128")
    built["trained"] = f"{recipe}, {a.steps} steps" + (" (the VM's teacher)" if a.model == "vm"
                                                       else "")
    if a.model == "vm":
        from opengem.pipeline import DEMO_OVERRIDES, DEMO_RECIPE, distill_demo
        from opengem.transfer.distill import distill

        student = work / "vm"
        if a.student_recipe:
            distill(run, a.student_recipe, data, student, DEMO_OVERRIDES)
        else:
            distill_demo(run, data, student)
        built["distilled"] = f"{a.student_recipe or DEMO_RECIPE} {' '.join(DEMO_OVERRIDES)}"
        run = student
    export_run(run, art, compile=not a.no_compile, table_dtype=a.table_dtype)
    return art, data, built


def _requests(schema, data: Path, candidates: int, domains: list[int] | None,
              n: int = 16) -> list[dict]:
    """``n`` requests from test rows (of ``domains``): a row's user, context and history + the ads
    of ``candidates`` rows."""
    from opengem.data.events import ShardReader
    from opengem.data.parquet import DatasetManifest
    from opengem.export.request import split_row

    manifest = DatasetManifest.load(data)
    # v2: the histories are joined from the event logs
    reader, rows = ShardReader(data, manifest, schema), []
    for info in manifest.split_files("test"):
        rows += [r for r in reader.read(info, schema.columns()).to_pylist()
                 if domains is None or r[schema.domains.column] in domains]
        if len(rows) >= 2048:
            break
    rng = np.random.default_rng(0)
    out = []
    for i in rng.choice(len(rows), n, replace=False):
        req, _ = split_row(schema, rows[i])
        req["candidates"] = [split_row(schema, rows[j])[1]
                             for j in rng.choice(len(rows), candidates)]
        out.append(req)
    return out


def _vm_domains(schema) -> list[int]:
    """The default VM's surfaces (``pipeline.DEMO_OVERRIDES``' transfer.domains) as domain ids."""
    from opengem.pipeline import DEMO_OVERRIDES

    names = [v for o in DEMO_OVERRIDES if o.startswith("transfer.domains=")
             for v in o.split("=", 1)[1].split(",")]
    return [list(schema.domains.names).index(n) for n in names]


def _shape(schema, reqs: list[dict]) -> dict:
    """Events per stream in the requests (before the model's history limit) and JSON body bytes."""
    out = {"n": len(reqs), "body_bytes_mean": int(np.mean([len(json.dumps(r)) for r in reqs]))}
    for s in schema.sequences:
        n = [len(r[s.ts_column]) for r in reqs]
        out[f"{s.name}_events"] = {"mean": round(float(np.mean(n)), 1), "max": int(max(n))}
    return out


def _pct(lat: list[float]) -> dict:
    a = np.asarray(lat) * 1e3
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
            "n": len(a)}


# ----------------------------------------------------------------------------- the client
async def _client(port: int, bodies: list[bytes], stop_at: float, warm_until: float, lat: list,
                  errors: list, which: list | None = None):
    """One keep-alive connection sending the next request when the last answer is read (no bodies:
    GET /healthz); ``which`` gets the index in ``bodies`` of each timed request."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    i = 0
    try:
        while time.perf_counter() < stop_at:
            body = bodies[i % len(bodies)] if bodies else None
            i += 1
            t0 = time.perf_counter()
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: b\r\n\r\n" if body is None else
                         b"POST /v1/score HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            dt = time.perf_counter() - t0
            if head[9:12] != b"200":
                errors.append(int(head[9:12]))
            elif t0 >= warm_until:
                lat.append(dt)
                if which is not None:
                    which.append((i - 1) % len(bodies))
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


def _load_paired(port: int, given: list[bytes], bare: list[bytes], seconds: float) -> dict:
    """One client alternating each request with its history and the same request looked up by user
    id, so both see the same machine: {"looked_up": percentiles, "given": percentiles, "errors"}."""
    bodies = [b for pair in zip(given, bare) for b in pair]

    async def run():
        lat, errors, which = [], [], []
        t0 = time.perf_counter()
        warm = t0 + min(1.0, seconds / 4)
        await _client(port, bodies, warm + 2 * seconds, warm, lat, errors, which)
        return np.asarray(lat), errors, np.asarray(which) % 2

    lat, errors, odd = asyncio.run(run())
    return {"looked_up": _pct(list(lat[odd == 1])), "given": _pct(list(lat[odd == 0])),
            "errors": len(errors)}


# ----------------------------------------------------------------------------- server + baselines
def _history_store(data: Path, work: Path) -> tuple[Path | None, dict]:
    """(the store of ``data``'s event logs, its figures), or (None, why) for a v1 dataset."""
    from opengem.data.parquet import LAYOUT_V2, DatasetManifest

    if DatasetManifest.load(data).layout != LAYOUT_V2:
        return None, {"skipped": f"{data} is layout v1: no event logs to build a history "
                                 f"store from"}
    t0 = time.perf_counter()
    _cli("history-store", "--data", str(data), "--out", str(work / "history"))
    meta = json.loads((work / "history" / "history.json").read_text())
    return work / "history", {"build_s": round(time.perf_counter() - t0, 1),
                              **{n: {k: st[k] for k in ("events", "users", "bytes")}
                                 for n, st in meta["streams"].items()}}


def _bare(schema, reqs: list[dict]) -> list[dict]:
    """The requests without history fields: the server reads them by user id."""
    from opengem.export.request import history_columns

    drop = {c for s in schema.sequences for c in history_columns(s)}
    return [{k: v for k, v in r.items() if k not in drop} for r in reqs]


def _start_server(artifact: Path, port: int, core: int,
                  history: Path | None = None) -> subprocess.Popen:
    cmd = [
        "taskset",
        "-c",
        str(core),
        sys.executable,
        "-m",
        "opengem",
        "--quiet",
        "serve",
        "--artifact",
        str(artifact),
        "--port",
        str(port),
        "--threads",
        "1",
    ] + (["--history", str(history)] if history else [])
    return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _timed(fn, n: int) -> dict:
    """Wall-clock percentiles, and the CPU time of the calling thread (what the work costs when the
    core is not shared: on a busy machine the wall-clock tail is mostly waiting for the core)."""
    lat, cpu = [], []
    for i in range(n + 2):
        t0, c0 = time.perf_counter(), time.thread_time()
        fn(i)
        if i >= 2:  # the first calls allocate
            lat.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
    c = _pct(cpu)
    return {**_pct(lat), "cpu_p50_ms": c["p50_ms"], "cpu_p99_ms": c["p99_ms"]}


def _training_model(artifact: Path, schema, table_dtype: str):
    """The plain training model (GEM built from the config, the artifact's weights), eval mode."""
    import torch

    from opengem.config import Config
    from opengem.export.tables import compress
    from opengem.model.build import build_gem, materialize

    cfg = Config.from_dict(json.loads((artifact / "config.json").read_text()))
    model = compress(materialize(build_gem(schema, cfg.model)), table_dtype)
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


def _check_lookup(p, lp, reqs: list[dict], bare: list[dict]) -> float:
    """Max |Δp| between the requests with their histories and the same requests looked up by
    user id."""
    diff = 0.0
    for r, b in zip(reqs, bare):
        x, y = p.predict(r)["predictions"], lp.predict(b)["predictions"]
        diff = max(diff, max(float(np.abs(np.subtract(x[t], y[t])).max()) for t in x))
    return diff


def _paired(p, reqs: list[dict], bare: list[dict], n: int) -> dict:
    """In process, the requests with their histories and without (looked up) alternated, so both see
    the same machine load: {"predictor": looked up, "predictor_given": histories in the request}."""
    bodies = [json.dumps(r).encode() for pair in zip(reqs, bare) for r in pair]
    given, looked = [], []

    def call(i):
        t0, c0 = time.perf_counter(), time.thread_time()
        p.predict(bodies[i % len(bodies)])
        (looked if i % 2 else given).append((time.perf_counter() - t0, time.thread_time() - c0))

    for i in range(2 * n + 4):
        call(i)

    def pct(x):
        x = x[2:]
        c = _pct([b for _, b in x])
        return {**_pct([a for a, _ in x]), "cpu_p50_ms": c["p50_ms"], "cpu_p99_ms": c["p99_ms"]}
    return {"predictor": pct(looked), "predictor_given": pct(given)}


def _in_process(p, reqs: list[dict], n: int) -> dict:
    bodies = [json.dumps(r).encode() for r in reqs]
    return {**_timed(lambda i: p.predict(bodies[i % len(bodies)]), n), "runtime": p.runtime}


def main() -> None:
    a = _args()
    import torch

    torch.set_num_threads(1)
    os.sched_setaffinity(0, {a.server_core})  # the in-process baselines run where the server will
    work = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="opengem-serving-"))
    t_start, load_start = time.perf_counter(), os.getloadavg()
    artifact, data, built = _prepare(a, work)

    from opengem.export.artifact import load_manifest
    from opengem.export.client import free_port, wait_ready
    from opengem.export.predictor import Predictor
    from opengem.features.schema import FeatureSchema

    schema = FeatureSchema.load(artifact / "schema.json")
    manifest = load_manifest(artifact)
    cands = [int(x) for x in a.candidates.split(",")]
    concs = [int(x) for x in a.concurrency.split(",")]
    table_dtype = manifest.get("tables", {}).get("dtype", "fp32")
    domains = _vm_domains(schema) if "distilled" in built else None
    reqs = {c: _requests(schema, data, c, domains) for c in cands}
    model, predictor = _training_model(artifact, schema, table_dtype), Predictor(artifact)
    eager, inproc = {}, {}
    for c in cands:
        n = 10 if c >= 512 else (30 if a.quick else 100)
        eager[c] = _eager(model, schema, reqs[c], n)
        # p99 needs samples
        inproc[c] = _in_process(predictor, reqs[c], 4 * n if c >= 512 else 10 * n)
        print(f"C={c:4d}  eager p50 {eager[c]['p50_ms']:8.2f} ms   predictor ({predictor.runtime}) "
              f"p50 {inproc[c]['p50_ms']:8.2f} ms  p99 {inproc[c]['p99_ms']:8.2f} ms  "
              f"(CPU time p50 {inproc[c]['cpu_p50_ms']:.2f}, p99 {inproc[c]['cpu_p99_ms']:.2f} ms)",
              flush=True)
    del model
    store_dir, store_info = _history_store(data, work)
    lk = {}
    if store_dir is not None:
        from opengem.export.history import ArrowHistoryStore

        c = min(cands, key=lambda x: abs(x - 64))
        store = ArrowHistoryStore(store_dir, schema)
        lp, bare = Predictor(artifact, history=store), _bare(schema, reqs[c])
        n = 30 if a.quick else 100
        lk = {"candidates": c, **_paired(lp, reqs[c], bare, 10 * n),
              "only": _timed(lambda i: store.lookup(bare[i % len(bare)][schema.user_column],
                                                    bare[i % len(bare)][schema.time_column],
                                                    [s.name for s in schema.sequences]), 10 * n),
              "checked": _check_lookup(predictor, lp, reqs[c], bare)}
        print(f"C={c:4d}  predictor with lookup p50 {lk['predictor']['p50_ms']:8.2f} ms  p99 "
              f"{lk['predictor']['p99_ms']:8.2f} ms (histories in the request, alternated: p50 "
              f"{lk['predictor_given']['p50_ms']:.2f}, "
              f"p99 {lk['predictor_given']['p99_ms']:.2f})   "
              f"lookup alone p50 {lk['only']['p50_ms']:.3f} ms  "
              f"p99 {lk['only']['p99_ms']:.3f} ms  (max |Δp| vs request "
              f"histories {lk['checked']:.1e})", flush=True)
        del lp
    del predictor

    port = free_port()
    server = _start_server(artifact, port, a.server_core, store_dir)
    served = {}
    try:
        wait_ready(f"http://127.0.0.1:{port}", server, timeout=300)
        os.sched_setaffinity(0, {a.client_core})
        floor = _load(port, [], 1, a.seconds)  # GET /healthz: HTTP stack + the machine, no model
        print(f"GET /healthz (no model) concurrency 1: p50 {floor['p50_ms']:8.2f} ms  p99 "
              f"{floor['p99_ms']:8.2f} ms",
              flush=True)
        for c in cands:
            bodies = [json.dumps(r).encode() for r in reqs[c]]
            for k in concs:
                served[(c, k)] = r = _load(port, bodies, k, a.seconds)
                print(f"C={c:4d} concurrency {k:3d}: p50 {r['p50_ms']:8.2f} ms  p99 "
                      f"{r['p99_ms']:8.2f} ms  {r['rps']:8.1f} req/s  {r['rps'] * c:10.0f} "
                      f"candidates/s  errors {r['errors']}", flush=True)
        if lk:
            c = lk["candidates"]
            lk["served"] = r = _load_paired(port, [json.dumps(x).encode() for x in reqs[c]],
                                            [json.dumps(x).encode()
                                             for x in _bare(schema, reqs[c])], a.seconds)
            print(f"C={c:4d} concurrency   1, histories looked up by user id: p50 "
                  f"{r['looked_up']['p50_ms']:8.2f} ms  "
                  f"p99 {r['looked_up']['p99_ms']:8.2f} ms (alternated with the same requests "
                  f"carrying them: p50 {r['given']['p50_ms']:.2f}, p99 "
                  f"{r['given']['p99_ms']:.2f})  errors {r['errors']}", flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)

    out = {"model": a.model if not a.artifact else "artifact",
           "artifact": {"kind": manifest["model"]["kind"], "recipe": manifest["model"]["recipe"],
                        "parameters": manifest["model"]["parameters"]["total"],
                        "runtime": inproc[cands[0]]["runtime"],
                        "table_dtype": table_dtype, "layout": manifest["layout"]},
           "built": built, "requests": _shape(schema, reqs[cands[0]]),
           "cores": {"server": a.server_core, "client": a.client_core}, "server_threads": 1,
           "seconds_per_level": a.seconds}
    for c in cands:
        one = served[(c, concs[0])]
        out[f"p50_ms_{c}"], out[f"p99_ms_{c}"] = round(one["p50_ms"], 3), round(one["p99_ms"], 3)
        out[f"rps_{c}"] = round(max(served[(c, k)]["rps"] for k in concs), 1)
        out[f"speedup_vs_eager_{c}"] = round(eager[c]["p50_ms"] / one["p50_ms"], 2)
        out[f"eager_p50_ms_{c}"] = round(eager[c]["p50_ms"], 3)
        out[f"predictor_p50_ms_{c}"] = round(inproc[c]["p50_ms"], 3)
        out[f"predictor_p99_ms_{c}"] = round(inproc[c]["p99_ms"], 3)
        out[f"predictor_cpu_p99_ms_{c}"] = round(inproc[c]["cpu_p99_ms"], 3)
    if lk:
        c = lk["candidates"]
        for k in ("p50_ms", "p99_ms"):
            out[f"lookup_{k.split('_')[0]}_ms_{c}"] = round(lk["served"]["looked_up"][k], 3)
            out[f"lookup_given_{k.split('_')[0]}_ms_{c}"] = round(lk["served"]["given"][k], 3)
        for name, key in (("predictor", "predictor"), ("predictor_given", "predictor_given"),
                          ("only", "only")):
            for m in ("p50_ms", "p99_ms", "cpu_p50_ms", "cpu_p99_ms"):
                out[f"lookup_{name}_{m}_{c}"] = round(lk[key][m], 3)
        out["lookup_max_abs_diff"] = lk["checked"]
        out["errors_lookup"] = lk["served"]["errors"]
    out["history_store"] = store_info
    out["healthz_p50_ms"], out["healthz_p99_ms"] = round(floor["p50_ms"],
                                                         3), round(floor["p99_ms"], 3)
    out["levels"] = [{"candidates": c, "concurrency": k, **{m: round(v, 3) for m, v in r.items()}}
                     for (c, k), r in served.items()]
    out["errors"] = sum(r["errors"] for r in served.values())
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    out["loadavg_1m"] = {"start": round(load_start[0], 2), "end": round(os.getloadavg()[0], 2),
                         "cpus": os.cpu_count()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
