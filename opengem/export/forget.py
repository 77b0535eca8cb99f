"""``opengem forget``: users removed from a dataset (``opengem.data.forget``) and from the serving
history store (here: the store's format is this package's, ``history.py``).

``forget_store(STORE, user_ids)`` writes each stream that holds one of the users again, without
them, beside the old files (``<stream>.forget<N>.arrow`` and its index), swaps ``history.json``
with ``os.replace`` and then removes the old files; a crash before the swap leaves the old store
whole (the new files are removed by the next forget: every ``.arrow`` file ``history.json`` does
not name is an orphan, the store directory being the store's own). A request for a forgotten user
then finds no events (``ArrowHistoryStore.lookup`` answers nothing: an empty history). A running
server keeps the files it mapped: restart it (or reload) to serve the new store.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from opengem.export.history import META, HistoryStoreError

log = logging.getLogger("opengem")

_TAG = re.compile(r"\.forget\d+(?=\.(users\.)?arrow$)")


def forget_store(store_dir: str | Path, user_ids: np.ndarray) -> dict:
    """Remove the users ``user_ids`` from the history store at ``store_dir``; returns the deletion
    record (also appended to ``history.json``'s ``deletions``: counts and time, no ids)."""
    root = Path(store_dir)
    try:
        meta = json.loads((root / META).read_text())
    except (OSError, ValueError) as e:
        raise HistoryStoreError(f"{root}: not a history store ({META}: {e})") from e
    _orphans(root, meta)
    ids = np.unique(np.asarray(user_ids, dtype=np.int64))
    n = len(meta.get("deletions", [])) + 1
    new, old, found, events = [], [], set(), {}
    try:
        for name, info in meta["streams"].items():
            events[name] = _forget_stream(root, info, ids, n, found, new, old)
        record = {"time": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                  "users_requested": len(ids), "users_found": len(found),
                  "users_unknown": len(ids) - len(found), "events_removed": events}
        meta.setdefault("deletions", []).append(record)
        tmp = root / (META + ".tmp")
        tmp.write_text(json.dumps(meta, indent=2))
        os.replace(tmp, root / META)
    except BaseException:
        for f in new:
            (root / f).unlink(missing_ok=True)
        raise
    for f in old:
        (root / f).unlink(missing_ok=True)
    log.info("forget %s: %d of %d users found; events removed %s", root, len(found), len(ids),
             events)
    return record


def _forget_stream(root: Path, info: dict, ids: np.ndarray, n: int, found: set, new: list,
                   old: list) -> int:
    """One stream written again without the users' events (a record batch per bucket, as built);
    returns the events removed (0: its files are left as they are)."""
    index = pa.ipc.open_file(pa.memory_map(str(root / info["index"]))).read_all()
    users = index.column("user").to_numpy()
    hit = np.isin(users, ids)
    if not hit.any():
        return 0
    found.update(int(u) for u in users[hit])
    reader = pa.ipc.open_file(pa.memory_map(str(root / info["file"])))
    log_name = _TAG.sub("", info["file"]).removesuffix(".arrow") + f".forget{n}.arrow"
    index_name = _TAG.sub("", info["index"]).removesuffix(".users.arrow") + \
        f".forget{n}.users.arrow"
    value_set = pa.array(ids, pa.int64())
    kept_users, starts, ends, rows = [], [], [], 0
    with pa.OSFile(str(root / log_name), "wb") as sink, \
            pa.ipc.new_file(sink, reader.schema) as w:
        new.append(log_name)
        for k in range(reader.num_record_batches):
            b = reader.get_batch(k)
            b = b.filter(pc.invert(pc.is_in(b.column(0), value_set=value_set)))
            w.write_batch(b)
            u = b.column(0).to_numpy()
            uniq, first = np.unique(u, return_index=True)
            kept_users.append(uniq)
            starts.append(rows + first)
            ends.append(rows + np.r_[first[1:], len(u)])
            rows += len(u)
    user, start, end = (np.concatenate(x).astype(np.int64) if x else np.zeros(0, np.int64)
                        for x in (kept_users, starts, ends))
    order = np.argsort(user, kind="stable")
    table = pa.table({"user": user[order], "start": start[order], "end": end[order]})
    with pa.OSFile(str(root / index_name), "wb") as sink, \
            pa.ipc.new_file(sink, table.schema) as w:
        new.append(index_name)
        w.write_table(table)
    removed = info["events"] - rows
    old += [info["file"], info["index"]]
    info.update(file=log_name, index=index_name, events=rows, users=len(user),
                bytes=(root / log_name).stat().st_size)
    return removed


def _orphans(root: Path, meta: dict) -> None:
    """Remove ``.arrow`` files ``history.json`` does not name (an interrupted forget's)."""
    named = {info[k] for info in meta.get("streams", {}).values() for k in ("file", "index")}
    gone = [p.name for p in root.glob("*.arrow") if p.name not in named]
    for name in gone:
        (root / name).unlink()
    if gone:
        log.warning("forget %s: removed %d files of an interrupted forget: %s", root, len(gone),
                    gone[:5])


def run(args) -> dict:
    """The command: the list read (raw ids mapped through the dataset's pseudonyms), then the
    dataset and the store, each its own atomic step."""
    from opengem.config import ConfigError
    from opengem.data.forget import forget_dataset, read_forget_list
    from opengem.data.parquet import DatasetManifest
    from opengem.data.pseudonym import load_key, user_ids_of

    if args.data is None and args.history_store is None:
        raise ConfigError("forget needs --data DATA and/or --history-store STORE")
    if args.key_file is not None and not args.raw_ids:
        raise ConfigError("--key-file is for --raw-ids (a list of raw ids to hash)")
    ids = read_forget_list(args.users, raw=args.raw_ids)
    requested, unknown = len(ids), 0
    if args.raw_ids:
        if args.data is None:
            raise ConfigError("--raw-ids needs --data: the dataset's pseudonyms map raw ids to "
                              "user ids")
        info = DatasetManifest.load(args.data).source.get("pseudonym")
        if not info:
            raise ConfigError(f"{args.data}: not a pseudonymised import; give its int64 user "
                              f"ids without --raw-ids")
        ids, unknown = user_ids_of(args.data, ids, load_key(args.key_file), info)
    out = {}
    if args.data is not None:
        out["data"] = forget_dataset(args.data, ids, requested, unknown)
    if args.history_store is not None:
        out["history_store"] = forget_store(args.history_store, ids)
    print(json.dumps(out, indent=2))
    return out
