"""Precomputed content embeddings (``EmbeddingFeature``): schema, collate, quarantine, the
X_0 token."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pytest
import torch

from opengem.data.batch import collate, validate_rows
from opengem.features.schema import EmbeddingFeature, FeatureSchema, SchemaError
from opengem.model.build import build_gem, materialize
from opengem.model.foundation import GEMConfig
from opengem.testing import random_table, tiny_schema


def with_embedding(dim: int = 4, name: str = "content", group: str = "ad") -> FeatureSchema:
    return dataclasses.replace(tiny_schema(), embeddings=(EmbeddingFeature(name, dim, group),))


def test_schema_round_trip_and_plain_schemas_keep_their_json(tmp_path):
    s = with_embedding()
    s.save(tmp_path / "schema.json")
    back = FeatureSchema.load(tmp_path)
    assert back == s and back.embeddings == (EmbeddingFeature("content", 4, "ad"),)
    assert back.fingerprint() == s.fingerprint() != tiny_schema().fingerprint()
    assert "content" in s.columns() and s.embedding_dim == 4
    assert "embeddings" not in tiny_schema().to_dict()  # so old schemas hash as before


@pytest.mark.parametrize("emb, message", [
    (EmbeddingFeature("content", 0), "dim must be a positive integer"),
    (EmbeddingFeature("ad_id", 3), "duplicate name 'ad_id'"),
    (EmbeddingFeature("content", 3, "item"), "group must be user/ad/context"),
])
def test_invalid_embedding_features_name_the_problem(emb, message):
    with pytest.raises(SchemaError, match=message):
        dataclasses.replace(tiny_schema(), embeddings=(emb,))
    with pytest.raises(SchemaError, match=message):
        FeatureSchema.from_dict({**tiny_schema().to_dict(),
                                 "embeddings": [dataclasses.asdict(emb)]})


def test_collate_gives_the_vectors_as_float32_rows():
    s = with_embedding(3)
    t = random_table(s, 5)
    rows = [[float(i), i + 0.5, -1.0] for i in range(5)]
    t = t.set_column(t.column_names.index("content"), "content",
                     pa.array(rows, pa.list_(pa.float32())))
    b = collate(t, s)
    assert b.embeddings.dtype == torch.float32 and b.embeddings.shape == (5, 3)
    assert torch.equal(b.embeddings, torch.tensor(rows))
    # a fixed_size_list column and a slice read the same
    fixed = t.set_column(t.column_names.index("content"), "content",
                         pa.array(rows, pa.list_(pa.float32(), 3)))
    assert torch.equal(collate(fixed.slice(2, 3), s).embeddings, torch.tensor(rows[2:]))
    assert collate(random_table(tiny_schema(), 3), tiny_schema()).embeddings is None


def test_bad_vectors_are_quarantined_with_a_named_reason():
    s = with_embedding(2)
    t = random_table(s, 4)
    rows = [[0.1, 0.2], [float("nan"), 0.0], [1.0], [0.3, float("inf")]]
    t = t.set_column(t.column_names.index("content"), "content",
                     pa.array(rows, pa.list_(pa.float32())))
    keep, reasons, why = validate_rows(t, s)
    assert keep.tolist() == [True, False, False, False]
    assert dict(reasons) == {"embedding content length != 2": 1, "embedding content is NaN/inf": 2}
    assert why[2] == "embedding content length != 2"
    nulls = t.set_column(t.column_names.index("content"), "content",
                         pa.array([[0.1, 0.2], None, [0.0, 0.0], [0.1, None]],
                                  pa.list_(pa.float32())))
    keep, reasons, _ = validate_rows(nulls, s)
    assert keep.tolist() == [True, False, True, False] and dict(reasons) == {"content is null": 2}


@pytest.mark.parametrize("arch", ["gem", "dlrm_dcn"])
def test_models_read_the_vector(arch):
    torch.manual_seed(0)
    s = with_embedding(3)
    model = materialize(build_gem(s, GEMConfig(arch=arch, embedding_dim=8))).eval()
    b = collate(random_table(s, 6), s)
    out = model(b)
    assert out.shape == (6, 2) and torch.isfinite(out).all()
    b.embeddings = b.embeddings + 1.0
    assert not torch.allclose(model(b), out)  # the vector reaches the logits


def test_a_schema_without_embeddings_builds_the_same_parameters():
    torch.manual_seed(0)
    a = build_gem(tiny_schema(), GEMConfig(embedding_dim=8))
    assert a.embedding_proj is None
    names = [n for n, _ in a.named_parameters()]
    assert not any("embedding_proj" in n for n in names)
    with_emb = build_gem(with_embedding(), GEMConfig(embedding_dim=8))
    extra = [n for n, _ in with_emb.named_parameters() if n not in set(names)]
    assert extra and all(n.startswith("embedding_proj.0.") for n in extra)


def test_an_embedding_column_of_another_type_is_a_named_error(tmp_path):
    from opengem.data.loader import ShardLoader
    from opengem.data.parquet import DataError, ShardWriter

    s = with_embedding(2)
    t = random_table(s, 4)
    t = t.set_column(t.column_names.index("content"), "content", pa.array(["0.1 0.2"] * 4))
    w = ShardWriter(tmp_path / "d", s)
    w.write(t, "s0", 0)
    w.close({"train": [0]})
    with pytest.raises(DataError, match="column 'content' is string, expected a list of 2 numbers"):
        list(ShardLoader(tmp_path / "d", "train", 4))
