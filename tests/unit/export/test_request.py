"""Request validation: every bad-request class is a RequestError with a status and the
field's name."""

import json

import numpy as np
import pytest
from pydantic import ValidationError

from opengem.export.request import (
    Limits,
    RequestError,
    error_from_validation,
    parse,
    request_models,
    rows_of,
    split_row,
    synthetic_request,
)
from opengem.testing import random_table, tiny_schema

SCHEMA = tiny_schema()


def _parse(body, limits=None):
    _, model = request_models(SCHEMA, limits or Limits())
    try:
        m = (
            model.model_validate_json(body)
            if isinstance(body, (str, bytes))
            else model.model_validate(body)
        )
    except ValidationError as e:
        raise error_from_validation(e) from None
    return parse(SCHEMA, m)


def _good(**changes):
    req = synthetic_request(SCHEMA, 3, 5, seed=1)
    req.update(changes)
    return req


def _without(key):
    req = _good()
    del req[key]
    return req


def _cand(**changes):
    req = _good()
    req["candidates"][1].update(changes)
    return req


BAD = {
    "missing field": (_without("activity"), 422, "activity", "field required"),
    "missing candidate field": (_cand(ad_id=None)
                                | {"candidates": [{"category": 1, "quality": 0.5}]}, 422,
                                "candidates.0.ad_id", "field required"),
    "wrong type": (_good(user_id="seven"), 422, "user_id", "valid integer"),
    "float id": (_cand(ad_id=3.5), 422, "candidates.1.ad_id", "valid integer"),
    "bool id": (_good(domain=True), 422, "domain", "valid integer"),
    "string dense": (_good(activity="0.5"), 422, "activity", "valid number"),
    "NaN dense": ('{"activity": NaN}', 422, "", ""),
    "huge dense": (_good(activity=1e39), 422, "activity", "less than or equal"),
    "huge id": (_good(user_id=2**70), 422, "user_id", "less than or equal"),
    "unknown domain": (_good(domain=9), 422, "domain", "less than or equal"),
    "unknown field": (_good(colour="red"), 422, "colour", "unknown field"),
    "empty candidates": (_good(candidates=[]), 422, "candidates", "at least 1"),
    "candidates not a list": (_good(candidates={"ad_id": 1}), 422, "candidates", "valid array"),
    "history lengths differ": (_good(**{"s0.event": [0, 1]}), 422, "s0.event",
                               "one entry per event"),
    "event after request": (_good(**{"s1.ts": [1_700_000_000 + 5] * 5}), 422, "s1.ts",
                            "before request_ts"),
    "events out of order": (_good(**{"s1.ts": [1_699_999_000 - i for i in range(5)]}), 422, "s1.ts",
                            "oldest"),
    "oversized history": (_good(**{f"s0.{c}": [0] * 65
                                   for c in ("item", "event", "ts", "category")}), 413,
                          "s0.", "at most 64"),
    "oversized candidates": (_good(candidates=[{"ad_id": 1, "category": 1, "quality": 0.0}] * 9),
                             413, "candidates", "at most 8"),
    "oversized multi-hot": (_good(tags=list(range(300))), 413, "tags", "at most 256"),
    "malformed JSON": ('{"user_id": 7,', 400, "body", "malformed JSON"),
    "not an object": ("[1, 2]", 422, "body", "should be an object"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_request_is_named(case):
    body, status, field, words = BAD[case]
    with pytest.raises(RequestError) as e:
        _parse(body if isinstance(body, str) else json.dumps(body), Limits(max_candidates=8))
    assert e.value.status == status, e.value
    assert e.value.field.startswith(field), e.value
    assert words in e.value.message, e.value


def test_good_request_parses_to_arrays():
    p = _parse(_good())
    assert p.num_candidates == 3
    assert p.sparse["tags"].dtype == np.int64 and len(p.sparse["tags"]) == 2
    assert p.cand_sparse["ad_id"][0].shape == (3,) and p.cand_dense["quality"].dtype == np.float32
    assert len(p.sequences["s0.item"]) == 5


def test_out_of_vocabulary_ids_are_accepted():
    p = _parse(synthetic_request(SCHEMA, 2, 3, oov=True))
    assert p.cand_sparse["ad_id"][0][0] >= 30  # mapped to the OOV row later, and counted


def test_log_rows_split_into_requests_and_back():
    rows = random_table(SCHEMA, 3, seed=2).to_pylist()
    req, cand = split_row(SCHEMA, rows[0])
    req["candidates"] = [cand] + [split_row(SCHEMA, r)[1] for r in rows[1:]]
    _parse(req)  # the raw fields of a log row are a valid request
    back = rows_of(SCHEMA, req)
    assert [r["ad_id"] for r in back] == [r["ad_id"] for r in rows]
    assert all(r["user_id"] == rows[0]["user_id"] for r in back)
