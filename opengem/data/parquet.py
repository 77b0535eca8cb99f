"""Parquet shards and the dataset manifest.

A dataset directory holds (layout 1, "v1")::

    DIR/schema.json      the FeatureSchema
    DIR/dataset.json     the manifest: layout, files (path, day, rows), splits (day lists), source info
    DIR/shards/*.parquet one impression per row; sequences as list<int64> columns (per-event
                         values as list<float32>)

Layout 2 ("v2", ``docs/dataset-layout.md``) stores each stream's events once per user instead, in
``DIR/events/<stream>/bucket=<b>/*.parquet``; impression shards then carry no history columns and
name the user bucket whose event files hold their users' events (``opengem.data.events``
joins them).

Every producer (the synthetic world, the real-data adapters) writes this layout through
``ShardWriter``; the loader reads it through ``DatasetManifest``. A manifest without ``layout``
is v1.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from opengem.features.schema import SCHEMA_FILE, FeatureSchema, SchemaError, SequenceStream

MANIFEST = "dataset.json"
# the manifest's "layout": v1 copies histories into rows, v2 joins event logs
LAYOUT_V1, LAYOUT_V2 = 1, 2
LAYOUTS = {"v1": LAYOUT_V1, "v2": LAYOUT_V2}


class DataError(ValueError):
    """A data file or manifest is unusable. The message names the file and the problem."""


def list_array(values: np.ndarray, lengths: np.ndarray) -> pa.ListArray:
    """A ``list<int64>`` (or float) Arrow column from flat values and per-row lengths, no copy
    of rows."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] != len(values):
        raise ValueError(f"lengths sum to {offsets[-1]} but there are {len(values)} values")
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values))


@dataclass
class ShardInfo:
    path: str  # relative to the dataset dir
    day: int
    rows: int
    # v2: the user bucket whose event files hold this shard's users' events
    bucket: int | None = None


@dataclass
class EventFileInfo:
    """One Parquet file of a stream's event log (v2): a bucket's files, in listed order, are
    its log."""

    path: str  # relative to the dataset dir
    bucket: int
    rows: int


@dataclass
class DatasetManifest:
    files: list[ShardInfo]
    splits: dict[str, list[int]]
    source: dict = field(default_factory=dict)
    layout: int = LAYOUT_V1
    # v2: stream → its event files
    events: dict[str, list[EventFileInfo]] = field(default_factory=dict)
    # the dataset card (opengem.data.card) and one record per `opengem forget` (no user ids);
    # written only when present, so manifests without them keep their bytes
    card: dict = field(default_factory=dict)
    deletions: list[dict] = field(default_factory=list)

    def split_files(self, split: str) -> list[ShardInfo]:
        if split not in self.splits:
            raise DataError(f"unknown split {split!r}; the manifest has {sorted(self.splits)}")
        days = set(self.splits[split])
        return [f for f in self.files if f.day in days]

    def event_files(self, stream: str, bucket: int) -> list[EventFileInfo]:
        return [e for e in self.events.get(stream, []) if e.bucket == bucket]

    def to_dict(self) -> dict:
        files = [{k: v for k, v in vars(f).items() if v is not None} for f in self.files]
        out = {"layout": self.layout, "files": files, "splits": self.splits, "source": self.source}
        if self.layout != LAYOUT_V1:
            out["events"] = {s: [vars(e) for e in es] for s, es in self.events.items()}
        out |= {k: v for k, v in (("card", self.card), ("deletions", self.deletions)) if v}
        return out

    def save(self, data_dir: str | Path) -> None:
        """Write ``dataset.json`` atomically (a temporary file renamed over it): a reader sees
        the old manifest or the new one, never half of one."""
        tmp = Path(data_dir) / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2))
        os.replace(tmp, Path(data_dir) / MANIFEST)

    @classmethod
    def load(cls, data_dir: str | Path) -> "DatasetManifest":
        p = Path(data_dir) / MANIFEST
        if not p.exists():
            raise DataError(f"{data_dir}: no {MANIFEST} (not a dataset directory; run `opengem "
                            f"generate` first?)")
        try:
            d = json.loads(p.read_text())
            files = [ShardInfo(**f) for f in d["files"]]
            splits = {k: [int(x) for x in v] for k, v in d["splits"].items()}
            layout = d.get("layout", LAYOUT_V1)  # manifests written before layouts existed are v1
            events = {s: [EventFileInfo(**e) for e in es] for s, es in d.get("events", {}).items()}
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise DataError(f"{p}: malformed manifest ({e})") from e
        if layout not in (LAYOUT_V1, LAYOUT_V2):
            raise DataError(f"{p}: layout {layout!r} is not supported (1 or 2)")
        if layout == LAYOUT_V2:
            no_bucket = [f.path for f in files if f.bucket is None]
            if no_bucket:
                raise DataError(f"{p}: layout 2 but files {no_bucket[:3]} name no bucket")
        return cls(files=files, splits=splits, source=d.get("source", {}), layout=layout,
                   events=events, card=d.get("card", {}), deletions=d.get("deletions", []))


TS = "ts"  # the event time column of an event log (seconds, like request_ts)


def event_columns(schema: FeatureSchema, stream: SequenceStream) -> list[str]:
    """An event log's columns: the user, the time, then what each event carries (item, event
    type, attributes, numeric values)."""
    cols = [schema.user_column, TS, "item", "event"] + [a.name for a in stream.attributes] + list(
        stream.values)
    if len(set(cols)) != len(cols):
        raise DataError(f"stream {stream.name!r}: attribute or value names clash with the event "
                        f"log's columns {cols[:4]}")
    return cols


def stream_columns(schema: FeatureSchema) -> set[str]:
    """The history list columns of every stream (what v2 impression shards do not hold)."""
    return {c for s in schema.sequences
            for c in [s.item_column, s.event_column, s.ts_column]
            + [s.attribute_column(a) for a in s.attributes] + list(s.value_columns)}


def impression_columns(schema: FeatureSchema, layout: int = LAYOUT_V1,
                       with_probs: bool = True) -> list[str]:
    """The columns an impression shard of ``layout`` holds."""
    drop = stream_columns(schema) if layout == LAYOUT_V2 else set()
    return [c for c in schema.columns(with_probs) if c not in drop]


class ShardWriter:
    """Writes shards into ``DIR/shards`` (v2: also event logs into ``DIR/events``) and, on
    ``close()``, the schema and manifest.

    Files are written to a temporary name and renamed, so a crash never leaves a truncated file
    under a name the manifest lists.
    """

    def __init__(self, out_dir: str | Path, schema: FeatureSchema, row_group_size: int = 16384,
                 layout: int = LAYOUT_V1):
        if layout not in (LAYOUT_V1, LAYOUT_V2):
            raise ValueError(f"layout must be {LAYOUT_V1} or {LAYOUT_V2}, got {layout!r}")
        self.out = Path(out_dir)
        (self.out / "shards").mkdir(parents=True, exist_ok=True)
        self.schema = schema
        self.row_group_size = row_group_size
        self.layout = layout
        self.files: list[ShardInfo] = []
        self.events: dict[str, list[EventFileInfo]] = {}

    def write(self, table: pa.Table, name: str, day: int, bucket: int | None = None) -> ShardInfo:
        missing = [c for c in impression_columns(self.schema, self.layout)
                   if c not in table.column_names]
        if missing:
            raise SchemaError(f"shard {name}: missing columns {missing}")
        if (bucket is None) != (self.layout == LAYOUT_V1):
            raise ValueError(f"shard {name}: a bucket is required in layout 2 and not allowed "
                             f"in layout 1")
        rel = f"shards/{name}.parquet"
        self._write(table, rel)
        info = ShardInfo(path=rel, day=int(day), rows=table.num_rows,
                         bucket=None if bucket is None else int(bucket))
        self.files.append(info)
        return info

    def write_events(self, stream: str, bucket: int, table: pa.Table) -> EventFileInfo:
        """One bucket's event log of ``stream`` (columns: ``event_columns``),
        already sorted by user then time; v2 only."""
        if self.layout != LAYOUT_V2:
            raise ValueError("event logs are written in layout 2 only")
        missing = [c for c in event_columns(self.schema, self.schema.stream(stream))
                   if c not in table.column_names]
        if missing:
            raise SchemaError(f"event log {stream} bucket {bucket}: missing columns {missing}")
        rel = f"events/{stream}/bucket={bucket:05d}/part-0.parquet"
        (self.out / rel).parent.mkdir(parents=True, exist_ok=True)
        # Sorted user and time columns delta-encode to ~1/3 fewer bytes of the log
        # than dictionaries.
        delta = {self.schema.user_column: "DELTA_BINARY_PACKED", "ts": "DELTA_BINARY_PACKED"}
        self._write(table, rel, use_dictionary=[c for c in table.column_names if c not in delta],
                    column_encoding=delta)
        info = EventFileInfo(path=rel, bucket=int(bucket), rows=table.num_rows)
        self.events.setdefault(stream, []).append(info)
        return info

    def _write(self, table: pa.Table, rel: str, **options) -> None:
        tmp = self.out / (rel + ".tmp")
        pq.write_table(table, tmp, row_group_size=self.row_group_size, compression="zstd",
                       **options)
        os.replace(tmp, self.out / rel)

    def close(self, splits: dict[str, list[int]], source: dict | None = None) -> DatasetManifest:
        self.schema.save(self.out / SCHEMA_FILE)
        files = sorted(self.files, key=lambda f: (f.day, f.path))
        events = {s: sorted(es, key=lambda e: (e.bucket, e.path)) for s,
                  es in sorted(self.events.items())}
        manifest = DatasetManifest(files=files, splits=splits, source=source or {},
                                   layout=self.layout, events=events)
        tmp = self.out / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest.to_dict(), indent=2))
        os.replace(tmp, self.out / MANIFEST)
        return manifest


def read_shard(data_dir: str | Path, info: ShardInfo, columns: list[str],
               schema: FeatureSchema | None = None) -> pa.Table:
    """Read one shard's columns. A missing, empty or truncated file, a missing column, a column of
    the wrong type (checked against ``schema`` if given) or a row count other than the manifest's is
    a ``DataError`` naming the file and the column."""
    path = Path(data_dir) / info.path
    if not path.exists():
        raise DataError(f"{path}: listed in the manifest but missing")
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from e
    have = set(pf.schema_arrow.names)
    missing = [c for c in columns if c not in have]
    if missing:
        hint = (" (a layout 2 shard: histories are joined from the event logs "
                "by opengem.data.events.ShardReader)"
                if getattr(info, "bucket", None) is not None and schema
                and set(missing) <= stream_columns(schema)
                else "")
        raise DataError(f"{path}: missing columns {missing}{hint}")
    wrong = _wrong_types(pf.schema_arrow, schema, columns) if schema is not None else []
    if wrong:
        raise DataError(f"{path}: " + "; ".join(wrong)
                        + " (the data does not match its schema.json)")
    if pf.metadata.num_rows != info.rows:
        raise DataError(f"{path}: holds {pf.metadata.num_rows} rows but the manifest "
                        f"lists {info.rows} "
                        "(rewritten or truncated after it was written)")
    try:
        return pf.read(columns=columns)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: could not read ({e})") from e


def _is_int_list(t: pa.DataType) -> bool:
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type)


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _is_number_list(t: pa.DataType) -> bool:
    return (
        pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    ) and (pa.types.is_integer(t.value_type) or pa.types.is_floating(t.value_type))


def _is_value_list(t: pa.DataType) -> bool:
    """A per-event value column: a (variable-length) list of numbers."""
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and (
        pa.types.is_integer(t.value_type) or pa.types.is_floating(t.value_type))


def expected_types(schema: FeatureSchema) -> dict[str, tuple[str, Callable[[pa.DataType], bool]]]:
    """Column → (what it must be, a check of its Arrow type), per the layout
    in ``features.schema``."""
    integer, int_list = ("an integer", pa.types.is_integer), ("a list of integers", _is_int_list)
    out = {c: integer
           for c in (schema.user_column, schema.time_column, schema.day_column,
                     schema.domains.column)}
    out |= {f.name: int_list if f.multi_hot else integer for f in schema.sparse}
    out |= {f.name: ("a number", _is_number) for f in schema.dense}
    out |= {f.name: (f"a list of {f.dim} numbers", _is_number_list) for f in schema.embeddings}
    for s in schema.sequences:
        out |= {c: int_list for c in [s.item_column, s.event_column, s.ts_column]
                + [s.attribute_column(a) for a in s.attributes]}
        out |= {c: ("a list of numbers (one per event)", _is_value_list) for c in s.value_columns}
    for t in schema.tasks:
        out[t.label_column] = ("a number (a 0/1 label, null if unknown)", _is_number)
        if t.prob_column:
            out[t.prob_column] = ("a number", _is_number)
    return out


def _wrong_types(arrow: pa.Schema, schema: FeatureSchema, columns: list[str]) -> list[str]:
    expected = expected_types(schema)
    return [f"column {c!r} is {arrow.field(c).type}, expected {expected[c][0]}"
            for c in columns if c in expected and not expected[c][1](arrow.field(c).type)]
