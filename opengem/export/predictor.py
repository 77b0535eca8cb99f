"""``Predictor``: an artifact's program behind raw-request scoring.

    p = Predictor("ARTIFACT")
    p.predict({"request_ts": …, "domain": 0, "user_id": 7, …, "candidates": [{"ad_id": 3, …}, …]})
    → {"model_version": "…", "tasks": ["click", "conversion"],
       "predictions": {"click": [0.031, …], "conversion": [0.0012, …]},      one per candidate, in order
       "oov": {"ad_id": 1}, "truncated": {"organic": 12}}                   ids / events repaired

One request = one user with many candidates: the user's sparse features and history are
embedded once and the candidates are scored together in one forward (``opengem.export.program``).
``score`` takes several parsed requests (a server's micro-batch) and still runs one forward.

With a history store (``history=``, ``opengem.export.history``) a request with ``user_id`` may leave
out a stream's history fields; they are read from the store at parse time (where the server
validates the request, before it joins a micro-batch, so the scoring thread never waits on a
lookup), and the response adds ``"looked_up": {stream: events}`` and ``"unknown_user": {stream: 1}``
(the store had no events of the user there: scored with an empty history). Fields given in the
request win, per stream.

Runtimes, best first (``runtime="auto"`` takes the first that loads): ``aoti`` (the AOTInductor
package, compiled for the exporting machine's CPU and torch build), ``exported`` (the portable
``torch.export`` program), ``eager`` (the model rebuilt from ``weights.pt`` and ``config.json``).
Probabilities are the model's: sigmoid of its logits, the quantity its log loss calibrates (the
calibration measured at export is in ``manifest["evaluation"]``).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from pydantic import ValidationError

from opengem.export.artifact import ArtifactError, load_manifest
from opengem.export.explain import BACKGROUND_FILE, RequestExplainer
from opengem.export.layout import Layout, assemble
from opengem.export.request import (
    Limits,
    ParsedRequest,
    RequestError,
    check_history,
    empty_history,
    error_from_validation,
    history_columns,
    parse,
    request_models,
)
from opengem.features.schema import SCHEMA_FILE, FeatureSchema

log = logging.getLogger("opengem.export")
RUNTIMES = ("aoti", "exported", "eager")


def read_background(root: Path, manifest: dict) -> list[dict] | None:
    """The artifact's explain background rows (hash checked), or None where it has none (an older
    artifact, or one exported without ``--data``)."""
    if BACKGROUND_FILE not in manifest.get("files", {}):
        return None
    load_manifest(root, verify=(BACKGROUND_FILE,))
    return json.loads((root / BACKGROUND_FILE).read_text())["rows"]


class Predictor:
    """Loads an artifact (hashes checked) and scores raw requests.

    Args:
        artifact_dir: a directory written by ``opengem export``.
        runtime: ``auto`` | ``aoti`` | ``exported`` | ``eager``.
        limits: per-request limits (candidates, history, multi-hot ids).
        history: a ``HistoryStore`` (``ArrowHistoryStore``, or a feature store's adapter) that fills the
            histories a request leaves out; its ``check`` runs against the artifact's schema here.
            Without one, every history field is required (422 otherwise).
    """

    def __init__(self, artifact_dir: str | Path, runtime: str = "auto",
                 limits: Limits | None = None,
                 history=None):
        self.root = Path(artifact_dir)
        self.manifest = load_manifest(self.root, verify=(SCHEMA_FILE,))
        self.schema = FeatureSchema.load(self.root / SCHEMA_FILE)
        self.layout = Layout(**self.manifest["layout"])
        self.tasks = self.schema.task_names
        self.version = self.manifest["model_version"]
        # artifacts before tables: fp32
        self.table_dtype = self.manifest.get("tables", {}).get("dtype", "fp32")
        self.limits = limits = limits or Limits()
        self.history = history
        if history is not None:
            history.check(self.schema)
        self.candidate_model, self.request_model = request_models(
            self.schema, limits, history is not None
        )
        self.program, self.runtime = self._load(runtime)
        self.explainer = RequestExplainer(self.schema, self.layout.max_seq_len,
                                          read_background(self.root, self.manifest),
                                          self._probs)

    # ------------------------------------------------------------------ loading
    def _load(self, runtime: str):
        if runtime not in ("auto",) + RUNTIMES:
            raise ValueError(f"runtime must be auto or one of {RUNTIMES}, got {runtime!r}")
        tries = [r for r in RUNTIMES if runtime in ("auto", r)]
        if runtime == "auto" and "program.aoti.pt2" not in self.manifest["files"]:
            tries.remove("aoti")
        errors = []
        for r in tries:
            try:
                return getattr(self, f"_load_{r}")(), r
            except Exception as e:  # a runtime that cannot load here falls through to the next
                if runtime != "auto" or isinstance(e, ArtifactError):
                    raise
                errors.append(f"{r}: {e}")
                log.warning("%s: runtime %s unavailable (%s); trying the next", self.root, r, e)
        raise ArtifactError(f"{self.root}: no runtime could load: {errors}")

    def _load_aoti(self):
        import torch._inductor

        load_manifest(self.root, verify=("program.aoti.pt2",))
        return AOTIProgram(torch._inductor.aoti_load_package(str(self.root / "program.aoti.pt2")))

    def _load_exported(self):
        load_manifest(self.root, verify=("program.pt2",))
        return torch.export.load(self.root / "program.pt2").module()

    def _load_eager(self):
        from opengem.config import Config
        from opengem.export.program import serving_module
        from opengem.export.tables import compress
        from opengem.model.build import build_gem, materialize

        if self.manifest["model"]["kind"] != "GEM":
            raise ArtifactError(f"eager runtime rebuilds GEM only, this artifact "
                                f"holds {self.manifest['model']['kind']}")
        load_manifest(self.root, verify=("weights.pt", "config.json"))
        cfg = Config.from_dict(json.loads((self.root / "config.json").read_text()))
        # weights.pt's format
        model = compress(materialize(build_gem(self.schema, cfg.model)), self.table_dtype)
        model.load_state_dict(torch.load(self.root / "weights.pt", weights_only=True))
        return serving_module(model.eval())

    # ------------------------------------------------------------------ scoring
    def parse(self, request: dict | bytes | str) -> ParsedRequest:
        """Validate one raw request (a dict, or JSON text); raises ``RequestError``."""
        try:
            if isinstance(request, (bytes, str)):
                m = self.request_model.model_validate_json(request)
            else:
                m = self.request_model.model_validate(request)
        except ValidationError as e:
            raise error_from_validation(e) from None
        p = parse(self.schema, m)
        if p.missing:
            self._fill(p)
        return p

    def _fill(self, p: ParsedRequest) -> None:
        """The streams ``p`` left out, from the store (a user it has not seen: empty, counted)."""
        if p.user_id is None:
            raise RequestError(422, self.schema.user_column, f"required when a history is left out "
                                                             f"(streams {list(p.missing)})")
        found = self.history.lookup(p.user_id, p.request_ts, p.missing)
        looked, unknown = {}, {}
        for s in self.schema.sequences:
            if s.name not in p.missing:
                continue
            cols = history_columns(s)
            if s.ts_column in found:
                p.sequences.update(check_history(self.schema, s, {c: found[c] for c in cols},
                                                 p.request_ts))
                looked[s.name] = len(p.sequences[s.ts_column])
            else:
                p.sequences.update(empty_history(s))
                unknown[s.name] = 1
        p.lookup = {"looked_up": looked, "unknown_user": unknown}

    @torch.inference_mode()
    def score(self, reqs: list[ParsedRequest]) -> list[dict]:
        """One forward over all candidates of all ``reqs``; one response per request, in order."""
        if not reqs:
            return []
        padded = reqs
        # the graph is traced for C ≥ 2: score a copy, drop it
        if sum(r.num_candidates for r in reqs) == 1:
            padded = [_doubled(reqs[0])] + reqs[1:]
        x, reports = assemble(self.schema, padded, self.layout)
        probs = self.program(x)
        probs = (probs[0] if isinstance(probs, (list, tuple)) else probs).float().numpy()
        out, start = [], 0
        for r, pr, rep in zip(reqs, padded, reports):
            p = probs[start:start + r.num_candidates]
            start += pr.num_candidates
            out.append({"model_version": self.version, "tasks": self.tasks,
                        "predictions": {t: p[:, j].tolist() for j, t in enumerate(self.tasks)},
                        **rep, **r.lookup})
            if r.explain:  # opt-in and costly: its own forwards, after the micro-batch's
                out[-1]["explanation"] = self.explainer.explain(r)
        return out

    @torch.inference_mode()
    def _probs(self, reqs: list[ParsedRequest]) -> np.ndarray:
        """Probabilities [candidates of all ``reqs``, T] of the program (the explainer's forward)."""
        padded = [_doubled(reqs[0])] + reqs[1:] if sum(r.num_candidates
                                                       for r in reqs) == 1 else reqs
        x, _ = assemble(self.schema, padded, self.layout)
        probs = self.program(x)
        probs = (probs[0] if isinstance(probs, (list, tuple)) else probs).double().numpy()
        return probs[reqs[0].num_candidates:] if padded is not reqs else probs

    def predict(self, request: dict | bytes | str) -> dict:
        return self.score([self.parse(request)])[0]

    def warmup(self, candidates: tuple[int, ...] = (1, 64)) -> float:
        """Run a few synthetic requests (first calls allocate); returns the seconds it took. They
        stay within the limits (a stream shorter than 8 events, a lower ``max_candidates``), or the
        server would fail to start."""
        from opengem.export.request import synthetic_request

        t0 = time.perf_counter()
        history = {s.name: min(8, self.limits.history(s)) for s in self.schema.sequences}
        for c in candidates:
            self.predict(synthetic_request(self.schema, min(c, self.limits.max_candidates), history,
                                           seed=c))
        return time.perf_counter() - t0


class AOTIProgram:
    """An AOTInductor package's model, called with the input dict in the order its call spec fixes.

    ``AOTICompiledModel.__call__`` deserialises its input and output tree specs from JSON and walks
    the inputs with pytree on every call (~0.05-0.1 ms of a ~1 ms VM forward at 64 candidates);
    here the specs are read once and the call goes straight to the package's ``boxed_run``.
    """

    def __init__(self, compiled):
        from torch.utils import _pytree as pytree

        self.compiled, self.loader, self.pytree = compiled, compiled.loader, pytree
        in_spec, self.out_spec = (pytree.treespec_loads(s) for s in self.loader.get_call_spec())
        args, kwargs = pytree.tree_unflatten(list(range(in_spec.num_leaves)), in_spec)
        if kwargs or len(args) != 1 or not isinstance(args[0], dict):
            raise ValueError(f"program.aoti.pt2 takes {in_spec}, not one dict of tensors")
        self.keys = sorted(args[0], key=args[0].get)  # leaf index of each input

    def __call__(self, x: dict[str, torch.Tensor]):
        return self.pytree.tree_unflatten(self.loader.boxed_run([x[k] for k in self.keys]),
                                          self.out_spec)


def _doubled(r: ParsedRequest) -> ParsedRequest:
    return replace(r, num_candidates=2 * r.num_candidates,
                   cand_sparse={k: (np.concatenate([v, v]), np.concatenate([n, n])) for k,
                                (v, n) in r.cand_sparse.items()},
                   cand_dense={k: np.concatenate([v, v]) for k, v in r.cand_dense.items()},
                   cand_embeddings={k: np.concatenate([v, v]) for k,
                                    v in r.cand_embeddings.items()})
