"""Embedding columns in the generic importer: Parquet list<float> or a delimited string in CSV."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from opengem.data.batch import collate
from opengem.data.loader import ShardLoader
from opengem.data.sources.common import ColumnError
from opengem.data.sources.generic import convert
from opengem.data.sources.spec import SpecError, check_spec
from opengem.features.schema import EmbeddingFeature, FeatureSchema

SPEC = {"tasks": [{"name": "click", "column": "clk"}], "sparse": [{"column": "ad", "group": "ad"}],
        "embeddings": [{"column": "emb", "name": "ad_content", "sep": " "}],
        "split": {"by": "random"}}


def _rows(n=40):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 3)).astype(np.float32), rng.integers(0, 5, n), rng.integers(0, 2, n)


def test_parquet_list_column(tmp_path):
    vec, ad, clk = _rows()
    pq.write_table(pa.table({"ad": ad, "clk": clk,
                             "emb": pa.array(vec.tolist(), pa.list_(pa.float32()))}),
                   tmp_path / "t.parquet")
    convert(tmp_path / "t.parquet", tmp_path / "out", SPEC)
    schema = FeatureSchema.load(tmp_path / "out")
    assert schema.embeddings == (EmbeddingFeature("ad_content", 3, "ad"),)
    got = np.concatenate([b.embeddings.numpy() for s in ("train", "valid", "test")
                          for b in ShardLoader(tmp_path / "out", s, 64)])
    assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, vec.tolist()))


def test_csv_delimited_string(tmp_path):
    vec, ad, clk = _rows(6)
    lines = ["ad,clk,emb"] + [f"{a},{c},{' '.join(f'{x:.6g}' for x in v)}" for a, c,
                              v in zip(ad, clk, vec)]
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    convert(tmp_path / "t.csv", tmp_path / "out",
            {**SPEC, "embeddings": [{**SPEC["embeddings"][0], "dim": 3}]})
    schema = FeatureSchema.load(tmp_path / "out")
    b = collate(pq.read_table(next((tmp_path / "out" / "shards").glob("*.parquet"))), schema)
    assert b.embeddings.shape[1] == 3


@pytest.mark.parametrize("cells, message", [
    (["1 2 3", "1 2", "0 0 0"], "row 1 has 2 values, expected 3"),
    (["1 2 3", "1 x 3", "0 0 0"], "row 1: 'x' is not a number"),
    (["1 2 3", "1 nan 3", "0 0 0"], "row 1 holds NaN/inf"),
])
def test_bad_csv_vectors_name_the_row(tmp_path, cells, message):
    lines = ["ad,clk,emb"] + [f"1,0,{c}" for c in cells]
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(ColumnError, match=message):
        convert(tmp_path / "t.csv", tmp_path / "out", SPEC)


def test_ragged_parquet_lists_are_an_error(tmp_path):
    ragged = pa.array([[0.1, 0.2], [0.3]], pa.list_(pa.float32()))
    pq.write_table(pa.table({"ad": [1, 2], "clk": [0, 1], "emb": ragged}), tmp_path / "t.parquet")
    with pytest.raises(ColumnError, match="row 1 has 1 values, expected 2"):
        convert(tmp_path / "t.parquet", tmp_path / "out", SPEC)
    pq.write_table(pa.table({"ad": [1, 2], "clk": [0, 1], "emb": pa.array([["a"], ["b"]])}),
                   tmp_path / "s.parquet")
    with pytest.raises(ColumnError, match="must be a list of numbers"):
        convert(tmp_path / "s.parquet", tmp_path / "out2", SPEC)


def test_spec_checks_embedding_keys():
    with pytest.raises(SpecError, match="dim must be > 0"):
        check_spec({**SPEC, "embeddings": [{"column": "emb", "dim": 0}]})
    with pytest.raises(SpecError, match="unknown key"):
        check_spec({**SPEC, "embeddings": [{"column": "emb", "width": 3}]})
    assert check_spec(SPEC)["embeddings"][0]["group"] == "ad"
