"""The op measurements behind ``benchmarks/jagged.py`` and ``opengem bench --quick``, at toy sizes:
the padded reference computes what GEM's jagged sequence side computes, and each figure is computed
from real runs and has the value its definition implies."""

import pytest
import torch
from instruments import ops as bench_ops

from opengem.model.sequence_arch import SequenceConfig, SequenceTower
from opengem.world.generate import generate
from opengem.world.presets import world_config


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_padded_tower_equals_gems_jagged_tower(position):
    torch.manual_seed(0)
    cfg = SequenceConfig(num_heads=2, recent_len=4, min_recent=2, num_pooled=3, position=position)
    tower = SequenceTower(n_sum=2, dim=8, num_layers=2, cfg=cfg)
    with torch.no_grad():  # the sink and positions start at zero: make them matter
        for p in (tower.sink_logit, tower.sink_value, tower.pos_emb):
            p.normal_()
    lengths = torch.tensor([0, 1, 3, 4, 11, 6])  # empty, shorter than K, = K, longer than K
    n, width = int(lengths.sum()), 11
    values = torch.randn(n, 8, requires_grad=True)
    ages = torch.rand(n) * 1e6
    x_sum = torch.randn(6, 2, 8, requires_grad=True)
    vp, valid = bench_ops.pad_right_aligned(values.detach(), lengths, width)
    ap, _ = bench_ops.pad_right_aligned(ages, lengths, width)
    assert (
        valid.sum() == n
        and torch.equal(vp[4], values.detach()[8:19])
        and torch.equal(vp[2, -3:], values[1:4])
    )
    vp.requires_grad_()

    jag = bench_ops.jagged_tower(tower, values, ages, lengths, x_sum)
    g_j = torch.autograd.grad(jag.pow(2).sum(),
                              [values, x_sum, tower.pool_q, tower.layers[0].qkv.weight])
    pad = bench_ops.padded_tower(tower, vp, ap, valid, x_sum)
    g_p = torch.autograd.grad(pad.pow(2).sum(),
                              [vp, x_sum, tower.pool_q, tower.layers[0].qkv.weight])
    assert jag.shape == pad.shape == (6, 2 + 3 + 2, 8)  # pyramid: K 4 → 2 after the first layer
    torch.testing.assert_close(pad, jag, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_p[0][valid], g_j[0], atol=1e-5, rtol=1e-5)
    assert g_p[0][~valid].abs().max() == 0  # padding slots get no gradient
    for a, b in zip(g_p[1:], g_j[1:]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_sequence_side_case_figures_follow_their_definitions(tmp_path):
    torch.set_num_threads(1)
    generate(world_config("tiny", seed=0), tmp_path, progress=False)
    out = bench_ops.sequence_side_case(tmp_path, "tiny", batches=2, repeats=3, inner=1)
    assert (
        out["batches"] == 2
        and out["rows_per_batch"] == 128
        and set(out["lengths"]) == {"organic", "ads"}
    )
    for s in out["lengths"].values():
        assert s["max"] <= 256 and s["padded_slots_over_events"] >= 1
    for mode in ("fwd", "fwd_bwd"):
        r = out[mode]["padded_over_jagged_time"]
        assert r["n"] == 3 and r["min"] <= r["q1"] <= r["median"] <= r["q3"] <= r["max"]
        # the ratio is formed per round, so it is not the ratio of the two medians; timings belong
        # to ``benchmarks/jagged.py`` and ``opengem bench --quick``, medians of several rounds
        assert out[mode]["jagged_ms"]["n"] == out[mode]["padded_ms"]["n"] == 3
    assert out["saved_bytes"]["padded_over_jagged"] == round(out["saved_bytes"]["padded"]
                                                             / out["saved_bytes"]["jagged"], 2)


def test_spread_is_median_range_and_quartiles():
    s = bench_ops.spread([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s["median"], s["min"], s["max"], s["q1"], s["q3"], s["n"]) == (
        3.0,
        1.0,
        5.0,
        2.0,
        4.0,
        5,
    )


def test_trained_tiny_fp8_and_table_compression(tmp_path):
    model, test, rates = bench_ops.trained_tiny(str(tmp_path), epochs=1)
    assert len(rates) == 2 and 0 < rates[1] < rates[0] < 1 and test
    fp8 = bench_ops.fp8_step(model, test[0])
    assert fp8["fp8_saved_bytes_ratio"] > 2 and fp8["fp8_tensors"] > 0
    assert 0 < fp8["fp8_grad_rel_l2_err"] < 0.1 and fp8["fp8_grad_min_cosine"] > 0.9
    t = bench_ops.table_ne(model, test, rates)
    assert t["fp16_table_bytes_ratio"] == 2.0 and t["int8_table_bytes_ratio"] > 3
    # < 1 % NE either way
    assert all(abs(c) < 1.0 for c in t["ne_cost_int8_pct"] + t["ne_cost_fp16_pct"])
