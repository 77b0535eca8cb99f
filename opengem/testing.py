"""Small, self-made schemas and random rows for tests and examples (no data files needed)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from opengem.data.parquet import list_array
from opengem.features.schema import (
    DenseFeature,
    Domains,
    EventAttribute,
    FeatureSchema,
    SequenceStream,
    SparseFeature,
    Task,
)


def tiny_schema(num_domains: int = 2, with_probs: bool = True, streams: int = 2) -> FeatureSchema:
    return FeatureSchema(
        sparse=(SparseFeature("user_id", 50, "user"), SparseFeature("ad_id", 30, "ad"),
                SparseFeature("category", 5, "ad"),
                SparseFeature("tags", 7, "user", multi_hot=True)),
        dense=(DenseFeature("activity", "user"), DenseFeature("quality", "ad")),
        sequences=tuple(SequenceStream(f"s{i}", 40, 3, 64,
                                       (EventAttribute("category", 5),) if i == 0 else ())
                        for i in range(streams)),
        tasks=(Task("click", "click", "p_click" if with_probs else None),
               Task("conversion", "conversion", "p_conversion" if with_probs else None,
                    requires="click")),
        domains=Domains(tuple(f"d{i}" for i in range(num_domains))),
    )


def item_matched_schema(num_ads: int = 4) -> FeatureSchema:
    """``tiny_schema`` whose stream ``s1`` holds ad ids (``matches="ad_id"``), with few ads so
    random rows hold events of the candidate's own ad."""
    import dataclasses

    base = tiny_schema()
    sparse = tuple(dataclasses.replace(f, vocab_size=num_ads) if f.name == "ad_id" else f
                   for f in base.sparse)
    s0, s1 = base.sequences
    return dataclasses.replace(base, sparse=sparse, sequences=(
        s0, dataclasses.replace(s1, item_vocab_size=num_ads, matches="ad_id")))


def valued_schema(values: tuple[str, ...] = ("dwell", "price"), stream: str = "s0",
                  **kw) -> FeatureSchema:
    """``tiny_schema`` (``kw``) whose stream ``stream`` carries per-event numeric values."""
    import dataclasses

    base = tiny_schema(**kw)
    return dataclasses.replace(base, sequences=tuple(
        dataclasses.replace(s, values=tuple(values)) if s.name == stream else s
        for s in base.sequences))


def random_table(schema: FeatureSchema, n: int, seed: int = 0,
                 lengths: dict[str, np.ndarray] | None = None) -> pa.Table:
    """``n`` valid random rows for ``schema``; ``lengths`` fixes per-stream history lengths."""
    rng = np.random.default_rng(seed)
    t0 = 1_700_000_000
    req = t0 + rng.integers(0, 86400, n)
    cols: dict[str, pa.Array] = {
        schema.user_column: pa.array(rng.integers(0, 50, n)),
        schema.time_column: pa.array(req),
        schema.day_column: pa.array(np.zeros(n, dtype=np.int32)),
        schema.domains.column: pa.array(rng.integers(0, schema.num_domains, n)),
    }
    for f in schema.sparse:
        if f.multi_hot:
            lens = rng.integers(0, 4, n)
            cols[f.name] = list_array(rng.integers(0, f.vocab_size, int(lens.sum())), lens)
        else:
            cols[f.name] = pa.array(rng.integers(0, f.vocab_size, n))
    for f in schema.dense:
        cols[f.name] = pa.array(rng.normal(size=n).astype(np.float32))
    stream_lens = {}
    for s in schema.sequences:
        lens = lengths[s.name] if lengths and s.name in lengths else rng.integers(0, 20, n)
        lens = stream_lens[s.name] = np.asarray(lens, dtype=np.int64)
        total = int(lens.sum())
        # events strictly before the request, oldest first
        gaps = rng.integers(1, 3600, total)
        row = np.repeat(np.arange(n), lens)
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        rev = np.arange(total) - np.repeat(starts, lens)  # position inside row
        age = (lens[row] - rev) * 600 + gaps % 600
        cols[s.item_column] = list_array(rng.integers(0, s.item_vocab_size, total), lens)
        cols[s.event_column] = list_array(rng.integers(0, s.num_event_types, total), lens)
        cols[s.ts_column] = list_array((req[row] - age).astype(np.int64), lens)
        for a in s.attributes:
            cols[s.attribute_column(a)] = list_array(rng.integers(0, a.vocab_size, total), lens)
    p_click = rng.uniform(0.01, 0.3, n)
    p_cvr = rng.uniform(0.0, 0.3, n)
    click = (rng.uniform(size=n) < p_click).astype(np.int8)
    conv = (click * (rng.uniform(size=n) < p_cvr)).astype(np.int8)
    for t, y, p in zip(schema.tasks, [click, conv], [p_click, p_click * p_cvr]):
        cols[t.label_column] = pa.array(y)
        if t.prob_column:
            cols[t.prob_column] = pa.array(p)
    for f in schema.embeddings:  # drawn last: tables of schemas without embeddings are as before
        cols[f.name] = pa.FixedSizeListArray.from_arrays(
            pa.array(rng.normal(size=n * f.dim).astype(np.float32)), f.dim
        ).cast(pa.list_(pa.float32()))
    for s in schema.sequences:  # also last: heavy-tailed, positive, like dwell times and prices
        for c in s.value_columns:
            lens = stream_lens[s.name]
            cols[c] = list_array(rng.lognormal(0.0, 1.5, int(lens.sum())).astype(np.float32), lens)
    return pa.table(cols)


def with_events(table: pa.Table, row: int, stream: str, ts: list[int],
                attrs: dict[str, int]) -> pa.Table:
    """``table`` with events at times ``ts`` appended (newest) to ``row``'s history of ``stream``:
    item and event type 0, and each attribute named in ``attrs`` at its value (the caller extends
    any other attribute column of the stream)."""
    for name in ("item", "event", "ts", *attrs):
        col = f"{stream}.{name}"
        values = table.column(col).to_pylist()
        values[row] = values[row] + (ts if name == "ts" else [attrs.get(name, 0)] * len(ts))
        flat = np.concatenate([np.asarray(v, dtype=np.int64) for v in values])
        table = table.set_column(table.schema.get_field_index(col), col,
                                 list_array(flat, [len(v) for v in values]))
    return table


def config_leaves(d: dict, prefix: str = "") -> dict:
    """The leaves of a config dict (``dataclasses.asdict``), by dotted key."""
    out = {}
    for k, v in d.items():
        out.update(config_leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def differing(a: dict, b: dict) -> set[str]:
    """The dotted keys whose leaves differ between two config dicts: what a preset dial moves."""
    a, b = config_leaves(a), config_leaves(b)
    return {k for k in a if a[k] != b[k]}


class TrueLogits(torch.nn.Module):
    """A "model" whose logits are the batch's stored true probabilities (synthetic worlds): click,
    and conversion chained on it; what a perfect model scores, through any model path."""

    def max_seq_len(self):
        return {}

    def forward(self, batch):
        p = batch.true_probs.double().clamp(1e-12, 1 - 1e-12)
        return torch.log(p) - torch.log1p(-p)
