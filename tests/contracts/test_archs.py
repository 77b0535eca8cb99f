"""One contract over every arch: shapes, every parameter learns, empty and very long sequences,
determinism, and the heads' domain routing and task chaining."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from opengem.data.batch import collate
from opengem.model.build import build_gem, count_parameters, materialize
from opengem.model.foundation import GEMConfig
from opengem.model.heads import Heads, HeadsConfig
from opengem.model.interaction_arch import InteractionArch, WukongConfig
from opengem.model.interformer import InterFormer, InterFormerConfig
from opengem.model.sequence_arch import SequenceConfig
from opengem.model.sparse_arch import SparseArch, SparseArchConfig
from opengem.recipes import recipe
from opengem.testing import random_table, tiny_schema

D = 16


def _batch(schema, n=12, lengths=None, seed=0):
    return collate(random_table(schema, n, seed=seed, lengths=lengths), schema)


def _check_all_params_learn(module, loss):
    loss.backward()
    dead = [n for n,
            p in module.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()
            or p.grad.abs().sum() == 0]
    assert not dead, f"parameters without gradient: {dead}"


def _gem(cfg=None, schema=None, seed=0):
    schema = schema or tiny_schema()
    cfg = cfg or GEMConfig(embedding_dim=D,
                           wukong=WukongConfig(num_layers=3, num_fm=4, num_lc=4, fm_rank=4),
                           sequence=SequenceConfig(num_heads=2, recent_len=8, min_recent=2,
                                                   num_pooled=2))
    return materialize(build_gem(schema, cfg), seed=seed,
                       base_rates=[0.1, 0.01][: len(schema.tasks)])


# ------------------------------------------------------------------------------- parts
def test_sparse_arch_shapes_and_grads():
    schema = tiny_schema()
    arch = SparseArch(schema, SparseArchConfig(), D)
    arch.init_weights()
    b = _batch(schema)
    x = arch.forward_sparse(b.sparse, b.batch_size)
    assert x.shape == (12, len(schema.sparse), D)
    seqs = arch.forward_sequences(b.sequences)
    for s in schema.sequences:
        vals, lens = seqs[s.name]
        assert vals.shape == (int(lens.sum()), D)
    _check_all_params_learn(arch, x.pow(2).sum() + sum(v.pow(2).sum() for v, _ in seqs.values()))


def test_sparse_arch_hashes_into_capped_tables():
    schema = tiny_schema()
    arch = SparseArch(schema, SparseArchConfig(max_rows_per_table=8), D)
    assert arch.ebc.embedding_bags["t_user_id"].weight.shape[0] == 8
    b = _batch(schema)
    assert arch.forward_sparse(b.sparse, b.batch_size).shape == (12, len(schema.sparse), D)


@pytest.mark.parametrize("cross_layer", ["attention", "dense", "none"])
@pytest.mark.parametrize("attentive", [False, True])
def test_wukong_stack(cross_layer, attentive):
    cfg = WukongConfig(num_layers=3, num_fm=3, num_lc=2, fm_rank=4, mlp_dims=(16,),
                       cross_layer=cross_layer, attentive_fm=attentive)
    arch = InteractionArch(7, 0, D, cfg)
    x = torch.randn(5, 7, D)
    y = arch(x)
    assert y.shape == (5, 5, D)
    _check_all_params_learn(arch, y.pow(2).sum())


def test_wukong_fm_is_the_optimized_projection():
    """FM(X) = X (Xᵀ Y): equal to the O(n²) form (X Xᵀ) Y."""
    arch = InteractionArch(6, 0, D, WukongConfig(num_layers=1, fm_rank=3))
    fmb = arch.layers[0].fmb
    x = torch.randn(2, 6, D)
    y = fmb.y.expand(2, -1, -1)
    fast = torch.bmm(x, torch.bmm(x.transpose(1, 2), y))
    slow = torch.bmm(torch.bmm(x, x.transpose(1, 2)), y)
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-4)


def test_interformer_both_directions():
    cfg = InterFormerConfig()
    wk = WukongConfig(num_layers=2, num_fm=3, num_lc=3, fm_rank=2, mlp_dims=(16,))
    sq = SequenceConfig(num_heads=2, recent_len=8, min_recent=2, num_pooled=2)
    arch = InterFormer(5, D, 2, wk, sq, cfg)
    lengths = torch.tensor([3, 0, 9])
    seqs = [(torch.randn(12, D, requires_grad=True), lengths),
            (torch.randn(12, D, requires_grad=True), lengths)]
    x = torch.randn(3, 5, D, requires_grad=True)
    x_sum, s_sum, x_last = arch(x, seqs)
    assert x_sum.shape == (3, cfg.num_sum, D) and s_sum.shape == (3, 2 * cfg.tokens_per_stream, D)
    assert x_last.shape == (3, 6, D)
    # sequence → non-sequence: the non-sequence output depends on the events
    g = torch.autograd.grad(x_last.sum(), seqs[0][0], retain_graph=True)[0]
    assert g.abs().sum() > 0
    # non-sequence → sequence: the sequence summary depends on the non-sequence tokens
    g = torch.autograd.grad(s_sum.sum(), x)[0]
    assert g.abs().sum() > 0


def test_heads_route_each_domain_to_its_own_output():
    schema = tiny_schema(num_domains=3)
    heads = Heads(8, schema, HeadsConfig(trunk_dims=(8,), task_dims=(4,)))
    feats = torch.randn(6, 8)
    dom = torch.tensor([0, 1, 2, 0, 1, 2])
    before = heads(feats, dom)
    with torch.no_grad():
        heads.out_b[1] += 3.0  # change only domain 1's outputs
    after = heads(feats, dom)
    changed = (after - before).abs().sum(1) > 1e-6
    assert changed.tolist() == [False, True, False, False, True, False]


def test_heads_chain_conversion_below_click():
    schema = tiny_schema()
    heads = Heads(8, schema, HeadsConfig(trunk_dims=(8,), task_dims=(4,)))
    heads.init_bias([0.1, 0.01])
    p = torch.sigmoid(heads(torch.randn(50, 8) * 5, torch.zeros(50, dtype=torch.long)))
    assert (p[:, 1] <= p[:, 0] + 1e-6).all()
    assert abs(torch.sigmoid(heads.out_b[0, 0]).item() - 0.1) < 1e-6  # starts at the base rate
    assert abs(torch.sigmoid(heads.out_b[0, 1]).item() - 0.1) < 1e-6  # conditional rate 0.01 / 0.1


# ------------------------------------------------------------------------------- whole model
@pytest.mark.parametrize("variant",
                         ["default", "no_sequences", "one_domain_one_task", "shared_heads"])
def test_gem_contract(variant):
    schema, cfg = tiny_schema(), None
    if variant == "no_sequences":
        cfg = GEMConfig(embedding_dim=D, use_sequences=False,
                        wukong=WukongConfig(num_layers=2, num_fm=2, num_lc=2))
    if variant == "one_domain_one_task":
        from dataclasses import replace
        schema = replace(tiny_schema(num_domains=1), tasks=tiny_schema().tasks[:1])
    if variant == "shared_heads":
        cfg = GEMConfig(embedding_dim=D, heads=HeadsConfig(domain_mode="shared"))
    model = _gem(cfg, schema)
    b = _batch(schema)
    logits = model(b)
    assert logits.shape == (12, len(schema.tasks)) and torch.isfinite(logits).all()
    ignore = {"interformer.towers"} if variant == "no_sequences" else set()
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, b.labels)
    loss.backward()
    dead = [n for n, p in model.named_parameters()
            if not any(n.startswith(i) for i in ignore)
                     and (p.grad is None or p.grad.abs().sum() == 0)]
    if variant == "shared_heads" or variant == "one_domain_one_task" or variant == "default":
        assert not dead, dead


def test_gem_handles_empty_and_very_long_sequences():
    model = _gem()
    lens = {"s0": np.array([0, 0, 2600, 1]), "s1": np.array([0, 5, 0, 2100])}
    schema = tiny_schema()
    from dataclasses import replace

    from opengem.features.schema import SequenceStream
    schema = replace(schema,
                     sequences=tuple(SequenceStream(s.name, s.item_vocab_size, s.num_event_types,
                                                    4096)
                                             for s in schema.sequences))
    model = _gem(schema=schema)
    b = _batch(schema, 4, lengths=lens)
    assert b.sequences["s0.item"].lengths().tolist() == [0, 0, 2600, 1]
    logits = model(b)
    assert torch.isfinite(logits).all()
    logits.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    # a batch where no row has any event at all
    b0 = _batch(schema, 3, lengths={"s0": np.zeros(3, int), "s1": np.zeros(3, int)})
    assert torch.isfinite(model(b0)).all()


def test_gem_row_independence_and_determinism():
    model = _gem(seed=3)
    b = _batch(tiny_schema(), 10, seed=5)
    torch.testing.assert_close(model(b), _gem(seed=3)(b))  # same seed → same model and outputs
    assert not torch.allclose(model(b), _gem(seed=4)(b))
    # a row's prediction does not depend on the other rows of its batch
    small = collate(random_table(tiny_schema(), 10, seed=5).slice(2, 3), tiny_schema())
    torch.testing.assert_close(model(small), model(b)[2:5], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["tiny", "demo", "small", "medium", "large", "xl"])
def test_recipes_build_on_meta(name):
    from opengem.world.generate import build_schema
    from opengem.world.presets import world_config

    schema = build_schema(world_config("demo"))
    model = build_gem(schema, recipe(name).model)
    n = count_parameters(model)
    assert n["total"] > 0
    if name == "xl":
        assert n["total"] >= 1_000_000_000


def test_target_match_flags_events_equal_to_the_candidate():
    """An event attribute named after a sparse feature is flagged where it equals the row's id; OOV
    never matches."""
    from opengem.model.foundation import match_attributes

    schema = tiny_schema()
    assert match_attributes(schema, "s0") == [("s0.category", "category", 5)]
    assert match_attributes(schema, "s1") == []
    _check_flags(_gem(schema=schema), schema, "s0", "s0.category", "category", 5)


def _check_flags(model, schema, stream, col, feat, oov):
    """``model``'s first match flag of ``stream`` against a loop: event ``col`` equals the row's
    candidate ``feat``, OOV never matching; the seeded rows hold both cases."""
    b = _batch(schema, n=6, lengths={stream: np.array([3, 0, 2, 4, 1, 5])})
    seq, sp = b.sequences.to_dict(), b.sparse.to_dict()
    lengths = seq[f"{stream}.item"].lengths()
    flags = model._match_flags(b, stream, lengths)
    ids, cand = seq[col].values().tolist(), sp[feat].values().tolist()
    rows = [r for r, n in enumerate(lengths.tolist()) for _ in range(n)]
    assert flags[:, 0].tolist() == [float(i == cand[r] and i != oov) for i, r in zip(ids, rows)]
    assert 0 < flags.sum() < len(ids)
    return b


def test_item_match_flags_events_of_the_candidates_own_item():
    """Where the schema declares a stream's items the candidate's ``ad_id`` and
    ``target_match_items`` is on, the item column is one more matched column (after the
    attributes), flagged where the event's item is the row's ad; off, nothing changes."""
    import dataclasses

    from opengem.model.foundation import match_attributes
    from opengem.testing import item_matched_schema

    schema = item_matched_schema()
    assert match_attributes(schema, "s1") == []
    assert match_attributes(schema, "s1", items=True) == [("s1.item", "ad_id", 4)]
    assert match_attributes(schema, "s0", items=True) == [("s0.category", "category", 5)]
    base = _gem(schema=schema)
    assert base.match_pairs["s1"] == []
    model = _gem(dataclasses.replace(base.cfg, target_match_items=True), schema)
    b = _check_flags(model, schema, "s1", "s1.item", "ad_id", 4)
    assert torch.isfinite(model(b)).all()


def test_target_tokens_are_the_candidate_in_each_streams_tables():
    """``target_tokens``: one X_0 token per stream with matched columns, the sum of those
    columns' tables at the candidate's ids (s0: its category table; s1, items matched: its item
    table at the ad id); every parameter still learns."""
    import dataclasses

    from opengem.testing import item_matched_schema

    schema = item_matched_schema()
    base = _gem(schema=schema)
    model = _gem(dataclasses.replace(base.cfg, target_match_items=True, target_tokens=True),
                 schema)
    assert model.token_streams == ["s0", "s1"]
    b = _batch(schema, n=5)
    got = model.target_tokens(b)
    t, cand = model.sparse_arch.tables(), b.sparse.to_dict()
    torch.testing.assert_close(got[:, 0], t["t_s0_category"][cand["category"].values()])
    torch.testing.assert_close(got[:, 1], t["t_s1_item"][cand["ad_id"].values()])
    x, _ = model.inputs(b)
    assert x.shape[1] == _gem(schema=schema).inputs(b)[0].shape[1] + 2
    _check_all_params_learn(model, model(b).sum())


def test_history_counts_windows_count_the_events_within_each_time():
    """``count_windows``: beside each decayed sum, the number of events of that type at most τ
    old (all, then matched), against a loop over the rows."""
    schema = tiny_schema()
    cfg = GEMConfig(embedding_dim=D, count_decay_hours=(0.5, 24.0), count_windows=True,
                    wukong=WukongConfig(num_layers=1, num_fm=2, num_lc=2),
                    sequence=SequenceConfig(num_heads=2, recent_len=4, min_recent=2, num_pooled=1))
    model = _gem(cfg, schema)
    b = _batch(schema, n=5,
               lengths={"s0": np.array([3, 0, 6, 1, 4]), "s1": np.array([2, 2, 0, 5, 1])})
    seq, sp, ages = b.sequences.to_dict(), b.sparse.to_dict(), b.seq_age.to_dict()
    lengths = seq["s0.item"].lengths()
    flags = model._match_flags(b, "s0", lengths)
    got = model.history_counts.stream_counts("s0", seq["s0.event"].values(),
                                             ages["s0"].values(), flags, lengths)
    E, taus = schema.stream("s0").num_event_types + 1, np.array([0.5, 24.0]) * 3600.0
    ev, age = seq["s0.event"].values().numpy(), ages["s0"].values().double().numpy()
    cats, cand = seq["s0.category"].values().numpy(), sp["category"].values().numpy()
    want, start = np.zeros((5, 2, E, 4)), 0
    for r, n in enumerate(lengths.tolist()):
        for i in range(start, start + n):
            w = np.r_[np.exp(-age[i] / taus), (age[i] <= taus).astype(float)]
            want[r, 0, ev[i]] += w
            if cats[i] == cand[r] and cats[i] != 5:
                want[r, 1, ev[i]] += w
        start += n
    np.testing.assert_allclose(got.numpy(), want.reshape(5, -1), rtol=1e-5, atol=1e-6)
    assert want[..., 2:].sum() > 0 and (want[..., 2:] < want[..., :2] + 1).all()


def test_din_query_holds_the_candidates_item_row():
    """DIN with the item matched: the query is the stream's item table at the candidate's ad id
    (DIN's own query), plus its matched attributes' rows."""
    from opengem.testing import item_matched_schema

    schema = item_matched_schema()
    cfg = GEMConfig(arch="din", embedding_dim=D, target_match_items=True)
    model = materialize(build_gem(schema, cfg), seed=0, base_rates=[0.1, 0.01])
    b = _batch(schema, n=5)
    x = model.sparse_arch.forward_sparse(b.sparse, 5)
    q = model.pool.query("s1", b, x, model.sparse_arch)
    table = model.sparse_arch.tables()["t_s1_item"]
    torch.testing.assert_close(q, table[b.sparse.to_dict()["ad_id"].values()])


def test_history_counts_are_decayed_counts_per_event_type_all_and_matched():
    """HistoryCounts: per row, Σ e^(−age/τ) over events of each type, over all events and over those
    whose attribute equals the candidate's (OOV never matches), against a loop over the rows."""
    schema = tiny_schema()
    cfg = GEMConfig(embedding_dim=D, count_decay_hours=(0.5, 24.0),
                    wukong=WukongConfig(num_layers=1, num_fm=2, num_lc=2),
                    sequence=SequenceConfig(num_heads=2, recent_len=4, min_recent=2, num_pooled=1))
    model = _gem(cfg, schema)
    hc = model.history_counts
    b = _batch(schema, n=5,
               lengths={"s0": np.array([3, 0, 6, 1, 4]), "s1": np.array([2, 2, 0, 5, 1])})
    seq, sp, ages = b.sequences.to_dict(), b.sparse.to_dict(), b.seq_age.to_dict()
    taus = np.array([0.5, 24.0]) * 3600.0
    for stream, attrs in (("s0", [("s0.category", "category", 5)]), ("s1", [])):
        assert model.match_pairs[stream] == attrs
        lengths = seq[f"{stream}.item"].lengths()
        flags = model._match_flags(b, stream, lengths) if attrs else None
        got = hc.stream_counts(stream, seq[f"{stream}.event"].values(), ages[stream].values(),
                               flags, lengths)
        E = schema.stream(stream).num_event_types + 1
        assert got.shape == (5, (1 + len(attrs)) * E * 2)
        ev, age = seq[f"{stream}.event"].values().numpy(), ages[stream].values().double().numpy()
        cats = seq["s0.category"].values().numpy() if attrs else None
        want = np.zeros((5, 1 + len(attrs), E, 2))
        start = 0
        for r, n in enumerate(lengths.tolist()):
            for i in range(start, start + n):
                w = np.exp(-age[i] / taus)
                want[r, 0, ev[i]] += w
                if attrs and cats[i] == sp["category"].values()[r].item() and cats[i] != 5:
                    want[r, 1, ev[i]] += w
            start += n
        np.testing.assert_allclose(got.numpy(), want.reshape(5, -1), rtol=1e-5, atol=1e-7)
        if attrs:
            assert 0 < want[:, 1].sum() < want[:, 0].sum()  # some events match, not all
    token = hc([hc.stream_counts(s, seq[f"{s}.event"].values(), ages[s].values(),
                                 model._match_flags(b, s, seq[f"{s}.item"].lengths())
                                 if model.match_pairs[s] else None,
                                 seq[f"{s}.item"].lengths()) for s in model.streams])
    assert token.shape == (5, D) and torch.isfinite(token).all()
    off = _gem(GEMConfig(embedding_dim=D, count_decay_hours=()), schema)
    assert off.history_counts is None and torch.isfinite(off(b)).all()
    # recency: beside each sum, the largest weight e^(−age/τ) (the newest such event), 0 with none
    rec = _gem(replace(cfg, count_recency=True), schema).history_counts
    lengths = seq["s0.item"].lengths()
    flags = model._match_flags(b, "s0", lengths)
    got = rec.stream_counts("s0", seq["s0.event"].values(), ages["s0"].values(), flags, lengths)
    E, n = (
        schema.stream("s0").num_event_types + 1,
        2 * (schema.stream("s0").num_event_types + 1) * 2,
    )
    sums = hc.stream_counts("s0", seq["s0.event"].values(), ages["s0"].values(), flags, lengths)
    assert got.shape == (5, 2 * n) and torch.equal(got[:, :n], sums)
    ev, age = seq["s0.event"].values().numpy(), ages["s0"].values().double().numpy()
    cats, cand = seq["s0.category"].values().numpy(), sp["category"].values().numpy()
    want = np.zeros((5, 2, E, 2))
    start = 0
    for r, k in enumerate(lengths.tolist()):
        for i in range(start, start + k):
            w = np.exp(-age[i] / taus)
            want[r, 0, ev[i]] = np.maximum(want[r, 0, ev[i]], w)
            if cats[i] == cand[r] and cats[i] != 5:
                want[r, 1, ev[i]] = np.maximum(want[r, 1, ev[i]], w)
        start += k
    np.testing.assert_allclose(got[:, n:].numpy(), want.reshape(5, -1), rtol=1e-5, atol=1e-7)
    assert rec.num_counts == 2 * hc.num_counts
    with pytest.raises(ValueError, match="count_decay_hours"):
        GEMConfig(count_decay_hours=(24.0, 0.0)).validate()


def test_shortcut_starts_at_zero_and_reads_pairs():
    from opengem.model.heads import LowOrderShortcut

    sc = LowOrderShortcut(4, 3, 2, "fwfm")
    x = torch.randn(5, 4, 3)
    assert torch.equal(sc(x), torch.zeros(5, 2))
    model = _gem()  # GEM.init_weights resets every module: the shortcut must stay at zero
    assert all(p.abs().sum() == 0 for p in model.shortcut.parameters())
    with torch.no_grad():
        sc.pairs.weight.zero_()
        sc.pairs.weight[0, 5] = 1.0  # pair (2, 3) is the last of 6 upper-triangle pairs
    assert torch.allclose(sc(x)[:, 0], (x[:, 2] * x[:, 3]).sum(-1) / 3**0.5)


def test_fvfm_shortcut_weights_each_pair_per_dimension():
    from opengem.model.heads import LowOrderShortcut

    sc = LowOrderShortcut(4, 3, 2, "fvfm")
    x = torch.randn(5, 4, 3)
    assert torch.equal(sc(x), torch.zeros(5, 2)) and sc.pairs.weight.shape == (2, 6 * 3)
    with torch.no_grad():
        sc.pairs.weight[0, 5 * 3 + 1] = 2.0  # pair (2, 3), dimension 1
        sc.pairs.weight[1, 0 * 3 + 2] = -1.0  # pair (0, 1), dimension 2
    assert torch.allclose(sc(x)[:, 0], 2.0 * x[:, 2, 1] * x[:, 3, 1] / 3**0.5)
    assert torch.allclose(sc(x)[:, 1], -x[:, 0, 2] * x[:, 1, 2] / 3**0.5)
    # a GEM with it starts exactly where the one without a shortcut does
    with_fvfm = _gem(GEMConfig(embedding_dim=D, shortcut="fvfm"))
    assert all(p.abs().sum() == 0 for p in with_fvfm.shortcut.parameters())


def test_unit_pairs_and_unit_fm_read_directions_not_scales():
    """shortcut_pairs=unit and wukong.fm_input=unit: rescaling a token leaves the pairs / the FM
    block unchanged."""
    from opengem.model.heads import LowOrderShortcut
    from opengem.model.interaction_arch import FactorizationMachineBlock

    x = torch.randn(5, 4, 3)
    x2 = x.clone()
    x2[:, 1] *= 7.0
    sc = LowOrderShortcut(4, 3, 2, "fwfm", unit_pairs=True)
    with torch.no_grad():
        sc.pairs.weight.normal_()
    assert torch.allclose(sc(x), sc(x2), atol=1e-5)
    raw = LowOrderShortcut(4, 3, 2, "fwfm")
    raw.load_state_dict(sc.state_dict())
    assert not torch.allclose(raw(x), raw(x2), atol=1e-3)
    fm = FactorizationMachineBlock(4, 3,
                                   WukongConfig(num_fm=2, fm_rank=2, mlp_dims=(8,),
                                                fm_input="unit"))
    assert torch.allclose(fm(x), fm(x2), atol=1e-4)
    with pytest.raises(ValueError, match="fm_input"):
        WukongConfig(fm_input="cosine").validate()
    with pytest.raises(ValueError, match="shortcut_pairs"):
        GEMConfig(shortcut_pairs="cosine").validate()


def test_input_norm_puts_every_x0_token_on_unit_rms():
    b = _batch(tiny_schema())
    off, on = _gem(), _gem(GEMConfig(embedding_dim=D, input_norm="rms"))
    x_off, _ = off.inputs(b)
    x_on, _ = on.inputs(b)
    rms_off = x_off.pow(2).mean(-1).sqrt()
    present = rms_off > 0  # an empty multi-hot bag is a zero token and stays zero
    # the problem: ids ~0.05, the domain token ~1
    assert rms_off[present].max() / rms_off[present].min() > 5
    rms_on = x_on.pow(2).mean(-1).sqrt()
    assert torch.allclose(rms_on[present], torch.ones_like(rms_on[present]), atol=1e-3)
    assert torch.equal(rms_on[~present], torch.zeros_like(rms_on[~present]))
    with torch.no_grad():
        on.input_norm.gain[0].mul_(3.0)  # the gains re-weight a field
    x_gain, _ = on.inputs(b)
    assert torch.allclose(x_gain.pow(2).mean(-1).sqrt()[present[:, 0], 0], torch.tensor(3.0),
                          atol=1e-2)
    with pytest.raises(ValueError, match="input_norm"):
        GEMConfig(input_norm="layer").validate()
    with pytest.raises(ValueError, match="input_norm_gain"):
        GEMConfig(input_norm="rms", input_norm_gain=0.0).validate()


def test_a_rows_score_does_not_depend_on_its_batch():
    """Scored alone or beside rows with much longer histories, a row gets the same logits."""
    from opengem.data.batch import collate

    schema = tiny_schema()
    model = _gem(schema=schema).eval()
    table = random_table(schema, 5, seed=3,
                         lengths={"s0": np.array([1, 60, 0, 2, 40]),
                                  "s1": np.array([0, 1, 30, 2, 3])})
    with torch.no_grad():
        together = model(collate(table, schema))
        for i in range(5):
            alone = model(collate(table.slice(i, 1), schema))
            assert torch.allclose(alone[0], together[i], atol=1e-5), i


def test_decay_pool_is_the_decayed_mean_of_each_rows_events_and_its_times_learn():
    """``decay_pool_hours``: per stream and τ, Σ_e w_e v_e / (1 + Σ_e w_e) of the stream's event
    embeddings (w_e = e^(−age/τ)), against a loop over the rows; an empty history pools to 0; the
    tokens join X_0 and every parameter, the log-τ ones included, gets a gradient."""
    schema = tiny_schema()
    base = GEMConfig(embedding_dim=D, wukong=WukongConfig(num_layers=1, num_fm=2, num_lc=2),
                     sequence=SequenceConfig(num_heads=2, recent_len=4, min_recent=2,
                                             num_pooled=1))
    model = _gem(replace(base, decay_pool_hours=(0.5, 24.0)), schema)
    b = _batch(schema, n=5,
               lengths={"s0": np.array([3, 0, 6, 1, 4]), "s1": np.array([2, 2, 0, 5, 1])})
    emb, ages = model.sparse_arch.forward_sequences(b.sequences), b.seq_age.to_dict()
    torch.testing.assert_close(torch.exp(model.decay_pool.log_tau).detach(),
                               torch.tensor([[1800.0, 86400.0]] * 2))
    for i, name in enumerate(("s0", "s1")):
        values, lengths = emb[name]
        got = model.decay_pool.stream_tokens(i, values, ages[name].values(), lengths)
        age, v = ages[name].values().double(), values.double()
        start = 0
        for r, n in enumerate(lengths.tolist()):
            for k, tau in enumerate((1800.0, 86400.0)):
                w = torch.exp(-age[start:start + n] / tau)
                want = (w[:, None] * v[start:start + n]).sum(0) / (1 + w.sum())
                torch.testing.assert_close(got[r, k].double(), want, rtol=1e-5, atol=1e-7)
            if n == 0:
                assert got[r].abs().max() == 0
            start += n
    x, _ = model.inputs(b)
    assert x.shape[1] == _gem(base, schema).inputs(b)[0].shape[1] + 4
    _check_all_params_learn(model, model(b).sum())


def test_decay_pool_refuses_a_time_that_is_not_positive():
    with pytest.raises(ValueError, match="decay_pool_hours"):
        GEMConfig(decay_pool_hours=(24.0, 0.0)).validate()
