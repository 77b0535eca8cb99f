"""The generic importer's several behaviour streams (``sequences``): two events tables with their
own item id spaces (an organic stream of content items, an ads stream whose items are ad ids),
shared attributes, one user bucketing, each stream's bad input named or counted, and the one-stream
spec written either way byte for byte."""

import copy
import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from opengem.cli import main
from opengem.data.events import ShardReader
from opengem.data.parquet import LAYOUT_V1, LAYOUT_V2, DatasetManifest
from opengem.data.sources import convert
from opengem.data.sources.common import ColumnError, SpecError, Vocab, split_per_user
from opengem.data.sources.fake_log import T0
from opengem.features.schema import FeatureSchema

pytest.importorskip("duckdb")

MAX_LEN = {"organic": 6, "ad_clicks": 4}


def _log(d, ads_ts_scale: int = 1):
    """6 users' impressions, an organic events table (content items "c<k>", their own id space,
    with a category shared with the ads' ``category``: one value outside it, one event of a user
    without impressions) and an ads-click table (items are ad ids, with the advertiser)."""
    rng = np.random.default_rng(7)
    d.mkdir(parents=True, exist_ok=True)
    n = 60
    ad = rng.integers(0, 10, n)
    pq.write_table(pa.table({
        "user": [f"u{u}" for u in rng.integers(0, 6, n)],
        "ts": T0 + rng.choice(np.arange(1000, 100_000), n, replace=False),
        "ad_id": [f"a{a}" for a in ad], "category": [f"k{a % 5}" for a in ad],
        "advertiser": [f"v{a % 4}" for a in ad], "click": rng.integers(0, 2, n)}),
        d / "impressions.parquet")
    m = 150
    item = rng.integers(0, 40, m)
    pq.write_table(pa.table({
        "uid": [f"u{u}" for u in rng.integers(0, 6, m - 1)] + ["stranger"],
        "when": T0 + rng.choice(np.arange(0, 100_000), m, replace=False),
        "content": [f"c{i}" for i in item], "kind": rng.choice(["view", "like"], m),
        "cat": [f"k{i % 5}" for i in item[:-2]] + ["k99", "k1"]}), d / "organic.parquet")
    k = 80
    ad = rng.integers(0, 12, k)  # a10, a11: never shown, outside ad_id's vocabulary
    pq.write_table(pa.table({
        "uid": [f"u{u}" for u in rng.integers(0, 6, k)],
        "when": (T0 + rng.choice(np.arange(0, 100_000), k, replace=False)) * ads_ts_scale,
        "ad": [f"a{a}" for a in ad], "advertiser": [f"v{a % 4}" for a in ad]}),
        d / "ad_clicks.parquet")
    return d


ORGANIC = {"name": "organic", "from": "events", "files": ["organic.parquet"], "user": "uid",
           "time": "when", "item": "content", "event": "kind", "max_len": MAX_LEN["organic"],
           "attributes": [{"column": "cat", "name": "content_category", "matches": "category"}]}
ADS = {"name": "ad_clicks", "from": "events", "files": ["ad_clicks.parquet"], "user": "uid",
       "time": "when", "item": "ad", "matches": "ad_id", "max_len": MAX_LEN["ad_clicks"],
       "attributes": [{"column": "advertiser", "matches": "advertiser"}]}


def _spec(*streams) -> dict:
    return {"files": {"train": ["impressions.parquet"], "test": []}, "user": "user", "time": "ts",
            "tasks": [{"name": "click", "column": "click"}],
            "sparse": [{"column": "ad_id", "group": "ad"}, {"column": "category", "group": "ad"},
                       {"column": "advertiser", "group": "ad"}],
            "dense": [],
            "split": {"by": "user_time", "valid": 0.2, "test": 0.2},
            "sequences": [copy.deepcopy(s) for s in (streams or (ORGANIC, ADS))]}


def _rows(out) -> dict:
    m, schema = DatasetManifest.load(out), FeatureSchema.load(out)
    reader = ShardReader(out, m, schema)
    return pa.concat_tables([reader.read(f, schema.columns()) for f in m.files]).to_pydict()


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    d = _log(tmp_path_factory.mktemp("log"))
    m = convert("generic", d, d / "out", spec=_spec())
    return d, m


def test_two_event_tables_import_with_their_id_spaces(imported):
    d, m = imported
    schema = FeatureSchema.load(d / "out")
    organic, ads = schema.stream("organic"), schema.stream("ad_clicks")
    sizes = {f.name: f.vocab_size for f in schema.sparse}
    assert ads.matches == "ad_id" and ads.item_vocab_size == sizes["ad_id"]
    assert ads.attributes[0].matches == "advertiser" and ads.attributes[0].name == "advertiser"
    assert organic.matches is None and organic.num_event_types == 2
    assert (organic.attributes[0].name, organic.attributes[0].matches) == ("content_category",
                                                                         "category")
    assert m.layout == LAYOUT_V2 and set(m.events) == {"organic", "ad_clicks"}
    st = m.source["storage"]
    assert st["layout"] == 2 and set(st["streams"]) == {"organic", "ad_clicks"}
    assert {e.bucket for es in m.events.values() for e in es} == set(range(st["buckets"]))
    org = st["streams"]["organic"]
    assert org["events_of_users_without_impressions_dropped"] == 1
    assert org["content_category_out_of_range_to_oov"] == 1  # "k99": not a category
    assert org["item_out_of_range_to_oov"] > 0  # content first seen after the train period
    assert st["streams"]["ad_clicks"]["item_out_of_range_to_oov"] > 0  # a10, a11
    assert main(["--quiet", "validate", str(d / "out")]) == 0


def test_histories_equal_a_brute_force_recomputation(imported):
    d, _ = imported
    imp = pq.read_table(d / "impressions.parquet").to_pydict()
    user, ts = np.array(imp["user"]), np.array(imp["ts"])
    train = split_per_user(user, ts, 0.2, 0.2) == 0
    last_train = {u: ts[train & (user == u)].max(initial=np.iinfo(np.int64).min)
                  for u in set(user)}
    got = _rows(d / "out")
    raw_user = np.unique(user)[np.array(got["user_id"])]
    for name, file, item_vocab in (
        ("organic", "organic.parquet", None),
        ("ad_clicks", "ad_clicks.parquet", Vocab(np.array(imp["ad_id"])[train])),
    ):
        ev = pq.read_table(d / file).to_pydict()
        eu, et, items = np.array(ev["uid"]), np.array(ev["when"]), np.array(ev[
            "content" if name == "organic" else "ad"])
        if item_vocab is None:  # fitted on the events a train row's history can hold
            seen = np.array([t < last_train.get(u, np.iinfo(np.int64).min)
                             for u, t in zip(eu, et)])
            item_vocab = Vocab(items[seen])
        checked = 0
        for r in range(0, len(raw_user), 7):
            mine = np.flatnonzero((eu == raw_user[r]) & (et < got["request_ts"][r]))
            mine = mine[np.argsort(et[mine], kind="stable")][-MAX_LEN[name]:]
            assert got[f"{name}.ts"][r] == et[mine].tolist()
            assert got[f"{name}.item"][r] == item_vocab(items[mine]).tolist()
            checked += len(mine)
        assert checked > 10


def test_a_tiny_run_trains_and_matches_the_ads_items(imported, tmp_path):
    from opengem.config import apply_overrides
    from opengem.model.foundation import GEM
    from opengem.recipes import recipe
    from opengem.train.trainer import train

    d, _ = imported
    cfg = apply_overrides(recipe("tiny"), ["data.batch_size=8", "train.max_steps=2",
                                           "data.prefetch=0", "model.target_match_items=true"])
    cfg.train.progress = False
    final = train(cfg, d / "out", tmp_path / "run")
    assert final["steps"] == 2
    pairs = GEM(FeatureSchema.load(d / "out"), cfg.model).match_pairs
    assert ("ad_clicks.item", "ad_id") in [p[:2] for p in pairs["ad_clicks"]]
    assert ("ad_clicks.advertiser", "advertiser") in [p[:2] for p in pairs["ad_clicks"]]
    assert [p[:2] for p in pairs["organic"]] == [("organic.content_category", "category")]


def _files(out) -> dict:
    return {str(f.relative_to(out)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(out.rglob("*")) if f.is_file()}


def test_one_stream_as_sequence_or_as_a_list_of_one_is_byte_identical(imported):
    d, _ = imported
    one = _spec(ADS)
    convert("generic", d, d / "list", spec=one)
    one["sequence"] = one.pop("sequences")[0]
    convert("generic", d, d / "single", spec=one)
    assert _files(d / "list") == _files(d / "single") and len(_files(d / "list")) > 3


def test_two_per_row_streams_and_an_attribute_of_its_own(imported, tmp_path):
    d, _ = imported
    spec = _spec({"name": "clicked", "from": "rows", "item": "ad_id", "only": "click",
                  "max_len": 3, "attributes": [{"column": "advertiser", "name": "adv",
                                                "hash_size": 7}]},
                 {"name": "shown", "item": "ad_id", "matches": "ad_id", "max_len": 5,
                  "attributes": ["category"]})
    m = convert("generic", d / "impressions.parquet", tmp_path / "out", spec=spec)
    schema = FeatureSchema.load(tmp_path / "out")
    assert m.layout == LAYOUT_V1 and [s.name for s in schema.sequences] == ["clicked", "shown"]
    assert schema.stream("shown").matches == "ad_id" and schema.stream("clicked").matches is None
    assert schema.stream("clicked").attributes[0].vocab_size == 7
    got = pq.read_table(tmp_path / "out" / m.files[0].path).to_pydict()
    assert max(map(len, got["shown.item"])) == 5 and max(map(len, got["clicked.item"])) <= 3


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.update(sequence=ADS), "give sequence (one stream) or sequences"),
    (lambda s: s["sequences"][1].update(name="organic"),
     "sequences[0] and sequences[1] are both named 'organic'"),
    (lambda s: s["sequences"][1].update(matches="price"),
     "sequences[1].matches 'price' is a dense feature"),
    (lambda s: s["sequences"][1].update(matches="tags"),
     "sequences[1].matches 'tags' is a multi-hot sparse feature"),
    (lambda s: s["sequences"][1].update(matches="nope"),
     "sequences[1].matches 'nope' is not a feature"),
    (lambda s: s["sequences"][0]["attributes"][0].update(matches="user_seg"),
     "sequences[0].attributes[0].matches 'user_seg' is not a feature"),
    (lambda s: s["sequences"][0]["attributes"][0].update(vocab="fit"),
     "give one of matches, vocab, hash_size, vocab_size"),
    (lambda s: s["sequences"][0].update(item_vocab="learn"), "item_vocab must be 'fit'"),
    (lambda s: s["sequences"][1].update(buckets=2) or s["sequences"][0].update(buckets=3),
     "streams give different buckets [2, 3]"),
    (lambda s: s["sequences"].append({"name": "shown", "item": "ad_id", "max_len": 2}),
     "streams from events/lists and from rows/column cannot be mixed"),
    (lambda s: s["sequences"].append({"name": "x", "from": "rows", "item": "ad_id",
                                      "max_len": 2, "item_vocab": "fit"}),
     "sequences[2].item_vocab: an item vocabulary of the stream's own is for streams from events"),
])
def test_spec_errors_name_the_stream_and_key(edit, message, tmp_path):
    spec = _spec()
    spec["sparse"].append({"column": "tags", "multi_hot": "|"})
    spec["dense"] = [{"column": "price"}]
    edit(spec)
    with pytest.raises(SpecError) as e:
        convert("generic", tmp_path, tmp_path / "out", spec=spec)
    assert message in str(e.value)


def test_an_own_attribute_named_like_a_feature_of_its_size_is_an_error(imported, tmp_path):
    d, _ = imported
    spec = _spec(ADS)
    spec["sequences"][0]["attributes"] = [{"column": "advertiser", "hash_size": 4}]
    spec["sparse"][2]["hash_size"] = 4
    with pytest.raises(SpecError, match=r"sequences\[0\].attributes\[0\] 'advertiser' .* rename "
                                        r"it, or declare \"matches\": 'advertiser'"):
        convert("generic", d, tmp_path / "out", spec=spec)
    spec["sequences"][0]["attributes"][0]["name"] = "ad_advertiser"  # renamed: imports
    m = convert("generic", d, tmp_path / "out", spec=spec)
    assert FeatureSchema.load(tmp_path / "out").stream("ad_clicks").attributes[0].matches is None
    assert m.layout == LAYOUT_V2


def test_a_stream_missing_a_column_in_its_events_file_names_the_file(imported, tmp_path):
    d, _ = imported
    spec = _spec()
    spec["sequences"][1]["attributes"][0]["column"] = "brand"
    with pytest.raises(ColumnError, match=r"ad_clicks.parquet: missing columns \['brand'\]"):
        convert("generic", d, tmp_path / "out", spec=spec)


def test_a_stream_in_another_time_unit_is_an_error_naming_its_time_unit_key(tmp_path):
    d = _log(tmp_path / "log", ads_ts_scale=1000)
    with pytest.raises(ColumnError, match=r"ad_clicks.parquet: column 'when'.*"
                                          r"set sequences\[1\].time_unit"):
        convert("generic", d, tmp_path / "out", spec=_spec())
    spec = _spec()
    spec["sequences"][1]["time_unit"] = "ms"
    m = convert("generic", d, tmp_path / "out", spec=spec)
    assert sum(e.rows for e in m.events["ad_clicks"]) == 80


def _lists(d, prefix: bool):
    """Two list streams on 2 rows of one user; the second's lists are prefixes of one history
    unless not (its first row saw item 9, which the later row's list lacks)."""
    d.mkdir(parents=True, exist_ok=True)
    bought, bought_ts = ([[5], [5, 6]], [[T0 + 1], [T0 + 1, T0 + 12]]) if prefix else (
        [[9], [5, 6]], [[T0 + 5], [T0 + 1, T0 + 12]])
    pq.write_table(pa.table({
        "user": ["u1", "u1"], "ts": [T0 + 10, T0 + 30], "ad_id": [1, 2],
        "category": ["k1", "k2"], "advertiser": ["v1", "v1"], "click": [0, 1],
        "seen": pa.array([[1], [1, 2]], pa.list_(pa.int64())),
        "seen_ts": pa.array([[T0 + 1], [T0 + 1, T0 + 20]], pa.list_(pa.int64())),
        "bought": pa.array(bought, pa.list_(pa.int64())),
        "bought_ts": pa.array(bought_ts, pa.list_(pa.int64()))}),
        d / "impressions.parquet")
    return d


def test_list_streams_share_one_layout(tmp_path):
    streams = [{"name": n, "from": "lists", "column": n, "times": f"{n}_ts", "item": "ad_id",
                "max_len": 4} for n in ("seen", "bought")]
    spec = _spec(*streams)
    spec["sparse"][0]["vocab_size"] = 10  # the listed items are ad ids as given
    d = _lists(tmp_path / "a", prefix=True)
    m = convert("generic", d, d / "out", spec=spec)
    assert m.layout == LAYOUT_V2 and set(m.events) == {"seen", "bought"}
    d = _lists(tmp_path / "b", prefix=False)
    m = convert("generic", d, d / "out", spec=spec)
    st = m.source["storage"]["streams"]
    assert m.layout == LAYOUT_V1 and st["bought"]["rows_not_prefixes"] == 2
    assert st["seen"]["layout"] == 1 and "'bought'" in st["seen"]["why"]
    got = pq.read_table(d / "out" / m.files[0].path).to_pydict()
    assert sorted(got["seen.item"]) == [[1], [1, 2]]
    # beside an events stream the dataset must be v2: lists that are not prefixes are an error
    pq.write_table(pa.table({"uid": ["u1"], "when": [T0 + 3], "ad": ["1"]}),
                   d / "ad_clicks.parquet")
    spec = _spec(streams[1], {**ADS, "attributes": []})
    spec["sparse"][0]["vocab_size"] = 10
    with pytest.raises(ColumnError, match="stream 'bought': 2 of 2 rows' lists are not"):
        convert("generic", d, d / "out2", spec=spec)
