"""Forgetting users: their impressions and events removed from a dataset, its other bytes kept.

``forget_dataset(DATA, user_ids)`` rewrites only the files that hold one of the users (in v2 the
shards and event files of their buckets; other files stay byte-identical) and records the deletion
in the manifest: counts and time, no ids. The ids are the dataset's int64 ``user_id``; a
pseudonymised import maps raw ids to them with its key (``opengem.data.pseudonym.user_ids_of``).

Crash safety, in order: (1) every rewritten file is written beside the old one under a new name
(``<name>.forget<N>.parquet``); (2) a journal (``forget.journal.json``) lists the new and the old
files; (3) the manifest is swapped with ``os.replace``; (4) the old files are removed, then the
journal. A crash before (3) leaves the old manifest, which lists only the old, intact files; a
crash after it leaves the new one. ``recover`` (run first by every forget) finishes or undoes what
a journal describes and removes ``.forget<N>`` files no manifest lists.

Both layouts: a v1 row's history lists are its own user's events, so removing the user's rows
removes them. Left as they were (``docs/dataset-layout.md``): the schema's vocabularies and
statistics fitted on the import's train rows, and models already trained.

Forget lists (``read_forget_list``): a text file (``.txt``), one id per line (blank lines and
``#`` comments skipped), or a Parquet/CSV file (``.parquet``/``.csv``) with a ``user_id`` column.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from opengem.data.card import dataset_card
from opengem.data.parquet import DataError, DatasetManifest
from opengem.data.pseudonym import write_pseudonyms
from opengem.features.schema import FeatureSchema

log = logging.getLogger("opengem")

JOURNAL = "forget.journal.json"
_TAG = re.compile(r"\.forget\d+(?=\.parquet$)")  # a rewritten file's name: <name>.forget<N>.parquet
LIST_FORMATS = ".txt (one id per line), .parquet or .csv (a user_id column)"


# ------------------------------------------------------------------------------------- the list
def read_forget_list(path: str | Path, raw: bool = False) -> np.ndarray:
    """The ids of a forget list: int64 user ids, or (``raw``) the raw ids' text.

    A line or cell that is not an integer (without ``raw``), a missing ``user_id`` column or a
    file of another kind is a ``DataError`` naming the file and the problem."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"forget list {p}: not found")
    suffix = p.suffix.lower()
    if suffix == ".txt":
        lines = [x.strip() for x in p.read_text().splitlines()]
        values = [x for x in lines if x and not x.startswith("#")]
    elif suffix in (".parquet", ".csv"):
        try:
            t = (pq.read_table(p) if suffix == ".parquet" else pa_csv.read_csv(
                p, convert_options=pa_csv.ConvertOptions(column_types={"user_id": pa.string()})))
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"forget list {p}: not a readable {suffix[1:]} file ({e})") from e
        if "user_id" not in t.column_names:
            raise DataError(f"forget list {p}: no user_id column (it has {t.column_names})")
        col = t.column("user_id")
        if col.null_count:
            raise DataError(f"forget list {p}: {col.null_count} empty user_id cells")
        values = [str(v) for v in col.to_pylist()]
    else:
        raise DataError(f"forget list {p}: a {suffix or 'suffix-less'} file; a forget list is "
                        f"{LIST_FORMATS}")
    if raw:
        return np.array(values, dtype=str)
    bad = [v for v in values if not re.fullmatch(r"[+-]?\d+", v)]
    if bad:
        raise DataError(f"forget list {p}: {len(bad)} ids are not integers (first: {bad[0]!r}); "
                        f"it holds the dataset's int64 user_id (raw ids of a pseudonymised "
                        f"import: --raw-ids --key-file)")
    return np.unique(np.array([int(v) for v in values], dtype=np.int64))


# ----------------------------------------------------------------------------------- the dataset
def forget_dataset(data_dir: str | Path, user_ids: np.ndarray, requested: int | None = None,
                   unknown_raw: int = 0) -> dict:
    """Remove the users ``user_ids`` from the dataset at ``data_dir``; returns the deletion record
    (also appended to the manifest's ``deletions``). ``requested``/``unknown_raw``: the raw ids
    asked for and those no pseudonym matched, when the ids came from raw ones."""
    data = Path(data_dir)
    recover(data)
    manifest, schema = DatasetManifest.load(data), FeatureSchema.load(data)
    ids = np.unique(np.asarray(user_ids, dtype=np.int64))
    n = len(manifest.deletions) + 1
    user = schema.user_column
    found: set[int] = set()
    new, old = [], []
    rows, events = 0, {s: 0 for s in manifest.events}
    try:
        for info in manifest.files:
            got = _rewrite(data, info, user, ids, n, found, new, old, events=False)
            rows += got
        for stream, files in manifest.events.items():
            for info in files:
                events[stream] += _rewrite(data, info, user, ids, n, found, new, old, events=True)
        manifest.files = [f for f in manifest.files if f.rows]
        manifest.events = {s: [e for e in es if e.rows] for s, es in manifest.events.items()}
        _forget_pseudonyms(data, manifest, ids, n, new, old)
        record = {"time": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                  "users_requested": int(requested if requested is not None else len(ids)),
                  "users_found": len(found),
                  "users_unknown": int(len(ids) - len(found) + unknown_raw),
                  "impressions_removed": rows, "events_removed": events,
                  "files_rewritten": len(new)}
        manifest.deletions.append(record)
        manifest.card = dataset_card(data, manifest, schema)
        _write_journal(data, new, old)
        manifest.save(data)
    except BaseException:
        for rel in new:  # the old manifest still lists the old files: undo the new ones
            (data / rel).unlink(missing_ok=True)
        (data / JOURNAL).unlink(missing_ok=True)
        raise
    _finish(data, old)
    log.info("forget %s: %d of %d users found; %d impressions and %s events removed; %d files "
             "rewritten", data, len(found), len(ids), rows, events, len(new))
    return record


def _rewrite(data: Path, info, user: str, ids: np.ndarray, n: int, found: set, new: list,
             old: list, events: bool) -> int:
    """Rewrite one listed file without the users' rows, if it holds any; returns the rows removed
    (``info`` then names the new file)."""
    path = data / info.path
    if not path.exists():
        raise DataError(f"{path}: listed in the manifest but missing")
    col = pq.read_table(path, columns=[user]).column(user)
    hit = pc.is_in(col, value_set=pa.array(ids, pa.int64()))
    if not pc.any(hit).as_py():
        return 0
    found.update(int(u) for u in pc.unique(pc.filter(col, hit)).to_pylist())
    pf = pq.ParquetFile(path)
    table = pf.read().filter(pc.invert(hit))
    rel = _TAG.sub("", info.path).removesuffix(".parquet") + f".forget{n}.parquet"
    _write(table, data / rel, pf, events, user)
    new.append(rel)
    old.append(info.path)
    removed = info.rows - table.num_rows
    info.path, info.rows = rel, table.num_rows
    return removed


def _write(table: pa.Table, path: Path, like: pq.ParquetFile, events: bool, user: str) -> None:
    """A rewritten file with the writer options of ``ShardWriter`` (row groups of the old file's
    first group size, zstd; event logs delta-encode the sorted user and time columns)."""
    size = like.metadata.row_group(0).num_rows if like.metadata.num_row_groups else 16384
    opts: dict = {}
    if events:
        delta = {user: "DELTA_BINARY_PACKED", "ts": "DELTA_BINARY_PACKED"}
        opts = {"use_dictionary": [c for c in table.column_names if c not in delta],
                "column_encoding": delta}
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp, row_group_size=max(size, 1), compression="zstd", **opts)
    os.replace(tmp, path)


def _forget_pseudonyms(data: Path, manifest: DatasetManifest, ids: np.ndarray, n: int,
                       new: list, old: list) -> None:
    """A pseudonymised dataset's pseudonyms of the users set to null: with the key, a raw id
    could otherwise still be found to have been in the dataset."""
    info = manifest.source.get("pseudonym")
    if not info:
        return
    names = pq.read_table(data / info["file"]).column("pseudonym").to_pylist()
    hit = [int(i) for i in ids if 0 <= i < len(names) and names[i] is not None]
    if not hit:
        return
    for i in hit:
        names[i] = None
    rel = _TAG.sub("", info["file"]).removesuffix(".parquet") + f".forget{n}.parquet"
    write_pseudonyms(data / rel, np.array(names, dtype=object))
    new.append(rel)
    old.append(info["file"])
    info["file"] = rel


# ----------------------------------------------------------------------------------- crash safety
def _write_journal(data: Path, new: list, old: list) -> None:
    tmp = data / (JOURNAL + ".tmp")
    tmp.write_text(json.dumps({"new": new, "old": old}, indent=1))
    os.replace(tmp, data / JOURNAL)


def _finish(data: Path, old: list) -> None:
    for rel in old:
        (data / rel).unlink(missing_ok=True)
    (data / JOURNAL).unlink(missing_ok=True)


def _listed(data: Path) -> set[str]:
    m = DatasetManifest.load(data)
    out = {f.path for f in m.files} | {e.path for es in m.events.values() for e in es}
    if m.source.get("pseudonym"):
        out.add(m.source["pseudonym"]["file"])
    return out


def recover(data_dir: str | Path) -> list[str]:
    """Finish or undo an interrupted forget: with a journal, the files of the manifest's side are
    kept and the others removed; then every ``.forget<N>`` file no manifest lists (written before
    a crash, before the journal) is removed. Returns the removed paths."""
    data = Path(data_dir)
    listed, removed = _listed(data), []
    j = data / JOURNAL
    if j.exists():
        d = json.loads(j.read_text())
        for rel in d["old"] + d["new"]:
            if rel not in listed and (data / rel).exists():
                (data / rel).unlink()
                removed.append(rel)
        j.unlink()
    for p in data.rglob("*.forget*.parquet*"):
        rel = p.relative_to(data).as_posix()
        if rel not in listed and (_TAG.search(rel) or rel.endswith(".tmp")):
            p.unlink()
            removed.append(rel)
    if removed:
        log.warning("forget %s: removed %d files of an interrupted forget: %s", data, len(removed),
                    removed[:5])
    return removed


# ------------------------------------------------------------------------------------ the command
def add_parser(subparsers) -> argparse.ArgumentParser:
    """``opengem forget --data DATA | --history-store STORE --users FILE [--raw-ids --key-file
    FILE]``; the handler is set by ``opengem.cli`` (the store's part lives in ``export``)."""
    f = subparsers.add_parser("forget",
                              help="remove users' impressions and events from a dataset "
                                   "and/or a history store (a deletion record, no ids, is kept)")
    f.add_argument("--data", default=None, metavar="DATA", help="the dataset to forget them in")
    f.add_argument("--history-store", default=None, metavar="STORE",
                   help="the serving history store (opengem history-store) to forget them in")
    f.add_argument("--users", required=True, metavar="FILE",
                   help=f"the forget list: {LIST_FORMATS}; the dataset's int64 user ids")
    f.add_argument("--raw-ids", action="store_true",
                   help="the list holds raw user ids of a pseudonymised import: hashed with "
                        "--key-file (or $OPENGEM_PSEUDONYM_KEY) and found in --data's pseudonyms")
    f.add_argument("--key-file", default=None, metavar="FILE",
                   help="the key the import pseudonymised with (only with --raw-ids)")
    return f
