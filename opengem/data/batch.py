"""The typed ``Batch`` and ``collate``: Arrow rows → KeyedJaggedTensors, never padded.

Legend: B rows, F dense features, E the embedding features' dims summed, T tasks, N events of one
stream summed over the batch.

A batch of 3 rows with an ``organic`` stream holding 2, 0 and 3 events is stored jagged::

    sequences["organic.item"].values()  = [i00 i01 | i20 i21 i22]     (N = 5)
    sequences["organic.item"].lengths() = [2, 0, 3]
    seq_age["organic"].values()         = request_ts − event ts, seconds (float32), same lengths
    seq_values["organic.dwell"].values() = each event's dwell (float32), same lengths

Events run oldest → newest inside each row.

Per-event numeric values (``SequenceStream.values``) are a float ``KeyedJaggedTensor`` keyed by
their columns, like ``seq_age``: ``Batch.to``, row selection and history caps treat every jagged
field alike, and it stays out of the sharded tables' input dist (only ``sequences`` goes there).
It is None when the schema has no values, so batches of such schemas are what they were.

Bad values never pass silently (the reader quarantines rows before collate, see ``validate_rows``):
out-of-range ids map to the feature's OOV row (index ``vocab_size``) and are counted in
``CollateStats``; histories longer than the model's limit keep their most recent events (counted).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torchrec import KeyedJaggedTensor

from opengem.features.schema import FeatureSchema


@dataclass
class Batch:
    sparse: KeyedJaggedTensor  # keys = schema sparse names; ids in [0, vocab] (vocab = OOV row)
    dense: torch.Tensor  # [B, F] float32; NaN = missing (only in ``missing="indicator"`` features)
    sequences: KeyedJaggedTensor  # keys "<stream>.item", "<stream>.event", "<stream>.<attribute>"…
    seq_age: KeyedJaggedTensor  # keys "<stream>"; float32 seconds since each event
    domain: torch.Tensor  # [B] int64
    labels: torch.Tensor  # [B, T] float32
    label_mask: torch.Tensor  # [B, T] bool
    weights: torch.Tensor  # [B] float32
    user_id: torch.Tensor  # [B] int64
    true_probs: torch.Tensor | None = None  # [B, T] float64 (synthetic worlds)
    # [B, E] float32: the schema's embedding features side by side
    embeddings: torch.Tensor | None = None
    # keys "<stream>.<value>" (``SequenceStream.value_columns``), float32 per event, the stream's
    # lengths; None when no stream has values
    seq_values: KeyedJaggedTensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.domain.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        def mv(x):
            return None if x is None else x.to(device, non_blocking=non_blocking)

        return Batch(**{k: mv(getattr(self, k)) for k in self.__dataclass_fields__})


@dataclass
class CollateStats:
    """Counters of values that were repaired rather than rejected (reported in run summaries)."""

    oov_ids: Counter = field(default_factory=Counter)  # feature → ids mapped to the OOV row
    truncated_rows: Counter = field(default_factory=Counter)  # stream → rows cut to max length
    truncated_events: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        return {k: dict(getattr(self, k))
                for k in ("oov_ids", "truncated_rows", "truncated_events")}

    @classmethod
    def from_dict(cls, d: dict) -> CollateStats:
        return cls(**{k: Counter(v) for k, v in d.items()})

    def add(self, other: CollateStats) -> list[str]:
        """Add ``other``'s counts; returns what was repaired for the first time (to log it once)."""
        new = [f"{k} of {name}" for k in ("oov_ids", "truncated_rows") for name in getattr(other, k)
               if name not in getattr(self, k)]
        for k in ("oov_ids", "truncated_rows", "truncated_events"):
            getattr(self, k).update(getattr(other, k))
        return new


def _ids(col: np.ndarray, vocab: int, name: str, stats: CollateStats) -> torch.Tensor:
    bad = (col < 0) | (col >= vocab)
    n_bad = int(bad.sum())
    if n_bad:
        stats.oov_ids[name] += n_bad
        col = np.where(bad, vocab, col)
    return torch.from_numpy(np.array(col, dtype=np.int64))  # a copy: Arrow buffers are read-only


def _list_parts(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(flat values, offsets) of a list column, zero-copy where Arrow allows."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    offsets = arr.offsets.to_numpy().astype(np.int64)
    values = arr.values.to_numpy(zero_copy_only=False)
    return values[offsets[0]:offsets[-1]], offsets - offsets[0]


def keep_recent(offsets: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices into the flat values that keep each row's last ``max_len`` events, and
    new lengths."""
    lengths = np.diff(offsets)
    new_len = np.minimum(lengths, max_len)
    starts = offsets[1:] - new_len
    total = int(new_len.sum())
    row_start = np.zeros(len(new_len), dtype=np.int64)
    np.cumsum(new_len[:-1], out=row_start[1:])
    idx = np.arange(total, dtype=np.int64) - np.repeat(row_start - starts, new_len)
    return idx, new_len


def collate(
    table: pa.Table,
    schema: FeatureSchema,
    max_seq_len: dict[str, int] | None = None,
    stats: CollateStats | None = None,
) -> Batch:
    """Build a ``Batch`` from validated Arrow rows. ``max_seq_len`` caps each stream (most
    recent kept)."""
    stats = stats if stats is not None else CollateStats()
    max_seq_len = max_seq_len or {}
    B = table.num_rows

    sp_vals, sp_lens = [], []
    for f in schema.sparse:
        col = table.column(f.name)
        if f.multi_hot:
            vals, offs = _list_parts(col)
            sp_vals.append(_ids(vals.astype(np.int64), f.vocab_size, f.name, stats))
            sp_lens.append(torch.from_numpy(np.diff(offs)))
        else:
            sp_vals.append(_ids(col.to_numpy().astype(np.int64, copy=False), f.vocab_size, f.name,
                                stats))
            sp_lens.append(torch.ones(B, dtype=torch.int64))
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=[f.name for f in schema.sparse],
        values=torch.cat(sp_vals) if sp_vals else torch.zeros(0, dtype=torch.int64),
        lengths=torch.cat(sp_lens) if sp_lens else torch.zeros(0, dtype=torch.int64),
    )

    if schema.dense:
        dense = np.stack([table.column(f.name).to_numpy().astype(np.float32) for f in schema.dense],
                         axis=1)
    else:
        dense = np.zeros((B, 0), dtype=np.float32)

    embeddings = None
    if schema.embeddings:
        embeddings = torch.from_numpy(np.concatenate(
            [_vectors(table.column(f.name), f.dim) for f in schema.embeddings], axis=1))

    request_ts = table.column(schema.time_column).to_numpy().astype(np.int64)
    seq_keys, seq_vals, seq_lens, age_vals, age_lens = [], [], [], [], []
    val_keys, val_vals, val_lens = [], [], []
    for s in schema.sequences:
        items, offs = _list_parts(table.column(s.item_column))
        events, _ = _list_parts(table.column(s.event_column))
        ts, _ = _list_parts(table.column(s.ts_column))
        attrs = [_list_parts(table.column(s.attribute_column(a)))[0] for a in s.attributes]
        nums = [_list_parts(table.column(c))[0] for c in s.value_columns]
        limit = min(max_seq_len.get(s.name, s.max_len), s.max_len)
        lengths = np.diff(offs)
        over = lengths > limit
        if over.any():
            stats.truncated_rows[s.name] += int(over.sum())
            stats.truncated_events[s.name] += int((lengths[over] - limit).sum())
            idx, lengths = keep_recent(offs, limit)
            items, events, ts = items[idx], events[idx], ts[idx]
            attrs = [a[idx] for a in attrs]
            nums = [v[idx] for v in nums]
        row = np.repeat(np.arange(B), lengths)
        age = (request_ts[row] - ts.astype(np.int64)).astype(np.float32)
        lens_t = torch.from_numpy(lengths.astype(np.int64))
        seq_keys += [s.item_column, s.event_column] + [s.attribute_column(a) for a in s.attributes]
        seq_vals += [
            _ids(items.astype(np.int64, copy=False), s.item_vocab_size, s.item_column, stats),
            _ids(events.astype(np.int64, copy=False), s.num_event_types, s.event_column, stats),
        ] + [_ids(v.astype(np.int64, copy=False), a.vocab_size, s.attribute_column(a), stats)
             for v, a in zip(attrs, s.attributes)]
        seq_lens += [lens_t] * (2 + len(s.attributes))
        age_vals.append(torch.from_numpy(age))
        age_lens.append(lens_t)
        val_keys += list(s.value_columns)
        val_vals += [torch.from_numpy(np.array(v, dtype=np.float32)) for v in nums]
        val_lens += [lens_t] * len(nums)
    empty_i, empty_f = torch.zeros(0, dtype=torch.int64), torch.zeros(0)
    sequences = KeyedJaggedTensor.from_lengths_sync(
        keys=seq_keys, values=torch.cat(seq_vals) if seq_vals else empty_i,
        lengths=torch.cat(seq_lens) if seq_lens else empty_i)
    seq_age = KeyedJaggedTensor.from_lengths_sync(
        keys=[s.name for s in schema.sequences],
        values=torch.cat(age_vals) if age_vals else empty_f,
        lengths=torch.cat(age_lens) if age_lens else empty_i)
    seq_values = (KeyedJaggedTensor.from_lengths_sync(keys=val_keys, values=torch.cat(val_vals),
                                                      lengths=torch.cat(val_lens))
                  if val_keys else None)

    labels = np.stack([table.column(t.label_column).to_numpy(zero_copy_only=False)
                       for t in schema.tasks], 1)
    mask = ~np.isnan(labels.astype(np.float64))
    true_probs = None
    if schema.has_true_probs and all(t.prob_column in table.column_names for t in schema.tasks):
        true_probs = torch.from_numpy(
            np.stack([table.column(t.prob_column).to_numpy().astype(np.float64)
                      for t in schema.tasks], 1))
    return Batch(
        sparse=sparse,
        dense=torch.from_numpy(dense),
        sequences=sequences,
        seq_age=seq_age,
        domain=torch.from_numpy(table.column(schema.domains.column).to_numpy().astype(np.int64)),
        labels=torch.from_numpy(np.nan_to_num(labels.astype(np.float32), nan=0.0)),
        label_mask=torch.from_numpy(mask),
        weights=torch.ones(B, dtype=torch.float32),
        user_id=torch.from_numpy(table.column(schema.user_column).to_numpy().astype(np.int64)),
        true_probs=true_probs,
        embeddings=embeddings,
        seq_values=seq_values,
    )


def _vectors(col: pa.ChunkedArray | pa.Array, dim: int) -> np.ndarray:
    """[B, dim] float32 of a list<float> (or fixed_size_list) column whose rows hold ``dim``
    values each."""
    flat = pc.list_flatten(col)
    flat = flat.combine_chunks() if isinstance(flat, pa.ChunkedArray) else flat
    return np.array(flat.to_numpy(zero_copy_only=False), dtype=np.float32).reshape(len(col), dim)


# ---------------------------------------------------------------------------------- row checks
def validate_rows(table: pa.Table,
                  schema: FeatureSchema) -> tuple[np.ndarray, list[tuple[str, int]], np.ndarray]:
    """Row-level checks before collate.

    Returns (keep mask [B] bool, [(reason, count), …], first failing reason per row ("" if kept)).

    Quarantined (not repaired) because a model trained on them would learn something false:
    a null in a feature column or inside a list (an empty history is ``[]``, not null); NaN/inf
    dense values (a dense feature with ``missing="indicator"`` keeps null/NaN as missing; inf is
    still dropped); an embedding vector of another length than its ``dim``, or holding NaN/inf;
    labels outside {0, 1}; a label set whose ``requires`` task is 0 (conversion without click); a
    domain index out of range; event timestamps out of order or not before the request time; a
    per-event value (``SequenceStream.values``) NaN or ±inf in float32, as a dense value is, since
    it reaches the event token through a Linear. Missing labels (null) are allowed and masked out
    of the loss.
    """
    B = table.num_rows
    keep = np.ones(B, dtype=bool)
    row_reason = np.full(B, "", dtype=object)
    reasons: list[tuple[str, int]] = []

    def drop(bad: np.ndarray, reason: str) -> None:
        bad = bad & keep
        n = int(bad.sum())
        if n:
            keep[bad] = False
            row_reason[bad] = reason
            reasons.append((reason, n))

    label_columns = {t.label_column for t in schema.tasks}  # null labels are allowed (masked)
    # null/NaN = missing, kept
    kept_missing = {f.name for f in schema.dense if f.missing == "indicator"}
    for c in schema.columns():
        if c in table.column_names and c not in label_columns | kept_missing:
            drop(_null_rows(table.column(c)), f"{c} is null")
    for f in schema.dense:
        v = table.column(f.name).to_numpy(zero_copy_only=False).astype(np.float64)
        if f.name in kept_missing:
            drop(np.isinf(v), f"dense {f.name} is inf")
        else:
            drop(~np.isfinite(v), f"dense {f.name} is NaN/inf")
    for f in schema.embeddings:
        col = table.column(f.name)
        drop(pc.list_value_length(col).to_numpy(zero_copy_only=False) != f.dim,
             f"embedding {f.name} length != {f.dim}")
        flat = pc.list_flatten(col)
        if len(flat):
            v = flat.to_numpy(zero_copy_only=False).astype(np.float64)
            parent = pc.list_parent_indices(col).to_numpy(zero_copy_only=False)
            drop(np.bincount(parent[~np.isfinite(v)], minlength=B) > 0,
                 f"embedding {f.name} is NaN/inf")
    labels = {}
    for t in schema.tasks:
        y = table.column(t.label_column).to_numpy(zero_copy_only=False).astype(np.float64)
        labels[t.name] = y
        drop(~np.isnan(y) & (y != 0) & (y != 1), f"label {t.label_column} not in {{0,1}}")
    for t in schema.tasks:
        if t.requires:
            drop((labels[t.name] == 1) & (labels[t.requires] == 0),
                 f"{t.name}=1 without {t.requires}=1")
    dom = table.column(schema.domains.column).to_numpy(zero_copy_only=False)
    drop((dom < 0) | (dom >= schema.num_domains), f"{schema.domains.column} out of range")
    req = table.column(schema.time_column).to_numpy().astype(np.int64)
    for s in schema.sequences:
        ts_col = table.column(s.ts_column)
        ts, offs = _list_parts(ts_col)
        lens = np.diff(offs)
        ts = ts.astype(np.int64)
        row = np.repeat(np.arange(B), lens)
        if len(ts):
            later = ts >= req[row]
            unordered = np.zeros(len(ts), dtype=bool)
            unordered[1:] = (ts[1:] < ts[:-1]) & (row[1:] == row[:-1])
            drop(np.bincount(row[later], minlength=B) > 0,
                 f"{s.ts_column} not before {schema.time_column}")
            drop(np.bincount(row[unordered], minlength=B) > 0, f"{s.ts_column} out of order")
        bad_len = np.zeros(B, dtype=bool)
        for col in ([s.item_column, s.event_column] + [s.attribute_column(a) for a in s.attributes]
                    + list(s.value_columns)):
            bad_len |= (
                pc.list_value_length(table.column(col)).to_numpy(zero_copy_only=False) != lens
            )
        what = "item/event/ts/attributes" + ("/values" if s.values else "")
        drop(bad_len, f"{s.name} event lists ({what}) differ in length")
        for col in s.value_columns:
            flat = pc.list_flatten(table.column(col))
            if len(flat):
                with np.errstate(over="ignore"):  # beyond float32: inf, bad like a NaN
                    v = flat.to_numpy(zero_copy_only=False).astype(np.float32)
                parent = pc.list_parent_indices(table.column(col)).to_numpy(zero_copy_only=False)
                drop(np.bincount(parent[~np.isfinite(v)], minlength=B) > 0, f"{col} is NaN/inf")
    return keep, reasons, row_reason


def _null_rows(col: pa.ChunkedArray) -> np.ndarray:
    """Rows whose value, or an element of whose list, is null."""
    is_list = (
        pa.types.is_list(col.type)
        or pa.types.is_large_list(col.type)
        or pa.types.is_fixed_size_list(col.type)
    )
    if not col.null_count and not (is_list and pc.list_flatten(col).null_count):
        return np.zeros(len(col), dtype=bool)  # the common case: no copy
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    bad = arr.is_null().to_numpy(zero_copy_only=False)
    if is_list:
        flat = pc.list_flatten(arr)
        bad[
            pc.list_parent_indices(arr).to_numpy()[flat.is_null().to_numpy(zero_copy_only=False)]
        ] = True
    return bad
