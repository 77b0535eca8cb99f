"""Real-data adapters: public sets (and any table + a JSON spec) → Parquet shards + ``schema.json``.

Every adapter writes the layout of ``opengem.data.parquet`` through ``common.write_dataset``, so
``opengem train --data DIR`` and ``opengem evaluate`` read its output unchanged. See each module's
docstring for its split protocol and features, and ``common`` for ids and leakage-free histories.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI imports this package to build its parser; numpy/pyarrow load on use
    from opengem.data.parquet import DatasetManifest

SOURCES = ("movielens", "open_bandit", "criteo", "avazu", "taobao", "aliccp", "aliexpress",
           "generic")


def convert(source: str, in_path: str | Path, out_dir: str | Path,
            spec: str | Path | dict | None = None,
            seed: int = 0, key_file: str | Path | None = None) -> DatasetManifest:
    """Convert ``in_path`` (a ``source`` set) into a dataset directory ``out_dir``.

    ``spec`` (a JSON file or dict) is required by ``generic`` and refused by the others; ``seed``
    only matters for random splits; ``key_file``: the pseudonym key of a generic spec that
    pseudonymises user ids (``opengem.data.pseudonym``).
    """
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; choose from {list(SOURCES)}")
    if (spec is None) == (source == "generic"):
        raise ValueError("--spec is required with --source generic" if spec is None
                         else f"--spec is only for --source generic (the {source} spec is "
                              f"built in)")
    if key_file is not None and source != "generic":
        raise ValueError(f"--key-file is only for --source generic (a spec that pseudonymises "
                         f"user ids); {source} does not pseudonymise")
    from opengem.data.card import dataset_card

    manifest = _convert(source, in_path, out_dir, spec, seed, key_file)
    manifest.card = dataset_card(out_dir, manifest)  # read before training: docs/dataset-layout
    manifest.save(out_dir)
    return manifest


def _convert(source: str, in_path: str | Path, out_dir: str | Path,
             spec: str | Path | dict | None, seed: int,
             key_file: str | Path | None) -> DatasetManifest:
    if source == "movielens":
        from opengem.data.sources import movielens

        return movielens.convert(in_path, out_dir)
    if source == "open_bandit":
        from opengem.data.sources import open_bandit

        return open_bandit.convert(in_path, out_dir)
    if source == "generic":
        from opengem.data.sources import generic

        return generic.convert(in_path, out_dir, spec, seed, key_file=key_file)
    from opengem.data.sources import ctr

    return ctr.convert(source, in_path, out_dir, seed)
