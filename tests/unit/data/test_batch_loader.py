import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from opengem.data.batch import CollateStats, collate, keep_recent, validate_rows
from opengem.data.loader import ShardLoader
from opengem.data.parquet import DataError, ShardWriter, list_array
from opengem.testing import random_table, tiny_schema


def _dataset(tmp_path, n_shards=3, rows=50, days=(0, 0, 1)):
    schema = tiny_schema()
    w = ShardWriter(tmp_path, schema)
    for i in range(n_shards):
        t = random_table(schema, rows + i, seed=i)
        # a unique row key so tests can follow rows through shuffles
        t = t.set_column(t.schema.get_field_index("user_id"), "user_id",
                         pa.array(np.arange(rows + i) + 1000 * i))
        w.write(t, f"s{i}", days[i])
    w.close({"train": sorted(set(days)), "test": [1]})
    return schema


def test_collate_is_jagged_and_keeps_lengths():
    schema = tiny_schema()
    lens = np.array([0, 3, 1, 7])
    t = random_table(schema, 4, lengths={"s0": lens, "s1": lens[::-1]})
    b = collate(t, schema)
    assert b.sequences["s0.item"].lengths().tolist() == lens.tolist()
    assert b.sequences["s1.event"].lengths().tolist() == lens[::-1].tolist()
    assert b.sequences["s0.item"].values().numel() == lens.sum()  # never padded
    ages = b.seq_age["s0"].values()
    assert (ages > 0).all()
    expected_items = np.concatenate(t.column("s0.item").to_pylist())
    assert b.sequences["s0.item"].values().tolist() == expected_items.tolist()
    assert b.dense.shape == (4, 2) and b.labels.shape == (4, 2) and b.true_probs.shape == (4, 2)
    assert b.sparse["tags"].lengths().tolist() == [len(x) for x in t.column("tags").to_pylist()]


def test_truncation_keeps_most_recent_and_is_counted():
    schema = tiny_schema()
    t = random_table(schema, 3, lengths={"s0": np.array([10, 2, 5]), "s1": np.array([1, 1, 1])})
    stats = CollateStats()
    b = collate(t, schema, {"s0": 4}, stats)
    assert b.sequences["s0.item"].lengths().tolist() == [4, 2, 4]
    rows = t.column("s0.item").to_pylist()
    assert b.sequences["s0.item"].values().tolist() == rows[0][-4:] + rows[1] + rows[2][-4:]
    assert stats.truncated_rows["s0"] == 2 and stats.truncated_events["s0"] == 6 + 1


def test_keep_recent_indices():
    idx, new_len = keep_recent(np.array([0, 3, 3, 8]), 2)
    assert idx.tolist() == [1, 2, 6, 7] and new_len.tolist() == [2, 0, 2]


def test_out_of_range_ids_map_to_oov_row_and_are_counted():
    schema = tiny_schema()
    t = random_table(schema, 4)
    t = t.set_column(t.schema.get_field_index("ad_id"), "ad_id", pa.array([0, 29, 30, -5]))
    stats = CollateStats()
    b = collate(t, schema, stats=stats)
    assert b.sparse["ad_id"].values().tolist() == [0, 29, 30, 30]
    assert stats.oov_ids["ad_id"] == 2


def test_validate_rows_quarantines_each_bad_class():
    schema = tiny_schema()
    t = random_table(schema, 8, lengths={"s0": np.full(8, 3), "s1": np.full(8, 2)})
    dense = t.column("activity").to_numpy().copy()
    dense[0] = np.nan
    dense[1] = np.inf
    click = t.column("click").to_numpy().copy()
    conv = t.column("conversion").to_numpy().copy()
    click[2], conv[2] = 0, 1  # conversion without click
    click[3] = 2  # label not in {0,1}
    dom = t.column("domain").to_numpy().copy()
    dom[4] = 9
    ts = t.column("s0.ts").to_pylist()
    ts[5] = [ts[5][2], ts[5][0], ts[5][1]]  # out of order
    ts[6] = [ts[6][0], ts[6][1], t.column("request_ts")[6].as_py() + 5]  # after the request
    for name, arr in [("activity", pa.array(dense)), ("click", pa.array(click)),
                      ("conversion", pa.array(conv)),
                      ("domain", pa.array(dom)), ("s0.ts", pa.array(ts))]:
        t = t.set_column(t.schema.get_field_index(name), name, arr)
    keep, reasons, per_row = validate_rows(t, schema)
    assert keep.tolist() == [False] * 7 + [True]
    got = dict(reasons)
    assert got["dense activity is NaN/inf"] == 2
    assert got["conversion=1 without click=1"] == 1
    assert got["label click not in {0,1}"] == 1
    assert got["domain out of range"] == 1
    assert got["s0.ts out of order"] == 1
    assert got["s0.ts not before request_ts"] == 1
    assert per_row[7] == "" and per_row[0] == "dense activity is NaN/inf"


def test_loader_quarantines_to_side_file(tmp_path):
    schema = tiny_schema()
    t = random_table(schema, 10)
    click = t.column("click").to_numpy().copy()
    click[3] = 5
    t = t.set_column(t.schema.get_field_index("click"), "click", pa.array(click))
    w = ShardWriter(tmp_path / "d", schema)
    w.write(t, "s0", 0)
    w.close({"train": [0]})
    loader = ShardLoader(tmp_path / "d", "train", 4, quarantine_dir=tmp_path / "q")
    n = sum(b.batch_size for b in loader)
    assert n == 9 and loader.quarantined == {"label click not in {0,1}": 1}
    side = pq.read_table(next((tmp_path / "q").glob("*.parquet")))
    assert (
        side.num_rows == 1
        and side.column("quarantine_reason")[0].as_py() == "label click not in {0,1}"
    )


def _keys(batches):
    return [int(x) for b in batches for x in b.user_id]


def test_loader_covers_split_once_in_time_order(tmp_path):
    _dataset(tmp_path)
    loader = ShardLoader(tmp_path, "train", 16, seed=3)
    keys = _keys(loader)
    assert len(keys) == len(set(keys)) == 50 + 51 + 52
    day1 = [k for k in keys if k >= 2000]
    assert keys[-len(day1):] == day1  # day 1 after day 0
    assert _keys(ShardLoader(tmp_path, "train", 16, seed=3)) == keys  # deterministic
    assert _keys(ShardLoader(tmp_path, "train", 16, seed=4)) != keys


@pytest.mark.parametrize("prefetch", [0, 2])
def test_resume_mid_epoch_yields_exactly_the_remaining_rows(tmp_path, prefetch):
    _dataset(tmp_path)
    full = _keys(ShardLoader(tmp_path, "train", 16, seed=1, epochs=2, prefetch=prefetch))
    first = ShardLoader(tmp_path, "train", 16, seed=1, epochs=2, prefetch=prefetch)
    it = iter(first)
    head = [next(it) for _ in range(7)]  # stops inside shard 2 of epoch 0
    state = first.state_dict()
    resumed = ShardLoader(tmp_path, "train", 16, seed=1, epochs=2, prefetch=prefetch)
    resumed.load_state_dict(state)
    assert _keys(head) + _keys(resumed) == full


def test_ranks_read_disjoint_shards(tmp_path):
    _dataset(tmp_path)
    k0 = _keys(ShardLoader(tmp_path, "train", 8, rank=0, world_size=2))
    k1 = _keys(ShardLoader(tmp_path, "train", 8, rank=1, world_size=2))
    assert not set(k0) & set(k1) and len(k0) + len(k1) == 153


def test_missing_and_broken_shards_name_the_file(tmp_path):
    _dataset(tmp_path)
    (tmp_path / "shards" / "s0.parquet").write_bytes(b"PAR1garbage")
    with pytest.raises(DataError, match="s0.parquet: not a readable Parquet file"):
        list(ShardLoader(tmp_path, "train", 8, shuffle=False))
    (tmp_path / "shards" / "s0.parquet").unlink()
    with pytest.raises(DataError, match="s0.parquet: listed in the manifest but missing"):
        list(ShardLoader(tmp_path, "train", 8, shuffle=False))
    with pytest.raises(DataError, match="unknown split 'valid'"):
        ShardLoader(tmp_path, "valid", 8)
    with pytest.raises(DataError, match="no dataset.json"):
        ShardLoader(tmp_path / "nowhere", "train", 8, schema=tiny_schema())


def test_shard_missing_a_column_is_an_error(tmp_path):
    schema = _dataset(tmp_path)
    t = random_table(schema, 5).drop_columns(["s1.ts"])
    pq.write_table(t, tmp_path / "shards" / "s1.parquet")
    with pytest.raises(DataError, match=r"s1.parquet: missing columns \['s1.ts'\]"):
        list(ShardLoader(tmp_path, "train", 8, shuffle=False))


def test_list_array_checks_lengths():
    with pytest.raises(ValueError, match="lengths sum to 3 but there are 2 values"):
        list_array(np.array([1, 2]), np.array([1, 2]))


def test_quarantine_is_counted_once_over_epochs(tmp_path):
    schema = tiny_schema()
    t = random_table(schema, 10)
    click = t.column("click").to_numpy().copy()
    click[[2, 7]] = 3
    t = t.set_column(t.schema.get_field_index("click"), "click", pa.array(click))
    w = ShardWriter(tmp_path / "d", schema)
    w.write(t, "s0", 0)
    w.close({"train": [0]})
    loader = ShardLoader(tmp_path / "d", "train", 4, epochs=3)
    assert sum(b.batch_size for b in loader) == 3 * 8  # every epoch drops the same 2 rows
    assert loader.quarantined == {"label click not in {0,1}": 2}  # counted once, not per epoch
