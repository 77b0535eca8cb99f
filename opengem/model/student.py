"""Students: small, servable vertical models (VMs) built from GEM's own parts.

Legend: B rows, T tasks, F GEM feature width (``GEM.feature_dim``), E teacher embedding width.

A student is a small ``GEM`` (the *backbone*: the model that is served) plus, while it trains, an
optional auxiliary distillation head (ExFM, dossier §8.2) reading the backbone's features through
a gradient-scale op::

    batch ─► backbone.inputs ─► backbone features [B, F] ─┬─► backbone.heads ─► serving logits [B, T]
                                                           └─► GradScale(β) ─► aux heads ─► distillation logits [B, T]

Because the served part is a plain ``GEM``, a student run directory is an ordinary run directory:
``load_run_model`` rebuilds it, ``opengem evaluate`` scores it, ``opengem export`` exports it
through ``ServingGEM`` (the aux head is training-only and is not saved).

Representation transfer adds the teacher's embedding as E dense *user* features named
``teacher_rep_000 …`` to the student's schema (``student_schema``): GEM's dense arch reads them
like any other float, and serving fills them from a per-user feature store (see
``opengem.transfer.user_reps.UserRepCache``), so the served program is unchanged. Representations
over time (``rep.source=days``) are k·r such features: the user's last k daily published
representations, each projected to r (``opengem.transfer.user_reps.UserRepHistory``).

Presets (``opengem.recipes.students``): one dial from ``vm_xs`` (no sequence towers: the cheapest
servable model) to ``fm_domain`` (a per-domain foundation model, the middle level of
hierarchical transfer).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from opengem.data.batch import Batch
from opengem.features.schema import DenseFeature, FeatureSchema
from opengem.model.build import build_gem, materialize
from opengem.model.foundation import GEM
from opengem.model.heads import Heads, HeadsConfig

REP_PREFIX = "teacher_rep_"


def student_schema(schema: FeatureSchema, rep_dim: int = 0) -> FeatureSchema:
    """The data schema plus ``rep_dim`` dense user features for the teacher's embedding."""
    if not rep_dim:
        return schema
    extra = tuple(DenseFeature(f"{REP_PREFIX}{i:03d}", "user") for i in range(rep_dim))
    return dataclasses.replace(schema, dense=schema.dense + extra)


def rep_dim_of(schema: FeatureSchema) -> int:
    """How many teacher-embedding features a (student) schema holds."""
    return sum(f.name.startswith(REP_PREFIX) for f in schema.dense)


def with_rep(batch: Batch, rep_BE: torch.Tensor | None) -> Batch:
    """The batch with the teacher embedding appended to its dense features (schema order)."""
    if rep_BE is None:
        return batch
    return dataclasses.replace(batch,
                               dense=torch.cat([batch.dense, rep_BE.to(batch.dense.dtype)], dim=1))


def forward_with_features(gem: GEM, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [B, T], features [B, F]) in one pass; the logits equal ``gem(batch)``."""
    x, seqs = gem.inputs(batch)
    feats = gem._features(x, seqs)  # GEM.forward's own path, keeping the features it computes
    return gem.heads(feats, batch.domain, gem.low_order(x)), feats


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def grad_scale(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Identity forward; backward multiplies the gradient by ``scale`` (ExFM's gradient
    scaling β)."""
    return x if scale == 1.0 else _GradScale.apply(x, scale)


class Student(nn.Module):
    """A vertical model: ``backbone`` (a small GEM, the served part) and an optional auxiliary head.

    Args:
        backbone: a materialised ``GEM``.
        aux: a ``Heads`` over the backbone's features (ExFM's distillation head) or None.
        aux_grad_scale: β, the scale of the aux head's gradient into the backbone.
    """

    def __init__(self, backbone: GEM, aux: Heads | None = None, aux_grad_scale: float = 1.0):
        super().__init__()
        self.backbone, self.aux, self.aux_grad_scale = backbone, aux, aux_grad_scale
        self.schema = backbone.schema

    def forward(self, batch: Batch) -> torch.Tensor:
        """Serving logits [B, T] (what is exported)."""
        return self.backbone(batch)

    def forward_train(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(serving logits, distillation-head logits or None)."""
        if self.aux is None:
            return self.backbone(batch), None
        logits, feats = forward_with_features(self.backbone, batch)
        return logits, self.aux(grad_scale(feats, self.aux_grad_scale), batch.domain)

    def max_seq_len(self) -> dict[str, int]:
        return self.backbone.max_seq_len()

    def sparse_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.backbone.sparse_parameters() if p.requires_grad]

    def dense_parameters(self) -> list[nn.Parameter]:
        sparse = {id(p) for p in self.backbone.sparse_parameters()}
        return [p for p in self.parameters() if id(p) not in sparse and p.requires_grad]


def build_student(schema: FeatureSchema, cfg, base_rates: list[float], seed: int = 0,
                  aux_heads: HeadsConfig | None = None, aux_label_scale: float = 1.0,
                  aux_grad_scale: float = 1.0) -> Student:
    """Build on meta → materialise → init, as every model here; ``schema`` is the student's
    (``student_schema``). The aux head starts at the scaled base rates it will be trained on."""
    backbone = materialize(build_gem(schema, cfg.model), "cpu", seed, base_rates)
    aux = None
    if aux_heads is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)
            aux = Heads(backbone.feature_dim, schema, aux_heads)
        aux.init_bias([min(aux_label_scale * r, 0.99) for r in base_rates])
    return Student(backbone, aux, aux_grad_scale)
