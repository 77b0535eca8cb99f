"""Any CSV/Parquet table + a JSON spec (see ``opengem.data.sources.spec``) → our layout, no code.

``--in`` is one table file, or a directory: with the spec's ``files`` the names are relative to it,
without them every ``*.csv``, ``*.csv.gz``, ``*.tsv`` and ``*.parquet`` in it is read, in name
order. Rows keep their input order as the tie-break of equal times; with no ``time`` column the row
number (across files, in order) is the time, so "earlier" means "above".

The stages, top to bottom in ``convert_frames``: check the spec → scan the impressions into a
DuckDB workspace in chunks and split them (``impressions``) → fit the vocabularies on the train
rows → each stream's events (``event_log``) → encode the rows chunk by chunk in output order and
write the shards, then the event logs (``common.write_shards``). No stage holds the impressions
whole, except for what still needs whole columns: streams from rows or lists, embedding vectors
and the ``random`` split's permutation (logged; a warning from ``impressions.WHOLE_WARN_ROWS``
rows).

Errors: a bad spec is a ``SpecError`` (file and key); a missing column, a cell that is not a number
where one is needed (a per-event value's included), a label outside {0, 1}, a domain value not in
``domain.names`` or an embedding vector of another length is a ``ColumnError`` (file, column and
value or row); both are ``ValueError``s. A missing per-event value (empty, NaN, ±inf) is not an
error by default: its event is dropped, counted (``spec``'s "Values").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from opengem.data.parquet import LAYOUT_V1, LAYOUT_V2, DatasetManifest
from opengem.data.pseudonym import FILE as PSEUDONYMS
from opengem.data.pseudonym import key_check, load_key, pseudonymise, write_pseudonyms
from opengem.data.sources.common import (
    SPLITS,
    ColumnError,
    SpecError,
    Vocab,
    hash_ids,
    history,
    take_rows,
    to_float,
    write_shards,
)
from opengem.data.sources.event_log import (
    EventTable,
    Storage,
    bucket_tables,
    event_values,
    list_histories,
    n_buckets,
)
from opengem.data.sources.impressions import (
    CHUNK_ROWS,
    Impressions,
    Source,
    Users,
    Workspace,
    held_whole,
)
from opengem.data.sources.spec import (
    _TIME_UNITS,
    FLOAT32_MAX,
    canonical,
    check_spec,
    id_space,
    load_spec,
    streams,
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


def convert(in_path: str | Path, out_dir: str | Path, spec: dict | str | Path,
            seed: int = 0, chunk_rows: int = CHUNK_ROWS,
            key_file: str | Path | None = None) -> DatasetManifest:
    """Write the table(s) at ``in_path`` as a dataset in ``out_dir`` per ``spec`` (a dict or a
    JSON file), ``chunk_rows`` impressions at a time. ``key_file``: the pseudonym key of a spec
    that pseudonymises (else ``$OPENGEM_PSEUDONYM_KEY``; ``opengem.data.pseudonym``)."""
    spec = load_spec(spec) if isinstance(spec, (str, Path)) else check_spec(spec)
    if key_file is not None and "pseudonymise" not in spec:
        raise SpecError("a pseudonym key was given but the spec does not pseudonymise: add "
                        "\"pseudonymise\": {\"hash\": \"hmac-sha256\"} (or leave the key out)")
    sources = [Source(str(f), day, path=f, sep=spec.get("sep", ","))
               for f, day in input_files(in_path, spec)]
    base = Path(in_path) if Path(in_path).is_dir() else Path(in_path).parent
    key = load_key(key_file) if "pseudonymise" in spec else None
    return _import(sources, spec, out_dir, seed, {"kind": "generic", "in": str(in_path)}, base,
                   chunk_rows, key)


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


def convert_frames(frames: list[tuple[str, int | None, dict]], spec: dict, out_dir: str | Path,
                   seed: int = 0, source: dict | None = None, base: Path | None = None,
                   chunk_rows: int = CHUNK_ROWS) -> DatasetManifest:
    """``frames``: (file name for errors, day or None, columns) held in memory (the built-in CTR
    sets). The spec must be checked already. ``base``: the directory the events files of streams
    from events are relative to."""
    return _import([Source(name, day, frame=t) for name, day, t in frames], spec, out_dir, seed,
                   source, base, chunk_rows)


def referenced_columns(spec: dict) -> list[str]:
    cols = [t["column"] for t in spec["tasks"]]
    cols += [f["column"] for f in spec["sparse"] + spec["dense"] + spec.get("embeddings", [])]
    cols += [spec[k] for k in ("user", "time") if k in spec]
    cols += [spec["domain"]["column"]] if "domain" in spec else []
    for _, seq in streams(spec):  # from events: those columns are the events table's
        cols += [seq[k] for k in _ROW_KEYS[seq["from"]] if k in seq]
        if seq["from"] == "rows":
            cols += [a["column"] for a in seq["attributes"] if isinstance(a, dict)]
            cols += [v["column"] for v in seq.get("values", [])]
    return list(dict.fromkeys(cols))


# the impression-table columns (other than sparse features) each kind of stream reads
_ROW_KEYS = {"rows": ("event",), "column": ("column",), "lists": ("column", "times"),
             "events": ()}


def _import(sources: list[Source], spec: dict, out_dir: str | Path, seed: int,
            source: dict | None, base: Path | None, chunk_rows: int,
            key: bytes | None = None) -> DatasetManifest:
    """The stages of the module docstring, in order, in one DuckDB workspace."""
    dense = {f["column"] for f in spec["dense"]}
    with Workspace() as ws:
        # scan the impressions (hashed and given ids encoded on the way) and split them
        imp = Impressions(ws, sources, spec, referenced_columns(spec), _stateless(spec),
                          _string_columns(spec), dense.__contains__, chunk_rows)
        method = spec.get("pseudonymise", {}).get("hash")
        users = imp.split(spec["split"], seed,
                          None if key is None else lambda raw: pseudonymise(raw, key, method))
        # fit the vocabularies on the train rows; embeddings and domains
        encoders = [_encoder(f, imp) for f in spec["sparse"]]
        by_column = {f["column"]: enc for f, enc in zip(spec["sparse"], encoders)}
        sparse = [SparseFeature(f["name"], enc.vocab_size, f["group"],
                                multi_hot=bool(f.get("multi_hot")))
                  for f, enc in zip(spec["sparse"], encoders)]
        side, embeddings = {}, []  # side: list columns held whole, in row order
        for f in spec.get("embeddings", []):
            frames = _whole(sources, [f["column"]], spec, imp.n, f"embedding {f['name']!r}",
                            lists=(f["column"],))
            side[f["name"]], dim = _vectors(frames, f)
            embeddings.append(EmbeddingFeature(f["name"], dim, f["group"]))
        names = _domains(spec, imp)
        info = {**(source or {}), "split": spec["split"], "files": imp.files}
        if users.pseudonyms is not None:  # the key's check value, never the key
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            write_pseudonyms(Path(out_dir) / PSEUDONYMS, users.pseudonyms)
            info["pseudonym"] = {"hash": method, "key_check": key_check(key, method),
                                 "file": PSEUDONYMS, "users": int(users.count)}
        # each stream's events, then the schema
        seqs, stream_cols, per_chunk, write = _streams(spec, sources, imp, users, ws, by_column,
                                                       base or Path("."), info)
        side |= stream_cols
        schema = FeatureSchema(
            sparse=tuple(sparse),
            dense=tuple(DenseFeature(f["name"], f["group"], f.get("missing", "quarantine"))
                        for f in spec["dense"]),
            sequences=seqs,
            tasks=tuple(Task(t["name"], t["name"], requires=t.get("requires"))
                        for t in spec["tasks"]),
            domains=Domains(tuple(names)),
            meta={"source": (source or {}).get("kind", "generic"), "spec": canonical(spec)},
            embeddings=tuple(embeddings))
        if schema.dense_missing:  # the import report: missing values kept per feature
            info["missing"] = {schema.dense[i].name: imp.missing[schema.dense[i].name]
                               for i in schema.dense_missing}
        # encode the rows chunk by chunk in output order; write the shards, then the event logs
        domain = _domain_ids(spec, names)
        offsets = {k: np.r_[0, np.cumsum(v[1])] for k, v in side.items()}
        chunks = ((d, b, _encode(spec, chunk, encoders, domain, side, offsets, per_chunk))
                  for d, b, chunk in imp.ordered(write.get("buckets", 1)))
        splits = {s: [d] for d, s in enumerate(SPLITS)}
        return write_shards(out_dir, schema, chunks, splits=splits, source=info,
                            layout=write.get("layout", LAYOUT_V1), events=write.get("events"))


def _stateless(spec: dict) -> dict[str, tuple[str, object]]:
    """The single-valued sparse features whose ids need no fitting (hashed, or ids already),
    encoded while scanning: feature index → (column, encoder)."""
    return {str(i): (f["column"], _encoder(f, None)) for i, f in enumerate(spec["sparse"])
            if not f.get("multi_hot") and ("hash_size" in f or "vocab_size" in f)}


def _string_columns(spec: dict) -> list[str]:
    """The impression columns staged as raw strings: sparse features fitted after the split or
    multi-hot, the domain, and what streams from rows/column read per row."""
    fitted = _stateless(spec)
    cols = [f["column"] for i, f in enumerate(spec["sparse"]) if str(i) not in fitted]
    cols += [spec["domain"]["column"]] if "domain" in spec else []
    for _, seq in streams(spec):
        if seq["from"] in ("rows", "column"):
            cols += [seq[k] for k in _ROW_KEYS[seq["from"]] if k in seq]
        if seq["from"] == "rows":
            cols += [spec["user"], seq["item"]]
            cols += [a if isinstance(a, str) else a["column"] for a in seq["attributes"]]
            cols += [v["column"] for v in seq.get("values", [])]
    return list(dict.fromkeys(cols))


def _encoder(f: dict, imp: Impressions | None):
    """A sparse feature's ids: hashed, as given, or a vocabulary of its train values (``imp``'s
    distinct values; multi-hot: of their tokens)."""
    if "hash_size" in f:
        return _Hash(f["hash_size"], f["column"])
    if "vocab_size" in f:
        return _Raw(f["vocab_size"], f"column {f['column']!r}")
    if f.get("multi_hot"):
        tokens = {t for part in imp.distinct(f["column"]) for s in part
                  for t in s.split(f["multi_hot"]) if t != ""}
        return Vocab(np.array(sorted(tokens), dtype=str))
    parts = list(imp.distinct(f["column"]))
    return Vocab(np.concatenate(parts) if parts else np.zeros(0, dtype=str))


def _whole(sources: list[Source], cols: list[str], spec: dict, n: int, what: str,
           lists: tuple[str, ...] = ()) -> list[tuple[str, int | None, dict]]:
    """``cols`` of every input table whole, as (name, day, columns) frames (read again)."""
    held_whole(what, n)
    dense = {f["column"] for f in spec["dense"]}
    return [(s.name, s.day, s.whole(cols, dense.__contains__, lists)) for s in sources]


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


def _domains(spec: dict, imp: Impressions) -> list[str]:
    """The domain names: ``domain.names`` (every value must be one) or the sorted values seen."""
    if "domain" not in spec:
        return [DEFAULT_DOMAIN]
    d = spec["domain"]
    if "names" in d:
        names = [str(x) for x in d["names"]]
    else:
        parts = list(imp.distinct(d["column"], train=False))
        names = [str(x) for x in np.unique(np.concatenate(parts) if parts
                                           else np.zeros(0, dtype=str))]
    if "all" in names:  # the evaluation reports every domain pooled under this name
        raise ColumnError(f"domain column {d['column']!r}: the value 'all' is reserved (the "
                          f"pooled slice); "
                          "rename it in the data or in domain.names")
    if "names" not in d:
        return names
    bad = imp.first_not_in(d["column"], names)
    if bad is not None:
        raise ColumnError(f"domain column {d['column']!r}: value {bad!r} is not in "
                          f"domain.names {names} (files {imp.files})")
    return names


@dataclass
class _V2Stream:
    """One per-user stream on its way to the log: from events (``table``) or from lists
    (``storage`` and, if its lists are prefixes, the event columns ``log``)."""

    stream: SequenceStream
    events: int  # events to store: the bucket count follows the largest stream
    table: EventTable | None = None
    storage: Storage | None = None
    log: dict | None = None


def _streams(spec: dict, sources: list[Source], imp: Impressions, users: Users, ws: Workspace,
             encoders: dict, base: Path, info: dict
             ) -> tuple[tuple[SequenceStream, ...], dict, list[Callable], dict]:
    """Every stream of the spec (one code path per source kind, in spec order), the list columns of
    streams stored per row: held whole, in row order (from rows; from lists when not prefixes) or
    made chunk by chunk (from column: functions of a chunk), and ``write_shards``'s layout
    arguments. The spec allows no mix of per-row (v1) and per-user (v2) streams; v2 streams
    share one user bucketing (the impressions are bucketed once), so a list stream whose lists are
    not prefixes makes the whole dataset v1, or is an error beside an events stream. One stream's
    ``source.storage`` is that stream's; several streams' is {layout, buckets, streams: {name:
    storage}}."""
    todo = streams(spec)
    if not todo:
        return (), {}, [], {}
    if todo[0][1]["from"] in ("rows", "column"):
        whole = any(s["from"] == "rows" for _, s in todo)
        c, raw, train = _row_columns(imp, "a stream from rows") if whole else ({}, {}, None)
        seqs, per_chunk = [], []
        for key, s in todo:
            if s["from"] == "column":
                stream, lists = _column_stream(spec, s, encoders)
                per_chunk.append(lists)
            else:
                stream = _rows_history(spec, key, s, c, raw, encoders, train, imp, info)
            seqs.append(stream)
        return tuple(seqs), {k: v for k, v in c.items() if isinstance(v, tuple)}, per_chunk, {}
    done: list[_V2Stream] = []
    lists: dict = {}
    for i, (key, s) in enumerate(todo):
        if s["from"] == "events":
            table = EventTable(s, base, ws, users, _TIME_UNITS[s["time_unit"]], key, f"ev{i}")
            n = table.known()
            stream = table.stream(s["name"], s["max_len"], _item(spec, s, encoders, table.fit),
                                  _attributes(spec, s, key, encoders, table.fit))
            done.append(_V2Stream(stream, n, table=table))
        else:
            enc, matches = _item(spec, s, encoders, None)
            if not lists:
                lists |= _row_columns(imp, "streams from lists")[0]
            frames = _whole(sources, [s["column"], s["times"]], spec, imp.n,
                            f"stream {s['name']!r} from lists", lists=(s["column"], s["times"]))
            stream, storage, log_cols = list_histories(frames, s, lists, enc, key, matches)
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
        return tuple(seqs), {k: v for k, v in lists.items() if isinstance(v, tuple)}, [], {}
    wanted = next((s["buckets"] for _, s in todo if "buckets" in s), None)
    buckets = n_buckets(max(d.events for d in done), users.count, wanted)
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

    return tuple(seqs), {}, [], {"layout": LAYOUT_V2, "buckets": buckets, "events": events}


def _row_columns(imp: Impressions, why: str) -> tuple[dict, dict, np.ndarray]:
    """The impressions whole, in row order, as the per-row streams read them: typed columns by
    output name, raw strings by input column, and the train mask."""
    w = imp.whole(why)
    c = {k: v for k, v in w.items() if isinstance(k, str) and k not in ("day", "rn")}
    raw = {k[1]: v for k, v in w.items() if isinstance(k, tuple) and k[0] == "raw"}
    return c, raw, w["day"] == 0


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


def _column_stream(spec: dict, s: dict, encoders: dict) -> tuple[SequenceStream, Callable]:
    """A ``from: column`` stream (each row's own list): its schema entry and the encoding of a
    chunk's lists, row by row, so that it is read in chunks like a feature. The times are unknown:
    the request time − k seconds, k = 1 for a row's newest event."""
    name, (item_enc, matches) = s["name"], _item(spec, s, encoders, None)

    def lists(chunk: dict) -> dict:
        items, lens = _multi_hot(chunk[("raw", s["column"])], s["sep"], item_enc)
        k = np.repeat(np.cumsum(lens), lens) - np.arange(len(items))
        return {f"{name}.item": (items, lens),
                f"{name}.event": (np.zeros(len(items), dtype=np.int64), lens),
                f"{name}.ts": (np.repeat(chunk["request_ts"], lens) - k, lens)}

    return SequenceStream(name, item_enc.vocab_size, 1, s["max_len"], matches=matches), lists


def _rows_history(spec: dict, key: str, s: dict, c: dict, raw: dict, encoders: dict,
                  train: np.ndarray, imp: Impressions, info: dict) -> SequenceStream:
    """A ``from: rows`` stream (the user's earlier rows; a vocabulary of its own is fitted on the
    train rows' events) over the impressions whole: its lists go into ``c``. A row whose value is
    missing is dropped as an event (``missing: drop``; it stays an impression), counted in
    ``source.values``."""
    name, (item_enc, matches) = s["name"], _item(spec, s, encoders, None)
    user = raw[spec["user"]]
    ev = np.ones(len(user), dtype=bool) if "only" not in s else c[s["only"]] == 1
    nums = _row_values(s, raw, ev, imp, key, info)  # may drop events from ``ev``
    event_vocab = Vocab(raw[s["event"]][train]) if "event" in s else None
    cols = {"item": item_enc(raw[s["item"]])[ev],
            "event": (event_vocab(raw[s["event"]]) if event_vocab
                      else np.zeros(len(user), dtype=np.int64))[ev]}
    attrs = _attributes(spec, s, key, encoders,
                        lambda _, col: Vocab(raw[col][train & ev]))
    for a, (attr, enc) in zip(s["attributes"], attrs):
        cols[attr.name] = enc(raw[a if isinstance(a, str) else a["column"]])[ev]
    cols |= {v: x[ev] for v, x in nums.items()}
    hist = history(user[ev], c["request_ts"][ev], cols, user, c["request_ts"], s["max_len"])
    for part, v in hist.items():
        c[f"{name}.{part}"] = v
    n_events = event_vocab.vocab_size if event_vocab else 1
    return SequenceStream(name, item_enc.vocab_size, n_events, s["max_len"],
                          tuple(a for a, _ in attrs), matches=matches, values=tuple(nums))


def _row_values(s: dict, raw: dict, ev: np.ndarray, imp: Impressions, key: str,
                info: dict) -> dict[str, np.ndarray]:
    """The values of a ``from: rows`` stream per row, as stored (float32), by name. Missing ones
    (empty, NaN, ±inf, beyond float32) among the event rows ``ev`` are counted per value, and
    per value's ``missing``: ``drop`` clears the row from ``ev`` (in place), ``fill`` fills,
    ``error`` raises; a cell that is no number is a ``ColumnError`` naming file, row and value."""
    if not s.get("values"):
        return {}
    counts, out, drop = {}, {}, np.zeros(len(ev), dtype=bool)
    for v in s["values"]:
        cells = np.char.strip(np.asarray(raw[v["column"]]).astype(str))
        # a null of a Parquet text column is staged as the string "None"
        empty = (np.char.str_len(cells) == 0) | (cells == "None")
        try:
            x = np.where(empty, "nan", cells).astype(np.float64)
        except ValueError:
            rn = next(i for i in np.flatnonzero(~empty) if not _is_number(cells[i]))
            file, row = imp.locate(rn)
            raise ColumnError(f"{file}: column {v['column']!r}: {str(cells[rn])!r} (row {row}) "
                              f"is not a number; a per-event value column holds numbers") from None
        with np.errstate(invalid="ignore"):
            bad = ev & ~(np.abs(x) <= FLOAT32_MAX)  # NaN compares False
        if v["missing"] == "error" and bad.any():
            file, row = imp.locate(int(np.flatnonzero(bad)[0]))
            raise ColumnError(f"{file}: column {v['column']!r}: {int(bad.sum())} event rows have "
                              f"a missing value (empty, NaN, ±inf or beyond float32; the first: "
                              f"row {row}); set {key}.values "
                              f"{v['name']!r}'s missing to drop or fill to keep importing")
        counts[f"{v['name']}_missing_or_non_finite"] = int(bad.sum())
        if v["missing"] == "drop":
            drop |= bad
        out[v["name"]] = event_values(x, v)
    if any(v["missing"] == "drop" for v in s["values"]):
        counts["events_with_missing_or_non_finite_values_dropped"] = int(drop.sum())
    ev &= ~drop
    info.setdefault("values", {})[s["name"]] = counts
    return out


def _encode(spec: dict, chunk: dict, encoders: list, domain, side: dict, offsets: dict,
            per_chunk: list[Callable]) -> dict:
    """One chunk of rows in output order (``Impressions.ordered``) as the shard writer's columns:
    ids of the fitted vocabularies, multi-hot lists, the domain, the lists of streams from a
    column (``per_chunk``), and the rows' share of the list columns held whole (``side``, in row
    order; ``offsets`` their row starts)."""
    c = {k: chunk[k] for k in ["user_id", "request_ts"] + [t["name"] for t in spec["tasks"]]
         + [f["name"] for f in spec["dense"]]}
    for i, (f, enc) in enumerate(zip(spec["sparse"], encoders)):
        if ("ids", str(i)) in chunk:  # hashed or pre-encoded while scanning
            c[f["name"]] = chunk[("ids", str(i))]
        elif f.get("multi_hot"):
            c[f["name"]] = _multi_hot(chunk[("raw", f["column"])], f["multi_hot"], enc)
        else:
            c[f["name"]] = enc(chunk[("raw", f["column"])])
    c["domain"] = domain(chunk)
    for lists in per_chunk:
        c |= lists(chunk)
    return c | take_rows(side, offsets, chunk["rn"]) if side else c


def _domain_ids(spec: dict, names: list[str]):
    """A chunk's domain ids: the positions of its values in ``names`` (0 without a domain)."""
    if "domain" not in spec:
        return lambda chunk: np.zeros(len(chunk["rn"]), dtype=np.int64)
    vocab = Vocab(np.array(names))  # sorted; map its positions back to the order of ``names``
    ids = np.array([names.index(v) for v in vocab.values], dtype=np.int64)
    col = spec["domain"]["column"]
    return lambda chunk: ids[vocab(chunk[("raw", col)])]


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


def _multi_hot(values: np.ndarray, sep: str, enc) -> tuple[np.ndarray, np.ndarray]:
    tokens = [[t for t in s.split(sep) if t != ""] for s in values]
    lens = np.array([len(t) for t in tokens], dtype=np.int64)
    flat = np.array([t for row in tokens for t in row], dtype=str)
    return enc(flat) if len(flat) else np.zeros(0, dtype=np.int64), lens


def spec_name(spec: dict, column: str) -> str:
    return next(f["name"] for f in spec["sparse"] if f["column"] == column)
