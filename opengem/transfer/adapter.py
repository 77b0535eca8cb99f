"""The student adapter (ExFM's SA; GEM's "Student Adapter").

Legend: B rows, T tasks, G domains, H hidden width.

The teacher is trained on older days; the world has drifted since. The adapter is a tiny model that
maps the teacher's logits to calibrated ones, fitted on the freshest ground truth::

    z'_bt = a_{g,t} · z_bt + c_{g,t}                       per-(domain, task) Platt scaling (identity at init)
          + MLP([z_b, onehot(g)])_t                        (``hidden`` > 0; zero at init)
          + Σ_f e_f[id_f(b)]_t                             (``ids``: a learned scalar per id, zero at init;
                                                             features the schema lacks are skipped)

ExFM Algorithm 1, per step: (1) update the adapter on (z_F, y) of the batch; (2) its output z',
under stop-gradient, is the student's soft label σ(z'/τ) (tempered like a raw teacher's logit, by
``opengem.transfer.losses.kd_loss``); (3) update the student. ``update`` does (1), ``target`` does
(2); the student never sends a gradient into the adapter.

How (1) fits the Platt part is a choice (``fit``), which ExFM leaves open. ``adam``: every part by
Adam at ``lr``, which moves a bias by about ``lr`` per step, so a student pass of a few dozen
batches leaves it near the identity: harmless when the teacher was trained on the student's own
task, but on a task it never trained on (``engage`` read from the click head) the soft label stays a
click probability. ``newton`` (default): the per-(domain, task) (a, c) by an online Newton step on
the curvature accumulated over every batch so far (recursive IRLS, started at the identity with
``prior`` units of curvature), which tracks the running maximum-likelihood Platt fit from the first
batches on. ``ids_fit`` makes the same choice for the id corrections: ``newton``, a diagonal Newton
step per id on its own rows' curvature plus ``ids_prior`` (a N(0, 1/ids_prior) prior: an id seen on
few rows stays near 0; the default), or ``adam``. ``ids_tasks`` picks the tasks that get
id corrections:
``borrowed`` (default), only a task read from another task's head (``engage`` from click), whose own
per-id effects the head never learned, so a day of labels is their only source; ``all``, every task,
which on a task the FM trained on re-fits from one day what it learned from all of them: it helps on
mismatched objectives and hurts on matched ones (docs/transfer.md; docs/experiments.md, 'Figures
moved from code docstrings'). The MLP stays with Adam. benchmarks/transfer.py measures the choices.
"""

from __future__ import annotations

import torch
from torch import nn

from opengem.data.batch import Batch
from opengem.features.schema import FeatureSchema
from opengem.model.interaction_arch import mlp
from opengem.train.losses import masked_bce
from opengem.transfer.config import AdapterConfig


class StudentAdapter(nn.Module):
    """Args: schema (tasks, domains, id vocabularies); cfg: ``AdapterConfig``; borrowed_T: [T] bool,
    the tasks read from another task's teacher head (None: none)."""

    def __init__(self, schema: FeatureSchema, cfg: AdapterConfig,
                 borrowed_T: torch.Tensor | None = None):
        super().__init__()
        G, T = schema.num_domains, len(schema.tasks)
        if cfg.ids_tasks == "all":
            in_scope = torch.ones(T, dtype=torch.bool)
        else:
            in_scope = (
                torch.zeros(T, dtype=torch.bool)
                if borrowed_T is None
                else borrowed_T.to(torch.bool)
            )
        # [T]: 1 where a task gets id corrections
        self.register_buffer("ids_scope", in_scope.float())
        self.cfg, self.num_domains = cfg, G
        self.scale = nn.Parameter(torch.ones(G, T))
        self.bias = nn.Parameter(torch.zeros(G, T))
        self.mlp = mlp([T + G, cfg.hidden, T]) if cfg.hidden else None
        if self.mlp is not None:
            nn.init.zeros_(self.mlp[-1].weight)
            nn.init.zeros_(self.mlp[-1].bias)
        # ids this schema lacks are skipped
        single = {f.name: f for f in schema.sparse if not f.multi_hot}
        ids = [f for f in cfg.ids if f in single] if bool(in_scope.any()) else []
        self.ids = nn.ModuleDict({f: nn.Embedding(single[f].vocab_size + 1, T) for f in ids})
        for e in self.ids.values():
            nn.init.zeros_(e.weight)
        self.task_w = torch.tensor([t.weight for t in schema.tasks])
        self.newton = cfg.fit == "newton"
        # the curvature of (a, c) per (domain, task) seen so far, starting at ``prior`` · I (the
        # identity's weight)
        self.register_buffer("curvature", cfg.prior * torch.eye(2).expand(G, T, 2, 2).clone())
        self.ids_newton = cfg.ids_fit == "newton"
        # each id's curvature seen so far, starting at the prior's precision
        for f, e in self.ids.items():
            self.register_buffer(f"ids_curvature_{f}",
                                 torch.full_like(e.weight.detach(), cfg.ids_prior))
        newton = ({"scale", "bias"} if self.newton else set()) | (
            {f"ids.{f}.weight" for f in self.ids} if self.ids_newton else set()
        )
        adam = [p for n, p in self.named_parameters() if n not in newton]
        self.optimizer = torch.optim.Adam(adam, lr=cfg.lr) if adam else None

    def forward(self, teacher_BT: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Corrected logits [B, T]."""
        g = batch.domain
        z = teacher_BT.detach()
        out = self.scale[g] * z + self.bias[g]
        if self.mlp is not None:
            out = out + self.mlp(torch.cat([z,
                                            nn.functional.one_hot(g, self.num_domains).to(z.dtype)],
                                           1))
        if self.ids:
            sparse = batch.sparse.to_dict()
            for f, emb in self.ids.items():
                # single-valued features: one id per row
                out = out + emb(sparse[f].values()) * self.ids_scope
        return out

    def update(self, teacher_BT: torch.Tensor, batch: Batch) -> float:
        """Fit the freshest labels (step 1 of Algorithm 1); returns the last loss."""
        loss = torch.zeros(())
        for i in range(self.cfg.steps):
            out = self(teacher_BT, batch)
            loss, _ = masked_bce(out, batch.labels, batch.label_mask, batch.weights, self.task_w)
            if self.optimizer is not None:
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
            if self.newton or self.ids_newton:
                self._newton_step(teacher_BT, out.detach(), batch, accumulate=i == 0)
        return loss.item()

    @torch.no_grad()
    def _newton_step(self, teacher_BT: torch.Tensor, out_BT: torch.Tensor, batch: Batch,
                     accumulate: bool) -> None:
        """(a, c)_{g,t} −= H⁻¹ ∇, H the curvature of every batch so far (this one's added once,
        however many ``steps``): per (domain, task), the rows' log-loss gradient and Fisher
        information in (a, c)."""
        z = teacher_BT.detach().to(out_BT.dtype)
        w = batch.label_mask.to(z.dtype) * batch.weights.to(z.dtype).unsqueeze(1)  # [B, T]
        p = torch.sigmoid(out_BT)
        y = torch.where(batch.label_mask, batch.labels.to(z.dtype), torch.zeros_like(z))
        r, h = w * (p - y), w * p * (1 - p)
        G, T = self.scale.shape
        g = batch.domain

        def per_domain(x_BT):
            return x_BT.new_zeros(G, T).index_add_(0, g, x_BT)

        # per id: Σ its rows' gradient / (Σ their curvature + prior)
        if self.ids_newton and self.ids:
            sparse = batch.sparse.to_dict()
            r_ids, h_ids = r * self.ids_scope, h * self.ids_scope  # a task out of scope keeps 0
            for f, emb in self.ids.items():
                v = sparse[f].values()
                curvature = getattr(self, f"ids_curvature_{f}")
                if accumulate:
                    curvature.index_add_(0, v, h_ids)
                emb.weight -= (
                    emb.weight.new_zeros(emb.weight.shape).index_add_(0, v, r_ids) / curvature
                )
        if not self.newton:
            return
        grad = torch.stack([per_domain(r * z), per_domain(r)], -1)  # [G, T, 2]
        hzz, hz, h1 = per_domain(h * z * z), per_domain(h * z), per_domain(h)
        if accumulate:
            self.curvature += torch.stack([torch.stack([hzz, hz], -1), torch.stack([hz, h1], -1)],
                                          -2)
        step = torch.linalg.solve(self.curvature, grad.unsqueeze(-1)).squeeze(-1)
        self.scale -= step[..., 0]
        self.bias -= step[..., 1]

    @torch.no_grad()
    def target(self, teacher_BT: torch.Tensor, batch: Batch) -> torch.Tensor:
        """adapter(z_F) under stop-gradient: the logits of the student's soft label (step 2)."""
        return self(teacher_BT, batch)
