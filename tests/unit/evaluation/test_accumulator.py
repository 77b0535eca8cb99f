"""MetricAccumulator / RateCounter: routing, masking, pooling, base rates, multi-process reduce."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch

from opengem.data.base_rates import RateCounter
from opengem.evaluation.accumulator import MetricAccumulator
from opengem.evaluation.metrics import entropy, logloss, summarize

DOMAINS = ["feed", "search", "video"]
TASKS = ["click", "conv"]


def make_data(n: int, seed: int):
    """Random rows: probs [n,T], labels [n,T] (NaN where masked), mask, domains, groups, p_true."""
    rng = np.random.default_rng(seed)
    p_true = rng.uniform(0.05, 0.6, size=(n, len(TASKS)))
    labels = (rng.random((n, len(TASKS))) < p_true).astype(np.float32)
    probs = np.clip(p_true + rng.normal(0, 0.1, size=p_true.shape), 0.01, 0.99).astype(np.float32)
    probs = np.round(probs, 2)  # ties
    mask = rng.random((n, len(TASKS))) < 0.8
    labels[~mask] = np.nan  # masked-out labels may be garbage
    domains = rng.integers(0, len(DOMAINS), n)
    groups = rng.integers(0, 25, n)
    return probs, labels, mask, domains, groups, p_true


def rows_of(data, domain: int | None, task: int):
    probs, labels, mask, domains, groups, p_true = data
    sel = mask[:, task] if domain is None else mask[:, task] & (domains == domain)
    return probs[sel, task], labels[sel, task], groups[sel], p_true[sel, task]


def assert_reports_equal(a: dict, b: dict, rel: float = 1e-12):
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].keys() == b[key].keys(), key
        for field, va in a[key].items():
            vb = b[key][field]
            if isinstance(va, float) and math.isnan(va):
                assert isinstance(vb, float) and math.isnan(vb), (key, field)
            elif isinstance(va, float):
                assert va == pytest.approx(vb, rel=rel), (key, field, va, vb)
            else:
                assert va == vb, (key, field)


def test_routing_masking_and_all_pooling():
    data = make_data(400, seed=0)
    acc = MetricAccumulator(DOMAINS, TASKS, base_rates={"click": 0.3, "conv": 0.2})
    for s in range(0, 400, 64):  # several batches
        acc.update(*(x[s : s + 64] for x in data))
    report = acc.compute()
    assert set(report) == {f"{d}/{t}" for d in [*DOMAINS, "all"] for t in TASKS}
    for t, task in enumerate(TASKS):
        for d, domain in enumerate(DOMAINS):
            p, y, g, pt = rows_of(data, d, t)
            expected = summarize(p, y, {"click": 0.3, "conv": 0.2}[task], groups=g, p_true=pt)
            entry = report[f"{domain}/{task}"]
            # exactly the masked-in rows of this domain
            assert entry["n"] == int(data[2][:, t][data[3] == d].sum())
            for k, v in expected.items():
                assert entry[k] == pytest.approx(v, rel=1e-9, nan_ok=True), (domain, task, k)
        p, y, g, pt = rows_of(data, None, t)
        expected = summarize(p, y, {"click": 0.3, "conv": 0.2}[task], groups=g, p_true=pt)
        for k, v in expected.items():
            assert report[f"all/{task}"][k] == pytest.approx(v, rel=1e-9, nan_ok=True), (task, k)
        assert report[f"all/{task}"]["n"] == int(data[2][:, t].sum())
        assert sum(report[f"{d}/{task}"]["n"] for d in DOMAINS) == report[f"all/{task}"]["n"]


def test_rows_go_only_to_their_domain():
    # domain 0 predicts 0.1 on every row, domain 1 predicts 0.9; masked rows carry NaN garbage
    probs = torch.tensor([[0.1, np.nan], [0.9, 0.9], [0.1, 0.1], [0.9, np.nan]])
    labels = torch.tensor([[0, -1], [1, 0], [1, 1], [0, 7]])
    mask = torch.tensor([[True, False], [True, True], [True, True], [True, False]])
    domains = torch.tensor([0, 1, 0, 1])
    acc = MetricAccumulator(["a", "b"], ["t0", "t1"], base_rates=None)
    acc.update(probs, labels, mask, domains)
    r = acc.compute()
    assert r["a/t0"]["n"] == 2 and r["b/t0"]["n"] == 2 and r["all/t0"]["n"] == 4
    assert r["a/t0"]["calibration"] == pytest.approx(0.2 / 1)  # only the 0.1 predictions
    assert r["b/t0"]["calibration"] == pytest.approx(1.8 / 1)  # only the 0.9 predictions
    assert r["a/t1"]["n"] == 1 and r["b/t1"]["n"] == 1
    assert r["a/t1"]["logloss"] == pytest.approx(-math.log(0.1))
    assert r["b/t1"]["logloss"] == pytest.approx(-math.log(0.1))
    assert "gauc" in r["a/t0"] and math.isnan(r["a/t0"]["gauc"])  # no groups given


def test_empty_slices_are_left_out():
    acc = MetricAccumulator(["a", "b"], ["t"], base_rates={"t": 0.5})
    acc.update(np.array([0.2, 0.7]), np.array([0, 1]), np.array([True, True]), np.array([0, 0]))
    assert set(acc.compute()) == {"a/t", "all/t"}
    assert MetricAccumulator(["a"], ["t"]).compute() == {}


def test_base_rate_precedence_and_source():
    data = make_data(300, seed=1)
    rates = {"click": 0.3, "feed/click": 0.1, "conv": 0.2, "all/conv": 0.25}
    acc = MetricAccumulator(DOMAINS, TASKS, base_rates=rates)
    acc.update(*data)
    r = acc.compute()
    expected_rate = {
        "feed/click": 0.1, "search/click": 0.3, "video/click": 0.3, "all/click": 0.3,
        "feed/conv": 0.2, "search/conv": 0.2, "video/conv": 0.2, "all/conv": 0.25,
    }  # fmt: skip
    for key, rate in expected_rate.items():
        assert r[key]["base_rate"] == rate
        assert r[key]["base_rate_source"] == "train"
        d, t = key.split("/")
        p, y, _, _ = rows_of(data, None if d == "all" else DOMAINS.index(d), TASKS.index(t))
        assert r[key]["ne"] == pytest.approx(logloss(p, y) / entropy(rate), rel=1e-9)


def test_eval_base_rate_when_none():
    data = make_data(300, seed=2)
    acc = MetricAccumulator(DOMAINS, TASKS, base_rates=None)
    acc.update(*data)
    r = acc.compute()
    for key, entry in r.items():
        d, t = key.split("/")
        p, y, _, _ = rows_of(data, None if d == "all" else DOMAINS.index(d), TASKS.index(t))
        rate = y.astype(np.float64).mean()
        assert entry["base_rate_source"] == "eval"
        assert entry["base_rate"] == pytest.approx(rate, rel=1e-12)
        assert entry["ne"] == pytest.approx(logloss(p, y) / entropy(rate), rel=1e-12)


def test_degenerate_rate_gives_nan_ne():
    acc = MetricAccumulator(["a"], ["t"], base_rates=None)
    acc.update(np.array([[0.2], [0.3]]), np.array([[0], [0]]), None, np.array([0, 0]))
    e = acc.compute()["a/t"]
    assert e["base_rate"] == 0.0 and math.isnan(e["ne"]) and math.isnan(e["auc"])
    assert e["logloss"] == pytest.approx(-(math.log(0.8) + math.log(0.7)) / 2)


def test_base_rate_validation():
    with pytest.raises(ValueError, match="no rate for"):
        MetricAccumulator(DOMAINS, TASKS, base_rates={"click": 0.3})
    with pytest.raises(ValueError, match="unknown key 'clik'"):
        MetricAccumulator(DOMAINS, TASKS, base_rates={"click": 0.3, "conv": 0.1, "clik": 0.3})
    with pytest.raises(ValueError, match=r"base_rates\['conv'\]"):
        MetricAccumulator(DOMAINS, TASKS, base_rates={"click": 0.3, "conv": 1.5})
    # per-domain keys alone are enough when every domain (and "all") is covered
    per = {f"{d}/{t}": 0.2 for d in [*DOMAINS, "all"] for t in TASKS}
    MetricAccumulator(DOMAINS, TASKS, base_rates=per)
    with pytest.raises(ValueError, match="reserved"):
        MetricAccumulator(["all", "feed"], TASKS)


def test_update_errors_name_the_problem():
    acc = MetricAccumulator(["a", "b"], ["t0", "t1"], base_rates=None)
    p = np.full((3, 2), 0.5)
    y = np.zeros((3, 2))
    m = np.ones((3, 2), bool)
    d = np.array([0, 1, 0])
    with pytest.raises(ValueError, match=r"task 't1': labels .*0 or 1"):
        acc.update(p, np.array([[0, 0], [1, 2], [0, 0]]), m, d)
    with pytest.raises(ValueError, match="task 't0': probs contains NaN"):
        acc.update(np.array([[np.nan, 0.5], [0.5, 0.5], [0.5, 0.5]]), y, m, d)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        acc.update(p + 0.6, y, m, d)
    with pytest.raises(ValueError, match=r"shape \[B, 2\]"):
        acc.update(p[:, :1], y, m, d)
    with pytest.raises(ValueError, match="labels has 2 rows"):
        acc.update(p, y[:2], m, d)
    with pytest.raises(ValueError, match=r"domains must lie in \[0, 2\)"):
        acc.update(p, y, m, np.array([0, 2, 0]))
    with pytest.raises(ValueError, match="groups must have shape"):
        acc.update(p, y, m, d, groups=np.array([1, 2]))
    # nothing was stored by the failed calls
    assert acc.compute() == {}
    acc.update(p, y, m, d, groups=np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="groups must be given in every update"):
        acc.update(p, y, m, d)


def test_torch_inputs_bf16_and_grad():
    probs = torch.tensor([[0.25], [0.75], [0.5]], requires_grad=True)
    acc = MetricAccumulator(["a"], ["t"], base_rates={"t": 0.5})
    acc.update(probs.to(torch.bfloat16) * 1, torch.tensor([[0.0], [1.0], [1.0]]),
               torch.ones(3, 1, dtype=torch.bool), torch.zeros(3, dtype=torch.long),
               torch.tensor([4, 4, 4]))  # fmt: skip
    e = acc.compute()["a/t"]
    assert e["auc"] == 1.0 and e["gauc"] == 1.0 and e["n"] == 3 and e["positives"] == 2


def test_label_rates_and_rate_counter_agree():
    data = make_data(500, seed=3)
    probs, labels, mask, domains, groups, _ = data
    acc = MetricAccumulator(DOMAINS, TASKS)
    rc = RateCounter(DOMAINS, TASKS)
    for s in range(0, 500, 100):
        acc.update(probs[s : s + 100], labels[s : s + 100], mask[s : s + 100], domains[s : s + 100])
        rc.update(torch.from_numpy(labels[s : s + 100]), torch.from_numpy(mask[s : s + 100]),
                  torch.from_numpy(domains[s : s + 100]))  # fmt: skip
    lr, rr = acc.label_rates(), rc.rates()
    assert lr.keys() == rr.keys() == {*TASKS, *(f"{d}/{t}" for d in DOMAINS for t in TASKS)}
    for k in lr:
        assert lr[k] == pytest.approx(rr[k], rel=1e-12)
    for t, task in enumerate(TASKS):
        assert rr[task] == pytest.approx(np.nanmean(labels[mask[:, t], t]))
        assert rr[f"video/{task}"] == pytest.approx(labels[mask[:, t] & (domains == 2), t].mean())
    # usable as base rates of an accumulator
    MetricAccumulator(DOMAINS, TASKS, base_rates=rr)
    # without torch.distributed initialised, reduce() changes nothing
    acc.reduce()
    rc.reduce()
    assert acc.label_rates() == lr and rc.rates() == rr


# --------------------------------------------------------------------- multi-process reduce


def _rank_batches(rank: int):
    """Deterministic per-rank batches; rank 1 has no 'video' rows at all and one empty batch."""
    data = make_data(600, seed=10 + rank)
    if rank == 1:
        keep = data[3] != DOMAINS.index("video")
        data = tuple(x[keep] for x in data)
    n = data[0].shape[0]
    batches = [tuple(x[s : s + 128] for x in data) for s in range(0, n, 128)]
    if rank == 1:
        batches.insert(1, tuple(x[:0] for x in data))
    return batches


def _fill(acc: MetricAccumulator, rc: RateCounter, batches) -> None:
    for probs, labels, mask, domains, groups, p_true in batches:
        acc.update(torch.from_numpy(probs), torch.from_numpy(labels), torch.from_numpy(mask),
                   torch.from_numpy(domains), torch.from_numpy(groups), torch.from_numpy(p_true))  # fmt: skip
        rc.update(labels, mask, domains)


def _dist_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    try:
        acc = MetricAccumulator(DOMAINS, TASKS, base_rates=None)  # eval rates: depend on all ranks
        rc = RateCounter(DOMAINS, TASKS)
        _fill(acc, rc, _rank_batches(rank))
        acc.reduce()
        rc.reduce()
        result = {"report": acc.compute(), "label_rates": acc.label_rates(), "rates": rc.rates()}
        for obj in (acc, rc):  # reducing twice would double-count
            try:
                obj.reduce()
                result["second_reduce_raised"] = False
            except RuntimeError:
                result.setdefault("second_reduce_raised", True)
        with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_reduce_two_gloo_processes_equals_single_process(tmp_path):
    import torch.multiprocessing as mp

    world = 2
    mp.spawn(_dist_worker, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world,
             join=True)

    acc = MetricAccumulator(DOMAINS, TASKS, base_rates=None)
    rc = RateCounter(DOMAINS, TASKS)
    for rank in range(world):  # rank order = order of the gathered rows
        _fill(acc, rc, _rank_batches(rank))
    expected = acc.compute()
    assert expected["video/click"]["n"] > 0

    for rank in range(world):
        with open(tmp_path / f"rank{rank}.pkl", "rb") as f:
            got = pickle.load(f)
        assert_reports_equal(got["report"], expected)
        assert got["label_rates"] == pytest.approx(acc.label_rates(), rel=1e-12)
        assert got["rates"] == pytest.approx(rc.rates(), rel=1e-12)
        assert got["second_reduce_raised"]
