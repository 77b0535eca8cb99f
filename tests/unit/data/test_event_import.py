"""The generic importer's v2 paths: an events table (sorted and bucketed out of core by DuckDB) and
per-row list columns (v2 when they are prefixes of one per-user history, else per row), and every
kind of bad input named or counted."""

import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from opengem.cli import main
from opengem.data.events import ShardReader
from opengem.data.parquet import LAYOUT_V1, LAYOUT_V2, DatasetManifest
from opengem.data.sources import convert
from opengem.data.sources.common import ColumnError, history
from opengem.data.sources.fake_log import T0, spec, write_log
from opengem.features.schema import FeatureSchema

pytest.importorskip("duckdb")


def _rows(out) -> dict:
    """Every impression row of a dataset, histories joined, as columns (numpy / python lists)."""
    m, schema = DatasetManifest.load(out), FeatureSchema.load(out)
    reader = ShardReader(out, m, schema)
    t = pa.concat_tables([reader.read(f, schema.columns()) for f in m.files])
    return t.to_pydict()


def _write(tmp, imps: dict, events: dict | None = None):
    tmp.mkdir(parents=True, exist_ok=True)
    n = len(imps["user"])
    base = {"item_id": [1] * n, "cat": [1] * n, "click": [0, 1] * (n // 2) + [0] * (n % 2)}
    pq.write_table(pa.table(base | imps), tmp / "impressions.parquet")
    if events is not None:
        pq.write_table(pa.table(events), tmp / "events.parquet")
    return tmp


def _events(user, ts, item=None, action=None):
    n = len(user)
    item = item if item is not None else list(range(n))
    return {"user": user, "ts": ts, "item_id": item, "action": action or ["view"] * n,
            "cat": [i % 50 for i in item]}


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    return write_log(tmp_path_factory.mktemp("log"), rows=400, users=30, events_per_user=60, seed=1)


def test_events_table_becomes_v2_with_exactly_the_strictly_earlier_events(
    log_dir, tmp_path, caplog
):
    with caplog.at_level(logging.INFO, logger="opengem"):
        m = convert("generic", log_dir, tmp_path / "out", spec=spec(max_len=12, buckets=3))
    assert m.layout == LAYOUT_V2 and len(m.events["clicks"]) == 3
    st = m.source["storage"]
    assert st["layout"] == 2 and "time-prefix" in st["why"] and st["events_read"] == 30 * 60
    assert "stored as layout v2" in caplog.text and "sorted by (user, time)" in caplog.text
    assert main(["--quiet", "validate", str(tmp_path / "out"), "--strict"]) == 0
    # The reference: each row's user's raw events strictly before its time, newest 12, from the
    # raw tables.
    ev, imp = (
        pq.read_table(log_dir / "events.parquet").to_pydict(),
        pq.read_table(log_dir / "impressions.parquet"),
    )
    got = _rows(tmp_path / "out")
    vocab = np.unique(imp.column("user").to_numpy().astype(str))  # user ids: sorted raw values
    raw_user = vocab[np.array(got["user_id"])].astype(np.int64)
    ref = history(np.array(ev["user"]), np.array(ev["ts"]), {"item": np.array(ev["item_id"])},
                  raw_user, np.array(got["request_ts"]), 12)
    flat = np.concatenate([np.array(x, dtype=np.int64) for x in got["clicks.item"]])
    assert np.array_equal([len(x) for x in got["clicks.item"]], ref["item"][1])
    assert ref["item"][1].max() == 12 and ref["item"][1].sum() > 1000  # capped, and not empty
    # same events (ties may order differently)
    assert np.array_equal(np.sort(flat), np.sort(ref["item"][0]))
    ts = np.concatenate([np.array(x) for x in got["clicks.ts"]])
    assert np.array_equal(ts, ref["ts"][0])
    assert all(max(h, default=0) < t for h, t in zip(got["clicks.ts"], got["request_ts"]))
    assert set(np.concatenate([np.array(x) for x in got["clicks.event"]])) == {0, 1}  # click, view


def test_unsorted_input_is_sorted_by_the_importer(tmp_path):
    a = write_log(tmp_path / "a", rows=200, users=10, events_per_user=40, seed=2, shuffle=False)
    b = write_log(tmp_path / "b", rows=200, users=10, events_per_user=40, seed=2, shuffle=True)
    ea, eb = pq.read_table(a / "events.parquet"), pq.read_table(b / "events.parquet")
    assert not ea.equals(eb) and ea.sort_by([("user", "ascending"),
                                             ("ts", "ascending")]).column("ts").equals(
        eb.sort_by([("user", "ascending"), ("ts", "ascending")]).column("ts"))
    for d in (a, b):
        convert("generic", d, d / "out", spec=spec())
    ra, rb = _rows(a / "out"), _rows(b / "out")
    assert ra["request_ts"] == rb["request_ts"] and ra["clicks.ts"] == rb["clicks.ts"]
    assert sum(map(len, ra["clicks.ts"])) > 500


def test_events_at_or_after_the_impression_are_never_joined(tmp_path):
    d = _write(tmp_path, {"user": [7, 7], "ts": [T0 + 100, T0 + 200]},
               _events([7] * 5, [T0 + 50, T0 + 100, T0 + 150, T0 + 200, T0 + 300]))
    m = convert("generic", d, d / "out", spec=spec())
    got = _rows(d / "out")
    # the request's own second is out
    assert got["clicks.ts"] == [[T0 + 50], [T0 + 50, T0 + 100, T0 + 150]]
    assert m.source["storage"]["events_at_or_after_last_impression_kept_unused"] == 2


def test_duplicate_user_time_events_are_kept_and_counted(tmp_path):
    d = _write(tmp_path, {"user": [1], "ts": [T0 + 100]},
               _events([1, 1, 1, 1], [T0 + 10, T0 + 10, T0 + 10, T0 + 20], item=[5, 5, 6, 7]))
    m = convert("generic", d, d / "out", spec=spec())
    st = m.source["storage"]
    assert (st["events_sharing_user_and_time"], st["exact_duplicate_events_kept"]) == (2, 1)
    assert sorted(_rows(d / "out")["clicks.item"][0]) == [5, 5, 6, 7]


def test_users_without_events_get_empty_histories_and_are_counted(tmp_path):
    d = _write(tmp_path, {"user": [1, 2, 3], "ts": [T0 + 100] * 3},
               _events([2, 2, 99], [T0, T0 + 1, T0 + 2]))
    m = convert("generic", d, d / "out", spec=spec())
    st = m.source["storage"]
    assert (
        st["users_without_events"] == 2 and st["events_of_users_without_impressions_dropped"] == 1
    )
    got = _rows(d / "out")
    assert sorted(map(len, got["clicks.item"])) == [0, 0, 2]


def test_ids_out_of_range_go_to_the_oov_row_counted(tmp_path):
    d = _write(tmp_path, {"user": [1], "ts": [T0 + 100]}, _events([1, 1, 1], [T0, T0 + 1, T0 + 2],
                                                                 item=[3, 10_000, -4]))
    m = convert("generic", d, d / "out", spec=spec())
    assert m.source["storage"]["item_out_of_range_to_oov"] == 2
    assert _rows(d / "out")["clicks.item"][0] == [3, 10_000, 10_000]  # vocab_size is the OOV row


def test_times_in_another_unit_are_an_error_naming_file_and_column(tmp_path):
    ms = [(T0 + k) * 1000 for k in range(3)]
    d = _write(tmp_path / "a", {"user": [1], "ts": [T0 + 100]}, _events([1, 1, 1], ms))
    with pytest.raises(ColumnError,
                       match=r"events.parquet: column 'ts': time 1700000002000 .*mixed units"):
        convert("generic", d, d / "out", spec=spec())
    d = _write(tmp_path / "b", {"user": [1], "ts": [T0 + 100]},
               _events([1, 1, 1], [T0, T0 + 1, ms[2]]))
    with pytest.raises(ColumnError, match="mixed units"):
        convert("generic", d, d / "out", spec=spec())
    # the same log declared in ms imports
    d = _write(tmp_path / "c", {"user": [1], "ts": [T0 + 100]}, _events([1, 1, 1], ms))
    convert("generic", d, d / "out", spec=spec(time_unit="ms"))
    assert _rows(d / "out")["clicks.ts"] == [[T0, T0 + 1, T0 + 2]]


def test_missing_event_columns_and_null_users_are_errors(tmp_path):
    ev = _events([1], [T0])
    ev.pop("cat")
    d = _write(tmp_path / "a", {"user": [1], "ts": [T0 + 100]}, ev)
    with pytest.raises(ColumnError, match=r"events.parquet: missing columns \['cat'\]"):
        convert("generic", d, d / "out", spec=spec())
    d = _write(tmp_path / "b", {"user": [1], "ts": [T0 + 100]},
               _events(pa.array([1, None], pa.int64()), [T0, T0]))
    with pytest.raises(ColumnError, match=r"column 'user' has 1 empty values"):
        convert("generic", d, d / "out", spec=spec())
    with pytest.raises(ColumnError, match="events file not found"):
        convert("generic", d, d / "out2", spec=spec(files=["nope.parquet"]))


def test_events_table_as_csv_with_iso_times(tmp_path):
    (tmp_path / "in").mkdir()
    _write(tmp_path / "in", {"user": [4, 4], "ts": [T0 + 100, T0 + 200]})
    (tmp_path / "in" / "events.csv").write_text(
        "user,ts,item_id,action,cat\n4,2023-11-14T23:13:21+01:00,9,click,9\n4,1700000150,8,view,8\n"
    )
    convert("generic", tmp_path / "in", tmp_path / "out", spec=spec(files=["events.csv"]))
    got = _rows(tmp_path / "out")  # 2023-11-14T23:13:21+01:00 = T0 + 1 s
    assert got["clicks.item"] == [[9], [9, 8]] and got["clicks.ts"] == [
        [T0 + 1],
        [T0 + 1, T0 + 150],
    ]


# --------------------------------------------------------------------------------- list columns
def _lists(tmp, users, ts, items, times, times_type=pa.list_(pa.int64())):
    n = len(users)
    return _write(tmp,
                  {"user": users, "ts": ts, "hist_items": pa.array(items, pa.list_(pa.int64())),
                        "hist_ts": pa.array(times, times_type), "item_id": [1] * n})


LIST_SPEC = {"from": "lists", "column": "hist_items", "times": "hist_ts", "files": None}


def _list_spec(**kw):
    s = spec(**{k: v for k, v in (LIST_SPEC | kw).items() if v is not None})
    s["sequence"].pop("files", None)
    s["sequence"].pop("event")
    s["sequence"].pop("attributes")
    return s


def test_prefix_lists_become_v2(tmp_path, caplog):
    d = _lists(tmp_path, [1, 1, 2], [T0 + 10, T0 + 30, T0 + 30],
               [[5], [5, 6, 7], [8]], [[T0 + 1], [T0 + 1, T0 + 12, T0 + 20], [T0 + 2]])
    with caplog.at_level(logging.INFO, logger="opengem"):
        m = convert("generic", d, d / "out", spec=_list_spec())
    assert m.layout == LAYOUT_V2 and m.source["storage"]["events_stored"] == 4
    assert "stored as layout v2" in caplog.text
    got = _rows(d / "out")
    assert sorted(zip(got["request_ts"], got["clicks.item"], got["clicks.ts"])) == [
        (T0 + 10, [5], [T0 + 1]), (T0 + 30, [5, 6, 7], [T0 + 1, T0 + 12, T0 + 20]),
        (T0 + 30, [8], [T0 + 2])]
    assert main(["--quiet", "validate", str(d / "out")]) == 0


def test_lists_logged_at_serving_time_stay_per_row_with_their_times(tmp_path, caplog):
    # user 1's first row saw item 9 at T0+5 that its later row does not hold: no one history
    # explains both
    d = _lists(tmp_path, [1, 1], [T0 + 10, T0 + 30], [[9], [5, 6]], [[T0 + 5], [T0 + 1, T0 + 12]],
               pa.list_(pa.timestamp("s")))
    with caplog.at_level(logging.INFO, logger="opengem"):
        m = convert("generic", d, d / "out", spec=_list_spec())
    assert m.layout == LAYOUT_V1 and m.source["storage"]["rows_not_prefixes"] == 2
    assert (
        "stored as layout v1" in caplog.text and "not the time-prefix" in m.source["storage"]["why"]
    )
    got = _rows(d / "out")
    assert sorted(zip(got["clicks.item"], got["clicks.ts"])) == [
        ([5, 6], [T0 + 1, T0 + 12]),
        ([9], [T0 + 5]),
    ]
    assert json.loads((d / "out" / "dataset.json").read_text())["source"]["storage"]["layout"] == 1


def test_list_events_at_or_after_the_impression_are_dropped(tmp_path):
    d = _lists(tmp_path, [1], [T0 + 10], [[5, 6, 7]], [[T0 + 1, T0 + 10, T0 + 11]])
    m = convert("generic", d, d / "out", spec=_list_spec())
    assert m.source["storage"]["events_at_or_after_the_impression_dropped"] == 2
    assert _rows(d / "out")["clicks.item"] == [[5]]


def test_list_columns_of_different_lengths_are_an_error_naming_the_row(tmp_path):
    d = _lists(tmp_path, [1, 2], [T0 + 10, T0 + 10], [[5], [5, 6]], [[T0], [T0]])
    with pytest.raises(ColumnError,
                       match=r"impressions.parquet: columns 'hist_items' and 'hist_ts' differ in "
                                          r"length in row 1 \(2 items, 1 times"):
        convert("generic", d, d / "out", spec=_list_spec())
    with pytest.raises(ColumnError, match=r"missing columns \['hist_times'\]"):
        convert("generic", d, d / "out", spec=_list_spec(times="hist_times"))
