"""``serve_smoke``: the demo's last step — export a run, start ``opengem serve``, score one request, stop."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from opengem.export.artifact import export_run
from opengem.export.request import synthetic_request
from opengem.features.schema import FeatureSchema


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: dict | None = None, timeout: float = 10.0) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def wait_ready(url: str, proc: subprocess.Popen | None = None, timeout: float = 120.0) -> float:
    """Seconds until ``url``/readyz answers 200; raises if the server exits or the time runs out."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was ready")
        try:
            if http("GET", f"{url}/readyz", timeout=2.0)[0] == 200:
                return time.perf_counter() - t0
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout:.0f} s")


def serve_smoke(run_dir: str | Path, artifact_dir: str | Path, compile: bool = True, candidates: int = 8) -> dict:
    """Export ``run_dir`` to ``artifact_dir`` (replacing it), serve it on a free loopback port, score
    one request of ``candidates`` ads, stop the server with SIGTERM. Returns the response and timings."""
    t0 = time.perf_counter()
    manifest = export_run(run_dir, artifact_dir, compile=compile, overwrite=True)
    times = {"export_s": time.perf_counter() - t0}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "opengem", "--quiet", "serve", "--artifact", str(artifact_dir), "--port", str(port)]
    status, response, runtime = 0, {}, None
    with tempfile.TemporaryFile() as log:  # a file, not a pipe: a chatty server never blocks on a full pipe
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env={**os.environ})
        try:
            times["startup_s"] = wait_ready(url, proc)
            runtime = http("GET", f"{url}/readyz")[1].get("runtime")
            schema = FeatureSchema.load(Path(artifact_dir) / "schema.json")
            t1 = time.perf_counter()
            status, response = http("POST", f"{url}/v1/score", synthetic_request(schema, candidates, 20, seed=1))
            times["request_ms"] = (time.perf_counter() - t1) * 1e3
        finally:
            t2 = time.perf_counter()
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            times["shutdown_s"] = time.perf_counter() - t2
            log.seek(0)
            stderr = log.read().decode(errors="replace")[-2000:]
    if status != 200:
        raise RuntimeError(f"smoke request failed with {status}: {response}\n{stderr}")
    return {"artifact": str(artifact_dir), "model_version": manifest["model_version"], "url": url,
            "status": status, "response": response, "exit_code": code, "times": times,
            "runtime": runtime}
