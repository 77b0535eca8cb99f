"""SequenceArch: one pyramid tower per behaviour stream, run in parallel.

Legend: B rows, N events of the stream in the batch (jagged), D dim, H heads, M pooled tokens,
C CLS tokens (= the non-sequence summary X_sum), K_l recent tokens kept at layer l,
S_l = C + M + K_l tokens a tower attends over at layer l.

How one tower sees a row (lengths [2, 0, 3], K = 2, M = 1, C = 1)::

    events (jagged)   [e00 e01 | . | e20 e21 e22]        each = item + event type + time-bucket emb
    pooled (M)        PMA over *all* of a row's events plus a learnable "nothing" slot, queries
                      keyed by X_sum (target-aware), O(N·M·D) — where a 2,000-event tail is summarised
    recent (K)        [e00 e01] [pad pad] [e21 e22]      right-aligned, masked
    layer-1 tokens    [CLS | pooled | recent]            S_1 = C + M + K

Each layer: S ← S + PFFN(X_sum, LN S); S ← S + MHA(LN S, key-padding mask); S ← S + FFN(LN S);
then the pyramid drops the oldest half of the recent tokens (never below ``min_recent``), so the
cost per layer is O(B·S_l²·D) with S_l shrinking, and nothing ever costs B × max_len².

Choices where the public record is silent, all config options:
- "pyramid-parallel" = parallel per-stream towers whose recent window halves per layer, with the
  long history pooled by learnable queries once at the bottom (``pyramid``: halve | none).
- Attention is standard softmax MHA, bidirectional (the history is all in the past of the request).
- PFFN (``pffn``): ``paper`` (default) follows InterFormer's appendix, W_PFFN = X_sum W ∈ ℝ^{D×D}
  with X_sum ∈ ℝ^{D×C}, applied as W_PFFN s to every token s; ``transposed`` is the map s ↦ W_PFFNᵀ
  s that earlier versions computed. Same parameters, a different function; measured
  in docs/experiments.md.
- Time: log-spaced buckets of (request time − event time), embedded and added to each event.
- Position (``position``): InterFormer applies RoPE to the sequence tokens. ``learned`` (default): a
  learned vector per recent position, added once to the first tokens; ``rope``: rotary embeddings of
  each recent token's distance from the newest event on the queries and keys of every layer (summary
  tokens sit at position 0, i.e. are not rotated). Both are measured in docs/experiments.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from opengem.ops.jagged import IMPLS, pool_attention, recent_window


@dataclass
class SequenceConfig:
    num_heads: int = 2
    recent_len: int = 64
    min_recent: int = 8
    pyramid: str = "halve"  # halve | none
    num_pooled: int = 4
    time_buckets: int = 64
    ffn_mult: int = 2
    dropout: float = 0.0
    # reference | triton: pooled attention kernel (opengem.ops.triton_jagged; CUDA)
    attention_impl: str = "reference"
    # paper: token s ↦ W_PFFN s (InterFormer App. A) | transposed: s ↦ W_PFFNᵀ s
    pffn: str = "paper"
    # learned: added position vectors | rope: rotary q/k (module docstring)
    position: str = "learned"

    def validate(self, dim: int) -> None:
        if self.attention_impl not in IMPLS:
            raise ValueError(f"model.sequence.attention_impl must be one of {IMPLS}, "
                             f"got {self.attention_impl!r}")
        if dim % self.num_heads:
            raise ValueError(f"model.embedding_dim {dim} is not divisible by "
                             f"model.sequence.num_heads {self.num_heads}")
        if self.pyramid not in ("halve", "none"):
            raise ValueError(f"model.sequence.pyramid must be halve|none, got {self.pyramid!r}")
        if self.pffn not in ("paper", "transposed"):
            raise ValueError(f"model.sequence.pffn must be paper|transposed, got {self.pffn!r}")
        if self.position not in ("learned", "rope"):
            raise ValueError(f"model.sequence.position must be learned|rope, got {self.position!r}")
        if self.position == "rope" and (dim // self.num_heads) % 2:
            raise ValueError(f"model.sequence.position=rope needs an even head dim, got "
                             f"{dim} / {self.num_heads} heads = {dim // self.num_heads}")
        if self.recent_len < 1 or self.num_pooled < 0 or self.min_recent < 1:
            raise ValueError("model.sequence.recent_len/min_recent must be >= 1 and num_pooled "
                             ">= 0")

    def recent_at(self, layer: int) -> int:
        """K_l: recent tokens attended at ``layer`` (0-based)."""
        if self.pyramid == "none":
            return self.recent_len
        return max(min(self.min_recent, self.recent_len), self.recent_len >> layer)


def time_bucket(age_s: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Log-spaced buckets of an event's age: 4 per e-fold of minutes, clamped."""
    b = torch.log1p(age_s.clamp(min=0) / 60.0) * 4.0
    return b.long().clamp(0, num_buckets - 1)


class PersonalizedFFN(nn.Module):
    """InterFormer PFFN: a per-row D×D map M_b[d, e] = Σ_c X_sum[b, c, d] W[c, e] (the paper's
    W_PFFN = X_sum W with X_sum stored as rows here). ``paper``: token t ↦ M_b t; ``transposed``: t
    ↦ M_bᵀ t."""

    def __init__(self, n_sum: int, dim: int, orientation: str = "paper"):
        super().__init__()
        self.w = nn.Parameter(torch.empty(n_sum, dim))
        self.transposed = orientation == "transposed"
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w, std=self.w.numel() ** -0.5)

    def forward(self, x_sum_BCD: torch.Tensor, s_BSD: torch.Tensor) -> torch.Tensor:
        w_BDD = torch.einsum("bnd,ne->bde", x_sum_BCD, self.w)
        return torch.bmm(s_BSD, w_BDD if self.transposed else w_BDD.transpose(1, 2))


def rope_positions(n_sum: int, num_pooled: int, num_recent: int,
                   device: torch.device) -> torch.Tensor:
    """[S] position of each token of [CLS | pooled | recent]: summaries 0, recent = distance from
    the newest.

    The recent tokens are right-aligned (newest last), so a pyramid drop of the oldest keeps each
    survivor's position."""
    head = torch.zeros(n_sum + num_pooled, device=device)
    return torch.cat([head, torch.arange(num_recent - 1, -1, -1, device=device, dtype=head.dtype)])


def apply_rope(x_BHSd: torch.Tensor, pos_S: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding (Su et al. 2021, half-split form) of queries or keys [B, H, S, d] at
    positions [S]."""
    d = x_BHSd.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, device=x_BHSd.device, dtype=torch.float32) / d)
    ang = pos_S.float()[:, None] * inv[None, :]  # [S, d/2]
    cos, sin = ang.cos().to(x_BHSd.dtype), ang.sin().to(x_BHSd.dtype)
    x1, x2 = x_BHSd[..., : d // 2], x_BHSd[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class SequenceLayer(nn.Module):
    def __init__(self, n_sum: int, dim: int, cfg: SequenceConfig):
        super().__init__()
        self.heads, self.dropout = cfg.num_heads, cfg.dropout
        self.rope = cfg.position == "rope"
        self.n_head_tokens = n_sum + cfg.num_pooled
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.pffn = PersonalizedFFN(n_sum, dim, cfg.pffn)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.ffn = nn.Sequential(nn.Linear(dim, cfg.ffn_mult * dim), nn.SiLU(),
                                 nn.Linear(cfg.ffn_mult * dim, dim))

    def forward(self, s_BSD: torch.Tensor, valid_BS: torch.Tensor,
                x_sum_BCD: torch.Tensor) -> torch.Tensor:
        B, S, D = s_BSD.shape
        s = s_BSD + self.pffn(x_sum_BCD, self.norm1(s_BSD))
        q, k, v = self.qkv(self.norm2(s)).view(B, S, 3, self.heads,
                                               D // self.heads).permute(2, 0, 3, 1, 4)
        if self.rope:
            pos = rope_positions(self.n_head_tokens, 0, S - self.n_head_tokens, s.device)
            q, k = apply_rope(q, pos), apply_rope(k, pos)
        mask = valid_BS[:, None, None, :]  # key padding; every row keeps its CLS tokens valid
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                           dropout_p=self.dropout if self.training else 0.0)
        s = s + self.out(a.transpose(1, 2).reshape(B, S, D))
        return s + self.ffn(self.norm3(s))


class SequenceTower(nn.Module):
    """One stream's pyramid tower. Args: n_sum (C), dim (D), num_layers, cfg."""

    def __init__(self, n_sum: int, dim: int, num_layers: int, cfg: SequenceConfig):
        super().__init__()
        self.cfg, self.n_sum, self.dim = cfg, n_sum, dim
        self.time_emb = nn.Embedding(cfg.time_buckets, dim)
        self.in_norm = nn.LayerNorm(dim)
        # position from the newest event
        self.pos_emb = nn.Parameter(torch.zeros(cfg.recent_len, dim))
        # (with position=rope it stays zero and unused: kept so checkpoints and export have
        # one layout)
        M = cfg.num_pooled
        if M:
            self.pool_q = nn.Parameter(torch.empty(M, dim))
            self.pool_cond = nn.Linear(n_sum * dim, M * dim)
            self.pool_kv = nn.Linear(dim, 2 * dim)
            self.pool_out = nn.Linear(dim, dim)
            # "attend to nothing" slot
            self.sink_logit = nn.Parameter(torch.zeros(M, cfg.num_heads))
            self.sink_value = nn.Parameter(torch.zeros(M, dim))
        self.layers = nn.ModuleList(SequenceLayer(n_sum, dim, cfg) for _ in range(num_layers))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.pos_emb)
        if self.cfg.num_pooled:
            nn.init.normal_(self.pool_q, std=self.dim**-0.5)
            nn.init.zeros_(self.sink_logit)
            nn.init.zeros_(self.sink_value)

    def embed(self, values_ND: torch.Tensor, ages_N: torch.Tensor) -> torch.Tensor:
        return self.in_norm(values_ND + self.time_emb(time_bucket(ages_N, self.cfg.time_buckets)))

    def first_tokens(self, tok_ND: torch.Tensor, lengths: torch.Tensor,
                     x_sum_BCD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """S_1 = [CLS | pooled | recent] and its validity mask."""
        B = lengths.numel()
        parts, valid = [x_sum_BCD], [lengths.new_ones(B, self.n_sum, dtype=torch.bool)]
        if self.cfg.num_pooled:
            M, D = self.cfg.num_pooled, self.dim
            q = self.pool_q + self.pool_cond(x_sum_BCD.flatten(1)).view(B, M, D)
            k, v = self.pool_kv(tok_ND).chunk(2, dim=-1)
            pooled = pool_attention(q, k, v, lengths, self.cfg.num_heads, self.sink_logit,
                                    self.sink_value, impl=self.cfg.attention_impl)
            parts.append(self.pool_out(pooled))
            # the sink makes every row's pool defined
            valid.append(lengths.new_ones(B, M, dtype=torch.bool))
        recent, rvalid = recent_window(tok_ND, lengths, self.cfg.recent_len)
        parts.append(self.add_position(recent))
        valid.append(rvalid)
        return torch.cat(parts, dim=1), torch.cat(valid, dim=1)

    def add_position(self, recent_BKD: torch.Tensor) -> torch.Tensor:
        """The learned position vectors (newest event last); with RoPE positions enter in the
        layers instead."""
        if self.cfg.position == "rope":
            return recent_BKD
        return recent_BKD + self.pos_emb[self.pos_emb.shape[0] - recent_BKD.shape[1]:]

    def layer(self, i: int, s_BSD: torch.Tensor, valid_BS: torch.Tensor,
              x_sum_BCD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.layers[i](s_BSD, valid_BS, x_sum_BCD)
        keep = self.n_sum + self.cfg.num_pooled + self.cfg.recent_at(i + 1)
        # pyramid: drop the oldest recent tokens (they sit right after the summaries)
        if s.shape[1] > keep:
            head = self.n_sum + self.cfg.num_pooled
            drop = s.shape[1] - keep
            s = torch.cat([s[:, :head], s[:, head + drop:]], dim=1)
            valid_BS = torch.cat([valid_BS[:, :head], valid_BS[:, head + drop:]], dim=1)
        return s, valid_BS

