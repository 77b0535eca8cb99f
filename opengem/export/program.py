"""The serving program: a trained model as one function of plain tensors, for ``torch.export``.

Legend: U requests (users) in a micro-batch, C candidates over all of them, Cm most candidates of
one request, N events of one stream over the U users (+ 1 sentinel), L longest history in the
micro-batch, K recent window, n sparse features, F dense features, D dim, M pooled tokens,
H heads, Dh = D / H, T tasks.

Why not export ``GEM.forward(batch)`` itself: a ``Batch`` of KeyedJaggedTensors splits values by
``length_per_key()`` (a host sync) and ``recent_window`` sizes a tensor by ``lengths.max()``, so
the trace is full of data-dependent shapes; and scoring C candidates of one user through it
repeats the user's history C times. ``ServingGEM`` holds the *same* parameters and modules as the
trained GEM and reorganises only the parts that touch the history, so each user's history is
embedded, normalised and projected to keys/values once (M-FALCON's idea), while the work that
depends on the candidate stays per candidate: GEM's towers are target-aware (CLS tokens and
pooling queries come from X_sum, which contains the ad), so pooling scores, tower layers and
the interaction stack are O(C). Every shape that depends on the data comes in as an input
(layout tensors built by the predictor), so the exported graph has none of its own.

Inputs, one dict (``input_spec`` lists it; the predictor fills it, see ``opengem.export.layout``)::

    sparse.<f>.values  [V_f]  int64   ids after OOV mapping; offsets [R_f + 1], R_f = U (user/context) or C (ad)
    dense              [C, F] float32 raw values (user/context values repeated per candidate)
    embeddings         [C, E] float32 the schema's embedding features side by side (only if it has any)
    domain, cand_user  [C]    int64   domain of each candidate's request; its request index in [0, U)
    cand_pad           [U, Cm] int64  candidate indices of each request, padded (pads repeat a real one)
    cand_pos           [C]    int64   where each candidate sits in the flattened [U·Cm] padding
    seq.<s>.<col>      [N]    int64   item / event / attribute ids of every event, users concatenated;
                                      the last entry is a sentinel event that padding points at
    seq.<s>.age        [N]    float32 request time − event time, seconds
    seq_values.<s>     [N, V] float32 per-event values of a stream that has any (sentinel row 0)
    seq.<s>.pool_idx, pool_valid      [U, L]  each user's events (padding → sentinel, invalid)
    seq.<s>.recent_idx, recent_valid  [U, K]  each user's newest K events, right-aligned

Output: probabilities [C, T] float32 in schema task order.
"""

from __future__ import annotations

import torch
from torch import nn

from opengem.export.tables import packed_tables, without_tables
from opengem.model.foundation import GEM, embedding_tokens
from opengem.model.student import Student


class ServingGEM(nn.Module):
    """GEM's forward over the serving layout. Shares (does not copy) the trained model's modules.

    Target match (``GEM.match_pairs``) makes an event's token depend on the candidate through A
    binary flags (event attribute == candidate id), so each event has 2^A possible tokens: all of
    them are computed once per event, and each candidate selects its own per event (A = 1 in the
    synthetic world: 2 tokens per event instead of C).

    Args:
        gem: a trained ``GEM`` in eval mode.
        tables: table name → ``PackedTable`` (fp32 or compressed rows, see ``opengem.export.tables``)
            to look up instead of ``gem``'s TorchRec tables; None: ``gem``'s own tables.
    """

    def __init__(self, gem: GEM, tables: nn.ModuleDict | None = None):
        super().__init__()
        self.gem = gem
        self.tables = tables
        self.schema, self.cfg = gem.schema, gem.cfg
        self.rows = gem.sparse_arch.rows
        self.capped = bool(gem.cfg.sparse.max_rows_per_table)
        self.match_pairs = {k: v for k, v in getattr(gem, "match_pairs", {}).items() if v}
        self.groups = {f.name: f.group for f in self.schema.sparse}

    def _ids(self, x: torch.Tensor, column: str) -> torch.Tensor:
        return x % self.rows[column] if self.capped else x  # SparseArch._hash, per feature

    def _bag(self, name: str, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        if self.tables is not None:
            return self.tables[name].bag(values, offsets)
        return self.gem.sparse_arch.ebc.embedding_bags[name](input=values, offsets=offsets).float()

    def _rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        if self.tables is not None:
            return self.tables[name](ids)
        return self.gem.sparse_arch.ec.embeddings[name](ids).float()

    def _cand_ids(self, x: dict[str, torch.Tensor], feature: str) -> torch.Tensor:
        """[C] the (single-valued) id of ``feature`` for each candidate."""
        v = x[f"sparse.{feature}.values"]
        return v if self.groups[feature] == "ad" else v[x["cand_user"]]

    def sparse_tokens(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        """[C, n, D]: user/context features looked up once per request, then gathered
        per candidate."""
        cand_user = x["cand_user"]
        toks = []
        for f in self.schema.sparse:
            e = self._bag(f"t_{f.name}", self._ids(x[f"sparse.{f.name}.values"], f.name),
                          x[f"sparse.{f.name}.offsets"])
            toks.append(e if f.group == "ad" else e[cand_user])
        return torch.stack(toks, dim=1)

    def event_values(self, x: dict[str, torch.Tensor], stream) -> torch.Tensor:
        """[N, D] each event's tables (+ per-event values), as ``SparseArch.forward_sequences``
        (and ``GEM.inputs``) sum them, once per event."""
        cols = [stream.item_column, stream.event_column] + [stream.attribute_column(a)
                                                            for a in stream.attributes]
        names = [f"t_{stream.name}_item", f"t_{stream.name}_event"] + [f"t_{stream.name}_{a.name}"
                                                                      for a in stream.attributes]
        values = None
        for col, name in zip(cols, names):
            e = self._rows(name, self._ids(x[f"seq.{col}"], col))
            # the order SparseArch.forward_sequences sums in
            values = e if values is None else values + e
        ev = getattr(self.gem, "event_values", None)
        if ev is not None and stream.name in ev.proj:  # then the values, as GEM.inputs adds them
            values = values + ev(stream.name, x[f"seq_values.{stream.name}"])
        return values

    def history_tokens(self, x: dict[str, torch.Tensor], tower: nn.Module, stream,
                       values: torch.Tensor) -> list[torch.Tensor]:
        """[N, D] per target-match combination: ``event_values`` + match vector + time
        embedding, once per event."""
        age = x[f"seq.{stream.name}.age"]
        A = len(self.match_pairs.get(stream.name, ()))
        if not A:
            return [tower.embed(values, age)]
        match = self.gem.target_match[stream.name]
        combos = [[float((k >> a) & 1) for a in range(A)] for k in range(2**A)]
        return [tower.embed(values
                            + match(torch.tensor([c], dtype=values.dtype, device=values.device)),
                            age)
                for c in combos]

    def _combo(self, x: dict[str, torch.Tensor], stream: str, events: torch.Tensor,
               cand_ids: list[torch.Tensor]) -> torch.Tensor | None:
        """Which target-match combination each (candidate, event) pair takes; shapes broadcast."""
        g = None
        for a, (col, _, oov) in enumerate(self.match_pairs.get(stream, ())):
            ev = x[f"seq.{col}"][events]
            # OOV never matches (GEM._match_flags)
            flag = ((ev == cand_ids[a]) & (ev != oov)).long() << a
            g = flag if g is None else g + flag
        return g

    def history_counts(self, x: dict[str, torch.Tensor], stream: str) -> torch.Tensor:
        """[C, (1 + A)·E·K (×2 with recency)]: ``HistoryCounts.stream_counts`` per candidate; the
        decayed weights are summed once per user, only the target-matched sums are per candidate."""
        hc, cand_user = self.gem.history_counts, x["cand_user"]
        w_NE = hc.event_weights(stream, x[f"seq.{stream}.event"], x[f"seq.{stream}.age"])
        idx_UL, valid_UL = x[f"seq.{stream}.pool_idx"], x[f"seq.{stream}.pool_valid"]
        w_ULE = w_NE[idx_UL] * valid_UL.unsqueeze(-1).to(w_NE.dtype)
        # padding weighs 0: amax is safe
        out, newest = [w_ULE.sum(1)[cand_user]], [w_ULE.amax(1)[cand_user]]
        w_CLE = w_ULE[cand_user]
        for (col, feat, oov) in self.match_pairs.get(stream, ()):
            ev_CL = x[f"seq.{col}"][idx_UL][cand_user]
            flag_CL = ((ev_CL == self._cand_ids(x, feat)[:, None]) & (ev_CL != oov)).to(w_NE.dtype)
            out.append(torch.einsum("cl,cle->ce", flag_CL, w_CLE))
            newest.append((flag_CL[:, :, None] * w_CLE).amax(1))
        return torch.cat(out + newest if hc.recency else out, dim=1)

    def decay_pool(self, x: dict[str, torch.Tensor], i: int, stream: str,
                   values_ND: torch.Tensor) -> torch.Tensor:
        """[C, K, D]: ``DecayPool.stream_tokens`` of stream ``i``, pooled once per user (it does not
        read the candidate) and given to each of the user's candidates."""
        w_NK = self.gem.decay_pool.weights(i, x[f"seq.{stream}.age"])
        idx_UL, valid_UL = x[f"seq.{stream}.pool_idx"], x[f"seq.{stream}.pool_valid"]
        w_ULK = w_NK[idx_UL] * valid_UL.unsqueeze(-1).to(w_NK.dtype)
        num_UKD = torch.einsum("ulk,uld->ukd", w_ULK, values_ND[idx_UL])
        return (num_UKD / (1.0 + w_ULK.sum(1))[:, :, None])[x["cand_user"]]

    def target_tokens(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        """[C, S_t, D]: ``GEM.target_tokens``, each candidate's ids in its streams' tables."""
        out = []
        for s in self.gem.token_streams:
            out.append(sum(self._rows(f"t_{s}_{col.split('.', 1)[1]}",
                                      self._ids(self._cand_ids(x, feat), col))
                           for col, feat, _ in self.match_pairs[s]))
        return torch.stack(out, dim=1)

    def first_tokens(self, x: dict[str, torch.Tensor], tower: nn.Module, name: str,
                     toks: list[torch.Tensor],
                     x_sum_CSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``SequenceTower.first_tokens`` with each user's keys, values and recent window
        computed once."""
        C, cand_user = x_sum_CSD.shape[0], x["cand_user"]
        ids = [self._cand_ids(x, feat) for _, feat, _ in self.match_pairs.get(name, ())]
        parts = [x_sum_CSD]
        valid = [torch.ones(C, tower.n_sum, dtype=torch.bool, device=x_sum_CSD.device)]
        M = tower.cfg.num_pooled
        if M:
            q_CMD = tower.pool_q + tower.pool_cond(x_sum_CSD.flatten(1)).view(C, M, tower.dim)
            kv = [tower.pool_kv(t).chunk(2, dim=-1) for t in toks]
            pool_idx, pad = x[f"seq.{name}.pool_idx"], x["cand_pad"]
            # [U, Cm, L]
            combo = self._combo(x, name, pool_idx[:, None, :], [i[pad][:, :, None] for i in ids])
            pooled = padded_pool(q_CMD, kv, combo, pool_idx, x[f"seq.{name}.pool_valid"], pad,
                                 x["cand_pos"], tower.sink_logit, tower.sink_value)
            parts.append(tower.pool_out(pooled))
            valid.append(torch.ones(C, M, dtype=torch.bool, device=x_sum_CSD.device))
        ridx_CK = x[f"seq.{name}.recent_idx"][cand_user]
        rvalid_CK = x[f"seq.{name}.recent_valid"][cand_user]
        recent = toks[0][ridx_CK]
        combo = self._combo(x, name, ridx_CK, [i[:, None] for i in ids])  # [C, K]
        for k in range(1, len(toks)):
            recent = torch.where((combo == k).unsqueeze(-1), toks[k][ridx_CK], recent)
        recent = recent * rvalid_CK.unsqueeze(-1).to(recent.dtype)
        parts.append(tower.add_position(recent))
        valid.append(rvalid_CK)
        return torch.cat(parts, dim=1), torch.cat(valid, dim=1)

    def inputs(self, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor,
                                                          list[tuple[torch.Tensor, torch.Tensor]]]:
        """X_0 [C, n_x, D] as ``GEM.inputs`` builds it, and each stream's first tower tokens."""
        gem = self.gem
        dense, domain = x["dense"], x["domain"]
        C = domain.shape[0]
        tokens = [self.sparse_tokens(x)]
        if gem.dense_arch is not None:
            tokens.append(gem.dense_arch(gem.dense_norm(dense)).view(C, self.cfg.dense_tokens, -1))
        tokens.append(gem.domain_emb(domain).unsqueeze(1))
        if gem.history_counts is not None:
            tokens.append(gem.history_counts([self.history_counts(x, s)
                                              for s in gem.streams]).unsqueeze(1))
        if getattr(gem, "token_streams", None):
            tokens.append(self.target_tokens(x))
        if gem.embedding_proj is not None:
            tokens += embedding_tokens(gem.embedding_proj, self.schema, x["embeddings"])
        streams = [self.schema.stream(s) for s in gem.streams]
        values = [self.event_values(x, s) for s in streams]
        if getattr(gem, "decay_pool", None) is not None:
            tokens += [self.decay_pool(x, i, s.name, v) for i, (s, v) in enumerate(zip(streams,
                                                                                     values))]
        x_BND = gem.x0(tokens)
        x_sum = gem.interformer.cross[0].summarize_x(x_BND)
        states = []
        for tower, stream, v in zip(gem.interformer.towers, streams, values):
            toks = self.history_tokens(x, tower, stream, v)
            states.append(self.first_tokens(x, tower, stream.name, toks,
                                            gem.interformer.tower_context(x_sum)))
        return x_BND, states

    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        inter = self.gem.interformer
        x_BND, states = self.inputs(x)
        shortcut = self.gem.low_order(x_BND)
        # InterFormer's own layers after the first tokens
        x_sum, s_sum, _ = inter.run_layers(x_BND, states)
        feats = torch.cat([x_sum.flatten(1)] + ([s_sum.flatten(1)] if s_sum is not None else []),
                          dim=1)
        logits = self.gem.heads(feats, x["domain"], shortcut)
        return torch.sigmoid(logits)


def padded_pool(q_CMD: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]],
                combo_UCL: torch.Tensor | None,
                pool_idx_UL: torch.Tensor, pool_valid_UL: torch.Tensor, cand_pad_UC: torch.Tensor,
                cand_pos_C: torch.Tensor, sink_logit_MH: torch.Tensor,
                sink_value_MD: torch.Tensor) -> torch.Tensor:
    """``ops.jagged.pool_attention`` (with sink) where the candidates of a user share that
    user's events.

    ``kv``: per target-match combination, keys and values [N, D] of every event; ``combo_UCL`` says
    which one candidate c uses for event l (None: a single combination). Candidates are grouped
    per user and padded, so scores are batched matmuls [U·H, Cm·M, Dh] × [U·H, Dh, L].
    Returns [C, M, D].
    """
    _, M, D = q_CMD.shape
    H = sink_logit_MH.shape[1]
    Dh = D // H
    U, L = pool_idx_UL.shape
    Cm = cand_pad_UC.shape[1]
    q = q_CMD[cand_pad_UC].view(U, Cm * M, H, Dh).transpose(1, 2)  # [U, H, Cm·M, Dh]
    scores, values = [], []
    for k_ND, v_ND in kv:
        k = k_ND[pool_idx_UL].view(U, L, H, Dh).permute(0, 2, 3, 1)  # [U, H, Dh, L]
        values.append(v_ND[pool_idx_UL].view(U, L, H, Dh).transpose(1, 2))  # [U, H, L, Dh]
        scores.append((torch.matmul(q, k) * Dh**-0.5).view(U, H, Cm, M, L))
    sel = [None] if combo_UCL is None else [(combo_UCL == j)[:, None, :, None, :]
                                            for j in range(len(kv))]
    s = scores[0]
    for j in range(1, len(kv)):
        s = torch.where(sel[j], scores[j], s)
    s = s.masked_fill(~pool_valid_UL[:, None, None, None, :], float("-inf"))
    sink = sink_logit_MH.t().reshape(1, H, 1, M, 1).expand(U, H, Cm, M, 1)
    a = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)
    w = a[..., :L]
    out = None
    for j, v in enumerate(values):
        wj = w if len(values) == 1 else w * sel[j].to(w.dtype)
        o = torch.matmul(wj.reshape(U, H, Cm * M, L), v)  # [U, H, Cm·M, Dh]
        out = o if out is None else out + o
    sink_v = sink_value_MD.view(M, H, Dh).transpose(0, 1).reshape(1, H, 1, M, Dh)
    out = out.view(U, H, Cm, M, Dh) + a[..., L:] * sink_v
    return out.permute(0, 2, 3, 1, 4).reshape(U * Cm, M, D)[cand_pos_C]


def serving_module(model: nn.Module) -> nn.Module:
    """The plain-tensor module to export for a trained model.

    GEM has its adapter here, over ``PackedTable``s of its tables (a GEM whose tables
    ``quantize_tables`` swapped for ``torchrec.quant`` ones serves their compressed rows, see
    ``opengem.export.tables``), on a copy of GEM without its TorchRec tables (so the program holds
    each row once). A ``Student`` serves its backbone (the aux head is training-only), reading the
    backbone's own tables. Any other model exports by defining ``serving_module()`` that returns a
    module taking the same input dict (see the module docstring).
    """
    if isinstance(model, GEM):
        return ServingGEM(without_tables(model), packed_tables(model.sparse_arch)).eval()
    if isinstance(model, Student):
        return ServingGEM(model.backbone).eval()
    if hasattr(model, "serving_module"):
        return model.serving_module().eval()
    raise TypeError(f"{type(model).__name__} has no serving adapter: define serving_module() on it "
                    "(a module over opengem.export.program's input dict)")
