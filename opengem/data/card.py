"""The dataset card: what a dataset holds, in one small JSON object a person can read before
training on it (``docs/dataset-layout.md``, "Dataset card").

``dataset_card`` reads a few columns of every impression shard (day, domain, request time, labels)
and the manifest: its sources, time range, rows and label rates per split and surface, the
quarantines and drops the import counted, and the deletions ``opengem forget`` recorded. The
importer and ``forget`` store it in the manifest (``card``); ``opengem report --data`` prints it.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from opengem.data.parquet import DatasetManifest
from opengem.features.schema import FeatureSchema

# words in the import's counts (manifest ``source``) that name rows or events left out or mapped
_QUARANTINE_WORDS = ("dropped", "quarantin", "missing", "oov", "out_of_range", "non_finite")


def dataset_card(data_dir: str | Path, manifest: DatasetManifest | None = None,
                 schema: FeatureSchema | None = None) -> dict:
    """The card of the dataset at ``data_dir`` (its manifest and schema loaded if not given)."""
    manifest = manifest or DatasetManifest.load(data_dir)
    schema = schema or FeatureSchema.load(data_dir)
    split_of = {d: s for s, days in manifest.splits.items() for d in days}
    rows: dict[str, dict[str, int]] = {}
    positives: dict[str, dict[str, dict[str, int]]] = {}
    lo, hi = None, None
    labels = {t.name: t.label_column for t in schema.tasks}
    for f in manifest.files:
        t = pq.read_table(Path(data_dir) / f.path,
                          columns=[schema.domains.column, schema.time_column, *labels.values()])
        if not t.num_rows:
            continue
        split = split_of.get(f.day, f"day {f.day}")
        ts = t.column(schema.time_column).to_numpy()
        lo, hi = min(lo, int(ts.min())) if lo is not None else int(ts.min()), \
            max(hi, int(ts.max())) if hi is not None else int(ts.max())
        dom = t.column(schema.domains.column).to_numpy()
        for d in np.unique(dom):
            name, m = _domain_name(schema, int(d)), dom == d
            rows.setdefault(split, {})[name] = rows.get(split, {}).get(name, 0) + int(m.sum())
            pos = positives.setdefault(split, {}).setdefault(name, {})
            for task, col in labels.items():
                y = np.asarray(t.column(col).to_numpy(zero_copy_only=False), dtype=np.float64)[m]
                pos[task] = pos.get(task, 0) + int((y > 0.5).sum())
    return {"sources": _sources(manifest, schema), "time_range": _time_range(lo, hi),
            "rows": rows, "label_rates": _rates(rows, positives),
            "events": {s: sum(e.rows for e in es) for s, es in manifest.events.items()},
            "quarantines": _quarantines(manifest.source), "deletions": _deletions(manifest)}


def _domain_name(schema: FeatureSchema, d: int) -> str:
    names = schema.domains.names
    return names[d] if 0 <= d < len(names) else f"domain {d}"


def _sources(manifest: DatasetManifest, schema: FeatureSchema) -> dict:
    """The kind of source and its input file names (names only: no machine's paths)."""
    src = manifest.source
    out = {"kind": src.get("kind") or schema.meta.get("source") or "synthetic",
           "layout": manifest.layout,
           "files": [Path(f).name for f in src.get("files", [])]}
    if "pseudonym" in src:
        out["user_ids"] = f"pseudonymised ({src['pseudonym']['hash']}, keyed)"
    return out


def _time_range(lo: int | None, hi: int | None) -> dict:
    if lo is None:
        return {}

    def iso(t: int) -> str:
        return dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="seconds")

    return {"first": iso(lo), "last": iso(hi), "first_ts": lo, "last_ts": hi}


def _rates(rows: dict, positives: dict) -> dict:
    return {s: {d: {task: round(p / rows[s][d], 6) for task, p in tasks.items()}
                for d, tasks in doms.items()} for s, doms in positives.items()}


def _quarantines(source: dict, prefix: str = "") -> dict:
    """Every count in the import's record whose name says rows or events were left out, mapped to
    OOV or kept missing (``source.storage``, ``source.missing``), flattened to dotted names."""
    out = {}
    for k, v in source.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            inner = _quarantines(v, name + ".")
            if prefix == "" and k == "missing":  # dense values kept missing, per feature
                inner = {f"missing.{f}": n for f, n in v.items() if isinstance(n, int)}
            out |= inner
        elif isinstance(v, int) and not isinstance(v, bool) and any(
                w in k.lower() for w in _QUARANTINE_WORDS):
            out[name] = v
    return out


def _deletions(manifest: DatasetManifest) -> dict:
    d = manifest.deletions
    return {"forgets": len(d), "users": sum(r.get("users_found", 0) for r in d),
            "impressions": sum(r.get("impressions_removed", 0) for r in d),
            "events": sum(sum(r.get("events_removed", {}).values()) for r in d),
            "last": d[-1]["time"] if d else None}


def card_lines(card: dict) -> list[str]:
    """The card as short text lines (the report's section, logs)."""
    src, tr = card.get("sources", {}), card.get("time_range", {})
    out = [f"source: {src.get('kind')} (layout v{src.get('layout')}), files "
           f"{', '.join(src.get('files', [])) or '-'}"
           + (f"; user ids {src['user_ids']}" if "user_ids" in src else ""),
           f"time range: {tr.get('first', '-')} to {tr.get('last', '-')}"]
    for split, doms in card.get("rows", {}).items():
        for d, n in doms.items():
            rates = card.get("label_rates", {}).get(split, {}).get(d, {})
            out.append(f"{split} / {d}: {n} rows, label rates "
                       + ", ".join(f"{t} {r:.4f}" for t, r in rates.items()))
    if card.get("events"):
        out.append("events: " + ", ".join(f"{s} {n}" for s, n in card["events"].items()))
    q = card.get("quarantines", {})
    out.append("quarantined / dropped: " + (", ".join(f"{k} {v}" for k, v in q.items()) or "none"))
    d = card.get("deletions", {})
    out.append(f"deletions: {d.get('forgets', 0)} forget runs, {d.get('users', 0)} users, "
               f"{d.get('impressions', 0)} impressions, {d.get('events', 0)} events"
               + (f" (last {d['last']})" if d.get("last") else ""))
    return out
