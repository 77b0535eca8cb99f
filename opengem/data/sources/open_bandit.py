"""Open Bandit Dataset (ZOZOTOWN) → our layout: one row per logged impression, campaigns as domains.

Input (``--in DIR``): the OBD folder layout ``{policy}/{campaign}/{campaign}.csv[.gz]`` plus
``{policy}/{campaign}/item_context.csv``, policy in (random, bts), campaign in (all, men, women);
whichever of the six folders exist are read (the small version in ``obp`` and the full release
share the layout).

Rows and labels. Every logged recommendation is a row; one task, ``click``. Domains: the
campaigns, named ``all_items``, ``men``, ``women`` (``all`` is the evaluation's pooled slice). The
logging policy and its propensity are not features (they describe the logger, not the user); the
policy is kept in the manifest.

Split (global, by calendar day, UTC): days are numbered from the first day in the data; the last
day → test, the day before → valid, the rest → train (the small version spans 7 days:
2019-11-24 … 11-30, so days 0–4 train, 5 valid, 6 test). Ids are contiguous, fitted on train.

Features:
  user     user_feature_0..3 (hashed categorical strings in the source)
  ad       item_id (campaign-qualified: item 3 of ``men`` is not item 3 of ``all``),
           item_feature_1..3 (categorical), item_feature_0 (dense)
  context  position (slot 1/2/3 → 0/1/2), hour (UTC)
  dense    affinity_item = log1p(the user's past clicks on the shown item),
           affinity_total = log1p(the user's past clicks on any item of the campaign)
No user id exists: ``user_id`` is the id of the user-feature tuple (a user *profile*, used only to
group gAUC, not a feature). No behaviour sequences (the source has none).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from opengem.data.parquet import DataError, DatasetManifest
from opengem.data.sources.common import (
    Vocab,
    fit_ids,
    need,
    parse_time,
    read_csv,
    to_float,
    to_label,
    write_dataset,
)
from opengem.features.schema import DenseFeature, Domains, FeatureSchema, SparseFeature, Task

CAMPAIGNS = ("all", "men", "women")  # folder names
DOMAINS = ("all_items", "men", "women")  # "all" is the evaluation's pooled pseudo-domain
POLICIES = ("random", "bts")
USER_FEATURES = tuple(f"user_feature_{i}" for i in range(4))
ITEM_FEATURES = tuple(f"item_feature_{i}" for i in range(1, 4))
DAY = 86400


def _files(in_dir: Path) -> list[tuple[str, str, Path, Path]]:
    found = []
    for policy in POLICIES:
        for camp in CAMPAIGNS:
            d = in_dir / policy / camp
            log = next((p for p in (d / f"{camp}.csv.gz", d / f"{camp}.csv") if p.exists()), None)
            if log is not None:
                found.append((policy, camp, log, d / "item_context.csv"))
    if not found:
        raise DataError(f"{in_dir}: no Open Bandit files "
                        f"(expected {{random,bts}}/{{all,men,women}}/{{campaign}}.csv[.gz])")
    return found


def _read_campaign(policy: str, camp: str, log_path: Path, ctx_path: Path) -> dict:
    """One (policy, campaign) file joined with its item context; string columns + parsed values."""
    log = read_csv(log_path, numeric=lambda c: c.startswith("user-item_affinity_"))
    need(log, ["timestamp", "item_id", "position", "click", *USER_FEATURES], str(log_path))
    ctx = read_csv(ctx_path)
    need(ctx, ["item_id", "item_feature_0", *ITEM_FEATURES], str(ctx_path))
    item = to_float(log["item_id"], f"{log_path} column item_id").astype(np.int64)
    ctx_item = to_float(ctx["item_id"], f"{ctx_path} column item_id").astype(np.int64)
    row = np.full(int(max(item.max(initial=0), ctx_item.max(initial=0))) + 1, -1)
    row[ctx_item] = np.arange(len(ctx_item))
    if (row[item] < 0).any():
        raise DataError(f"{log_path}: item_id {int(item[row[item] < 0][0])} is not in {ctx_path}")
    aff_cols = sorted((c for c in log if c.startswith("user-item_affinity_")),
                      key=lambda c: int(c.rsplit("_", 1)[1]))
    aff = (
        np.stack([to_float(log[c], f"{log_path} column {c}", fill=0.0) for c in aff_cols], 1)
        if aff_cols
        else None
    )
    n = len(item)
    out = {
        "ts": parse_time(log["timestamp"], f"{log_path} column timestamp"),
        "click": to_label(log["click"], f"{log_path} column click"),
        "position": to_float(log["position"], f"{log_path} column position").astype(np.int64) - 1,
        "item": np.char.add(f"{camp}:", item.astype(str)),
        "domain": np.full(n, CAMPAIGNS.index(camp), dtype=np.int64),
        "policy": np.full(n, policy),
        "item_feature_0": to_float(ctx["item_feature_0"],
                                   f"{ctx_path} column item_feature_0")[row[item]],
        "affinity_item": aff[np.arange(n), item] if aff is not None
        and aff.shape[1] > item.max(initial=0)
        else np.zeros(n),
        "affinity_total": aff.sum(1) if aff is not None else np.zeros(n),
    }
    out.update({f: log[f] for f in USER_FEATURES})
    out.update({f: ctx[f][row[item]] for f in ITEM_FEATURES})
    return out


def convert(in_dir: str | Path, out_dir: str | Path) -> DatasetManifest:
    """Write the Open Bandit files under ``in_dir`` as a dataset in ``out_dir`` (see the
    module docstring)."""
    parts = [_read_campaign(*f) for f in _files(Path(in_dir))]
    raw = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    ts = raw["ts"]
    day = ((ts - (ts.min() // DAY) * DAY) // DAY).astype(np.int32)
    days = sorted(int(d) for d in np.unique(day))
    if len(days) < 3:
        raise DataError(f"{in_dir}: the logs span {len(days)} day(s); a by-day split needs >= 3")
    splits = {"train": days[:-2], "valid": [days[-2]], "test": [days[-1]]}
    train = np.isin(day, splits["train"])

    c: dict = {"request_ts": ts, "domain": raw["domain"], "click": raw["click"],
               "position": raw["position"], "hour": (ts // 3600) % 24}
    vocab: dict[str, int] = {}
    for name, values in [("item_id", raw["item"])] + [(f, raw[f])
                                                      for f in USER_FEATURES + ITEM_FEATURES]:
        c[name], vocab[name] = fit_ids(values, train)
    profile = np.char.add(np.char.add(raw["user_feature_0"], raw["user_feature_1"]),
                          np.char.add(raw["user_feature_2"], raw["user_feature_3"]))
    c["user_id"] = Vocab(profile)(profile)
    c["item_feature_0"] = raw["item_feature_0"].astype(np.float32)
    c["affinity_item"] = np.log1p(np.maximum(raw["affinity_item"], 0)).astype(np.float32)
    c["affinity_total"] = np.log1p(np.maximum(raw["affinity_total"], 0)).astype(np.float32)

    sparse = tuple(SparseFeature(f, vocab[f], "user") for f in USER_FEATURES)
    sparse += (SparseFeature("item_id", vocab["item_id"], "ad"),)
    sparse += tuple(SparseFeature(f, vocab[f], "ad") for f in ITEM_FEATURES)
    sparse += (SparseFeature("position", 3, "context"), SparseFeature("hour", 24, "context"))
    dense = (DenseFeature("item_feature_0", "ad"), DenseFeature("affinity_item", "user"),
             DenseFeature("affinity_total", "user"))
    schema = FeatureSchema(sparse=sparse, dense=dense, sequences=(),
                           tasks=(Task("click", "click"),),
                           domains=Domains(DOMAINS), meta={"source": "open-bandit"})
    policies = {p: int((raw["policy"] == p).sum()) for p in POLICIES if (raw["policy"] == p).any()}
    source = {"kind": "open-bandit", "in": str(in_dir), "policies": policies,
              "split": "by UTC day: last day test, the day before valid, the rest train",
              "ids": "contiguous, fitted on train; unseen → OOV"}
    return write_dataset(out_dir, schema, c, day, splits=splits, source=source)
