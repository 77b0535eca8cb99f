"""Per-event values at serving: the history store keeps and returns them as the loader's join
does, refuses NaN, and a trained model exported and served by user id scores as with the
histories given (values included)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from opengem.cli import main
from opengem.data.events import ShardReader
from opengem.data.parquet import LAYOUT_V2, DatasetManifest, ShardWriter
from opengem.export import Predictor
from opengem.export.history import ArrowHistoryStore, HistoryStoreError, build_history_store
from opengem.export.request import history_columns, split_row
from opengem.testing import random_table, tiny_schema, valued_schema

T = 1_700_000_000
TOL = 1e-6


def _log(rng, schema, stream, users, per_user):
    """A sorted event log of ``stream``: ``per_user`` events per user in the hours before T."""
    s = schema.stream(stream)
    user = np.repeat(np.asarray(users, dtype=np.int64), per_user)
    ts = np.concatenate([np.sort(T - rng.integers(1, 7200, per_user)) for _ in users])
    n = len(user)
    cols = {"user_id": pa.array(user), "ts": pa.array(ts.astype(np.int64)),
            "item": pa.array(rng.integers(0, s.item_vocab_size, n)),
            "event": pa.array(rng.integers(0, s.num_event_types, n))}
    cols |= {a.name: pa.array(rng.integers(0, a.vocab_size, n)) for a in s.attributes}
    cols |= {v: pa.array(rng.lognormal(0.0, 1.5, n)) for v in s.values}  # float64 in the file
    return pa.table(cols)


def _dataset(root, schema, users=tuple(range(10)), nan=False):
    """A v2 dataset: one bucket, impressions of every user at a few times around their events."""
    rng = np.random.default_rng(0)
    w = ShardWriter(root, schema, layout=LAYOUT_V2)
    for s in schema.sequences:
        log = _log(rng, schema, s.name, users, 9)
        if nan and s.values:
            v = log.column(s.values[0]).to_numpy().copy()
            v[4] = np.nan
            log = log.set_column(log.column_names.index(s.values[0]), s.values[0], pa.array(v))
        w.write_events(s.name, 0, log)
    n = 4 * len(users)
    imp = random_table(schema, n, seed=1, lengths={s.name: np.zeros(n, int)
                                                   for s in schema.sequences})
    imp = imp.set_column(imp.column_names.index("user_id"), "user_id",
                         pa.array(np.tile(np.asarray(users, dtype=np.int64), 4)))
    imp = imp.set_column(imp.column_names.index("request_ts"), "request_ts",
                         pa.array(T - rng.integers(-60, 5000, n)))
    imp = imp.drop_columns([c for s in schema.sequences for c in history_columns(s)])
    for day in (0, 1):
        w.write(imp, f"d{day}", day, bucket=0)
    w.close({"train": [0], "test": [1]})
    return root


def _rows(data, schema):
    m = DatasetManifest.load(data)
    return ShardReader(data, m, schema).read(m.split_files("test")[0], schema.columns()).to_pylist()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("values")
    schema = valued_schema()
    data, store = _dataset(root / "data", schema), root / "store"
    build_history_store(data, store)
    return SimpleNamespace(root=root, data=data, store=store, schema=schema)


def test_the_store_returns_values_as_the_loader_joins_them(world):
    store = ArrowHistoryStore(world.store, world.schema)
    meta = json.loads((world.store / "history.json").read_text())
    assert meta["streams"]["s0"]["columns"][-2:] == ["dwell", "price"]
    rows = _rows(world.data, world.schema)
    assert sum(len(r["s0.dwell"]) for r in rows) > 20
    for row in rows:
        got = store.lookup(row["user_id"], row["request_ts"], ["s0", "s1"])
        for c in history_columns(world.schema.stream("s0")):
            assert list(got.get(c, [])) == row[c], c
        assert got["s0.dwell"].dtype == np.float32 and "s1.dwell" not in got


def test_a_store_without_the_values_or_with_nan_values_is_refused(world, tmp_path):
    plain = tiny_schema()
    build_history_store(_dataset(tmp_path / "plain", plain), tmp_path / "plain_store")
    with pytest.raises(HistoryStoreError, match=r"stream 's0' columns: store .* model .*'dwell'"):
        ArrowHistoryStore(tmp_path / "plain_store", world.schema)
    with pytest.raises(HistoryStoreError, match=r"column 'dwell' holds NaN/inf values"):
        build_history_store(_dataset(tmp_path / "nan", world.schema, nan=True), tmp_path / "s")


def test_served_by_user_id_equals_histories_given_and_the_export_parity_holds(world):
    run, art = world.root / "run", world.root / "artifact"
    assert main(["--quiet", "train", "--recipe", "tiny", "--data", str(world.data), "--out",
                 str(run), "train.max_steps=2", "train.threads=1", "data.batch_size=16"]) == 0
    assert main(["--quiet", "export", "--run", str(run), "--out", str(art), "--no-compile"]) == 0
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["parity"]["max_abs_diff_exported"] <= TOL
    given = Predictor(art, runtime="exported")
    looked = Predictor(art, runtime="exported",
                       history=ArrowHistoryStore(world.store, world.schema))
    drop = {c for s in world.schema.sequences for c in history_columns(s)}
    rows = _rows(world.data, world.schema)[:12]
    events = 0
    for row in rows:
        req, cand = split_row(world.schema, row)
        full = {**req, "candidates": [cand, cand]}
        a = given.predict(full)
        b = looked.predict({k: v for k, v in full.items() if k not in drop})
        events += b["looked_up"].get("s0", 0)
        for t in world.schema.task_names:
            assert np.abs(np.subtract(a["predictions"][t], b["predictions"][t])).max() <= TOL
    assert events > 10
    # the values reach the scores: another dwell, another score
    row = next(r for r in rows if len(r["s0.dwell"]) > 1)
    req, cand = split_row(world.schema, row)
    base = given.predict({**req, "candidates": [cand, cand]})["predictions"]["click"][0]
    req["s0.dwell"] = [v * 100.0 for v in req["s0.dwell"]]
    assert given.predict({**req, "candidates": [cand, cand]})["predictions"]["click"][0] != base
