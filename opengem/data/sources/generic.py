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

from pathlib import Path

import numpy as np

from opengem.data.parquet import LAYOUT_V2, DatasetManifest
from opengem.data.sources.common import (
    SPLITS,
    TRAIN,
    ColumnError,
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
from opengem.data.sources.event_log import EventTable, list_histories
from opengem.data.sources.spec import _TIME_UNITS, check_spec, load_spec, time_divisor
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
    seq = spec.get("sequence", {})
    lists = (seq["column"], seq["times"]) if seq.get("from") == "lists" else ()
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
    seq = spec.get("sequence", {})
    keys = {"rows": ("event",), "column": ("column",),
            "lists": ("column", "times")}.get(seq.get("from"), ())
    cols += [seq[k] for k in keys if k in seq]  # from events: those columns are the events table's
    return list(dict.fromkeys(cols))


def convert_frames(frames: list[tuple[str, int | None, dict]], spec: dict, out_dir: str | Path,
                   seed: int = 0, source: dict | None = None,
                   base: Path | None = None) -> DatasetManifest:
    """``frames``: (file name for errors, day or None, columns). The spec must be checked already.
    ``base``: the directory the events files of ``sequence.from: events`` are relative to."""
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
    kind = spec.get("sequence", {}).get("from")
    write: dict = {}
    if kind == "events":
        stream, write = _event_table(spec, c, raw, encoders, base or Path("."), info)
        seqs = (stream,)
    elif kind == "lists":
        stream, storage, tables = list_histories(frames, spec, c,
                                                 encoders[spec["sequence"]["item"]])
        storage.report(stream.name)
        info["storage"] = storage.to_dict()
        seqs = (stream,)
        if tables is not None:
            write = {"layout": LAYOUT_V2, "buckets": storage.buckets,
                     "events": lambda w: [w.write_events(stream.name, b, t) for b,
                                          t in tables.items()]}
    else:
        seqs = (_sequence(spec, c, raw, encoders, train),) if "sequence" in spec else ()
    schema = FeatureSchema(
        sparse=tuple(sparse),
        dense=tuple(DenseFeature(f["name"], f["group"], f.get("missing", "quarantine"))
                                          for f in spec["dense"]),
        sequences=seqs,
        tasks=tuple(Task(t["name"], t["name"], requires=t.get("requires")) for t in spec["tasks"]),
        domains=Domains(tuple(names)),
        meta={"source": (source or {}).get("kind", "generic"), "spec": spec},
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


def _event_table(spec: dict, c: dict, raw: dict, encoders: dict, base: Path,
                 info: dict) -> tuple[SequenceStream, dict]:
    """The stream of an events table and ``write_dataset``'s v2 arguments; ``info["storage"]`` is
    filled in once the logs are written (the counts are made on the way)."""
    s = spec["sequence"]
    user_raw = raw[spec["user"]]
    table = EventTable(spec, base, Vocab(user_raw), c["user_id"], c["request_ts"], encoders,
                       [spec_name(spec, a) for a in s["attributes"]], _TIME_UNITS[s["time_unit"]])
    buckets = table.partition()
    stream = table.stream(s["name"], s["max_len"])

    def events(writer) -> None:
        table.write(writer, stream)
        storage = table.storage()
        storage.report(stream.name)
        info["storage"] = storage.to_dict()

    return stream, {"layout": LAYOUT_V2, "buckets": buckets, "events": events}


def _parse(frames, spec: dict, seed: int) -> tuple[dict, dict, np.ndarray]:
    """Typed output columns (labels, dense, time, user) + the raw string columns + the day
    per row."""
    cols = referenced_columns(spec)
    seq = spec.get("sequence", {})
    raw_cols = [f["column"] for f in spec["sparse"]] + [spec[k] for k in ("user",) if k in spec]
    raw_cols += [spec["domain"]["column"]] if "domain" in spec else []
    seq_raw = {"rows": ("event",), "column": ("column",)}.get(seq.get("from"), ())
    raw_cols = list(dict.fromkeys(raw_cols + [seq[k] for k in seq_raw if k in seq]))
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


def _sequence(spec: dict, c: dict, raw: dict, encoders: dict, train: np.ndarray) -> SequenceStream:
    s = spec["sequence"]
    name, item_enc = s["name"], encoders[s["item"]]
    if s["from"] == "column":
        items, lens = _multi_hot(raw[s["column"]], s["sep"], item_enc)
        row = np.repeat(np.arange(len(lens)), lens)
        # 1 for each row's newest event
        k = np.repeat(np.cumsum(lens), lens) - np.arange(len(items))
        c[f"{name}.item"], c[f"{name}.event"] = (items,
                                                 lens), (np.zeros(len(items), dtype=np.int64), lens)
        c[f"{name}.ts"] = (c["request_ts"][row] - k, lens)
        return SequenceStream(name, item_enc.vocab_size, 1, s["max_len"])
    user = raw[spec["user"]]
    ev = np.ones(len(user), dtype=bool) if "only" not in s else c[s["only"]] == 1
    event_vocab = Vocab(raw[s["event"]][train]) if "event" in s else None
    cols = {"item": item_enc(raw[s["item"]])[ev],
            "event": (event_vocab(raw[s["event"]]) if event_vocab
                      else np.zeros(len(user), dtype=np.int64))[ev]}
    attrs = tuple(EventAttribute(spec_name(spec, a), encoders[a].vocab_size)
                  for a in s["attributes"])
    for a, attr in zip(s["attributes"], attrs):
        cols[attr.name] = encoders[a](raw[a])[ev]
    hist = history(user[ev], c["request_ts"][ev], cols, user, c["request_ts"], s["max_len"])
    for part, v in hist.items():
        c[f"{name}.{part}"] = v
    n_events = event_vocab.vocab_size if event_vocab else 1
    return SequenceStream(name, item_enc.vocab_size, n_events, s["max_len"], attrs)


def spec_name(spec: dict, column: str) -> str:
    return next(f["name"] for f in spec["sparse"] if f["column"] == column)
