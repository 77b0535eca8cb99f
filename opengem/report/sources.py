"""What a report is made of, read from a run directory and the files next to it.

    RUN/metrics.jsonl      training records (``"loss"`` …) and, if a periodic evaluation wrote them,
                           held-out records ``{"step": S, "eval": {"<domain>/<task>": {"ne": …}, …}}``,
                           which the trainer writes with
                           ``train.eval_every`` (or ``eval_each_epoch``, ``eval_at``; ``opengem.train.hooks``).
    RUN/final.json         the summary block (absent while the run is training)
    RUN/base_rates.json    NE's normaliser: turns the per-slice training loss into training-batch NE
    evaluation JSON        ``--eval FILE``; else RUN/evaluation.json (a distilled student), else
                           RUN/../evaluation.json (``opengem demo``'s layout: DIR/run, DIR/evaluation.json,
                           DIR/explain.json: the explanations it names)
    benchmark outputs      ``--bench FILE``: benchmarks/transfer.py or benchmarks/scaling.py output
                           (the JSON object, or the whole log: its last JSON line is read), or
                           ``opengem outcomes --json``'s auction replay, or ``opengem explain
                           --json``'s explanations (their summary per group)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from opengem.run import BASE_RATES_FILE, EVALUATION_FILE, METRICS_FILE, load_final


@dataclass
class Sources:
    run: Path
    records: list[dict] = field(default_factory=list)  # training lines of metrics.jsonl
    evals: list[dict] = field(default_factory=list)  # periodic held-out evaluation lines
    final: dict | None = None
    base_rates: dict = field(default_factory=dict)
    evaluation: dict | None = None
    evaluation_file: str | None = None
    transfer: dict | None = None  # benchmarks/transfer.py's JSON
    scaling: dict | None = None  # benchmarks/scaling.py's JSON
    outcomes: dict | None = None  # opengem outcomes --json (opengem.world.replay)
    explanations: dict | None = None  # opengem explain --json (opengem.evaluation.explain)
    notes: list[str] = field(default_factory=list)  # what was missing or skipped


def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def read_jsonl(path: Path, notes: list[str]) -> list[dict]:
    """Parsed lines of a JSON-lines file; a line that does not parse (a run killed mid-write)
    is skipped."""
    if not path.exists():
        return []
    out, bad = [], 0
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                bad += 1
    if bad:
        notes.append(f"{path.name}: {bad} line(s) did not parse and were skipped")
    return out


def last_json(path: Path) -> dict:
    """The file as one JSON object, else its last line that is one (a benchmark's log)."""
    text = path.read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    for line in reversed(text.splitlines()):
        if line.lstrip().startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    raise ValueError(f"{path}: no JSON object in it (expected a benchmark's output)")


def _find_evaluation(run: Path) -> Path | None:
    if (run / EVALUATION_FILE).exists():
        return run / EVALUATION_FILE
    beside = run.parent / EVALUATION_FILE
    if beside.exists():
        owner = json.loads(beside.read_text()).get("run")
        if owner is None or Path(owner).name == run.name:
            return beside
    return None


def load_sources(run_dir: str | Path, evaluation: str | Path | dict | None = None,
                 benchmarks: list[str | Path] | tuple = ()) -> Sources:
    run = Path(run_dir)
    if not run.is_dir():
        raise ValueError(f"{run}: not a directory")
    src = Sources(run)
    lines = read_jsonl(run / METRICS_FILE, src.notes)
    src.records = [r for r in lines if "loss" in r and "step" in r]
    src.evals = [r for r in lines if "eval" in r and "step" in r]
    src.final = load_final(run)
    src.base_rates = _json(run / BASE_RATES_FILE) or {}
    if isinstance(evaluation, dict):
        src.evaluation, src.evaluation_file = evaluation, None
    else:
        path = Path(evaluation) if evaluation is not None else _find_evaluation(run)
        if path is not None:
            src.evaluation, src.evaluation_file = json.loads(path.read_text()), str(path)
    for b in benchmarks:
        obj = last_json(Path(b))
        if "r_kd" in obj and "rows" in obj:
            src.transfer = obj
        elif any(k.startswith("eps_") for k in obj):
            src.scaling = obj
        elif "totals" in obj and "vs_truth" in obj:
            src.outcomes = obj
        elif obj.get("method") == "occlusion" and "summary" in obj:
            src.explanations = obj
        else:
            src.notes.append(f"{Path(b).name}: neither benchmarks/transfer.py, "
                             f"benchmarks/scaling.py, opengem outcomes nor opengem explain "
                             f"output; left out")
    # the demo's own explanations, named by its evaluation (DIR/evaluation.json → DIR/explain.json)
    named = (src.evaluation or {}).get("explain", {}).get("file")
    if src.explanations is None and named and src.evaluation_file:
        path = Path(src.evaluation_file).parent / named
        if path.exists():
            src.explanations = json.loads(path.read_text())
        else:
            src.notes.append(f"{path}: the evaluation names it, but it is missing; explanations "
                             f"left out")
    return src
