"""Real-data adapters: every source on a hand-written fixture, leakage, the generic spec's errors,
the CLI entry, and (skipped when absent) the public sets under the shared data folder."""

import argparse
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from opengem.data.loader import ShardLoader
from opengem.data.parquet import DataError, DatasetManifest
from opengem.data.sources import SOURCES, convert
from opengem.data.sources import cli as sources_cli
from opengem.data.sources.common import (
    ColumnError,
    SpecError,
    history,
    split_by_time,
    split_per_user,
)
from opengem.data.sources.ctr import SOURCES as CTR_SPECS
from opengem.data.sources.generic import referenced_columns
from opengem.data.sources.spec import check_spec
from opengem.features.schema import FeatureSchema, SchemaError

FIX = Path(__file__).parent / "fixtures"
_ROOT = Path(__file__).resolve().parents[3]
SHARED = next((p for p in (_ROOT.parent / "shared" / "data", _ROOT / "shared" / "data")
               if p.exists()),
              _ROOT.parent / "shared" / "data")


def _rows(out: Path, split: str | None = None) -> list[dict]:
    m = DatasetManifest.load(out)
    files = m.split_files(split) if split else m.files
    return [r for f in files for r in pq.read_table(out / f.path).to_pylist()]


def _check_histories(out: Path, schema: FeatureSchema) -> int:
    """Every stream of every row: ordered in time, strictly before the request, lists aligned."""
    n = 0
    for r in _rows(out):
        for s in schema.sequences:
            ts = r[s.ts_column]
            assert len(r[s.item_column]) == len(r[s.event_column]) == len(ts) <= s.max_len
            assert all(t < r[schema.time_column]
                       for t in ts), "a future (or same-time) event leaked into history"
            assert ts == sorted(ts)
            n += len(ts)
    return n


def _loads(out: Path, split: str = "train") -> None:
    loader = ShardLoader(out, split, batch_size=8, shuffle=False)
    batches = list(loader)
    assert sum(b.batch_size for b in batches) == sum(f.rows for f in loader.files)
    assert not loader.quarantined


# ------------------------------------------------------------------------------------- common
def test_history_keeps_strictly_earlier_events_most_recent_last():
    ev_user = np.array(["a", "a", "b", "a", "a"])
    ev_ts = np.array([30, 10, 10, 20, 20])
    ev_item = np.array([3, 1, 9, 2, 22])
    h = history(ev_user, ev_ts, {"item": ev_item}, np.array(["a", "a", "b", "c"]),
                np.array([20, 31, 10, 99]), 2)
    items, lens = h["item"]
    assert lens.tolist() == [1, 2, 0, 0]  # ties with the row are excluded; unknown user → empty
    # most recent 2 of user a before 31: ts 20 (input order), 30
    assert items.tolist() == [1, 22, 3]
    assert h["ts"][0].tolist() == [10, 20, 30]


def test_splits_by_time_and_per_user():
    day = split_by_time(np.arange(20)[::-1], valid=0.1, test=0.2)
    assert day.tolist() == [2] * 4 + [1] * 2 + [0] * 14
    user = np.array([0] * 10 + [1] * 3)
    day = split_per_user(user, np.r_[np.arange(10)[::-1], 0, 1, 2], 0.1, 0.1)
    assert day[:10].tolist() == [2, 1] + [0] * 8 and day[10:].tolist() == [0, 0, 0]


# ----------------------------------------------------------------------------------- movielens
@pytest.fixture(scope="module")
def movielens_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("ml") / "data"
    convert("movielens", FIX / "movielens", out)
    return out


def test_movielens_fixture(movielens_out):
    schema = FeatureSchema.load(movielens_out)
    m = DatasetManifest.load(movielens_out)
    # users 1, 2: 8/1/1 of 10; user 3: 4 train
    assert m.source["rows"] == {"train": 20, "valid": 2, "test": 2}
    assert schema.task_names == ["click"] and schema.domains.names == ("movielens",)
    assert {"age", "gender", "occupation", "genres", "movie_id", "hour"} <= {
        f.name for f in schema.sparse
    }
    assert _check_histories(movielens_out, schema) > 0
    rows = _rows(movielens_out)
    # user 1 rated two movies at t=1200: neither sees the other, both see exactly the two
    # earlier ratings
    # user 1 is 24: age bucket 1
    tied = [r for r in rows if r["request_ts"] == 1200 and r["age"] == 1]
    assert len(tied) == 2 and all(r["ratings.ts"] == [1000, 1100] for r in tied)
    # the held-out rows are each user's latest ones; the test movie 70 is unseen in train → OOV
    assert sorted(r["request_ts"] for r in _rows(movielens_out, "test")) == [1800, 1800]
    vocab = schema.sparse_feature("movie_id").vocab_size
    assert any(r["movie_id"] == vocab for r in _rows(movielens_out, "test"))
    assert sum(r["click"] for r in rows) == 15  # ratings >= 4
    for split in ("train", "valid", "test"):
        _loads(movielens_out, split)


def test_movielens_history_is_exactly_the_earlier_ratings(movielens_out):
    """Leakage: a row's history is the set of its user's ratings strictly before it,
    nothing else."""
    lines = (FIX / "movielens" / "ml-100k.inter").read_text().splitlines()[1:]
    ratings = [tuple(int(float(x)) for x in line.split("\t")) for line in lines]
    rows = _rows(movielens_out)
    ages = {r["user_id"]: r["age"] for r in rows}
    by_age = {1: 1, 5: 2, 0: 3}  # user 1 is 24, user 2 53, user 3 17
    for r in rows:
        user = by_age[ages[r["user_id"]]]
        want = sorted((ts, rating - 1) for u, _, rating,
                      ts in ratings if u == user and ts < r["request_ts"])
        assert list(zip(r["ratings.ts"], r["ratings.event"])) == want


def test_movielens_grouplens_files_give_the_same_rows(movielens_out, tmp_path):
    """GroupLens' own u.data / u.user / u.item (``|``-separated, 19 genre flags) read
    like RecBole's."""
    from opengem.data.sources.movielens import GENRES

    def recbole(name):
        return [x.split("\t")
                for x in (FIX / "movielens" / f"ml-100k.{name}").read_text().splitlines()[1:]]

    (tmp_path / "u.data").write_text("".join("\t".join(r) + "\n" for r in recbole("inter")))
    (tmp_path / "u.user").write_text("".join("|".join(r) + "\n" for r in recbole("user")))
    items = []
    for item, title, year, genres in recbole("item"):
        flags = ["1" if g in genres.split(" ") else "0" for g in GENRES]
        items.append("|".join([item, title, f"01-Jan-{year}" if year else "", "", "http://x",
                               *flags]))
    (tmp_path / "u.item").write_text("\n".join(items) + "\n", encoding="latin-1")
    convert("movielens", tmp_path, tmp_path / "out")
    assert _rows(tmp_path / "out") == _rows(movielens_out)


# --------------------------------------------------------------------------------- open bandit
def test_open_bandit_fixture(tmp_path):
    out = tmp_path / "obd"
    m = convert("open_bandit", FIX / "open_bandit", out)
    schema = FeatureSchema.load(out)
    assert m.splits == {"train": [0, 1], "valid": [2], "test": [3]}
    assert m.source["rows"] == {"train": 4, "valid": 2, "test": 3} and m.source["policies"] == {
        "random": 6,
        "bts": 3,
    }
    assert schema.domains.names == ("all_items", "men", "women") and not schema.sequences
    rows = _rows(out)
    assert sorted(r["position"] for r in rows) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    shown = next(r for r in rows if r["request_ts"] == 1574590260)  # item 2, affinities (0, 1, 3)
    assert shown["affinity_item"] == pytest.approx(np.log1p(3.0)) and shown["click"] == 1
    assert {r["domain"] for r in rows} == {0, 1}
    _loads(out, "test")


# ------------------------------------------------------------------------------------ CTR sets
def _ctr_table(source: str, n: int = 12) -> dict[str, list[str]]:
    """``n`` made-up rows holding every column the built-in spec reads (raw columns for
    derived ones)."""
    spec = check_spec(CTR_SPECS[source][0])
    cols = {c: [f"v{i % 3}" for i in range(n)] for c in referenced_columns(spec)}
    for f in spec["dense"]:
        cols[f["column"]] = [str(0.5 * i) if i % 4 else "" for i in range(n)]
    for t in spec["tasks"]:
        cols[t["column"]] = [str(int(i % 2 == 0)) for i in range(n)]
    if source == "avazu":
        for c in ("ts", "hour_of_day", "surface", "user"):
            cols.pop(c)
        cols["hour"] = [f"141021{i % 24:02d}" for i in range(n)]
        cols["app_id"] = ["ecad2386" if i % 2 else "a1" for i in range(n)]
    if source == "taobao":
        cols["time_stamp"] = [f"2017-05-06 00:00:{i:02d}" for i in range(n)]
        cols["click_sequence"] = ["", "v1", "v0^v2^v1"] * (n // 3)
    if source == "aliexpress":
        cols.pop("country")
    return cols


def _write_csv(path: Path, cols: dict[str, list[str]]) -> None:
    names = list(cols)
    lines = [",".join(names)] + [",".join(cols[c][i] for c in names)
                                 for i in range(len(cols[names[0]]))]
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("source", sorted(CTR_SPECS))
def test_ctr_source_writes_a_valid_layout(source, tmp_path):
    _write_csv(tmp_path / f"{source}_sample.csv", _ctr_table(source))
    (tmp_path / "README.txt").write_text("not a table of this source\n")
    out = tmp_path / "out"
    m = convert(source, tmp_path, out, seed=3)
    schema = FeatureSchema.load(out)
    assert sum(m.source["rows"].values()) == 12 and m.source["rows"]["test"] == 1
    assert m.source["skipped"] == [str(tmp_path / "README.txt")]
    assert ("conversion" in schema.task_names) == (source in ("aliccp", "aliexpress"))
    _check_histories(out, schema)
    _loads(out, "train")


def test_ctr_split_from_file_names_and_countries_as_domains(tmp_path):
    for name, n in (("ae_nl_train.csv", 6), ("ae_es_train.csv", 6), ("ae_nl_test.csv", 3)):
        _write_csv(tmp_path / name, {k: v[:n] for k, v in _ctr_table("aliexpress").items()})
    m = convert("aliexpress", tmp_path, tmp_path / "out")
    schema = FeatureSchema.load(tmp_path / "out")
    assert schema.domains.names == ("es", "nl")
    assert m.source["rows"] == {"train": 12, "valid": 0, "test": 3}
    assert {r["domain"] for r in _rows(tmp_path / "out", "test")} == {1}


def test_taobao_click_sequence_is_ordered_before_the_request(tmp_path):
    _write_csv(tmp_path / "taobao.csv", _ctr_table("taobao"))
    convert("taobao", tmp_path / "taobao.csv", tmp_path / "out")
    schema = FeatureSchema.load(tmp_path / "out")
    # 4 rows of each of "", "v1", "v0^v2^v1"
    assert _check_histories(tmp_path / "out", schema) == 4 * 4
    third = next(r for r in _rows(tmp_path / "out") if len(r["clicks.item"]) == 3)
    assert third["clicks.ts"] == [third["request_ts"] - k for k in (3, 2, 1)]


# ------------------------------------------------------------------------------------- generic
def test_generic_fixture_with_a_history_of_earlier_clicks(tmp_path):
    out = tmp_path / "g"
    m = convert("generic", FIX / "generic" / "events.csv", out, spec=FIX / "generic" / "spec.json")
    schema = FeatureSchema.load(out)
    assert m.source["rows"] == {"train": 6, "valid": 3, "test": 3}
    assert schema.domains.names == ("search", "feed") and schema.task_names == [
        "click",
        "conversion",
    ]
    assert (
        schema.sparse_feature("cate").vocab_size == 16 and schema.sparse_feature("tags").multi_hot
    )
    assert schema.stream("clicks").attributes[0].name == "cate"
    _check_histories(out, schema)
    lines = [x.split(",") for x in (FIX / "generic" / "events.csv").read_text().splitlines()[1:]]
    clicks = {}  # user → [(ts, ad)] of clicked rows
    for user, ts, ad, *_, clk, _buy in lines:
        if clk == "1":
            clicks.setdefault(user, []).append((int(ts), ad))
    for r, (user, ts, *_rest) in zip(sorted(_rows(out),
                                            key=lambda r: (r["request_ts"], r["user_id"])),
                                     sorted(lines, key=lambda x: (int(x[1]), x[0]))):
        # max_len 2, most recent
        want = [t for t, _ in sorted(clicks.get(user, [])) if t < int(ts)][-2:]
        assert r["clicks.ts"] == want
    # "search" is names[0]
    assert [r["domain"] for r in _rows(out) if r["request_ts"] == 105] == [0]
    for split in ("train", "valid", "test"):
        _loads(out, split)


def _spec(**changes) -> dict:
    spec = json.loads((FIX / "generic" / "spec.json").read_text())
    spec.update(changes)
    return spec


@pytest.mark.parametrize("changes, message", [
    ({"colour": "red"}, "unknown key(s) ['colour'] in top level"),
    ({"tasks": [{"name": "click"}]}, "tasks[0] is missing ['column']"),
    ({"tasks": [{"name": "click", "column": "clk", "weight": 2}]},
     "unknown key(s) ['weight'] in tasks[0]"),
    ({"sparse": [{"column": "ad", "hash_size": "big"}]}, "sparse[0].hash_size must be a int"),
    ({"sparse": [{"column": "ad", "hash_size": 8, "vocab_size": 8}]},
     "hash_size or vocab_size, not both"),
    ({"dense": [{"column": "price", "transform": "sqrt"}]}, "transform must be none or log1p"),
    ({"split": {"by": "coin"}}, "split.by must be one of"),
    ({"split": {"by": "time", "test": 1.5}}, "split.valid and split.test"),
    ({"sequence": {"item": "page", "max_len": 4}},
     "sequence.item 'page' must be a single-valued column"),
    ({"sequence": {"item": "ad", "max_len": 4, "only": "buy"}},
     "sequence.only 'buy' is not a task"),
    ({"tasks": []}, "tasks must list at least one label column"),
    ({"dense": [{"column": "price", "missing": "zero"}]},
     "missing must be one of quarantine/indicator"),
    ({"dense": [{"column": "price", "missing": "indicator", "fill": 0.0}]},
     "fill or missing=indicator, not both"),
])
def test_generic_spec_errors_name_the_key(changes, message, tmp_path):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(_spec(**changes)))
    with pytest.raises(SpecError) as e:
        convert("generic", FIX / "generic" / "events.csv", tmp_path / "out", spec=path)
    assert message in str(e.value) and str(path) in str(e.value)


def test_generic_spec_file_errors(tmp_path):
    with pytest.raises(SpecError, match="spec file not found"):
        convert("generic", FIX / "generic" / "events.csv", tmp_path / "o",
                spec=tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SpecError, match="not valid JSON"):
        convert("generic", FIX / "generic" / "events.csv", tmp_path / "o",
                spec=tmp_path / "bad.json")


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("price", "cost", 1), "missing columns ['price']"),
    (lambda t: t.replace(",9.5,", ",cheap,", 1), "column 'price': 'cheap' is not a number"),
    (lambda t: t.replace(",1,0\n", ",2,0\n", 1),
     "column 'clk': label value 2.0 in row 0 is not 0 or 1"),
    (lambda t: t.replace(",feed,", ",home,", 1), "value 'home' is not in domain.names"),
    (lambda t: t.replace("u1,100,", "u1,yesterday,", 1), "'yesterday' in row 0 is not a unix time"),
])
def test_generic_data_errors_name_file_column_and_value(edit, message, tmp_path):
    data = tmp_path / "events.csv"
    data.write_text(edit((FIX / "generic" / "events.csv").read_text()))
    with pytest.raises(ColumnError) as e:
        convert("generic", data, tmp_path / "out", spec=FIX / "generic" / "spec.json")
    assert message in str(e.value) and "events.csv" in str(e.value)
    assert isinstance(e.value, ValueError) and isinstance(e.value, DataError)


def test_generic_keeps_missing_values_of_a_missing_indicator_feature(tmp_path):
    """``missing: indicator``: empty cells stay NaN (not the fill), the rows load, the manifest
    counts them."""
    data = tmp_path / "events.csv"
    lines = (FIX / "generic" / "events.csv").read_text().splitlines()
    lines[1], lines[3] = lines[1].replace(",9.5,", ",,"), lines[3].replace(",3,", ",,")
    data.write_text("\n".join(lines) + "\n")
    # without the option or a fill: an error
    with pytest.raises(ColumnError, match="empty value in row 0"):
        convert("generic", data, tmp_path / "err",
                spec=_spec(dense=[{"column": "price", "group": "ad"}]))
    spec = _spec(dense=[{"column": "price", "group": "ad", "transform": "log1p",
                         "missing": "indicator"}])
    m = convert("generic", data, tmp_path / "out", spec=spec)
    schema = FeatureSchema.load(tmp_path / "out")
    empty = sum(x.split(",")[4] == "" for x in lines[1:])  # the two made here and the fixture's own
    assert (
        empty == 3
        and schema.dense[0].missing == "indicator"
        and m.source["missing"] == {"price": empty}
    )
    price = [r["price"] for r in _rows(tmp_path / "out")]
    assert sum(np.isnan(p) for p in price) == empty and sum(p == 0.0 for p in price) == 0
    for split in ("train", "valid", "test"):
        _loads(tmp_path / "out", split)


def test_generic_domain_all_is_reserved(tmp_path):
    data = tmp_path / "events.csv"
    data.write_text((FIX / "generic" / "events.csv").read_text().replace(",feed,", ",all,"))
    spec = _spec(domain={"column": "page"})
    with pytest.raises(ColumnError, match="the value 'all' is reserved"):
        convert("generic", data, tmp_path / "out", spec=spec)


def test_generic_reads_parquet_and_files_splits(tmp_path):
    import pyarrow.csv as pa_csv

    table = pa_csv.read_csv(FIX / "generic" / "events.csv")
    pq.write_table(table.slice(0, 8), tmp_path / "a.parquet")
    pq.write_table(table.slice(8), tmp_path / "b.parquet")
    spec = _spec(files={"train": ["a.parquet"], "test": ["b.parquet"]}, split={"by": "files"})
    spec["dense"][0]["fill"] = 0.0
    m = convert("generic", tmp_path, tmp_path / "out", spec=spec)
    assert m.source["rows"] == {"train": 8, "valid": 0, "test": 4}
    _check_histories(tmp_path / "out", FeatureSchema.load(tmp_path / "out"))


def test_generic_history_of_every_earlier_row_with_label_events(tmp_path):
    spec = _spec(sequence={"name": "views", "item": "ad", "event": "clk", "max_len": 8})
    convert("generic", FIX / "generic" / "events.csv", tmp_path / "out", spec=spec)
    schema = FeatureSchema.load(tmp_path / "out")
    assert schema.stream("views").num_event_types == 2
    _check_histories(tmp_path / "out", schema)
    # u1 at 160
    row = next(r for r in _rows(tmp_path / "out") if r["request_ts"] == 160 and r["user_id"] == 0)
    # clk of u1's earlier rows
    assert row["views.ts"] == [100, 110, 130] and row["views.event"] == [1, 1, 0]


def test_generic_millisecond_times(tmp_path):
    lines = (FIX / "generic" / "events.csv").read_text().splitlines()
    ms = [lines[0]] + [",".join([x.split(",")[0], x.split(",")[1] + "000", *x.split(",")[2:]])
                       for x in lines[1:]]
    (tmp_path / "events.csv").write_text("\n".join(ms) + "\n")
    convert("generic", tmp_path / "events.csv", tmp_path / "out", spec=_spec(time_unit="ms"))
    convert("generic", FIX / "generic" / "events.csv", tmp_path / "ref", spec=_spec())
    assert _rows(tmp_path / "out") == _rows(tmp_path / "ref")
    with pytest.raises(SpecError, match="time_unit must be one of"):
        check_spec(_spec(time_unit="h"))


def test_generic_schema_name_clash_is_a_schema_error(tmp_path):
    spec = _spec(sparse=[{"column": "ad", "name": "domain"}])
    spec.pop("sequence")
    with pytest.raises(SchemaError, match="duplicate name 'domain'"):
        convert("generic", FIX / "generic" / "events.csv", tmp_path / "out", spec=spec)


# ----------------------------------------------------------------------------------------- CLI
def test_cli_import_parses_and_runs(tmp_path):
    parser = argparse.ArgumentParser()
    sources_cli.add_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["import", "--source", "generic", "--in",
                              str(FIX / "generic" / "events.csv"),
                              "--out", str(tmp_path / "g"), "--spec",
                              str(FIX / "generic" / "spec.json")])
    assert sources_cli.run(args) == {"rows": {"train": 6, "valid": 3, "test": 3}, "shards": 3,
                                     "out": str(tmp_path / "g"),
                                    "layout": 1, "storage": None}
    args = parser.parse_args(["import", "--source", "movielens", "--in", str(FIX / "movielens"),
                              "--out", str(tmp_path / "m"), "--spec", "x.json"])
    with pytest.raises(ValueError, match="--spec is only for --source generic"):
        sources_cli.run(args)
    with pytest.raises(ValueError, match="--spec is required"):
        convert("generic", FIX / "generic" / "events.csv", tmp_path / "x")
    with pytest.raises(SystemExit):
        parser.parse_args(["import", "--source", "nope", "--in", "a", "--out", "b"])
    assert set(SOURCES) == {"movielens", "open_bandit", "generic", *CTR_SPECS}


# ------------------------------------------------------------------------------- end to end
def test_movielens_output_trains_one_tiny_step(movielens_out, tmp_path):
    from opengem.config import apply_overrides
    from opengem.recipes import recipe
    from opengem.train.trainer import train

    cfg = apply_overrides(recipe("tiny"),
                          ["data.batch_size=8", "train.max_steps=1", "data.prefetch=0"])
    cfg.train.progress = False
    final = train(cfg, movielens_out, tmp_path / "run")
    assert final["steps"] == 1 and final["examples"] == 8


# ------------------------------------------------------------------------ real shared data
def _shared(sub: str) -> Path:
    path = SHARED / sub
    if not path.exists():
        pytest.skip(f"shared data {sub} not present")
    return path


def test_real_movielens_100k(tmp_path):
    from opengem.data.sources import movielens

    # the default 256: ~2x slower
    m = movielens.convert(_shared("movielens-100k"), tmp_path / "ml", max_len=32)
    assert m.source["rows"] == {"train": 80808, "valid": 9596, "test": 9596}
    t = pq.read_table(tmp_path / "ml" / m.split_files("test")[0].path,
                      columns=["request_ts", "ratings.ts"])
    req = t.column("request_ts").to_numpy()
    ts = t.column("ratings.ts").combine_chunks()
    lens = np.diff(ts.offsets.to_numpy())
    flat = ts.values.to_numpy()
    assert (flat < np.repeat(req, lens)).all() and lens.max() == 32
    _loads_first_batch(tmp_path / "ml")


def _loads_first_batch(out: Path) -> None:
    loader = ShardLoader(out, "test", batch_size=256)
    assert next(iter(loader)).batch_size == 256 and not loader.quarantined


def test_real_open_bandit(tmp_path):
    m = convert("open_bandit", _shared("open-bandit-small"), tmp_path / "obd")
    assert m.source["rows"] == {"train": 43569, "valid": 8425, "test": 8006}
    _loads_first_batch(tmp_path / "obd")


@pytest.mark.parametrize("source, sub, rows", [
    ("criteo", "criteo", 315), ("avazu", "avazu", 100), ("taobao", "taobao-ad-seq", 200),
    ("aliccp", "ali-ccp-mtl", 200), ("aliexpress", "aliexpress-mtl", 320)])
def test_real_ctr_samples(source, sub, rows, tmp_path):
    m = convert(source, _shared(f"ctr-samples/{sub}"), tmp_path / "out")
    assert sum(m.source["rows"].values()) == rows
    _check_histories(tmp_path / "out", FeatureSchema.load(tmp_path / "out"))
    _loads(tmp_path / "out", "train")


def test_fixtures_are_tiny():
    assert sum(f.stat().st_size for f in FIX.rglob("*") if f.is_file()) < 20_000
