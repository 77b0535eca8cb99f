"""Off-policy estimates on Open Bandit: the CTR a model would get if it chose the items, read from the
uniformly random logger's clicks, and the estimators checked against a policy whose CTR is known.

    python benchmarks/off_policy.py --quick   # GEM and DLRM-DCN at the tiny recipe's lrs, 2 epochs
                                              # (< 5 min on 2 cores)
    python benchmarks/off_policy.py           # each model's lr chosen on valid over quality.py's
                                              # --quick grid (2 x 2), up to 2 epochs

Data: ``shared/data/open-bandit-small``'s ``random/`` logs only (campaigns all, men, women; the
logger picks each slot's item uniformly, so the propensity is 1 / #items), converted by
``opengem.data.sources.open_bandit`` (days 0-4 train, 5 valid, 6 test). The models (``gem``,
``dlrm_dcn``: ``quality.NEURAL``'s overrides) train on train through ``quality.neural_trial``.

The target policy of a model: for each logged test row (a user at one slot of one impression), it
scores every item of the campaign at each of the three slots, ranks the items by the mean of the
three predicted click probabilities (one ranking, so the three slots show three different items),
and shows the r-th ranked item at slot r. Its value is the expected clicks per slot-impression
(the CTR), estimated from the random test rows by IPS, self-normalised IPS and DR
(``opengem.evaluation.off_policy``); DR's reward model is the model itself, its predicted click
probability for each item at the row's slot and context. Intervals: 95 % percentile bootstrap
over the rows. Beside them, the random logger's own test CTR.

The check: Bernoulli Thompson Sampling (the ``bts/`` logs) is a second policy whose on-policy CTR
is known (its logs' mean click). Its action probabilities on the random rows are the bts logs'
share of each (item, slot) per campaign, not its logged propensities averaged per item and slot:
BTS's posterior moved through the week (an item at a slot carries up to hundreds of distinct
propensities), and the propensity logged with a shown item is biased upwards by its being shown,
while the share of rows that show an item is an unbiased estimate of BTS's time-averaged
probability of showing it, the policy whose CTR the bts logs' mean click measures. (obp's own
check instead simulates the BTS posterior from ZOZO's production prior, which is not in the data.)
It is estimated on every random row (IPS, SNIPS: no model needed) and on the test rows (with DR,
each model as reward model); the interval of the difference (estimate - on-policy) combines two
independent bootstraps, the random rows' and the bts logs'.

The last line is ONE JSON object of headline figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from opengem.evaluation.off_policy import (
    Interval,
    bootstrap_ci,
    bootstrap_draws,
    dr,
    ips,
    percentile_interval,
    snips,
)

CAMPAIGNS = ("all", "men", "women")  # the OBD folders; domain index = position here
MODELS = ("gem", "dlrm_dcn")
QUICK_POINT = (3e-3, 0.1)  # the tiny recipe's own (dense lr, table lr)
SLOTS = 3
N_BOOT = 2000
DAY = 86400


# ------------------------------------------------------------------------------- raw logs
def read_log(shared: Path, policy: str, camp: str) -> dict:
    """One raw (policy, campaign) log: ts (s), item, slot (0-2), click, pscore, affinity [n, items]."""
    from opengem.data.sources.common import parse_time, read_csv, to_float

    path = shared / policy / camp / f"{camp}.csv.gz"
    log = read_csv(path, numeric=lambda c: c.startswith("user-item_affinity_") or c in (
        "item_id", "position", "click", "propensity_score"))
    aff = sorted((c for c in log if c.startswith("user-item_affinity_")),
                 key=lambda c: int(c.rsplit("_", 1)[1]))
    return {"ts": parse_time(log["timestamp"], f"{path} column timestamp"),
            "item": log["item_id"].astype(np.int64), "slot": log["position"].astype(np.int64) - 1,
            "click": log["click"].astype(np.float64), "pscore": log["propensity_score"],
            "affinity": np.nan_to_num(np.stack([to_float(log[c], c) for c in aff], 1))}


def random_dataset(work: Path, shared: Path) -> Path:
    """The random logger's three campaigns as a dataset (the bts folder left out: the models learn
    from the log the estimators read)."""
    from opengem.data.parquet import MANIFEST
    from opengem.data.sources import convert

    out = work / "data" / "obd-random"
    if not (out / MANIFEST).exists():
        src = work / "obd-random-in"
        src.mkdir(parents=True, exist_ok=True)
        if not (src / "random").exists():
            (src / "random").symlink_to((shared / "random").resolve())
        convert("open_bandit", src, out)
    return out


# ------------------------------------------------------------------------------- training
def train_models(data: Path, work: Path, quick: bool, jobs: int) -> dict[str, dict]:
    """model → {run, point, test metrics}: quality.py's trial, at the recipe's lrs (--quick) or the
    point with the best valid NE over quality.py's --quick grid."""
    from instruments.tune import choose, lr_grid
    from quality import NEURAL, QUICK, neural_trial

    grid = [QUICK_POINT] if quick else lr_grid(QUICK.dense_lrs, QUICK.table_lrs)
    run = {(m, p): str(work / "runs" / m / f"lr{p[0]:g}-t{p[1]:g}") for m in MODELS for p in grid}
    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
        futures = {k: pool.submit(neural_trial, str(data), r, "tiny",
                                  [*NEURAL[k[0]], "train.seed=0", "data.seed=0"], k[1],
                                  QUICK.max_epochs, quick)
                   for k, r in run.items()}
        trials = {k: f.result() for k, f in futures.items()}
        out = {}
        for m in MODELS:
            point = choose({p: [trials[(m, p)]["valid_value"]] for p in grid})
            test = trials[(m, point)] if quick else pool.submit(
                neural_trial, str(data), run[(m, point)], "tiny",
                [*NEURAL[m], "train.seed=0", "data.seed=0"], point, QUICK.max_epochs, True).result()
            out[m] = {"run": run[(m, point)], "point": list(point),
                      "test": {k: test["metrics"]["all/click"][k] for k in ("auc", "ne")}}
    return out


# ------------------------------------------------------------------------------- counterfactuals
def test_rows(data: Path) -> dict[str, np.ndarray]:
    """Every column of the dataset's test split, in file order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from opengem.data.parquet import DatasetManifest

    files = DatasetManifest.load(data).split_files("test")
    table = pa.concat_tables([pq.read_table(data / f.path) for f in files])
    return {n: table.column(n).to_numpy() for n in table.column_names}


def candidates(data: Path, rows: dict, logs: dict) -> dict:
    """Per campaign: the item ids as the dataset encodes them, their item columns, and each test
    row's raw log entry (for its propensity and its affinity to every item)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from opengem.data.parquet import DatasetManifest
    from opengem.data.sources.common import Vocab

    man = DatasetManifest.load(data)
    train = pa.concat_tables([pq.read_table(data / f.path) for f in man.split_files("train")])
    item_cols = ["item_id", "item_feature_0", "item_feature_1", "item_feature_2", "item_feature_3"]
    # the converter's item vocabulary: campaign-qualified ids fitted on train (days 0-4)
    first_day = min(int(lg["ts"].min()) for lg in logs.values()) // DAY * DAY
    names = np.concatenate([np.char.add(f"{c}:", lg["item"][(lg["ts"] - first_day) // DAY < 5]
                                        .astype(str)) for c, lg in logs.items()])
    vocab = Vocab(names)
    features = {n: train.column(n).to_numpy() for n in item_cols}
    order = _converter_order(logs, first_day)
    first = {int(c): i for i, c in reversed(list(enumerate(features["item_id"])))}
    out = {}
    for d, camp in enumerate(CAMPAIGNS):
        log = logs[camp]
        n_items = log["affinity"].shape[1]
        code = vocab(np.char.add(f"{camp}:", np.arange(n_items).astype(str)))
        if (code >= len(vocab)).any():
            raise ValueError(f"{camp}: items {np.flatnonzero(code >= len(vocab))} never logged in "
                             f"train")
        cols = {n: features[n][[first[int(c)] for c in code]] for n in item_cols}
        mine = np.flatnonzero(rows["domain"] == d)
        raw = order[1][order[0] == d]
        logged = (code[log["item"][raw]], log["slot"][raw], log["click"][raw])
        if not all(np.array_equal(x, rows[n][mine]) for x, n in zip(
                logged, ("item_id", "position", "click"))) or not np.allclose(
                np.log1p(np.maximum(log["affinity"][raw, log["item"][raw]], 0)),
                rows["affinity_item"][mine], atol=1e-5):
            raise ValueError(f"{camp}: the test rows do not line up with the raw log's last day")
        out[camp] = {"rows": mine, "raw": raw, "items": cols, "logged": log["item"][raw]}
    return out


def _converter_order(logs: dict, first_day: int) -> tuple[np.ndarray, np.ndarray]:
    """(campaign, raw row) of each test row in the dataset's order: the converter concatenates the
    campaigns' logs and writes each day's rows sorted by time, ties in that order."""
    camp = np.concatenate([np.full(len(logs[c]["ts"]), d) for d, c in enumerate(CAMPAIGNS)])
    row = np.concatenate([np.arange(len(logs[c]["ts"])) for c in CAMPAIGNS])
    ts = np.concatenate([logs[c]["ts"] for c in CAMPAIGNS])
    day = (ts - first_day) // DAY
    last = np.flatnonzero(day == day.max())
    last = last[np.argsort(ts[last], kind="stable")]
    return camp[last], row[last]


def expanded(rows: dict, cand: dict, logs: dict) -> tuple[dict, list]:
    """Every test row x every campaign item x every slot, as dataset columns; ``user_id`` (not a
    feature, only gAUC's grouping) carries the expanded row's index so the scores come back in
    place whatever order the loader reads them in."""
    cols, shapes, parts = {}, [], []
    for camp in CAMPAIGNS:
        c = cand[camp]
        n, k = len(c["rows"]), len(c["items"]["item_id"])
        j, a, s = (g.reshape(-1) for g in np.meshgrid(np.arange(n), np.arange(k),
                                                      np.arange(SLOTS), indexing="ij"))
        part = {name: v[c["rows"]][j] for name, v in rows.items()}
        part.update({name: v[a] for name, v in c["items"].items()})
        part["position"] = s.astype(part["position"].dtype)
        aff = logs[camp]["affinity"][c["raw"]][j, a]
        part["affinity_item"] = np.log1p(np.maximum(aff, 0)).astype(np.float32)
        parts.append(part)
        shapes.append((n, k))
    for name in rows:
        cols[name] = np.concatenate([p[name] for p in parts])
    cols["user_id"] = np.arange(len(cols["user_id"]), dtype=cols["user_id"].dtype)
    return cols, shapes


def score_expanded(run: str, data: Path, cols: dict, work: Path) -> np.ndarray:
    """The run's best checkpoint's click probability for every expanded row, in their order."""
    import torch

    from opengem.data.sources.common import write_dataset
    from opengem.evaluation.evaluate import score_rows
    from opengem.features.schema import FeatureSchema
    from opengem.run import load_run_model

    out = work / "data" / "obd-counterfactual"
    schema = FeatureSchema.load(data)
    if not (out / "dataset.json").exists():
        write_dataset(out, schema, cols, np.zeros(len(cols["user_id"]), np.int32),
                      splits={"test": [0]}, source={"kind": "open-bandit counterfactual"})
    torch.set_num_threads(2)
    model, _, _ = load_run_model(run, best=True)
    scored = score_rows(model, schema, out, "test", batch_size=4096)
    probs = np.empty(len(cols["user_id"]))
    probs[scored["user_id"].numpy()] = scored["probs"][:, 0].numpy()
    return probs


# ------------------------------------------------------------------------------- estimates
def policy_arrays(probs: np.ndarray, shapes: list, cand: dict, logs: dict, bts_share: dict) -> dict:
    """Per-row arrays over the campaigns' test rows: reward, pscore, the model policy's target
    probability and its q̂s, and BTS's."""
    out: dict[str, list] = {k: [] for k in ("reward", "pscore", "target", "q_logged", "q_target",
                                            "bts_target", "bts_q_target", "campaign")}
    at = 0
    for d, (camp, (n, k)) in enumerate(zip(CAMPAIGNS, shapes)):
        q = probs[at:at + n * k * SLOTS].reshape(n, k, SLOTS)
        at += n * k * SLOTS
        c, log = cand[camp], logs[camp]
        slot = log["slot"][c["raw"]]
        rank = np.argsort(-q.mean(2), axis=1, kind="stable")[:, :SLOTS]  # rank r → slot r
        shown = rank[np.arange(n), slot]
        q_at = q[np.arange(n), :, slot]  # [n, k]: every item at the row's slot
        share = bts_share[camp][slot]  # [n, k]
        out["reward"].append(log["click"][c["raw"]])
        out["pscore"].append(log["pscore"][c["raw"]])
        out["target"].append((shown == c["logged"]).astype(float))
        out["q_logged"].append(q_at[np.arange(n), c["logged"]])
        out["q_target"].append(q_at[np.arange(n), shown])
        out["bts_target"].append(share[np.arange(n), c["logged"]])
        out["bts_q_target"].append((share * q_at).sum(1))
        out["campaign"].append(np.full(n, d))
    return {k: np.concatenate(v) for k, v in out.items()}


def bts_shares(logs: dict) -> dict:
    """campaign → [slot, item] share of the bts log's rows at that slot that show that item."""
    out = {}
    for camp in CAMPAIGNS:
        lg, k = logs[("bts", camp)], logs[("random", camp)]["affinity"].shape[1]
        counts = np.zeros((SLOTS, k))
        np.add.at(counts, (lg["slot"], lg["item"]), 1)
        out[camp] = counts / counts.sum(1, keepdims=True)
    return out


def _mean(r):
    return r.mean(-1)


def interval(fn, *arrays, seed: int) -> Interval:
    return bootstrap_ci(fn, *arrays, n_boot=N_BOOT, seed=seed)


def estimates(a: dict, target: str, q_target: str, seed: int) -> dict[str, Interval]:
    """IPS, SNIPS, DR, and beside them the reward model's own value of the policy (``dm``, the
    direct method: mean q_target), which DR corrects with the logged clicks."""
    base = (a["reward"], a["pscore"], a[target])
    return {"ips": interval(ips, *base, seed=seed), "snips": interval(snips, *base, seed=seed),
            "dr": interval(dr, *base, a["q_logged"], a[q_target], seed=seed),
            "dm": interval(_mean, a[q_target], seed=seed)}


def overlap(a: dict, target: str) -> dict:
    """How much of the log speaks for the policy: rows where the logger took the policy's action
    (for a stochastic policy, the effective rows (Σw)² / Σw²) and the clicks among them."""
    w = a[target] / a["pscore"]
    return {"rows": int((a[target] > 0).sum()), "clicks": int(a["reward"][a[target] > 0].sum()),
            "effective_rows": round(float(w.sum() ** 2 / (w ** 2).sum()), 1)}


def bts_check(reward, pscore, target, on_policy_clicks, seed: int) -> dict:
    """IPS and SNIPS of BTS on these random rows against BTS's own mean click: the estimate's
    interval, whether it covers the on-policy CTR, and the difference's interval."""
    on = bootstrap_ci(_mean, on_policy_clicks, n_boot=N_BOOT, seed=seed + 1)
    on_draws = bootstrap_draws(_mean, on_policy_clicks, n_boot=N_BOOT, seed=seed + 1)
    out = {"on_policy": on.as_list()}
    for name, fn in (("ips", ips), ("snips", snips)):
        est = bootstrap_ci(fn, reward, pscore, target, n_boot=N_BOOT, seed=seed)
        draws = bootstrap_draws(fn, reward, pscore, target, n_boot=N_BOOT, seed=seed)
        diff = percentile_interval(draws - on_draws, est.value - on.value)
        out[name] = {"estimate": est.as_list(), "covers_on_policy": est.covers(on.value),
                     "difference": diff.as_list(), "difference_covers_0": diff.covers(0.0)}
    return out


def bts_all_rows(logs: dict, shares: dict) -> dict:
    """The check on every random row (all days), per campaign and pooled."""
    parts = {}
    for camp in CAMPAIGNS:
        lg = logs[("random", camp)]
        parts[camp] = (lg["click"], lg["pscore"], shares[camp][lg["slot"], lg["item"]],
                       logs[("bts", camp)]["click"])
    parts["pooled"] = tuple(np.concatenate(x) for x in zip(*parts.values()))
    return {camp: bts_check(*p, seed=i) for i, (camp, p) in enumerate(parts.items())}


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the recipe's lrs, no grid (< 5 min)")
    ap.add_argument("--jobs", type=int, default=2, help="trainings in parallel, one thread each")
    ap.add_argument("--shared", default=str(Path(__file__).resolve().parents[2] / "shared"
                                            / "data" / "open-bandit-small"))
    ap.add_argument("--work", default=None, help="data and runs (default: a temporary directory)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    shared, work = Path(args.shared), Path(args.work or tempfile.mkdtemp(prefix="opengem-ope-"))
    logs = {(p, c): read_log(shared, p, c) for p in ("random", "bts") for c in CAMPAIGNS}
    shares = bts_shares(logs)
    check_all = bts_all_rows(logs, shares)
    data = random_dataset(work, shared)
    models = train_models(data, work, args.quick, args.jobs)
    print(f"[off_policy] trained in {time.perf_counter() - t0:.0f} s under {work}", flush=True)

    rows = test_rows(data)
    random_logs = {c: logs[("random", c)] for c in CAMPAIGNS}
    cand = candidates(data, rows, random_logs)
    cols, shapes = expanded(rows, cand, random_logs)
    report = {"mode": "quick" if args.quick else "full", "commit": git_commit(),
              "rows_test": int(sum(n for n, _ in shapes)), "bts_all_random_rows": check_all}
    a = None
    for i, (m, info) in enumerate(models.items()):
        probs = score_expanded(info["run"], data, cols, work)
        a = policy_arrays(probs, shapes, cand, random_logs, shares)
        est = estimates(a, "target", "q_target", seed=10 + i)
        bts = estimates(a, "bts_target", "bts_q_target", seed=20 + i)
        report[m] = {**info, "policy_ctr": {k: v.as_list() for k, v in est.items()},
                     "overlap": overlap(a, "target"),
                     "bts_test_rows": {k: v.as_list() for k, v in bts.items()}}
        report[m].pop("run")
        print(f"[off_policy] {m}: " + ", ".join(f"{k} {v.value:.4f} [{v.low:.4f}, {v.high:.4f}]"
                                                for k, v in est.items()), flush=True)
    report["random_test_ctr"] = interval(_mean, a["reward"], seed=30).as_list()
    report["test_clicks"] = int(a["reward"].sum())
    report["bts_test_overlap"] = overlap(a, "bts_target")
    report["bts_on_policy_ctr"] = check_all["pooled"]["on_policy"]
    report["bts_test_rows_check"] = bts_check(a["reward"], a["pscore"], a["bts_target"],
                                              np.concatenate([logs[("bts", c)]["click"]
                                                              for c in CAMPAIGNS]), seed=40)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
