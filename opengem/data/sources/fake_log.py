"""A generated real-log-shaped input (impressions table + events table, optionally a second events
table of ad clicks) for the importer's tests and its memory benchmark. Events are written in chunks
of users, so an events log far larger than memory can be made."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

T0 = 1_700_000_000  # unix seconds: the log's start
SPAN = 30 * 86400  # 30 days


def spec(max_len: int = 50, ad_clicks: int = 0, **sequence) -> dict:
    """The generic importer's spec of a ``write_log`` directory (``sequence`` overrides);
    ``ad_clicks`` > 0 adds the ad-click table as a second stream of that ``max_len``, whose items
    are the impressions' ``item_id`` ids."""
    seq = {"name": "clicks", "from": "events", "files": ["events.parquet"], "item": "item_id",
           "event": "action", "attributes": ["cat"], "max_len": max_len} | sequence
    out = {"files": {"train": ["impressions.parquet"], "test": []}, "user": "user", "time": "ts",
           "tasks": [{"name": "click", "column": "click"}],
           "sparse": [{"column": "item_id", "group": "ad", "vocab_size": 10_000},
                      {"column": "cat", "group": "ad", "vocab_size": 50}],
           "split": {"by": "user_time", "valid": 0.1, "test": 0.2}, "sequence": seq}
    if ad_clicks:
        ads = {"name": "ad_clicks", "from": "events", "files": ["ad_clicks.parquet"],
               "item": "ad", "matches": "item_id", "max_len": ad_clicks,
               "attributes": [{"column": "cat", "name": "ad_cat", "matches": "cat"}]}
        out = {k: v for k, v in out.items() if k != "sequence"} | {"sequences": [seq, ads]}
    return out


def write_log(out: str | Path, rows: int, users: int, events_per_user: int, seed: int = 0,
              shuffle: bool = True, chunk_users: int = 500, ad_clicks_per_user: int = 0,
              dwell: bool = False) -> Path:
    """``out/impressions.parquet`` (``rows`` impressions of ``users`` users) and
    ``out/events.parquet`` (``events_per_user`` events each, in shuffled order unless ``shuffle``
    is False); with ``ad_clicks_per_user`` also ``out/ad_clicks.parquet`` (user, ts, ad, cat: ads
    of the impressions' ``item_id`` space), drawn from a generator of its own so that the other
    tables are those of a log without it. ``dwell``: the events also carry ``dwell`` (float32
    seconds, log-normal; ``spec(values=["dwell"])`` reads it), from a generator of its own too,
    so that the log is the one without it plus that column."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    user = rng.integers(0, users, rows)
    item = rng.integers(0, 10_000, rows)
    pq.write_table(pa.table({"user": user, "ts": T0 + rng.integers(SPAN // 2, SPAN, rows),
                             "item_id": item, "cat": item % 50,
                             "click": (rng.random(rows) < 0.1).astype(np.int64)}),
                   out / "impressions.parquet")
    schema = pa.schema([("user", pa.int64()), ("ts", pa.int64()), ("item_id", pa.int64()),
                        ("action", pa.string()), ("cat", pa.int64())]
                       + ([("dwell", pa.float32())] if dwell else []))
    dwell_rng = np.random.default_rng([seed, 2])
    with pq.ParquetWriter(out / "events.parquet", schema, compression="zstd") as w:
        for u0 in range(0, users, chunk_users):
            u = np.repeat(np.arange(u0, min(u0 + chunk_users, users)), events_per_user)
            ts = T0 + rng.integers(0, SPAN, len(u))
            if not shuffle:
                o = np.lexsort((ts, u))
                u, ts = u[o], ts[o]
            else:
                o = rng.permutation(len(u))
                u, ts = u[o], ts[o]
            it = rng.integers(0, 10_000, len(u))
            action = np.array(["view", "click"])[(rng.random(len(u)) < 0.2).astype(int)]
            cols = {"user": u, "ts": ts, "item_id": it, "action": action, "cat": it % 50}
            if dwell:
                cols["dwell"] = dwell_rng.lognormal(2.5, 1.0, len(u)).astype(np.float32)
            w.write_table(pa.table(cols, schema=schema))
    if ad_clicks_per_user:
        _ad_clicks(out / "ad_clicks.parquet", users, ad_clicks_per_user, seed, chunk_users)
    return out


def _ad_clicks(path: Path, users: int, per_user: int, seed: int, chunk_users: int) -> None:
    rng = np.random.default_rng([seed, 1])
    schema = pa.schema([("user", pa.int64()), ("ts", pa.int64()), ("ad", pa.int64()),
                        ("cat", pa.int64())])
    with pq.ParquetWriter(path, schema, compression="zstd") as w:
        for u0 in range(0, users, chunk_users):
            u = np.repeat(np.arange(u0, min(u0 + chunk_users, users)), per_user)
            u = u[rng.permutation(len(u))]
            ad = rng.integers(0, 10_000, len(u))
            w.write_table(pa.table({"user": u, "ts": T0 + rng.integers(0, SPAN, len(u)), "ad": ad,
                                    "cat": ad % 50}, schema=schema))
