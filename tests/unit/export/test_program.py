"""The serving program equals GEM on the same rows: shared history, target match, multi-hot, OOV,
truncation, hashing, several users per micro-batch; and it exports with torch.export."""

import numpy as np
import pyarrow as pa
import pytest
import torch

from opengem.data.batch import collate
from opengem.export.artifact import export_program
from opengem.export.layout import Layout, assemble
from opengem.export.program import padded_pool, serving_module
from opengem.export.request import parse, request_models, rows_of, synthetic_request
from opengem.model.build import build_gem, materialize
from opengem.model.foundation import GEMConfig
from opengem.model.interaction_arch import WukongConfig
from opengem.model.interformer import InterFormerConfig
from opengem.model.sequence_arch import SequenceConfig
from opengem.model.sparse_arch import SparseArchConfig
from opengem.ops.jagged import pool_attention
from opengem.testing import tiny_schema

TOL = 1e-5


def _model(schema, max_rows=0, max_seq_len=12, interleave=True, count_decay_hours=(), seq=None,
           span="all", tower_layers=True, **kw):
    cfg = GEMConfig(
        embedding_dim=16,
        max_seq_len=max_seq_len,
        sparse=SparseArchConfig(max_rows_per_table=max_rows),
        interformer=InterFormerConfig(interleave=interleave, tower_layers=tower_layers),
        count_decay_hours=count_decay_hours,
        wukong=WukongConfig(
            num_layers=2, num_fm=4, num_lc=4, fm_rank=4, mlp_dims=(32,), cross_layer_span=span
        ),
        sequence=SequenceConfig(
            num_heads=2, recent_len=8, min_recent=2, num_pooled=2, **(seq or {})
        ),
        **kw,
    )
    model = materialize(build_gem(schema, cfg), base_rates=[0.1, 0.01])
    if model.dense_norm.needs_fit:  # statistics of a made-up training split
        F = len(schema.dense)
        knots = np.sort(np.random.default_rng(3).normal(size=(F, 33)), axis=1)
        model.dense_norm.fit({"names": [f.name for f in schema.dense], "mean": [0.3] * F,
                              "std": [2.0] * F, "quantiles": knots.tolist(), "median": [0.7] * F},
                             [f.name for f in schema.dense])
    # zero-initialised parts (shortcut, sinks) must matter too
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(0)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def _requests(schema, specs, seed=0):
    """specs: (candidates, history per stream); history −1 = 3× the limit; ids out of range in
    the first."""
    out = []
    for i, (c, h) in enumerate(specs):
        out.append(synthetic_request(schema, c, 36 if h < 0 else h, seed=seed + i, oov=i == 0))
    return out


def reference(model, schema, reqs):
    """The training model on the requests' rows, collated as training does, in a batch that also
    holds one row with a full recent window (as every training batch of hundreds of rows does).

    GEM sizes its recent window by the longest history in the batch; when that is shorter than
    ``interformer.num_recent`` the sequence summary's recent slice reaches into the pooled tokens,
    so a row's score depends on its neighbours. Serving always uses the full window (the training
    condition), which keeps a request's score independent of its micro-batch.
    """
    anchor = synthetic_request(schema, 1, model.cfg.sequence.recent_len, seed=99)
    rows = [r for req in reqs + [anchor] for r in rows_of(schema, req)]
    with torch.no_grad():
        logits = model(collate(pa.Table.from_pylist(rows), schema, model.max_seq_len()))
    return torch.sigmoid(logits.double())[:-1]


def _inputs(model, schema, reqs):
    """The serving program's inputs (and the parse reports) of ``reqs``, laid out for ``model``."""
    layout = Layout(model.max_seq_len(), model.cfg.sequence.recent_len)
    _, req_model = request_models(schema)
    return assemble(schema, [parse(schema, req_model.model_validate(r)) for r in reqs], layout)


def _compare(model, schema, reqs, fn=None):
    x, reports = _inputs(model, schema, reqs)
    with torch.no_grad():
        got = (fn or serving_module(model))(x).double()
    return (got - reference(model, schema, reqs)).abs().max().item(), reports


@pytest.mark.parametrize("specs", [
    [(3, -1), (2, 0), (5, 7)],  # long (truncated) / empty / short histories in one micro-batch
    [(1, 5), (1, 0)],
    [(6, 1)],
    [(2, -1)],
])
def test_serving_module_equals_gem(specs):
    schema = tiny_schema()
    model = _model(schema)
    diff, reports = _compare(model, schema, _requests(schema, specs))
    assert diff < TOL
    assert reports[0]["oov"]  # the first request carries out-of-vocabulary ids
    if specs[0][1] < 0:
        assert reports[0]["truncated"] == {"s0": 24, "s1": 24}


@pytest.mark.parametrize("kw", [
    {"seq": {"position": "rope"}},
    {"seq": {"pffn": "transposed"}, "span": "earlier"},
    {"embedding_init": "table", "dense_norm": "standardize"},
    {"dense_norm": "quantile"},
    {"input_norm": "rms", "shortcut": "fvfm", "count_decay_hours": (1.0, 24.0),
     "count_recency": True},
    {"input_norm": "rms_ids", "count_decay_hours": (1.0,), "count_recency": True,
     "shortcut_pairs": "unit"},
    {"decay_pool_hours": (0.5, 24.0), "input_norm": "rms"},
])
def test_serving_module_equals_gem_for_each_model_choice(kw):
    """RoPE, the PFFN orientation, the cross-layer span, the fitted dense normaliser, the X_0 RMS
    norm, the field-vector shortcut and the decayed history means serve as they train."""
    schema = tiny_schema()
    diff, _ = _compare(_model(schema, **kw), schema,
                       _requests(schema, [(3, -1), (2, 0), (4, 5)], seed=21))
    assert diff < TOL


def test_serving_module_hashes_capped_tables():
    schema = tiny_schema()
    model = _model(schema, max_rows=6)
    diff, _ = _compare(model, schema, _requests(schema, [(4, 9), (3, 2)], seed=5))
    assert diff < TOL


def test_serving_module_equals_gem_without_interleaving():
    """The ablation without InterFormer's exchange (towers read zeros for X_sum) serves as
    it trains."""
    schema = tiny_schema()
    model = _model(schema, interleave=False)
    diff, _ = _compare(model, schema, _requests(schema, [(3, 9), (2, 0)], seed=11))
    assert diff < TOL


def test_serving_module_equals_gem_with_pooled_only_towers():
    """Towers without self-attention layers (``tower_layers=false``) serve as they train."""
    schema = tiny_schema()
    model = _model(schema, tower_layers=False)
    diff, _ = _compare(model, schema, _requests(schema, [(3, 9), (2, 0)], seed=12))
    assert diff < TOL


@pytest.mark.parametrize("specs,windows", [([(3, -1), (2, 0), (5, 7)], False),
                                           ([(4, 9), (1, 3)], False), ([(4, 9), (1, 3)], True)])
def test_serving_module_with_history_counts(specs, windows):
    """The history-counts token (all and target-matched decayed counts) serves as it trains."""
    schema = tiny_schema()
    model = _model(schema, count_decay_hours=(0.5, 24.0, 720.0), count_windows=windows)
    assert model.history_counts is not None
    diff, _ = _compare(model, schema, _requests(schema, specs, seed=13))
    assert diff < TOL


def test_target_match_is_exercised():
    """A history whose every category equals one candidate's (and not the other's) scores as GEM
    scores it."""
    schema = tiny_schema()
    model = _model(schema)
    req = synthetic_request(schema, 2, 6, seed=3)
    req["candidates"][0]["category"], req["candidates"][1]["category"] = 1, 2
    req["candidates"][1]["ad_id"] = req["candidates"][0]["ad_id"]
    req["candidates"][1]["quality"] = req["candidates"][0]["quality"]
    req["s0.category"] = [1] * 6
    diff, _ = _compare(model, schema, [req])
    assert diff < TOL


def test_item_match_serves_as_it_trains():
    """The item match (an ads stream holding the candidate's own ad ids) and the target tokens
    serve as GEM scores them: a history of one candidate's ad and not the other's, with the
    history counts on."""
    from opengem.testing import item_matched_schema

    schema = item_matched_schema()
    model = _model(schema, count_decay_hours=(0.5, 24.0), target_match_items=True,
                   target_tokens=True)
    assert model.match_pairs["s1"] == [("s1.item", "ad_id", 4)]
    assert model.token_streams == ["s0", "s1"]
    req = synthetic_request(schema, 2, 6, seed=5)
    req["candidates"][0]["ad_id"], req["candidates"][1]["ad_id"] = 1, 2
    req["s1.item"] = [1, 1, 3, 1, 0, 1]
    reqs = [req, *_requests(schema, [(3, -1), (2, 0)], seed=21)]
    diff, _ = _compare(model, schema, reqs)
    assert diff < TOL


@pytest.mark.parametrize("seed", range(3))
def test_padded_pool_equals_jagged_pool_attention(seed):
    g = torch.Generator().manual_seed(seed)
    U, M, H, D = 3, 2, 2, 8
    lengths = torch.tensor([4, 0, 6])
    counts = np.array([2, 3, 1])
    N = int(lengths.sum())
    k, v = torch.randn(N + 1, D, generator=g), torch.randn(N + 1, D, generator=g)
    q = torch.randn(int(counts.sum()), M, D, generator=g)
    sink_l, sink_v = torch.randn(M, H, generator=g), torch.randn(M, D, generator=g)
    L = int(lengths.max())
    offs = np.concatenate([[0], np.cumsum(lengths.numpy())])
    valid = np.arange(L)[None] < lengths.numpy()[:, None]
    pool_idx = torch.from_numpy(np.where(valid, offs[:-1, None] + np.arange(L)[None], N))
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    cand_user = np.repeat(np.arange(U), counts)
    Cm = counts.max()
    cand_pad = torch.from_numpy(starts[:, None] + np.minimum(np.arange(Cm), counts[:, None] - 1))
    cand_pos = torch.from_numpy(cand_user * Cm + np.arange(len(cand_user)) - starts[cand_user])
    got = padded_pool(q, [(k, v)], None, pool_idx, torch.from_numpy(valid), cand_pad, cand_pos,
                      sink_l, sink_v)
    # reference: every candidate is a row holding a copy of its user's events
    rows = [np.arange(offs[u], offs[u + 1]) for u in cand_user]
    idx = torch.from_numpy(np.concatenate(rows).astype(np.int64))
    ref = pool_attention(q, k[idx], v[idx], torch.tensor([len(r) for r in rows]), H, sink_l, sink_v)
    assert torch.allclose(got, ref, atol=1e-6)


@pytest.mark.parametrize("kw", [{}, {"dense_norm": "quantile", "seq": {"position": "rope"}}])
def test_exported_program_runs_every_size(kw):
    """One exported graph serves 1 or many users, candidates and events (0/1 sizes included)."""
    schema = tiny_schema()
    model = _model(schema, **kw)
    ep = export_program(serving_module(model),
                        _inputs(model, schema, _requests(schema, [(3, 23), (5, 11)], seed=7))[0])
    program = ep.module()
    for specs in ([(2, 0)], [(2, 1)], [(1, 3), (1, 0)], [(7, -1), (2, 2), (1, 0)], [(40, 5)]):
        diff, _ = _compare(model, schema, _requests(schema, specs, seed=1), fn=program)
        assert diff < TOL, specs


@pytest.mark.parametrize("specs", [[(3, -1), (2, 0), (5, 7)], [(1, 4)]])
def test_serving_module_with_embedding_features(specs):
    """Precomputed vectors, one per candidate (ad) and one per request (user), serve as
    they train."""
    import dataclasses

    from opengem.features.schema import EmbeddingFeature

    schema = dataclasses.replace(tiny_schema(), embeddings=(EmbeddingFeature("content", 5, "ad"),
                                                            EmbeddingFeature("profile", 3, "user")))
    model = _model(schema, count_decay_hours=(1.0,))
    reqs = _requests(schema, specs, seed=17)
    diff, _ = _compare(model, schema, reqs)
    assert diff < TOL
    # the vectors matter: another candidate vector changes that candidate's score
    x, _ = _inputs(model, schema, reqs)
    assert x["embeddings"].shape == (sum(c for c, _ in specs), 8)
    with torch.no_grad():
        before = serving_module(model)(x)
        x["embeddings"][0, :5] += 1.0
        after = serving_module(model)(x)
    assert not torch.allclose(before[0], after[0]) and torch.equal(before[1:], after[1:])


def test_a_vector_of_the_wrong_length_is_a_422():
    import dataclasses

    from opengem.export.request import RequestError
    from opengem.features.schema import EmbeddingFeature

    schema = dataclasses.replace(tiny_schema(), embeddings=(EmbeddingFeature("content", 5, "ad"),))
    req = synthetic_request(schema, 2, 3)
    req["candidates"][1]["content"] = [0.0] * 4
    _, req_model = request_models(schema)
    with pytest.raises(RequestError, match="needs 5 floats, got 4") as e:
        parse(schema, req_model.model_validate(req))
    assert e.value.status == 422 and e.value.field == "candidates.1.content"


def test_exported_program_with_an_embedding_feature():
    """torch.export of a GEM with an ad vector: one graph for any number of candidates."""
    import dataclasses

    from opengem.features.schema import EmbeddingFeature

    schema = dataclasses.replace(tiny_schema(), embeddings=(EmbeddingFeature("content", 5, "ad"),))
    model = _model(schema)
    x = _inputs(model, schema, _requests(schema, [(3, 23), (5, 11)], seed=7))[0]
    program = export_program(serving_module(model), x).module()
    # C = 1 fails the graph's guard with or without vectors (main too)
    for specs in ([(2, 3)], [(7, -1), (1, 0)]):
        diff, _ = _compare(model, schema, _requests(schema, specs, seed=2), fn=program)
        assert diff < TOL, specs


def _missing_schema():
    import dataclasses

    from opengem.features.schema import DenseFeature

    return dataclasses.replace(
        tiny_schema(),
        dense=(
            DenseFeature("activity", "user", missing="indicator"),
            DenseFeature("quality", "ad", missing="indicator"),
        ),
    )


def _with_missing(reqs):
    """Null a user value, leave out an ad value, keep the rest: every way a request
    says "missing"."""
    reqs[0]["activity"] = None
    reqs[0]["candidates"][0].pop("quality")
    reqs[-1]["candidates"][-1]["quality"] = None
    return reqs


@pytest.mark.parametrize("norm", ["signed_log", "standardize", "quantile"])
def test_serving_module_equals_gem_with_missing_values(norm):
    """A null or left-out value of a ``missing="indicator"`` feature scores as the eager model
    scores its NaN row: imputed with the fitted median, flagged by the indicator (within 1e-5)."""
    schema = _missing_schema()
    model = _model(schema, dense_norm=norm)
    reqs = _with_missing(_requests(schema, [(3, -1), (2, 0), (4, 5)], seed=23))
    diff, _ = _compare(model, schema, reqs)
    assert diff < TOL
    x, _ = _inputs(model, schema, reqs)
    assert (
        torch.isnan(x["dense"][:3, 0]).all()
        and torch.isnan(x["dense"][0, 1])
        and torch.isnan(x["dense"][-1, 1])
    )
    # the indicator matters: the fill value itself, given as a value, scores differently
    with torch.no_grad():
        filled = dict(x, dense=torch.nan_to_num(x["dense"], nan=0.7))
        assert not torch.allclose(serving_module(model)(x)[0], serving_module(model)(filled)[0])


def test_exported_program_with_missing_values():
    """torch.export of a GEM with missing-indicator features: NaN inputs, one graph, equal
    to eager."""
    schema = _missing_schema()
    model = _model(schema, dense_norm="quantile")
    x = _inputs(model, schema, _with_missing(_requests(schema, [(3, 23), (5, 11)], seed=7)))[0]
    program = export_program(serving_module(model), x).module()
    for specs in ([(2, 3)], [(7, -1), (1, 0)]):
        diff, _ = _compare(model, schema, _with_missing(_requests(schema, specs, seed=2)),
                           fn=program)
        assert diff < TOL, specs


def test_a_null_for_a_feature_without_the_missing_option_is_a_422():
    from pydantic import ValidationError

    from opengem.export.request import error_from_validation

    schema = tiny_schema()
    req = synthetic_request(schema, 2, 3)
    req["candidates"][1]["quality"] = None
    _, req_model = request_models(schema)
    with pytest.raises(ValidationError) as e:
        req_model.model_validate(req)
    err = error_from_validation(e.value)
    assert err.status == 422 and err.field == "candidates.1.quality" and "missing" in err.message
    req = synthetic_request(schema, 2, 3)
    del req["activity"]
    with pytest.raises(ValidationError) as e:
        req_model.model_validate(req)
    assert error_from_validation(e.value).field == "activity"


def test_export_inputs_of_streams_shorter_than_the_example_histories():
    """``opengem export`` traces and checks parity on histories of 23 events and of twice the
    model's limit; a stream whose ``max_len`` is shorter (an imported ads stream of 12) still gets
    them, truncated to its limit, not refused as an over-long request."""
    import dataclasses

    from opengem.export.artifact import example_requests, program_inputs

    schema = tiny_schema()
    schema = dataclasses.replace(schema, sequences=tuple(
        dataclasses.replace(s, max_len=6) for s in schema.sequences))
    layout = Layout({s.name: s.max_len for s in schema.sequences}, 8)
    x = program_inputs(schema, layout, example_requests(schema, layout, [(3, 23), (2, -1)]))
    assert x["seq.s0.pool_idx"].shape == (2, 6) and len(x["seq.s0.item"]) == 2 * 6 + 1


@pytest.mark.parametrize("specs, kw", [([(3, -1), (2, 0), (5, 7)], {}),
                                       ([(4, 9), (1, 3)], {"count_decay_hours": (1.0,)})])
def test_serving_module_with_per_event_values(specs, kw):
    """A stream's per-event values (dwell, price) serve as they train: each event's token gets
    the same Linear of signed_log(values), truncated with its events."""
    from opengem.testing import valued_schema

    schema = valued_schema()
    model = _model(schema, **kw)
    reqs = _requests(schema, specs, seed=29)
    diff, _ = _compare(model, schema, reqs)
    assert diff < TOL
    # the values matter: another dwell in the newest event of the first request moves its scores
    x, _ = _inputs(model, schema, reqs)
    assert x["seq_values.s0"].shape == (len(x["seq.s0.item"]), 2) and "seq_values.s1" not in x
    assert not x["seq_values.s0"][-1].any()  # the sentinel event
    reqs[0]["s0.dwell"][-1] *= 50.0
    assert _compare(model, schema, reqs)[0] < TOL
    with torch.no_grad():
        y, _ = _inputs(model, schema, reqs)
        before, after = serving_module(model)(x), serving_module(model)(y)
    C0 = specs[0][0]
    assert not torch.allclose(before[:C0], after[:C0]) and torch.equal(before[C0:], after[C0:])


def test_exported_program_with_per_event_values():
    """torch.export of a GEM whose stream carries values: one graph for any number of events."""
    from opengem.testing import valued_schema

    schema = valued_schema()
    model = _model(schema)
    x = _inputs(model, schema, _requests(schema, [(3, 23), (5, 11)], seed=7))[0]
    program = export_program(serving_module(model), x).module()
    for specs in ([(2, 3)], [(7, -1), (1, 0)], [(2, 0)]):
        diff, _ = _compare(model, schema, _requests(schema, specs, seed=2), fn=program)
        assert diff < TOL, specs


@pytest.mark.parametrize("change, field, words", [
    (lambda r: r["s0.dwell"].pop(), "s0.dwell", "has 2 events but s0.ts has 3"),
    (lambda r: r["s0.price"].__setitem__(1, float("nan")), "s0.price.1", "finite number"),
    (lambda r: r["s0.dwell"].__setitem__(0, "long"), "s0.dwell.0", "valid number"),
])
def test_bad_per_event_values_are_a_422_naming_the_field(change, field, words):
    from pydantic import ValidationError

    from opengem.export.request import RequestError, check_history, error_from_validation
    from opengem.testing import valued_schema

    schema = valued_schema()
    req = synthetic_request(schema, 2, 3)
    change(req)
    _, req_model = request_models(schema)
    try:
        parse(schema, req_model.model_validate(req))
        raise AssertionError("accepted")
    except ValidationError as e:
        err = error_from_validation(e)
    except RequestError as e:
        err = e
    assert err.status == 422 and err.field == field and words in err.message, err
    # a store's history skips pydantic: check_history refuses its NaN the same way
    s0 = schema.sequences[0]
    given = {c: synthetic_request(schema, 1, 3)[c] for c in
             ("s0.item", "s0.event", "s0.ts", "s0.category", "s0.dwell", "s0.price")}
    given["s0.dwell"] = np.array([1.0, np.inf, 2.0], dtype=np.float32)
    with pytest.raises(RequestError, match="event 1 is inf: per-event values must be finite") as e:
        check_history(schema, s0, given, 1_700_000_000)
    assert e.value.field == "s0.dwell"
