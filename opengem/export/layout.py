"""Parsed requests → the serving program's input dict (see ``opengem.export.program``).

Legend: U requests in a micro-batch, C candidates over all of them, N events of a stream over the
U requests, L longest history, K recent window.

Preprocessing is the training path's own: ids outside a vocabulary go to the OOV row and are
counted by ``opengem.data.batch``'s ``_ids``; histories longer than the model's limit keep their
most recent events through ``keep_recent``; event ages are ``request_ts − ts`` in seconds, as
``collate`` computes them. A request's user, context and history are laid out once; its
candidates index them through ``cand_user``. Two users with histories [e0 e1 e2] and [f0]::

    seq.<s>.item   = [e0 e1 e2 f0 ∅]                 ∅ = sentinel event, target of all padding
    pool_idx       = [[0 1 2] [3 4 4]]               pool_valid  = [[1 1 1] [1 0 0]]
    recent_idx (K=2) = [[1 2] [4 3]]                 recent_valid = [[1 1] [0 1]]
    seq_values.<s>   = [v(e0) v(e1) v(e2) v(f0) 0]    [N + 1, V] per-event values, streams with any

The training model sizes its recent window by the longest history in a batch; here it is always
K slots, and the pooled window at least 2 (extra slots are masked padding). Training batches of
hundreds of rows nearly always hold a history of K events, so this is the training condition;
it also keeps a request's scores independent of the other requests in its micro-batch. (GEM's
sequence summary reads the last ``num_recent`` tokens, so on a batch whose longest history is
shorter than that the eager model's scores would differ: see the tests' ``reference``.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from opengem.data.batch import CollateStats, _ids, keep_recent
from opengem.export.request import ParsedRequest
from opengem.features.schema import FeatureSchema


@dataclass(frozen=True)
class Layout:
    """The model-side preprocessing parameters (stored in the artifact's manifest)."""

    max_seq_len: dict[str, int]  # per stream: longer histories keep their newest events
    recent_len: int  # K: the recent window of the sequence towers (inputs always carry all K slots)

    def to_dict(self) -> dict:
        return {"max_seq_len": dict(self.max_seq_len), "recent_len": self.recent_len}


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def assemble(schema: FeatureSchema, reqs: list[ParsedRequest],
             layout: Layout) -> tuple[dict, list[dict]]:
    """(program inputs, per-request report {"oov": {feature: n}, "truncated": {stream: events}})."""
    stats = [CollateStats() for _ in reqs]
    counts = np.array([r.num_candidates for r in reqs], dtype=np.int64)
    starts = _offsets(counts)[:-1]
    cand_user = np.repeat(np.arange(len(reqs)), counts)
    x: dict[str, torch.Tensor] = {}
    for f in schema.sparse:
        if f.group == "ad":
            vals = [_ids(r.cand_sparse[f.name][0], f.vocab_size, f.name, st) for r,
                    st in zip(reqs, stats)]
            lens = np.concatenate([r.cand_sparse[f.name][1] for r in reqs])
        else:
            vals = [_ids(r.sparse[f.name], f.vocab_size, f.name, st) for r, st in zip(reqs, stats)]
            lens = np.array([len(r.sparse[f.name]) for r in reqs], dtype=np.int64)
        x[f"sparse.{f.name}.values"] = torch.cat(vals)
        x[f"sparse.{f.name}.offsets"] = _t(_offsets(lens))
    dense = np.empty((len(cand_user), len(schema.dense)), dtype=np.float32)
    for j, f in enumerate(schema.dense):
        if f.group == "ad":
            dense[:, j] = np.concatenate([r.cand_dense[f.name] for r in reqs])
        else:
            dense[:, j] = np.repeat(np.array([r.dense[f.name] for r in reqs], dtype=np.float32),
                                    counts)
    x["dense"] = _t(dense)
    # [C, E]: every embedding feature's vector side by side, as ``Batch.embeddings``
    if schema.embeddings:
        x["embeddings"] = _t(np.concatenate(
            [np.concatenate([r.cand_embeddings[f.name] for r in reqs]) if f.group == "ad"
             else np.repeat(np.stack([r.embeddings[f.name] for r in reqs]), counts, axis=0)
             for f in schema.embeddings], axis=1).astype(np.float32))
    x["domain"] = _t(np.repeat(np.array([r.domain for r in reqs], dtype=np.int64), counts))
    x["cand_user"] = _t(cand_user)
    Cm = int(counts.max())
    x["cand_pad"] = _t(starts[:, None] + np.minimum(np.arange(Cm), counts[:, None] - 1))
    x["cand_pos"] = _t(cand_user * Cm + np.arange(len(cand_user)) - starts[cand_user])
    for s in schema.sequences:
        x.update(_stream(s, reqs, layout.max_seq_len[s.name], layout.recent_len, stats))
    return x, [_report(st) for st in stats]


def _stream(s, reqs: list[ParsedRequest], limit: int, recent_len: int,
            stats: list[CollateStats]) -> dict:
    cols = [s.item_column, s.event_column] + [s.attribute_column(a) for a in s.attributes]
    vocab = [s.item_vocab_size, s.num_event_types] + [a.vocab_size for a in s.attributes]
    lens = np.array([len(r.sequences[s.ts_column]) for r in reqs], dtype=np.int64)
    offs = _offsets(lens)
    values = list(s.value_columns)
    flat = {c: np.concatenate([r.sequences[c] for r in reqs])
            for c in cols + [s.ts_column] + values}
    if (lens > limit).any():
        for u in np.flatnonzero(lens > limit):
            stats[u].truncated_rows[s.name] += 1
            stats[u].truncated_events[s.name] += int(lens[u] - limit)
        idx, lens = keep_recent(offs, limit)
        flat = {c: v[idx] for c, v in flat.items()}
        offs = _offsets(lens)
    total = int(offs[-1])
    out = {}
    for c, v in zip(cols, vocab):
        parts = [_ids(flat[c][offs[u]:offs[u + 1]], v, c, stats[u]) for u in range(len(reqs))]
        out[f"seq.{c}"] = torch.cat(parts + [torch.zeros(1, dtype=torch.int64)])  # + sentinel
    if values:  # [N, V] as ``Batch.seq_values`` holds them, + a zero sentinel row
        v = np.stack([flat[c] for c in values], axis=1).astype(np.float32)
        out[f"seq_values.{s.name}"] = _t(np.concatenate([v, np.zeros((1, len(values)), v.dtype)]))
    req_ts = np.repeat(np.array([r.request_ts for r in reqs], dtype=np.int64), lens)
    age = (req_ts - flat[s.ts_column]).astype(np.float32)
    out[f"seq.{s.name}.age"] = _t(np.append(age, np.float32(0)))
    # ≥ 2: the exported graph is traced for L ≠ 1 (an extra slot is masked padding)
    L = max(2, int(lens.max()))
    pos = np.arange(L)
    valid = pos[None, :] < lens[:, None]
    out[f"seq.{s.name}.pool_idx"] = _t(np.where(valid, offs[:-1, None] + pos[None, :], total))
    out[f"seq.{s.name}.pool_valid"] = _t(valid)
    # always the full window: padding is masked, and a fixed K keeps the pyramid's branches fixed
    K = recent_len
    back = np.arange(K) - K  # −K … −1: position from the newest event
    rvalid = back[None, :] >= -lens[:, None]
    out[f"seq.{s.name}.recent_idx"] = _t(np.where(rvalid, offs[1:, None] + back[None, :], total))
    out[f"seq.{s.name}.recent_valid"] = _t(rvalid)
    return out


def _report(st: CollateStats) -> dict:
    return {"oov": dict(st.oov_ids), "truncated": dict(st.truncated_events)}
