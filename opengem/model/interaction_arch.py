"""InteractionArch: the enhanced Wukong stack for non-sequence features (Wukong, Zhang et al. 2024).

Legend: B rows, n tokens in, n_F FM tokens out, n_L linear-compress tokens out, D dim, k FM rank.

One Wukong layer (Wukong eq. §3.2)::

    X_{i+1} = LN( concat(FMB(X_i), LCB(X_i)) + Res(X_i) )          [B, n_F + n_L, D]
    FMB(X)  = reshape(MLP(LN(flatten(X (Xᵀ Y)))))                  optimized FM, O(n·k·D)
    LCB(X)  = W_L X,  W_L ∈ ℝ^{n_L × n}
    Res     = identity if n == n_F + n_L else a linear compress on the token axis

``attentive_fm`` makes Y input-dependent: Y = Y₀ + reshape(MLP(flatten(W_c X))) (Wukong §3.3).

GEM's *cross-layer attention connections* are not specified publicly. Our
choice, a config option measured against the others (``cross_layer``):

- ``attention`` (default): before layer i, X̃_i = X_i + Σ_j α_ij P_j(X_j), where P_j compresses
  X_j's tokens to X_i's count and α_i = softmax_j(q(LN mean X_i)·k_j(LN mean P_j X_j) / √D).
- ``dense``: the same sum with uniform α (DenseNet-style, as Lattice's extended context).
- ``none``: plain Wukong.

Which layers compete (``cross_layer_span``):

- ``all`` (default): connection i (1 ≤ i ≤ L) attends over X_0 … X_i — the earlier layers *and* the
  current one — and connection L is an output connection after the last layer, so the heads read
  X̃_L. Every connection then has ≥ 2 candidates: the attention is live at 1 and 2 layers, the
  depths we ship (with only earlier layers, a softmax over the single X_0 at layer 1 is constant).
- ``earlier``: connection i (i < L) over X_0 … X_{i−1} only, no output connection: at ≤ 2 layers
  ``attention`` then equals ``dense``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class WukongConfig:
    num_layers: int = 2
    num_fm: int = 8
    num_lc: int = 8
    fm_rank: int = 8
    mlp_dims: tuple[int, ...] = (256,)
    attentive_fm: bool = False
    cross_layer: str = "attention"  # attention | dense | none
    # all: earlier + current layer, plus an output connection | earlier
    cross_layer_span: str = "all"
    # raw | unit: the FM block's Gram from tokens scaled to unit RMS (LCB, residual: raw)
    fm_input: str = "raw"
    dropout: float = 0.0

    @property
    def num_out(self) -> int:
        return self.num_fm + self.num_lc

    def validate(self) -> None:
        if self.cross_layer not in ("attention", "dense", "none"):
            raise ValueError(f"model.wukong.cross_layer must be attention|dense|none, "
                             f"got {self.cross_layer!r}")
        if self.cross_layer_span not in ("all", "earlier"):
            raise ValueError(f"model.wukong.cross_layer_span must be all|earlier, "
                             f"got {self.cross_layer_span!r}")
        if self.fm_input not in ("raw", "unit"):
            raise ValueError(f"model.wukong.fm_input must be raw|unit, got {self.fm_input!r}")
        for k in ("num_layers", "num_fm", "num_lc", "fm_rank"):
            if getattr(self, k) < 1:
                raise ValueError(f"model.wukong.{k} must be >= 1, got {getattr(self, k)}")


def unit_rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Each vector of the last axis scaled to unit RMS (a zero vector stays zero)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def mlp(dims: list[int], dropout: float = 0.0, last_act: bool = False) -> nn.Sequential:
    """Linear → SiLU stacks; no activation after the last layer unless ``last_act``."""
    layers: list[nn.Module] = []
    for i in range(len(dims) - 1):
        layers.append(nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2 or last_act:
            layers.append(nn.SiLU())
            if dropout:
                layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


class TokenLinear(nn.Module):
    """Linear map on the token axis: [B, n_in, D] → [B, n_out, D] (Wukong's linear compress)."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.weight.shape[1] ** -0.5)

    def forward(self, x_BND: torch.Tensor) -> torch.Tensor:
        return torch.einsum("on,bnd->bod", self.weight, x_BND)


class FactorizationMachineBlock(nn.Module):
    def __init__(self, n_in: int, dim: int, cfg: WukongConfig):
        super().__init__()
        self.n_in, self.dim, self.k, self.n_out = n_in, dim, cfg.fm_rank, cfg.num_fm
        self.y = nn.Parameter(torch.empty(n_in, cfg.fm_rank))
        self.unit = cfg.fm_input == "unit"
        self.attentive = cfg.attentive_fm
        if self.attentive:
            self.compress = TokenLinear(n_in, cfg.fm_rank)
            self.y_mlp = mlp([cfg.fm_rank * dim, 64, n_in * cfg.fm_rank])
        self.norm = nn.LayerNorm(n_in * cfg.fm_rank)
        self.mlp = mlp([n_in * cfg.fm_rank, *cfg.mlp_dims, cfg.num_fm * dim], cfg.dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.y, std=self.n_in ** -0.5)

    def forward(self, x_BND: torch.Tensor) -> torch.Tensor:
        B = x_BND.shape[0]
        # every field's pairs count alike, whatever its token's scale (a zero token stays zero)
        if self.unit:
            x_BND = unit_rms(x_BND)
        y = self.y.expand(B, -1, -1)
        if self.attentive:
            y = y + self.y_mlp(self.compress(x_BND).flatten(1)).view(B, self.n_in, self.k)
        fm_BNK = torch.bmm(x_BND, torch.bmm(x_BND.transpose(1, 2), y))  # X (Xᵀ Y): O(n·k·D)
        fm_BNK = fm_BNK * self.dim**-0.5
        return self.mlp(self.norm(fm_BNK.flatten(1))).view(B, self.n_out, self.dim)


class WukongLayer(nn.Module):
    def __init__(self, n_in: int, dim: int, cfg: WukongConfig):
        super().__init__()
        self.fmb = FactorizationMachineBlock(n_in, dim, cfg)
        self.lcb = TokenLinear(n_in, cfg.num_lc)
        self.residual = TokenLinear(n_in, cfg.num_out) if n_in != cfg.num_out else None
        self.norm = nn.LayerNorm(dim)

    def forward(self, x_BND: torch.Tensor) -> torch.Tensor:
        res = x_BND if self.residual is None else self.residual(x_BND)
        return self.norm(torch.cat([self.fmb(x_BND), self.lcb(x_BND)], dim=1) + res)


class CrossLayerConnection(nn.Module):
    """Mixes the candidates ``prev_tokens`` (token counts of X_0 … in order) into a layer's input
    X_i (see the module docstring). ``forward(x, candidates)`` takes the candidates' tensors in that
    order; with span ``all`` the last candidate is X_i itself."""

    def __init__(self, prev_tokens: list[int], n_cur: int, dim: int, mode: str):
        super().__init__()
        self.mode = mode
        self.proj = (
            nn.ModuleList(TokenLinear(n, n_cur) for n in prev_tokens)
            if mode != "none" and prev_tokens
            else None
        )
        # a softmax over one candidate is constant
        if mode == "attention" and len(prev_tokens) >= 2:
            self.q = nn.Linear(dim, dim, bias=False)
            self.k = nn.Linear(dim, dim, bias=False)
            # the token means are small (tokens are LayerNormed around 0): normalise them so the
            # scores start O(1) and the softmax can move off uniform in a pass
            self.norm = nn.LayerNorm(dim, elementwise_affine=False)

    def forward(self, x_BND: torch.Tensor, history: list[torch.Tensor]) -> torch.Tensor:
        if self.proj is None or not history:
            return x_BND
        cands = self.candidates(history)  # [B, J, n, D]
        if self.mode == "dense" or len(history) == 1:
            return x_BND + cands.mean(dim=1)
        alpha = self.weights(x_BND, cands)
        return x_BND + torch.einsum("bj,bjnd->bnd", alpha, cands)

    def weights(self, x_BND: torch.Tensor, cands_BJND: torch.Tensor) -> torch.Tensor:
        """α [B, J]: softmax over the candidates (read by tests and the report to show it is
        not uniform)."""
        q = self.q(self.norm(x_BND.mean(dim=1)))  # [B, D]
        k = self.k(self.norm(cands_BJND.mean(dim=2)))  # [B, J, D]
        return torch.softmax(torch.einsum("bd,bjd->bj", q, k) * q.shape[-1] ** -0.5, dim=1)

    def candidates(self, history: list[torch.Tensor]) -> torch.Tensor:
        """[B, J, n, D]: each candidate compressed to this layer's token count."""
        return torch.stack([p(h) for p, h in zip(self.proj, history)], dim=1)


class InteractionArch(nn.Module):
    """Stack of Wukong layers with cross-layer connections.

    Args:
        n_in: tokens entering layer 0 (non-sequence tokens).
        n_extra: tokens appended to every layer's input from outside (InterFormer's sequence
            summaries; 0 for a standalone Wukong).
        dim: D.  cfg: ``WukongConfig``.

    ``forward_layer(i, x, extra, history)`` runs one layer so InterFormer can interleave it with
    the sequence arch, ``finish(x, history)`` applies the output connection (span ``all``);
    ``forward(x)`` runs the whole stack standalone. ``history`` holds X_0 … X_{i−1}.
    """

    def __init__(self, n_in: int, n_extra: int, dim: int, cfg: WukongConfig):
        super().__init__()
        self.cfg = cfg
        self.span_all = cfg.cross_layer_span == "all"
        tokens = [n_in] + [cfg.num_out] * cfg.num_layers  # tokens of X_0 … X_L
        # connection i over X_0 … X_i for i ≥ 1, plus the output connection (i = L)
        if self.span_all:
            conns = [CrossLayerConnection(tokens[: i + 1] if i else [], tokens[i], dim,
                                          cfg.cross_layer)
                     for i in range(cfg.num_layers + (cfg.num_layers > 0))]
        else:
            conns = [CrossLayerConnection(tokens[:i], tokens[i], dim, cfg.cross_layer)
                     for i in range(cfg.num_layers)]
        self.connections = nn.ModuleList(conns)
        self.layers = nn.ModuleList(WukongLayer(tokens[i] + n_extra, dim, cfg)
                                    for i in range(cfg.num_layers))

    def candidates(self, x_BND: torch.Tensor, history: list[torch.Tensor]) -> list[torch.Tensor]:
        """What connection i mixes: the earlier layers, and with span ``all`` the current
        one too."""
        return history + [x_BND] if self.span_all and history else history

    def forward_layer(self, i: int, x_BND: torch.Tensor, extra_BED: torch.Tensor | None,
                      history: list[torch.Tensor]) -> torch.Tensor:
        x = self.connections[i](x_BND, self.candidates(x_BND, history))
        if extra_BED is not None:
            x = torch.cat([x, extra_BED], dim=1)
        return self.layers[i](x)

    def finish(self, x_BND: torch.Tensor, history: list[torch.Tensor]) -> torch.Tensor:
        """X̃_L: the output connection over X_0 … X_L (span ``all``); X_L unchanged otherwise."""
        if len(self.connections) <= self.cfg.num_layers:
            return x_BND
        return self.connections[self.cfg.num_layers](x_BND, self.candidates(x_BND, history))

    def forward(self, x_BND: torch.Tensor) -> torch.Tensor:
        history: list[torch.Tensor] = []  # X_0 … X_{i-1}
        for i in range(self.cfg.num_layers):
            x_next = self.forward_layer(i, x_BND, None, history)
            history.append(x_BND)
            x_BND = x_next
        return self.finish(x_BND, history)
