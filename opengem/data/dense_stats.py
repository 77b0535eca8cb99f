"""Per-feature statistics of the dense features on the training split, what the model's dense
normaliser is fitted on (``opengem.model.dense_norm``).

Only the dense columns are read. Every rank reads the same files and gets the same figures, so no
collective is needed and a resumed or sharded run normalises exactly as a single process does. At
scale the read is capped: files are taken evenly across the split (every k-th) until ``max_rows``
rows are read — a uniform sample of days, deterministic, and far below a training pass.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from opengem.data.parquet import DataError, DatasetManifest, read_shard
from opengem.features.schema import FeatureSchema

__all__ = ["DENSE_QUANTILES", "train_dense_stats"]

# quantile knots per feature (32 equal-mass bins): the rank transform's resolution
DENSE_QUANTILES = 33


def train_dense_stats(data_dir: str | Path, schema: FeatureSchema, split: str,
                      max_rows: int = 1_000_000,
                      num_quantiles: int = DENSE_QUANTILES) -> dict[str, list]:
    """``{"names", "mean", "std", "quantiles"}`` of each dense feature over ``split`` (non-finite
    values are skipped: the loader quarantines those rows, or they are missing values).
    ``quantiles[f]`` has ``num_quantiles`` knots from the minimum to the maximum. When the schema
    has ``missing="indicator"`` features, also ``"median"`` (what a missing value is imputed with)
    and ``"missing"`` (NaNs read, per feature). Raises ``DataError`` when the split has no finite
    value of a feature."""
    names = [f.name for f in schema.dense]
    if not names:
        return {"names": [], "mean": [], "std": [], "quantiles": []}
    manifest = DatasetManifest.load(data_dir)
    files = manifest.split_files(split)
    total = sum(f.rows for f in files)
    stride = max(1, int(np.ceil(total / max_rows))) if max_rows > 0 else 1
    cols: list[list[np.ndarray]] = [[] for _ in names]
    missing = [0] * len(names)
    for info in files[::stride]:
        table = read_shard(data_dir, info, names, schema)
        for i, n in enumerate(names):
            v = table.column(n).to_numpy(zero_copy_only=False).astype(np.float64)
            missing[i] += int(np.isnan(v).sum())
            cols[i].append(v[np.isfinite(v)])
    out: dict[str, list] = {"names": names, "mean": [], "std": [], "quantiles": []}
    if schema.dense_missing:  # only then: other runs' dense_stats.json stay as they were
        out["median"], out["missing"] = [], missing
    qs = np.linspace(0.0, 1.0, num_quantiles)
    for n, parts in zip(names, cols):
        v = np.concatenate(parts) if parts else np.zeros(0)
        if v.size == 0:
            raise DataError(f"{data_dir}: dense feature {n!r} has no finite value in "
                            f"split {split!r}; "
                            "it cannot be normalised (drop it from the schema or fill it "
                            "at import)")
        out["mean"].append(float(v.mean()))
        out["std"].append(float(v.std()))
        out["quantiles"].append([float(x) for x in np.quantile(v, qs)])
        if "median" in out:
            out["median"].append(float(np.median(v)))
    return out
