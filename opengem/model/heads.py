"""Multi-domain × multi-task heads.

Legend: B rows, F input features, T tasks, G domains (surfaces), H tower width.

    trunk  : shared MLP  [B, F] → [B, H0]
    tower_t: per-task MLP [B, H0] → [B, H]
    output : per (domain, task) linear, selected by each row's domain → logit [B, T]

The public record does not say how GEM specialises per surface (dossier §11.6). Our choice,
``domain_mode``: ``output`` (default; shared towers, one output layer per (domain, task)),
``shared`` (one output for all domains; the domain only enters as an input token).

Conversion is rare, so by default it is trained on all impressions through the click head
(ESMM-style, ``chain_required``): p(conversion) = p(click) · p(conversion | click). The head
returns the logit of that product, so BCE-with-logits on conversion labels is exact and
p(conversion) ≤ p(click) always holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from opengem.features.schema import FeatureSchema
from opengem.model.interaction_arch import mlp, unit_rms


@dataclass
class HeadsConfig:
    trunk_dims: tuple[int, ...] = (256, 128)
    task_dims: tuple[int, ...] = (64,)
    domain_mode: str = "output"  # output | shared
    chain_required: bool = True
    dropout: float = 0.0

    def validate(self) -> None:
        if self.domain_mode not in ("output", "shared"):
            raise ValueError(f"model.heads.domain_mode must be output|shared, "
                             f"got {self.domain_mode!r}")


def base_rate_logits(base_rates: list[float], parent: list[int], tasks: list[str]) -> list[float]:
    """Each task's output bias at its base rate: logit(rate), the conditional rate rate/rate(parent)
    for a chained task (``parent[t] >= 0``)."""
    if len(base_rates) != len(tasks):
        raise ValueError(f"got {len(base_rates)} base rates for tasks {tasks}")
    out = []
    for t, r in enumerate(base_rates):
        if parent[t] >= 0:
            r = r / max(base_rates[parent[t]], 1e-6)
        r = min(max(r, 1e-6), 1 - 1e-6)
        out.append(math.log(r / (1 - r)))
    return out


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x < 0, stable at both ends."""
    x = x.clamp(max=-1e-7)
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def chained_logit(parent_logit: torch.Tensor, cond_logit: torch.Tensor) -> torch.Tensor:
    """logit(σ(parent) · σ(cond))."""
    logp = F.logsigmoid(parent_logit) + F.logsigmoid(cond_logit)
    return logp - log1mexp(logp)


class Heads(nn.Module):
    """Shared trunk → one tower per task → one output per (domain, task) (module docstring).

    Args:
        in_dim: F, the width of the features the heads read (``GEM.feature_dim``).
        schema: tasks (in order; ``requires`` chains a task to the one it needs) and domains.
        cfg: ``HeadsConfig`` (``model.heads.*``): trunk and tower widths, ``domain_mode``,
            ``chain_required``, dropout.

    Shapes: ``forward(feats [B, F], domain [B] long, shortcut [B, T] or None)`` → logits [B, T]
    in schema task order; parameters ``out_w`` [G, T, H], ``out_b`` [G, T] with G = domains
    (``output``) or 1 (``shared``). Row b uses output group ``domain[b]``: with domains
    (feed, video) and ``domain = [1, 0]``, row 0 is scored by video's outputs, row 1 by feed's.
    """

    def __init__(self, in_dim: int, schema: FeatureSchema, cfg: HeadsConfig):
        super().__init__()
        self.cfg = cfg
        self.tasks = schema.task_names
        self.parent = [self.tasks.index(t.requires) if (t.requires and cfg.chain_required) else -1
                       for t in schema.tasks]
        if any(p >= t for t, p in enumerate(self.parent)):
            raise ValueError(f"a task must come after the task it requires (tasks {self.tasks})")
        G = schema.num_domains if cfg.domain_mode == "output" else 1
        self.trunk = mlp([in_dim, *cfg.trunk_dims], cfg.dropout, last_act=True)
        h0 = cfg.trunk_dims[-1] if cfg.trunk_dims else in_dim
        self.towers = nn.ModuleList(mlp([h0, *cfg.task_dims], cfg.dropout, last_act=True)
                                    for _ in self.tasks)
        h = cfg.task_dims[-1] if cfg.task_dims else h0
        self.out_w = nn.Parameter(torch.empty(G, len(self.tasks), h))
        self.out_b = nn.Parameter(torch.empty(G, len(self.tasks)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.out_w, std=self.out_w.shape[-1] ** -0.5)
        nn.init.zeros_(self.out_b)

    def init_bias(self, base_rates: list[float]) -> None:
        """Start each output at its task's base rate (conditional rate for chained tasks)."""
        with torch.no_grad():
            for t, b in enumerate(base_rate_logits(base_rates, self.parent, self.tasks)):
                self.out_b[:, t] = b

    @torch.no_grad()
    def scale_(self, a_T: torch.Tensor) -> None:
        """Multiply each task's output weights and biases by ``a_T`` [T], in place (a Platt
        slope folded in, ``opengem.model.logit_shift.fold_offsets``)."""
        self.out_w.mul_(a_T.to(self.out_w.dtype)[None, :, None])
        self.out_b.mul_(a_T.to(self.out_b.dtype)[None, :])

    def forward(self, feats_BF: torch.Tensor, domain_B: torch.Tensor,
                shortcut_BT: torch.Tensor | None = None) -> torch.Tensor:
        """logits [B, T]; ``shortcut_BT`` (low-order logits, see ``LowOrderShortcut``) is added to
        each task's own logit before chaining."""
        return self.chain(self.raw_logits(feats_BF, domain_B, shortcut_BT))

    def output_group(self, domain_B: torch.Tensor) -> torch.Tensor:
        """Which row of ``out_w`` / ``out_b`` each row uses: its domain, or 0 when shared."""
        return domain_B if self.cfg.domain_mode == "output" else torch.zeros_like(domain_B)

    def raw_logits(self, feats_BF: torch.Tensor, domain_B: torch.Tensor,
                   shortcut_BT: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T] each task's own logit before chaining (a chained task's is logit
        p(task | parent))."""
        h = self.trunk(feats_BF)
        g = self.output_group(domain_B)
        w, b = self.out_w[g], self.out_b[g]  # [B, T, H], [B, T]
        raw = torch.stack(
            [(tower(h) * w[:, t]).sum(-1) + b[:, t] for t, tower in enumerate(self.towers)], dim=1
        )
        return raw if shortcut_BT is None else raw + shortcut_BT

    def chain(self, raw_BT: torch.Tensor) -> torch.Tensor:
        """[B, T] final logits: a chained task's is logit(p(parent) · p(task | parent))."""
        out: list[torch.Tensor] = []
        for t in range(raw_BT.shape[1]):
            p = self.parent[t]
            out.append(raw_BT[:, t] if p < 0 else chained_logit(out[p], raw_BT[:, t]))
        return torch.stack(out, dim=1)


class ZeroLinear(nn.Linear):
    """A linear layer that starts (and re-initialises, e.g. in ``GEM.init_weights``) at zero."""

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class LowOrderShortcut(nn.Module):
    """First- and second-order logits straight from the input tokens X_0 (field-weighted FM).

    Legend: n input tokens, D dim, P = n(n−1)/2 token pairs, T tasks.

        linear: [B, n·D] → [B, T]                      (each embedding's first-order effect)
        fwfm:   ⟨x_i, x_j⟩/√D for i < j → [B, P] → [B, T]  (one learned weight per pair and task)
        fvfm:   x_i ⊙ x_j/√D for i < j → [B, P·D] → [B, T] (a learned weight per pair, dim and task)

    Not in the public GEM record (dossier §11): Wukong and InterFormer only reach the logits through
    their stacks. We add this DeepFM/FwFM-style path because one pass over the logs learns low-order
    effects (ad quality, a user segment × ad category affinity) slowly through deep stacks; the
    output weights start at zero, so at init the model equals the one without
    it. ``model.shortcut``:
    ``fwfm`` (linear + pairs) | ``fvfm`` (linear + pairs, each pair a weighted inner product,
    FmFM's field-vector form, Sun et al. 2021) | ``linear`` | ``none``.

    ``unit_pairs`` (``model.shortcut_pairs=unit``, the default): the pairs are read from tokens
    scaled to unit RMS. X_0 mixes id embeddings of RMS ~0.05 at init (0.1-0.8 trained) with a domain
    token of ~1, so raw pair products differ by orders of magnitude between fields and a pair of id
    fields (an affinity such as segment × category) starts with a near-zero gradient on its weight;
    unit tokens make each pair a cosine, every field pair on one scale. The linear part keeps the
    raw tokens.

    Why ``fvfm`` exists: with one scalar per pair, every field's single embedding must serve all of
    its pairs' affinities at once (segment × category and segment × format share segment's vector);
    a weight per dimension lets each pair read its own subspace, for P·D·T more weights (zero
    at init).
    """

    def __init__(self, n_tokens: int, dim: int, num_tasks: int, mode: str,
                 unit_pairs: bool = False):
        super().__init__()
        self.mode, self.dim, self.n, self.unit_pairs = mode, dim, n_tokens, unit_pairs
        self.linear = ZeroLinear(n_tokens * dim, num_tasks, bias=False)
        n_pairs = n_tokens * (n_tokens - 1) // 2
        width = {"fwfm": n_pairs, "fvfm": n_pairs * dim}.get(mode)
        self.pairs = ZeroLinear(width, num_tasks, bias=False) if width else None

    def forward(self, x_BND: torch.Tensor) -> torch.Tensor:
        # FSDP mixed precision: tables stay fp32, this may be bf16
        x_BND = x_BND.to(self.linear.weight.dtype)
        out = self.linear(x_BND.flatten(1))
        if self.pairs is not None:
            # no buffer: nothing to shard
            i, j = torch.triu_indices(self.n, self.n, offset=1, device=x_BND.device)
            # pairs of unit-RMS tokens: a cosine per pair, whatever the fields' scales
            if self.unit_pairs:
                x_BND = unit_rms(x_BND)
            if self.mode == "fvfm":
                out = out + self.pairs((x_BND[:, i] * x_BND[:, j]).flatten(1) * self.dim**-0.5)
            else:
                gram = torch.bmm(x_BND, x_BND.transpose(1, 2)) * self.dim**-0.5
                out = out + self.pairs(gram[:, i, j])
        return out

