"""``opengem export``: a trained run → a portable, versioned serving artifact.

Layout (every file hashed in the manifest; the predictor refuses a file whose hash differs)::

    ARTIFACT/
      manifest.json      format + version, model version, versions of the stack, layout, parity,
                         evaluation metrics at export time, file hashes
      schema.json        the FeatureSchema the model was trained on (the request format derives from it)
      config.json        the run's config (model architecture included)
      weights.pt         the model's state_dict in one process (DCP shards of any world size gathered;
                         with --table-dtype fp16|int8, the torchrec.quant tables' compressed rows)
      program.pt2        torch.export ExportedProgram of the serving module (plain tensors in, probabilities out)
      program.aoti.pt2   (optional) the same program compiled by AOTInductor for this CPU + torch build
      explain_background.json  (with --data) 16 train rows' user/context feature values: the
                         background ``"explain": true`` requests occlude them with (export/explain.py)

Preprocessing is not a separate file: it is the schema (vocabularies → OOV row, stream limits)
plus ``manifest.layout`` (the model's history cap and recent window), applied by the same code
as training (``opengem.export.layout``). The export checks the program against the training
model on requests that exercise OOV ids, truncation, empty histories and several users in one
micro-batch, and fails if any probability differs by more than ``PARITY_TOL``.

Export choices. ``torch.export`` (non-strict, dynamic in users, candidates, events and multi-hot
ids) is the portable program; its input is a dict of plain tensors because the KJT path of
``GEM.forward`` has data-dependent shapes (``length_per_key()``, ``lengths.max()``) and would
repeat each user's history per candidate. AOTInductor then compiles that program into a shared
library for this CPU and torch build (on by default; the fast runtime, several times faster than
running the exported graph op by op). Considered and not taken: TorchScript (in maintenance
upstream; scripting TorchRec's KJT path needs rewrites and gains nothing over AOTInductor),
ONNX (a second runtime, onnxruntime, to ship and keep equal), ``torchrec.ir`` serialisation of
KJT modules (covers embedding modules, not our jagged sequence ops; plain-tensor inputs make it
unnecessary).

Compressed tables (``table_dtype`` fp16 | int8, ``opengem export --table-dtype``): the trained
model's TorchRec tables are quantised by ``opengem.ops.quantize.quantize_tables`` before the
program is built, and the program reads the compressed rows (``opengem.export.tables``). The
parity check then compares the program with that quantised model run eagerly through TorchRec's
own quantised modules (to ``PARITY_TOL``), and records how far the quantised model is from the
fp32 one on the same requests (``parity.table_compression_max_abs_diff``: the cost of compression,
not an error). ``manifest.tables`` records the dtype and the bytes of the tables.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import platform
import shutil
import time
from importlib import metadata
from pathlib import Path
from unittest import mock

import pyarrow as pa
import torch
import torch.fx.experimental._config as fx_config

from opengem.checkpoint import BEST
from opengem.data.batch import collate
from opengem.evaluation.evaluate import evaluate_model
from opengem.export.explain import BACKGROUND_FILE, write_background
from opengem.export.layout import Layout, assemble
from opengem.export.program import serving_module
from opengem.export.request import Limits, parse, request_models, rows_of, synthetic_request
from opengem.export.tables import compress, tables_info
from opengem.features.schema import SCHEMA_FILE, FeatureSchema
from opengem.model.build import count_parameters
from opengem.ops.quantize import table_bytes
from opengem.run import (
    EVALUATION_FILE,
    load_base_rates,
    load_final,
    load_recalibration,
    load_run_model,
)

log = logging.getLogger("opengem.export")
FORMAT, FORMAT_VERSION = "opengem-artifact", 1
PARITY_TOL = 1e-5


class ArtifactError(RuntimeError):
    """An artifact is missing, incomplete, tampered with, or of an unsupported format."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def versions() -> dict:
    out = {"python": platform.python_version(), "machine": platform.machine()}
    for pkg in ("opengem", "torch", "torchrec", "fbgemm-gpu-cpu", "fbgemm-gpu", "numpy", "pyarrow"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def layout_of(model, cfg) -> Layout:
    return Layout(model.max_seq_len(), cfg.model.sequence.recent_len)


def example_requests(schema: FeatureSchema, layout: Layout, sizes: list[tuple[int, int]],
                     seed: int = 0, oov: bool = False) -> list[dict]:
    """Requests of (candidates, history events per stream); history −1 = twice the model's limit."""
    out = []
    for i, (c, h) in enumerate(sizes):
        hist = {s: 2 * n for s, n in layout.max_seq_len.items()} if h < 0 else h
        out.append(synthetic_request(schema, c, hist, seed=seed + i, oov=oov and i == 0))
    return out


def program_inputs(schema: FeatureSchema, layout: Layout, requests: list[dict]) -> dict:
    """The program's inputs of ``example_requests``. Their histories may exceed a stream's
    ``max_len`` (twice the model's limit, to exercise truncation): the request limit is theirs."""
    longest = max((len(r[s.ts_column]) for r in requests for s in schema.sequences), default=0)
    _, req_model = request_models(schema, Limits(max_history=max(longest, 1)))
    return assemble(schema, [parse(schema, req_model.model_validate(r)) for r in requests],
                    layout)[0]


def _dynamic_shapes(x: dict) -> dict:
    """Every dim dynamic except the recent window K and the dense, embedding and per-event value
    widths (fixed by the model)."""
    static = {("dense", 1), ("embeddings", 1)} | {(k, 1) for k in x
                                                  if k.endswith((".recent_idx", ".recent_valid"))
                                                  or k.startswith("seq_values.")}
    return {k: {i: (torch.export.Dim.STATIC if (k, i) in static else torch.export.Dim.AUTO)
                for i in range(v.dim())}
            for k, v in x.items()}


def export_program(module: torch.nn.Module, x: dict) -> torch.export.ExportedProgram:
    """torch.export, non-strict, dynamic in users, candidates, events and multi-hot ids.

    ``backed_size_oblivious`` stops export from specialising sizes 0 and 1 (a request with one
    user, or a user with no history, must run the same graph). Attention is traced as its math
    (``attention_math``: matmul, softmax, matmul) instead of ``F.scaled_dot_product_attention``,
    for the trace only (the model's own forward is unchanged; ``parity`` checks the two agree):
    the towers attend over a dozen tokens per candidate, where the CPU flash-attention kernel
    that AOTInductor calls costs ~110 µs a call (6 calls per VM forward, one core), while the
    math compiles into the graph's own loops (the VM's program at 64 candidates: 1.15 → 0.95 ms).
    """
    with fx_config.patch(backed_size_oblivious=True), torch.no_grad(), \
            mock.patch("torch.nn.functional.scaled_dot_product_attention", attention_math):
        return torch.export.export(module, (x,), dynamic_shapes=(_dynamic_shapes(x),), strict=False)


def attention_math(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
    """``F.scaled_dot_product_attention`` (eval: no dropout; no causal flag) as matmul,
    softmax, matmul."""
    if is_causal or dropout_p or enable_gqa:
        raise NotImplementedError("the serving trace supports plain attention with an "
                                  "optional mask only")
    s = torch.matmul(q, k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if attn_mask is not None:
        s = (
            s.masked_fill(~attn_mask, float("-inf"))
            if attn_mask.dtype == torch.bool
            else s + attn_mask
        )
    return torch.matmul(torch.softmax(s, dim=-1), v)


@torch.no_grad()
def parity(model, schema: FeatureSchema, layout: Layout, programs: dict, fp32_model=None) -> dict:
    """max |Δp| of each program vs the training model's forward on the same rows (collated);
    ``fp32_model``: also max |Δp| of ``model`` (tables compressed) vs the uncompressed one."""
    # the first request's histories are twice the limit, so the batch holds full recent windows, as
    # training batches do (see opengem.export.layout on why that matters for the reference)
    reqs = example_requests(schema, layout, [(3, -1), (2, 0), (5, 7), (4, 1)], seed=11, oov=True)
    x = program_inputs(schema, layout, reqs)
    rows = [r for req in reqs for r in rows_of(schema, req)]
    batch = collate(pa.Table.from_pylist(rows), schema, layout.max_seq_len)
    ref = torch.sigmoid(model(batch).double())
    out = {"requests": len(reqs), "candidates": len(rows),
           "reference": "training model on collated rows"}
    for name, fn in programs.items():
        out[f"max_abs_diff_{name}"] = float((fn(x).double() - ref).abs().max())
    if fp32_model is not None:
        out["reference"] += " (tables compressed, TorchRec's quantised modules)"
        out["table_compression_max_abs_diff"] = float((torch.sigmoid(fp32_model(batch).double())
                                                       - ref).abs().max())
    return out


def find_evaluation(run: Path) -> dict | None:
    """An evaluation.json of this run (in the run or beside it, as ``opengem demo`` writes it)."""
    for p in (run / EVALUATION_FILE, run.parent / EVALUATION_FILE):
        if p.exists():
            ev = json.loads(p.read_text())
            if Path(ev.get("run", "")).resolve() == run.resolve():
                return {"source": p.name, "split": ev.get("split"), "metrics": ev.get("metrics")}
    return None


def export_run(run_dir: str | Path, out_dir: str | Path, data_dir: str | Path | None = None,
               split: str = "test", compile: bool = True, overwrite: bool = False,
               table_dtype: str = "fp32", best: bool = False) -> dict:
    """Write the artifact of a run's latest checkpoint (with ``best``, of its best held-out
    evaluation's, ``train.keep_best``); returns the manifest.

    ``data_dir``: evaluate on ``split`` now and record the metrics (otherwise an ``evaluation.json``
    of the run is recorded if one exists). ``compile``: also build the AOTInductor package.
    ``table_dtype``: fp32 | fp16 | int8 embedding tables in the artifact (see the module docstring).
    """
    run, out = Path(run_dir), Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ArtifactError(f"{out} exists and is not empty (artifacts are immutable; pick a "
                            f"new directory)")
    model, cfg, schema = load_run_model(run, best=best)
    if cfg.model.arch != "gem":
        raise ArtifactError(f"{run}: model.arch={cfg.model.arch} is a peer baseline; only GEM "
                            f"runs (and the "
                            "vertical models distilled from them) export")
    layout = layout_of(model, cfg)
    fp32_model, fp32_bytes, parameters = None, table_bytes(model), count_parameters(model)
    if table_dtype != "fp32":
        fp32_model = copy.deepcopy(model)
    model = compress(model, table_dtype)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    schema.save(tmp / SCHEMA_FILE)
    (tmp / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    torch.save(model.state_dict(), tmp / "weights.pt")

    module = serving_module(model)
    t0 = time.perf_counter()
    ep = export_program(module,
                        program_inputs(schema, layout,
                                       example_requests(schema, layout, [(3, 23), (5, 11)])))
    torch.export.save(ep, tmp / "program.pt2")
    times = {"export_s": time.perf_counter() - t0}
    programs = {"exported": torch.export.load(tmp / "program.pt2").module()}
    aoti_error = None
    if compile:
        t1 = time.perf_counter()
        try:
            programs["aoti"] = compile_aoti(ep, tmp / "program.aoti.pt2")
            times["compile_s"] = time.perf_counter() - t1
        except Exception as e:  # noqa: BLE001 - no compiler here: the portable program still serves
            aoti_error = f"{type(e).__name__}: {str(e)[:300]}"
            (tmp / "program.aoti.pt2").unlink(missing_ok=True)
            log.warning("AOTInductor compile failed, the artifact has the exported program "
                        "only: %s", aoti_error)
    check = parity(model, schema, layout, programs, fp32_model)
    worst = max(v for k, v in check.items() if k.startswith("max_abs_diff"))
    if not worst <= PARITY_TOL:
        raise ArtifactError(f"serving program differs from the training model by {worst:.3g} "
                            f"> {PARITY_TOL} ({check}); opengem/export/program.py no longer "
                            f"matches the model")

    evaluation = None
    if data_dir is not None:
        write_background(data_dir, schema, tmp / BACKGROUND_FILE)
        ev = evaluate_model(model, schema, data_dir, split, load_base_rates(run), progress=False)
        evaluation = {"source": f"evaluated at export on split {split!r}", "split": split,
                      "metrics": ev["metrics"]}
    else:
        evaluation = find_evaluation(run)
    final = load_final(run) or {}
    recalibration = load_recalibration(run)
    files = {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size}
             for p in sorted(tmp.iterdir())}
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model_version": hashlib.sha256(
            (files["program.pt2"]["sha256"]
             + files["weights.pt"]["sha256"]).encode()).hexdigest()[:16],
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": {"kind": type(model).__name__, "recipe": cfg.recipe, "parameters": parameters,
                  "schema_fingerprint": schema.fingerprint(), "tasks": schema.task_names},
        "run": {"name": run.name, "checkpoint": BEST if best else final.get("checkpoint"),
                "steps": final.get("steps"),
                # of the last checkpoint, before any recalibration: none recorded for the best one
                "params_sha256": None if best else final.get("params_sha256"),
                "recalibration": recalibration["offsets"] if recalibration is not None else None,
                "recalibration_slopes": (recalibration or {}).get("slopes")},
        "layout": layout.to_dict(),
        "tables": tables_info(model, table_dtype, fp32_bytes),
        "export": {"method": "torch.export (non-strict, dynamic shapes)",
                   "aoti": "aoti" in programs, "aoti_error": aoti_error, **times},
        "parity": check,
        "evaluation": evaluation,
        "versions": versions(),
        "files": files,
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return manifest


def compile_aoti(ep: torch.export.ExportedProgram, path: Path):
    """AOTInductor: the exported program compiled to a shared library for this CPU (a C++ compiler
    is needed)."""
    import torch._inductor  # heavy (the compiler stack): imported only when compiling

    torch._inductor.aoti_compile_and_package(ep, package_path=str(path))
    return torch._inductor.aoti_load_package(str(path))


def load_manifest(artifact_dir: str | Path,
                  verify: tuple[str, ...] = (SCHEMA_FILE, "program.pt2")) -> dict:
    """The manifest of an artifact, after checking its format and the hashes of the files
    in ``verify``."""
    root = Path(artifact_dir)
    p = root / "manifest.json"
    if not p.exists():
        raise ArtifactError(f"{root}: no manifest.json (not an opengem artifact)")
    try:
        manifest = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{p}: not valid JSON ({e})") from e
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{root}: format "
                            f"{manifest.get('format')!r} v{manifest.get('format_version')} "
                            f"not supported (expected {FORMAT!r} v{FORMAT_VERSION})")
    for name in verify:
        entry = manifest.get("files", {}).get(name)
        if entry is None or not (root / name).exists():
            raise ArtifactError(f"{root}: {name} is missing")
        if sha256_file(root / name) != entry["sha256"]:
            raise ArtifactError(f"{root}: {name} does not match its sha256 in the manifest "
                                f"(corrupt or modified)")
    return manifest
