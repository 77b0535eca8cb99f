"""A plain HTTP client of ``opengem serve`` (stdlib only): a free port, one JSON call, waiting
until ready.

Used by the demo's serving step (``opengem.pipeline.serve_smoke``), the tests
and benchmarks/serving.py.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: dict | None = None,
         timeout: float = 10.0) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"content-type": "application/json"})
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
