"""Per-event numeric values (``SequenceStream.values``): schema, both layouts, validation,
quarantine, the batch and the event token of GEM and the peers."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pyarrow as pa
import pytest
import torch

from opengem.cli import main
from opengem.data.batch import collate, validate_rows
from opengem.data.events import ShardReader
from opengem.data.loader import ShardLoader
from opengem.data.parquet import LAYOUT_V2, DataError, DatasetManifest, ShardWriter
from opengem.features.schema import FeatureSchema, SchemaError
from opengem.model.build import build_gem, materialize
from opengem.model.foundation import GEMConfig
from opengem.testing import random_table, tiny_schema, valued_schema

T = 1_700_000_000


# ------------------------------------------------------------------------------------ schema
def test_schema_round_trip_and_schemas_without_values_keep_their_json(tmp_path):
    s = valued_schema()
    s.save(tmp_path / "schema.json")
    back = FeatureSchema.load(tmp_path)
    assert back == s and back.sequences[0].values == ("dwell", "price")
    assert back.fingerprint() == s.fingerprint() != tiny_schema().fingerprint()
    assert s.to_dict()["sequences"][0]["values"] == ["dwell", "price"]
    # written only when there are some: schemas without values hash as before the field
    assert all("values" not in x for x in tiny_schema().to_dict()["sequences"])
    assert "values" not in s.to_dict()["sequences"][1]
    cols = s.columns()
    assert cols[cols.index("s0.category") + 1:][:2] == ["s0.dwell", "s0.price"]
    assert s.sequences[0].value_columns == ("s0.dwell", "s0.price")


@pytest.mark.parametrize("values, message", [
    (("dwell", "dwell"), "must be unique"),
    (("category",), "not item/event/ts or an attribute's name"),
    (("ts",), "not item/event/ts"),
    (("watch-fraction",), "value name 'watch-fraction' must match"),
    (("",), "value name '' must match"),
])
def test_invalid_value_names_name_the_problem(values, message):
    with pytest.raises(SchemaError, match=re.escape(message)):
        valued_schema(values)
    d = tiny_schema().to_dict()
    d["sequences"][0]["values"] = list(values)
    with pytest.raises(SchemaError, match=re.escape(message)):
        FeatureSchema.from_dict(d)


def test_values_must_be_a_list_of_names():
    d = tiny_schema().to_dict()
    d["sequences"][0]["values"] = "dwell"
    with pytest.raises(SchemaError, match="values must be a list of names"):
        FeatureSchema.from_dict(d)


# ------------------------------------------------------------------------------------ batch
def test_collate_gives_float32_values_aligned_with_the_events():
    s = valued_schema()
    t = random_table(s, 5, lengths={"s0": np.array([2, 0, 3, 1, 4]), "s1": np.full(5, 2)})
    b = collate(t, s)
    assert b.seq_values.keys() == ["s0.dwell", "s0.price"]
    d = b.seq_values.to_dict()
    for c in ("s0.dwell", "s0.price"):
        assert d[c].values().dtype == torch.float32
        assert torch.equal(d[c].lengths(), b.sequences["s0.item"].lengths())
        want = np.concatenate([np.asarray(x, dtype=np.float32) for x in t.column(c).to_pylist()])
        assert torch.equal(d[c].values(), torch.from_numpy(want))
    # a history cap keeps the newest events' values
    capped = collate(t, s, {"s0": 2}).seq_values.to_dict()["s0.dwell"]
    rows = t.column("s0.dwell").to_pylist()
    assert capped.values().tolist() == pytest.approx([v for r in rows for v in r[-2:]])
    assert collate(random_table(tiny_schema(), 3), tiny_schema()).seq_values is None


def test_history_caps_of_the_students_cut_values_too():
    from opengem.transfer.stream import cap_history, select_rows

    s = valued_schema()
    b = collate(random_table(s, 4, lengths={"s0": np.array([5, 1, 0, 3]), "s1": np.ones(4)}), s)
    c = cap_history(b, s, {"s0": 2})
    assert c.seq_values.lengths().tolist() == [2, 1, 0, 2] * 2
    assert torch.equal(c.seq_values["s0.dwell"].values(),
                       b.seq_values["s0.dwell"].values()[[3, 4, 5, 7, 8]])
    assert select_rows(b, torch.tensor([3])).seq_values.lengths().tolist() == [3, 3]


def _set(t, col, rows, type_=None):
    return t.set_column(t.column_names.index(col), col,
                        pa.array(rows, type_ or pa.list_(pa.float32())))


def test_nan_or_inf_values_and_misaligned_lists_are_quarantined_by_name():
    s = valued_schema()
    t = random_table(s, 5, lengths={"s0": np.full(5, 2), "s1": np.full(5, 1)})
    dwell = t.column("s0.dwell").to_pylist()
    dwell[1] = [1.0, float("nan")]
    dwell[2] = [float("-inf"), 1.0]
    dwell[3] = [1.0]
    price = t.column("s0.price").to_pylist()
    price[4] = [1e39, 0.0]  # beyond float32: inf in the batch, so bad like one
    t = _set(_set(t, "s0.dwell", dwell), "s0.price", price, pa.list_(pa.float64()))
    keep, reasons, why = validate_rows(t, s)
    assert keep.tolist() == [True, False, False, False, False]
    assert dict(reasons) == {"s0 event lists (item/event/ts/attributes/values) differ in length": 1,
                             "s0.dwell is NaN/inf": 2, "s0.price is NaN/inf": 1}
    assert why[1] == "s0.dwell is NaN/inf"


# ------------------------------------------------------------------------------------ layouts
def _loader(data, **kw):
    return ShardLoader(data, "train", 64, shuffle=False, **kw)


def test_v1_round_trip(tmp_path):
    s = valued_schema()
    t = random_table(s, 12)
    w = ShardWriter(tmp_path, s)
    w.write(t, "s0", 0)
    w.close({"train": [0]})
    (b,) = list(_loader(tmp_path))
    assert torch.equal(b.seq_values.values(), collate(t, s).seq_values.values())
    # integer lists are numbers too (a dwell logged in whole seconds)
    t2 = _set(t, "s0.dwell", [[int(x) for x in r] for r in t.column("s0.dwell").to_pylist()],
              pa.list_(pa.int64()))
    w = ShardWriter(tmp_path / "i", s)
    w.write(t2, "s0", 0)
    w.close({"train": [0]})
    (b2,) = list(_loader(tmp_path / "i"))
    assert b2.seq_values["s0.dwell"].values().dtype == torch.float32


def test_a_value_column_of_another_type_is_a_named_error(tmp_path):
    s = valued_schema()
    t = _set(random_table(s, 4), "s0.dwell", ["1.5"] * 4, pa.string())
    w = ShardWriter(tmp_path, s)
    w.write(t, "s0", 0)
    w.close({"train": [0]})
    with pytest.raises(DataError, match=r"column 's0.dwell' is string, expected a list of numbers"):
        list(_loader(tmp_path))


def _events(user, ts, dwell, price, float_type=None):
    n, float_type = len(user), float_type or pa.float64()
    return pa.table({"user_id": pa.array(user, pa.int64()), "ts": pa.array(ts, pa.int64()),
                     "item": pa.array(np.arange(n) % 40), "event": pa.array(np.arange(n) % 3),
                     "category": pa.array(np.arange(n) % 5),
                     "dwell": pa.array(dwell, float_type), "price": pa.array(price, float_type)})


def _impressions(schema, users, times):
    t = random_table(schema, len(users), seed=1)
    t = t.set_column(t.column_names.index("user_id"), "user_id", pa.array(users))
    t = t.set_column(t.column_names.index("request_ts"), "request_ts", pa.array(times))
    return t.drop_columns([c for s in schema.sequences
                           for c in (s.item_column, s.event_column, s.ts_column)
                           + tuple(s.attribute_column(a) for a in s.attributes)
                           + s.value_columns])


def _write_v2(root, schema, events, users, times):
    w = ShardWriter(root, schema, layout=LAYOUT_V2)
    w.write_events("s0", 0, events)
    w.write(_impressions(schema, users, times), "s0", 0, bucket=0)
    w.close({"train": [0]})
    return root


def test_v2_joins_values_with_their_events_and_equals_v1(tmp_path):
    s = valued_schema(streams=1)
    ev = _events([3, 7, 7, 7, 7], [T - 5, T - 3, T - 2, T - 1, T],
                 [9.0, 1.5, 2.5, 3.5, 4.5], [0.0, 10.0, 20.0, 30.0, 40.0])
    v2 = _write_v2(tmp_path / "v2", s, ev, [7, 7, 3, 9], [T, T - 2, T - 4, T])
    (b,) = list(_loader(v2))
    assert b.seq_values["s0.dwell"].lengths().tolist() == [3, 1, 1, 0]
    assert b.seq_values["s0.dwell"].values().tolist() == [1.5, 2.5, 3.5, 1.5, 9.0]
    assert b.seq_values["s0.price"].values().tolist() == [10.0, 20.0, 30.0, 10.0, 0.0]
    # the same rows written as v1 (the joined lists) give the same batch
    m = DatasetManifest.load(v2)
    rows = ShardReader(v2, m, s).read(m.files[0], s.columns())
    w = ShardWriter(tmp_path / "v1", s)
    w.write(rows, "s0", 0)
    w.close({"train": [0]})
    (b1,) = list(_loader(tmp_path / "v1"))
    for f in ("sequences", "seq_age", "seq_values"):
        x, y = getattr(b, f), getattr(b1, f)
        assert x.keys() == y.keys() and torch.equal(x.values(), y.values())
        assert torch.equal(x.lengths(), y.lengths())


def test_v2_event_log_values_of_another_type_are_a_named_error(tmp_path):
    s = valued_schema(streams=1)
    ev = _events([7], [T - 1], [1.0], [2.0])
    ev = ev.set_column(ev.column_names.index("dwell"), "dwell", pa.array(["x"]))
    _write_v2(tmp_path, s, ev, [7], [T])
    with pytest.raises(DataError, match=r"column 'dwell' is string, expected numbers"):
        list(_loader(tmp_path))


def test_a_nan_event_value_quarantines_the_rows_whose_history_holds_it(tmp_path, capsys):
    s = valued_schema(streams=1)
    ev = _events([7, 7, 7], [T - 9, T - 5, T - 1], [1.0, float("nan"), 2.0], [1.0, 2.0, 3.0])
    # rows: before the NaN event (kept), after it (quarantined, twice)
    data = _write_v2(tmp_path, s, ev, [7, 7, 7], [T - 6, T - 2, T])
    loader = ShardLoader(data, "train", 4, quarantine_dir=tmp_path / "q")
    (b,) = list(loader)
    assert b.batch_size == 1 and dict(loader.quarantined) == {"s0.dwell is NaN/inf": 2}
    rc = main(["--quiet", "validate", str(data)])
    out = capsys.readouterr()
    text = out.out + out.err
    assert rc == 2 and "column 'dwell' has 1 NaN/inf values (e.g. nan)" in text, text


def test_validate_accepts_values_and_reports_v1_nan_rows(tmp_path, capsys):
    s = valued_schema(streams=1)
    ev = _events([7, 7], [T - 9, T - 1], [1.0, 1e6], [-3.0, 0.0], pa.float32())
    data = _write_v2(tmp_path / "v2", s, ev, [7, 7], [T - 5, T])
    rc = main(["--quiet", "validate", str(data)])
    out = capsys.readouterr().out
    assert rc == 0 and "0 errors, 0 warnings" in out, out  # values are not ids: no range check
    t = random_table(s, 6, lengths={"s0": np.full(6, 2)})
    dwell = t.column("s0.dwell").to_pylist()
    dwell[2] = [float("inf"), 1.0]
    w = ShardWriter(tmp_path / "v1", s)
    w.write(_set(t, "s0.dwell", dwell), "s0", 0)
    w.close({"train": [0]})
    rc = main(["--quiet", "validate", str(tmp_path / "v1")])
    out = capsys.readouterr().out
    assert rc == 0 and "1 rows would be quarantined by the loader: s0.dwell is NaN/inf" in out, out


# ------------------------------------------------------------------------------------ models
def _batch(schema, n=6, seed=0):
    return collate(random_table(schema, n, seed=seed,
                                lengths={"s0": np.array([3, 0, 2, 5, 1, 4][:n]),
                                         "s1": np.full(n, 2)}), schema)


def test_a_schema_without_values_builds_the_same_model():
    """Only a stream with values adds a module, built last: every other parameter is
    initialised as before (seeded init order unchanged)."""
    plain = materialize(build_gem(tiny_schema(), GEMConfig(embedding_dim=8)), seed=3)
    valued = materialize(build_gem(valued_schema(), GEMConfig(embedding_dim=8)), seed=3)
    assert plain.event_values is None
    a, b = dict(plain.named_parameters()), dict(valued.named_parameters())
    assert set(b) - set(a) == {"event_values.proj.s0.weight"}
    assert b["event_values.proj.s0.weight"].shape == (8, 2)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_event_token_changes_with_the_value_and_the_linear_learns():
    s = valued_schema()
    model = materialize(build_gem(s, GEMConfig(embedding_dim=8)))
    b = _batch(s)
    emb = model.sparse_arch.forward_sequences(b.sequences)
    tokens = model.event_values.add(emb, b)
    vals = torch.stack([b.seq_values[c].values() for c in ("s0.dwell", "s0.price")], 1)
    w = model.event_values.proj["s0"].weight
    want = emb["s0"][0] + torch.sign(vals) * torch.log1p(vals.abs()) @ w.t()
    assert torch.allclose(tokens["s0"][0], want, atol=1e-6)
    assert torch.equal(tokens["s1"][0], emb["s1"][0])  # a stream without values is untouched
    out = model(b)
    out.sum().backward()
    assert w.grad is not None and w.grad.abs().sum() > 0
    bumped = dataclasses.replace(b, seq_values=_scaled(b.seq_values, 10.0))
    with torch.no_grad():
        assert not torch.allclose(model(bumped), out)
    with pytest.raises(ValueError, match=r"have per-event values but the batch carries none"):
        model(dataclasses.replace(b, seq_values=None))


def _scaled(kjt, k):
    from torchrec import KeyedJaggedTensor

    return KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values() * k, lengths=kjt.lengths())


@pytest.mark.parametrize("arch", ["dlrm", "din"])
def test_peers_read_the_values_through_the_same_event_model(arch):
    s = valued_schema()
    model = materialize(build_gem(s, GEMConfig(arch=arch, embedding_dim=8)))
    assert [n for n, _ in model.named_parameters() if "event_values" in n] == [
        "event_values.proj.s0.weight"]
    b = _batch(s)
    out = model(b)
    out.sum().backward()
    assert model.event_values.proj["s0"].weight.grad.abs().sum() > 0
    with torch.no_grad():
        assert not torch.allclose(model(dataclasses.replace(b, seq_values=_scaled(b.seq_values,
                                                                                    3.0))), out)
    plain = materialize(build_gem(tiny_schema(), GEMConfig(arch=arch, embedding_dim=8)))
    assert plain.event_values is None
