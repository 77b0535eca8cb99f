"""What an explanation costs: ``"explain": true`` on a served request, and ``opengem explain``
offline, on the models ``benchmarks/serving.py`` builds.

    python benchmarks/explain.py --quick                 the default VM (distilled), demo world of
                                                         1,000 users (serving.py --quick's build)
    python benchmarks/explain.py --out DIR               reuse DIR's build if it is there

Serving: in-process ``Predictor.predict`` on one torch thread, requests of ``--candidates``
candidates from test rows of the VM's surface, with and without ``explain``; the artifact is
serving.py's (exported without ``--data``), so the explainer is given the background rows
``opengem export --data`` would have written (16 train rows, seed 0). Offline: ``explain_run`` on
``--rows`` test rows of the teacher GEM run and of the VM. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving  # the same build as the serving figures


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a 1,000-user world (else 3,000)")
    p.add_argument("--out", default=None, help="working directory (reused when it holds a build)")
    p.add_argument("--candidates", type=int, default=64)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--rows", type=int, default=32, help="offline: test rows explained")
    p.add_argument("--no-compile", action="store_true", help="export without AOTInductor")
    return p.parse_args()


def _ms(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    import torch

    from opengem.evaluation.explain import background_rows, explain_run, feature_groups
    from opengem.export import Predictor
    from opengem.export.explain import RequestExplainer

    a = _args()
    torch.set_num_threads(1)
    work = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="opengem-explain-"))
    build = SimpleNamespace(model="vm", data=None, artifact=None, users=1000 if a.quick else 3000,
                            recipe="demo", teacher_recipe="tiny", student_recipe=None, steps=20,
                            no_compile=a.no_compile, table_dtype="fp32")
    if (work / "artifact" / "manifest.json").exists():
        build.data, build.artifact = str(work / "data"), str(work / "artifact")
    art, data, built = serving._prepare(build, work)
    pred = Predictor(art)
    schema = pred.schema
    names = [n for n, _, side in feature_groups(schema) if side != "ad"]
    bg = background_rows(data, schema, 16, 0).select(names).to_pylist()
    pred.explainer = RequestExplainer(schema, pred.layout.max_seq_len, bg, pred._probs)
    reqs = serving._requests(schema, data, a.candidates, serving._vm_domains(schema), a.requests)
    pred.predict(reqs[0])
    pred.predict({**reqs[0], "explain": True})
    plain = [t for r in reqs for t in _ms(lambda r=r: pred.predict(r), 3)]
    explained, sizes = [], []
    for r in reqs:
        t0 = time.perf_counter()
        ex = pred.predict({**r, "explain": True})["explanation"]
        explained.append((time.perf_counter() - t0) * 1e3)
        sizes.append(ex["candidates_scored"])
    out = {"bench": "explain", "built": built, "runtime": pred.runtime,
           "candidates": a.candidates, "requests": len(reqs),
           "serving": {"plain_p50_ms": round(float(np.median(plain)), 2),
                       "explain_p50_ms": round(float(np.median(explained)), 1),
                       "explain_max_ms": round(float(np.max(explained)), 1),
                       "candidates_scored_mean": int(np.mean(sizes)),
                       "events": {s.name: int(np.mean([len(r[s.ts_column]) for r in reqs]))
                                  for s in schema.sequences}}}
    rows = list(range(a.rows))
    for name, run in (("teacher_gem", work / "run"), ("vm", work / "vm")):
        ex = explain_run(run, data, rows=rows)
        out[f"offline_{name}"] = {"rows": len(rows), "ms_per_row": round(ex.ms_per_row, 1),
                                  "forwards_per_row": ex.forwards_per_row}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
