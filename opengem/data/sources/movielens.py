"""MovieLens-100K → our layout: one row per rating, a behaviour sequence of the user's
earlier ratings.

Input (``--in DIR``): RecBole atomic files ``ml-100k.inter`` / ``.user`` / ``.item`` (tab-separated,
typed ``name:type`` headers), or GroupLens' original ``u.data`` / ``u.user`` / ``u.item``.

Rows and labels. Every rating is an impression of the movie to the user at its timestamp; one task,
``click`` = rating >= 4 (no conversion task: ratings have one outcome). One domain, ``movielens``.

Split (per-user, by time): each user's ratings sorted by (timestamp, input order); the last 10 %
(floor) → test (day 2), the 10 % before → valid (day 1), the rest → train (day 0). Every ML-100K
user has >= 20 ratings, so every user is in all three splits. Ids (user, movie, occupation, …) are
contiguous, fitted on the train rows; a movie first rated in valid/test is OOV.

Features:
  user     user_id, age (7 MovieLens-1M buckets), gender, occupation, zip_region (first zip digit),
           user_prior_ratings = log1p(the user's ratings strictly before this one)
  ad       movie_id, genres (multi-hot, 19), decade (release decade, 0 = unknown),
           movie_prior_ratings = log1p(the movie's ratings by anyone strictly before this one),
           movie_prior_like_rate = (likes + 1) / (ratings + 2) over those earlier ratings
  context  hour, weekday (UTC, from the timestamp)
  stream   ``ratings``: the user's ratings strictly before the row's timestamp, oldest → newest,
           item = movie id, event = rating − 1 (5 types), ts; the most recent ``max_len`` kept.
A rating made in the same second as the row (the row itself included) is never in its history.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from opengem.data.parquet import DataError, DatasetManifest
from opengem.data.sources.common import (
    TRAIN,
    Vocab,
    fit_ids,
    history,
    need,
    prior_stats,
    read_csv,
    split_per_user,
    to_float,
    write_dataset,
)
from opengem.features.schema import (
    DenseFeature,
    Domains,
    FeatureSchema,
    SequenceStream,
    SparseFeature,
    Task,
)

AGE_EDGES = (18, 25, 35, 45, 50, 56)  # MovieLens-1M age groups: <18, 18-24, …, 56+
GENRES = ("unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
          "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance",
          "Sci-Fi", "Thriller", "War", "Western")
NUM_DECADES = 10  # 0 = unknown, 1 = 1920s or earlier, …, 9 = 2000s


def load(in_dir: str | Path) -> tuple[dict, dict, dict]:
    """(ratings, users, items) as string columns with canonical names, from either file format."""
    d = Path(in_dir)
    if (d / "ml-100k.inter").exists():
        inter, users, items = (_recbole(d / f"ml-100k.{x}") for x in ("inter", "user", "item"))
        items["genres"] = np.char.replace(items.pop("class"), " ", "|")
        return inter, users, items
    if (d / "u.data").exists():
        return _grouplens(d)
    raise DataError(f"{d}: no MovieLens-100K files (expected ml-100k.inter/.user/.item "
                    f"or u.data/u.user/u.item)")


def _recbole(path: Path) -> dict:
    cols = read_csv(path, sep="\t")
    return {name.split(":")[0]: v for name, v in cols.items()}


def _grouplens(d: Path) -> tuple[dict, dict, dict]:
    def rows(name, sep, names, encoding="utf8"):
        path = d / name
        if not path.exists():
            raise DataError(f"{path}: file not found")
        lines = [x.split(sep) for x in path.read_text(encoding=encoding).splitlines() if x.strip()]
        return {n: np.array([x[i] for x in lines], dtype=str) for i, n in enumerate(names)}, lines

    inter, _ = rows("u.data", "\t", ["user_id", "item_id", "rating", "timestamp"])
    users, _ = rows("u.user", "|", ["user_id", "age", "gender", "occupation", "zip_code"])
    items, lines = rows("u.item", "|", ["item_id", "movie_title", "release_date"],
                        encoding="latin-1")
    items["release_year"] = np.array([x[-4:] for x in items.pop("release_date")], dtype=str)
    items["genres"] = np.array(
        ["|".join(g for g, f in zip(GENRES, x[5:24]) if f == "1") for x in lines], dtype=str
    )
    return inter, users, items


def build_schema(vocab: dict[str, int], max_len: int) -> FeatureSchema:
    sparse = (SparseFeature("user_id", vocab["user_id"], "user"),
              SparseFeature("age", len(AGE_EDGES) + 1, "user"),
              SparseFeature("gender", vocab["gender"], "user"),
              SparseFeature("occupation", vocab["occupation"], "user"),
              SparseFeature("zip_region", vocab["zip_region"], "user"),
              SparseFeature("movie_id", vocab["movie_id"], "ad"),
              SparseFeature("genres", len(GENRES), "ad", multi_hot=True),
              SparseFeature("decade", NUM_DECADES, "ad"),
              SparseFeature("hour", 24, "context"), SparseFeature("weekday", 7, "context"))
    dense = (DenseFeature("user_prior_ratings", "user"), DenseFeature("movie_prior_ratings", "ad"),
             DenseFeature("movie_prior_like_rate", "ad"))
    return FeatureSchema(sparse=sparse, dense=dense,
                         sequences=(SequenceStream("ratings", vocab["movie_id"], 5, max_len),),
                         tasks=(Task("click", "click"),), domains=Domains(("movielens",)),
                         meta={"source": "movielens-100k", "label": "click = rating >= 4",
                               "events": ["rating1", "rating2", "rating3", "rating4", "rating5"],
                               "genres": list(GENRES)})


def convert(in_dir: str | Path, out_dir: str | Path, max_len: int = 256, valid: float = 0.1,
            test: float = 0.1) -> DatasetManifest:
    """Write MovieLens-100K from ``in_dir`` as a dataset in ``out_dir`` (see the
    module docstring)."""
    inter, users, items = load(in_dir)
    need(inter, ["user_id", "item_id", "rating", "timestamp"], f"{in_dir}: ratings")
    need(users, ["user_id", "age", "gender", "occupation", "zip_code"], f"{in_dir}: users")
    need(items, ["item_id", "release_year", "genres"], f"{in_dir}: items")
    user, item = inter["user_id"], inter["item_id"]
    ts = to_float(inter["timestamp"], "ratings column timestamp").astype(np.int64)
    rating = to_float(inter["rating"], "ratings column rating")
    day = split_per_user(user, ts, valid, test)

    c: dict = {"request_ts": ts, "domain": np.zeros(len(ts), dtype=np.int64),
               "click": (rating >= 4).astype(np.int8)}
    vocab: dict[str, int] = {}
    c["user_id"], vocab["user_id"] = fit_ids(user, day == TRAIN)
    c["movie_id"], vocab["movie_id"] = fit_ids(item, day == TRAIN)
    urow = _lookup(users["user_id"], user, "users", "user_id")
    age = to_float(users["age"], "users column age")[urow]
    c["age"] = np.digitize(age, AGE_EDGES).astype(np.int64)
    for name, raw in (("gender", users["gender"]), ("occupation", users["occupation"]),
                      ("zip_region", np.array([z[:1] for z in users["zip_code"]], dtype=str))):
        c[name], vocab[name] = fit_ids(raw[urow], day == TRAIN)
    irow = _lookup(items["item_id"], item, "items", "item_id")
    c["decade"] = _decade(items["release_year"])[irow]
    c["genres"] = _genres(items["genres"], irow)
    # Monday = 0; 1970-01-01 was a Thursday
    c["hour"], c["weekday"] = (ts // 3600) % 24, (ts // 86400 + 3) % 7
    n_user, _ = prior_stats(user, ts, np.ones(len(ts)), user, ts)
    n_item, likes = prior_stats(item, ts, c["click"], item, ts)
    c["user_prior_ratings"] = np.log1p(n_user).astype(np.float32)
    c["movie_prior_ratings"] = np.log1p(n_item).astype(np.float32)
    c["movie_prior_like_rate"] = ((likes + 1) / (n_item + 2)).astype(np.float32)
    hist = history(user, ts, {"item": c["movie_id"], "event": rating.astype(np.int64) - 1}, user,
                   ts, max_len)
    for part, v in hist.items():
        c[f"ratings.{part}"] = v

    schema = build_schema(vocab, max_len)
    source = {"kind": "movielens-100k", "in": str(in_dir),
              "split": f"per-user by time: last {test:.0%} test, "
              f"{valid:.0%} before valid", "ids": "contiguous, fitted on train; unseen → OOV",
              "train_users": len(np.unique(user[day == TRAIN]))}
    return write_dataset(out_dir, schema, c, day, source=source)


def _lookup(keys: np.ndarray, values: np.ndarray, table: str, column: str) -> np.ndarray:
    """Row of ``keys`` (a side table's id column) holding each of ``values``; unknown ids are
    an error."""
    vocab = Vocab(keys)
    idx = vocab(values)
    if (idx == vocab.vocab_size).any() or len(vocab) != len(keys):
        bad = values[idx == vocab.vocab_size]
        raise DataError(f"{table}: {column} {bad[0]!r} of the ratings is not in the {table} file"
                        if len(bad) else f"{table}: duplicate {column} values")
    order = np.argsort(np.asarray(keys).astype(str), kind="stable")
    return order[idx]


def _decade(years: np.ndarray) -> np.ndarray:
    y = np.array([float(x) if x.strip().isdigit() else np.nan for x in years])
    dec = np.clip((y - 1920) // 10 + 1, 1, NUM_DECADES - 1)
    return np.where(np.isnan(y), 0, dec).astype(np.int64)


def _genres(genres: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    index = {g: i for i, g in enumerate(GENRES)}
    per_item = [np.array([index[g] for g in s.split("|") if g in index], dtype=np.int64)
                for s in genres]
    lens = np.array([len(per_item[r]) for r in rows], dtype=np.int64)
    flat = np.concatenate([per_item[r] for r in rows]) if len(rows) else np.zeros(0, np.int64)
    return flat.astype(np.int64), lens
