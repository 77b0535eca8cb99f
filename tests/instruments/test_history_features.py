"""The practitioner's history columns: each family by hand on drawn rows, no future leakage, unique
names, and both peers carrying them."""

import math

import numpy as np
import pytest
from instruments.gbdt import batch_features, feature_names, stream_features
from instruments.history_features import NONE_LOG1P_H, PractitionerHistory, event_names, item_pair
from instruments.linear import LinearColumns

from opengem.data.batch import collate, validate_rows
from opengem.data.parquet import list_array
from opengem.features.schema import FeatureSchema
from opengem.testing import random_table, tiny_schema, with_events

H, D = 3600, 86400


def _schema() -> FeatureSchema:
    """tiny_schema with s1's items in ad_id's id space (30 ids) and named event types."""
    d = tiny_schema().to_dict()
    d["sequences"][1]["item_vocab_size"] = 30
    d["meta"] = {**d.get("meta", {}), "s1_events": ["click", "conversion", "other"]}
    return FeatureSchema.from_dict(d)


def _with_history(table, schema, stream: str, rows: dict[int, dict[str, list]]):
    """``table`` with ``stream``'s history replaced: row → {"age": seconds before the request,
    "item", "event", attribute name: values}, oldest first; other rows empty."""
    req = table.column("request_ts").to_pylist()
    s = schema.stream(stream)
    for name in ["item", "event", "ts"] + [a.name for a in s.attributes]:
        values = [[] for _ in req]
        for r, h in rows.items():
            values[r] = ([req[r] - a for a in h["age"]] if name == "ts"
                         else h.get(name, [0] * len(h["age"])))
        col = f"{stream}.{name}"
        flat = np.asarray([v for vs in values for v in vs], dtype=np.int64)
        table = table.set_column(table.schema.get_field_index(col), col,
                                 list_array(flat, [len(v) for v in values]))
    return table


def _drawn():
    """Three rows: 0 a newest event that does not match, 1 four events at known ages on each
    stream, 2 no history."""
    schema = _schema()
    table = random_table(schema, 3, seed=0)
    cat, ad = (table.column(c).to_pylist() for c in ("category", "ad_id"))
    o = [(c + 1) % 5 for c in cat]
    table = _with_history(table, schema, "s0", {
        0: {"age": [3 * H, H], "category": [cat[0], o[0]]},
        1: {"age": [8 * D, 2 * D, 2 * H, 600], "event": [1, 2, 0, 0],
            "category": [o[1], o[1], cat[1], cat[1]]}})
    other = [(a + 1) % 30 for a in ad]
    table = _with_history(table, schema, "s1", {
        0: {"age": [7 * H, 6 * H, 5 * H, 4 * H, 3 * H, 2 * H, H],
            "item": [ad[0], ad[0]] + [other[0]] * 4 + [ad[0]]},
        1: {"age": [40 * D, 10 * D, 3 * D, 5 * H], "event": [0, 1, 0, 1],
            "item": [ad[1], other[1], ad[1], ad[1]]}})
    return schema, table


def _row(schema, table, r: int) -> dict:
    cols = PractitionerHistory(schema)
    return dict(zip(cols.names, cols.batch(collate(table, schema))[r].tolist()))


def test_decayed_matches_by_hand():
    schema, table = _drawn()
    x = _row(schema, table, 1)
    ages_s0, ages_s1 = [8 * D, 2 * D, 2 * H, 600], [40 * D, 10 * D, 3 * D, 5 * H]
    for tag, tau in (("1h", H), ("6h", 6 * H), ("24h", D), ("7d", 7 * D), ("30d", 30 * D)):
        decays = [math.exp(-a / tau) for a in ages_s0]
        assert x[f"s0.decay_{tag}.all"] == pytest.approx(sum(decays), rel=1e-12)
        assert x[f"s0.decay_{tag}.category"] == pytest.approx(sum(decays[2:]), rel=1e-12)
        decays = [math.exp(-a / tau) for a in ages_s1]
        assert x[f"s1.decay_{tag}.ad_id"] == pytest.approx(
            decays[0] + decays[2] + decays[3], rel=1e-12)
    assert item_pair(schema, "s1") == [("s1.item", "ad_id", 30)] and item_pair(schema, "s0") == []


def test_last_event_match_and_the_newest_matchs_age_by_hand():
    schema, table = _drawn()
    one, zero, empty = (_row(schema, table, r) for r in (1, 0, 2))
    assert one["s0.last_event_match.category"] == 1 and zero["s0.last_event_match.category"] == 0
    assert one["s0.since_match_log1p_h.category"] == pytest.approx(math.log1p(600 / H))
    assert zero["s0.since_match_log1p_h.category"] == pytest.approx(math.log1p(3))
    assert one["s1.since_match_log1p_h.ad_id"] == pytest.approx(math.log1p(5))
    assert empty["s0.since_match_log1p_h.category"] == NONE_LOG1P_H > math.log1p(10 * 8760 - 1)
    assert empty["s0.last_event_match.category"] == 0 and empty["s0.decay_30d.all"] == 0


def test_counts_in_windows_and_repeat_engagement_by_hand():
    schema, table = _drawn()
    x = _row(schema, table, 1)
    # s0 ages 8 d, 2 d, 2 h, 10 min; event types 1, 2, 0, 0
    assert [x[f"s0.n_last_{w}"] for w in ("1h", "24h", "7d")] == [1, 2, 3]
    assert [x[f"s0.n_last_7d.e{e}"] for e in range(3)] == [2, 0, 1]
    # s1 ages 40 d, 10 d, 3 d, 5 h: click, conversion, click, conversion on ads ad, other, ad, ad
    assert event_names(schema, "s1") == ["click", "conversion", "other"]
    assert [x[f"s1.n_last_{w}"] for w in ("1h", "24h", "7d")] == [0, 1, 2]
    assert (x["s1.n_last_7d.click"], x["s1.n_last_7d.conversion"]) == (1, 1)
    got = {(w, e): x[f"s1.n_last_{w}.{e}.ad_id"] for w in ("24h", "7d", "30d")
           for e in ("click", "conversion")}
    assert got == {("24h", "click"): 0, ("24h", "conversion"): 1, ("7d", "click"): 1,
                   ("7d", "conversion"): 1, ("30d", "click"): 1, ("30d", "conversion"): 1}
    # s0's category matches: 2 h (type 0) and 10 min (type 0)
    assert (x["s0.n_last_24h.e0.category"], x["s0.n_last_30d.e0.category"]) == (2, 2)


def test_shares_of_the_last_k_events_by_hand():
    schema, table = _drawn()
    zero, one = _row(schema, table, 0), _row(schema, table, 1)
    # s1 row 0: 7 events, ad ad other other other other ad (newest last)
    assert zero["s1.share_last5.ad_id"] == pytest.approx(1 / 5)
    assert zero["s1.share_last20.ad_id"] == pytest.approx(3 / 7)
    assert one["s0.share_last5.category"] == pytest.approx(2 / 4)
    assert one["s1.share_last20.ad_id"] == pytest.approx(3 / 4)


def test_events_at_or_after_the_request_never_count():
    schema, table = _drawn()
    req, cat = (table.column(c).to_pylist()[0] for c in ("request_ts", "category"))
    # matching events at and after the request, newest: the row's newest past event does not match
    later = with_events(table, 0, "s0", [req, req + 60], {"category": cat})
    cols = PractitionerHistory(schema)
    np.testing.assert_array_equal(cols.batch(collate(later, schema)),
                                  cols.batch(collate(table, schema)))
    np.testing.assert_array_equal(batch_features(collate(later, schema), schema),
                                  batch_features(collate(table, schema), schema))
    # and the loader never hands such a row out: validate_rows quarantines it
    keep, _, reason = validate_rows(later, schema)
    assert keep.tolist() == [False, True, True] and reason[0] == "s0.ts not before request_ts"


def test_names_are_unique_and_the_peers_carry_them():
    schema, table = _drawn()
    batch = collate(table, schema)
    extra = PractitionerHistory(schema).names
    names, _ = feature_names(schema)
    basic, _ = feature_names(schema, "basic")
    lr = LinearColumns(schema)
    for cols in (extra, names, lr.names):
        assert len(cols) == len(set(cols))
    # the window counts are the basic features' own, kept once
    assert set(names) == set(basic) | set(extra) and len(names) < len(basic) + len(extra)
    assert batch_features(batch, schema).shape == (3, len(names))
    assert lr.batch(batch).shape == (3, len(lr.names)) and set(extra) <= set(lr.names)
    assert len(LinearColumns(schema, history="basic").names) == len(lr.names) - len(extra)
    x = PractitionerHistory(schema).batch(batch).numpy()
    # stream_features: n_events, since last, since first, then the three window counts
    got = np.stack(stream_features(batch, schema, "s0"), 1)[:, 3:6]
    np.testing.assert_array_equal(got, x[:, [extra.index(f"s0.n_last_{w}") for w in
                                             ("1h", "24h", "7d")]])
    assert np.isfinite(x).all()
    with pytest.raises(ValueError, match="history must be one of"):
        feature_names(schema, "none")
