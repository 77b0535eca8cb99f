"""Representation transfer over time (rep.source=days): a row of day d reads its user's daily
published teacher representations of days < d only, never its own day or later; on a run with
snapshots, each day's table is computed by that day's own snapshot (lagged)."""

import numpy as np
import pyarrow as pa
import pytest
import torch
from _transfer import gem_config, make_gem

from opengem.checkpoint import save_snapshot
from opengem.config import Config
from opengem.data.parquet import ShardWriter
from opengem.run import save_config, save_schema
from opengem.testing import random_table
from opengem.transfer.config import techniques_config
from opengem.transfer.distill import keep_history, rep_width
from opengem.transfer.stream import SliceStream, domain_ids
from opengem.transfer.teacher import (
    DailySnapshots,
    TeacherService,
    UserRepHistory,
    teacher_snapshot,
)

USERS_PER_DAY = 12  # day d's rows belong to users d·12 … d·12 + 11, so a row's day is its user's …
LOYAL = 48  # … but for every tenth row, user 48's, who comes back every day


def test_a_day_is_read_only_by_later_days_and_in_one_fixed_space():
    h = UserRepHistory(dim_in=6, days=2, dim=3)
    g = torch.Generator().manual_seed(0)
    emb = {d: torch.randn(4, 6, generator=g) for d in range(4)}
    users = torch.tensor([1, 2, 3, 1])
    h.update(0, users, emb[0])
    assert h.days_read(1) == [] and not h.lookup(users, 1).any()  # day 0 is live, not published
    h.update(1, users, emb[1])  # moving to day 1 publishes day 0
    assert h.days_read(1) == [0] and h.days_read(0) == []
    out = h.lookup(users, 1)
    # one published day: the second slot is empty
    assert out.shape == (4, 6) and not out[:, 3:].any()
    mu, basis = h.proj
    mean1 = (emb[0][0] + emb[0][3]) / 2  # user 1's mean over its two rows of day 0
    assert torch.allclose(out[0, :3], (mean1 - mu) @ basis, atol=1e-5)
    h.update(2, torch.tensor([7]), emb[2][:1])
    h.update(3, torch.tensor([7]), emb[3][:1])
    assert h.days_read(3) == [2, 1] and h.days_read(2) == [1, 0] and h.days_read(99) == [2, 1]
    got = h.lookup(torch.tensor([7, 1]), 3)
    assert got[0, :3].any() and not got[0, 3:].any()  # user 7: day 2 yes, day 1 not seen
    assert not got[1, :3].any() and got[1, 3:].any()  # user 1: not on day 2, on day 1
    assert torch.equal(h.proj[1], basis)  # the projection is fitted once and frozen


def _days_dataset(out, schema, days=4, n=80):
    w = ShardWriter(out, schema)
    for d in range(days):
        t = random_table(schema, n, seed=d)
        u = np.where(np.arange(n) % 10 == 0, LOYAL,
                     d * USERS_PER_DAY + np.arange(n) % USERS_PER_DAY)
        t = t.set_column(t.column_names.index(schema.user_column), schema.user_column, pa.array(u))
        t = t.set_column(t.column_names.index(schema.day_column), schema.day_column,
                         pa.array(np.full(n, d, dtype=np.int32)))
        # two shards a day: a chunk straddling shards would straddle days at the boundary
        for part in range(2):
            w.write(t.slice(part * n // 2, n // 2), f"d{d:03d}-b{part}", d)
    w.close({"train": [0, 1], "valid": [2, 3], "test": [3]})
    return out


class _Spy(TeacherService):
    """Records, for every call, the rows' true days and the published days they could read."""

    seen: list

    def predict(self, batch, update_cache=True, day=None):
        u = batch.user_id
        true_days = set((u[u != LOYAL] // USERS_PER_DAY).tolist())
        out = super().predict(batch, update_cache, day)
        # what a row may read: its user's rows of the published days < day
        want = torch.zeros(len(u), 2, 4)
        for j, d in enumerate(self.history.days_read(day)):
            slot, table = self.history.tables[d]
            for i, user in enumerate(u.tolist()):
                if user in slot:
                    want[i, j] = table[slot[user]]
        self.seen.append((day, true_days, self.history.days_read(day), out.user_hist, u,
                          want.reshape(len(u), -1)))
        return out


def test_the_student_stream_never_reads_its_own_day_or_later(schema, tmp_path):
    data = _days_dataset(tmp_path / "data", schema)
    tcfg = techniques_config("kd+rep", **{})
    tcfg.rep.source, tcfg.rep.days, tcfg.rep.dim = "days", 2, 4
    tcfg.validate()
    gem = _Spy(make_gem(schema))
    gem.seen = []
    assert keep_history(tcfg, gem) and rep_width(tcfg, gem.feature_dim) == 8
    doms = domain_ids(schema, schema.domains.names)
    s = SliceStream(data, "valid", schema, doms, gem, 16, seed=0, warmup_days=2, teacher_batch=16)
    n = sum(tout.user_hist.shape[0] for _, tout in s)
    assert n == 160
    # the warm-up scored the teacher's days 0 and 1
    assert {d for d, *_ in gem.seen} == {0, 1, 2, 3}
    for day, true_days, read, hist, users, want in gem.seen:
        assert true_days == {day}  # no chunk mixes days
        assert all(r < day for r in read), (day, read)  # never its own day or later
        assert read == sorted(range(max(0, day - 2), day), reverse=True)
        assert hist.shape[1] == 8 and torch.equal(hist, want)
        # users of day d were never seen before d: their stream is empty; the loyal user's is not
        # (day ≥ 1)
        assert not hist[users != LOYAL].any()
        assert bool(hist[users == LOYAL].any()) == (day >= 1)


def test_rep_days_validates():
    tcfg = techniques_config("kd+rep")
    tcfg.rep.source = "days"
    tcfg.validate()
    tcfg.rep.days = 0
    with pytest.raises(Exception, match="rep.days"):
        tcfg.validate()


class _UserSpy(TeacherService):
    """Records every call's day, the rows' true days, users, the user means they read,
    their embeddings."""

    seen: list

    def predict(self, batch, update_cache=True, day=None):
        u = batch.user_id
        out = super().predict(batch, update_cache, day)
        true_days = torch.where(u == LOYAL, -1, u // USERS_PER_DAY)
        self.seen.append((day, true_days, u, out.user_rep, out.embeddings))
        return out


def test_the_per_user_mean_never_holds_the_rows_own_day(schema, tmp_path):
    """rep.source=user: 80 rows a day in chunks of 24, so a chunk read across the day boundary would
    put the next day's rows into the table published for the day before (the same-day leak)."""
    data = _days_dataset(tmp_path / "data", schema)
    gem = _UserSpy(make_gem(schema))
    gem.seen = []
    doms = domain_ids(schema, schema.domains.names)
    s = SliceStream(data, "valid", schema, doms, gem, 8, seed=0, warmup_days=1, teacher_batch=24)
    assert sum(b.batch_size for b, _ in s) == 160
    assert [d for d, *_ in gem.seen] == [1] * 4 + [2] * 4 + [3] * 4  # 80 rows a day: 24, 24, 24, 8
    for day, true_days, users, rep, emb in gem.seen:
        own = true_days[users != LOYAL]
        assert bool((own == day).all()), (day, own.unique())  # no chunk mixes days
        # a day's users were never seen before it: nothing published
        assert not rep[users != LOYAL].any()
    for day in (2, 3):  # the loyal user reads the mean of its own rows of the days before, exactly
        past = torch.cat([e[u == LOYAL] for d, _, u, _, e in gem.seen if d < day])
        read = torch.cat([r[u == LOYAL] for d, _, u, r, _ in gem.seen if d == day])
        assert torch.allclose(read, past.mean(0).expand_as(read), atol=1e-5)


def _snapshot_run(schema, run, days):
    """A continuously trained run as the sweep has one: a snapshot per day, each a
    different model."""
    run.mkdir()
    save_config(run, Config(model=gem_config()))
    save_schema(run, schema)
    for day in days:
        save_snapshot(run, day, make_gem(schema, seed=10 + day),
                      {"schema": schema.fingerprint(), "step": day},
                      {"last_day": day, "days": list(range(day + 1)), "step": day})
    return run


class _BatchSpy(TeacherService):
    """Records every call: its day, the batch, the published days its rows read, their features."""

    seen: list

    def predict(self, batch, update_cache=True, day=None):
        out = super().predict(batch, update_cache, day)
        self.seen.append((day, batch, self.history.days_read(day), out.user_hist))
        return out


@pytest.mark.parametrize("lag", [0, 1])
def test_each_days_table_is_computed_by_that_days_own_snapshot(schema, tmp_path, lag):
    """rep.source=days on a run with a snapshot per day: the table of day t is what snapshot(t −
    lag) computes for day t's users (not the students' teacher), and a row of day d reads only
    tables of days < d, computed by snapshots that have seen days ≤ d − 1 − lag."""
    data = _days_dataset(tmp_path / "data", schema)
    run = _snapshot_run(schema, tmp_path / "gem", range(4))
    snap, meta = teacher_snapshot(run, 2, lag)  # the students' teacher: their first day is 2
    assert meta["last_day"] == 1 - lag
    gem = _BatchSpy.from_run(run, snapshot=snap)
    gem.seen = []
    tcfg = techniques_config("kd+rep")
    tcfg.rep.source, tcfg.rep.days, tcfg.rep.dim = "days", 2, 4
    assert keep_history(tcfg, gem, DailySnapshots(run, lag, {snap: gem.model}))
    doms = domain_ids(schema, schema.domains.names)
    s = SliceStream(data, "valid", schema, doms, gem, 16, seed=0, warmup_days=2, teacher_batch=16)
    assert sum(b.batch_size for b, _ in s) == 160
    gem.history.publish()  # close day 3 too, to check its table
    h = gem.history
    # the table of day t by snapshot t − lag; lag 1 leaves day 0 without one (no snapshot had seen
    # day −1)
    assert h.source == {t: t - lag for t in range(lag, 4)} and sorted(h.tables) == list(
        range(lag, 4)
    )
    for day, batch, read, hist in gem.seen:
        assert all(t < day and h.source[t] <= day - 1 - lag for t in read), (day, read)
    mu, basis = h.proj
    for t in range(lag, 4):
        model = TeacherService.from_run(run,
                                        snapshot=run / "snapshots" / f"day-{t - lag:05d}").model
        feats = torch.cat([TeacherService(model).predict(b).embeddings for d, b,
                           *_ in gem.seen if d == t])
        users = torch.cat([b.user_id for d, b, *_ in gem.seen if d == t])
        slot, table = h.tables[t]
        for u in users.unique().tolist():
            want = (feats[users == u].mean(0) - mu) @ basis
            assert torch.allclose(table[slot[u]], want, atol=1e-4), (t, u)
        # not the students' teacher: what the old path stored differs
        if t - lag != meta["last_day"]:
            first = next(b for d, b, *_ in gem.seen if d == t)
            theirs = TeacherService(gem.model).predict(first).embeddings
            assert not torch.allclose(theirs, feats[: first.batch_size], atol=1e-3)
    # a row of day 3 reads its user's day-2 table (snapshot 2 − lag) and day-1 table, as published
    day3 = [(b, x) for d, b, _, x in gem.seen if d == 3]
    b, x = day3[0]
    i = int((b.user_id == LOYAL).nonzero()[0])
    assert torch.equal(x[i, :4], h.tables[2][1][h.tables[2][0][LOYAL]])
    assert torch.equal(x[i, 4:], h.tables[1][1][h.tables[1][0][LOYAL]])


def test_distill_on_a_run_with_snapshots_publishes_each_days_table_from_its_own_snapshot(
    schema, tmp_path
):
    """``opengem distill`` with rep.source=days on a continuously trained run: the tables it saves
    for serving were computed by the days' own snapshots (day t by snapshot t at lag 0), not
    its teacher's."""
    from opengem.run import USER_REP_FILE
    from opengem.transfer.distill import distill

    data = _days_dataset(tmp_path / "data", schema)
    run = _snapshot_run(schema, tmp_path / "gem", range(4))
    out = distill(run, "vm_xs", data, tmp_path / "vm",
                  ["transfer.rep.enabled=true", "transfer.rep.source=days",
                                                        "transfer.rep.days=2", "transfer.rep.dim=4",
                                                        "transfer.snapshot_lag=0",
                   "data.batch_size=16",
                                                        'transfer.domains=["d0","d1"]'])
    assert out["rows"] == 80  # the test day's rows
    saved = torch.load(tmp_path / "vm" / USER_REP_FILE, weights_only=False)
    # the teacher itself is snapshot 1 (day 2 − 1)
    assert saved["snapshot_last_day"] == {0: 0, 1: 1, 2: 2}
    assert saved["tables"][2]["reps"].shape == (13, 4)  # day 2's 12 users and the loyal one
