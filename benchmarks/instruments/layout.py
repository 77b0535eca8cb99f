"""Bytes on disk of a dataset in layout v1 (histories copied into every row) and v2 (event logs
stored once per user; ``opengem.data.events``): the measurement ``benchmarks/dataset_layout.py`` and
``opengem bench --quick`` share."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from opengem.data.parquet import stream_columns
from opengem.features.schema import FeatureSchema
from opengem.world.generate import WorldConfig, generate


def parquet_bytes(data: Path) -> dict[str, int]:
    """Bytes on disk of a dataset's Parquet files: total, event logs, and history columns inside
    shards (compressed column-chunk sizes from the footers)."""
    files = list(data.rglob("*.parquet"))
    histories = stream_columns(FeatureSchema.load(data))
    in_rows = 0
    for f in (data / "shards").glob("*.parquet"):
        md = pq.ParquetFile(f).metadata
        in_rows += sum(md.row_group(g).column(c).total_compressed_size
                       for g in range(md.num_row_groups)
                       for c in range(md.num_columns)
                       if md.row_group(g).column(c).path_in_schema.split(".list")[0]
                       in histories)
    return {"total": sum(f.stat().st_size for f in files),
            "event_logs": sum(f.stat().st_size for f in files
                              if "events" in f.relative_to(data).parts),
            "history_columns_in_shards": in_rows}


def layout_bytes(cfg: WorldConfig, root: Path) -> dict:
    """The world ``cfg`` written in both layouts under ``root`` (``v1``, ``v2``; same seed,
    same rows):
    their rows, ``parquet_bytes`` each, and ``dataset_bytes_v1_over_v2`` (total bytes)."""
    out: dict = {}
    for layout in ("v1", "v2"):
        m = generate(cfg, root / layout, progress=False, layout=layout)
        out["rows"] = sum(f.rows for f in m.files)
        out[f"bytes_{layout}"] = parquet_bytes(root / layout)
    out["dataset_bytes_v1_over_v2"] = round(out["bytes_v1"]["total"] / out["bytes_v2"]["total"], 2)
    return out
