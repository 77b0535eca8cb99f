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
    """Args: schema (tasks, domains, id vocabularies); cfg: ``AdapterConfig``."""

    def __init__(self, schema: FeatureSchema, cfg: AdapterConfig):
        super().__init__()
        G, T = schema.num_domains, len(schema.tasks)
        self.cfg, self.num_domains = cfg, G
        self.scale = nn.Parameter(torch.ones(G, T))
        self.bias = nn.Parameter(torch.zeros(G, T))
        self.mlp = mlp([T + G, cfg.hidden, T]) if cfg.hidden else None
        if self.mlp is not None:
            nn.init.zeros_(self.mlp[-1].weight)
            nn.init.zeros_(self.mlp[-1].bias)
        single = {f.name: f for f in schema.sparse if not f.multi_hot}  # ids this schema lacks are skipped
        self.ids = nn.ModuleDict({f: nn.Embedding(single[f].vocab_size + 1, T) for f in cfg.ids if f in single})
        for e in self.ids.values():
            nn.init.zeros_(e.weight)
        self.task_w = torch.tensor([t.weight for t in schema.tasks])
        self.optimizer = torch.optim.Adam(self.parameters(), lr=cfg.lr)

    def forward(self, teacher_BT: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Corrected logits [B, T]."""
        g = batch.domain
        z = teacher_BT.detach()
        out = self.scale[g] * z + self.bias[g]
        if self.mlp is not None:
            out = out + self.mlp(torch.cat([z, nn.functional.one_hot(g, self.num_domains).to(z.dtype)], 1))
        if self.ids:
            sparse = batch.sparse.to_dict()
            for f, emb in self.ids.items():
                out = out + emb(sparse[f].values())  # single-valued features: one id per row
        return out

    def update(self, teacher_BT: torch.Tensor, batch: Batch) -> float:
        """Fit the freshest labels (step 1 of Algorithm 1); returns the last loss."""
        loss = torch.zeros(())
        for _ in range(self.cfg.steps):
            loss, _ = masked_bce(self(teacher_BT, batch), batch.labels, batch.label_mask, batch.weights, self.task_w)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
        return loss.item()

    @torch.no_grad()
    def target(self, teacher_BT: torch.Tensor, batch: Batch) -> torch.Tensor:
        """adapter(z_F) under stop-gradient: the logits of the student's soft label (step 2)."""
        return self(teacher_BT, batch)
