"""The teacher's per-user tables, published like feature-store tables (what serving looks up by
user id).

Legend: B rows, E teacher embedding width, U users of a table, r the projected width (``rep.dim``).

``UserRepCache`` (``rep.source=user``): user → the running mean of the teacher's embeddings over the
user's rows, published once a day. ``UserRepHistory`` (``rep.source=days``, LoopFM's representations
over time): one table per day, each computed by that day's own FM snapshot (``DailySnapshots`` in
``opengem.transfer.teacher``), read by later days as k·r dense user features.
"""

from __future__ import annotations

import torch


class UserRepCache:
    """user id → running mean of the teacher embeddings of that user's rows (a feature-store table).

    ``update`` writes the live table; ``lookup`` reads the last ``publish``ed snapshot."""

    def __init__(self, dim: int):
        self.dim = dim
        self.slot: dict[int, int] = {}
        self.sums = torch.zeros(1024, dim)
        self.counts = torch.zeros(1024)
        self.published = (self.sums[:0].clone(), self.counts[:0].clone())

    def _slots(self, user_ids: torch.Tensor, add: bool) -> torch.Tensor:
        out = []
        for u in user_ids.tolist():
            s = self.slot.get(u)
            if s is None and add:
                s = self.slot[u] = len(self.slot)
            out.append(-1 if s is None else s)
        if len(self.slot) > self.sums.shape[0]:
            grow = max(len(self.slot), 2 * self.sums.shape[0]) - self.sums.shape[0]
            self.sums = torch.cat([self.sums, self.sums.new_zeros(grow, self.dim)])
            self.counts = torch.cat([self.counts, self.counts.new_zeros(grow)])
        return torch.tensor(out, dtype=torch.long)

    def publish(self) -> None:
        """Make every update so far visible to ``lookup`` (the daily feature-store refresh)."""
        n = len(self.slot)
        self.published = (self.sums[:n].clone(), self.counts[:n].clone())

    def lookup(self, user_ids: torch.Tensor) -> torch.Tensor:
        """[B, E]: each user's published mean; zeros for a user not in the snapshot."""
        sums, counts = self.published
        s = self._slots(user_ids, add=False)
        out = torch.zeros(len(s), self.dim)
        rows = ((s >= 0) & (s < len(counts))).nonzero().squeeze(1)
        rows = rows[counts[s[rows]] > 0]
        out[rows] = sums[s[rows]] / counts[s[rows]].unsqueeze(1)
        return out

    def update(self, user_ids: torch.Tensor, emb_BE: torch.Tensor) -> None:
        s = self._slots(user_ids, add=True)
        self.sums.index_add_(0, s, emb_BE.float())
        self.counts.index_add_(0, s, torch.ones(len(s)))

    def state_dict(self) -> dict:
        """The published snapshot (what serving reads)."""
        sums, counts = self.published
        users = torch.tensor(sorted(self.slot, key=self.slot.get)[: len(counts)], dtype=torch.long)
        return {"dim": self.dim, "user_ids": users, "sums": sums.clone(), "counts": counts.clone()}

    @classmethod
    def from_state_dict(cls, state: dict) -> UserRepCache:
        c = cls(state["dim"])
        c.slot = {int(u): i for i, u in enumerate(state["user_ids"].tolist())}
        c.sums, c.counts = state["sums"].clone(), state["counts"].clone()
        c.publish()
        return c


class UserRepHistory:
    """Per user, the FM's daily published representations (LoopFM's historical embeddings).

    Each day closes into one table: user id → the mean of that day's embeddings of the user's rows,
    projected to ``dim`` by a fixed PCA (fitted on the first day published, then frozen, so every
    day's vectors live in one space). A row of day d reads its user's vectors of the ``days`` latest
    *published* days before d, newest first, as k·r dense features (zeros for a day the user was not
    seen): never its own day or later (a day is published only once the teacher has moved past it,
    and only days < d are read).

    Which model computes a day's table: with ``snapshots`` (``DailySnapshots``, a continuously
    trained run), the day's own snapshot, the one published when the day ended, delayed by the lag
    (the rule is ``DailySnapshots``'s); without, the teacher that scores the day (a run without
    snapshots). ``update`` takes the embeddings of that model; ``source`` records, per table, the
    last day its snapshot had seen. One frozen projection over snapshots is meaningful because
    successive snapshots of one continuous run are warm-started from each other (their feature
    spaces move slowly); a run retrained from scratch would need a projection per snapshot.

    Why dense features of the last k days, projected, rather than a pooled stream inside the model:
    the served backbone stays a plain GEM (no new module, nothing run at serving but a key-value
    lookup of k·r floats), and the projection keeps the input small (3 × 16 against the 320 of the
    per-user mean, which over-fit a student with ≈1,400 clicks); the student's dense arch learns the
    weighting over days that pooling would have fixed."""

    def __init__(self, dim_in: int, days: int = 3, dim: int = 16, snapshots=None):
        self.dim_in, self.days, self.dim, self.snapshots = dim_in, days, dim, snapshots
        # day → (user → row, [U, r])
        self.tables: dict[int, tuple[dict[int, int], torch.Tensor]] = {}
        # day → last day seen by the snapshot that computed its table
        self.source: dict[int, int | None] = {}
        self.proj: tuple[torch.Tensor, torch.Tensor] | None = None  # (mean [E], basis [E, r])
        self.live: tuple[int, dict[int, int], list[torch.Tensor], list[torch.Tensor]] | None = None

    def update(self, day: int, user_ids: torch.Tensor, emb_BE: torch.Tensor) -> None:
        if self.live is not None and self.live[0] != day:
            self.publish()
        if self.live is None:
            self.live = (day, {}, [], [])
        _, slot, sums, counts = self.live
        rows = []
        for u in user_ids.tolist():
            s = slot.get(u)
            if s is None:
                s = slot[u] = len(slot)
            rows.append(s)
        idx = torch.tensor(rows, dtype=torch.long)
        n = len(slot)
        acc = torch.zeros(n, self.dim_in)
        cnt = torch.zeros(n)
        acc.index_add_(0, idx, emb_BE.float())
        cnt.index_add_(0, idx, torch.ones(len(idx)))
        sums.append(acc)
        counts.append(cnt)

    def publish(self) -> None:
        """Close the live day into its published table (the teacher has moved on to a later day)."""
        if self.live is None:
            return
        day, slot, sums, counts = self.live
        self.live = None
        n = len(slot)
        total, cnt = torch.zeros(n, self.dim_in), torch.zeros(n)
        for a, c in zip(sums, counts):
            total[: len(a)] += a
            cnt[: len(c)] += c
        mean = total / cnt.clamp(min=1).unsqueeze(1)
        if self.proj is None:
            mu = mean.mean(0)
            x = mean - mu
            r = min(self.dim, n, self.dim_in)
            _, _, v = torch.linalg.svd(x, full_matrices=False)
            basis = torch.zeros(self.dim_in, self.dim)
            basis[:, :r] = v[:r].T
            # unit variance per component on the fitting day
            scale = (x @ basis).std(0).clamp(min=1e-6)
            self.proj = (mu, basis / scale)
        mu, basis = self.proj
        self.tables[day] = (slot, (mean - mu) @ basis)
        self.source[day] = self.snapshots.last_day(day) if self.snapshots is not None else None

    def lookup(self, user_ids: torch.Tensor, day: int) -> torch.Tensor:
        """[B, days·dim]: each user's vectors of the ``days`` latest published days
        before ``day``."""
        past = sorted((d for d in self.tables if d < day), reverse=True)[: self.days]
        out = torch.zeros(len(user_ids), self.days, self.dim)
        ids = user_ids.tolist()
        for j, d in enumerate(past):
            slot, table = self.tables[d]
            rows = [(i, slot[u]) for i, u in enumerate(ids) if u in slot]
            if rows:
                i, s = map(torch.tensor, zip(*rows))
                out[i, j] = table[s]
        return out.reshape(len(ids), -1)

    def state_dict(self) -> dict:
        """The published tables and the projection (what serving reads, keyed by user id
        and day)."""
        return {"days": self.days, "dim": self.dim, "proj": self.proj,
                "snapshot_last_day": dict(self.source),
                "tables": {d: {"user_ids": torch.tensor(sorted(slot, key=slot.get),
                                                        dtype=torch.long), "reps": t}
                           for d, (slot, t) in self.tables.items()}}

    def days_read(self, day: int) -> list[int]:
        """The published days a row of ``day`` reads (for tests and reports)."""
        return sorted((d for d in self.tables if d < day), reverse=True)[: self.days]
