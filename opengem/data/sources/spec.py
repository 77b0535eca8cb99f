"""The source spec: a small JSON file saying which column of a user's table is what.

JSON, not YAML: the standard library reads it (no new dependency) and ``schema.json`` is JSON too.
Every key is checked; an unknown key, a missing one or a value of the wrong type is a
``SpecError`` naming the file and the key path. Example (every key but ``tasks`` and one of
``sparse``/``dense`` is optional)::

    {
      "files": {"train": ["train.csv"], "valid": ["valid.csv"], "test": ["test.csv"]},
      "sep": ",",
      "tasks": [{"name": "click", "column": "clk"},
                {"name": "conversion", "column": "buy", "requires": "click"}],
      "sparse": [{"column": "ad_id", "group": "ad", "hash_size": 100000},
                 {"column": "cate_id", "group": "ad"},
                 {"column": "tags", "group": "user", "multi_hot": "|", "hash_size": 1000},
                 {"column": "slot", "name": "slot_id", "group": "context", "vocab_size": 8}],
      "dense": [{"column": "price", "group": "ad", "transform": "log1p", "fill": 0.0}],
      "embeddings": [{"column": "image_emb", "name": "ad_content", "group": "ad", "dim": 16, "sep": " "}],
      "domain": {"column": "pid", "names": ["feed", "search"]},
      "user": "user_id",
      "time": "ts", "time_unit": "s",
      "sequence": {"name": "clicks", "from": "rows", "item": "ad_id", "only": "click", "max_len": 50,
                   "attributes": ["cate_id"]},
      "split": {"by": "user_time", "valid": 0.1, "test": 0.1}
    }

Sparse ids: ``hash_size`` N hashes each value's text into [0, N); ``vocab_size`` N takes the values
as ids already in [0, N) (others → the OOV row); neither: contiguous ids fitted on the train rows
(unseen → OOV). ``multi_hot`` is the delimiter of a list of values in one cell. A feature's ``name``
defaults to its column with characters other than letters, digits and ``_`` replaced by ``_``.

Dense: ``transform`` none | log1p (of max(x, 0), the Criteo convention); empty cells → ``fill``
(default: an error), or with ``"missing": "indicator"`` kept as missing (NaN; the schema's
``DenseFeature.missing``: the model gets a missing indicator; the manifest's ``source.missing``
counts them). Domain: a column whose values are the surfaces (``names`` fixes their order and makes
other values an error; default: the sorted values seen; ``all`` is reserved for the pooled
evaluation slice); absent → one domain ``default``.

Embeddings: precomputed fixed-width float vectors (``EmbeddingFeature``: one X_0 token each), e.g.
an ad's image or text encoding. The column is a Parquet ``list<float>`` (or fixed-size list), or in
CSV (or a Parquet string column) a string of numbers split by ``sep`` (default ``|``). ``dim``
(default: the first row's length) must hold for every row: a row of another length, an empty or null
cell or a value that is not a finite number is a ``ColumnError`` naming the file, column and row.
``group`` defaults to ``ad`` (serving then takes the vector per candidate).

Time: unix seconds (``time_unit`` ms / us for numbers in those units) or ISO-8601 datetimes.

Sequence: ``from: rows`` — each row's user's *earlier rows* (strictly earlier time; ``only``: just
those with that task's label 1), item = the ids of sparse feature ``item``, event = ``event``
column's values (contiguous; default one type), ``attributes`` = single-valued sparse features each
event carries; needs ``user`` and ``time``. ``from: column`` — a delimited list of item ids in the
row itself (``column``, ``sep``), taken as oldest → newest and before the request; their times are
unknown, so events get the request time − k seconds (k = 1 for the newest).
``from: events`` — a separate events table (``files``, relative to ``--in``; CSV/TSV/Parquet) with
one row per event: the user column (``user``, default the top-level ``user``), the time (``time``,
default the top-level ``time``; ``time_unit`` default the top-level one), the item (the column named
``item``), ``event`` and ``attributes`` columns named as in the impression table. It is sorted and
bucketed out of core by DuckDB and written as layout v2 (``opengem.data.sources.event_log``).
``from: lists`` — Parquet list columns of each impression row: ``column`` (list of item ids) and
``times`` (list<int64> in ``time_unit`` or list<timestamp>), one time per item. Written as v2 when
every row's list is the time-prefix of one per-user history, else per row (v1) with the times kept.
``buckets``: the number of user buckets of a v2 dataset (default: from the number of events).

Split: ``files`` (the ``files`` lists, day 0/1/2), ``time`` (global, by time rank; with no ``time``
column, by row order), ``user_time``
(each user's last rows), ``random`` (seeded); ``valid``/``test`` are shares of rows. Default:
``files`` if given, else ``time`` if ``time`` is, else ``random``.
"""

from __future__ import annotations

import re
from pathlib import Path

from opengem.data.sources.common import SpecError
from opengem.features.schema import MISSING, read_json

_GROUPS = ("user", "ad", "context")
_TIME_UNITS = {"s": 1, "ms": 1000, "us": 1_000_000}
_KEYS = {
    "": ({"files": dict, "sep": str, "tasks": list, "sparse": list, "dense": list, "domain": dict,
          "user": str, "time": str, "time_unit": str, "sequence": dict, "split": dict, "name": str,
          "embeddings": list}, {"tasks"}),
    "files": ({"train": list, "valid": list, "test": list}, {"train", "test"}),
    "tasks": ({"name": str, "column": str, "requires": str, "positive_at": float},
              {"name", "column"}),
    "sparse": ({"column": str, "name": str, "group": str, "hash_size": int, "vocab_size": int,
                "multi_hot": str},
               {"column"}),
    "dense": ({"column": str, "name": str, "group": str, "transform": str, "fill": float,
               "missing": str},
              {"column"}),
    "embeddings": ({"column": str, "name": str, "group": str, "dim": int, "sep": str}, {"column"}),
    "domain": ({"column": str, "names": list}, {"column"}),
    "sequence": ({"name": str, "from": str, "item": str, "event": str, "only": str, "max_len": int,
                  "attributes": list, "column": str, "sep": str, "files": list, "user": str,
                  "time": str, "time_unit": str,
                  "times": str, "buckets": int}, {"item", "max_len"}),
    "split": ({"by": str, "valid": float, "test": float}, set()),
}


def load_spec(path: str | Path) -> dict:
    """Read and check a spec file; returns it with defaults filled in."""
    p = Path(path)
    return check_spec(read_json(p, SpecError, "spec file"), str(p))


def check_spec(d: object, where: str = "spec") -> dict:
    """Check a spec (a dict, as from JSON) and fill defaults; every problem is a ``SpecError``."""
    _obj(d, "", where)
    out = dict(d)
    if "files" in d:
        _obj(d["files"], "files", where)
        for k, v in d["files"].items():
            if not all(isinstance(x, str) for x in v):
                raise SpecError(f"{where}: files.{k} must be a list of file names, got {v!r}")
    for key in ("tasks", "sparse", "dense", "embeddings"):
        out[key] = [_obj(x, key, where, f"{key}[{i}]") for i, x in enumerate(d.get(key, []))]
    if not out["tasks"]:
        raise SpecError(f"{where}: tasks must list at least one label column")
    if not out["sparse"] and not out["dense"] and not out["embeddings"]:
        raise SpecError(f"{where}: needs at least one feature under sparse, dense or embeddings")
    for f in out["embeddings"]:
        f.setdefault("group", "ad")
        f.setdefault("sep", "|")
        if "dim" in f and f["dim"] <= 0:
            raise SpecError(f"{where}: embedding {f['column']!r}: dim must be > 0, got {f['dim']}")
    for i, f in enumerate(out["sparse"] + out["dense"] + out["embeddings"]):
        f.setdefault("name", feature_name(f["column"]))
        f.setdefault("group", "user")
        if f["group"] not in _GROUPS:
            raise SpecError(f"{where}: feature {f['column']!r}: group must be one of {_GROUPS}, "
                            f"got {f['group']!r}")
    for f in out["sparse"]:
        if "hash_size" in f and "vocab_size" in f:
            raise SpecError(f"{where}: sparse {f['column']!r}: give hash_size or vocab_size, "
                            f"not both")
        for k in ("hash_size", "vocab_size"):
            if k in f and f[k] <= 0:
                raise SpecError(f"{where}: sparse {f['column']!r}: {k} must be > 0, got {f[k]}")
    for f in out["dense"]:
        f.setdefault("transform", "none")
        if f["transform"] not in ("none", "log1p"):
            raise SpecError(f"{where}: dense {f['column']!r}: transform must be none or log1p, "
                            f"got {f['transform']!r}")
        if f.get("missing", "quarantine") not in MISSING:
            raise SpecError(f"{where}: dense {f['column']!r}: missing must be one "
                            f"of {'/'.join(MISSING)}, "
                            f"got {f['missing']!r}")
        if f.get("missing") == "indicator" and "fill" in f:
            raise SpecError(f"{where}: dense {f['column']!r}: give fill or missing=indicator, "
                            f"not both")
    if "domain" in d:
        out["domain"] = _obj(d["domain"], "domain", where)
    if "split" in d:
        out["split"] = _obj(d["split"], "split", where)
    if out.setdefault("time_unit", "s") not in _TIME_UNITS:
        raise SpecError(f"{where}: time_unit must be one of {sorted(_TIME_UNITS)}, "
                        f"got {out['time_unit']!r}")
    out["split"] = _split(out, where)
    if "sequence" in d:
        out["sequence"] = _sequence(out, where)
    return out


def time_divisor(spec: dict) -> int:
    return _TIME_UNITS[spec.get("time_unit", "s")]


def feature_name(column: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_]", "_", column)
    return name if re.match(r"^[A-Za-z_]", name) else f"f_{name}"


def _obj(x: object, kind: str, where: str, path: str | None = None) -> dict:
    path = path if path is not None else (kind or "top level")
    if not isinstance(x, dict):
        raise SpecError(f"{where}: {path} must be a JSON object, got {x!r}")
    allowed, required = _KEYS[kind]
    unknown = sorted(set(x) - set(allowed))
    if unknown:
        raise SpecError(f"{where}: unknown key(s) {unknown} in {path}; allowed: {sorted(allowed)}")
    missing = sorted(required - set(x))
    if missing:
        raise SpecError(f"{where}: {path} is missing {missing}")
    for k, v in x.items():
        want = allowed[k]
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) if want is float else (
            isinstance(v, want) and not (want is int and isinstance(v, bool)))
        if not ok:
            raise SpecError(f"{where}: {path}.{k} must be a {want.__name__}, got {v!r}")
    return dict(x)


def _split(d: dict, where: str) -> dict:
    s = dict(d.get("split", {}))
    s.setdefault("by", "files" if "files" in d else "time" if "time" in d else "random")
    s.setdefault("valid", 0.1)
    s.setdefault("test", 0.1)
    need = {"files": ["files"], "time": [], "user_time": ["user", "time"], "random": []}
    if s["by"] not in need:
        raise SpecError(f"{where}: split.by must be one of {sorted(need)}, got {s['by']!r}")
    missing = [k for k in need[s["by"]] if k not in d]
    if missing:
        raise SpecError(f"{where}: split.by {s['by']!r} needs the top-level key(s) {missing}")
    if not (0 <= s["valid"] < 1 and 0 < s["test"] < 1 and s["valid"] + s["test"] < 1):
        raise SpecError(f"{where}: split.valid and split.test must be shares in [0, 1) summing "
                        f"to < 1, got {s['valid']} and {s['test']}")
    return s


def _sequence(d: dict, where: str) -> dict:
    s = _obj(d["sequence"], "sequence", where)
    s.setdefault("name", "history")
    s.setdefault("from", "rows")
    s.setdefault("attributes", [])
    sparse = {f["column"]: f for f in d["sparse"]}
    if s["item"] not in sparse or sparse[s["item"]].get("multi_hot"):
        raise SpecError(f"{where}: sequence.item {s['item']!r} must be a single-valued column "
                        f"listed under sparse")
    if s["max_len"] <= 0:
        raise SpecError(f"{where}: sequence.max_len must be > 0, got {s['max_len']}")
    extra = {"rows": set(), "column": set(),
             "events": {"files", "user", "time", "time_unit", "buckets"},
             "lists": {"times", "time_unit", "buckets"}}.get(s["from"], set())
    stray = sorted({"files", "user", "time", "time_unit", "times", "buckets"} & set(s) - extra)
    if stray:
        raise SpecError(f"{where}: sequence.{stray[0]} is not used with sequence "
                        f"from {s['from']!r}")
    if s.get("time_unit", "s") not in _TIME_UNITS:
        raise SpecError(f"{where}: sequence.time_unit must be one of {sorted(_TIME_UNITS)}, "
                        f"got {s['time_unit']!r}")
    if s.get("buckets", 1) <= 0:
        raise SpecError(f"{where}: sequence.buckets must be > 0, got {s['buckets']}")
    if s["from"] in ("events", "lists"):
        missing = [k for k in ("user", "time") if k not in d]
        if missing:
            raise SpecError(f"{where}: sequence from {s['from']} needs the top-level "
                            f"key(s) {missing}")
        if s["from"] == "events":
            if not s.get("files") or not all(isinstance(x, str) for x in s["files"]):
                raise SpecError(f"{where}: sequence from events needs files, a list of event "
                                f"table file names")
            s.setdefault("user", d["user"])
            s.setdefault("time", d["time"])
        else:
            if "column" not in s or "times" not in s:
                raise SpecError(f"{where}: sequence from lists needs sequence.column (items) "
                                f"and sequence.times")
            if s["attributes"] or "event" in s or "only" in s:
                raise SpecError(f"{where}: sequence from lists takes no attributes/event/only")
        s.setdefault("time_unit", d.get("time_unit", "s"))
        for a in s["attributes"]:
            if a not in sparse or sparse[a].get("multi_hot"):
                raise SpecError(f"{where}: sequence attribute {a!r} must be a single-valued column "
                                f"listed under sparse")
    elif s["from"] == "rows":
        missing = [k for k in ("user", "time") if k not in d]
        if missing:
            raise SpecError(f"{where}: sequence from rows needs the top-level key(s) {missing}")
        tasks = [t["name"] for t in d["tasks"]]
        if "only" in s and s["only"] not in tasks:
            raise SpecError(f"{where}: sequence.only {s['only']!r} is not a task; tasks "
                            f"are {tasks}")
        for a in s["attributes"]:
            if a not in sparse or sparse[a].get("multi_hot"):
                raise SpecError(f"{where}: sequence attribute {a!r} must be a single-valued column "
                                f"listed under sparse")
    elif s["from"] == "column":
        if "column" not in s:
            raise SpecError(f"{where}: sequence from column needs sequence.column")
        if s["attributes"] or "event" in s or "only" in s:
            raise SpecError(f"{where}: sequence from column takes no attributes/event/only")
        s.setdefault("sep", "|")
    else:
        raise SpecError(f"{where}: sequence.from must be rows, column, events or lists, "
                        f"got {s['from']!r}")
    return s
