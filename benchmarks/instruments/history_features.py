"""The history summaries an ads team writes by hand, shared by the LightGBM and the
logistic-regression peers (``instruments.gbdt``, ``instruments.linear``).

Legend: B rows, N events of one stream summed over the batch (jagged values), A matched
attributes of the stream, E event types, K decay times τ.

    Batch.seq_age[stream], Batch.sequences["<stream>.*"], Batch.sparse ─► [B, k] float64

Per stream, with "matching" meaning an event whose attribute equals the candidate's id of the same
name (``match_attributes``: ``organic.category`` ≡ ``category``, ``ads.advertiser_id`` ≡
``advertiser_id``) or whose item id does when the stream's items are an ad-side id space
(``item_pair``: ``ads.item`` ≡ ``ad_id``); the OOV id never matches:

- ``{s}.decay_{τ}.all`` / ``.{a}``: Σ e^(−age/τ) over all events / the matching ones,
  τ ∈ 1 h, 6 h, 24 h, 7 d, 30 d;
- ``{s}.last_event_match.{a}``: 1 if the newest event matches (the share of the last 1 event);
  ``{s}.since_match_log1p_h.{a}``: log1p(hours since the newest matching event), ``NONE_LOG1P_H``
  when there is none;
- ``{s}.n_last_{w}`` / ``.{event}``: events in the last 1 h, 24 h, 7 d, all / of one type;
- ``{s}.n_last_{w}.{event}.{a}``: repeat engagement, matching events of one type (clicks and
  conversions on the candidate's advertiser in the ads stream) in the last 24 h, 7 d, 30 d;
- ``{s}.share_last{k}.{a}``: the share of the last k ∈ {5, 20} events that match (0 with none).

A row of 2 ``ads`` events, click 2 h ago on advertiser 7 and conversion 1 h ago on advertiser 3,
for a candidate of advertiser 7::

    ads.event = [0 1]   ads.advertiser_id = [7 3]   age_s = [7200 3600]
    ads.decay_1h.advertiser_id = e^(−2)     ads.last_event_match.advertiser_id = 0
    ads.since_match_log1p_h.advertiser_id = log1p(2)     ads.n_last_24h.click.advertiser_id = 1

Causal by construction: only events strictly before the request (age > 0) count, whatever the
batch holds (the loader also quarantines rows with later events: ``validate_rows``).
"""

from __future__ import annotations

import math

import torch

from opengem.data.batch import Batch
from opengem.features.schema import FeatureSchema
from opengem.model.foundation import match_attributes, match_flags
from opengem.ops.jagged import offsets_of, row_ids

HISTORY = ("practitioner", "basic")  # the peers' switch: these columns on (default) or off
DECAY_S = (("1h", 3600.0), ("6h", 21600.0), ("24h", 86400.0), ("7d", 604800.0),
           ("30d", 2592000.0))
WINDOWS_S = (("1h", 3600.0), ("24h", 86400.0), ("7d", 604800.0))
REPEAT_S = (("24h", 86400.0), ("7d", 604800.0), ("30d", 2592000.0))
LAST_K = (5, 20)
# above any real history's age (a decade): "never" sorts after "long ago"
NONE_LOG1P_H = math.log1p(10 * 365 * 24)


def check_history(history: str) -> str:
    if history not in HISTORY:
        raise ValueError(f"history must be one of {HISTORY}, got {history!r}")
    return history


def item_pair(schema: FeatureSchema, stream: str) -> list[tuple[str, str, int]]:
    """[(item column, ad-side feature, OOV id)]: the feature the schema declares the items' id
    space (``SequenceStream.matches``); in a schema without the declaration, the first ad-side
    feature of the same vocabulary not already matched through an attribute; else []."""
    s = schema.stream(stream)
    if s.matches is not None:
        return [(s.item_column, s.matches, s.item_vocab_size)]
    taken = {feat for _, feat, _ in match_attributes(schema, stream)}
    for f in schema.sparse:
        if (f.group == "ad" and not f.multi_hot and f.vocab_size == s.item_vocab_size
                and f.name not in taken):
            return [(s.item_column, f.name, f.vocab_size)]
    return []


def event_names(schema: FeatureSchema, stream: str) -> list[str]:
    """The stream's event type names from the schema's meta (``<stream>_events``, as the synthetic
    world writes them) when they fit, else e0, e1, …"""
    n = schema.stream(stream).num_event_types
    names = schema.meta.get(f"{stream}_events")
    if isinstance(names, list) and len(names) == n and len(set(names)) == n:
        return [str(x) for x in names]
    return [f"e{i}" for i in range(n)]


class PractitionerHistory:
    """The module docstring's columns for one schema: ``names``, ``counts`` (True where a column
    is a count or a decayed count, heavy-tailed: the logistic regression takes its log1p) and
    ``batch(batch)`` → [B, k] float64, finite."""

    def __init__(self, schema: FeatureSchema):
        self.schema = schema
        self.pairs = {s.name: match_attributes(schema, s.name) + item_pair(schema, s.name)
                      for s in schema.sequences}
        self.names: list[str] = []
        self.counts: list[bool] = []
        for s in schema.sequences:
            for names, count in self._stream_names(s.name):
                self.names += names
                self.counts += [count] * len(names)

    def _stream_names(self, s: str) -> list[tuple[list[str], bool]]:
        """(names, is a count) per family, in ``_stream`` order."""
        attrs = [feat for _, feat, _ in self.pairs[s]]
        events = event_names(self.schema, s)
        return [
            ([f"{s}.decay_{t}.{m}" for t, _ in DECAY_S for m in ["all", *attrs]], True),
            ([f"{s}.n_last_{w}{e}" for w, _ in WINDOWS_S for e in ["", *(f".{e}" for e in events)]],
             True),
            ([f"{s}.n_last_{w}.{e}.{a}" for a in attrs for w, _ in REPEAT_S for e in events], True),
            ([f"{s}.last_event_match.{a}" for a in attrs], False),
            ([f"{s}.share_last{k}.{a}" for k in LAST_K for a in attrs], False),
            ([f"{s}.since_match_log1p_h.{a}" for a in attrs], False),
        ]

    def batch(self, batch: Batch) -> torch.Tensor:
        """[B, k] float64 in ``names`` order."""
        cols = [self._stream(batch, s.name) for s in self.schema.sequences]
        return torch.cat(cols, 1) if cols else torch.zeros(batch.batch_size, 0, dtype=torch.float64)

    def _stream(self, batch: Batch, s: str) -> torch.Tensor:
        B, E = batch.batch_size, self.schema.stream(s).num_event_types
        ages = batch.seq_age.to_dict()[s]
        lengths, age = ages.lengths(), ages.values().double()
        row = row_ids(lengths)
        past = age > 0
        pairs = self.pairs[s]
        hit_NA = (match_flags(pairs, batch, lengths) if pairs
                  else past.new_zeros(past.numel(), 0)) & past[:, None]
        events = batch.sequences.to_dict()[self.schema.stream(s).event_column].values()
        # OOV event types count in "all" only
        type_NE = (events[:, None] == torch.arange(E)) & past[:, None]
        sel_NM = torch.cat([past[:, None], hit_NA], 1)
        decay = [_segment_sum(row, sel_NM * torch.exp(-age / tau)[:, None], B)
                 for _, tau in DECAY_S]
        windows = [_segment_sum(row, torch.cat([past[:, None], type_NE], 1) & (age <= w)[:, None],
                                B) for _, w in WINDOWS_S]
        repeat = [_segment_sum(row, type_NE & (hit_NA[:, a] & (age <= w))[:, None], B)
                  for a in range(len(pairs)) for _, w in REPEAT_S]
        return torch.cat(decay + windows + repeat + _recency(row, age, past, hit_NA, lengths), 1)


def _segment_sum(row_N: torch.Tensor, x_NM: torch.Tensor, B: int) -> torch.Tensor:
    """[B, M] per-row sums of the jagged [N, M]."""
    x_NM = x_NM.double()
    return x_NM.new_zeros(B, x_NM.shape[1]).index_add_(0, row_N, x_NM)


def _recency(row_N: torch.Tensor, age_N: torch.Tensor, past_N: torch.Tensor,
             hit_NA: torch.Tensor, lengths_B: torch.Tensor) -> list[torch.Tensor]:
    """[last-event match [B, A], share of the last k [B, A] per k, log1p hours since the newest
    match [B, A]]. "Last" counts past events only, by position (events run oldest → newest)."""
    B = lengths_B.numel()
    seen = torch.cumsum(past_N.long(), 0)
    # past events at or before each position within its row, via the row's start in ``seen``
    start = torch.cat([seen.new_zeros(1), seen])[offsets_of(lengths_B)[:-1]]
    n_past = _segment_sum(row_N, past_N[:, None], B)[:, 0]
    from_end = n_past.long()[row_N] - (seen - start[row_N])  # 0 = the newest past event
    out = [_segment_sum(row_N, hit_NA & (past_N & (from_end == 0))[:, None], B)]
    for k in LAST_K:
        n = _segment_sum(row_N, hit_NA & (past_N & (from_end < k))[:, None], B)
        out.append(n / n_past.clamp(max=k, min=1)[:, None])
    hours = torch.where(hit_NA, age_N[:, None] / 3600.0, math.inf)
    newest = hours.new_full((B, hit_NA.shape[1]), math.inf).scatter_reduce_(
        0, row_N[:, None].expand_as(hours), hours, "amin")
    out.append(torch.where(torch.isinf(newest), NONE_LOG1P_H, torch.log1p(newest)))
    return out
