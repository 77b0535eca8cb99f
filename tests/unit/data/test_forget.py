"""opengem forget: a user's rows and events gone from every file and from the history store, other
users' bytes unchanged, a crash mid-forget leaving the old dataset readable; pseudonymised imports
train as plain ones and map raw ids back only with their key; bad forget lists named."""

import hashlib
import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from opengem.cli import main
from opengem.data import forget
from opengem.data.forget import JOURNAL, forget_dataset, read_forget_list, recover
from opengem.data.parquet import DataError, DatasetManifest
from opengem.data.sources import convert
from opengem.data.sources.fake_log import spec, write_log
from opengem.features.schema import FeatureSchema

pytest.importorskip("duckdb")
KEY = b"a key of thirty-two bytes, kept!"


def _digests(d) -> dict[str, str]:
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


def _users_in(d, rel) -> set[int]:
    return set(pq.read_table(d / rel, columns=["user_id"]).column("user_id").to_pylist())


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("forget")
    log = write_log(root / "log", rows=400, users=30, events_per_user=20, seed=1)
    convert("generic", log, root / "plain", spec=spec(max_len=12, buckets=3))
    (root / "key").write_bytes(KEY + b"\n")
    convert("generic", log, root / "pseudo", key_file=root / "key",
            spec=spec(max_len=12, buckets=3) | {"pseudonymise": {"hash": "hmac-sha256"}})
    return root


@pytest.fixture
def data(made, tmp_path):
    shutil.copytree(made / "plain", tmp_path / "data")
    return tmp_path / "data"


def test_forgotten_users_are_gone_and_other_users_bytes_are_unchanged(data):
    m0 = DatasetManifest.load(data)
    before = _digests(data)
    gone = sorted(_users_in(data, m0.files[0].path))[:2]  # two users of one bucket
    bucket = m0.files[0].bucket
    rows_before = {f.path: pq.read_table(data / f.path) for f in m0.files if f.bucket == bucket}
    rec = forget_dataset(data, np.array(gone + [10**9]))
    m = DatasetManifest.load(data)
    listed = [f.path for f in m.files] + [e.path for es in m.events.values() for e in es]
    assert all(not (_users_in(data, p) & set(gone)) for p in listed)
    assert rec["users_found"] == 2 and rec["users_unknown"] == 1 and rec["users_requested"] == 3
    assert rec["impressions_removed"] > 0 and rec["events_removed"]["clicks"] == 2 * 20
    assert m.deletions == [rec] and "user_id" not in json.dumps(rec)  # counts, no ids
    assert m.card["deletions"]["users"] == 2
    after = _digests(data)
    for f in m.files + [e for es in m.events.values() for e in es]:
        if f.bucket != bucket:  # other buckets' files: the same bytes
            assert after[f.path] == before[f.path]
    for old, t in rows_before.items():  # the touched bucket: other users' rows equal, in order
        new = next(f.path for f in m.files if f.path.startswith(old.removesuffix(".parquet")))
        keep = [u not in gone for u in t.column("user_id").to_pylist()]
        assert pq.read_table(data / new).equals(t.filter(pa.array(keep)))
    on_disk = {p for p in after if p.endswith(".parquet")}
    assert on_disk == set(listed)  # the old files are removed, no orphans
    assert main(["--quiet", "validate", str(data), "--strict"]) == 0
    again = forget_dataset(data, np.array(gone))  # forgetting twice: found nowhere
    assert again["users_found"] == 0 and again["users_unknown"] == 2


def test_a_crash_mid_forget_leaves_the_old_dataset_readable(data, monkeypatch):
    before = _digests(data)
    m0 = DatasetManifest.load(data)
    users = sorted(set().union(*(_users_in(data, f.path) for f in m0.files)))[::3]
    calls = []

    def crash(*a, **k):
        if len(calls) == 2:
            raise RuntimeError("injected crash")
        calls.append(a)
        real(*a, **k)

    real = forget._write
    monkeypatch.setattr(forget, "_write", crash)
    with pytest.raises(RuntimeError, match="injected"):
        forget_dataset(data, np.array(users))
    assert _digests(data) == before  # the new files undone, the old ones and manifest as they were
    monkeypatch.setattr(forget, "_write", real)
    # a hard kill leaves files the manifest does not list (and maybe a journal): recover cleans up
    shutil.copy(data / m0.files[0].path, data / "shards" / "d000-b00000.forget1.parquet")
    (data / JOURNAL).write_text(json.dumps({"new": ["shards/x.forget1.parquet"],
                                            "old": [m0.files[0].path]}))
    assert "shards/d000-b00000.forget1.parquet" in recover(data)
    assert _digests(data) == before
    assert main(["--quiet", "validate", str(data), "--strict"]) == 0


def test_a_v1_dataset_is_forgotten_too(made, tmp_path):
    """v1 rows hold only their own user's history, so dropping the rows forgets the events."""
    log = made / "log"
    s = spec(max_len=12)
    s["sequence"] = {"name": "clicks", "from": "rows", "item": "item_id", "max_len": 12}
    convert("generic", log, tmp_path / "v1", spec=s)
    m0 = DatasetManifest.load(tmp_path / "v1")
    assert m0.layout == 1
    gone = sorted(_users_in(tmp_path / "v1", m0.files[0].path))[:1]
    rec = forget_dataset(tmp_path / "v1", np.array(gone))
    assert rec["users_found"] == 1 and rec["events_removed"] == {}
    m = DatasetManifest.load(tmp_path / "v1")
    assert all(gone[0] not in _users_in(tmp_path / "v1", f.path) for f in m.files)
    assert main(["--quiet", "validate", str(tmp_path / "v1")]) == 0


def test_the_history_store_forgets_and_serves_an_empty_history(data, tmp_path):
    from opengem.export.forget import forget_store
    from opengem.export.history import ArrowHistoryStore, build_history_store

    store = tmp_path / "store"
    build_history_store(data, store)
    schema = FeatureSchema.load(data)
    m = DatasetManifest.load(data)
    users = sorted(set().union(*(_users_in(data, f.path) for f in m.files)))
    gone, kept = users[:3], users[3:]
    before = ArrowHistoryStore(store, schema)
    want = {u: before.lookup(u, 2 * 10**9, ["clicks"]) for u in kept}
    assert all(before.lookup(u, 2 * 10**9, ["clicks"]) for u in gone)
    rec = forget_store(store, np.array(gone + [10**9]))
    assert rec["users_found"] == 3 and rec["users_unknown"] == 1
    assert rec["events_removed"] == {"clicks": 3 * 20}
    after = ArrowHistoryStore(store, schema)
    assert all(after.lookup(u, 2 * 10**9, ["clicks"]) == {} for u in gone)
    for u in kept:
        got = after.lookup(u, 2 * 10**9, ["clicks"])
        assert got.keys() == want[u].keys()
        assert all(np.array_equal(got[k], want[u][k]) for k in got)
    assert sorted(p.name for p in store.glob("*.arrow")) == sorted(
        [after.meta["streams"]["clicks"]["file"], after.meta["streams"]["clicks"]["index"]])


def test_forget_lists_text_csv_parquet_and_the_formats_refused(tmp_path):
    (tmp_path / "a.txt").write_text("# users to forget\n3\n\n12\n3\n")
    (tmp_path / "b.csv").write_text("user_id,why\n12,asked\n3,asked\n")
    pq.write_table(pa.table({"user_id": [3, 12]}), tmp_path / "c.parquet")
    for f in ("a.txt", "b.csv", "c.parquet"):
        assert read_forget_list(tmp_path / f).tolist() == [3, 12]
    (tmp_path / "d.json").write_text("[3]")
    (tmp_path / "e.txt").write_text("3\nuser-12\n")
    (tmp_path / "f.csv").write_text("user,why\n3,x\n")
    for f, problem in (("d.json", "a .json file; a forget list is .txt"),
                       ("e.txt", "not integers \\(first: 'user-12'\\)"),
                       ("f.csv", "no user_id column"), ("nope.txt", "not found")):
        with pytest.raises(DataError, match=problem):
            read_forget_list(tmp_path / f)
    assert read_forget_list(tmp_path / "e.txt", raw=True).tolist() == ["3", "user-12"]


def test_raw_ids_are_forgotten_with_the_key_which_the_dataset_never_holds(made, tmp_path):
    d = tmp_path / "pseudo"
    shutil.copytree(made / "pseudo", d)
    assert all(KEY not in p.read_bytes() for p in d.rglob("*") if p.is_file())
    raw = pq.read_table(made / "log" / "impressions.parquet").column("user").to_pylist()
    (tmp_path / "raw.txt").write_text(f"{raw[0]}\n{raw[1]}\nnobody\n")
    (tmp_path / "other").write_bytes(b"another key of thirty-two bytes!")
    args = ["--quiet", "forget", "--data", str(d), "--users", str(tmp_path / "raw.txt"),
            "--raw-ids", "--key-file"]
    assert main(args + [str(tmp_path / "other")]) == 2  # a wrong key is refused, nothing changes
    assert DatasetManifest.load(d).deletions == []
    assert main(args + [str(made / "key")]) == 0
    assert main(["--quiet", "validate", str(d), "--strict"]) == 0
    rec = DatasetManifest.load(d).deletions[0]
    gone = len({raw[0], raw[1]})
    assert rec["users_found"] == gone and rec["users_unknown"] == 1 and rec["users_requested"] == 3
    assert main(["--quiet", "forget", "--data", str(d), "--users", str(tmp_path / "raw.txt")]) == 2


def test_pseudonymised_and_plain_imports_train_to_the_same_parameters(tmp_path):
    """Ids are ranks of other strings, so users are numbered differently; with one bucket a shard's
    rows (ordered by day, time, input order) and every history are the same, and so is training."""
    from opengem.config import apply_overrides
    from opengem.recipes import recipe
    from opengem.train.trainer import train

    log = write_log(tmp_path / "log", rows=240, users=20, events_per_user=10, seed=2)
    (tmp_path / "key").write_bytes(KEY)
    convert("generic", log, tmp_path / "plain", spec=spec(max_len=8))
    convert("generic", log, tmp_path / "pseudo", key_file=tmp_path / "key",
            spec=spec(max_len=8) | {"pseudonymise": {"hash": "blake2b"}})
    plain_ids = pq.read_table(tmp_path / "plain" / DatasetManifest.load(
        tmp_path / "plain").files[0].path).column("user_id")
    pseudo_ids = pq.read_table(tmp_path / "pseudo" / DatasetManifest.load(
        tmp_path / "pseudo").files[0].path).column("user_id")
    assert plain_ids != pseudo_ids  # the users are numbered otherwise
    cfg = apply_overrides(recipe("tiny"), ["data.batch_size=16", "train.max_steps=3",
                                           "data.prefetch=0"])
    cfg.train.progress = False
    a = train(cfg, tmp_path / "plain", tmp_path / "run_plain")
    b = train(cfg, tmp_path / "pseudo", tmp_path / "run_pseudo")
    assert a["steps"] == b["steps"] == 3 and a["params_sha256"] == b["params_sha256"]


def test_the_report_shows_the_dataset_card_with_its_deletions(data):
    from opengem.report.build import dataset_sections

    first = DatasetManifest.load(data).files[0].path
    forget_dataset(data, np.array(sorted(_users_in(data, first))[:1]))
    [section] = dataset_sections(data)
    assert section.title == "Dataset card"
    assert "source: generic (layout v2)" in section.body and "train / default:" in section.body
    assert "deletions: 1 forget runs, 1 users" in section.body


def test_pseudonymising_refuses_a_missing_short_or_stray_key_and_an_unknown_hash(made, tmp_path,
                                                                                 monkeypatch):
    from opengem.data.sources.common import SpecError

    monkeypatch.delenv("OPENGEM_PSEUDONYM_KEY", raising=False)
    log, ps = made / "log", spec(max_len=4) | {"pseudonymise": {"hash": "hmac-sha256"}}
    with pytest.raises(DataError, match="needs a key: give --key-file FILE or set"):
        convert("generic", log, tmp_path / "a", spec=ps)
    (tmp_path / "short").write_bytes(b"tiny")
    with pytest.raises(DataError, match="has 4 bytes; use at least 16"):
        convert("generic", log, tmp_path / "b", spec=ps, key_file=tmp_path / "short")
    with pytest.raises(SpecError, match="the spec does not pseudonymise"):
        convert("generic", log, tmp_path / "c", spec=spec(max_len=4), key_file=made / "key")
    with pytest.raises(SpecError, match="pseudonymise.hash must be one of"):
        convert("generic", log, tmp_path / "d", key_file=made / "key",
                spec=spec(max_len=4) | {"pseudonymise": {"hash": "md5"}})
    monkeypatch.setenv("OPENGEM_PSEUDONYM_KEY", KEY.decode())  # the environment's key works too
    m = convert("generic", log, tmp_path / "e", spec=ps)
    assert m.source["pseudonym"]["key_check"] == DatasetManifest.load(
        made / "pseudo").source["pseudonym"]["key_check"]
    assert main(["--quiet", "forget", "--users", str(tmp_path / "short")]) == 2  # no target
