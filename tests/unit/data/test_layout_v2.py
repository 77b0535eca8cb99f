"""Dataset layout v2 (event logs stored once per user, joined at read time) against v1."""

import json
import re

import numpy as np
import pyarrow as pa
import pytest
import torch

from opengem.cli import main
from opengem.data.events import events_before, join_histories, read_bucket
from opengem.data.loader import ShardLoader
from opengem.data.parquet import (
    LAYOUT_V1,
    LAYOUT_V2,
    MANIFEST,
    DataError,
    DatasetManifest,
    ShardWriter,
)
from opengem.features.schema import FeatureSchema
from opengem.testing import random_table, tiny_schema
from opengem.world.generate import generate
from opengem.world.presets import world_config

# Short caps so that many tiny-world histories are cut to their newest events in both layouts.
CAPS = ["behaviour.organic_max_len=24", "behaviour.ads_max_len=4"]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    cfg = world_config("tiny", seed=3, overrides=CAPS)
    for layout in ("v1", "v2"):
        generate(cfg, root / layout, progress=False, layout=layout)
    return root / "v1", root / "v2"


def assert_batches_equal(a, b):
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if x is None or isinstance(x, torch.Tensor):
            assert (x is None and y is None) or (x.dtype == y.dtype and torch.equal(x, y)), name
        else:  # KeyedJaggedTensor
            assert x.keys() == y.keys(), name
            assert torch.equal(x.values(), y.values()) and torch.equal(x.lengths(), y.lengths()), (
                name
            )


def test_v2_is_smaller_and_records_its_layout(worlds):
    v1, v2 = worlds
    m1, m2 = DatasetManifest.load(v1), DatasetManifest.load(v2)
    assert (m1.layout, m2.layout) == (LAYOUT_V1, LAYOUT_V2)
    assert [f.rows for f in m1.files] == [f.rows for f in m2.files]
    assert m1.source == m2.source  # the same rows, statistics and calibration
    assert all(f.bucket is not None for f in m2.files) and set(m2.events) == {"organic", "ads"}
    nbytes = [sum(p.stat().st_size for p in d.rglob("*.parquet")) for d in worlds]
    assert nbytes[1] < nbytes[0]


def test_manifest_without_layout_reads_as_v1(worlds, tmp_path):
    d = json.loads((worlds[0] / MANIFEST).read_text())
    d.pop("layout")
    (tmp_path / MANIFEST).write_text(json.dumps(d))
    assert DatasetManifest.load(tmp_path).layout == LAYOUT_V1
    (tmp_path / MANIFEST).write_text(json.dumps({**d, "layout": 3}))
    with pytest.raises(DataError, match="layout 3"):
        DatasetManifest.load(tmp_path)


@pytest.mark.parametrize("split, kw", [("train", {}), ("test", {"shuffle": False}),
                                       ("train",
                                        {"max_seq_len": {"organic": 5}, "prefetch": 2,
                                         "epochs": 2})])
def test_v1_and_v2_yield_equal_batches(worlds, split, kw):
    a = list(ShardLoader(worlds[0], split, 61, **kw))
    b = list(ShardLoader(worlds[1], split, 61, **kw))
    assert len(a) == len(b) > 3
    for x, y in zip(a, b):
        assert_batches_equal(x, y)
    if not kw:  # the cap cut some histories to their newest events
        assert max(int(x.sequences["organic.item"].lengths().max()) for x in a) == 24


def test_v2_resume_mid_epoch_yields_the_rest_exactly(worlds):
    full = list(ShardLoader(worlds[1], "train", 50, seed=4))
    loader = ShardLoader(worlds[1], "train", 50, seed=4)
    it = iter(loader)
    head = [next(it) for _ in range(7)]
    state = loader.state_dict()
    it.close()
    rest = ShardLoader(worlds[1], "train", 50, seed=4)
    rest.load_state_dict(state)
    tail = list(rest)
    assert len(head) + len(tail) == len(full)
    for x, y in zip(head + tail, full):
        assert_batches_equal(x, y)


def test_ranks_read_disjoint_v2_shards_covering_the_split(worlds):
    ids = [torch.cat([b.user_id for b in ShardLoader(worlds[1], "train", 64, rank=r, world_size=2)])
           for r in (0, 1)]
    one = torch.cat([b.user_id for b in ShardLoader(worlds[1], "train", 64)])
    assert sum(len(x) for x in ids) == len(one)
    assert sorted(torch.cat(ids).tolist()) == sorted(one.tolist())


def test_training_on_v1_and_v2_ends_with_the_same_params(worlds, tmp_path):
    final = []
    for data, run in zip(worlds, ("a", "b")):
        args = ["--quiet", "train", "--recipe", "tiny", "--data", str(data), "--out",
                str(tmp_path / run), "train.threads=1", "train.epochs=1", "data.batch_size=64"]
        assert main(args) == 0
        final.append(json.loads((tmp_path / run / "final.json").read_text()))
    assert final[0]["steps"] == final[1]["steps"] > 20  # a whole epoch: every shard joined
    assert final[0]["params_sha256"] == final[1]["params_sha256"]


# ------------------------------------------------------------------------------ the join itself
def _write_v2(tmp_path, schema, impressions, events):
    """A one-shard, one-bucket v2 dataset; ``events`` is stream → columns dict (already sorted)."""
    w = ShardWriter(tmp_path, schema, layout=LAYOUT_V2)
    for s in schema.sequences:
        if s.name in events:
            w.write_events(s.name, 0,
                           pa.table({k: pa.array(np.asarray(v, dtype=np.int64)) for k, v in
                                                events[s.name].items()}))
    w.write(impressions, "s0", 0, bucket=0)
    w.close({"train": [0]})


def _impressions(schema, users, times):
    t = random_table(schema, len(users), seed=1,
                     lengths={s.name: np.zeros(len(users), int) for s in schema.sequences})
    t = t.set_column(t.schema.get_field_index(schema.user_column), schema.user_column,
                     pa.array(users))
    t = t.set_column(t.schema.get_field_index(schema.time_column), schema.time_column,
                     pa.array(times))
    return t.drop_columns([c for s in schema.sequences
                           for c in (s.item_column, s.event_column, s.ts_column)
                           + tuple(s.attribute_column(a) for a in s.attributes)])


def test_join_never_reads_an_event_at_or_after_the_request(tmp_path):
    schema = tiny_schema(streams=1)
    T = 1_700_000_000
    # user 7: events at T-2, T-1, T-1 (two in one second: log order kept), T, T+1; user 9: none
    ev = {"user_id": [3, 7, 7, 7, 7, 7], "ts": [T - 5, T - 2, T - 1, T - 1, T, T + 1],
          "item": [1, 10, 11, 12, 13, 14], "event": [0, 0, 1, 2, 0, 1],
          "category": [0, 1, 2, 3, 4, 0]}
    _write_v2(tmp_path, schema, _impressions(schema, [7, 7, 7, 9, 3], [T, T - 1, T + 5, T, T - 5]),
              {"s0": ev})
    b = next(iter(ShardLoader(tmp_path, "train", 5, shuffle=False)))
    lengths = b.sequences["s0.item"].lengths().tolist()
    items = b.sequences["s0.item"].values().tolist()
    assert lengths == [3, 1, 5, 0, 0]  # at T: not the event at T; at T-1: neither event at T-1
    assert items == [10, 11, 12] + [10] + [10, 11, 12, 13, 14]
    assert b.sequences["s0.category"].values().tolist()[:3] == [1, 2, 3]
    # every joined event is strictly older than its request
    assert (b.seq_age["s0"].values() > 0).all()


def test_join_matches_a_brute_force_reference():
    rng = np.random.default_rng(0)
    schema = tiny_schema(streams=1)
    s = schema.sequences[0]
    user = np.sort(rng.integers(0, 30, 2000))
    ts = np.concatenate([np.sort(rng.integers(0, 500, int((user == u).sum())))
                         for u in np.unique(user)])
    cols = {"item": pa.array(np.arange(len(user))),
            "event": pa.array(rng.integers(0, 3, len(user))),
            "category": pa.array(rng.integers(0, 5, len(user)))}
    from opengem.data.events import BucketEvents

    qu, qt = rng.integers(-2, 33, 400), rng.integers(-5, 510, 400)
    refs = [[i for i in range(len(user)) if user[i] == u and ts[i] < t][-s.max_len:] for u,
            t in zip(qu, qt)]
    for index in (None, ()):  # the bucket's search index, and the general lexsort path
        bucket = BucketEvents(user, ts, cols, index)
        assert join_histories(qu, qt, bucket, s)["s0.item"].to_pylist() == refs
    huge = np.array([0, 2**61])  # keys of this span overflow int64: the lexsort path answers
    assert BucketEvents(np.array([1, 2]), huge,
                        cols).end_before(np.array([2, 2, 1]), np.array([2**61, 2**62, 5])
                                                                  ).tolist() == [1, 2, 1]
    assert events_before(user, ts, np.array([user[0]]), np.array([ts[0]])).tolist() == [0]


def test_loader_refuses_an_unsorted_event_log(tmp_path):
    schema = tiny_schema(streams=1)
    T = 1_700_000_000
    ev = {"user_id": [7, 7, 3], "ts": [T - 2, T - 1, T - 9], "item": [1, 2, 3], "event": [0, 0, 0],
          "category": [0, 0, 0]}
    _write_v2(tmp_path, schema, _impressions(schema, [7], [T]), {"s0": ev})
    with pytest.raises(DataError,
                       match=r"bucket=00000/part-0.parquet: event log not sorted .* row 2"):
        list(ShardLoader(tmp_path, "train", 4))


def test_read_bucket_names_a_missing_column(tmp_path):
    schema = tiny_schema(streams=1)
    w = ShardWriter(tmp_path, schema, layout=LAYOUT_V2)
    with pytest.raises(Exception, match="missing columns"):
        w.write_events("s0", 0, pa.table({"user_id": pa.array([1]), "ts": pa.array([1])}))
    # no files: every history is empty
    empty = read_bucket(tmp_path, [], schema, schema.sequences[0])
    assert empty.end_before(np.array([1, 2]), np.array([5, 6])).tolist() == [0, 0]


# ------------------------------------------------------------------------------ opengem validate
def _good_events(T):
    return {"user_id": [3, 7, 7, 7], "ts": [T - 5, T - 2, T - 1, T - 1], "item": [1, 10, 11, 12],
            "event": [0, 0, 1, 2], "category": [0, 1, 2, 3]}


def _validate(tmp_path, capsys, *extra):
    rc = main(["--quiet", "validate", str(tmp_path), *extra])
    out = capsys.readouterr()
    return rc, out.out + out.err


def _case(tmp_path, change=None, users=(7, 9, 3), streams=1):
    schema = tiny_schema(streams=streams)
    T = 1_700_000_000
    ev = _good_events(T)
    if change:
        change(ev)
    _write_v2(tmp_path, schema, _impressions(schema, list(users), [T] * len(users)), {"s0": ev})
    return tmp_path


def test_validate_accepts_a_good_v2_dataset_with_users_without_events(tmp_path, capsys):
    rc, out = _validate(_case(tmp_path), capsys)
    assert rc == 0, out
    assert (
        "s0.users_without_events=1" in out
        and "s0.same_user_and_ts_events=1" in out
        and "0 errors" in out
    )


def test_validate_accepts_the_generated_worlds(worlds, capsys):
    for d in worlds:
        rc, out = _validate(d, capsys)
        assert rc == 0 and "0 errors, 0 warnings" in out, out


@pytest.mark.parametrize("change, match", [
    (lambda e: e.update(ts=[1, 5, 3, 4]),
     r"part-0.parquet: event log not sorted by \(user_id, ts\) at row 2"),
    (lambda e: e.update(ts=[(1_700_000_000 - 5) * 1000] + e["ts"][1:]),
     r"column 'ts' has 1 times of another magnitude than 'request_ts' .*milliseconds"),
    (lambda e: e.pop("event"), r"missing columns \['event'\]"),
])
def test_validate_names_each_bad_input(tmp_path, capsys, change, match):
    if "event'" in match:  # the writer refuses a log missing a column: write it behind its back
        path = _case(tmp_path)
        import pyarrow.parquet as pq

        f = next(path.rglob("part-0.parquet"))
        pq.write_table(pq.read_table(f).drop_columns(["event"]), f)
    else:
        path = _case(tmp_path, change)
    rc, out = _validate(path, capsys)
    assert rc == 2
    assert any(re.search(match, line) for line in out.splitlines()), out


@pytest.mark.parametrize("change, match", [
    (lambda e: e.update(item=[1, 10, 40, 12]),
     r"part-0.parquet: column 'item' has 1 ids outside \[0, 40\) \(e.g. 40\); the loader maps "
     r"them to the OOV"),
    (lambda e: e.update(category=[0, 1, -1, 3]),
     r"column 'category' has 1 ids outside \[0, 5\) \(e.g. -1\)"),
])
def test_validate_warns_of_ids_out_of_range(tmp_path, capsys, change, match):
    path = _case(tmp_path, change)
    rc, out = _validate(path, capsys)
    assert rc == 0 and re.search("warning: .*" + match, out) and "oov_ids=1" in out, out
    assert _validate(path, capsys, "--strict")[0] == 2


def test_validate_counts_exact_duplicates_as_a_warning(tmp_path, capsys):
    def dup(e):
        for k in e:
            e[k] = e[k][:3] + [e[k][2]]

    path = _case(tmp_path, dup)
    rc, out = _validate(path, capsys)
    assert rc == 0 and "1 events repeat the one before them exactly (e.g. user 7" in out, out
    assert "s0.exact_duplicate_events=1" in out
    rc, out = _validate(path, capsys, "--strict")
    assert rc == 2


def test_validate_finds_a_user_outside_its_bucket(tmp_path, capsys):
    schema = tiny_schema(streams=1)
    T = 1_700_000_000
    w = ShardWriter(tmp_path, schema, layout=LAYOUT_V2)
    for b, user in ((0, 7), (1, 8)):
        w.write_events("s0", b,
                       pa.table({"user_id": pa.array([user]), "ts": pa.array([T - 1]),
                                 "item": pa.array([1]),
                                          "event": pa.array([0]), "category": pa.array([0])}))
    # user 8's events are in bucket 1
    w.write(_impressions(schema, [7, 8], [T, T]), "s0", 0, bucket=0)
    w.close({"train": [0]})
    rc, out = _validate(tmp_path, capsys)
    assert (
        rc == 2
        and "1 users of bucket 0's impression shards have their events in another bucket (user 8"
        in out
    )


def test_validate_v1_reports_quarantine_and_mixed_units(tmp_path, capsys):
    schema = tiny_schema(streams=1)
    t = random_table(schema, 6, lengths={"s0": np.array([2, 2, 0, 1, 3, 1])})
    ts = t.column("s0.ts").to_pylist()
    ts[0] = [ts[0][1], ts[0][0]]  # out of order: the loader quarantines the row
    ts[1] = [x * 1000 for x in ts[1]]  # milliseconds
    t = t.set_column(t.schema.get_field_index("s0.ts"), "s0.ts", pa.array(ts, pa.list_(pa.int64())))
    w = ShardWriter(tmp_path, schema)
    w.write(t, "s0", 0)
    w.close({"train": [0]})
    rc, out = _validate(tmp_path, capsys)
    assert rc == 2, out
    assert "column 's0.ts' has 2 times of another magnitude" in out
    assert "rows would be quarantined by the loader: s0.ts out of order" in out


def test_validate_reports_a_missing_manifest(tmp_path, capsys):
    rc, out = _validate(tmp_path, capsys)
    assert rc == 2 and "no dataset.json" in out


def test_generate_cli_writes_v2(tmp_path, capsys):
    out = tmp_path / "d"
    assert main(["--quiet", "generate", "--preset", "tiny", "--out", str(out), "--layout", "v2",
                 "--no-oracle", "sizes.num_users=100"]) == 0
    assert DatasetManifest.load(out).layout == LAYOUT_V2
    assert FeatureSchema.load(out).sequences
    assert not list((out / "shards").glob("*.tmp")) and list(
        (out / "events" / "organic").rglob("*.parquet")
    )


def test_a_null_event_value_is_a_validate_error_and_quarantines_the_rows_that_would_hold_it(
    tmp_path, capsys
):
    schema = tiny_schema(streams=1)
    T = 1_700_000_000
    w = ShardWriter(tmp_path, schema, layout=LAYOUT_V2)
    w.write_events("s0", 0, pa.table({"user_id": pa.array([7, 7]), "ts": pa.array([T - 9, T - 1]),
                                      "item": pa.array([1, None], pa.int64()),
                                      "event": pa.array([0, 0]),
                                      "category": pa.array([0, 0])}))
    # only the second row sees the null
    w.write(_impressions(schema, [7, 7], [T - 5, T]), "s0", 0, bucket=0)
    w.close({"train": [0]})
    rc, out = _validate(tmp_path, capsys)
    assert rc == 2 and "column 'item' has 1 nulls" in out
    loader = ShardLoader(tmp_path, "train", 4)
    (batch,) = list(loader)
    assert batch.batch_size == 1 and dict(loader.quarantined) == {"s0.item is null": 1}
