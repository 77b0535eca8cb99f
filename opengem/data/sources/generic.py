"""Any CSV/Parquet table + a JSON spec (see ``opengem.data.sources.spec``) → our layout, no code.

``--in`` is one table file, or a directory: with the spec's ``files`` the names are relative to it,
without them every ``*.csv``, ``*.csv.gz``, ``*.tsv`` and ``*.parquet`` in it is read, in name
order. Rows keep their input order as the tie-break of equal times; with no ``time`` column the row
number (across files, in order) is the time, so "earlier" means "above".

Errors: a bad spec is a ``SpecError`` (file and key); a missing column, a cell that is not a number
where one is needed, a label outside {0, 1}, a domain value not in ``domain.names`` or an embedding
vector of another length is a ``ColumnError`` (file, column and value or row); both
are ``ValueError``s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from opengem.data.parquet import LAYOUT_V1, LAYOUT_V2, DatasetManifest
from opengem.data.sources.common import (
    SPLITS,
    TRAIN,
    ColumnError,
    SpecError,
    Vocab,
    hash_ids,
    history,
    need,
    parse_time,
    random_split,
    read_csv,
    split_by_time,
    split_per_user,
    to_float,
    to_label,
    write_dataset,
)
from opengem.data.sources.event_log import (
    EventTable,
    Storage,
    bucket_tables,
    list_histories,
    n_buckets,
)
from opengem.data.sources.spec import (
    _TIME_UNITS,
    canonical,
    check_spec,
    id_space,
    load_spec,
    streams,
    time_divisor,
)
from opengem.features.schema import (
    DenseFeature,
    Domains,
    EmbeddingFeature,
    EventAttribute,
    FeatureSchema,
    SequenceStream,
    SparseFeature,
    Task,
)

DEFAULT_DOMAIN = "default"  # the one domain of data without a domain column
_TABLES = ("*.csv", "*.csv.gz", "*.tsv", "*.parquet")


def read_table(path: Path, sep: str = ",", numeric=None, lists: tuple[str, ...] = (),
               only: set[str] | None = None) -> dict[str, np.ndarray]:
    """A CSV (strings) or Parquet (native numbers, other columns as strings) file as numpy columns;
    the Parquet list columns named in ``lists`` stay Arrow arrays (``sequence.from: lists``).
    ``only``: of a Parquet file, read just these columns (the others are never decoded)."""
    if path.name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not path.exists():
            raise ColumnError(f"{path}: file not found")
        try:
            names = pq.read_schema(path).names
            t = pq.read_table(path, columns=[c for c in names if only is None or c in only])
        except (pa.ArrowInvalid, OSError) as e:
            raise ColumnError(f"{path}: not a readable Parquet file ({e})") from e
        out = {}
        for name, col in zip(t.column_names, t.columns):
            if name in lists:
                out[name] = col
                continue
            if pa.types.is_nested(col.type):
                raise ColumnError(f"{path}: column {name!r} is a {col.type} column; use a "
                                  f"delimited string (multi_hot)")
            v = col.to_numpy(zero_copy_only=False)
            out[name] = v if v.dtype.kind in "iufb" else v.astype(str)
        return out
    return read_csv(path, sep="\t" if path.name.endswith(".tsv") else sep, numeric=numeric)


def input_files(in_path: str | Path, spec: dict) -> list[tuple[Path, int | None]]:
    """(file, day or None) for every input file: the spec's ``files`` (day 0/1/2) or what
    ``in_path`` holds."""
    p = Path(in_path)
    if "files" in spec:
        base = p if p.is_dir() else p.parent
        return [(base / f, SPLITS.index(split)) for split in SPLITS
                for f in spec["files"].get(split, [])]
    if p.is_dir():
        files = sorted({f for pat in _TABLES for f in p.glob(pat)})
        if not files:
            raise ColumnError(f"{p}: no {', '.join(_TABLES)} files")
        return [(f, None) for f in files]
    return [(p, None)]


def convert(in_path: str | Path, out_dir: str | Path, spec: dict | str | Path,
            seed: int = 0) -> DatasetManifest:
    """Write the table(s) at ``in_path`` as a dataset in ``out_dir`` per ``spec`` (a dict or a
    JSON file)."""
    spec = load_spec(spec) if isinstance(spec, (str, Path)) else check_spec(spec)
    dense = {f["column"] for f in spec["dense"]}
    lists = tuple(c for _, s in streams(spec) if s["from"] == "lists"
                  for c in (s["column"], s["times"]))
    # Parquet list<float> columns stay Arrow
    lists += tuple(f["column"] for f in spec["embeddings"])
    only = set(referenced_columns(spec))
    frames = [(str(f), day, read_table(f, spec.get("sep", ","), dense.__contains__, lists, only))
              for f, day in input_files(in_path, spec)]
    base = Path(in_path) if Path(in_path).is_dir() else Path(in_path).parent
    return convert_frames(frames, spec, out_dir, seed, {"kind": "generic", "in": str(in_path)},
                          base=base)


def referenced_columns(spec: dict) -> list[str]:
    cols = [t["column"] for t in spec["tasks"]]
    cols += [f["column"] for f in spec["sparse"] + spec["dense"] + spec.get("embeddings", [])]
    cols += [spec[k] for k in ("user", "time") if k in spec]
    cols += [spec["domain"]["column"]] if "domain" in spec else []
    for _, seq in streams(spec):  # from events: those columns are the events table's
        cols += [seq[k] for k in _ROW_KEYS[seq["from"]] if k in seq]
        if seq["from"] == "rows":
            cols += [a["column"] for a in seq["attributes"] if isinstance(a, dict)]
    return list(dict.fromkeys(cols))


# the impression-table columns (other than sparse features) each kind of stream reads
_ROW_KEYS = {"rows": ("event",), "column": ("column",), "lists": ("column", "times"),
             "events": ()}


def convert_frames(frames: list[tuple[str, int | None, dict]], spec: dict, out_dir: str | Path,
                   seed: int = 0, source: dict | None = None,
                   base: Path | None = None) -> DatasetManifest:
    """``frames``: (file name for errors, day or None, columns). The spec must be checked already.
    ``base``: the directory the events files of streams from events are relative to."""
    c, raw, day = _parse(frames, spec, seed)
    train = day == TRAIN
    sparse: list[SparseFeature] = []
    encoders = {}
    for f in spec["sparse"]:
        enc = _encoder(f, raw[f["column"]], train)
        encoders[f["column"]] = enc
        if f.get("multi_hot"):
            c[f["name"]] = _multi_hot(raw[f["column"]], f["multi_hot"], enc)
        else:
            c[f["name"]] = enc(raw[f["column"]])
        sparse.append(SparseFeature(f["name"], enc.vocab_size, f["group"],
                                    multi_hot=bool(f.get("multi_hot"))))
    embeddings = []
    for f in spec.get("embeddings", []):
        c[f["name"]], dim = _vectors(frames, f)
        embeddings.append(EmbeddingFeature(f["name"], dim, f["group"]))
    names = _domains(spec, raw, frames)
    if "domain" in spec:
        vocab = Vocab(np.array(names))  # sorted; map its positions back to the order of ``names``
        c["domain"] = np.array([names.index(v) for v in vocab.values], dtype=np.int64)[
            vocab(raw[spec["domain"]["column"]])]
    info = {**(source or {}), "split": spec["split"], "files": [f for f, _, _ in frames]}
    seqs, write = _streams(spec, frames, c, raw, encoders, train, base or Path("."), info)
    schema = FeatureSchema(
        sparse=tuple(sparse),
        dense=tuple(DenseFeature(f["name"], f["group"], f.get("missing", "quarantine"))
                                          for f in spec["dense"]),
        sequences=seqs,
        tasks=tuple(Task(t["name"], t["name"], requires=t.get("requires")) for t in spec["tasks"]),
        domains=Domains(tuple(names)),
        meta={"source": (source or {}).get("kind", "generic"), "spec": canonical(spec)},
        embeddings=tuple(embeddings))
    if schema.dense_missing:  # the import report: missing values kept per feature
        info["missing"] = {schema.dense[i].name: int(np.isnan(c[schema.dense[i].name]).sum())
                           for i in schema.dense_missing}
    splits = {s: [d] for d, s in enumerate(SPLITS)}
    return write_dataset(out_dir, schema, c, day, splits=splits, source=info, **write)


def _vectors(frames, f: dict) -> tuple[tuple[np.ndarray, np.ndarray], int]:
    """((flat float32 values, lengths), dim) of embedding column ``f`` over every frame, in
    row order:
    Parquet list<number> columns as they are, strings split by ``f["sep"]``. Every row must hold
    ``dim`` finite numbers (``f["dim"]``, else the first row's count); anything else is
    a ColumnError."""
    import pyarrow as pa
    import pyarrow.compute as pc

    col, dim, flats, lens = f["column"], f.get("dim"), [], []
    for name, _, table in frames:
        where = f"{name} column {col!r}"
        v = table[col]
        if isinstance(v, (pa.ChunkedArray, pa.Array)) and pa.types.is_nested(v.type):
            t = v.type
            if not (
                pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
            ) or not (pa.types.is_floating(t.value_type) or pa.types.is_integer(t.value_type)):
                raise ColumnError(f"{where}: an embedding column must be a list of numbers, "
                                  f"got {t}")
            if v.null_count:
                row = int(np.flatnonzero(v.is_null().to_numpy(zero_copy_only=False))[0])
                raise ColumnError(f"{where}: row {row} is null")
            flat = pc.list_flatten(v)
            if flat.null_count:
                row = int(
                    pc.list_parent_indices(v).to_numpy()[
                        np.flatnonzero(flat.is_null().to_numpy(zero_copy_only=False))[0]
                    ]
                )
                raise ColumnError(f"{where}: row {row} holds a null value")
            n = pc.list_value_length(v).to_numpy(zero_copy_only=False).astype(np.int64)
            vals = np.asarray(flat.to_numpy(zero_copy_only=False), dtype=np.float64)
        else:
            if isinstance(v, (pa.ChunkedArray, pa.Array)):
                v = v.to_numpy(zero_copy_only=False)
            cells = np.asarray(v).astype(str)
            parts = [[x for x in str(cell).strip().split(f["sep"]) if x.strip()] for cell in cells]
            n = np.array([len(p) for p in parts], dtype=np.int64)
            try:
                vals = np.array([float(x) for p in parts for x in p], dtype=np.float64)
            except ValueError:
                bad = next((i, x) for i, p in enumerate(parts) for x in p if not _is_number(x))
                raise ColumnError(f"{where}: row {bad[0]}: {bad[1]!r} is not a number") from None
        if dim is None and len(n):
            dim = int(n[0])
        off = np.flatnonzero(n != dim)
        if len(off):
            raise ColumnError(f"{where}: row {int(off[0])} has {int(n[off[0]])} values, "
                              f"expected {dim} "
                              "(every vector of an embedding column has one length)")
        if not np.isfinite(vals).all():
            row = int(np.repeat(np.arange(len(n)), n)[np.flatnonzero(~np.isfinite(vals))[0]])
            raise ColumnError(f"{where}: row {row} holds NaN/inf")
        flats.append(vals.astype(np.float32))
        lens.append(n)
    if not dim:
        raise ColumnError(f"column {col!r}: an embedding needs at least one value per row")
    return (np.concatenate(flats), np.concatenate(lens)), dim


def _is_number(x: str) -> bool:
    try:
        float(x)
        return True
    except ValueError:
        return False


@dataclass
class _V2Stream:
    """One per-user stream on its way to the log: from events (``table``) or from lists
    (``storage`` and, if its lists are prefixes, the event columns ``log``)."""

    stream: SequenceStream
    events: int  # events to store: the bucket count follows the largest stream
    table: EventTable | None = None
    storage: Storage | None = None
    log: dict | None = None


def _streams(spec: dict, frames, c: dict, raw: dict, encoders: dict, train: np.ndarray,
             base: Path, info: dict) -> tuple[tuple[SequenceStream, ...], dict]:
    """Every stream of the spec (one code path per source kind, in spec order) and
    ``write_dataset``'s layout arguments. The spec allows no mix of per-row (v1) and per-user (v2)
    streams; v2 streams share one user bucketing (the impressions are bucketed once), so a list
    stream whose lists are not prefixes makes the whole dataset v1, or is an error beside an
    events stream. One stream's ``source.storage`` is that stream's; several streams' is
    {layout, buckets, streams: {name: storage}}."""
    todo = streams(spec)
    if not todo:
        return (), {}
    if todo[0][1]["from"] in ("rows", "column"):
        return tuple(_sequence(spec, key, s, c, raw, encoders, train) for key, s in todo), {}
    user_vocab = Vocab(raw[spec["user"]])
    train_ts = np.full(len(user_vocab), np.iinfo(np.int64).min)  # each user's last train request
    np.maximum.at(train_ts, c["user_id"][train], c["request_ts"][train])
    done: list[_V2Stream] = []
    for key, s in todo:
        if s["from"] == "events":
            table = EventTable(s, base, user_vocab, c["user_id"], c["request_ts"],
                               _TIME_UNITS[s["time_unit"]], key, train_ts)
            n = table.known()
            stream = table.stream(s["name"], s["max_len"], _item(spec, s, encoders, table.fit),
                                  _attributes(spec, s, key, encoders, table.fit))
            done.append(_V2Stream(stream, n, table=table))
        else:
            enc, matches = _item(spec, s, encoders, None)
            stream, storage, log_cols = list_histories(frames, s, c, enc, key, matches)
            done.append(_V2Stream(stream, len(log_cols["ts"]) if log_cols else 0,
                                  storage=storage, log=log_cols))
    seqs = [d.stream for d in done]
    per_row = [d for d in done if d.table is None and d.log is None]
    from_events = [d for d in done if d.table is not None]
    if per_row and from_events:
        d = per_row[0]
        raise ColumnError(f"stream {d.stream.name!r}: {d.storage.why}; a stream from events is "
                          f"stored per user (v2) and a dataset has one layout: give "
                          f"{d.stream.name!r} as an events table, or import it in a dataset of "
                          f"its own")
    if per_row:  # lists only, some not prefixes: every stream keeps its rows' own lists
        why = (f"stored per row: stream {per_row[0].stream.name!r}'s lists are not prefixes and "
               f"a dataset has one layout")
        _report(info, seqs, [d.storage if d.log is None else
                             Storage(LAYOUT_V1, why, 1, d.storage.counts) for d in done],
                LAYOUT_V1, 1)
        return tuple(seqs), {}
    wanted = next((s["buckets"] for _, s in todo if "buckets" in s), None)
    buckets = n_buckets(max(d.events for d in done), len(user_vocab), wanted)
    for d in done:
        if d.table is not None:
            d.table.partition(buckets)
        else:
            d.storage.buckets = buckets
    if not from_events:  # lists: reported before writing, as they always were
        _report(info, seqs, [d.storage for d in done], LAYOUT_V2, buckets)

    def events(writer) -> None:
        for d in done:
            if d.table is not None:
                d.table.write(writer, d.stream)
                d.storage = d.table.storage()
            else:
                for b, t in bucket_tables(d.log, buckets).items():
                    writer.write_events(d.stream.name, b, t)
        if from_events:  # the counts are made on the way
            _report(info, seqs, [d.storage for d in done], LAYOUT_V2, buckets)

    return tuple(seqs), {"layout": LAYOUT_V2, "buckets": buckets, "events": events}


def _report(info: dict, seqs: list[SequenceStream], stores: list[Storage], layout: int,
            buckets: int) -> None:
    for stream, storage in zip(seqs, stores):
        storage.report(stream.name)
    info["storage"] = stores[0].to_dict() if len(stores) == 1 else {
        "layout": layout, "buckets": buckets,
        "streams": {s.name: st.to_dict() for s, st in zip(seqs, stores)}}


def _item(spec: dict, s: dict, encoders: dict, fit) -> tuple:
    """(encoder, matched feature name or None) of a stream's items: a sparse feature's encoder
    (``matches``, or ``item`` naming a sparse column as before ``matches`` existed: no match
    declared, so old specs write the schema they wrote), else an id space of its own."""
    sparse = {f["column"]: f for f in spec["sparse"]}
    single = s["item"] if s["item"] in sparse and not sparse[s["item"]].get("multi_hot") else None
    how, x = id_space(s, sparse, single)
    if how == "own":
        return _own(x, s["item"], lambda: fit("item", s["item"])), None
    return encoders[x["column"]], x["name"] if how == "matches" else None


def _attributes(spec: dict, s: dict, key: str, encoders: dict, fit) -> list[tuple]:
    """(EventAttribute, encoder) per attribute of stream ``s``. An attribute of its own id space
    named like a sparse feature of the same size would be matched with it by the model's legacy
    name rule by accident: an error."""
    sparse = {f["column"]: f for f in spec["sparse"]}
    out = []
    for i, a in enumerate(s["attributes"]):
        if isinstance(a, str):  # a sparse column: its encoder, the legacy name rule
            out.append((EventAttribute(spec_name(spec, a), encoders[a].vocab_size), encoders[a]))
            continue
        how, x = id_space(a, sparse, None)
        if how == "matches":
            enc = encoders[x["column"]]
            out.append((EventAttribute(a["name"], enc.vocab_size, matches=x["name"]), enc))
            continue
        enc = _own(x, a["column"], lambda i=i, a=a: fit(f"a{i}", a["column"]))
        same = [f for f in spec["sparse"] if f["name"] == a["name"] and not f.get("multi_hot")
                and encoders[f["column"]].vocab_size == enc.vocab_size]
        if same:
            raise SpecError(f"{key}.attributes[{i}] {a['name']!r} (column {a['column']!r}): an "
                            f"id space of its own, but named like the sparse feature "
                            f"{a['name']!r} of the same vocab_size {enc.vocab_size}, so the "
                            f"model would compare it with the candidate's {a['name']!r}: rename "
                            f"it, or declare \"matches\": {same[0]['column']!r} if it is that "
                            f"feature's id space")
        out.append((EventAttribute(a["name"], enc.vocab_size), enc))
    return out


def _own(x: dict, column: str, fit):
    """An id space of a stream's own: hashed, ids as given, or ``fit()``'s vocabulary."""
    if "hash_size" in x:
        return _Hash(x["hash_size"], column)
    if "vocab_size" in x:
        return _Raw(x["vocab_size"], f"column {column!r}")
    return fit()


def _parse(frames, spec: dict, seed: int) -> tuple[dict, dict, np.ndarray]:
    """Typed output columns (labels, dense, time, user) + the raw string columns + the day
    per row."""
    cols = referenced_columns(spec)
    raw_cols = [f["column"] for f in spec["sparse"]] + [spec[k] for k in ("user",) if k in spec]
    raw_cols += [spec["domain"]["column"]] if "domain" in spec else []
    for _, seq in streams(spec):
        if seq["from"] in ("rows", "column"):
            raw_cols += [seq[k] for k in _ROW_KEYS[seq["from"]] if k in seq]
        if seq["from"] == "rows":
            raw_cols += [a["column"] for a in seq["attributes"] if isinstance(a, dict)]
    raw_cols = list(dict.fromkeys(raw_cols))
    parts: dict[str, list] = {}
    for name, _, table in frames:
        need(table, cols, name)
        n = len(next(iter(table.values()))) if table else 0
        for t in spec["tasks"]:
            where = f"{name} column {t['column']!r}"
            parts.setdefault(t["name"],
                             []).append(to_label(table[t["column"]], where, t.get("positive_at")))
        for f in spec["dense"]:
            v = to_float(table[f["column"]], f"{name} column {f['column']!r}", f.get("fill"),
                         keep_missing=f.get("missing") == "indicator")
            v = np.log1p(np.maximum(v, 0)) if f["transform"] == "log1p" else v
            parts.setdefault(f["name"], []).append(v.astype(np.float32))
        if "time" in spec:
            ts = parse_time(table[spec["time"]], f"{name} column {spec['time']!r}",
                            time_divisor(spec))
            parts.setdefault("request_ts", []).append(ts)
        for col in raw_cols:
            parts.setdefault(("raw", col), []).append(np.asarray(table[col]).astype(str))
        parts.setdefault("_n", []).append(n)
    c = {k: np.concatenate(v) for k, v in parts.items() if isinstance(k, str) and k != "_n"}
    raw = {k[1]: np.concatenate(v) for k, v in parts.items() if isinstance(k, tuple)}
    n = int(sum(parts["_n"]))
    c.setdefault("request_ts", np.arange(n, dtype=np.int64))
    user = raw[spec["user"]] if "user" in spec else np.arange(n).astype(str)
    c["user_id"] = Vocab(user)(user)
    c["domain"] = np.zeros(n, dtype=np.int64)
    by = spec["split"]
    if by["by"] == "files":
        day = np.concatenate([np.full(k, d, dtype=np.int32) for (_, d, _),
                              k in zip(frames, parts["_n"])])
    elif by["by"] == "time":
        day = split_by_time(c["request_ts"], by["valid"], by["test"])
    elif by["by"] == "user_time":
        day = split_per_user(user, c["request_ts"], by["valid"], by["test"])
    else:
        day = random_split(n, by["valid"], by["test"], seed)
    return c, raw, day


class _Raw:
    """Values that already are ids (``vocab_size``); anything not an integer in range → OOV."""

    def __init__(self, size: int, where: str):
        self.vocab_size, self.where = size, where

    def __call__(self, values: np.ndarray) -> np.ndarray:
        v = to_float(values, self.where, fill=-1.0)
        return np.where((v >= 0) & (v < self.vocab_size) & (v == np.floor(v)), v,
                        self.vocab_size).astype(np.int64)


class _Hash:
    def __init__(self, size: int, salt: str):
        self.vocab_size, self.salt = size, salt

    def __call__(self, values: np.ndarray) -> np.ndarray:
        return hash_ids(values, self.vocab_size, self.salt)


def _encoder(f: dict, values: np.ndarray, train: np.ndarray):
    if "hash_size" in f:
        return _Hash(f["hash_size"], f["column"])
    if "vocab_size" in f:
        return _Raw(f["vocab_size"], f"column {f['column']!r}")
    if f.get("multi_hot"):
        tokens = [t for s in values[train] for t in s.split(f["multi_hot"]) if t != ""]
        return Vocab(np.array(tokens, dtype=str))
    return Vocab(values[train])


def _multi_hot(values: np.ndarray, sep: str, enc) -> tuple[np.ndarray, np.ndarray]:
    tokens = [[t for t in s.split(sep) if t != ""] for s in values]
    lens = np.array([len(t) for t in tokens], dtype=np.int64)
    flat = np.array([t for row in tokens for t in row], dtype=str)
    return enc(flat) if len(flat) else np.zeros(0, dtype=np.int64), lens


def _domains(spec: dict, raw: dict, frames) -> list[str]:
    if "domain" not in spec:
        return [DEFAULT_DOMAIN]
    d = spec["domain"]
    values = raw[d["column"]]
    names = [str(x) for x in d["names"]] if "names" in d else [str(x) for x in np.unique(values)]
    if "all" in names:  # the evaluation reports every domain pooled under this name
        raise ColumnError(f"domain column {d['column']!r}: the value 'all' is reserved (the "
                          f"pooled slice); "
                          "rename it in the data or in domain.names")
    if "names" not in d:
        return names
    bad = ~np.isin(values, names)
    if bad.any():
        raise ColumnError(f"domain column {d['column']!r}: value {str(values[bad][0])!r} is not in "
                          f"domain.names {names} (files {[f for f, _, _ in frames]})")
    return names


def _sequence(spec: dict, key: str, s: dict, c: dict, raw: dict, encoders: dict,
              train: np.ndarray) -> SequenceStream:
    """A per-row (v1) stream: ``from: column`` (each row's own list) or ``from: rows`` (the
    user's earlier rows; a vocabulary of its own is fitted on the train rows' events)."""
    name, (item_enc, matches) = s["name"], _item(spec, s, encoders, None)
    if s["from"] == "column":
        items, lens = _multi_hot(raw[s["column"]], s["sep"], item_enc)
        row = np.repeat(np.arange(len(lens)), lens)
        # 1 for each row's newest event
        k = np.repeat(np.cumsum(lens), lens) - np.arange(len(items))
        c[f"{name}.item"], c[f"{name}.event"] = (items,
                                                 lens), (np.zeros(len(items), dtype=np.int64), lens)
        c[f"{name}.ts"] = (c["request_ts"][row] - k, lens)
        return SequenceStream(name, item_enc.vocab_size, 1, s["max_len"], matches=matches)
    user = raw[spec["user"]]
    ev = np.ones(len(user), dtype=bool) if "only" not in s else c[s["only"]] == 1
    event_vocab = Vocab(raw[s["event"]][train]) if "event" in s else None
    cols = {"item": item_enc(raw[s["item"]])[ev],
            "event": (event_vocab(raw[s["event"]]) if event_vocab
                      else np.zeros(len(user), dtype=np.int64))[ev]}
    attrs = _attributes(spec, s, key, encoders,
                        lambda _, col: Vocab(raw[col][train & ev]))
    for a, (attr, enc) in zip(s["attributes"], attrs):
        cols[attr.name] = enc(raw[a if isinstance(a, str) else a["column"]])[ev]
    hist = history(user[ev], c["request_ts"][ev], cols, user, c["request_ts"], s["max_len"])
    for part, v in hist.items():
        c[f"{name}.{part}"] = v
    n_events = event_vocab.vocab_size if event_vocab else 1
    return SequenceStream(name, item_enc.vocab_size, n_events, s["max_len"],
                          tuple(a for a, _ in attrs), matches=matches)


def spec_name(spec: dict, column: str) -> str:
    return next(f["name"] for f in spec["sparse"] if f["column"] == column)
