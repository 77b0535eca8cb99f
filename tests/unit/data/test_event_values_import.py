"""The generic importer's per-event numeric values (``values``: dwell seconds, price): read from an
events table through DuckDB's bucketing into the v2 log, or from earlier impression rows; missing
ones (empty, NaN, inf) dropped or filled and counted, non-numbers and name clashes named."""

import copy
import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

from opengem.cli import main
from opengem.data.events import ShardReader
from opengem.data.parquet import DatasetManifest
from opengem.data.sources import convert
from opengem.data.sources.common import ColumnError, SpecError
from opengem.data.sources.fake_log import T0, spec, write_log
from opengem.data.sources.spec import check_spec
from opengem.features.schema import FeatureSchema

pytest.importorskip("duckdb")

BAD = [float("nan"), float("inf"), None, 1e39]  # each a missing value, the last beyond float32


def _rows(out) -> dict:
    m, schema = DatasetManifest.load(out), FeatureSchema.load(out)
    reader = ShardReader(out, m, schema)
    return pa.concat_tables([reader.read(f, schema.columns()) for f in m.files]).to_pydict()


def _log(d, dwell=None, csv=False):
    """5 users' impressions and 120 events (unique times, so a time names an event; one event of a
    user without impressions) with a ``dwell`` column: ``dwell`` given, else numbers with the
    ``BAD`` cells at rows 3, 10, 20 and 30."""
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(5)
    n, m = 40, 120
    pq.write_table(pa.table({
        "user": rng.integers(0, 5, n), "ts": T0 + rng.choice(np.arange(5000, 90_000), n, False),
        "item_id": rng.integers(0, 30, n), "cat": rng.integers(0, 5, n),
        "click": rng.integers(0, 2, n)}), d / "impressions.parquet")
    if dwell is None:
        dwell = list(np.round(rng.exponential(20.0, m), 3))
        for row, x in zip((3, 10, 20, 30), BAD):
            dwell[row] = x
    item = rng.integers(0, 30, m)
    ev = {"user": list(rng.integers(0, 5, m - 1)) + [99],
          "ts": T0 + rng.choice(np.arange(0, 90_000), m, False), "item_id": item,
          "action": rng.choice(["view", "like"], m), "cat": item % 5, "dwell": dwell}
    if csv:
        pa_csv.write_csv(pa.table(ev), d / "events.csv")
    else:
        pq.write_table(pa.table(ev), d / "events.parquet")
    return d


def _spec(values=("dwell",), **seq) -> dict:
    s = spec(max_len=8, values=values if isinstance(values, str) else list(values), **seq)
    s["sparse"] = [{"column": "item_id", "group": "ad", "vocab_size": 30},
                   {"column": "cat", "group": "ad", "vocab_size": 5}]
    return s


def _input(d) -> dict:
    """Each event's time → its dwell as read (None: a missing cell), of the known users."""
    ev = pq.read_table(d / "events.parquet").to_pydict()
    return {t: x for t, x, u in zip(ev["ts"], ev["dwell"], ev["user"]) if u != 99}


def _finite(x) -> bool:
    return x is not None and bool(np.isfinite(x)) and abs(x) < 3.4e38


@pytest.mark.parametrize("buckets", [1, 3])
def test_values_follow_their_events_into_the_log_and_histories(tmp_path, buckets):
    d = _log(tmp_path / "log")
    m = convert("generic", d, d / "out", spec=_spec(buckets=buckets))
    schema = FeatureSchema.load(d / "out")
    assert schema.stream("clicks").values == ("dwell",)
    st = m.source["storage"]
    assert st["dwell_missing_or_non_finite"] == 4  # NaN, inf, null, 1e39
    assert st["events_with_missing_or_non_finite_values_dropped"] == 4
    assert st["events_of_users_without_impressions_dropped"] == 1
    # the log: every kept event once, with its value (float32), the bad ones gone
    given = _input(d)
    log = pa.concat_tables([pq.read_table(d / "out" / e.path) for e in m.events["clicks"]])
    assert len(m.events["clicks"]) == buckets and log.schema.field("dwell").type == pa.float32()
    got = dict(zip(log.column("ts").to_pylist(), log.column("dwell").to_pylist()))
    assert got == {t: float(np.float32(x)) for t, x in given.items() if _finite(x)}
    # the joined histories: values aligned with their events' times
    rows = _rows(d / "out")
    pairs = [(t, x) for ts, xs in zip(rows["clicks.ts"], rows["clicks.dwell"])
             for t, x in zip(ts, xs)]
    assert len(pairs) > 50 and all(got[t] == x for t, x in pairs)
    assert main(["--quiet", "validate", str(d / "out")]) == 0


def test_clean_values_add_a_column_and_change_nothing_else(tmp_path):
    """The same events in the same order, ids and buckets as the spec without values."""
    d = _log(tmp_path / "log", dwell=list(np.linspace(0.5, 60.0, 120)))
    with_v = convert("generic", d, tmp_path / "with", spec=_spec(buckets=2))
    without = convert("generic", d, tmp_path / "without", spec=_spec(values=(), buckets=2))
    assert [e.path for e in with_v.events["clicks"]] == [e.path for e in without.events["clicks"]]
    for a, b in zip(with_v.events["clicks"], without.events["clicks"]):
        ta, tb = pq.read_table(tmp_path / "with" / a.path), pq.read_table(tmp_path / "without"
                                                                         / b.path)
        assert ta.drop_columns(["dwell"]).equals(tb)
    a, b = _rows(tmp_path / "with"), _rows(tmp_path / "without")
    assert {k: v for k, v in a.items() if k != "clicks.dwell"} == b
    st = with_v.source["storage"]
    assert st["dwell_missing_or_non_finite"] == 0
    assert st["events_with_missing_or_non_finite_values_dropped"] == 0


def test_fill_and_log1p_keep_every_event(tmp_path):
    d = _log(tmp_path / "log")
    v = {"column": "dwell", "name": "dwell_log", "transform": "log1p", "fill": -1.0}
    m = convert("generic", d, d / "out", spec=_spec(values=[v]))
    st = m.source["storage"]
    assert st["dwell_log_missing_or_non_finite"] == 4
    assert "events_with_missing_or_non_finite_values_dropped" not in st
    log = pa.concat_tables([pq.read_table(d / "out" / e.path) for e in m.events["clicks"]])
    got = dict(zip(log.column("ts").to_pylist(), log.column("dwell_log").to_pylist()))
    want = {t: float(np.float32(np.log1p(max(x if _finite(x) else -1.0, 0.0))))
            for t, x in _input(d).items()}
    assert got == want  # a filled value is transformed too: log1p(max(-1, 0)) = 0


def test_missing_error_names_the_file_column_and_first_value(tmp_path):
    d = _log(tmp_path / "log")
    with pytest.raises(ColumnError, match=r"events.parquet: column 'dwell': 4 events have a "
                                          r"missing value .*; the first: 'nan', row 3\)"):
        convert("generic", d, d / "out", spec=_spec(values=[{"column": "dwell",
                                                             "missing": "error"}]))


def test_csv_values_empty_cells_are_missing_and_text_must_be_numbers(tmp_path):
    dwell = [str(x) for x in np.arange(120) + 0.5]
    dwell[7], dwell[8] = "", " 2.5 "  # an empty cell (missing); spaces around a number are fine
    d = _log(tmp_path / "ok", dwell=dwell, csv=True)
    m = convert("generic", d, d / "out", spec=_spec(files=["events.csv"]))
    assert m.source["storage"]["dwell_missing_or_non_finite"] == 1
    dwell[9] = "12s"
    d = _log(tmp_path / "bad", dwell=dwell, csv=True)
    with pytest.raises(ColumnError, match=r"events.csv: column 'dwell': '12s' \(row 9\) is not a "
                                          r"number"):
        convert("generic", d, d / "out", spec=_spec(files=["events.csv"]))


@pytest.mark.parametrize("dwell, message", [
    (["3.5"] * 60 + ["n/a"] + ["1"] * 59, ": 'n/a' (row 60) is not a number"),
    ([True] * 120, " is BOOLEAN; a per-event value column holds numbers"),
])
def test_a_value_column_of_the_wrong_type_names_file_column_and_value(tmp_path, dwell, message):
    d = _log(tmp_path / "log", dwell=dwell)
    with pytest.raises(ColumnError, match=re.escape("events.parquet: column 'dwell'" + message)):
        convert("generic", d, d / "out", spec=_spec())


def test_a_missing_value_column_names_the_file(tmp_path):
    d = _log(tmp_path / "log")
    with pytest.raises(ColumnError, match=r"events.parquet: missing columns \['watch'\]"):
        convert("generic", d, d / "out", spec=_spec(values=["watch"]))


@pytest.mark.parametrize("values, message", [
    (["cat"], "values[0].name 'cat' clashes with an attribute's name"),
    ([{"column": "dwell", "name": "ts"}], "'ts' clashes with an event log column"),
    ([{"column": "dwell", "name": "item"}], "'item' clashes with an event log column"),
    ([{"column": "dwell", "name": "user_id"}], "'user_id' clashes with an event log column"),
    (["dwell", {"column": "w", "name": "dwell"}], "'dwell' clashes with another value's name"),
    ([{"column": "dwell", "name": "dwell-s"}], "name 'dwell-s' must be letters"),
    ([{"column": "dwell", "transform": "log"}], "transform must be none or log1p"),
    ([{"column": "dwell", "missing": "zero"}], "missing must be one of drop/fill/error"),
    ([{"column": "dwell", "missing": "fill"}], "missing 'fill' needs a fill value"),
    ([{"column": "dwell", "missing": "drop", "fill": 0.0}], "a fill value needs missing 'fill'"),
    ([{"column": "dwell", "fill": float("nan")}], "fill must be a finite float32"),
    ([{"column": "dwell", "scale": 2.0}], "unknown key(s) ['scale']"),
    ([3], "values[0] must be a column name or an object"),
    ("dwell", "sequence.values must be a list"),
])
def test_value_spec_errors_name_the_key(values, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        check_spec(_spec(values=values))


@pytest.mark.parametrize("kind", ["lists", "column"])
def test_values_from_lists_or_a_column_are_a_spec_error(kind):
    seq = ({"from": "lists", "column": "items", "times": "times"} if kind == "lists"
           else {"from": "column", "column": "items"})
    s = {**_spec(), "sequence": {"name": "h", "item": "item_id", "max_len": 5,
                                 "values": ["dwell"], **seq}}
    with pytest.raises(SpecError, match=f"sequence.values: per-event values are read from an "
                                        f"events table .* not from {kind}"):
        check_spec(s)


def test_values_from_earlier_rows_with_a_missing_one_dropped_as_an_event_only(tmp_path):
    """``from: rows``: each earlier row's price; a row without one is still an impression."""
    rng = np.random.default_rng(2)
    n = 40
    price = list(np.round(rng.exponential(5.0, n), 2))
    price[4], price[9] = None, float("inf")
    imp = {"user": [f"u{k}" for k in rng.integers(0, 4, n)], "ts": T0 + np.arange(n) * 100,
           "ad": [f"a{k}" for k in rng.integers(0, 6, n)], "click": rng.integers(0, 2, n),
           "price": pa.array(price, pa.float64())}
    pq.write_table(pa.table(imp), tmp_path / "imp.parquet")
    s = {"tasks": [{"name": "click", "column": "click"}], "sparse": [{"column": "ad"}],
         "user": "user", "time": "ts", "split": {"by": "user_time"},
         "sequence": {"name": "h", "from": "rows", "item": "ad", "max_len": 50,
                      "values": [{"column": "price", "name": "paid"}]}}
    m = convert("generic", tmp_path / "imp.parquet", tmp_path / "out", spec=s)
    assert m.source["values"] == {"h": {"paid_missing_or_non_finite": 2,
                                        "events_with_missing_or_non_finite_values_dropped": 2}}
    rows = _rows(tmp_path / "out")
    assert sum(rows["day"].count(k) for k in (0, 1, 2)) == n  # every row is still an impression
    by_ts = dict(zip(imp["ts"].tolist(), price))
    pairs = [(t, x) for ts, xs in zip(rows["h.ts"], rows["h.paid"]) for t, x in zip(ts, xs)]
    assert len(pairs) > 20 and all(x == float(np.float32(by_ts[t])) for t, x in pairs)
    assert not {imp["ts"][4], imp["ts"][9]} & {t for t, _ in pairs}
    assert main(["--quiet", "validate", str(tmp_path / "out")]) == 0
    strict = copy.deepcopy(s)
    strict["sequence"]["values"][0]["missing"] = "error"
    with pytest.raises(ColumnError, match=r"imp.parquet: column 'price': 2 event rows have a "
                                          r"missing value .*; the first: row 4\)"):
        convert("generic", tmp_path / "imp.parquet", tmp_path / "strict", spec=strict)
    # a non-number names the file, the column and the row
    text = [None if x is None else str(x) for x in price[:-1]] + ["cheap"]  # a text column
    pq.write_table(pa.table({**imp, "price": text}), tmp_path / "imp.parquet")
    with pytest.raises(ColumnError, match=r"imp.parquet: column 'price': 'cheap' \(row 39\) is "
                                          r"not a number"):
        convert("generic", tmp_path / "imp.parquet", tmp_path / "out2", spec=s)


def test_fake_log_dwell_adds_a_column_to_the_same_log(tmp_path):
    plain = write_log(tmp_path / "plain", rows=50, users=5, events_per_user=20, seed=4)
    dwell = write_log(tmp_path / "dwell", rows=50, users=5, events_per_user=20, seed=4,
                      dwell=True)
    a, b = (pq.read_table(p / "events.parquet") for p in (plain, dwell))
    assert b.drop_columns(["dwell"]).equals(a) and "dwell" not in a.column_names
    assert pq.read_table(dwell / "impressions.parquet").equals(
        pq.read_table(plain / "impressions.parquet"))
    m = convert("generic", dwell, dwell / "out", spec=spec(values=["dwell"]))
    assert FeatureSchema.load(dwell / "out").stream("clicks").values == ("dwell",)
    assert m.source["storage"]["dwell_missing_or_non_finite"] == 0
    assert json.loads((dwell / "out" / "schema.json").read_text())["meta"]["spec"]["sequence"][
        "values"] == [{"column": "dwell", "name": "dwell", "transform": "none",
                       "missing": "drop"}]


def test_one_stream_of_a_pair_carries_values(tmp_path):
    """Two streams, one with values: the other's log has none."""
    write_log(tmp_path, rows=60, users=6, events_per_user=10, seed=2, ad_clicks_per_user=4,
              dwell=True)
    s = spec(ad_clicks=3, values=["dwell"])
    m = convert("generic", tmp_path, tmp_path / "out", spec=copy.deepcopy(s))
    schema = FeatureSchema.load(tmp_path / "out")
    assert schema.stream("clicks").values == ("dwell",) and schema.stream("ad_clicks").values == ()
    ads_log = pq.read_table(tmp_path / "out" / m.events["ad_clicks"][0].path)
    assert "dwell" not in ads_log.column_names
    assert main(["--quiet", "validate", str(tmp_path / "out")]) == 0
