"""Serving: export a trained run to an artifact, score requests with a ``Predictor``, serve
over HTTP.

    artifact.py   export_run: weights + schema + torch.export program (+ AOTInductor) + manifest
    program.py    ServingGEM: the model as a function of plain tensors, user/history shared per request
    tables.py     the program's embedding tables: fp32, or TorchRec-quantised fp16 / int8 rows
    request.py    request JSON schema (from the FeatureSchema), validation, parsed form
    layout.py     parsed requests → program inputs (OOV, truncation, ages: the training path's code)
    predictor.py  Predictor: load an artifact, score requests
    explain.py    ``"explain": true``: occlusion explanations through the served program
    batcher.py    micro-batching worker that owns the predictor; atomic model swap
    server.py     FastAPI app and ``serve``
    client.py     a stdlib HTTP client of the server: free port, JSON call, wait until ready
"""

from opengem.export.artifact import ArtifactError, export_run, load_manifest
from opengem.export.predictor import Predictor
from opengem.export.request import Limits, RequestError

__all__ = ["ArtifactError", "Limits", "Predictor", "RequestError", "export_run", "load_manifest"]
