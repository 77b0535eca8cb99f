"""Explanations: per scored row, how much each input group and each recent history event moved
the model's logit (``opengem explain``).

Legend: N explained rows, G groups (features, then streams), T tasks, B background rows,
M events per stream read by leave-one-out, S streams, F features.

Method: **occlusion at the input**, on Arrow rows in the dataset's schema (histories joined as list
columns), scored through the same ``collate`` the loader uses. It only edits inputs, so one code
path explains GEM, the peers (DLRM-DCN, DIN), a student, or any ``table → logits`` callable (the
synthetic world's own truth, in the tests) — gradients would need a differentiable path through
embedding lookups and jagged kernels that each architecture builds differently, and attention
weights say where a model looked, not what changed its output.

- A **feature** (every sparse, dense and embedding feature of the schema; each is one input token
  of the model) contributes ``z(row) − mean_b z(row with the feature's column taken from b)`` over
  B background rows b drawn from the train split with a fixed seed: the interventional, first-order
  occlusion effect. The background is real rows, not the out-of-vocabulary id: the OOV row of an
  embedding table is never trained (no training row holds an OOV id), so "feature set to OOV" asks
  the model about an input it has never seen and its answer measures nothing. Each side of the
  request (user, ad, context: the schema's ``group``) is also occluded all at once, from the same
  background row: the side's joint contribution, interactions inside it included.
- A **stream** contributes ``z(row) − z(row with the stream's lists empty)``: no history is the
  natural absence of a stream (a new user), so it needs no background.
- An **event** of a stream, among the newest M = min(32, the model's history limit for the stream)
  events the model reads, has the effect ``z(row) − z(row without that event)`` (leave-one-out);
  the k with the largest |effect| on the ranking task are reported with their item, event type,
  age, attributes and values.
- The **domain** column (the surface) is never occluded: it selects the heads rather than feeding
  them, so "another surface" is another model, not an absent input.

All effects are in logit units, per task. They are first order: a feature whose effect runs only
through an interaction with another occluded group is split between them, and contributions need
not sum to ``z(row) − E[z]``. Cost, in forwards of one row: ``1 + (F + sides) · B + S + S · M``
per explained row (measured wall time in ``Explanation.ms_per_row``; the rows are scored in
chunks, so it is forwards of batched rows, not one forward per occlusion).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from opengem.data.batch import collate, validate_rows
from opengem.features.schema import FeatureSchema

# table → logits [rows, T] (schema task order)
TableScorer = Callable[[pa.Table], np.ndarray]
SIDES = ("user", "ad", "context")
MAX_EVENTS = 32  # M's cap: leave-one-out past the newest few dozen events costs more than it says
CHUNK = 4096  # rows per forward: a few thousand keeps a tiny model's forward cheap and memory flat


@dataclass
class Explanation:
    """The explanations of N rows: contributions ``[N, G, T]`` of ``groups`` (features, then
    streams), side contributions ``[N, 3, T]``, the rows' logits ``[N, T]``, and per row the
    top-k events of each stream (dicts, each with its ``effect`` per task)."""

    tasks: list[str]
    groups: list[str]
    kinds: list[str]  # per group: sparse / dense / embedding / stream
    logits: np.ndarray
    contributions: np.ndarray
    sides: np.ndarray
    events: list[dict[str, list[dict]]]
    rows: list[int]
    background_rows: int
    forwards_per_row: int
    ms_per_row: float
    features_available: bool = True
    notes: list[str] = field(default_factory=list)

    def ranking(self, task: str) -> np.ndarray:
        """[N] index of the group with the largest |contribution| on ``task``, per row."""
        return np.abs(self.contributions[:, :, self.tasks.index(task)]).argmax(1)

    def summary(self) -> dict:
        """Per task and group: mean |contribution| over the rows and the share of rows on which the
        group ranks first."""
        out = {}
        for j, t in enumerate(self.tasks):
            first = (np.bincount(self.ranking(t), minlength=len(self.groups))
                     / max(len(self.rows), 1))
            mean = np.abs(self.contributions[:, :, j]).mean(0)
            out[t] = {g: {"mean_abs": round(float(m), 4), "first_share": round(float(f), 4)}
                      for g, m, f in zip(self.groups, mean, first)}
        return out

    def to_dict(self) -> dict:
        rows = []
        for i, r in enumerate(self.rows):
            rows.append({
                "row": r,
                "logit": _per_task(self.tasks, self.logits[i]),
                "groups": {g: _per_task(self.tasks, self.contributions[i, k])
                           for k, g in enumerate(self.groups)},
                "sides": {s: _per_task(self.tasks, self.sides[i, k]) for k, s in enumerate(SIDES)
                          if np.isfinite(self.sides[i, k]).all()},
                "events": {s: [{**e, "effect": {t: round(v, 5) for t, v in e["effect"].items()}}
                               for e in evs] for s, evs in self.events[i].items()},
            })
        return {"tasks": self.tasks, "method": "occlusion", "background_rows": self.background_rows,
                "forwards_per_row": self.forwards_per_row, "ms_per_row": round(self.ms_per_row, 3),
                "features_available": self.features_available, "notes": self.notes,
                "kinds": dict(zip(self.groups, self.kinds)), "summary": self.summary(),
                "rows": rows}


def _per_task(tasks: list[str], v: np.ndarray) -> dict[str, float | None]:
    """Per task, rounded; None where not measured (a side without background rows): JSON has
    no NaN."""
    return {t: round(float(x), 5) if np.isfinite(x) else None for t, x in zip(tasks, v)}


# ------------------------------------------------------------------------------ scorers
def table_scorer(model: torch.nn.Module, schema: FeatureSchema, chunk: int = CHUNK) -> TableScorer:
    """``model``'s logits of Arrow rows, through ``collate`` with the model's history limits (what
    the loader feeds it), in chunks of ``chunk`` rows."""
    limits = model.max_seq_len() if hasattr(model, "max_seq_len") else None

    @torch.no_grad()
    def score(table: pa.Table) -> np.ndarray:
        out = []
        for start in range(0, table.num_rows, chunk):
            z = model(collate(table.slice(start, chunk), schema, limits))
            out.append((z[0] if isinstance(z, (tuple, list)) else z).double().numpy())
        return np.concatenate(out) if out else np.zeros((0, len(schema.tasks)))
    return score


def history_limits(model, schema: FeatureSchema) -> dict[str, int]:
    """Events per stream the model reads (its ``max_seq_len``, else the schema's ``max_len``)."""
    own = model.max_seq_len() if hasattr(model, "max_seq_len") else {}
    return {s.name: min(own.get(s.name, s.max_len) or s.max_len, s.max_len)
            for s in schema.sequences}


# ------------------------------------------------------------------------------ table edits
def stream_columns(s) -> list[str]:
    """Every list column of a stream: item, event, ts, attributes, values."""
    return ([s.item_column, s.event_column, s.ts_column]
            + [s.attribute_column(a) for a in s.attributes] + list(s.value_columns))


def _list_parts(col) -> tuple[pa.Array, np.ndarray]:
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    off = arr.offsets.to_numpy().astype(np.int64)
    return arr.values.slice(off[0], off[-1] - off[0]), off - off[0]


def drop_events(table: pa.Table, s, rows: np.ndarray, drop: np.ndarray) -> pa.Table:
    """``table.take(rows)`` with, in row k, stream ``s``'s event ``drop[k]`` (its index in the row's
    lists, oldest first) removed; ``drop[k] = -1`` keeps every event, ``-2`` removes them all."""
    out = table.take(pa.array(rows))
    lengths = np.diff(_list_parts(table.column(s.ts_column))[1])[rows]
    starts = _list_parts(table.column(s.ts_column))[1][:-1][rows]
    pos = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    d = np.repeat(drop, lengths)
    keep = (pos != d) & (d != -2)
    idx = (np.repeat(starts, lengths) + pos)[keep]
    new_len = np.bincount(np.repeat(np.arange(len(rows)), lengths)[keep], minlength=len(rows))
    offsets = pa.array(np.concatenate([[0], np.cumsum(new_len)]).astype(np.int32))
    for c in stream_columns(s):
        values, _ = _list_parts(table.column(c))
        col = pa.ListArray.from_arrays(offsets, values.take(pa.array(idx, type=pa.int64())))
        out = out.set_column(out.schema.get_field_index(c), c,
                             col.cast(table.schema.field(c).type))
    return out


def swap_columns(table: pa.Table, background: pa.Table, columns: list[str], rows: np.ndarray,
                 bg: np.ndarray) -> pa.Table:
    """``table.take(rows)`` with ``columns`` of row k taken from ``background`` row ``bg[k]``."""
    out = table.take(pa.array(rows))
    donor = background.take(pa.array(bg))
    for c in columns:
        out = out.set_column(out.schema.get_field_index(c), c,
                             donor.column(c).cast(table.schema.field(c).type))
    return out


def feature_groups(schema: FeatureSchema) -> list[tuple[str, str, str]]:
    """(name, kind, side) of every occluded feature, the domain column left out."""
    out = [(f.name, "sparse", f.group) for f in schema.sparse if f.name != schema.domains.column]
    out += [(f.name, "dense", f.group) for f in schema.dense]
    out += [(f.name, "embedding", f.group) for f in schema.embeddings]
    return out


# ------------------------------------------------------------------------------ the method
def explain_rows(model: torch.nn.Module | TableScorer, schema: FeatureSchema, rows: pa.Table,
                 background: pa.Table | None, k: int = 5, rank_task: str | None = None,
                 row_ids: list[int] | None = None) -> Explanation:
    """Occlusion explanations of ``rows`` (module docstring).

    Args:
        model: an ``nn.Module`` taking a ``Batch`` (logits [B, T]), or a ``table → logits``
            callable.
        rows: Arrow rows in ``schema``'s columns, histories as list columns.
        background: B rows of the same columns (the train split's); None: features are not
            explained (left out of ``groups``, a note says so; streams and events still are).
        k: events reported per stream and row; ``rank_task``: the task they are ranked by (default
            the first).
    """
    score = table_scorer(model, schema) if isinstance(model, torch.nn.Module) else model
    limits = history_limits(model, schema)
    tasks = schema.task_names
    feats = feature_groups(schema) if background is not None and background.num_rows else []
    B = background.num_rows if feats else 0
    sides = [side for side in SIDES if any(g == side for _, _, g in feats)]
    per_row = 1 + (len(feats) + len(sides)) * B + len(schema.sequences) + sum(
        min(MAX_EVENTS, limits[s.name]) for s in schema.sequences)
    # explained rows per block: its occluded copies fill about one forward's chunk, so memory stays
    # flat however many rows are asked for
    step = max(1, CHUNK // per_row)
    t0 = time.perf_counter()
    blocks = [_explain_block(score, schema, rows.slice(i, step), background, feats, sides, limits,
                             tasks.index(rank_task or tasks[0]), k)
              for i in range(0, rows.num_rows, step)]
    ms = (time.perf_counter() - t0) * 1000 / max(rows.num_rows, 1)
    cat = [np.concatenate([b[j] for b in blocks]) if blocks else np.zeros((0, 0, len(tasks)))
           for j in range(3)]
    names = [n for n, _, _ in feats] + [s.name for s in schema.sequences]
    kinds = [kd for _, kd, _ in feats] + ["stream"] * len(schema.sequences)
    unavailable = not feats and bool(feature_groups(schema))
    return Explanation(tasks, names, kinds, cat[0], cat[1], cat[2],
                       [e for b in blocks for e in b[3]],
                       list(row_ids) if row_ids is not None else list(range(rows.num_rows)), B,
                       per_row, ms, not unavailable,
                       ["features unavailable: no background rows to occlude them with"]
                       if unavailable else [])


def _explain_block(score: TableScorer, schema: FeatureSchema, rows: pa.Table,
                   background: pa.Table | None, feats: list, sides: list[str],
                   limits: dict[str, int], rank: int, k: int):
    """(logits [N, T], contributions [N, G, T], sides [N, 3, T], events) of a few rows, all their
    occluded copies scored in one call."""
    N, T = rows.num_rows, len(schema.tasks)
    B = background.num_rows if feats else 0
    idx, bg = np.repeat(np.arange(N), B), np.tile(np.arange(B), N)
    parts = [rows] + [swap_columns(rows, background, [n], idx, bg) for n, _, _ in feats]
    parts += [swap_columns(rows, background, [n for n, _, g in feats if g == side], idx, bg)
              for side in sides]
    parts += [drop_events(rows, s, np.arange(N), np.full(N, -2)) for s in schema.sequences]
    loo = {}
    for s in schema.sequences:  # the newest M events of each row, newest first
        lengths = np.diff(_list_parts(rows.column(s.ts_column))[1])
        m = np.minimum(lengths, min(MAX_EVENTS, limits[s.name]))
        within = np.arange(int(m.sum())) - np.repeat(np.cumsum(m) - m, m)
        loo[s.name] = (np.repeat(np.arange(N), m), np.repeat(lengths, m) - 1 - within)
        parts.append(drop_events(rows, s, *loo[s.name]))
    z = score(pa.concat_tables([p.select(rows.column_names) for p in parts]))
    base, at = z[:N], N
    n_groups = len(feats) + len(schema.sequences)
    contrib, side_c = np.empty((N, n_groups, T)), np.full((N, len(SIDES), T), np.nan)
    for j in range(len(feats)):
        contrib[:, j] = base - z[at:at + N * B].reshape(N, B, T).mean(1)
        at += N * B
    for side in sides:
        side_c[:, SIDES.index(side)] = base - z[at:at + N * B].reshape(N, B, T).mean(1)
        at += N * B
    for j in range(len(schema.sequences)):
        contrib[:, len(feats) + j] = base - z[at:at + N]
        at += N
    events: list[dict[str, list[dict]]] = [{} for _ in range(N)]
    for s in schema.sequences:
        r, pos = loo[s.name]
        _top_events(events, rows, s, r, pos, base[r] - z[at:at + len(r)], rank, k,
                    schema.task_names, schema.time_column)
        at += len(r)
    return base, contrib, side_c, events


def _top_events(events: list[dict], rows: pa.Table, s, r: np.ndarray, pos: np.ndarray,
                eff: np.ndarray, rank: int, k: int, tasks: list[str], time_column: str) -> None:
    """Fill ``events[row][stream]`` with the row's k events of largest |effect| on ``rank``."""
    _, off = _list_parts(rows.column(s.ts_column))
    flat = {c: _list_parts(rows.column(c))[0].to_numpy(zero_copy_only=False)
            for c in stream_columns(s)}
    request_ts = rows.column(time_column).to_numpy()
    for row in range(rows.num_rows):
        mine = np.flatnonzero(r == row)
        order = mine[np.argsort(-np.abs(eff[mine, rank]), kind="stable")][:k]
        out = []
        for i in order:
            at = off[row] + pos[i]
            ts = int(flat[s.ts_column][at])
            out.append({"index": int(pos[i]),
                        "newest_rank": int(off[row + 1] - off[row] - 1 - pos[i]),
                        "item": int(flat[s.item_column][at]),
                        "event": int(flat[s.event_column][at]),
                        "age_s": int(request_ts[row]) - ts,
                        "attributes": {a.name: int(flat[s.attribute_column(a)][at])
                                       for a in s.attributes},
                        "values": {v: float(flat[s.value_column(v)][at]) for v in s.values},
                        "effect": {t: float(x) for t, x in zip(tasks, eff[i])}})
        events[row][s.name] = out


# ------------------------------------------------------------------------------ a run on a dataset

def read_rows(data_dir: str | Path, schema: FeatureSchema, split: str,
              rows: list[int], strict: bool = True) -> pa.Table:
    """Rows ``rows`` (indices into ``split``, in its order) with histories joined, in the order
    asked; an index past the split's end is refused by name, and so (``strict``) is a row the
    loader would quarantine, else it is left out."""
    from opengem.data.events import ShardReader
    from opengem.data.loader import split_files
    from opengem.data.parquet import DatasetManifest

    manifest = DatasetManifest.load(data_dir)
    files = split_files(manifest, split)
    total = sum(f.rows for f in files)
    bad = [r for r in rows if not 0 <= r < total]
    if bad:
        raise ValueError(f"row {bad[0]} is not a row of split {split!r} of {data_dir} "
                         f"(it has rows 0..{total - 1})")
    reader, parts, start = ShardReader(data_dir, manifest, schema), {}, 0
    want = np.asarray(rows, dtype=np.int64)
    for f in files:
        mine = np.unique(want[(want >= start) & (want < start + f.rows)])
        if len(mine):
            t = reader.read(f, schema.columns()).take(pa.array(mine - start))
            parts.update({int(r): t.slice(i, 1) for i, r in enumerate(mine)})
        start += f.rows
    table = pa.concat_tables([parts[int(r)] for r in want]).combine_chunks()
    keep, _, reason = validate_rows(table, schema)
    if not strict:
        return table.filter(pa.array(keep))
    if not keep.all():
        i = int(np.flatnonzero(~keep)[0])
        raise ValueError(f"row {rows[i]} of split {split!r} would be quarantined by the loader "
                         f"({reason[i]}): the model never scores it")
    return table


def split_size(data_dir: str | Path, split: str) -> int:
    from opengem.data.parquet import DatasetManifest

    return sum(f.rows for f in DatasetManifest.load(data_dir).split_files(split))


def background_rows(data_dir: str | Path, schema: FeatureSchema, n: int = 16, seed: int = 0,
                    split: str = "train") -> pa.Table:
    """``n`` rows of ``split`` drawn uniformly with ``seed`` (a fixed seed: the same background,
    so the same explanation, on every call); rows the loader would quarantine are skipped."""
    size = split_size(data_dir, split)
    if size == 0:
        raise ValueError(f"{data_dir}: split {split!r} has no rows to draw a background from")
    picks = np.random.default_rng(seed).permutation(size)[:n * 2]
    table = read_rows(data_dir, schema, split, sorted(int(x) for x in picks), strict=False)
    return table.slice(0, n)


def parse_rows(text: str) -> list[int]:
    """``0,5,9`` or ``10-19`` (or both, comma-separated) → row indices; else refused by name."""
    rows: list[int] = []
    for part in text.split(","):
        a, _, b = part.strip().partition("-")
        try:
            rows += list(range(int(a), int(b) + 1)) if b else [int(a)]
        except ValueError:
            raise ValueError(f"--rows: {part!r} is not a row index or a range a-b") from None
    return rows


def explain_run(run: str | Path, data_dir: str | Path, rows: list[int] | None = None,
                sample: int | None = None, split: str = "test", k: int = 5,
                background: int = 16, seed: int = 0, checkpoint: str = "best") -> Explanation:
    """``explain_rows`` of a run's model (loaded as ``evaluate`` loads it) on ``rows`` of
    ``split`` (or ``sample`` rows drawn with ``seed``); a run of another schema than the data's is
    refused by name."""
    from opengem.run import load_run_model, use_best

    schema = FeatureSchema.load(Path(data_dir) / "schema.json")
    model, _, run_schema = load_run_model(run, best=use_best(run, checkpoint))
    if run_schema.fingerprint() != schema.fingerprint():
        raise ValueError(f"run {run} was trained on another schema than {data_dir}'s "
                         "(fingerprints differ): its explanations would not be of these inputs")
    if (rows is None) == (sample is None):
        raise ValueError("explain needs --rows or --sample (one of them)")
    if k < 1 or background < 0 or (sample is not None and sample < 1) or rows == []:
        raise ValueError(f"explain needs k >= 1 (got {k}), background >= 0 (got {background}) "
                         f"and at least one row")
    if sample is not None:
        size = split_size(data_dir, split)
        rows = sorted(int(x) for x in np.random.default_rng(seed).choice(
            size, min(sample, size), replace=False))
    table = read_rows(data_dir, schema, split, rows)
    bg = background_rows(data_dir, schema, background, seed) if background else None
    return explain_rows(model, schema, table, bg, k=k, row_ids=rows)


def format_explanation(ex: Explanation, top: int = 6) -> str:
    """A readable print: per row and task the largest contributions, the sides, the top events."""
    head = (f"occlusion explanations of {len(ex.rows)} rows (logit units; {ex.background_rows} "
            f"background rows; {ex.forwards_per_row} forwards/row, {ex.ms_per_row:.1f} ms/row)")
    lines = [head]
    lines += [f"note: {n}" for n in ex.notes]
    for i, r in enumerate(ex.rows):
        for j, t in enumerate(ex.tasks):
            c = ex.contributions[i, :, j]
            order = [g for g in np.argsort(-np.nan_to_num(np.abs(c), nan=-1))[:top]]
            groups = ", ".join(f"{ex.groups[g]} {c[g]:+.3f}" for g in order if np.isfinite(c[g]))
            side = ", ".join(f"{s} {ex.sides[i, k, j]:+.3f}" for k, s in enumerate(SIDES)
                             if np.isfinite(ex.sides[i, k, j]))
            lines.append(f"row {r} {t}: logit {ex.logits[i, j]:+.3f} | {groups}"
                         + (f" | sides: {side}" if side else ""))
        for s, evs in ex.events[i].items():
            if evs:
                lines.append(f"  {s} events: " + "; ".join(
                    f"item {e['item']} (type {e['event']}, {e['age_s']} s ago) "
                    f"{e['effect'][ex.tasks[0]]:+.3f}" for e in evs))
    lines.append("mean |contribution| over the rows (share ranked first):")
    for t, groups in ex.summary().items():
        best = sorted(groups.items(), key=lambda kv: -np.nan_to_num(kv[1]["mean_abs"]))[:top]
        lines.append(f"  {t}: " + ", ".join(f"{g} {v['mean_abs']:.3f} ({v['first_share']:.0%})"
                                            for g, v in best))
    return "\n".join(lines)
