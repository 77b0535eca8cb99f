import json

import pytest

from opengem.features.schema import FeatureSchema, SchemaError, SequenceStream, SparseFeature, Task
from opengem.testing import tiny_schema


def _d():
    return tiny_schema().to_dict()


def test_json_round_trip_and_fingerprint(tmp_path):
    s = tiny_schema()
    s.save(tmp_path / "schema.json")
    back = FeatureSchema.load(tmp_path)
    assert back == s
    assert back.fingerprint() == s.fingerprint()
    assert tiny_schema(num_domains=3).fingerprint() != s.fingerprint()


def test_columns_list_every_column_once():
    s = tiny_schema()
    cols = s.columns()
    assert len(cols) == len(set(cols))
    assert {"s0.item", "s0.event", "s0.ts", "p_click", "p_conversion", "domain"} <= set(cols)
    assert "p_click" not in s.columns(with_probs=False)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["sparse"][0].update(vocab_size=0), "vocab_size must be a positive integer"),
        (lambda d: d["sparse"][1].update(name="bad name"), "must match"),
        (lambda d: d["sparse"][1].update(name="category"), "duplicate name 'category'"),
        (lambda d: d["sparse"][1].update(group="advertiser"), "group must be user/ad/context"),
        (lambda d: d["sequences"][0].update(max_len=-1), "max_len must be a positive integer"),
        (lambda d: d["tasks"][1].update(requires="purchase"), "requires unknown task 'purchase'"),
        (lambda d: d["tasks"][0].update(weight=-1.0), "weight must be >= 0"),
        (lambda d: d.update(tasks=[]), "at least one task"),
        (lambda d: d["domains"].update(names=[]), "at least one domain"),
        (lambda d: d["domains"].update(names=["a", "a"]), "duplicate domain names"),
        (lambda d: d.update(colour="blue"), "unknown schema keys ['colour']"),
        (lambda d: d["sparse"][0].update(hash="yes"), "unknown keys ['hash']"),
        (lambda d: d.pop("tasks"), "missing 'tasks'"),
        (lambda d: d.update(version=99), "version 99 not supported"),
    ],
)
def test_invalid_schemas_name_the_problem(mutate, message):
    d = _d()
    mutate(d)
    with pytest.raises(SchemaError,
                       match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        FeatureSchema.from_dict(d)


def test_load_errors(tmp_path):
    with pytest.raises(SchemaError, match="not found"):
        FeatureSchema.load(tmp_path)
    (tmp_path / "schema.json").write_text("{not json")
    with pytest.raises(SchemaError, match="not valid JSON"):
        FeatureSchema.load(tmp_path)
    (tmp_path / "schema.json").write_text(json.dumps([1, 2]))
    with pytest.raises(SchemaError, match="must be a JSON object"):
        FeatureSchema.load(tmp_path)


def test_lookups():
    s = tiny_schema()
    assert s.sparse_feature("ad_id") == SparseFeature("ad_id", 30, "ad")
    assert s.stream("s1") == SequenceStream("s1", 40, 3, 64)
    assert s.stream("s0").attributes[0].name == "category" and "s0.category" in s.columns()
    assert s.task_names == ["click", "conversion"]
    assert s.tasks[1] == Task("conversion", "conversion", "p_conversion", requires="click")
    with pytest.raises(SchemaError, match="no sparse feature named 'nope'"):
        s.sparse_feature("nope")


def test_declared_matches_round_trip_and_are_checked():
    """``matches`` (a stream's items or an attribute sharing a sparse feature's id space) is
    written only when set, so older schemas keep their fingerprint, and must name a single-valued
    sparse feature of the same size."""
    import dataclasses

    from opengem.features.schema import EventAttribute
    from opengem.testing import item_matched_schema

    plain = tiny_schema()
    assert "matches" not in json.dumps(plain.to_dict())
    s = item_matched_schema()
    assert FeatureSchema.from_dict(json.loads(s.to_json())) == s
    assert s.fingerprint() != dataclasses.replace(
        s, sequences=(s.sequences[0], dataclasses.replace(s.sequences[1], matches=None))
    ).fingerprint()
    s0, s1 = plain.sequences
    for stream, message in [
        (dataclasses.replace(s1, matches="nope"), "'nope', which is not a single-valued"),
        (dataclasses.replace(s1, matches="tags"), "'tags', which is not a single-valued"),
        (dataclasses.replace(s1, matches="ad_id"), "vocab_size 40 is not the feature's 30"),
        (dataclasses.replace(s0, attributes=(EventAttribute("cat", 6, matches="category"),)),
         "attribute 'cat': matches 'category' but its vocab_size 6"),
    ]:
        with pytest.raises(SchemaError, match=message):
            dataclasses.replace(plain, sequences=(stream, s1) if stream.name == "s0"
                                else (s0, stream))
    shared = dataclasses.replace(s0, attributes=(EventAttribute("cat", 5, matches="category"),))
    from opengem.model.foundation import match_attributes

    schema = dataclasses.replace(plain, sequences=(shared, s1))
    assert match_attributes(schema, "s0") == [("s0.cat", "category", 5)]
