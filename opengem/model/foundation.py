"""GEM: the foundation model, single-device, built from the schema and one ``GEMConfig``.

Legend: B rows, n sparse features, F dense features, D dim, T tasks.

    batch.sparse ─► SparseArch (EBC) ─► [B, n, D] ┐
    batch.dense  ─► DenseArch        ─► [B, k, D] │
    batch.domain ─► domain embedding ─► [B, 1, D] ├─ X_0 [B, n+k+2, D] ─┐
    batch.sequences ─► HistoryCounts ─► [B, 1, D] │                      ├─► InterFormer ─► Heads ─► logits [B, T]
    batch.embeddings ─► Linear dim→D each ─► [B, e, D] ┘ (precomputed vectors, e.g. ad content; e may be 0)
    batch.sequences ─► DecayPool (model.decay_pool_hours, off by default) ─► [B, S·K, D] ┘ (decayed means)
    batch.sequences ─► SparseArch (EC) + ages ─► per stream jagged [N, D] ┘   (Wukong ⇄ pyramid towers)
    batch.seq_values ─► EventValues: Linear(signed_log) ─► + each event token (streams with values)

Both sequence paths read the target match (event attribute == the candidate's id of that name).

Distribution never appears here: ``opengem.parallel`` (sharding) and the trainer wrap it from
outside. Build on ``meta``, materialise with ``to_empty``, then call ``init_weights()``.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.functional import one_hot
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from opengem.data.batch import Batch
from opengem.features.schema import FeatureSchema
from opengem.model.dense_norm import DenseNormalizer, signed_log
from opengem.model.heads import Heads, HeadsConfig, LowOrderShortcut
from opengem.model.interaction_arch import WukongConfig, mlp, unit_rms
from opengem.model.interformer import InterFormer, InterFormerConfig
from opengem.model.sequence_arch import SequenceConfig
from opengem.model.sparse_arch import SparseArch, SparseArchConfig
from opengem.ops.jagged import row_ids


@dataclass
class GEMConfig:
    arch: str = "gem"  # gem | dlrm | dlrm_dcn | din: GEM, or a peer baseline (model.peers)
    embedding_dim: int = 32
    dense_tokens: int = 1
    # cap on every stream's history (most recent kept); 0 = the schema's max_len
    max_seq_len: int = 0
    use_sequences: bool = True  # False: ablation without sequence towers
    # fwfm | fvfm | linear | none: low-order logits from X_0 (heads.LowOrderShortcut)
    shortcut: str = "fwfm"
    # raw | unit: the shortcut's pairs from tokens scaled to unit RMS, its linear part raw (heads.LowOrderShortcut;
    # chosen on development worlds' valid splits, docs/experiments.md)
    shortcut_pairs: str = "unit"
    # flag events whose attribute equals the candidate's feature of that name
    target_match: bool = True
    # the target match also compares each event's item with the candidate's id where the schema
    # declares the items that feature's ids (``SequenceStream.matches``)
    target_match_items: bool = False
    # one X_0 token per stream with matched columns: the candidate looked up in the stream's own
    # tables (``GEM.target_tokens``)
    target_tokens: bool = False
    # HistoryCounts token; () = off
    count_decay_hours: tuple[float, ...] = (1.0, 24.0, 168.0, 720.0)
    # HistoryCounts also reads e^(−age of the newest event/τ), per type, all and matched; off: its
    # gain on small development worlds did not carry to the demo's size (docs/experiments.md, 'Where
    # the held-out gap is')
    count_recency: bool = False
    # HistoryCounts also counts the events in hard windows of the same lengths (age ≤ τ), as a
    # practitioner's "events in the last hour / day / week" features do
    count_windows: bool = False
    # DecayPool: per stream and initial decay time (hours), one X_0 token, the time-decayed mean of
    # the stream's event embeddings with τ learned; () = off (within a training seed's noise at the
    # demo's size, docs/experiments.md)
    decay_pool_hours: tuple[float, ...] = ()
    # torch: the domain and time-bucket embeddings keep nn.Embedding's N(0, 1) | table: N(0, init_std²) like the
    # id tables. After LayerNorm a unit-scale token dominates 0.05-scale ones; measured
    # in docs/experiments.md.
    embedding_init: str = "torch"
    # signed_log | standardize | quantile (opengem.model.dense_norm; fitted on train)
    dense_norm: str = "signed_log"
    # none | rms: every X_0 token to unit RMS, times a learned per-token gain (TokenRMSNorm)
    input_norm: str = "none"
    # the gains' initial value (the RMS each normalised token starts at)
    input_norm_gain: float = 1.0
    sparse: SparseArchConfig = field(default_factory=SparseArchConfig)
    wukong: WukongConfig = field(default_factory=WukongConfig)
    sequence: SequenceConfig = field(default_factory=SequenceConfig)
    interformer: InterFormerConfig = field(default_factory=InterFormerConfig)
    heads: HeadsConfig = field(default_factory=HeadsConfig)

    def validate(self) -> None:
        if self.arch not in ("gem", "dlrm", "dlrm_dcn", "din"):
            raise ValueError(f"model.arch must be gem|dlrm|dlrm_dcn|din, got {self.arch!r}")
        if self.embedding_dim < 1 or self.dense_tokens < 1 or self.max_seq_len < 0:
            raise ValueError("model.embedding_dim and model.dense_tokens must be >= 1, "
                             "max_seq_len >= 0")
        for name in ("count_decay_hours", "decay_pool_hours"):
            hours = getattr(self, name)
            if any(not h > 0 for h in hours):
                raise ValueError(f"model.{name} must all be > 0 hours, got {hours}")
        if not self.input_norm_gain > 0:
            raise ValueError(f"model.input_norm_gain must be > 0, got {self.input_norm_gain}")
        if self.input_norm not in ("none", "rms", "rms_ids"):
            raise ValueError(f"model.input_norm must be none|rms|rms_ids, got {self.input_norm!r}")
        if self.embedding_init not in ("torch", "table"):
            raise ValueError(f"model.embedding_init must be torch|table, "
                             f"got {self.embedding_init!r}")
        if self.shortcut_pairs not in ("raw", "unit"):
            raise ValueError(f"model.shortcut_pairs must be raw|unit, got {self.shortcut_pairs!r}")
        if self.shortcut not in ("fwfm", "fvfm", "linear", "none"):
            raise ValueError(f"model.shortcut must be fwfm|fvfm|linear|none, got {self.shortcut!r}")
        self.wukong.validate()
        self.sequence.validate(self.embedding_dim)
        self.interformer.validate()
        self.heads.validate()


def match_attributes(schema: FeatureSchema, stream: str,
                     items: bool = False) -> list[tuple[str, str, int]]:
    """(event column, sparse feature, OOV id) for each attribute of ``stream`` that shares a
    single-valued sparse feature's id space (``EventAttribute.matches``, or unset: named after one
    with the same vocabulary), then, with ``items``, the item column when the schema declares
    the items an impression feature's ids (``SequenceStream.matches``).

    Target match (a choice; the public record is silent, dossier §11): each event token gets a
    learned vector per attribute equal to the candidate's own id — "this organic event is in the
    ad's category", "this ads engagement was with the same advertiser", "this user clicked this
    very ad" — SIM's hard search as a token feature. With the towers' attention sink, a
    time-decayed share of matching events is one attention read. ``model.target_match=false``
    turns it off; ``model.target_match_items`` decides the item column.
    """
    feats = {f.name: f for f in schema.sparse}
    s = schema.stream(stream)
    out = []
    for a in s.attributes:
        f = feats.get(a.matches or a.name)
        if f is not None and not f.multi_hot and f.vocab_size == a.vocab_size:
            out.append((s.attribute_column(a), f.name, f.vocab_size))
    if items and s.matches is not None:
        out.append((s.item_column, s.matches, s.item_vocab_size))
    return out


def embedding_tokens(proj: nn.ModuleList, schema: FeatureSchema,
                     emb_BE: torch.Tensor | None) -> list[torch.Tensor]:
    """One [B, 1, D] X_0 token per embedding feature: its slice of ``Batch.embeddings`` through
    its Linear."""
    if emb_BE is None:
        raise ValueError(f"the schema has embedding features {[f.name for f in schema.embeddings]} "
                         "but the batch carries no embeddings")
    out, start = [], 0
    for f, lin in zip(schema.embeddings, proj):
        out.append(lin(emb_BE[:, start:start + f.dim].to(lin.weight.dtype)).unsqueeze(1))
        start += f.dim
    return out


class EventValues(nn.Module):
    """Each event's numeric values (``SequenceStream.values``: dwell seconds, watch fraction,
    price) as one more summand of its token, beside its item, event-type and attribute rows:
    ``Linear(V → D)(signed_log(values))`` per stream that has values (V of them).

    Why signed_log (``model.dense_norm``'s default for dense floats): dwell times and prices are
    heavy-tailed, and a raw value would let a few long dwells swamp the token; sign·log1p puts any
    unit and scale in one range without fitted statistics, so training and serving need nothing
    beyond the weights. No bias: a value of 0 leaves the token as the tables make it (the tables
    already hold every per-event constant).

    Args: schema, streams (the model's stream names, in order), dim (D). ``add(events, batch)``
    takes ``SparseArch.forward_sequences``'s output and returns it with the values' vectors added.
    """

    def __init__(self, schema: FeatureSchema, streams: list[str], dim: int):
        super().__init__()
        self.columns = {s: list(schema.stream(s).value_columns) for s in streams
                        if schema.stream(s).values}
        self.proj = nn.ModuleDict({s: nn.Linear(len(cols), dim, bias=False)
                                   for s, cols in self.columns.items()})

    def forward(self, stream: str, values_NV: torch.Tensor) -> torch.Tensor:
        """[N, D] of one stream's values [N, V] (raw, as collated)."""
        lin = self.proj[stream]
        return lin(signed_log(values_NV.to(lin.weight.dtype)))

    def values(self, batch: Batch) -> dict[str, torch.Tensor]:
        """stream → its values [N, V] in ``values`` order, from ``Batch.seq_values``."""
        if batch.seq_values is None:
            raise ValueError(f"the schema's streams {sorted(self.columns)} have per-event values "
                             "but the batch carries none (Batch.seq_values)")
        per_key = batch.seq_values.to_dict()
        return {s: torch.stack([per_key[c].values() for c in cols], dim=1)
                for s, cols in self.columns.items()}

    def add(self, events: dict[str, tuple[torch.Tensor, torch.Tensor]],
            batch: Batch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        vals = self.values(batch)
        return {s: ((v + self(s, vals[s]), n) if s in vals else (v, n))
                for s, (v, n) in events.items()}


def event_values(schema: FeatureSchema, streams: list[str], dim: int) -> EventValues | None:
    """The value projection of ``streams``, or None when none of them has values (a model of such
    a schema builds exactly the modules it did before the field)."""
    return (EventValues(schema, streams, dim)
            if any(schema.stream(s).values for s in streams) else None)


def match_flags(pairs: list[tuple[str, str, int]], batch: Batch,
                lengths: torch.Tensor) -> torch.Tensor:
    """[N, A] bool: where event n's attribute a equals its row's candidate id of that name
    (``pairs``: a stream's ``match_attributes``; lengths [B] its events per row). OOV
    never matches."""
    row = row_ids(lengths)
    seq, sparse = batch.sequences.to_dict(), batch.sparse.to_dict()
    flags = []
    for col, feat, oov in pairs:
        ids = seq[col].values()
        flags.append((ids == sparse[feat].values()[row]) & (ids != oov))
    return torch.stack(flags, dim=1)


class HistoryCounts(nn.Module):
    """One X_0 token from time-decayed event counts of each stream: per event type and decay time τ,
    log1p(Σ_e e^(−age_e/τ)) over all of a row's events and over those whose attribute matches the
    candidate (``match_attributes``), through a 2-layer MLP.

    Why (a choice; the public record is silent): softmax attention reads a *share* of matching
    events, never how many there are, and a tower recovers a count only through its sink logit; but
    "how often, how recently did this user engage with this advertiser" is the classic ads feature
    (SIM's hard search reduced to counts). The sums are O(N) jagged segment sums. τ is
    ``model.count_decay_hours`` (fixed, log-spaced: the MLP mixes them); () turns the token off.
    Counts see the history the loader keeps (``model.max_seq_len``). Softmax attention reads shares
    of matching events, never how many there were or how recent; this token reads exactly that
    (docs/experiments.md has what it did on the demo world).

    ``recency`` (``model.count_recency``) adds, beside each sum, the largest weight, e^(−age/τ) of
    the newest such event: a sum of decays cannot tell one event an hour ago from many a day ago,
    and "how long since the user last engaged with this advertiser" is the other classic
    ads feature.
    """

    def __init__(self, schema: FeatureSchema, streams: list[str], match_pairs: dict[str, list],
                 decay_hours: tuple[float, ...], dim: int, recency: bool = False,
                 windows: bool = False):
        super().__init__()
        # constants, not a buffer: nothing to shard or load
        self.decay_hours = tuple(float(h) for h in decay_hours)
        # + the OOV event id
        self.num_events = {s: schema.stream(s).num_event_types + 1 for s in streams}
        self.recency, self.windows = recency, windows
        K = len(decay_hours) * (2 if windows else 1)
        n = sum((1 + len(match_pairs[s])) * self.num_events[s] * K for s in streams)
        self.num_counts = n * (2 if recency else 1)
        self.mlp = mlp([self.num_counts, 4 * dim, dim])

    def event_weights(self, stream: str, events_N: torch.Tensor,
                      age_N: torch.Tensor) -> torch.Tensor:
        """[N, E·K]: event n's one-hot event type ⊗ its decays e^(−age/τ_k) (then, with
        ``windows``, its indicators age ≤ τ_k: K = 2 × the decay times)."""
        E = self.num_events[stream]
        inv_tau_K = age_N.new_tensor([1.0 / (3600.0 * h) for h in self.decay_hours],
                                     dtype=torch.float32)
        scaled_NK = age_N.float().clamp(min=0)[:, None] * inv_tau_K
        decay_NK = torch.exp(-scaled_NK)
        if self.windows:
            decay_NK = torch.cat([decay_NK, (scaled_NK <= 1.0).float()], dim=1)
        return (one_hot(events_N.clamp(0, E - 1), E).float()[:, :, None]
                * decay_NK[:, None, :]).flatten(1)

    def stream_counts(self, stream: str, events_N: torch.Tensor, age_N: torch.Tensor,
                      flags_NA: torch.Tensor | None, lengths_B: torch.Tensor) -> torch.Tensor:
        """[B, (1 + A)·E·K] decayed counts of one stream (before log1p); with ``recency`` then as
        many largest weights (0 where there is no such event)."""
        B = lengths_B.numel()
        w_NEK = self.event_weights(stream, events_N, age_N)
        sel = [w_NEK.new_ones(w_NEK.shape[0], 1)] + ([flags_NA.to(w_NEK.dtype)]
                                                     if flags_NA is not None else [])
        x = (torch.cat(sel, dim=1)[:, :, None] * w_NEK[:, None, :]).flatten(1)
        row = row_ids(lengths_B)
        sums = x.new_zeros(B, x.shape[1]).index_add_(0, row, x)
        if not self.recency:
            return sums
        # ≥ 0: 0 = none
        newest = x.new_zeros(B, x.shape[1]).scatter_reduce_(0, row[:, None].expand_as(x), x, "amax")
        return torch.cat([sums, newest], dim=1)

    def forward(self, counts: list[torch.Tensor]) -> torch.Tensor:
        """[B, D] from each stream's ``stream_counts``: log1p of the sums, the largest weights as
        they are."""
        if self.recency:
            counts = [
                torch.cat([torch.log1p(c[:, : c.shape[1] // 2]), c[:, c.shape[1] // 2 :]], dim=1)
                for c in counts
            ]
            return self.mlp(torch.cat(counts, dim=1))
        return self.mlp(torch.log1p(torch.cat(counts, dim=1)))


class DecayPool(nn.Module):
    """Per stream and decay time τ_k, one X_0 token: the time-decayed mean of the stream's event
    embeddings (item + event type + attributes, the tables' own space), Σ_e w_e v_e / (1 + Σ_e w_e)
    with w_e = e^(−age_e/τ_k) on the event's age in seconds; each τ_k is learned (its log, one per
    stream and k), starting at ``hours``.

    Why (a choice; the public record is silent): the towers read the history through the
    candidate-conditioned softmax pool and the recent window, so "how close is what this user has
    been doing lately to this ad" reaches the candidate's tokens only after attention and a layer;
    a decayed mean in the tables' space puts it beside the candidate's own rows in X_0, where one
    of Wukong's dot products reads it (YouTube's averaged watch embeddings, with a learned decay on
    real seconds instead of a fixed window). The 1 in the denominator is the towers' sink: an empty
    or long-past history pools to ~0 rather than to a mean of nothing. Candidate-free and O(N·D):
    computed once per user at serving. ``model.decay_pool_hours``; () turns it off.
    """

    def __init__(self, num_streams: int, hours: tuple[float, ...]):
        super().__init__()
        self.hours = tuple(float(h) for h in hours)
        self.log_tau = nn.Parameter(torch.empty(num_streams, len(self.hours)))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.log_tau.copy_(torch.log(torch.tensor(self.hours) * 3600.0).expand_as(self.log_tau))

    def weights(self, i: int, age_N: torch.Tensor) -> torch.Tensor:
        """[N, K] e^(−age/τ_k) of stream ``i``'s events."""
        return torch.exp(-age_N.to(self.log_tau.dtype).clamp(min=0)[:, None]
                         * torch.exp(-self.log_tau[i])[None, :])

    def stream_tokens(self, i: int, values_ND: torch.Tensor, age_N: torch.Tensor,
                      lengths_B: torch.Tensor) -> torch.Tensor:
        """[B, K, D]: stream ``i``'s pooled tokens from its jagged events (values [N, D],
        lengths [B])."""
        B, D = lengths_B.numel(), values_ND.shape[1]
        w_NK = self.weights(i, age_N)
        row = row_ids(lengths_B)
        K = w_NK.shape[1]
        num = values_ND.new_zeros(B, K * D).index_add_(
            0, row, (w_NK[:, :, None] * values_ND[:, None, :]).flatten(1))
        den = 1.0 + w_NK.new_zeros(B, K).index_add_(0, row, w_NK)
        return num.view(B, K, D) / den[:, :, None]


class TokenRMSNorm(nn.Module):
    """X_0 [B, n, D] → each token divided by its RMS over D, times a learned gain per (token, dim).

    Why (a choice; the public record is silent): X_0 mixes id embeddings (N(0, 0.05²) at init) with
    the domain embedding (N(0, 1)) and MLP outputs (dense, history counts) of unit scale, so the
    FM's Gram matrix and the shortcut's pairs are dominated by the unit-scale tokens and an id × id
    affinity is a small perturbation of them. Putting every field on one scale lets each pair of
    fields count alike from the first step; the gains let training re-weight fields. ``rms_ids``
    normalises the id tokens only; ``model.input_norm_gain`` is the RMS the tokens start at.
    Measured on development worlds (docs/experiments.md): it raises the learned share of the id × id
    terms but costs conversion NE, so it is an option, off by default.
    """

    def __init__(self, n_tokens: int, dim: int, eps: float = 1e-6, n_norm: int | None = None,
                 gain: float = 1.0):
        super().__init__()
        # the first n_norm tokens only
        self.eps, self.n_norm = eps, n_tokens if n_norm is None else n_norm
        self.init_gain = gain
        self.gain = nn.Parameter(torch.full((self.n_norm, dim), gain))

    def reset_parameters(self) -> None:
        nn.init.constant_(self.gain, self.init_gain)

    def forward(self, x_BND: torch.Tensor) -> torch.Tensor:
        x, rest = x_BND[:, : self.n_norm], x_BND[:, self.n_norm:]
        x = unit_rms(x, self.eps) * self.gain
        return torch.cat([x, rest], dim=1) if rest.shape[1] else x


class TableModel(nn.Module):
    """What training, evaluation and teachers use of any model built from a schema (GEM, the peers):
    which parameters are table rows (row-wise Adagrad, TorchRec-sharded) and the history caps.
    Subclasses set ``schema``, ``cfg`` (a ``GEMConfig``) and ``sparse_arch``."""

    schema: FeatureSchema
    cfg: GEMConfig
    sparse_arch: SparseArch

    def sparse_parameters(self) -> list[nn.Parameter]:
        return self.sparse_arch.sparse_parameters()

    def dense_parameters(self) -> list[nn.Parameter]:
        sparse = {id(p) for p in self.sparse_parameters()}
        return [p for p in self.parameters() if id(p) not in sparse]

    def max_seq_len(self) -> dict[str, int]:
        """Per-stream history cap for ``collate`` (the loader applies it, never the model)."""
        return {s.name: (min(self.cfg.max_seq_len, s.max_len) if self.cfg.max_seq_len
                         else s.max_len)
                for s in self.schema.sequences}


class GEM(TableModel):
    """The foundation model: schema-built tables, the X_0 tokens, InterFormer, the heads
    (module docstring).

    Args:
        schema: the features, streams, tasks and domains; every table and head is sized from it.
        cfg: ``GEMConfig`` (``model.*``); validated here.
        device: where to build the parameters; ``"meta"`` to parallelise first, then ``to_empty``
            and ``init_weights()``.

    Legend: B rows, n_x = n sparse + k dense + 1 domain (+ 1 history-counts) tokens, D dim,
    N events of one stream in the batch, F = ``feature_dim``, T tasks.

    ``forward(batch)`` → logits [B, T] in schema task order; ``features(batch)`` → [B, F], what the
    heads read. A stream's events are jagged, never padded: values [N, D] with lengths [B], e.g. a
    batch of 3 rows with 2, 0 and 3 ads events::

        lengths  [2, 0, 3]
        values   [e00, e01 | (none) | e20, e21, e22]     N = 5 rows of D, row b's events in order

    so the towers' cost grows with N, not with B × max length.
    """

    def __init__(self, schema: FeatureSchema, cfg: GEMConfig,
                 device: torch.device | str | None = None):
        super().__init__()
        cfg.validate()
        self.schema, self.cfg = schema, cfg
        D = cfg.embedding_dim
        device = torch.device(device) if device is not None else None
        with torch.device(device) if device is not None else nullcontext():
            self.sparse_arch = SparseArch(schema, cfg.sparse, D, device)
            F = len(schema.dense)
            # + M missing indicators
            norm = DenseNormalizer(F, cfg.dense_norm, missing=schema.dense_missing)
            self.dense_arch = mlp([norm.out_features, 4 * D, cfg.dense_tokens * D]) if F else None
            self.dense_norm = norm
            self.domain_emb = nn.Embedding(schema.num_domains, D)
            self.streams = [s.name for s in schema.sequences] if cfg.use_sequences else []
            self.match_pairs = {name: match_attributes(schema, name, cfg.target_match_items)
                                if cfg.target_match else [] for name in self.streams}
            self.history_counts = (HistoryCounts(schema, self.streams, self.match_pairs,
                                                 cfg.count_decay_hours, D,
                                                 cfg.count_recency, cfg.count_windows)
                                   if cfg.count_decay_hours and self.streams else None)
            self.token_streams = ([n for n in self.streams if self.match_pairs[n]]
                                  if cfg.target_tokens else [])
            n_pool = len(self.streams) * len(cfg.decay_pool_hours)
            n_x = (len(schema.sparse) + (cfg.dense_tokens if F else 0) + 1
                   + (self.history_counts is not None) + len(self.token_streams)
                   + len(schema.embeddings) + n_pool)
            self.input_norm = (TokenRMSNorm(n_x, D, n_norm=len(schema.sparse)
                                                    if cfg.input_norm == "rms_ids" else None,
                                            gain=cfg.input_norm_gain) if cfg.input_norm != "none"
                               else None)
            self.target_match = nn.ModuleDict({name: nn.Linear(len(cols), D, bias=False)
                                               for name, cols in self.match_pairs.items() if cols})
            self.interformer = InterFormer(n_x, D, len(self.streams), cfg.wukong, cfg.sequence,
                                           cfg.interformer)
            feat = (
                cfg.interformer.num_sum * D
                + len(self.streams) * cfg.interformer.tokens_per_stream * D
            )
            self.feature_dim = feat
            self.heads = Heads(feat, schema, cfg.heads)
            self.shortcut = (LowOrderShortcut(n_x, D, len(schema.tasks), cfg.shortcut,
                                              cfg.shortcut_pairs == "unit")
                             if cfg.shortcut != "none" else None)
            # Last, and only when the schema has embedding features: a schema without any builds
            # (and seeds) exactly the modules it did before the kind existed.
            self.embedding_proj = (nn.ModuleList([nn.Linear(f.dim, D) for f in schema.embeddings])
                                   if schema.embeddings else None)
            # After it, for the same reason: only streams with per-event values add a module.
            self.event_values = event_values(schema, self.streams, D)
            # Last again, and only when on: off, the model builds and seeds what it did before.
            self.decay_pool = (DecayPool(len(self.streams), cfg.decay_pool_hours) if n_pool
                               else None)

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def init_weights(self, base_rates: list[float] | None = None, seed: int = 0) -> None:
        """(Re)initialise every parameter; call after ``to_empty`` when built on meta."""
        tables = {id(m) for m in self.sparse_arch.modules()}
        for m in self.modules():
            # tables: seeded per table below, independent of this stream
            if m is self or id(m) in tables:
                continue
            if isinstance(m, nn.MultiheadAttention):
                m._reset_parameters()
            elif hasattr(m, "reset_parameters"):
                m.reset_parameters()
        self.sparse_arch.init_weights(seed)
        if self.cfg.embedding_init == "table":
            std = self.cfg.sparse.init_std
            for emb in [self.domain_emb] + [t.time_emb for t in self.interformer.towers]:
                emb.weight.normal_(0.0, std)
        if base_rates is not None:
            self.heads.init_bias(base_rates)

    # ------------------------------------------------------------------ forward
    def inputs(self, batch: Batch) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """X_0 [B, n_x, D] (sparse, dense, domain, history-count and embedding tokens) and per
        stream (tokens [N, D], lengths [B])."""
        B = batch.batch_size
        tokens = [self.sparse_arch.forward_sparse(batch.sparse, B)]
        if self.dense_arch is not None:
            tokens.append(
                self.dense_arch(self.dense_norm(batch.dense)).view(B, self.cfg.dense_tokens, -1)
            )
        tokens.append(self.domain_emb(batch.domain).unsqueeze(1))
        seqs, counts, pools = [], [], []
        if self.streams:
            emb = self.sparse_arch.forward_sequences(batch.sequences)
            if self.event_values is not None:
                emb = self.event_values.add(emb, batch)
            ages = batch.seq_age.to_dict()
            seq = batch.sequences.to_dict() if self.history_counts is not None else {}
            for i, (tower, name) in enumerate(zip(self.interformer.towers, self.streams)):
                values, lengths = emb[name]
                if self.decay_pool is not None:
                    pools.append(self.decay_pool.stream_tokens(i, values, ages[name].values(),
                                                               lengths))
                flags = self._match_flags(batch, name, lengths) if self.match_pairs[name] else None
                if name in self.target_match:
                    values = values + self.target_match[name](
                        flags.to(self.target_match[name].weight.dtype)
                    )
                age = ages[name].values()
                seqs.append((tower.embed(values, age), lengths))
                if self.history_counts is not None:
                    counts.append(self.history_counts.stream_counts(
                        name, seq[self.schema.stream(name).event_column].values(), age, flags,
                        lengths))
        if counts:
            tokens.append(self.history_counts(counts).unsqueeze(1))
        if self.token_streams:
            tokens.append(self.target_tokens(batch))
        if self.embedding_proj is not None:
            tokens += embedding_tokens(self.embedding_proj, self.schema, batch.embeddings)
        tokens += pools
        return self.x0(tokens), seqs

    def target_tokens(self, batch: Batch) -> torch.Tensor:
        """[B, S_t, D]: per stream with matched columns (``token_streams``), the sum of its
        matched tables' rows at the candidate's ids, the candidate in the stream's event space.

        Why (``model.target_tokens``, a choice; the public record is silent): the towers' pooling
        queries and CLS tokens come from X_0, where the ad is its ``ad_id`` row, learned apart
        from the ads stream's item table; this token puts the candidate in the table its events
        are embedded with (DIN's query, item-level target attention), so an event and the
        candidate can be compared directly. Looked up through the stream's own (possibly
        sharded) collection: one event per row, the candidate's id, under every matched key.
        """
        B, seq, cand = batch.batch_size, batch.sequences, batch.sparse.to_dict()
        matched = {col: feat for s in self.token_streams for col, feat, _ in self.match_pairs[s]}
        values, lengths = [], []
        for k in seq.keys():  # noqa: SIM118 (a KJT, not a dict)
            on = k in matched
            if on:
                values.append(cand[matched[k]].values())
            lengths.append(torch.full((B,), int(on), dtype=torch.int32,
                                      device=seq.values().device))
        kjt = KeyedJaggedTensor(keys=seq.keys(), values=torch.cat(values),
                                lengths=torch.cat(lengths))
        emb = self.sparse_arch.lookup_sequence_ids(kjt)
        return torch.stack([sum(emb[col].values() for col, _, _ in self.match_pairs[s])
                            for s in self.token_streams], dim=1)

    def x0(self, tokens: list[torch.Tensor]) -> torch.Tensor:
        """X_0 [B, n_x, D] from its token groups, through ``input_norm`` (serving builds it
        here too)."""
        x_BND = torch.cat(tokens, dim=1)
        return self.input_norm(x_BND) if self.input_norm is not None else x_BND

    def _match_flags(self, batch: Batch, stream: str, lengths: torch.Tensor) -> torch.Tensor:
        return match_flags(self.match_pairs[stream], batch, lengths)

    def _features(self, x_BND: torch.Tensor,
                  seqs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        x_sum, s_sum, _ = self.interformer(x_BND, seqs)
        parts = [x_sum.flatten(1)] + ([s_sum.flatten(1)] if s_sum is not None else [])
        return torch.cat(parts, dim=1)

    def features(self, batch: Batch) -> torch.Tensor:
        """[B, feature_dim]: the representation the heads read (used for
        representation transfer)."""
        return self._features(*self.inputs(batch))

    def low_order(self, x_BND: torch.Tensor) -> torch.Tensor | None:
        """[B, T] logits of the low-order shortcut from X_0 (None without one)."""
        return self.shortcut(x_BND) if self.shortcut is not None else None

    def forward(self, batch: Batch) -> torch.Tensor:
        """logits [B, T] in schema task order."""
        x, seqs = self.inputs(batch)
        return self.heads(self._features(x, seqs), batch.domain, self.low_order(x))
