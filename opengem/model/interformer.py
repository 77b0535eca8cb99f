"""InterFormer interleaving of the non-sequence (Wukong) and sequence (pyramid towers) sides.

Legend: B rows, n_l non-sequence tokens at layer l, C = ``num_sum`` summary tokens, D dim,
P = CLS + PMA + recent summary tokens per stream, E = P × number of streams.

Per layer l (InterFormer, App. A.1)::

    Cross arch:   X_sum = Gate(LCE(X_l))                        [B, C, D]
                  S_sum = Gate([S_CLS | PMA(S_l) | S_recent])   [B, P, D] per stream
    Interaction:  X_{l+1} = Wukong_l([X_l | S_sum of all streams])      (bidirectional flow:
    Sequence:     S_{l+1} = Tower_l(S_l, X_sum)   per stream             sequence → X and X → S)

After the last layer one more cross arch summarises both sides for the heads.
Gating is X ⊙ σ(W X) per token (the common self-gating; the paper's LaTeX reads σ(X ⊙ MLP(X)) —
``gate="sigmoid_of_product"`` selects that reading).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from opengem.model.interaction_arch import InteractionArch, TokenLinear, WukongConfig
from opengem.model.sequence_arch import SequenceConfig, SequenceTower


@dataclass
class InterFormerConfig:
    num_sum: int = 4  # C: non-sequence summary tokens (= CLS tokens of each tower)
    num_pma: int = 2
    num_recent: int = 2
    gate: str = "self"  # self: X⊙σ(WX) | sigmoid_of_product: σ(X⊙WX)
    # Ablations (benchmarks/quality.py). wukong=False: the non-sequence tokens skip the Wukong
    # layers (X_l = X_0). interleave=False: no exchange between the sides — Wukong gets no S_sum and
    # the towers get zeros for X_sum (CLS, PFFN, pooling queries); the heads still read
    # both summaries.
    wukong: bool = True
    interleave: bool = True
    # False: the towers keep their first tokens ([CLS | pooled | recent], S_1) through every layer,
    # no self-attention layers; the summaries and the exchange with Wukong are unchanged. Why an
    # option: the tower layers are the largest part of a CPU step at the demo's sizes
    # (benchmarks/step_profile.py), so a pooled-only sequence side is the cheap form to weigh
    # against them at equal wall time (benchmarks/cheap_forms.py).
    tower_layers: bool = True

    def validate(self) -> None:
        if self.gate not in ("self", "sigmoid_of_product"):
            raise ValueError(f"model.interformer.gate must be self|sigmoid_of_product, "
                             f"got {self.gate!r}")
        if self.num_sum < 1 or self.num_pma < 0 or self.num_recent < 0:
            raise ValueError("model.interformer.num_sum must be >= 1, num_pma/num_recent >= 0")

    @property
    def tokens_per_stream(self) -> int:
        return self.num_sum + self.num_pma + self.num_recent


class Gate(nn.Module):
    def __init__(self, dim: int, mode: str):
        super().__init__()
        self.proj, self.mode = nn.Linear(dim, dim), mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "self":
            return x * torch.sigmoid(self.proj(x))
        return torch.sigmoid(x * self.proj(x))


class SequenceSummary(nn.Module):
    """S_sum = Gate([CLS | PMA | recent]) for one stream."""

    def __init__(self, dim: int, heads: int, cfg: InterFormerConfig):
        super().__init__()
        self.cfg, self.heads = cfg, heads
        if cfg.num_pma:
            self.q = nn.Parameter(torch.empty(cfg.num_pma, dim))
            self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.gate = Gate(dim, cfg.gate)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.cfg.num_pma:
            nn.init.normal_(self.q, std=self.q.shape[-1] ** -0.5)

    def forward(self, s_BSD: torch.Tensor, valid_BS: torch.Tensor) -> torch.Tensor:
        parts = [s_BSD[:, : self.cfg.num_sum]]
        if self.cfg.num_pma:
            parts.append(self.pma(s_BSD, valid_BS))
        if self.cfg.num_recent:
            r = s_BSD[:, -self.cfg.num_recent :] * valid_BS[:, -self.cfg.num_recent :,
                                                            None].to(s_BSD.dtype)
            parts.append(r)
        return self.gate(torch.cat(parts, dim=1))

    def pma(self, s_BSD: torch.Tensor, valid_BS: torch.Tensor) -> torch.Tensor:
        """``self.attn(Q, S, S, key_padding_mask=~valid)`` with the same weights, computed directly:
        the learnable queries are projected once (not B times), and SDPA replaces
        ``nn.MultiheadAttention``'s general path: faster forward + backward on CPU, same values
        (docs/experiments.md, 'Figures moved from code docstrings')."""
        B, S, D = s_BSD.shape
        H, P = self.heads, self.q.shape[0]
        w, b = self.attn.in_proj_weight, self.attn.in_proj_bias
        q = F.linear(self.q, w[:D], b[:D]).view(1, P, H,
                                                D // H).transpose(1, 2).expand(B, H, P, D // H)
        k, v = F.linear(s_BSD, w[D:], b[D:]).view(B, S, 2, H, D // H).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=valid_BS[:, None, None, :])
        return self.attn.out_proj(o.transpose(1, 2).reshape(B, P, D))


class CrossArch(nn.Module):
    """One layer's summaries of both sides."""

    def __init__(self, n_x: int, dim: int, num_streams: int, heads: int, cfg: InterFormerConfig):
        super().__init__()
        self.lce = TokenLinear(n_x, cfg.num_sum)
        self.x_gate = Gate(dim, cfg.gate)
        self.seq = nn.ModuleList(SequenceSummary(dim, heads, cfg) for _ in range(num_streams))

    def summarize_x(self, x_BND: torch.Tensor) -> torch.Tensor:
        return self.x_gate(self.lce(x_BND))

    def summarize_s(self, streams: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        if not streams:
            return None
        return torch.cat([m(s, v) for m, (s, v) in zip(self.seq, streams)], dim=1)


class InterFormer(nn.Module):
    """Interleaves an ``InteractionArch`` (Wukong) with one ``SequenceTower`` per stream.

    Args:
        n_x: non-sequence tokens entering layer 0.  dim: D.  num_streams: parallel towers.
        wukong, sequence, cfg: the three configs; the layer count is ``wukong.num_layers``.
    Inputs to ``forward``: x [B, n_x, D]; per stream (tokens [N, D] jagged, lengths [B]).
    Output: (X_sum [B, C, D], S_sum [B, E, D] or None, X_L [B, n_F+n_L, D]).
    """

    def __init__(self, n_x: int, dim: int, num_streams: int, wukong: WukongConfig,
                 sequence: SequenceConfig, cfg: InterFormerConfig):
        super().__init__()
        self.cfg, self.num_layers, self.num_streams = cfg, wukong.num_layers, num_streams
        n_extra = num_streams * cfg.tokens_per_stream if cfg.interleave else 0
        self.interaction = InteractionArch(n_x, n_extra, dim,
                                           wukong if cfg.wukong else replace(wukong, num_layers=0))
        self.towers = nn.ModuleList(SequenceTower(cfg.num_sum, dim,
                                                  wukong.num_layers if cfg.tower_layers else 0,
                                                  sequence)
                                    for _ in range(num_streams))
        tokens = [n_x] + [wukong.num_out if cfg.wukong else n_x] * wukong.num_layers
        self.cross = nn.ModuleList(CrossArch(tokens[i], dim, num_streams, sequence.num_heads, cfg)
                                   for i in range(wukong.num_layers + 1))

    def forward(self, x_BND: torch.Tensor, seqs: list[tuple[torch.Tensor, torch.Tensor]]):
        x_sum = self.cross[0].summarize_x(x_BND)
        states = [tw.first_tokens(tok, lengths, self.tower_context(x_sum))
                  for tw, (tok, lengths) in zip(self.towers, seqs)]
        return self.run_layers(x_BND, states, x_sum)

    def tower_context(self, x_sum: torch.Tensor) -> torch.Tensor:
        """What the towers read as X_sum (CLS tokens, PFFN, pooling queries): zeros
        without interleaving."""
        return x_sum if self.cfg.interleave else torch.zeros_like(x_sum)

    def run_layers(self, x_BND: torch.Tensor, states: list[tuple[torch.Tensor, torch.Tensor]],
                   x_sum: torch.Tensor | None = None):
        """The interleaved layers from the towers' first tokens ``states`` (per stream: tokens,
        valid) on; ``x_sum`` = layer 0's X_sum when already computed. Returns what
        ``forward`` returns."""
        history: list[torch.Tensor] = []
        for i in range(self.num_layers):
            if i or x_sum is None:
                x_sum = self.cross[i].summarize_x(x_BND)
            x_next = x_BND
            if self.cfg.wukong:
                s_sum = self.cross[i].summarize_s(states) if self.cfg.interleave else None
                x_next = self.interaction.forward_layer(i, x_BND, s_sum, history)
            if self.cfg.tower_layers:
                states = [tw.layer(i, s, v, self.tower_context(x_sum)) for tw,
                          (s, v) in zip(self.towers, states)]
            history.append(x_BND)
            x_BND = x_next
        if self.cfg.wukong:
            x_BND = self.interaction.finish(x_BND, history)
        last = self.cross[self.num_layers]
        return last.summarize_x(x_BND), last.summarize_s(states), x_BND
