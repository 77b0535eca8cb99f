"""Distillation losses (ExFM, Li et al. 2025, eq. 1–7).

Legend: B rows, T tasks; h(s, p) = BCE(σ(s), p) with a soft label p ∈ [0, 1].

    soft label     p_F = σ(z_F / τ)                       (raw teacher)   or  σ(adapter(z_F))   (student adapter)
    KD             L = L_true(ŷ_S) + w_kd · h(ŷ_S / τ, p)                 serving head fits the soft label
    aux head       L = L_true(ŷ_S) + w · h(ŷ_D, min(α·p, 1))              a separate head fits it; the serving
                                                                           head sees ground truth only
    L_true = the trainer's masked BCE (``opengem.train.losses.masked_bce``) on the labelled rows.

Each soft-label term is a mean over every row of the batch (the teacher labels rows that have no
label yet too), weighted by the row's sample weight, summed over tasks with the task weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from opengem.train.losses import masked_bce
from opengem.transfer.config import TransferConfig


def soft_bce(logits_BT: torch.Tensor, target_BT: torch.Tensor, weights_B: torch.Tensor,
             task_weights_T: torch.Tensor) -> torch.Tensor:
    """Σ_t w_t · Σ_b ω_b h(s_bt, p_bt) / Σ_b ω_b."""
    ll = F.binary_cross_entropy_with_logits(logits_BT, target_BT, reduction="none")
    per_task = (ll * weights_B.unsqueeze(1)).sum(0) / weights_B.sum().clamp(min=1e-12)
    return (per_task * task_weights_T).sum()


def kd_loss(student_BT: torch.Tensor, teacher_BT: torch.Tensor, weights_B: torch.Tensor,
            task_weights_T: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Standard KD on soft labels: h(s/τ, σ(t/τ))."""
    target = torch.sigmoid(teacher_BT.detach() / temperature)
    return soft_bce(student_BT / temperature, target, weights_B, task_weights_T)


def scaled_label(p_BT: torch.Tensor, scale: float) -> torch.Tensor:
    """ExFM label scaling: min(α·p, 1) (amplifies small, long-tailed probabilities)."""
    return (p_BT * scale).clamp(max=1.0)


@dataclass
class DistillLoss:
    total: torch.Tensor
    true: float
    distill: float


def distill_loss(logits_BT: torch.Tensor, aux_BT: torch.Tensor | None, soft_BT: torch.Tensor | None,
                 labels_BT: torch.Tensor, mask_BT: torch.Tensor, weights_B: torch.Tensor,
                 task_weights_T: torch.Tensor, cfg: TransferConfig) -> DistillLoss:
    """The student's loss for one batch.

    Args:
        logits_BT: serving-head logits.  aux_BT: distillation-head logits (None without ``cfg.aux``).
        soft_BT: the soft label p (already σ(z/τ) or the adapter's output; no gradient), None = no KD.
        labels_BT, mask_BT, weights_B: the batch's ground truth.  task_weights_T: schema task weights.
    """
    true, _ = masked_bce(logits_BT, labels_BT, mask_BT, weights_B, task_weights_T)
    if soft_BT is None or not cfg.kd.enabled:
        return DistillLoss(true, true.item(), 0.0)
    soft_BT = soft_BT.detach()
    if cfg.aux.enabled:
        if aux_BT is None:
            raise ValueError("transfer.aux is on but the student has no auxiliary head")
        d = soft_bce(aux_BT, scaled_label(soft_BT, cfg.aux.label_scale), weights_B, task_weights_T)
        total = true + cfg.aux.weight * d
    else:
        d = soft_bce(logits_BT / cfg.kd.temperature, soft_BT, weights_B, task_weights_T)
        total = true + cfg.kd.weight * d
    return DistillLoss(total, true.item(), d.item())
