"""Two behaviour streams from two events tables, imported, trained, exported and served by user id.

    python examples/two_streams.py --out DIR [--steps 20]

Writes a small log under ``DIR/log`` (Parquet): ``impressions.parquet`` (user, ts, ad_id, category,
advertiser, click), ``organic.parquet`` (content views and likes: items of their own id space, with
a category from the ads' ``category`` vocabulary and the dwell seconds, a per-event value) and
``ad_clicks.parquet`` (clicks on ad ids, with the advertiser), and the import spec ``spec.json``.
Then runs, printing each command::

    opengem import --source generic --in DIR/log --spec DIR/log/spec.json --out DIR/data
    opengem validate DIR/data
    opengem train --recipe tiny --data DIR/data --out DIR/run model.target_match_items=true ...
    opengem export --run DIR/run --out DIR/artifact --no-compile
    opengem history-store --data DIR/data --out DIR/history

and scores one request that gives only the user id: the histories come from the store
(``docs/dataset-layout.md``, "Several streams: a worked example").
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

T0 = 1_700_000_000  # unix seconds: the log's start
DAY = 86_400

# The organic stream: content items get a vocabulary of their own (fitted on the train period);
# their category is an id of the ads' category feature, so the model can compare the two. Each
# view's dwell seconds is a per-event value, embedded into the event token: a view with no dwell
# logged is dropped (the default ``missing``) and counted in the manifest's ``source.storage``.
ORGANIC = {"name": "organic", "from": "events", "files": ["organic.parquet"], "item": "content",
           "event": "action", "max_len": 32,
           "attributes": [{"column": "category", "name": "content_category",
                           "matches": "category"}],
           "values": ["dwell"]}
# The ads stream: its items are ad ids (the ad_id feature's encoder), its attribute the advertiser.
AD_CLICKS = {"name": "ad_clicks", "from": "events", "files": ["ad_clicks.parquet"], "item": "ad",
             "matches": "ad_id", "max_len": 12,
             "attributes": [{"column": "advertiser", "matches": "advertiser"}]}
SPEC = {"files": {"train": ["impressions.parquet"], "test": []}, "user": "user", "time": "ts",
        "tasks": [{"name": "click", "column": "click"}],
        "sparse": [{"column": "ad_id", "group": "ad"}, {"column": "category", "group": "ad"},
                   {"column": "advertiser", "group": "ad"}],
        "split": {"by": "user_time", "valid": 0.2, "test": 0.2},
        "sequences": [ORGANIC, AD_CLICKS]}


def write_log(out: str | Path, users: int = 40, impressions: int = 600, seed: int = 0) -> Path:
    """The three tables and ``spec.json`` under ``out``. Each user likes one category: their organic
    views and ad clicks mostly fall in it, they dwell longer on it and click its ads more often,
    so both streams carry the signal. A few views have no dwell logged (null)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    n_ads, n_cats, n_content, n_advertisers = 30, 6, 120, 5
    likes = rng.integers(0, n_cats, users)

    def pick(u: np.ndarray, n_items: int, share: float) -> np.ndarray:
        """Items (category = item % n_cats): ``share`` of them of the user's liked category."""
        own = likes[u] + n_cats * rng.integers(0, n_items // n_cats, len(u))
        return np.where(rng.random(len(u)) < share, own, rng.integers(0, n_items, len(u)))

    u = rng.integers(0, users, impressions)
    ad = rng.integers(0, n_ads, impressions)
    click = rng.random(impressions) < np.where(ad % n_cats == likes[u], 0.4, 0.08)
    pq.write_table(pa.table({
        "user": [f"u{k}" for k in u], "ts": T0 + rng.integers(7 * DAY, 30 * DAY, impressions),
        "ad_id": [f"a{k}" for k in ad], "category": [f"k{k % n_cats}" for k in ad],
        "advertiser": [f"v{k % n_advertisers}" for k in ad], "click": click.astype(np.int64)}),
        out / "impressions.parquet")

    u = rng.integers(0, users, users * 30)
    item = pick(u, n_content, 0.7)
    # dwell from a generator of its own, so the other columns are those of a log without it
    own = np.random.default_rng([seed, 1])
    dwell = own.lognormal(np.where(item % n_cats == likes[u], 3.5, 2.0), 0.5).astype(np.float32)
    pq.write_table(pa.table({
        "user": [f"u{k}" for k in u], "ts": T0 + rng.integers(0, 30 * DAY, len(u)),
        "content": [f"c{k}" for k in item],
        "action": rng.choice(["view", "like"], len(u), p=[0.8, 0.2]),
        "category": [f"k{k % n_cats}" for k in item],
        "dwell": pa.array(dwell, mask=own.random(len(u)) < 0.02)}), out / "organic.parquet")

    u = rng.integers(0, users, users * 8)
    ad = pick(u, n_ads, 0.6)
    pq.write_table(pa.table({
        "user": [f"u{k}" for k in u], "ts": T0 + rng.integers(0, 30 * DAY, len(u)),
        "ad": [f"a{k}" for k in ad], "advertiser": [f"v{k % n_advertisers}" for k in ad]}),
        out / "ad_clicks.parquet")
    (out / "spec.json").write_text(json.dumps(SPEC, indent=1))
    return out


def _cli(*args: str) -> None:
    from opengem.cli import main

    print("$ opengem", " ".join(shlex.quote(a) for a in args), flush=True)
    if main(["--quiet", *args]) != 0:
        raise SystemExit(f"opengem {args[0]} failed")


def score_by_user_id(artifact: Path, store: Path, data: Path) -> dict:
    """One test row of the dataset as a request without its histories: the store fills them."""
    from opengem.data.events import ShardReader
    from opengem.data.parquet import DatasetManifest
    from opengem.export import Predictor
    from opengem.export.history import ArrowHistoryStore
    from opengem.export.request import history_columns, split_row
    from opengem.features.schema import FeatureSchema

    schema = FeatureSchema.load(data)
    m = DatasetManifest.load(data)
    rows = ShardReader(data, m, schema).read(m.split_files("test")[0], schema.columns()).to_pylist()
    row = max(rows, key=lambda r: len(r["organic.ts"]))
    request, _ = split_row(schema, row)
    for s in schema.sequences:
        for c in history_columns(s):
            request.pop(c)
    request["candidates"] = [split_row(schema, r)[1] for r in rows[:5]]
    # ids are the dataset's (the importer's encodings), the user's included
    print("request:", {k: v for k, v in request.items() if k != "candidates"},
          f"+ {len(request['candidates'])} candidates, no histories")
    out = Predictor(artifact, history=ArrowHistoryStore(store, schema)).predict(request)
    print("looked up per stream:", out["looked_up"], "events; p(click):",
          [round(x, 4) for x in out["predictions"]["click"]])
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args(argv)
    out = Path(a.out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty: pick a new directory (runs are not overwritten)")
    log = write_log(out / "log")
    print(f"wrote {log}: impressions, organic and ad_clicks tables and spec.json")
    data, run, art, store = out / "data", out / "run", out / "artifact", out / "history"
    _cli("import", "--source", "generic", "--in", str(log), "--spec", str(log / "spec.json"),
         "--out", str(data))
    _cli("validate", str(data))
    _cli("train", "--recipe", "tiny", "--data", str(data), "--out", str(run),
         f"train.max_steps={a.steps}", "data.batch_size=32", "model.target_match_items=true")
    _cli("export", "--run", str(run), "--out", str(art), "--no-compile")
    _cli("history-store", "--data", str(data), "--out", str(store))
    return score_by_user_id(art, store, data)


if __name__ == "__main__":
    main()
