"""Public CTR / multi-task ads sets → our layout, as built-in specs of the generic adapter.

Each source is a spec (``opengem.data.sources.spec``) plus, where the raw columns need it, a small
function that derives columns first. ``--in`` is a file or a directory; in a directory every CSV
(``.csv``/``.txt``, ``.gz`` too) whose header holds the spec's columns is read, others are skipped
(listed in the manifest). Files whose names carry ``train`` / ``val(id)`` / ``test`` give the split
(day 0/1/2; a missing valid file leaves the valid split empty); otherwise the spec's fallback
applies. Ids are contiguous, fitted on the train rows (unseen → OOV). Features of unknown side
are ``context``.

  criteo      click = label; I1–I13 dense (log1p, blank → 0); C1–C26 sparse. No time, user or
              domain: row order is time (the Kaggle file is chronological); split by it, last 10 %
              test, 10 % before valid. One domain.
  avazu       click; hour YYMMDDHH → request time and an hour-of-day feature; user = device_ip +
              device_model (Avazu has no user id); domains = site vs app traffic (app_id ecad2386 =
              site); split by time rank, last 10 % test.
  taobao      clk; time_stamp; userid; ad (adgroup, category, campaign, customer, brand, price) and
              user-profile fields; domains = pid (the ad slot); click_sequence (``^``-separated
              adgroup ids, oldest → newest) is the ``clicks`` stream with times request − k s.
  aliccp      click, conversion = purchase (requires click); the 23 label-encoded fields (f_101 =
              user … f_853) sparse, the 8 D* fields dense; domains = field 301 (the scenario).
  aliexpress  click, conversion (requires click); categorical_1–16 sparse, numerical_1–63 dense;
              user = search_id (gAUC per search); domains = countries from the file names
              (``…_nl_…``, ``es``, ``fr``, ``us``, ``ru``; a file without one is ``unknown``).
These samples are schema fixtures: far too small for any metric.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from opengem.data.parquet import DataError, DatasetManifest
from opengem.data.sources.common import read_csv
from opengem.data.sources.generic import convert_frames, referenced_columns
from opengem.data.sources.spec import check_spec

COUNTRIES = ("nl", "es", "fr", "us", "ru")
_SPLIT_TOKENS = {"train": 0, "val": 1, "valid": 1, "validation": 1, "test": 2}


def _sparse(cols, group="context"):
    return [{"column": c, "group": group} for c in cols]


def _dense(cols, group="context", **kw):
    return [{"column": c, "group": group, **kw} for c in cols]


def _avazu(t: dict, name: str) -> dict:
    hour = np.char.zfill(t["hour"], 8)  # YYMMDDHH
    iso = np.char.add(np.char.add(np.char.add("20", hour.astype("<U2")), "-"), _slice(hour, 2, 4))
    iso = np.char.add(np.char.add(np.char.add(iso, "-"), _slice(hour, 4, 6)),
                      np.char.add("T", _slice(hour, 6, 8)))
    t["ts"] = np.char.add(iso, ":00:00")
    t["hour_of_day"] = _slice(hour, 6, 8)
    t["surface"] = np.where(t["app_id"] == "ecad2386", "site", "app")
    t["user"] = np.char.add(np.char.add(t["device_ip"], "/"), t["device_model"])
    return t


def _aliexpress(t: dict, name: str) -> dict:
    tokens = set(re.split(r"[^a-z]+", Path(name).name.lower()))
    country = next((c for c in COUNTRIES if c in tokens), "unknown")
    t["country"] = np.full(len(t["search_id"]), country)
    return t


def _slice(a: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return np.array([x[lo:hi] for x in a], dtype=str)


_CRITEO_I = [f"I{i}" for i in range(1, 14)]
_CRITEO_C = [f"C{i}" for i in range(1, 27)]
_AVAZU_CTX = ["C1", "banner_pos", "site_id", "site_domain", "site_category", "app_id", "app_domain",
              "app_category"]
_AVAZU_USER = ["device_id", "device_ip", "device_model", "device_type", "device_conn_type"]
_TAOBAO_USER = ["userid", "cms_segid", "cms_group_id", "final_gender_code", "age_level",
                "pvalue_level", "shopping_level", "occupation", "new_user_class_level"]
_CCP_USER = ["101", "121", "122", "124", "125", "126", "127", "128", "129", "109_14", "110_14",
             "127_14", "150_14"]
_CCP_AD = ["205", "206", "207", "210", "216"]
_CCP_CTX = ["508", "509", "702", "853", "301"]

SOURCES: dict[str, tuple[dict, object]] = {
    "criteo": ({"tasks": [{"name": "click", "column": "label"}], "sparse": _sparse(_CRITEO_C),
                "dense": _dense(_CRITEO_I, transform="log1p", fill=0.0), "split": {"by": "time"}},
               None),
    "avazu": ({"tasks": [{"name": "click", "column": "click"}], "time": "ts", "user": "user",
               "domain": {"column": "surface", "names": ["site", "app"]},
               "sparse": _sparse(_AVAZU_CTX + ["hour_of_day"]) + _sparse(_AVAZU_USER, "user")
               + _sparse([f"C{i}" for i in range(14, 22)], "ad"), "split": {"by": "time"}}, _avazu),
    "taobao": ({"tasks": [{"name": "click", "column": "clk"}], "time": "time_stamp",
                "user": "userid", "domain": {"column": "pid"},
                "sparse": _sparse(_TAOBAO_USER, "user")
                + _sparse(["adgroup_id", "cate_id", "campaign_id", "customer",
                                                                   "brand"], "ad"),
                "dense": _dense(["price"], "ad", transform="log1p", fill=0.0),
                "sequence": {"name": "clicks", "from": "column", "column": "click_sequence",
                             "sep": "^", "item": "adgroup_id", "max_len": 64},
                "split": {"by": "time"}}, None),
    "aliccp": ({"tasks": [{"name": "click", "column": "click"},
                          {"name": "conversion", "column": "purchase", "requires": "click"}],
                "user": "101", "domain": {"column": "301"},
                "sparse": _sparse(_CCP_USER, "user") + _sparse(_CCP_AD, "ad") + _sparse(_CCP_CTX),
                "dense": _dense(["D109_14", "D110_14", "D127_14", "D150_14"], "user", fill=0.0)
                + _dense(["D508", "D509", "D702", "D853"], fill=0.0), "split": {"by": "random"}},
               None),
    "aliexpress": ({"tasks": [{"name": "click", "column": "click"},
                              {"name": "conversion", "column": "conversion", "requires": "click"}],
                    "user": "search_id", "domain": {"column": "country"},
                    "sparse": _sparse([f"categorical_{i}" for i in range(1, 17)]),
                    "dense": _dense([f"numerical_{i}" for i in range(1, 64)], fill=0.0),
                    "split": {"by": "random"}},
                   _aliexpress),
}


def _split_of(path: Path) -> int | None:
    tokens = re.split(r"[^a-z]+", path.name.lower())
    days = {_SPLIT_TOKENS[t] for t in tokens if t in _SPLIT_TOKENS}
    return days.pop() if len(days) == 1 else None


def convert(source: str, in_path: str | Path, out_dir: str | Path,
            seed: int = 0) -> DatasetManifest:
    """Write the ``source`` files at ``in_path`` (a file or a directory) as a dataset
    in ``out_dir``."""
    if source not in SOURCES:
        raise ValueError(f"unknown CTR source {source!r}; choose from {sorted(SOURCES)}")
    spec, derive = SOURCES[source]
    spec = check_spec(spec, f"built-in {source} spec")
    p = Path(in_path)
    paths = (
        sorted(f for f in p.iterdir() if re.search(r"\.(csv|txt)(\.gz)?$", f.name))
        if p.is_dir()
        else [p]
    )
    frames, skipped = [], []
    for f in paths:
        t = read_csv(f, numeric={d["column"] for d in spec["dense"]}.__contains__)
        if derive is not None and _has_raw(t, source):
            t = derive(t, str(f))
        if all(c in t for c in referenced_columns(spec)):
            frames.append((str(f), _split_of(f), t))
        else:
            skipped.append(str(f))
    if not frames:
        raise DataError(f"{in_path}: no {source} file (a CSV holding the columns of the "
                        f"{source} spec); skipped {skipped}")
    days = [d for _, d, _ in frames]
    if None not in days and {0, 2} <= set(days):
        spec = {**spec, "split": {**spec["split"], "by": "files"}}
    else:
        frames = [(f, None, t) for f, _, t in frames]
    source_info = {"kind": source, "in": str(in_path), "skipped": skipped}
    return convert_frames(frames, spec, out_dir, seed, source_info)


def _has_raw(t: dict, source: str) -> bool:
    return {"avazu": "hour" in t and "app_id" in t,
            "aliexpress": "search_id" in t}.get(source, True)
