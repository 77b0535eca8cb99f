"""Explanations at serving time: ``"explain": true`` in a scoring request (off by default).

The method is ``opengem.evaluation.explain``'s occlusion, on a parsed request instead of Arrow rows:
each candidate's logit minus its logit with one input replaced, all the edited copies of the
request scored through the artifact's own program (so the served model is what is explained, its
compressed tables and compiled graph included). What serving lacks is a dataset to draw background
rows from, so:

- **ad-side features** take their background from the request's other candidates: for shift
  j = 1 … B' (B' = min(16, C − 1)), candidate c's feature is replaced by candidate (c + j) mod C's.
  The other candidates are what the model is choosing among, so "this ad's category instead of
  the others'" is the contribution a ranking question asks about. A request with one candidate
  has none: its ad features are reported unavailable.
- **user and context features** take theirs from ``explain_background.json``: rows of the train
  split's request-side fields (user, context) that ``opengem export --data DATA`` writes beside the
  model. It holds feature values of real training rows (no labels and no histories): a user id
  among the features would be stored too, so ``opengem forget`` users should re-export.
  An artifact without the file (older ones, or exported without ``--data``) still explains
  streams, events and ad features, and says the user/context features are unavailable.
- **streams** are emptied, **events** left out one at a time over the newest M = min(32, the
  model's history limit) events, as offline.

Cost per explained request, in candidates scored: C · (1 + F_uc · B + F_ad · B' + (sides) · B +
S + S · M), with F_uc user/context features, F_ad ad features, S streams; scored in chunks of
a few thousand candidates outside the micro-batch (an explained request delays the requests that
share its scoring thread; ``docs/serving.md`` has the measured time).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from opengem.evaluation.explain import MAX_EVENTS, SIDES, background_rows, feature_groups
from opengem.export.request import ParsedRequest, empty_history, history_columns
from opengem.features.schema import FeatureSchema

BACKGROUND_FILE = "explain_background.json"
BACKGROUND_ROWS = 16
CHUNK = 4096  # candidates per forward of the edited copies


def write_background(data_dir: str | Path, schema: FeatureSchema, path: Path,
                     n: int = BACKGROUND_ROWS, seed: int = 0) -> int:
    """Write ``n`` train rows' user and context feature values (``explain_background.json``);
    returns the rows written."""
    names = [name for name, _, side in feature_groups(schema) if side != "ad"]
    table = background_rows(data_dir, schema, n, seed).select(names)
    rows = table.to_pylist()
    path.write_text(json.dumps({"seed": seed, "split": "train", "rows": rows}))
    return len(rows)


class RequestExplainer:
    """Occlusion explanations of parsed requests (module docstring).

    Args:
        schema: the artifact's schema.
        max_seq_len: the model's history limit per stream (the layout's).
        background: user/context rows (``predictor.read_background``), or None.
        probs: parsed requests → probabilities [candidates over all requests, T] (the program).
    """

    def __init__(self, schema: FeatureSchema, max_seq_len: dict[str, int],
                 background: list[dict] | None, probs: Callable[[list], np.ndarray]):
        self.schema, self.background, self.probs = schema, background, probs
        self.m = {s.name: min(MAX_EVENTS, max_seq_len.get(s.name, s.max_len))
                  for s in schema.sequences}
        self.feats = feature_groups(schema)

    def explain(self, p: ParsedRequest, k: int = 5) -> dict:
        """Per candidate: contribution of each group and side (logit units, per task) and the k
        events of each stream with the largest |effect| on the first task."""
        t0 = time.perf_counter()
        C, tasks = p.num_candidates, self.schema.task_names
        copies, labels, notes = [p], [("logit", None)], []
        shifts = list(range(1, min(BACKGROUND_ROWS, C - 1) + 1))
        bg = self.background or []
        if not bg:
            notes.append("user and context features unavailable: the artifact has no "
                         f"{BACKGROUND_FILE} (export with --data)")
        if not shifts:
            notes.append("ad features unavailable: one candidate, no others to take them from")
        for side in SIDES:
            names = [n for n, _, g in self.feats if g == side]
            draws = shifts if side == "ad" else bg
            if not names or not draws:
                continue
            for name in names:
                copies += [self._swap(p, [name], d) for d in draws]
                labels += [("group", name)] * len(draws)
            copies += [self._swap(p, names, d) for d in draws]
            labels += [("side", side)] * len(draws)
        for s in self.schema.sequences:
            copies.append(replace(p, sequences={**p.sequences, **empty_history(s)}))
            labels.append(("group", s.name))
        for s in self.schema.sequences:
            n = len(p.sequences[s.ts_column])
            for i in range(n - 1, n - 1 - min(n, self.m[s.name]), -1):
                cut = {c: np.delete(p.sequences[c], i) for c in history_columns(s)}
                copies.append(replace(p, sequences={**p.sequences, **cut}))
                labels.append(("event", (s.name, i)))
        z = self._logits(copies).reshape(len(copies), C, len(tasks))
        out = self._collect(p, z, labels, k)
        return {"method": "occlusion", "units": "logit", "tasks": tasks,
                "features_available": {"user_context": bool(bg), "ad": bool(shifts)},
                "background": {"user_context": len(bg), "ad": len(shifts)},
                "notes": notes, "candidates_scored": len(copies) * C,
                "ms": round((time.perf_counter() - t0) * 1000, 3), "candidates": out}

    def _swap(self, p: ParsedRequest, names: list[str], donor) -> ParsedRequest:
        """``p`` with ``names`` taken from ``donor``: a background row (user/context features) or a
        shift j (ad features: candidate c gets candidate (c + j) mod C's)."""
        kinds = {n: kd for n, kd, _ in self.feats}
        sparse, dense, emb = dict(p.sparse), dict(p.dense), dict(p.embeddings)
        cs, cd, ce = dict(p.cand_sparse), dict(p.cand_dense), dict(p.cand_embeddings)
        shift = isinstance(donor, int)
        order = (np.arange(p.num_candidates) + donor) % p.num_candidates if shift else None
        for n in names:
            if order is not None:
                if kinds[n] == "sparse":
                    cs[n] = _roll_jagged(*p.cand_sparse[n], order)
                elif kinds[n] == "dense":
                    cd[n] = p.cand_dense[n][order]
                else:
                    ce[n] = p.cand_embeddings[n][order]
            elif kinds[n] == "sparse":
                v = donor[n]
                sparse[n] = np.asarray(v if isinstance(v, list) else [v], dtype=np.int64)
            elif kinds[n] == "dense":
                dense[n] = float("nan") if donor[n] is None else float(donor[n])
            else:
                emb[n] = np.asarray(donor[n], dtype=np.float32)
        return replace(p, sparse=sparse, dense=dense, embeddings=emb, cand_sparse=cs,
                       cand_dense=cd, cand_embeddings=ce)

    def _logits(self, copies: list[ParsedRequest]) -> np.ndarray:
        per = max(1, CHUNK // copies[0].num_candidates)
        probs = np.concatenate([np.asarray(self.probs(copies[i:i + per]), dtype=np.float64)
                                for i in range(0, len(copies), per)])
        probs = np.clip(probs, 1e-12, 1 - 1e-7)
        return np.log(probs) - np.log1p(-probs)

    def _collect(self, p: ParsedRequest, z: np.ndarray, labels: list, k: int) -> list[dict]:
        tasks, base = self.schema.task_names, z[0]
        groups: dict[str, list[int]] = {}
        sides: dict[str, list[int]] = {}
        events: list[tuple[str, int, int]] = []
        for j, (kind, what) in enumerate(labels):
            if kind == "group":
                groups.setdefault(what, []).append(j)
            elif kind == "side":
                sides.setdefault(what, []).append(j)
            elif kind == "event":
                events.append((*what, j))
        out = []
        for c in range(p.num_candidates):
            row = {"logit": _task_dict(tasks, base[c]),
                   "groups": {g: _task_dict(tasks, base[c] - z[js, c].mean(0))
                              for g, js in groups.items()},
                   "sides": {s: _task_dict(tasks, base[c] - z[js, c].mean(0))
                             for s, js in sides.items()},
                   "events": {s.name: [] for s in self.schema.sequences}}
            top = sorted(events, key=lambda e: -abs(base[c, 0] - z[e[2], c, 0]))
            for stream, i, j in top:
                if len(row["events"][stream]) < k:
                    row["events"][stream].append(self._event(p, stream, i, base[c] - z[j, c]))
            out.append(row)
        return out

    def _event(self, p: ParsedRequest, stream: str, i: int, effect: np.ndarray) -> dict:
        s = self.schema.stream(stream)
        seq = p.sequences
        return {"index": i, "item": int(seq[s.item_column][i]),
                "event": int(seq[s.event_column][i]),
                "age_s": int(p.request_ts - seq[s.ts_column][i]),
                "attributes": {a.name: int(seq[s.attribute_column(a)][i]) for a in s.attributes},
                "values": {v: float(seq[s.value_column(v)][i]) for v in s.values},
                "effect": _task_dict(self.schema.task_names, effect)}


def _task_dict(tasks: list[str], v: np.ndarray) -> dict[str, float]:
    return {t: round(float(x), 5) for t, x in zip(tasks, v)}


def _roll_jagged(ids: np.ndarray, lengths: np.ndarray,
                 order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Candidate c's id list replaced by candidate ``order[c]``'s."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    new_len = lengths[order]
    idx = np.concatenate([np.arange(starts[o], starts[o] + lengths[o]) for o in order]) \
        if len(order) else np.zeros(0, dtype=np.int64)
    return ids[idx.astype(np.int64)], new_len
