"""``opengem serve``: the HTTP server in front of a ``Predictor`` (FastAPI on uvicorn).

    POST /v1/score        one request (user + candidates) → probabilities per task and candidate
    GET  /healthz         liveness: the process and its scoring thread are up
    GET  /readyz          readiness: model loaded and warmed, not shutting down (503 otherwise)
    GET  /metrics         Prometheus text: latency histogram, requests and errors by route and status,
                          micro-batch sizes, forward time, model version
    POST /admin/reload    {"artifact": DIR}: load, check and warm a new artifact, then swap it in
    GET  /openapi.json    the API (request fields generated from the artifact's FeatureSchema)

Why FastAPI + uvicorn: the request schema is generated from the FeatureSchema as pydantic models,
which give validation with field-level messages and the OpenAPI spec from one definition; uvicorn
is the reference ASGI server and drains open requests on SIGTERM. The heavy work is one forward
per micro-batch in a worker thread, so the server framework is not the bottleneck (its cost is
measured by benchmarks/serving.py). TorchServe (archived), Triton (its own server binary and
model format) and Ray Serve (a cluster runtime) add a second process model for no gain on one
machine.

Errors: every bad request gets a 4xx JSON body ``{"error": {"status", "field", "message"}}``:
400 malformed JSON, 413 too large (body, candidates, history, multi-hot), 422 wrong or missing
fields; a hot reload that fails is a 400/409 and leaves the old model serving.

History store (``serve --history STORE``, ``opengem.export.history``): opened once, memory-mapped,
shared by every model a hot reload swaps in (reload keeps the schema, so the store still fits).
"""

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import BaseModel, Field

from opengem.export.artifact import ArtifactError
from opengem.export.batcher import MicroBatcher
from opengem.export.predictor import Predictor
from opengem.export.request import Limits, RequestError, error_from_validation

log = logging.getLogger("opengem.export")
ROUTES = ("/v1/score", "/healthz", "/readyz", "/metrics", "/admin/reload", "/openapi.json", "/docs")
_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25,
            0.5, 1.0, 2.5)


class ScoreResponse(BaseModel):
    model_version: str
    tasks: list[str]
    predictions: dict[str, list[float]] = Field(description="task → probability per candidate, in "
                                                            "request order")
    oov: dict[str, int] = Field(description="feature → ids outside its vocabulary (scored through "
                                            "its OOV row)")
    truncated: dict[str, int] = Field(description="stream → oldest events dropped past the model's "
                                                  "history limit")
    looked_up: dict[str, int] | None = Field(
        None,
        description="with a history store: stream → events read "
        "for the streams the request left out",
    )
    unknown_user: dict[str, int] | None = Field(
        None,
        description="with a history store: stream → 1 where the "
        "store has no events of the user (empty history)",
    )
    explanation: dict | None = Field(
        None,
        description='with "explain": true: per candidate, each input group\'s and the top '
        "history events' contribution to its logits (occlusion, opengem.export.explain)",
    )


class ErrorDetail(BaseModel):
    status: int
    field: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ReloadRequest(BaseModel):
    artifact: str = Field(description="directory of the new artifact (same feature schema)")


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.latency = Histogram("opengem_request_duration_seconds", "request latency", ["route"],
                                 buckets=_BUCKETS, registry=r)
        self.requests = Counter("opengem_requests", "requests by route and status",
                                ["route", "status"], registry=r)
        self.errors = Counter("opengem_request_errors", "4xx/5xx responses", ["route", "status"],
                              registry=r)
        self.batch_requests = Histogram("opengem_batch_requests", "requests per forward",
                                        registry=r, buckets=(1, 2, 4, 8, 16, 32, 64))
        self.batch_candidates = Histogram("opengem_batch_candidates", "candidates per forward",
                                          registry=r,
                                          buckets=(1, 8, 64, 256, 512, 1024, 2048, 4096))
        self.forward = Histogram("opengem_forward_seconds", "one micro-batch: preprocess + forward",
                                 registry=r, buckets=_BUCKETS)
        self.model = Gauge("opengem_model_info", "the model being served", ["version", "runtime"],
                           registry=r)
        self.reloads = Counter("opengem_reloads", "hot reloads by result", ["result"], registry=r)

    def on_batch(self, n_requests: int, n_candidates: int, seconds: float) -> None:
        self.batch_requests.observe(n_requests)
        self.batch_candidates.observe(n_candidates)
        self.forward.observe(seconds)

    def set_model(self, p: Predictor) -> None:
        self.model.clear()
        self.model.labels(p.version, p.runtime).set(1)


class BodyTooLarge(Exception):
    pass


class EdgeMiddleware:
    """Pure ASGI: latency/status metrics for every request, and the body-size limit (413)."""

    def __init__(self, app, metrics: Metrics, max_body: int):
        self.app, self.metrics, self.max_body = app, metrics, max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status, seen = time.perf_counter(), [500], [0]
        route = scope["path"] if scope["path"] in ROUTES else "other"

        async def send_(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        async def receive_():
            msg = await receive()
            seen[0] += len(msg.get("body", b""))
            if seen[0] > self.max_body:
                raise BodyTooLarge
            return msg

        try:
            length = dict(scope["headers"]).get(b"content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body:
                raise BodyTooLarge
            await self.app(scope, receive_, send_)
        except BodyTooLarge:
            err = RequestError(413, "body", f"request body over {self.max_body} bytes")
            await _error_response(err)(scope, receive, send_)
        finally:
            dt = time.perf_counter() - t0
            self.metrics.latency.labels(route).observe(dt)
            self.metrics.requests.labels(route, str(status[0])).inc()
            if status[0] >= 400:
                self.metrics.errors.labels(route, str(status[0])).inc()


def _error_response(e: RequestError) -> JSONResponse:
    return JSONResponse({"error": {"status": e.status, "field": e.field, "message": e.message}},
                        status_code=e.status)


def create_app(artifact: str | Path, runtime: str = "auto", limits: Limits | None = None,
               window_ms: float = 2.0, max_batch_candidates: int = 2048,
               max_body_bytes: int = 16 << 20,
               admin: bool = True, history=None) -> FastAPI:
    """The ASGI app serving ``artifact``; the model loads now, warms up and starts scoring at
    startup. ``history``: a ``HistoryStore`` (or a store directory) that fills histories a request
    leaves out."""
    limits = limits or Limits()
    if isinstance(history, (str, Path)):
        from opengem.export.history import ArrowHistoryStore
        from opengem.features.schema import SCHEMA_FILE, FeatureSchema

        history = ArrowHistoryStore(history, FeatureSchema.load(Path(artifact) / SCHEMA_FILE))
    predictor = Predictor(artifact, runtime, limits, history)
    metrics = Metrics()
    batcher = MicroBatcher(predictor, window_ms / 1e3, max_batch_candidates, metrics.on_batch)
    status = {"ready": False, "draining": False}
    reload_lock = asyncio.Lock()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await asyncio.to_thread(predictor.warmup)
        batcher.start()
        metrics.set_model(predictor)
        status["ready"] = True
        log.info("serving %s (model %s, runtime %s)", artifact, predictor.version,
                 predictor.runtime)
        yield
        status["ready"] = False
        await asyncio.to_thread(batcher.stop)

    app = FastAPI(title="OpenGEM scoring", version="1", lifespan=lifespan,
                  description="Scores candidate ads for one request with a model exported by "
                              "`opengem export`.")
    app.state.batcher, app.state.metrics, app.state.status = batcher, metrics, status
    app.add_middleware(EdgeMiddleware, metrics=metrics, max_body=max_body_bytes)
    errors = {c: {"model": ErrorResponse} for c in (400, 413, 422)}

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return _error_response(error_from_validation(list(exc.errors())))

    @app.post(
        "/v1/score",
        responses={200: {"model": ScoreResponse}, **errors},
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ScoreRequest"}}
                },
            }
        },
    )
    async def score(request: Request):
        """Probabilities per task for each candidate of one request (see ScoreRequest for
        the fields)."""
        batcher.incoming += 1
        try:
            parsed = batcher.predictor.parse(await request.body())
            fut = batcher.submit(parsed)
        except RequestError as e:
            return _error_response(e)
        finally:
            batcher.incoming -= 1
        return Response(json.dumps(await fut, allow_nan=False), media_type="application/json")

    @app.get("/healthz")
    async def healthz():
        ok = batcher.alive()
        return JSONResponse({"status": "ok" if ok else "scoring thread down"},
                            status_code=200 if ok else 503)

    @app.get("/readyz")
    async def readyz():
        p = batcher.predictor
        ready = status["ready"] and not status["draining"] and batcher.alive()
        body = {"ready": ready, "model_version": p.version, "runtime": p.runtime}
        if not ready:
            body["reason"] = "shutting down" if status["draining"] else "starting"
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if admin:
        @app.post("/admin/reload", responses=errors | {409: {"model": ErrorResponse}})
        async def reload(body: ReloadRequest):
            """Load, check and warm a new artifact, then swap it in; requests in flight finish on
            the old one."""
            async with reload_lock:
                current, t0 = batcher.predictor, time.perf_counter()
                try:
                    new = await asyncio.to_thread(_load_warm, body.artifact, runtime, limits,
                                                  history)
                except Exception as e:  # noqa: BLE001 - any failure leaves the old model serving
                    metrics.reloads.labels("failed").inc()
                    msg = (
                        str(e)
                        if isinstance(e, ArtifactError)
                        else f"cannot load: {type(e).__name__}: {e}"
                    )
                    return _error_response(RequestError(400, "artifact", msg[:500]))
                if new.schema.fingerprint() != current.schema.fingerprint():
                    metrics.reloads.labels("refused").inc()
                    return _error_response(RequestError(409, "artifact",
                                                        "its feature schema differs from the one "
                                                        "served (the request format would change): "
                                                        "deploy a new server"))
                batcher.swap(new)
                metrics.set_model(new)
                metrics.reloads.labels("ok").inc()
                return {"previous": current.version, "current": new.version, "runtime": new.runtime,
                        "load_s": round(time.perf_counter() - t0, 3)}

    def openapi() -> dict:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, description=app.description,
                               routes=app.routes)
            comps = spec.setdefault("components", {}).setdefault("schemas", {})
            js = predictor.request_model.model_json_schema(
                by_alias=True, ref_template="#/components/schemas/{model}"
            )
            comps.update(js.pop("$defs", {}))
            comps["ScoreRequest"] = js
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi
    return app


def _load_warm(artifact: str, runtime: str, limits: Limits, history=None) -> Predictor:
    p = Predictor(artifact, runtime, limits, history)
    p.warmup()
    return p


def serve(artifact: str | Path, host: str = "127.0.0.1", port: int = 8000, runtime: str = "auto",
          window_ms: float = 2.0, limits: Limits | None = None, admin: bool = True,
          log_level: str = "info", history: str | Path | None = None) -> None:
    """Run the server until SIGINT/SIGTERM, then stop taking connections, finish open
    requests, exit."""
    import uvicorn

    app = create_app(artifact, runtime, limits, window_ms, admin=admin, history=history)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            app.state.status["draining"] = True  # /readyz turns 503 while open requests finish
            super().handle_exit(sig, frame)
            # uvicorn re-raises the signal after draining (exit status -15); a drained stop exits 0
            getattr(self, "_captured_signals", []).clear()

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=30, lifespan="on")
    _Server(config).run()
