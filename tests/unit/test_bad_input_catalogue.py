"""The bad-input catalogue: every kind of bad input gives an error of our own type that names the
file/row/column/value, or a counted, logged quarantine (rows in the side file with a reason), or
a counted, logged repair. One test per entry; its docstring says which behaviour and why.
"""

import dataclasses
import errno
import json
import logging
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_fs

from opengem.checkpoint import CheckpointError, checkpoint_dir, latest_checkpoint, load_checkpoint
from opengem.config import ConfigError, apply_overrides
from opengem.data.loader import ShardLoader
from opengem.data.parquet import DataError, ShardWriter
from opengem.features.schema import FeatureSchema, SchemaError
from opengem.parallel import ParallelConfigError, ParallelDims
from opengem.recipes import recipe
from opengem.run import BASE_RATES_FILE, CONFIG_FILE, SCHEMA_FILE, load_run_model
from opengem.testing import random_table, tiny_schema
from opengem.train.trainer import train
from opengem.world.generate import build_schema
from opengem.world.presets import world_config

ROWS = 12


def _write(tmp_path, table, schema=None, name="s0"):
    """A one-shard dataset (train split) holding ``table``; returns its directory."""
    w = ShardWriter(tmp_path / "d", schema or tiny_schema())
    w.write(table, name, 0)
    w.close({"train": [0]})
    return tmp_path / "d"


def _set(table, name, values, type_=None):
    return table.set_column(table.schema.get_field_index(name), name, pa.array(values, type_))


def _load(data, tmp_path, **kw):
    """Read the whole split; returns (loader, rows handed out)."""
    loader = ShardLoader(data, "train", 4, shuffle=False, quarantine_dir=tmp_path / "q", **kw)
    return loader, sum(b.batch_size for b in loader)


def _quarantined(tmp_path, data, reason, rows):
    """Assert ``rows`` (indices) were quarantined for ``reason``: counted, logged, in the
    side file."""
    loader, n = _load(data, tmp_path)
    assert loader.quarantined == {reason: len(rows)} and n == ROWS - len(rows)
    side = pq.read_table(next((tmp_path / "q").glob("*.parquet")))
    assert side.column("quarantine_reason").to_pylist() == [reason] * len(rows)
    assert side.column("quarantine_shard").to_pylist() == ["shards/s0.parquet"] * len(rows)
    return side


# ------------------------------------------------------------------------------- data files
def test_missing_column(tmp_path):
    """Error: a model cannot be fed without it. Names the file and the column."""
    data = _write(tmp_path, random_table(tiny_schema(), ROWS))
    pq.write_table(random_table(tiny_schema(), ROWS).drop_columns(["quality"]),
                   data / "shards" / "s0.parquet")
    with pytest.raises(DataError, match=r"s0.parquet: missing columns \['quality'\]"):
        _load(data, tmp_path)


@pytest.mark.parametrize("column, values, words", [
    ("activity", ["x"] * ROWS, "column 'activity' is string, expected a number"),
    ("tags", list(range(ROWS)), "column 'tags' is int64, expected a list of integers"),
    ("s0.ts", [[1.5]] * ROWS,
     "column 's0.ts' is list<element: double>, expected a list of integers"),
    ("click", ["yes"] * ROWS, "column 'click' is string, expected a number"),
])
def test_wrong_dtype(tmp_path, column, values, words):
    """Error: a whole column of the wrong type is a producer bug, not a bad row. File +
    column + types."""
    data = _write(tmp_path, _set(random_table(tiny_schema(), ROWS), column, values))
    with pytest.raises(DataError,
                       match=rf"s0.parquet: {words}".replace("[", r"\[").replace("(", r"\(")):
        _load(data, tmp_path)
    if column == "click":  # training reads the labels first (base rates): the same error
        with pytest.raises(DataError, match=column):
            train(recipe("tiny"), data, tmp_path / "run")


def test_nan_inf_dense(tmp_path):
    """Quarantine: a NaN would poison the loss; imputing would teach a value nobody saw."""
    t = random_table(tiny_schema(), ROWS)
    v = t.column("activity").to_numpy().copy()
    v[[2, 5]] = [np.nan, -np.inf]
    side = _quarantined(tmp_path, _write(tmp_path, _set(t, "activity", v)),
                        "dense activity is NaN/inf", [2, 5])
    assert (
        np.isnan(side.column("activity")[0].as_py())
        and side.column("activity")[1].as_py() == -np.inf
    )


@pytest.mark.parametrize("bad, reason", [([0.1, float("nan"), 0.0], "embedding content is NaN/inf"),
                                         ([0.1, 0.2], "embedding content length != 3")])
def test_bad_embedding_vector(tmp_path, bad, reason):
    """Quarantine: a NaN vector poisons the loss like a NaN dense value; a vector of another length
    is not the encoder's output the feature names (padding or cutting it would invent one)."""
    from opengem.features.schema import EmbeddingFeature

    schema = dataclasses.replace(tiny_schema(), embeddings=(EmbeddingFeature("content", 3, "ad"),))
    t = random_table(schema, ROWS)
    v = t.column("content").to_pylist()
    v[1] = v[4] = bad
    _quarantined(tmp_path, _write(tmp_path, _set(t, "content", v, pa.list_(pa.float32())), schema),
                 reason, [1, 4])


def test_nan_inf_event_value(tmp_path):
    """Quarantine: a per-event value (``SequenceStream.values``: a dwell, a price) reaches the event
    token through a Linear, so a NaN poisons the loss as a dense one does; in a v2 event log the
    rows whose history holds the event are quarantined the same way (``opengem validate`` errs)."""
    from opengem.testing import valued_schema

    schema = valued_schema()
    t = random_table(schema, ROWS, lengths={"s0": np.full(ROWS, 2)})
    v = t.column("s0.dwell").to_pylist()
    v[3], v[10] = [float("nan"), 1.0], [2.0, float("inf")]
    side = _quarantined(tmp_path,
                        _write(tmp_path, _set(t, "s0.dwell", v, pa.list_(pa.float32())), schema),
                        "s0.dwell is NaN/inf", [3, 10])
    assert np.isnan(side.column("s0.dwell")[0].as_py()[0])


def test_negative_or_out_of_vocab_ids(tmp_path, caplog):
    """Repair, counted and logged once: ids unseen when the vocabulary was fixed (new ads, -1 for
    "unknown") are normal in ads logs; they share the OOV row, as at serving time."""
    t = _set(random_table(tiny_schema(), ROWS), "ad_id", [-1, 30, 999] + [0] * (ROWS - 3))
    with caplog.at_level(logging.WARNING, "opengem.data.loader"):
        loader, n = _load(_write(tmp_path, t), tmp_path)
    assert n == ROWS and loader.stats.oov_ids == {"ad_id": 3} and not loader.quarantined
    assert "repairing oov_ids of ad_id" in caplog.text


def test_empty_sequences_are_valid_null_ones_quarantined(tmp_path):
    """Empty history: valid (new users), kept with length 0. A null list: quarantined (a broken
    join; an empty history is written ``[]``)."""
    schema = tiny_schema()
    lens = np.array([0] * ROWS)
    loader = ShardLoader(_write(tmp_path, random_table(schema, ROWS, lengths={"s0": lens})),
                         "train", ROWS)
    b = next(iter(loader))
    assert b.sequences["s0.item"].lengths().tolist() == [0] * ROWS and not loader.quarantined
    t = random_table(schema, ROWS)
    items = t.column("s0.item").to_pylist()
    items[4] = None
    _quarantined(tmp_path / "n",
                 _write(tmp_path / "n", _set(t, "s0.item", items, pa.list_(pa.int64()))),
                 "s0.item is null", [4])


def test_sequences_longer_than_max(tmp_path, caplog):
    """Repair, counted and logged once: the most recent max_len events are kept (the model's limit
    is a modelling choice, the data is still right)."""
    schema = tiny_schema()
    lens = np.array([70, 3] + [1] * (ROWS - 2))  # the schema's max_len is 64
    with caplog.at_level(logging.INFO, "opengem.data.loader"):
        loader, n = _load(_write(tmp_path, random_table(schema, ROWS, lengths={"s0": lens})),
                          tmp_path)
    assert (
        n == ROWS
        and loader.stats.truncated_rows == {"s0": 1}
        and loader.stats.truncated_events == {"s0": 6}
    )
    assert [
        r.levelname for r in caplog.records if "repairing truncated_rows of s0" in r.message
    ] == ["INFO"]


def test_timestamps_out_of_order(tmp_path):
    """Quarantine: the event order is the model's input; reordering would guess at a logging bug."""
    t = random_table(tiny_schema(), ROWS, lengths={"s0": np.full(ROWS, 3)})
    ts = t.column("s0.ts").to_pylist()
    ts[7] = ts[7][::-1]
    _quarantined(tmp_path, _write(tmp_path, _set(t, "s0.ts", ts)), "s0.ts out of order", [7])


def test_labels_not_in_0_1(tmp_path):
    """Quarantine: a 2 or a -1 is not a label; null is allowed (masked out of the loss)."""
    t = random_table(tiny_schema(), ROWS)
    y = t.column("click").to_numpy().copy()
    y[[1, 9]] = [2, -1]
    conv = t.column("conversion").to_pylist()
    conv[3] = None
    t = _set(_set(t, "click", y), "conversion", conv, pa.int8())
    side = _quarantined(tmp_path, _write(tmp_path, t), "label click not in {0,1}", [1, 9])
    assert side.column("click").to_pylist() == [2, -1]


def test_conversion_without_click(tmp_path):
    """Quarantine, where the schema says so (``Task.requires``; the synthetic world declares it
    because it draws conversions only after clicks): such a row is a logging error."""
    assert FeatureSchema.from_dict(json.loads(tiny_schema().to_json())).tasks[1].requires == "click"
    assert {t.name: t.requires for t in build_schema(world_config("tiny")).tasks} == \
        {"click": None, "conversion": "click"}
    d = tiny_schema().to_dict()
    d["tasks"][1]["requires"] = "conversion"
    with pytest.raises(SchemaError, match="task 'conversion' requires unknown task 'conversion'"):
        FeatureSchema.from_dict(d)
    t = random_table(tiny_schema(), ROWS)
    click, conv = t.column("click").to_numpy().copy(), t.column("conversion").to_numpy().copy()
    click[6], conv[6] = 0, 1
    _quarantined(tmp_path, _write(tmp_path, _set(_set(t, "click", click), "conversion", conv)),
                 "conversion=1 without click=1", [6])


@pytest.mark.parametrize("damage", ["empty", "truncated", "fewer_rows"])
def test_empty_or_truncated_parquet(tmp_path, damage):
    """Error naming the file: a damaged shard cannot be read around (the manifest promised
    its rows)."""
    data = _write(tmp_path, random_table(tiny_schema(), ROWS))
    path = data / "shards" / "s0.parquet"
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:  # readable, but not the file the manifest lists
        pq.write_table(random_table(tiny_schema(), ROWS - 2), path)
    words = (
        "holds 10 rows but the manifest lists 12"
        if damage == "fewer_rows"
        else "not a readable Parquet file"
    )
    with pytest.raises(DataError, match=f"s0.parquet: {words}"):
        _load(data, tmp_path)


def test_schema_that_does_not_match_the_data(tmp_path):
    """Error naming file and column: the schema.json beside the shards must describe them."""
    data = _write(tmp_path, random_table(tiny_schema(), ROWS))
    d = tiny_schema().to_dict()
    d["dense"] = [*d["dense"], {"name": "price", "group": "ad"}]
    FeatureSchema.from_dict(d).save(data / SCHEMA_FILE)
    with pytest.raises(DataError, match=r"s0.parquet: missing columns \['price'\]"):
        _load(data, tmp_path)
    d = tiny_schema().to_dict()
    d["sparse"][1]["multi_hot"] = True
    FeatureSchema.from_dict(d).save(data / SCHEMA_FILE)
    with pytest.raises(DataError, match="column 'ad_id' is int64, expected a list of integers"):
        _load(data, tmp_path)


# ------------------------------------------------------------------------------- configs
@pytest.mark.parametrize("override, words", [
    ("optim.lrr=1", "unknown config key 'optim.lrr'"),
    ("model.embedding_dim=15", "embedding_dim 15 is not divisible by model.sequence.num_heads 2"),
    ("model.wukong.num_layers=0", "model.wukong.num_layers must be >= 1, got 0"),
    ("parallel.dp_replicate=0", "dp_replicate must be >= 1"),
    ("data.batch_size=abc", "data.batch_size: cannot read 'abc' as int"),
])
def test_config_unknown_key_or_impossible_value(override, words):
    """Error naming the key and the value, before anything is built."""
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        apply_overrides(recipe("tiny"), [override])


def test_parallel_degrees_that_do_not_fit_the_world():
    """Error at launch, naming the degrees and the world size (only then is the world
    size known)."""
    cfg = apply_overrides(recipe("tiny"), ["parallel.dp_replicate=1", "parallel.dp_shard=2"])
    with pytest.raises(ParallelConfigError,
                       match=r"dp_replicate \(1\) × dp_shard \(2\) = 2, but the world size is 4"):
        ParallelDims.from_config(cfg.parallel, 4)


# ------------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 2-step run on a small dataset of the tiny schema, and that dataset."""
    tmp = tmp_path_factory.mktemp("run")
    data = _write(tmp, random_table(tiny_schema(), 64))
    cfg = apply_overrides(recipe("tiny"),
                          ["data.batch_size=32", "train.progress=false", "train.threads=1"])
    train(cfg, data, tmp / "run")
    return cfg, data, tmp / "run"


def test_checkpoint_from_another_schema_or_model(tiny_run, tmp_path):
    """Error naming both sides: resuming or evaluating with another schema/model cannot be right."""
    cfg, data, run = tiny_run
    bigger = apply_overrides(recipe("tiny"),
                             ["data.batch_size=32", "train.progress=false",
                              "model.embedding_dim=32"])
    with pytest.raises(CheckpointError,
                       match=r"from another model: model\.embedding_dim 16 vs 32 \(checkpoint vs"):
        train(bigger, data, run, resume=True)
    other = _write(tmp_path, random_table(tiny_schema(num_domains=3), 64),
                   tiny_schema(num_domains=3))
    want = f"from another schema: schema '{tiny_schema().fingerprint()}' vs '{tiny_schema(3).fingerprint()}'"
    with pytest.raises(CheckpointError, match=want):
        train(cfg, other, run, resume=True)
    config = json.loads((run / CONFIG_FILE).read_text())
    config["model"]["embedding_dim"] = 32
    (tmp_path / "r").mkdir()
    for name in (SCHEMA_FILE, BASE_RATES_FILE):
        (tmp_path / "r" / name).write_text((run / name).read_text())
    (tmp_path / "r" / CONFIG_FILE).write_text(json.dumps(config))
    checkpoint_dir(tmp_path / "r").symlink_to(checkpoint_dir(run))
    with pytest.raises(CheckpointError, match=r"does not fit this model \(.*Size mismatch.*32"):
        load_run_model(tmp_path / "r")


@pytest.mark.parametrize("where", ["dcp", "trainer_state"])
def test_disk_full_while_saving_a_checkpoint(tiny_run, tmp_path, monkeypatch, where):
    """Error saying disk full and where; the partial step-N.tmp is removed, the previous checkpoint
    stays LATEST and loads."""
    cfg, data, run0 = tiny_run
    run = tmp_path / "run"
    shutil.copytree(run0, run)
    before = latest_checkpoint(run)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(*((dcp_fs, "_write_item", full) if where == "dcp"
                          else (torch, "save", full)))
    more = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, epochs=2))
    with pytest.raises(CheckpointError,
                       match=rf"disk full while saving "
                             rf"checkpoint {run}/checkpoints/step-00000004.tmp"
                       r" \(.*No space left on device\); removed it, step-00000002 is intact"):
        train(more, data, run, resume=True)
    monkeypatch.undo()
    assert latest_checkpoint(run) == before and not list(checkpoint_dir(run).glob("*.tmp"))
    model = load_run_model(run)[0]  # loads LATEST
    assert load_checkpoint(before, model)["step"] == 2


def test_null_values_in_feature_columns(tmp_path):
    """Quarantine (not listed in the issue, found on the way): a null id, time or domain has no
    meaning, and would crash collate."""
    t = random_table(tiny_schema(), ROWS)
    ad = t.column("ad_id").to_pylist()
    ad[8] = None
    _quarantined(tmp_path, _write(tmp_path, _set(t, "ad_id", ad, pa.int64())), "ad_id is null", [8])

