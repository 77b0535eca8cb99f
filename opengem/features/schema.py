"""FeatureSchema: the one place that says which columns exist and what they are.

Data generation, the loader, the model, training, export and serving all read the schema. It is
stored as ``schema.json`` next to the Parquet shards it describes.

Column layout of a shard (one impression per row)::

    user_id            int64            for gAUC grouping (also usable as a sparse feature)
    request_ts         int64            seconds; the time of the impression
    day                int32            simulated/logical day, used for splits
    <domain.column>    int64            domain (surface) index in [0, len(domain.names))
    <sparse.name>      list<int64> or int64   id(s) of a sparse feature; raw ids in [0, vocab_size)
    <dense.name>       float32          one dense float
    <embedding.name>   list<float32>    a precomputed vector of exactly ``dim`` floats (e.g. an ad's content
                                        embedding from an image/text encoder); fixed_size_list allowed
    <stream>.item      list<int64>      behaviour sequence item ids, oldest → newest
    <stream>.event     list<int64>      event type per event, in [0, num_event_types)
    <stream>.ts        list<int64>      event timestamps (seconds), non-decreasing, all < request_ts
    <stream>.<attr>    list<int64>      one id per event for each ``EventAttribute`` of the stream
    <stream>.<value>   list<float32>    one number per event for each of the stream's ``values``
                                        (dwell seconds, watch fraction, price); finite
    <task.label>       int8/float       0/1 label
    <task.prob>        float            (synthetic worlds only) true probability the label was drawn with

Out-of-range ids are not an error at read time: they map to the feature's OOV row (``vocab_size``)
and are counted (see ``opengem.data.batch``). Structural problems (missing columns, wrong types,
bad schema fields) are errors that name the problem.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

SCHEMA_VERSION = 1
SCHEMA_FILE = "schema.json"  # its name in a data directory, a run directory and an artifact
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SchemaError(ValueError):
    """A schema, or data checked against a schema, is invalid. The message names the field."""


@dataclass(frozen=True)
class SparseFeature:
    """A categorical feature. Raw ids are in ``[0, vocab_size)``; row ``vocab_size`` is the OOV row.

    ``multi_hot`` features hold a list of ids per row (pooled by sum), others exactly one id.
    ``group`` is "user", "ad" or "context": used by students, export and serving to know which
    side of a request a feature comes from.
    """

    name: str
    vocab_size: int
    group: str = "user"
    multi_hot: bool = False


# what a NaN/null dense value means (``DenseFeature.missing``)
MISSING = ("quarantine", "indicator")


@dataclass(frozen=True)
class DenseFeature:
    """A float feature. By default (``missing="quarantine"``) NaN/inf are invalid (rejected or
    quarantined by the reader). ``missing="indicator"``: a NaN or null is a missing value, kept; the
    model sees the train median in its place plus a 0/1 "was missing" input
    (``opengem.model.dense_norm``), because in logs a missing counter or price is often informative.
    ±inf stays invalid.
    """

    name: str
    group: str = "user"
    missing: str = "quarantine"


@dataclass(frozen=True)
class EmbeddingFeature:
    """A precomputed fixed-width float vector per row, e.g. an ad's content (creative) embedding
    from an image or text encoder: GEM's multimodal input. Stored as a list of exactly ``dim``
    floats; a row with another length or a NaN/inf is quarantined. ``group`` as for the other
    features (serving takes an "ad" one per candidate). Per-event vectors (an attribute of a stream)
    are not a kind yet.
    """

    name: str
    dim: int
    group: str = "ad"


@dataclass(frozen=True)
class EventAttribute:
    """A categorical attribute carried by every event of a stream (e.g. the item's category).

    ``matches`` names the single-valued sparse feature whose id space the attribute shares (the
    organic item's category ≡ the ad's ``category``): the model then compares each event's value
    with the candidate's. Unset, an attribute named like such a feature with the same vocabulary
    matches it (the rule schemas written before the field rely on).
    """

    name: str
    vocab_size: int
    matches: str | None = None


@dataclass(frozen=True)
class SequenceStream:
    """One behaviour event stream (e.g. ad engagements, organic views).

    Each event is (item id, event type, timestamp, optional attributes, optional numeric values) —
    Meta's event-based features: an event model embeds each attribute and sums them into one event
    token. ``values`` names per-event floats (dwell seconds, watch fraction, price), stored as
    ``<stream>.<value>`` beside ``<stream>.item``: how long or how much an engagement was is signal
    the event type alone cannot carry. ``max_len`` is the longest history the data may hold; longer
    histories keep their most recent ``max_len`` events (counted).
    """

    name: str
    item_vocab_size: int
    num_event_types: int
    max_len: int
    attributes: tuple[EventAttribute, ...] = ()
    # the single-valued sparse feature whose id space the items share (an ad-engagement stream's
    # ad ids ≡ the candidate's ``ad_id``): the model compares each event's item with the
    # candidate's; None: the items are their own id space (organic content)
    matches: str | None = None
    # names of per-event float values, each the column ``<stream>.<name>``; () = none
    values: tuple[str, ...] = ()

    def attribute_column(self, attr: EventAttribute) -> str:
        return f"{self.name}.{attr.name}"

    def value_column(self, value: str) -> str:
        return f"{self.name}.{value}"

    @property
    def value_columns(self) -> tuple[str, ...]:
        """The value columns, in ``values`` order (the model's [N, V] columns)."""
        return tuple(self.value_column(v) for v in self.values)

    @property
    def item_column(self) -> str:
        return f"{self.name}.item"

    @property
    def event_column(self) -> str:
        return f"{self.name}.event"

    @property
    def ts_column(self) -> str:
        return f"{self.name}.ts"


@dataclass(frozen=True)
class Task:
    """A binary label. ``prob_column`` names the true probability (synthetic data only).

    ``requires`` names another task whose positive label this one needs (conversion requires a
    click); rows that break it are invalid.
    """

    name: str
    label_column: str
    prob_column: str | None = None
    requires: str | None = None
    weight: float = 1.0


@dataclass(frozen=True)
class Domains:
    """The surfaces. ``column`` holds an index into ``names``."""

    names: tuple[str, ...]
    column: str = "domain"


@dataclass(frozen=True)
class FeatureSchema:
    """Every column of a dataset and what it is (module docstring); validated on construction.

    Args:
        sparse: id features, in the order the model's tokens take ([B, n, D], n = len(sparse)).
        dense: float features ([B, F]).
        sequences: behaviour streams, each stored as jagged lists per row (ids, times and any
            per-event ``values``).
        tasks: binary labels ([B, T] with a mask), in the order of the model's logits.
        domains: the surfaces and the column holding each row's index.
        user_column, time_column, day_column: gAUC groups, the request time, the split key.
        version, meta: the format version; free-form provenance (not part of ``fingerprint``).
        embeddings: precomputed float vectors (``EmbeddingFeature``), one X_0 token each; stored in
            ``schema.json`` only when there are some (so schemas without any keep their fingerprint).

    ``FeatureSchema.load(dir_or_file)`` reads ``schema.json``; ``save``, ``to_dict``/``from_dict``
    round-trip it. A row with 2 ads events and tags ``[3, 5]`` carries ``ads.item = [17, 4]``,
    ``ads.event = [0, 1]``, ``ads.ts = [t0, t1]`` and ``tags = [3, 5]``: lists, never padded.
    """

    sparse: tuple[SparseFeature, ...]
    dense: tuple[DenseFeature, ...]
    sequences: tuple[SequenceStream, ...]
    tasks: tuple[Task, ...]
    domains: Domains
    user_column: str = "user_id"
    time_column: str = "request_ts"
    day_column: str = "day"
    version: int = SCHEMA_VERSION
    meta: dict = field(default_factory=dict, compare=False)
    embeddings: tuple[EmbeddingFeature, ...] = ()

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ queries
    @property
    def task_names(self) -> list[str]:
        return [t.name for t in self.tasks]

    @property
    def num_domains(self) -> int:
        return len(self.domains.names)

    def sparse_feature(self, name: str) -> SparseFeature:
        for f in self.sparse:
            if f.name == name:
                return f
        raise SchemaError(f"no sparse feature named {name!r}; have {[f.name for f in self.sparse]}")

    def stream(self, name: str) -> SequenceStream:
        for s in self.sequences:
            if s.name == name:
                return s
        raise SchemaError(f"no sequence stream named {name!r}; have "
                          f"{[s.name for s in self.sequences]}")

    def columns(self, with_probs: bool = True) -> list[str]:
        """Every column a shard must hold (probability columns only if asked and declared)."""
        cols = [self.user_column, self.time_column, self.day_column, self.domains.column]
        cols += [f.name for f in self.sparse if f.name != self.user_column] + [
            f.name for f in self.dense
        ]
        cols += [f.name for f in self.embeddings]
        for s in self.sequences:
            cols += [s.item_column, s.event_column, s.ts_column] + [
                s.attribute_column(a) for a in s.attributes
            ] + list(s.value_columns)
        cols += [t.label_column for t in self.tasks]
        if with_probs:
            cols += [t.prob_column for t in self.tasks if t.prob_column]
        return cols

    @property
    def dense_missing(self) -> list[int]:
        """Indices (into ``dense``) of the features whose missing values are
        kept (``missing="indicator"``)."""
        return [i for i, f in enumerate(self.dense) if f.missing == "indicator"]

    @property
    def embedding_dim(self) -> int:
        """Width of ``Batch.embeddings``: every embedding feature's ``dim``, concatenated in
        schema order."""
        return sum(f.dim for f in self.embeddings)

    @property
    def has_true_probs(self) -> bool:
        return bool(self.tasks) and all(t.prob_column for t in self.tasks)

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        names: set[str] = set()

        def claim(name: str, what: str) -> None:
            if not isinstance(name, str) or not _NAME.match(name):
                raise SchemaError(f"{what} name {name!r} must match {_NAME.pattern}")
            if name in names:
                raise SchemaError(f"duplicate name {name!r} ({what})")
            names.add(name)

        for c in (self.time_column, self.day_column, self.domains.column):
            claim(c, "reserved column")
        # the user id may double as a feature
        if self.user_column not in {f.name for f in self.sparse}:
            claim(self.user_column, "reserved column")
        for f in self.sparse:
            claim(f.name, "sparse feature")
            _positive_int(f.vocab_size, f"sparse feature {f.name!r} vocab_size")
            if f.group not in ("user", "ad", "context"):
                raise SchemaError(f"sparse feature {f.name!r}: group must be user/ad/context, "
                                  f"got {f.group!r}")
        for f in self.dense:
            claim(f.name, "dense feature")
            if f.group not in ("user", "ad", "context"):
                raise SchemaError(f"dense feature {f.name!r}: group must be user/ad/context, "
                                  f"got {f.group!r}")
            if f.missing not in MISSING:
                raise SchemaError(f"dense feature {f.name!r}: missing must be one "
                                  f"of {'/'.join(MISSING)}, "
                                  f"got {f.missing!r}")
        for f in self.embeddings:
            claim(f.name, "embedding feature")
            _positive_int(f.dim, f"embedding feature {f.name!r} dim")
            if f.group not in ("user", "ad", "context"):
                raise SchemaError(f"embedding feature {f.name!r}: group must be user/ad/context, "
                                  f"got {f.group!r}")
        for s in self.sequences:
            claim(s.name, "sequence stream")
            _positive_int(s.item_vocab_size, f"stream {s.name!r} item_vocab_size")
            _positive_int(s.num_event_types, f"stream {s.name!r} num_event_types")
            _positive_int(s.max_len, f"stream {s.name!r} max_len")
            attr_names = [a.name for a in s.attributes]
            if len(set(attr_names)) != len(attr_names) or {"item", "event", "ts"} & set(attr_names):
                raise SchemaError(f"stream {s.name!r}: attribute names {attr_names} must be unique "
                                  f"and not item/event/ts")
            for a in s.attributes:
                if not _NAME.match(a.name):
                    raise SchemaError(f"stream {s.name!r} attribute name {a.name!r} must "
                                      f"match {_NAME.pattern}")
                _positive_int(a.vocab_size, f"stream {s.name!r} attribute {a.name!r} vocab_size")
                if a.matches is not None:
                    self._check_match(a.matches, a.vocab_size,
                                      f"stream {s.name!r} attribute {a.name!r}")
            if s.matches is not None:
                self._check_match(s.matches, s.item_vocab_size, f"stream {s.name!r} items")
            self._check_values(s, attr_names)
        if not self.tasks:
            raise SchemaError("schema needs at least one task")
        task_names = {t.name for t in self.tasks}
        for t in self.tasks:
            claim(t.name, "task")
            if t.label_column != t.name:
                claim(t.label_column, f"task {t.name!r} label column")
            if t.prob_column:
                claim(t.prob_column, f"task {t.name!r} prob column")
            if t.requires is not None and (t.requires not in task_names or t.requires == t.name):
                raise SchemaError(f"task {t.name!r} requires unknown task {t.requires!r}")
            if not (t.weight >= 0.0):
                raise SchemaError(f"task {t.name!r} weight must be >= 0, got {t.weight}")
        if not self.domains.names:
            raise SchemaError("schema needs at least one domain")
        if len(set(self.domains.names)) != len(self.domains.names):
            raise SchemaError(f"duplicate domain names {self.domains.names}")
        if not self.sparse and not self.dense and not self.embeddings:
            raise SchemaError("schema needs at least one sparse, dense or embedding feature")
        if self.version != SCHEMA_VERSION:
            raise SchemaError(f"schema version {self.version} not supported "
                              f"(expected {SCHEMA_VERSION})")

    @staticmethod
    def _check_values(s: SequenceStream, attr_names: list[str]) -> None:
        if not isinstance(s.values, tuple):
            raise SchemaError(f"stream {s.name!r}: values must be a tuple of names, "
                              f"got {s.values!r}")
        for v in s.values:
            if not isinstance(v, str) or not _NAME.match(v):
                raise SchemaError(f"stream {s.name!r} value name {v!r} must match {_NAME.pattern}")
        taken = {"item", "event", "ts"} | set(attr_names)
        if len(set(s.values)) != len(s.values) or taken & set(s.values):
            raise SchemaError(f"stream {s.name!r}: value names {list(s.values)} must be unique and "
                              f"not item/event/ts or an attribute's name {sorted(attr_names)}")

    def _check_match(self, feature: str, vocab_size: int, what: str) -> None:
        f = next((f for f in self.sparse if f.name == feature), None)
        if f is None or f.multi_hot:
            raise SchemaError(f"{what}: matches {feature!r}, which is not a single-valued sparse "
                              f"feature; have {[g.name for g in self.sparse if not g.multi_hot]}")
        if f.vocab_size != vocab_size:
            raise SchemaError(f"{what}: matches {feature!r} but its vocab_size {vocab_size} is not "
                              f"the feature's {f.vocab_size} (one id space has one size)")

    # -------------------------------------------------------------- (de)serialise
    def to_dict(self) -> dict:
        d = asdict(self)
        # unset matches are not written: schemas without them keep their fingerprint
        for s in d["sequences"]:
            if s["matches"] is None:
                s.pop("matches")
            for a in s["attributes"]:
                if a["matches"] is None:
                    a.pop("matches")
            # streams without values read (and hash) as they did before the field
            if not s["values"]:
                s.pop("values")
            else:
                s["values"] = list(s["values"])
        # schemas without embeddings read (and hash) as they did before the kind
        if not self.embeddings:
            d.pop("embeddings")
        # the default is not written: schemas without the option keep their fingerprint
        for f in d["dense"]:
            if f["missing"] == "quarantine":
                f.pop("missing")
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def from_dict(cls, d: dict) -> "FeatureSchema":
        if not isinstance(d, dict):
            raise SchemaError(f"schema must be a JSON object, got {type(d).__name__}")
        known = {"sparse", "dense", "sequences", "tasks", "domains", "user_column", "time_column",
                 "day_column", "version", "meta", "embeddings"}
        unknown = set(d) - known
        if unknown:
            raise SchemaError(f"unknown schema keys {sorted(unknown)}")
        for key in ("sparse", "dense", "sequences", "tasks", "domains"):
            if key not in d:
                raise SchemaError(f"schema is missing {key!r}")
        try:
            return cls(
                sparse=tuple(_build(SparseFeature, x, "sparse") for x in d["sparse"]),
                dense=tuple(_build(DenseFeature, x, "dense") for x in d["dense"]),
                sequences=tuple(_stream(x) for x in d["sequences"]),
                tasks=tuple(_build(Task, x, "tasks") for x in d["tasks"]),
                domains=_build(Domains, {**d["domains"], "names": tuple(d["domains"]["names"])},
                               "domains"),
                embeddings=tuple(_build(EmbeddingFeature, x, "embeddings")
                                 for x in d.get("embeddings", ())),
                **{k: d[k] for k in ("user_column", "time_column", "day_column", "version", "meta")
                   if k in d},
            )
        except (TypeError, KeyError) as e:
            raise SchemaError(f"malformed schema: {e}") from e

    @classmethod
    def load(cls, path: str | Path) -> "FeatureSchema":
        p = Path(path)
        if p.is_dir():
            p = p / SCHEMA_FILE
        return cls.from_dict(read_json(p, SchemaError, "schema file"))

    def fingerprint(self) -> str:
        """A short hash of the structural schema (not ``meta``), stored in checkpoints."""
        import hashlib

        d = self.to_dict()
        d.pop("meta", None)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def read_json(path: Path, error: type[Exception], what: str) -> object:
    """The parsed JSON file at ``path``; ``error`` names the file when it is missing or not JSON."""
    if not path.exists():
        raise error(f"{what} not found: {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e})") from e


def _positive_int(v: object, what: str) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise SchemaError(f"{what} must be a positive integer, got {v!r}")


def _stream(x: object) -> SequenceStream:
    if isinstance(x, dict) and "values" in x:
        if not isinstance(x["values"], (list, tuple)):
            raise SchemaError(f"sequences: values must be a list of names, got {x['values']!r}")
        x = {**x, "values": tuple(x["values"])}
    if isinstance(x, dict) and "attributes" in x:
        attrs = x["attributes"]
        if not isinstance(attrs, (list, tuple)):
            raise SchemaError(f"sequences: attributes must be a list, got {attrs!r}")
        x = {**x,
             "attributes": tuple(_build(EventAttribute, a, "sequences.attributes") for a in attrs)}
    return _build(SequenceStream, x, "sequences")


def _build(kind: type, x: object, where: str):
    if not isinstance(x, dict):
        raise SchemaError(f"{where}: each entry must be an object, got {x!r}")
    fields = set(kind.__dataclass_fields__)
    unknown = set(x) - fields
    if unknown:
        raise SchemaError(f"{where}: unknown keys {sorted(unknown)} in {x!r}")
    try:
        return kind(**x)
    except TypeError as e:
        raise SchemaError(f"{where}: {e}") from e
