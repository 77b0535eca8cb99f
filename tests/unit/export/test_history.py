"""The serving history store: lookups equal the training loader's join, the strictly-before rule,
the memory map, bad stores refused; the predictor fills left-out histories by user id
(request wins)."""

import dataclasses
import json
import shutil
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from opengem.cli import main
from opengem.data.events import ShardReader
from opengem.data.parquet import DatasetManifest
from opengem.export import Predictor, RequestError
from opengem.export.history import META, ArrowHistoryStore, HistoryStoreError, build_history_store
from opengem.export.request import history_columns, split_row
from opengem.features.schema import FeatureSchema
from opengem.world.generate import generate
from opengem.world.presets import world_config

TOL = 1e-6


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("history")
    data, store = root / "data", root / "store"
    generate(world_config("tiny", seed=1), data, progress=False, layout="v2")
    build_history_store(data, store)
    schema = FeatureSchema.load(data)
    return SimpleNamespace(root=root, data=data, store=store, schema=schema)


@pytest.fixture(scope="module")
def artifact(world):
    run, art = world.root / "run", world.root / "artifact"
    assert main(["--quiet", "train", "--recipe", "tiny", "--data", str(world.data), "--out",
                 str(run), "train.max_steps=2", "train.threads=1"]) == 0
    assert main(["--quiet", "export", "--run", str(run), "--out", str(art), "--no-compile"]) == 0
    return art


def _rows(world, n=40):
    """Test rows as the training loader reads them (histories joined from the event logs)."""
    m = DatasetManifest.load(world.data)
    info = m.split_files("test")[0]
    rows = ShardReader(world.data, m, world.schema).read(info, world.schema.columns()).to_pylist()
    rng = np.random.default_rng(0)
    return [rows[i] for i in rng.choice(len(rows), min(n, len(rows)), replace=False)]


def _streams(schema):
    return [s.name for s in schema.sequences]


# ------------------------------------------------------------------------------------------ the store
def test_lookup_equals_the_loaders_join(world):
    store = ArrowHistoryStore(world.store, world.schema)
    for row in _rows(world):
        got = store.lookup(row["user_id"], row["request_ts"], _streams(world.schema))
        for s in world.schema.sequences:
            for c in history_columns(s):
                assert list(got.get(c, [])) == row[c], (row["user_id"], c)


def test_an_event_at_request_ts_is_never_returned(world):
    store = ArrowHistoryStore(world.store, world.schema)
    st = store.streams["organic"]
    u, ts = int(st.index_user[0]), st.events(0).ts
    t = int(ts[len(ts) // 2])
    before = store.lookup(u, t, ["organic"])["organic.ts"]
    assert len(before) and (before < t).all()
    assert t in store.lookup(u, t + 1, ["organic"])["organic.ts"]
    assert store.lookup(u, int(ts[0]), ["organic"]).get("organic.ts", np.zeros(0)).size == 0


def test_unknown_user_is_left_out(world):
    store = ArrowHistoryStore(world.store, world.schema)
    assert store.lookup(10**12, 2**40, _streams(world.schema)) == {}


def test_store_is_memory_mapped(world):
    before = pa.total_allocated_bytes()
    store = ArrowHistoryStore(world.store, world.schema)
    assert pa.total_allocated_bytes() - before < 4096  # nothing of the log copied into Arrow's heap
    batches = store.streams["organic"].batches
    assert len(batches) > 1  # one per user bucket, each read in place
    # read-only views of the map
    assert all(not b.columns["item"].buffers()[1].is_mutable for b in batches)
    assert (
        sum(b.columns["item"].buffers()[1].size for b in batches)
        >= 8 * store.meta["streams"]["organic"]["events"]
    )


def test_v1_dataset_is_refused(world, tmp_path):
    shutil.copy(world.data / "schema.json", tmp_path / "schema.json")
    d = json.loads((world.data / "dataset.json").read_text())
    d["layout"], d["files"] = 1, []
    d.pop("events")
    (tmp_path / "dataset.json").write_text(json.dumps(d))
    with pytest.raises(HistoryStoreError, match="layout 1.*layout 2"):
        build_history_store(tmp_path, tmp_path / "store")
    assert (
        main(["--quiet", "history-store", "--data", str(tmp_path), "--out", str(tmp_path / "s")])
        == 2
    )


def _copy(world, tmp_path):
    out = tmp_path / "store"
    shutil.copytree(world.store, out)
    return out


def test_store_of_another_schema_is_refused_naming_the_difference(world, tmp_path):
    store = _copy(world, tmp_path)
    meta = json.loads((store / META).read_text())
    meta["streams"]["organic"]["item_vocab_size"] += 1
    del meta["streams"]["ads"]
    (store / META).write_text(json.dumps(meta))
    with pytest.raises(HistoryStoreError, match="organic.*item_vocab_size.*ads.*not in the store"):
        ArrowHistoryStore(store, world.schema)


@pytest.mark.parametrize("damage", ["no_manifest", "missing", "truncated", "garbage"])
def test_corrupt_or_missing_store_files_are_refused(world, tmp_path, damage):
    store = _copy(world, tmp_path)
    f = store / "organic.arrow"
    if damage == "no_manifest":
        (store / META).unlink()
    elif damage == "missing":
        f.unlink()
    elif damage == "truncated":
        f.write_bytes(f.read_bytes()[:1000])
    else:
        f.write_bytes(b"x" * f.stat().st_size)
    with pytest.raises(HistoryStoreError):
        ArrowHistoryStore(store, world.schema)


# -------------------------------------------------------------------------------------- the predictor
def _request(schema, row, rows, drop=()):
    req, _ = split_row(schema, row)
    req["candidates"] = [split_row(schema, r)[1] for r in rows[:8]]
    for s in schema.sequences:
        if s.name in drop:
            for c in history_columns(s):
                req.pop(c)
    return req


def test_lookup_scores_equal_request_histories(world, artifact):
    store = ArrowHistoryStore(world.store, world.schema)
    p = Predictor(artifact, history=store)
    rows = _rows(world, 12)
    for row in rows:
        full = p.predict(_request(world.schema, row, rows))
        looked = p.predict(_request(world.schema, row, rows, drop=_streams(world.schema)))
        for t in p.tasks:
            assert np.abs(np.array(full["predictions"][t]) - looked["predictions"][t]).max() < TOL
        assert looked["looked_up"] == {
            s.name: len(row[s.ts_column])
            for s in world.schema.sequences
            if s.ts_column in store.lookup(row["user_id"], row["request_ts"], [s.name])
        }
        assert "looked_up" not in full


def test_request_histories_win_per_stream(world, artifact):
    p = Predictor(artifact, history=ArrowHistoryStore(world.store, world.schema))
    rows = _rows(world, 12)
    row = max(rows, key=lambda r: len(r["organic.ts"]))
    mixed = _request(world.schema, row, rows, drop=["ads"])
    for c in history_columns(world.schema.sequences[0]):
        mixed[c] = mixed[c][-3:]  # a request's own (shorter) organic history, not the store's
    out = p.predict(mixed)
    assert "organic" not in out["looked_up"]
    explicit = _request(world.schema, row, rows)
    for c in history_columns(world.schema.sequences[0]):
        explicit[c] = explicit[c][-3:]
    ref = p.predict(explicit)
    assert np.abs(np.array(out["predictions"]["click"]) - ref["predictions"]["click"]).max() < TOL


def test_unknown_user_scores_with_empty_histories(world, artifact):
    p = Predictor(artifact, history=ArrowHistoryStore(world.store, world.schema))
    rows = _rows(world, 12)
    req = _request(world.schema, rows[0], rows, drop=_streams(world.schema))
    req["user_id"] = 10**12
    out = p.predict(req)
    assert out["unknown_user"] == {s: 1 for s in _streams(world.schema)} and out["looked_up"] == {}
    empty = _request(world.schema, rows[0], rows)
    empty["user_id"] = 10**12
    for s in world.schema.sequences:
        for c in history_columns(s):
            empty[c] = []
    ref = p.predict(empty)
    assert np.abs(np.array(out["predictions"]["click"]) - ref["predictions"]["click"]).max() < TOL


def test_without_a_store_histories_stay_required(world, artifact):
    rows = _rows(world, 12)
    req = _request(world.schema, rows[0], rows, drop=["organic"])
    with pytest.raises(RequestError) as e:
        Predictor(artifact).predict(req)
    assert e.value.status == 422 and e.value.field.startswith("organic.")
    part = _request(world.schema, rows[0], rows)
    part.pop("organic.event")
    with pytest.raises(RequestError, match="given in part"):
        Predictor(artifact, history=ArrowHistoryStore(world.store, world.schema)).predict(part)


def test_predictor_refuses_a_store_of_another_schema(world, artifact, tmp_path):
    store = ArrowHistoryStore(world.store, world.schema)
    other = dataclasses.replace(world.schema, user_column="uid")
    with pytest.raises(HistoryStoreError, match="user column"):
        store.check(other)
