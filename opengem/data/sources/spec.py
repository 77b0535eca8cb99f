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

Users: ``"pseudonymise": {"hash": "hmac-sha256" | "blake2b"}`` gives user ids by the rank of a
keyed hash of the raw ids; the key comes from ``opengem import --key-file`` or
``$OPENGEM_PSEUDONYM_KEY`` and never enters the dataset (``opengem.data.pseudonym``).

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

Several streams: ``sequences``, a list of stream objects with the keys above (``sequence`` is a list
of one; both spellings of one stream write the same dataset). Names differ. Streams from
events/lists (stored per user, v2) and from rows/column (per row, v1) cannot be mixed: a dataset has
one layout, and its v2 streams share one user bucketing (give ``buckets`` once). Each events stream
reads its own ``files``. Item ids: ``item`` naming a single-valued sparse column reuses that
feature's encoder (as before ``matches`` existed: no match declared); ``matches`` (a single-valued
sparse feature's column or name): the items are that feature's ids, encoded with its encoder, and
the schema says so (``SequenceStream.matches``: with ``model.target_match_items`` the model
compares each event's item with the candidate's); from events only, an id space of the stream's
own: ``"item_vocab": "fit"`` (the default when ``item`` is no sparse column), ``hash_size`` or
``vocab_size`` as for sparse features.
``fit`` takes the values of the events a train row's history can hold (before the user's last train
impression), so an id first seen later is OOV (counted in ``source.storage``), as a new item is in
production. An attribute is a sparse column name (its encoder; the model matches it by name with a
feature of that name and size) or an object ``{"column", "name", "matches" | "vocab": "fit" |
"hash_size" | "vocab_size"}`` (default: ``fit``; from rows, on the train rows' events); an
own-vocabulary attribute named like a single-valued sparse feature of its size is an error, since
the model would match it by that name. Example (content items of their own, ad clicks on ad ids)::

    "sequences": [
      {"name": "organic", "from": "events", "files": ["organic.parquet"], "item": "content_id",
       "event": "action", "max_len": 200,
       "attributes": [{"column": "cat", "name": "content_category", "matches": "cate_id"}]},
      {"name": "ad_clicks", "from": "events", "files": ["ad_clicks.parquet"], "item": "ad",
       "matches": "ad_id", "max_len": 50, "attributes": [{"column": "cate", "matches": "cate_id"}]}
    ]

Values: ``values`` lists a stream's per-event numbers (dwell seconds, watch fraction, price;
``SequenceStream.values``, embedded into the event token), each a column name or an object
``{"column", "name", "transform": "none" | "log1p", "missing": "drop" | "fill" | "error",
"fill"}``. ``name`` defaults to the column's feature name and must not clash with an event's other
columns (user_id, ts, item, event, an attribute's name, another value). ``transform`` as for dense
features (log1p of max(x, 0)). A missing value (an empty or null cell, NaN, ±inf, or beyond
float32, which would be stored as inf) is by default ``drop``: the event is left out (vocabularies
and the log never see it; counted), ``fill`` (``fill`` given): that number instead, ``error``: a
``ColumnError``. From events: a column of the events table (a number type, or text whose every
non-empty cell is a number; anything else is a ``ColumnError`` naming file, column and value),
counted per stream in ``source.storage`` (``<name>_missing_or_non_finite``,
``events_with_missing_or_non_finite_values_dropped``). From rows: a column of the impressions
table, each earlier row's; a row with a missing value is dropped as an event only (it stays an
impression), counted in ``source.values.<stream>``. From lists and column: not supported (a
``SpecError``): give the stream as an events table. Example::

    {"name": "organic", "from": "events", "files": ["organic.parquet"], "item": "content_id",
     "max_len": 200, "values": ["dwell_s", {"column": "watched", "name": "watch_fraction",
                                            "missing": "fill", "fill": 0.0}]}

Split: ``files`` (the ``files`` lists, day 0/1/2), ``time`` (global, by time rank; with no ``time``
column, by row order), ``user_time``
(each user's last rows), ``random`` (seeded); ``valid``/``test`` are shares of rows. Default:
``files`` if given, else ``time`` if ``time`` is, else ``random``.
"""

from __future__ import annotations

import re
from pathlib import Path

from opengem.data.pseudonym import HASHES
from opengem.data.sources.common import SpecError
from opengem.features.schema import MISSING, read_json

_GROUPS = ("user", "ad", "context")
_TIME_UNITS = {"s": 1, "ms": 1000, "us": 1_000_000}
_KEYS = {
    "": ({"files": dict, "sep": str, "tasks": list, "sparse": list, "dense": list, "domain": dict,
          "user": str, "time": str, "time_unit": str, "sequence": dict, "sequences": list,
          "split": dict, "name": str, "embeddings": list, "pseudonymise": dict}, {"tasks"}),
    "pseudonymise": ({"hash": str}, {"hash"}),
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
                  "time": str, "time_unit": str, "times": str, "buckets": int, "matches": str,
                  "item_vocab": str, "hash_size": int, "vocab_size": int, "values": list},
                 {"item", "max_len"}),
    "attribute": ({"column": str, "name": str, "matches": str, "vocab": str, "hash_size": int,
                   "vocab_size": int}, {"column"}),
    "value": ({"column": str, "name": str, "transform": str, "missing": str, "fill": float},
              {"column"}),
    "split": ({"by": str, "valid": float, "test": float}, set()),
}
# what a per-event value's missing cell (empty, null, NaN, ±inf, beyond float32) becomes
VALUE_MISSING = ("drop", "fill", "error")
FLOAT32_MAX = 3.4028234663852886e38  # a larger value would be stored as inf
# the columns of an event log besides attributes and values (``parquet.event_columns``)
_EVENT_COLUMNS = ("user_id", "ts", "item", "event")


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
    if "pseudonymise" in d:
        out["pseudonymise"] = _pseudonymise(d, where)
    if "sequence" in d and "sequences" in d:
        raise SpecError(f"{where}: give sequence (one stream) or sequences (a list), not both")
    if "sequence" in d:
        out["sequence"] = _sequence(out, d["sequence"], "sequence", where)
    elif "sequences" in d:
        seqs = [_sequence(out, s, f"sequences[{i}]", where) for i, s in enumerate(d["sequences"])]
        if not seqs:
            raise SpecError(f"{where}: sequences must list at least one stream (or be left out)")
        _check_streams(seqs, where)
        out["sequences"] = seqs
    return out


def canonical(spec: dict) -> dict:
    """The checked spec as ``schema.json``'s meta records it: a list of one stream as
    ``sequence``, so both spellings of one stream write the same dataset, byte for byte."""
    if len(spec.get("sequences", ())) != 1:
        return spec
    out = {k: v for k, v in spec.items() if k != "sequences"}
    return {**out, "sequence": spec["sequences"][0]}


def streams(spec: dict) -> list[tuple[str, dict]]:
    """(key path for messages, stream) of every stream of a checked spec, in spec order."""
    if "sequence" in spec:
        return [("sequence", spec["sequence"])]
    return [(f"sequences[{i}]", s) for i, s in enumerate(spec.get("sequences", []))]


def id_space(x: dict, sparse: dict, legacy: str | None) -> tuple[str, object]:
    """How a stream's items (``x`` the stream) or an attribute object (``x`` the attribute) get
    ids: ("matches", sparse feature spec) | ("reuse", the sparse feature of column ``legacy``:
    its encoder, no match declared, as before ``matches`` existed) | ("own", {"hash_size": N} |
    {"vocab_size": N} | {} for a vocabulary fitted on the train period's events)."""
    if "matches" in x:
        return "matches", _find(sparse, x["matches"])
    own = {k: x[k] for k in ("hash_size", "vocab_size") if k in x}
    if own or "item_vocab" in x or "vocab" in x or legacy is None:
        return "own", own
    return "reuse", sparse[legacy]


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


def _pseudonymise(d: dict, where: str) -> dict:
    """User ids by the rank of a keyed hash of the raw ids (``opengem.data.pseudonym``): needs a
    user column and one of its hashes; the key is given at import, never in the spec."""
    p = _obj(d["pseudonymise"], "pseudonymise", where)
    if p["hash"] not in HASHES:
        raise SpecError(f"{where}: pseudonymise.hash must be one of {list(HASHES)}, "
                        f"got {p['hash']!r}")
    if "user" not in d:
        raise SpecError(f"{where}: pseudonymise needs the top-level key 'user' (the column of "
                        f"raw user ids to hash)")
    return p


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


def _find(sparse: dict, ref: str) -> dict:
    """The sparse feature a (checked) ``matches`` names: the first by column or name."""
    return next(f for f in sparse.values() if ref in (f["column"], f["name"]))


def _matched(d: dict, ref: str, key: str, where: str) -> None:
    """``matches`` must name a single-valued sparse feature (its column or its name): the model
    compares one event id with the candidate's one id."""
    for f in d["sparse"]:
        if ref in (f["column"], f["name"]):
            if f.get("multi_hot"):
                raise SpecError(f"{where}: {key} {ref!r} is a multi-hot sparse feature; matches "
                                f"names a single-valued sparse feature (one id per event)")
            return
    for kind in ("dense", "embeddings"):
        if any(ref in (f["column"], f["name"]) for f in d[kind]):
            raise SpecError(f"{where}: {key} {ref!r} is a {kind} feature; matches names a "
                            f"single-valued sparse feature")
    have = [f["column"] for f in d["sparse"] if not f.get("multi_hot")]
    raise SpecError(f"{where}: {key} {ref!r} is not a feature; matches names a single-valued "
                    f"sparse feature: one of {have}")


def _own_vocab(x: dict, path: str, where: str, fit_key: str) -> None:
    """At most one id space (``matches``, ``fit_key``: "fit", ``hash_size``, ``vocab_size``)."""
    given = [k for k in ("matches", fit_key, "hash_size", "vocab_size") if k in x]
    if len(given) > 1:
        raise SpecError(f"{where}: {path}: give one of matches, {fit_key}, hash_size, "
                        f"vocab_size; got {given}")
    if x.get(fit_key, "fit") != "fit":
        raise SpecError(f"{where}: {path}.{fit_key} must be 'fit', got {x[fit_key]!r}")
    for k in ("hash_size", "vocab_size"):
        if k in x and x[k] <= 0:
            raise SpecError(f"{where}: {path}.{k} must be > 0, got {x[k]}")


def _attributes(d: dict, s: dict, path: str, where: str) -> list:
    """A string is a single-valued sparse column (its encoder reused; the legacy name rule may
    match it); an object names its own column and id space (``matches``, else its own)."""
    sparse = {f["column"]: f for f in d["sparse"]}
    out = []
    for i, a in enumerate(s["attributes"]):
        if isinstance(a, str):
            if a not in sparse or sparse[a].get("multi_hot"):
                raise SpecError(f"{where}: {path} attribute {a!r} must be a single-valued column "
                                f"listed under sparse (or an object with its own id space)")
            out.append(a)
            continue
        key = f"{path}.attributes[{i}]"
        if not isinstance(a, dict):
            raise SpecError(f"{where}: {key} must be a sparse column name or an object "
                            f"{{column, name, matches | vocab | hash_size | vocab_size}}, "
                            f"got {a!r}")
        a = _obj(a, "attribute", where, key)
        a.setdefault("name", feature_name(a["column"]))
        _own_vocab(a, key, where, "vocab")
        if "matches" in a:
            _matched(d, a["matches"], f"{key}.matches", where)
        out.append(a)
    return out


def _check_streams(seqs: list[dict], where: str) -> None:
    """Names unique; one layout (v2 streams and v1 streams do not mix); one user bucketing."""
    seen: dict[str, int] = {}
    for i, s in enumerate(seqs):
        if s["name"] in seen:
            raise SpecError(f"{where}: sequences[{seen[s['name']]}] and sequences[{i}] are both "
                            f"named {s['name']!r}; give each stream its own name")
        seen[s["name"]] = i
    kinds = {s["from"] for s in seqs}
    if kinds & {"events", "lists"} and kinds & {"rows", "column"}:
        raise SpecError(f"{where}: streams from events/lists and from rows/column cannot be mixed "
                        f"in one dataset; the first are stored once per user (layout v2), the "
                        f"others per row (v1), and a dataset has one layout: give the rows/column "
                        f"stream as an events table (one row per event) instead")
    buckets = sorted({s["buckets"] for s in seqs if "buckets" in s})
    if len(buckets) > 1:
        raise SpecError(f"{where}: streams give different buckets {buckets}; the streams of a "
                        f"dataset share one user bucketing: give one value")


def _sequence(d: dict, raw: object, path: str, where: str) -> dict:
    s = _obj(raw, "sequence", where, path)
    s.setdefault("name", "history")
    s.setdefault("from", "rows")
    s.setdefault("attributes", [])
    if s["from"] not in ("rows", "column", "events", "lists"):
        raise SpecError(f"{where}: {path}.from must be rows, column, events or lists, "
                        f"got {s['from']!r}")
    sparse = {f["column"]: f for f in d["sparse"]}
    _own_vocab(s, path, where, "item_vocab")
    if "matches" in s:
        _matched(d, s["matches"], f"{path}.matches", where)
    own = [k for k in ("item_vocab", "hash_size", "vocab_size") if k in s]
    if own and s["from"] != "events":
        raise SpecError(f"{where}: {path}.{own[0]}: an item vocabulary of the stream's own is "
                        f"for streams from events; from {s['from']} the items are ids of the "
                        f"sparse feature named by item")
    single = s["item"] in sparse and not sparse[s["item"]].get("multi_hot")
    if not single and (s["from"] != "events"
                       or (s["item"] in sparse and not own and "matches" not in s)):
        raise SpecError(f"{where}: {path}.item {s['item']!r} must be a single-valued column "
                        f"listed under sparse" + (" (or give the stream its own item_vocab, "
                                                 "hash_size or vocab_size, or matches)"
                                                 if s["from"] == "events" else ""))
    if s["max_len"] <= 0:
        raise SpecError(f"{where}: {path}.max_len must be > 0, got {s['max_len']}")
    extra = {"rows": set(), "column": set(),
             "events": {"files", "user", "time", "time_unit", "buckets"},
             "lists": {"times", "time_unit", "buckets"}}[s["from"]]
    stray = sorted({"files", "user", "time", "time_unit", "times", "buckets"} & set(s) - extra)
    if stray:
        raise SpecError(f"{where}: {path}.{stray[0]} is not used with sequence "
                        f"from {s['from']!r}")
    if s.get("time_unit", "s") not in _TIME_UNITS:
        raise SpecError(f"{where}: {path}.time_unit must be one of {sorted(_TIME_UNITS)}, "
                        f"got {s['time_unit']!r}")
    if s.get("buckets", 1) <= 0:
        raise SpecError(f"{where}: {path}.buckets must be > 0, got {s['buckets']}")
    if s["from"] in ("events", "lists"):
        missing = [k for k in ("user", "time") if k not in d]
        if missing:
            raise SpecError(f"{where}: sequence from {s['from']} needs the top-level "
                            f"key(s) {missing}")
        if s["from"] == "events":
            if not s.get("files") or not all(isinstance(x, str) for x in s["files"]):
                raise SpecError(f"{where}: {path} from events needs files, a list of event "
                                f"table file names")
            s.setdefault("user", d["user"])
            s.setdefault("time", d["time"])
        else:
            if "column" not in s or "times" not in s:
                raise SpecError(f"{where}: {path} from lists needs {path}.column (items) "
                                f"and {path}.times")
            if s["attributes"] or "event" in s or "only" in s:
                raise SpecError(f"{where}: {path} from lists takes no attributes/event/only")
        s.setdefault("time_unit", d.get("time_unit", "s"))
    elif s["from"] == "rows":
        missing = [k for k in ("user", "time") if k not in d]
        if missing:
            raise SpecError(f"{where}: sequence from rows needs the top-level key(s) {missing}")
        tasks = [t["name"] for t in d["tasks"]]
        if "only" in s and s["only"] not in tasks:
            raise SpecError(f"{where}: {path}.only {s['only']!r} is not a task; tasks "
                            f"are {tasks}")
    else:
        if "column" not in s:
            raise SpecError(f"{where}: {path} from column needs {path}.column")
        if s["attributes"] or "event" in s or "only" in s:
            raise SpecError(f"{where}: {path} from column takes no attributes/event/only")
        s.setdefault("sep", "|")
    s["attributes"] = _attributes(d, s, path, where)
    if "values" in s:
        s["values"] = _values(d, s, path, where)
    return s


def _values(d: dict, s: dict, path: str, where: str) -> list[dict]:
    """A stream's per-event values, each as a full object (defaults filled). Read from an events
    table's columns or, from rows, the earlier rows' columns; the other kinds have no per-event
    numbers to take them from here (a ``SpecError``). A name must not clash with what an event
    already carries (item, event, ts, user, an attribute): both are columns of one event log."""
    if s["from"] not in ("events", "rows"):
        raise SpecError(f"{where}: {path}.values: per-event values are read from an events table "
                        f"(from events) or the impression rows (from rows), not from "
                        f"{s['from']}; give the stream as an events table to carry values")
    sparse = {f["column"]: f["name"] for f in d["sparse"]}
    attrs = [sparse[a] if isinstance(a, str) else a["name"] for a in s["attributes"]]
    out: list[dict] = []
    for i, v in enumerate(s["values"]):
        key = f"{path}.values[{i}]"
        if isinstance(v, str):
            v = {"column": v}
        elif not isinstance(v, dict):
            raise SpecError(f"{where}: {key} must be a column name or an object {{column, name, "
                            f"transform, missing, fill}}, got {v!r}")
        v = _obj(v, "value", where, key)
        v.setdefault("name", feature_name(v["column"]))
        v.setdefault("transform", "none")
        v.setdefault("missing", "fill" if "fill" in v else "drop")
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", v["name"]):
            raise SpecError(f"{where}: {key}.name {v['name']!r} must be letters, digits and _ "
                            f"(not starting with a digit)")
        if v["transform"] not in ("none", "log1p"):
            raise SpecError(f"{where}: {key}.transform must be none or log1p, "
                            f"got {v['transform']!r}")
        if v["missing"] not in VALUE_MISSING:
            raise SpecError(f"{where}: {key}.missing must be one of {'/'.join(VALUE_MISSING)}, "
                            f"got {v['missing']!r}")
        if (v["missing"] == "fill") != ("fill" in v):
            raise SpecError(f"{where}: {key}: missing 'fill' needs a fill value, and a fill "
                            f"value needs missing 'fill' (got missing {v['missing']!r})")
        if "fill" in v and not abs(v["fill"]) <= FLOAT32_MAX:  # False for NaN too
            raise SpecError(f"{where}: {key}.fill must be a finite float32, got {v['fill']!r}")
        taken = {n: "an event log column" for n in _EVENT_COLUMNS}
        taken |= {n: "an attribute's name" for n in attrs}
        taken |= {w["name"]: "another value's name" for w in out}
        if v["name"] in taken:
            raise SpecError(f"{where}: {key}.name {v['name']!r} clashes with "
                            f"{taken[v['name']]} (each event's columns are "
                            f"{list(_EVENT_COLUMNS) + attrs + [w['name'] for w in out]}); give "
                            f"the value a name of its own")
        out.append(v)
    return out
