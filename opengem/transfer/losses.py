"""Distillation losses (ExFM, Li et al. 2025, eq. 1–7).

Legend: B rows, T tasks; h(s, p) = BCE(σ(s), p) with a soft label p ∈ [0, 1].

    teacher logit  z = z_F                                (raw teacher)   or  adapter(z_F)      (student adapter)
    KD             L = L_true(ŷ_S) + w_kd · τ² h(ŷ_S / τ, σ(z / τ))       serving head fits the soft label
    aux head       L = L_true(ŷ_S) + w · h(ŷ_D, min(α·σ(z), 1))           a separate head fits it; the serving
                                                                           head sees ground truth only
    L_true = the trainer's masked BCE (``opengem.train.losses.masked_bce``) on the labelled rows.

Temperature (Hinton et al. 2015): the student's and the teacher's logits are divided by the same
τ, so the KD term's minimum is still ŷ_S = z (a student fitted to the soft label alone is as
calibrated as its teacher at any τ), and its gradient (σ(ŷ_S/τ) − σ(z/τ))/τ shrinks as 1/τ² near
agreement, which the τ² factor undoes so that ``kd.weight`` means the same at every τ. The adapter's
logits are tempered like the raw teacher's: it recalibrates the teacher, τ then softens the result.
The auxiliary head's label is untempered (ExFM scales the probability itself), so τ ≠ 1 with ``aux``
is refused by ``TransferConfig.validate``.

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
    """Standard KD on teacher logits: τ² h(s/τ, σ(t/τ)) (module docstring); no gradient into t."""
    target = torch.sigmoid(teacher_BT.detach() / temperature)
    return temperature ** 2 * soft_bce(student_BT / temperature, target, weights_B, task_weights_T)


def scaled_label(p_BT: torch.Tensor, scale: float) -> torch.Tensor:
    """ExFM label scaling: min(α·p, 1) (amplifies small, long-tailed probabilities)."""
    return (p_BT * scale).clamp(max=1.0)


@dataclass
class DistillLoss:
    total: torch.Tensor
    true: float
    distill: float


def distill_loss(logits_BT: torch.Tensor, aux_BT: torch.Tensor | None,
                 teacher_BT: torch.Tensor | None,
                 labels_BT: torch.Tensor, mask_BT: torch.Tensor, weights_B: torch.Tensor,
                 task_weights_T: torch.Tensor, cfg: TransferConfig) -> DistillLoss:
    """The student's loss for one batch.

    Args:
        logits_BT: serving-head logits.  aux_BT: distillation-head logits (None without ``cfg.aux``).
        teacher_BT: the teacher's logits z (raw, or the adapter's; no gradient), None = no KD.
        labels_BT, mask_BT, weights_B: the batch's ground truth.  task_weights_T: schema task weights.
    """
    true, _ = masked_bce(logits_BT, labels_BT, mask_BT, weights_B, task_weights_T)
    if teacher_BT is None or not cfg.kd.enabled:
        return DistillLoss(true, true.item(), 0.0)
    teacher_BT = teacher_BT.detach()
    if cfg.aux.enabled:
        if aux_BT is None:
            raise ValueError("transfer.aux is on but the student has no auxiliary head")
        label = scaled_label(torch.sigmoid(teacher_BT), cfg.aux.label_scale)
        d = soft_bce(aux_BT, label, weights_B, task_weights_T)
        total = true + cfg.aux.weight * d
    else:
        d = kd_loss(logits_BT, teacher_BT, weights_B, task_weights_T, cfg.kd.temperature)
        total = true + cfg.kd.weight * d
    return DistillLoss(total, true.item(), d.item())
