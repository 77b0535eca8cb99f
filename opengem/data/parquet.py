"""Parquet shards and the dataset manifest.

A dataset directory holds::

    DIR/schema.json      the FeatureSchema
    DIR/dataset.json     the manifest: files (path, day, rows), splits (day lists), source info
    DIR/shards/*.parquet one impression per row; sequences as list<int64> columns

Every producer (the synthetic world, the real-data adapters) writes this layout through
``ShardWriter``; the loader reads it through ``DatasetManifest``.
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

from opengem.features.schema import SCHEMA_FILE, FeatureSchema, SchemaError

MANIFEST = "dataset.json"


class DataError(ValueError):
    """A data file or manifest is unusable. The message names the file and the problem."""


def list_array(values: np.ndarray, lengths: np.ndarray) -> pa.ListArray:
    """A ``list<int64>`` (or float) Arrow column from flat values and per-row lengths, no copy of rows."""
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


@dataclass
class DatasetManifest:
    files: list[ShardInfo]
    splits: dict[str, list[int]]
    source: dict = field(default_factory=dict)

    def split_files(self, split: str) -> list[ShardInfo]:
        if split not in self.splits:
            raise DataError(f"unknown split {split!r}; the manifest has {sorted(self.splits)}")
        days = set(self.splits[split])
        return [f for f in self.files if f.day in days]

    def to_dict(self) -> dict:
        return {"files": [vars(f) for f in self.files], "splits": self.splits, "source": self.source}

    @classmethod
    def load(cls, data_dir: str | Path) -> "DatasetManifest":
        p = Path(data_dir) / MANIFEST
        if not p.exists():
            raise DataError(f"{data_dir}: no {MANIFEST} (not a dataset directory; run `opengem generate` first?)")
        try:
            d = json.loads(p.read_text())
            files = [ShardInfo(**f) for f in d["files"]]
            splits = {k: [int(x) for x in v] for k, v in d["splits"].items()}
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise DataError(f"{p}: malformed manifest ({e})") from e
        return cls(files=files, splits=splits, source=d.get("source", {}))


class ShardWriter:
    """Writes shards into ``DIR/shards`` and, on ``close()``, the schema and manifest.

    Shards are written to a temporary name and renamed, so a crash never leaves a truncated shard
    under a name the manifest lists.
    """

    def __init__(self, out_dir: str | Path, schema: FeatureSchema, row_group_size: int = 16384):
        self.out = Path(out_dir)
        (self.out / "shards").mkdir(parents=True, exist_ok=True)
        self.schema = schema
        self.row_group_size = row_group_size
        self.files: list[ShardInfo] = []

    def write(self, table: pa.Table, name: str, day: int) -> ShardInfo:
        missing = [c for c in self.schema.columns() if c not in table.column_names]
        if missing:
            raise SchemaError(f"shard {name}: missing columns {missing}")
        rel = f"shards/{name}.parquet"
        tmp = self.out / (rel + ".tmp")
        pq.write_table(table, tmp, row_group_size=self.row_group_size, compression="zstd")
        os.replace(tmp, self.out / rel)
        info = ShardInfo(path=rel, day=int(day), rows=table.num_rows)
        self.files.append(info)
        return info

    def close(self, splits: dict[str, list[int]], source: dict | None = None) -> DatasetManifest:
        self.schema.save(self.out / SCHEMA_FILE)
        files = sorted(self.files, key=lambda f: (f.day, f.path))
        manifest = DatasetManifest(files=files, splits=splits, source=source or {})
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
        raise DataError(f"{path}: missing columns {missing}")
    wrong = _wrong_types(pf.schema_arrow, schema, columns) if schema is not None else []
    if wrong:
        raise DataError(f"{path}: " + "; ".join(wrong) + " (the data does not match its schema.json)")
    if pf.metadata.num_rows != info.rows:
        raise DataError(f"{path}: holds {pf.metadata.num_rows} rows but the manifest lists {info.rows} "
                        "(rewritten or truncated after it was written)")
    try:
        return pf.read(columns=columns)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: could not read ({e})") from e


def _is_int_list(t: pa.DataType) -> bool:
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type)


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def expected_types(schema: FeatureSchema) -> dict[str, tuple[str, Callable[[pa.DataType], bool]]]:
    """Column → (what it must be, a check of its Arrow type), per the layout in ``features.schema``."""
    integer, int_list = ("an integer", pa.types.is_integer), ("a list of integers", _is_int_list)
    out = {c: integer for c in (schema.user_column, schema.time_column, schema.day_column, schema.domains.column)}
    out |= {f.name: int_list if f.multi_hot else integer for f in schema.sparse}
    out |= {f.name: ("a number", _is_number) for f in schema.dense}
    for s in schema.sequences:
        out |= {c: int_list for c in [s.item_column, s.event_column, s.ts_column]
                + [s.attribute_column(a) for a in s.attributes]}
    for t in schema.tasks:
        out[t.label_column] = ("a number (a 0/1 label, null if unknown)", _is_number)
        if t.prob_column:
            out[t.prob_column] = ("a number", _is_number)
    return out


def _wrong_types(arrow: pa.Schema, schema: FeatureSchema, columns: list[str]) -> list[str]:
    expected = expected_types(schema)
    return [f"column {c!r} is {arrow.field(c).type}, expected {expected[c][0]}"
            for c in columns if c in expected and not expected[c][1](arrow.field(c).type)]
