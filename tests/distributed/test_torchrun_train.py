"""``torchrun -m opengem train`` end to end on the tiny world (2 gloo processes, one thread each).

    A  table-wise, 12 steps                      the reference run
    B  row-wise, same data and steps             same losses as A (the layout does not change the math)
    C  A's config, one rank SIGKILLed after a checkpoint, then ``--resume``: A's exact parameters
    D  A's config, one rank SIGTERMed (a preemption): both ranks stop after the same step, save, exit;
       ``--resume``: A's exact parameters
    E  A's config with held-out evaluation every 4 steps, early stopping and the best checkpoint
    A's checkpoint in one process: ``opengem evaluate``, the same params_sha256, and a resume on
    another world size (refused by default, ``train.resume_reshard=rewind`` continues)
"""

import json
import os
import shutil
import signal

import _torchrun as T
import numpy as np
import pytest

from opengem.checkpoint import checkpoint_dir
from opengem.cli import main
from opengem.run import FINAL_FILE, METRICS_FILE
from opengem.train.resume import position_after, shared_data_boundary

pytestmark = pytest.mark.distributed

STEPS, BATCH = 12, 64  # each rank holds about 1,000 training rows: 15 full batches
TRAIN = (f"train.max_steps={STEPS}", f"data.batch_size={BATCH}", "train.log_every=1",
         "optim.warmup_steps=2")


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "data"
    assert main(["--quiet", "generate", "--preset", "tiny", "--out", str(out), "--seed", "1"]) == 0
    return out


def _train_args(data, run, *extra, resume=False):
    flags = ("--resume",) if resume else ()
    return ("train", "--recipe", "tiny", "--data", str(data), "--out", str(run), *flags, *TRAIN,
            *extra)


@pytest.fixture(scope="module")
def run_a(tiny_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("a") / "run"
    T.run(2, *_train_args(tiny_data, run, "parallel.default_sharding=table_wise"),
          log=run.parent / "log")
    return run


def test_layouts_agree_and_the_checkpoint_loads_in_one_process(tiny_data, run_a, tmp_path):
    from opengem.run import load_run_model
    from opengem.train.trainer import params_sha256

    T.run(2, *_train_args(tiny_data, tmp_path / "b", "parallel.default_sharding=row_wise"),
          log=tmp_path / "log")
    a, b = T.final(run_a), T.final(tmp_path / "b")
    assert (a["steps"], a["world_size"], len(a["peak_rss_mb"])) == (STEPS, 2, 2)
    # every step: both ranks' full batches
    assert a["examples"] == b["examples"] == STEPS * 2 * BATCH
    assert len(a["params_sha256"]) == 64 and a["parameters"]["total"] > a["parameters"]["dense"] > 0
    assert "table_wise" in "\n".join(a["parallel"]["sparse_plan"])
    assert "row_wise" in "\n".join(b["parallel"]["sparse_plan"])
    la, lb = T.losses(run_a), T.losses(tmp_path / "b")
    assert [s for s, _ in la] == [s for s, _ in lb] == list(range(1, STEPS + 1))
    assert max(abs(x - y) / abs(x) for (_, x), (_, y) in zip(la, lb)) <= 1e-5, (la, lb)

    model, _, _ = load_run_model(run_a)  # the plain single-process model from the 2-rank checkpoint
    assert params_sha256(model) == a["params_sha256"]
    # The tiny recipe's EMA: every rank wrote its shards of the average as the model and of the
    # training weights beside it; both load into one process, and they differ.
    import torch

    from opengem.checkpoint import latest_checkpoint, load_tensors
    from opengem.train.ema import EMA_KEY, dense_ema

    ckpt = latest_checkpoint(run_a)
    for rank in (0, 1):
        state = torch.load(ckpt / f"trainer_state-rank{rank}.pt", weights_only=False)
        assert state["ema"] == {"decay": 0.9, "updates": STEPS}
    trained, _, _ = load_run_model(run_a)
    load_tensors(ckpt, {EMA_KEY: dense_ema(trained, 0.9).params})
    assert params_sha256(trained) != a["params_sha256"]
    out = tmp_path / "eval.json"
    assert (
        main(
            [
                "--quiet",
                "evaluate",
                "--run",
                str(run_a),
                "--data",
                str(tiny_data),
                "--json",
                str(out),
            ]
        )
        == 0
    )
    ev = json.loads(out.read_text())
    assert ev["metrics"]["all/click"]["n"] > 0 and 0 < ev["metrics"]["all/click"]["auc"] < 1


def test_killed_rank_then_resume_is_bit_identical(tiny_data, run_a, tmp_path):
    run, log = tmp_path / "c", tmp_path / "log"
    layout = ("parallel.default_sharding=table_wise", "train.ckpt_every=2")
    proc = T.start(2, *_train_args(tiny_data, run, *layout), log=log)
    try:
        T.wait_for(lambda: (checkpoint_dir(run) / "LATEST").exists(), 240, "the first checkpoint",
                   proc, log)
        pid = T.wait_for(lambda: T.worker_pid(proc, 1), 10, "rank 1's pid", proc, log)
        os.kill(pid, signal.SIGKILL)
        assert proc.wait(timeout=120) != 0
    finally:
        T.stop(proc)
    assert not (run / FINAL_FILE).exists(), "the run finished before the kill; nothing was tested"
    killed_at = (checkpoint_dir(run) / "LATEST").read_text()
    T.run(2, *_train_args(tiny_data, run, *layout, resume=True), log=log)
    a, c = T.final(run_a), T.final(run)
    assert (c["steps"], c["examples"], c["params_sha256"]) == (
        a["steps"],
        a["examples"],
        a["params_sha256"],
    ), killed_at
    assert T.losses(run) == T.losses(run_a)  # steps redone after the checkpoint are logged once


def test_sigterm_to_one_rank_checkpoints_both_and_resumes_bit_identical(tiny_data, run_a, tmp_path):
    run, log = tmp_path / "d", tmp_path / "log"
    # no periodic checkpoints: only SIGTERM saves
    layout = ("parallel.default_sharding=table_wise",)
    proc = T.start(2, *_train_args(tiny_data, run, *layout), log=log)
    try:
        metrics = run / METRICS_FILE
        T.wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, 240,
                   "two steps", proc, log)
        pid = T.wait_for(lambda: T.worker_pid(proc, 1), 10, "rank 1's pid", proc, log)
        os.kill(pid, signal.SIGTERM)
        assert proc.wait(timeout=120) != 0  # preempted, not finished
    finally:
        T.stop(proc)
    assert not (run
                / FINAL_FILE).exists(), "the run finished before the SIGTERM; nothing was tested"
    latest = checkpoint_dir(run) / (checkpoint_dir(run) / "LATEST").read_text().strip()
    assert sorted(p.name for p in latest.glob("trainer_state-rank*.pt")) == [
        "trainer_state-rank0.pt",
        "trainer_state-rank1.pt",
    ]
    assert "exiting with code 75" in log.read_text()
    T.run(2, *_train_args(tiny_data, run, *layout, resume=True), log=log)
    a, d = T.final(run_a), T.final(run)
    assert (d["steps"], d["examples"], d["params_sha256"]) == (
        a["steps"],
        a["examples"],
        a["params_sha256"],
    ), latest
    assert T.losses(run) == T.losses(run_a)


def test_held_out_evaluation_on_two_ranks_matches_one_process(tiny_data, run_a, tmp_path):
    """The ranks score their own valid files (2 and 1: different numbers of batches, so the row-wise
    sharded forward runs in lockstep), the metrics are reduced, every rank takes rank 0's stop
    decision; the figures are those of one process scoring the saved model, and the best checkpoint
    loads in one process."""
    from opengem.evaluation.evaluate import evaluate_model
    from opengem.run import load_run_model

    run = tmp_path / "e"
    T.run(2,
          *_train_args(tiny_data, run, "parallel.default_sharding=row_wise", "train.eval_every=1",
                          "train.eval_metric=all/conversion:auc", "train.early_stop_patience=1",
                          "train.keep_best=true"), log=tmp_path / "log")
    e, lines = T.final(run), [json.loads(x)
                              for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in lines if "eval" in x]
    assert [x["step"] for x in evals] == list(range(1, e["steps"] + 1))
    # conversion AUC is noisy at 64 rows a rank
    assert e["evaluation"]["stopped_early"] and e["steps"] < STEPS
    train_losses, ref = [(x["step"], x["loss"]) for x in lines
                         if "loss" in x], T.losses(run_a)[:e["steps"]]
    # evaluating moved nothing
    assert max(abs(x - y) / abs(x) for (_, x), (_, y) in zip(train_losses, ref)) <= 1e-5
    rates = json.loads((run / "base_rates.json").read_text())
    for best, line in ((False, evals[-1]),
                       (True, next(x for x in evals if x["step"] == e["evaluation"]["best_step"]))):
        model, _, schema = load_run_model(run, recalibrated=False, best=best)
        one = evaluate_model(model, schema, tiny_data, "valid", rates, progress=False)["metrics"]
        for key, field in (("all/click", "ne"), ("all/click", "auc"), ("all/conversion", "auc")):
            assert one[key]["n"] == line["eval"][key]["n"] > 0
            assert abs(one[key][field] / line["eval"][key][field] - 1) < 1e-6, (
                key,
                field,
                one[key],
                line["eval"][key],
            )


def test_resume_on_another_world_size(tiny_data, run_a, tmp_path, capsys):
    run = tmp_path / "one"
    shutil.copytree(run_a, run)
    args = ["--quiet", *_train_args(tiny_data, run, f"train.max_steps={STEPS + 2}", resume=True)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "written by 2 ranks; resuming on 1" in err and "train.resume_reshard=rewind" in err, err
    assert main([*args, "train.resume_reshard=rewind"]) == 0
    one = T.final(run)
    assert one["steps"] == STEPS + 2 and one["world_size"] == 1
    assert one["resharded"]["from_world_size"] == 2 and one["resharded"]["rows_repeated"] > 0
    assert [s for s, _ in T.losses(run)] == list(range(1, STEPS + 3))


def _read_by(positions, n, epochs):
    """Units (epoch, global shard) each rank has touched, by the definition
    in ``shared_data_boundary``."""
    W, units = len(positions), []
    for r, p in enumerate(positions):
        for e in range(epochs):
            for g in range(r, n, W):
                j = (g - r) // W
                if (e, j) < (p["epoch"], p["shard"]) or ((e, j) == (p["epoch"], p["shard"])
                                                         and p["row"]):
                    units.append((e, g))
    return units


@pytest.mark.parametrize("seed", range(20))
def test_shared_data_boundary(seed):
    rng = np.random.default_rng(seed)
    n, epochs, W = int(rng.integers(1, 9)), int(rng.integers(1, 4)), int(rng.integers(1, 5))
    positions = [{"epoch": int(rng.integers(0, epochs + 1)), "shard": 0, "row": 0}
                 for _ in range(W)]
    for r, p in enumerate(positions):
        if p["epoch"] < epochs:
            p["shard"] = int(rng.integers(0, len(range(r, n, W)) + 1))
            p["row"] = int(rng.integers(0, 3)) if p["shard"] < len(range(r, n, W)) else 0
    m, past = shared_data_boundary(positions, n, epochs)
    read = _read_by(positions, n, epochs)
    assert len(read) == len(set(read))
    assert all(e * n + g < m for e, g in read) == (not past)
    assert sorted({(e, g) for e, g, _ in past}) == sorted((e, g) for e, g in read if e * n + g >= m)
    assert set(range(m)) <= {e * n + g for e, g in read}
    # any world size continuing after m reads every later unit exactly once
    for W2 in (1, 2, 3):
        later = []
        for r in range(W2):
            p = position_after(m, n, r, W2)
            later += [(e, g) for e in range(p["epoch"], epochs) for j,
                      g in enumerate(range(r, n, W2))
                      if e > p["epoch"] or j >= p["shard"]]
        assert sorted(later) == [divmod(u, n) for u in range(m, epochs * n)]


def test_parallel_overrides_parse_and_validate():
    from opengem.config import Config, ConfigError, apply_overrides
    from opengem.recipes import recipe

    cfg = apply_overrides(recipe("tiny"),
                          ["parallel.dp_shard=2", "parallel.default_sharding=row_wise",
                                           'parallel.sharding={"t_user_id": "column_wise"}'])
    assert (cfg.parallel.dp_shard, cfg.parallel.default_sharding) == (2, "row_wise")
    assert cfg.parallel.sharding == {"t_user_id": "column_wise"}
    assert Config.from_dict(json.loads(json.dumps(cfg.to_dict()))).parallel == cfg.parallel
    for item, words in [("parallel.default_sharding=diagonal", "default_sharding must be one of"),
                        ("parallel.sharding=[1]", "expected a JSON object"),
                        ('parallel.sharding={"t_user_id": "x"}', "t_user_id"),
                        ("parallel.dp_replicate=0", "dp_replicate must be >= 1"),
                        ("train.resume_reshard=maybe", "exact or rewind")]:
        with pytest.raises(ConfigError, match=words):
            apply_overrides(recipe("tiny"), [item])
