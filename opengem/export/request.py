"""A scoring request: its JSON schema (built from the FeatureSchema), validation, and parsed form.

A request is one impression opportunity with many candidate ads, in the raw fields of the logs
(column names as in the Parquet shards, see ``opengem.features.schema``)::

    {"request_ts": 1700000000, "domain": 0,                       time and surface of the request
     "user_id": 17, "age": 3, …, "position": 1, "hour": 13,       user and context sparse ids
     "user_activity": 0.4, "hour_sin": 0.2, …,                    user and context dense floats
     "organic.item": [...], "organic.event": [...], "organic.ts": [...], "organic.category": [...],
     "ads.item": [...], …,                                        histories, oldest → newest
     "organic.dwell": [...],                                      per-event values (floats), if any
     "candidates": [{"ad_id": 5, "advertiser_id": 2, …, "ad_quality": 0.7,        ad-group fields
                     "ad_content": [0.1, -0.3, …]}, …],                  (embedding features: dim floats)
     "explain": false}                                            opt-in explanations (export/explain.py)

Feature ``group`` in the schema decides the side: ``ad`` fields belong to each candidate, ``user``
and ``context`` fields to the request. Everything a log row has except labels is accepted.

Checks, each failing with ``RequestError(status, field, message)``:
types, required fields and unknown fields (422); non-finite or out-of-float32 dense values (422);
a null dense value (422) unless its feature is ``missing="indicator"``: then null or left out is
missing; an embedding vector of another length than its feature's ``dim`` (422); history lists of
one stream of different lengths, event times not before the request or out of order, a per-event
value (``SequenceStream.values``) NaN or ±inf (422, the checks ``validate_rows`` quarantines
training rows for); empty candidate lists (422); ``explain`` not a JSON boolean (422); more
candidates, longer histories or more multi-hot ids than the limits (413). A stream's history fields are required
unless the server has a history store (``opengem.export.history``): then a request with ``user_id``
may leave out all fields of a stream and the store fills them (one field of a stream without the
others is still a 422). Ids outside a feature's vocabulary are *not* errors: as in training they
score through the feature's OOV row and each response counts them (``oov``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from opengem.features.schema import FeatureSchema

INT64 = (-(2**63), 2**63 - 1)
_Id = Annotated[int, Field(strict=True, ge=INT64[0], le=INT64[1])]
_Ts = Annotated[int, Field(strict=True, ge=0, le=2**62)]
# finite in float32
_Float = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=-3.0e38, le=3.0e38)]


@dataclass(frozen=True)
class Limits:
    """What one request may hold; past these a request is refused with 413."""

    max_candidates: int = 1024
    max_history: int = 0  # events per stream; 0 = the schema's max_len
    max_multi_hot: int = 256  # ids of one multi-hot feature

    def history(self, stream) -> int:
        return self.max_history or stream.max_len


class RequestError(ValueError):
    """A bad request; ``status`` is the HTTP code, ``field`` names what is wrong."""

    def __init__(self, status: int, field: str, message: str):
        super().__init__(f"{field}: {message}" if field else message)
        self.status, self.field, self.message = status, field, message


@dataclass
class ParsedRequest:
    """A validated request as arrays (ids not yet OOV-mapped, histories not yet truncated)."""

    request_ts: int
    domain: int
    sparse: dict[str, np.ndarray]  # user/context feature → ids of the request
    dense: dict[str, float]  # user/context dense
    # "<stream>.<col>" → int64 per event (ts included); a value column: float32 per event
    sequences: dict[str, np.ndarray]
    cand_sparse: dict[str, tuple[np.ndarray, np.ndarray]]  # ad feature → (ids, lengths [C])
    cand_dense: dict[str, np.ndarray]  # ad dense → [C] float32
    num_candidates: int
    user_id: int | None = None
    missing: tuple[str, ...] = ()  # streams whose history the request left out (a store fills them)
    # response report of the store's lookup
    lookup: dict[str, dict[str, int]] = field(default_factory=dict)
    # user/context embedding → [dim] float32
    embeddings: dict[str, np.ndarray] = field(default_factory=dict)
    # ad embedding → [C, dim] float32
    cand_embeddings: dict[str, np.ndarray] = field(default_factory=dict)
    explain: bool = False  # the response adds an explanation (``opengem.export.explain``)


def _py(name: str) -> str:
    return "f_" + name.replace(".", "__")  # a Python identifier; the JSON name is the alias


def _fields(schema: FeatureSchema, groups: set[str], limits: Limits) -> dict:
    out = {}
    for f in schema.sparse:
        if f.group in groups:
            t = Annotated[list[_Id], Field(max_length=limits.max_multi_hot)] if f.multi_hot else _Id
            out[_py(f.name)] = (t,
                                Field(..., alias=f.name,
                                      description=f"{f.group} id, vocabulary {f.vocab_size}"))
    for f in schema.dense:
        # null or left out: missing, as in the logs
        if f.group in groups and f.missing == "indicator":
            out[_py(f.name)] = (
                _Float | None,
                Field(
                    None, alias=f.name, description=f"{f.group} dense value; null/omitted: missing"
                ),
            )
        elif f.group in groups:
            out[_py(f.name)] = (_Float,
                                Field(..., alias=f.name, description=f"{f.group} dense value"))
    for f in schema.embeddings:  # the length is checked in ``parse`` (a 422, not a limit's 413)
        if f.group in groups:
            out[_py(f.name)] = (
                list[_Float],
                Field(..., alias=f.name, description=f"{f.group} vector of {f.dim} floats"),
            )
    return out


def _vector(v: list, f, where: str) -> np.ndarray:
    if len(v) != f.dim:
        raise RequestError(422, where, f"embedding {f.name!r} needs {f.dim} floats, got {len(v)}")
    return np.asarray(v, dtype=np.float32)


def history_columns(s) -> tuple[str, ...]:
    """A stream's history fields in a request (and v1 row): item, event, ts, its attributes, then
    its per-event values."""
    return (s.item_column, s.event_column, s.ts_column) + tuple(
        s.attribute_column(a) for a in s.attributes
    ) + s.value_columns


def empty_history(s) -> dict[str, np.ndarray]:
    """A stream's history fields with no events, each of its field's dtype."""
    values = set(s.value_columns)
    return {c: np.zeros(0, dtype=np.float32 if c in values else np.int64)
            for c in history_columns(s)}


def request_models(schema: FeatureSchema, limits: Limits = Limits(),
                   optional_histories: bool = False) -> tuple[type[BaseModel], type[BaseModel]]:
    """(Candidate, ScoreRequest) pydantic models; their JSON schema is the API's.

    ``optional_histories``: history fields may be left out (a history store fills them by user id).
    """
    cfg = ConfigDict(extra="forbid", populate_by_name=False)
    cand = create_model("Candidate", __config__=cfg, **_fields(schema, {"ad"}, limits))
    fields = _fields(schema, {"user", "context"}, limits)
    fields[_py(schema.time_column)] = (_Ts,
                                       Field(..., alias=schema.time_column, description="seconds"))
    fields[_py(schema.domains.column)] = (Annotated[int,
                                                    Field(strict=True, ge=0,
                                                          le=schema.num_domains - 1)],
                                          Field(..., alias=schema.domains.column,
                                                description=f"index "
                                                            f"into {list(schema.domains.names)}"))
    if schema.user_column not in {f.name for f in schema.sparse}:
        fields[_py(schema.user_column)] = (_Id | None, Field(None, alias=schema.user_column))
    fields[_py(schema.day_column)] = (_Id | None,
                                      Field(None, alias=schema.day_column, description="ignored"))
    for s in schema.sequences:
        n = limits.history(s)
        for col in history_columns(s):
            item = _Ts if col == s.ts_column else _Float if col in s.value_columns else _Id
            t = Annotated[list[item], Field(max_length=n)]
            desc = f"stream {s.name}, oldest → newest, ≤ {n} events"
            fields[_py(col)] = ((t | None,
                                 Field(None, alias=col,
                                       description=desc + "; omitted: looked up by user_id"))
                                if optional_histories
                                else (t, Field(..., alias=col, description=desc)))
    fields["explain"] = (Annotated[bool, Field(strict=True)],
                         Field(False, description="true: add each candidate's explanation "
                                                  "(occlusion; costs many forwards, see "
                                                  "docs/serving.md)"))
    fields["candidates"] = (Annotated[list[cand],
                                      Field(min_length=1, max_length=limits.max_candidates)],
                            Field(..., description="ads to score for this request"))
    return cand, create_model("ScoreRequest", __config__=cfg, **fields)


def error_from_validation(e: ValidationError | list[dict]) -> RequestError:
    """The first problem of a pydantic error, as a RequestError naming the field (413
    for limits)."""
    errors = e.errors() if isinstance(e, ValidationError) else e
    err, kind = errors[0], errors[0].get("type")
    loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    if kind == "json_invalid":
        return RequestError(400, "body", f"malformed JSON: {err.get('msg')}")
    if kind in ("missing", "extra_forbidden"):
        return RequestError(422, loc,
                            ("field required" if kind == "missing" else "unknown field") + more)
    if kind == "float_type" and err.get("input", ...) is None:
        return RequestError(422, loc,
                            f"null: {loc.rsplit('.', 1)[-1]!r} needs a number (only a "
                            f"dense feature "
                                      f"declared missing=\"indicator\" takes null "
                                      f"as missing){more}")
    if kind == "too_long":
        return RequestError(413, loc, err.get("msg", "too long") + more)
    return RequestError(422, loc or "body",
                        f"{err.get('msg')}, got {_short(err.get('input'))}{more}")


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def parse(schema: FeatureSchema, req: BaseModel) -> ParsedRequest:
    """Arrays of a request model validated by ``request_models``; semantic checks included."""
    get = req.__dict__  # attributes by Python name: cheaper than model_dump for big candidate lists
    ts = get[_py(schema.time_column)]
    sequences, missing = {}, []
    for s in schema.sequences:
        given = {c: get.get(_py(c)) for c in history_columns(s)}
        if all(v is None for v in given.values()):
            missing.append(s.name)  # only possible with optional_histories
            continue
        absent = [c for c, v in given.items() if v is None]
        if absent:
            raise RequestError(422, absent[0],
                               f"field required: stream {s.name!r} is given in part "
                                               "(give all its fields, or none to look it up "
                                               "by user id)")
        sequences.update(check_history(schema, s, given, ts))
    sparse, dense, cand_sparse, cand_dense = {}, {}, {}, {}
    cands = get["candidates"]
    C = len(cands)
    for f in schema.sparse:
        if f.group != "ad":
            v = get[_py(f.name)]
            sparse[f.name] = np.asarray(v if f.multi_hot else [v], dtype=np.int64)
        elif f.multi_hot:
            lists = [c.__dict__[_py(f.name)] for c in cands]
            lens = np.fromiter((len(x) for x in lists), np.int64, count=C)
            flat = np.fromiter((i for x in lists for i in x), np.int64, count=int(lens.sum()))
            cand_sparse[f.name] = (flat, lens)
        else:
            key = _py(f.name)
            cand_sparse[f.name] = (np.fromiter((c.__dict__[key] for c in cands), np.int64, count=C),
                                   np.ones(C, dtype=np.int64))
    # a missing value of a ``missing="indicator"`` feature (the only ones that may be None)
    nan = float("nan")
    for f in schema.dense:
        key = _py(f.name)
        if f.group != "ad":
            dense[f.name] = nan if get[key] is None else float(get[key])
        else:
            cand_dense[f.name] = np.fromiter((nan if c.__dict__[key] is None else c.__dict__[key]
                                              for c in cands),
                                             np.float32, count=C)
    embeddings, cand_embeddings = {}, {}
    for f in schema.embeddings:
        key = _py(f.name)
        if f.group != "ad":
            embeddings[f.name] = _vector(get[key], f, f.name)
        else:
            cand_embeddings[f.name] = (np.stack([_vector(c.__dict__[key], f,
                                                         f"candidates.{i}.{f.name}")
                                                 for i, c in enumerate(cands)]))
    user = (
        get.get(_py(schema.user_column))
        if schema.user_column not in {f.name for f in schema.sparse}
        else int(sparse[schema.user_column][0])
    )
    return ParsedRequest(ts, get[_py(schema.domains.column)], sparse, dense, sequences, cand_sparse,
                         cand_dense, C, user, tuple(missing), embeddings=embeddings,
                         cand_embeddings=cand_embeddings, explain=get.get("explain", False))


def check_history(schema: FeatureSchema, s, fields: dict, ts: int) -> dict[str, np.ndarray]:
    """One stream's history fields as int64 arrays (value fields float32), checked as
    ``validate_rows`` checks training rows: one entry per event in every field, events before the
    request, oldest → newest, values finite in float32 (422 otherwise). A store's histories come
    here too, so they pass the checks a client's do."""
    values = set(s.value_columns)
    arrs = {c: np.asarray(fields[c], dtype=np.float32 if c in values else np.int64)
            for c in history_columns(s)}
    n = len(arrs[s.ts_column])
    for c, a in arrs.items():
        if len(a) != n:
            raise RequestError(422, c, f"has {len(a)} events but {s.ts_column} has {n}; "
                                       f"every list of stream {s.name!r} must have one entry "
                                       f"per event")
    for c in s.value_columns:
        bad = np.flatnonzero(~np.isfinite(arrs[c]))
        if len(bad):
            raise RequestError(422, c, f"event {int(bad[0])} is {float(arrs[c][bad[0]])}: "
                                       f"per-event values must be finite float32 numbers")
    t = arrs[s.ts_column]
    if (t >= ts).any():
        raise RequestError(422, s.ts_column, f"events must happen before {schema.time_column}={ts}")
    if n > 1 and (np.diff(t) < 0).any():
        raise RequestError(422, s.ts_column, "events must be ordered oldest → newest")
    return arrs


def split_row(schema: FeatureSchema, row: dict) -> tuple[dict, dict]:
    """(request fields, candidate fields) of one log row (labels and probabilities dropped)."""
    ad = {f.name for f in (*schema.sparse, *schema.dense, *schema.embeddings) if f.group == "ad"}
    drop = {t.label_column for t in schema.tasks} | {t.prob_column for t in schema.tasks
                                                     if t.prob_column}
    req = {k: v for k, v in row.items() if k not in ad and k not in drop}
    return req, {k: row[k] for k in ad}


def rows_of(schema: FeatureSchema, request: dict) -> list[dict]:
    """The log rows a request stands for: one per candidate (labels NaN = missing),
    for ``collate``."""
    # a value left out is a null in a row
    left_out = [f for f in schema.dense if f.missing == "indicator"]
    base = {f.name: None for f in left_out if f.group != "ad"}
    base.update({k: v for k, v in request.items() if k not in ("candidates", "explain")})
    base.update({t.label_column: float("nan") for t in schema.tasks})
    for col in (schema.day_column, schema.user_column):  # optional in a request, required in a row
        if base.get(col) is None:
            base[col] = 0
    cand = {f.name: None for f in left_out if f.group == "ad"}
    return [{**base, **cand, **c} for c in request["candidates"]]


def synthetic_request(schema: FeatureSchema, num_candidates: int, history: int | dict[str, int] = 8,
                      seed: int = 0, oov: bool = False) -> dict:
    """A valid random request (for tracing, warm-up, smoke tests and benchmarks).

    ``history``: events per stream; ``oov``: put one out-of-vocabulary id in each id field.
    """
    rng = np.random.default_rng(seed)
    ts = 1_700_000_000

    def ids(vocab: int, n: int | None = None):
        v = rng.integers(0, vocab, n if n is not None else 1)
        if oov and len(v):
            v[0] = vocab + 7
        return v.tolist() if n is not None else int(v[0])

    req: dict[str, Any] = {schema.time_column: ts,
                           schema.domains.column: int(rng.integers(schema.num_domains)),
                           # overwritten below if it is a feature
                           schema.user_column: int(rng.integers(1000))}
    for f in schema.sparse:
        if f.group != "ad":
            req[f.name] = ids(f.vocab_size, 2 if f.multi_hot else None)
    for f in schema.dense:
        if f.group != "ad":
            req[f.name] = float(rng.normal())
    for f in schema.embeddings:
        if f.group != "ad":
            req[f.name] = rng.normal(size=f.dim).tolist()
    for s in schema.sequences:
        n = history.get(s.name, 0) if isinstance(history, dict) else history
        req[s.item_column] = ids(s.item_vocab_size, n)
        req[s.event_column] = rng.integers(0, s.num_event_types, n).tolist()
        req[s.ts_column] = (ts - 60 * np.arange(n, 0, -1)).tolist()
        for a in s.attributes:
            req[s.attribute_column(a)] = rng.integers(0, a.vocab_size, n).tolist()
        for c in s.value_columns:  # heavy-tailed and positive, like dwell times and prices
            req[c] = rng.lognormal(0.0, 1.5, n).tolist()
    cands = []
    for _ in range(num_candidates):
        c: dict[str, Any] = {}
        for f in schema.sparse:
            if f.group == "ad":
                c[f.name] = ids(f.vocab_size, 2 if f.multi_hot else None)
        for f in schema.dense:
            if f.group == "ad":
                c[f.name] = float(rng.normal())
        for f in schema.embeddings:
            if f.group == "ad":
                c[f.name] = rng.normal(size=f.dim).tolist()
        cands.append(c)
    req["candidates"] = cands
    return req
