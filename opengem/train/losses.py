"""Masked, weighted binary cross-entropy per (domain, task).

Legend: B rows, T tasks, G domains.

    loss = Σ_t w_t · Σ_b ω_b m_bt ℓ_bt / Σ_b ω_b m_bt        ℓ = BCE-with-logits, m = label mask,
                                                            ω = sample weight, w_t = task weight
Each task is a mean over its labelled rows of all domains (every impression counts once); the
per-(domain, task) table is returned for logging, so a surface whose loss diverges is visible.
``global_masked_bce`` is the same loss over the global batch when ranks each hold a part of it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def masked_bce(
    logits_BT: torch.Tensor,
    labels_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    weights_B: torch.Tensor,
    task_weights_T: torch.Tensor,
    domain_B: torch.Tensor | None = None,
    num_domains: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (scalar loss, per-(domain, task) mean loss [G, T] detached; NaN where no rows)."""
    ll = F.binary_cross_entropy_with_logits(logits_BT, labels_BT, reduction="none")
    w = mask_BT.to(ll.dtype) * weights_B.unsqueeze(1)
    per_task = (ll * w).sum(0) / w.sum(0).clamp(min=1e-12)
    loss = (per_task * task_weights_T).sum()
    with torch.no_grad():
        dom = (
            domain_B
            if domain_B is not None
            else torch.zeros(ll.shape[0], dtype=torch.long, device=ll.device)
        )
        num = ll.new_zeros(num_domains, ll.shape[1]).index_add_(0, dom, ll.detach() * w)
        den = ll.new_zeros(num_domains, ll.shape[1]).index_add_(0, dom, w)
        table = torch.where(den > 0, num / den.clamp(min=1e-12), torch.full_like(num, float("nan")))
    return loss, table


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def global_masked_bce(logits_BT, labels_BT, mask_BT, weights_B, task_weights_T, domain_B=None,
                      num_domains=1):
    """``masked_bce`` scaled so that the mean over ranks equals ``masked_bce`` of the global batch.

    Each task's loss is a mean over its labelled rows; when ranks hold different numbers of them the
    mean of per-rank means is not the global mean. Using the global denominators (one all-reduce of
    T numbers, no gradient) and multiplying by the world size fixes that: FSDP and TorchRec both
    average gradients over ranks. The returned per-(domain, task) table is this rank's.
    """
    W = _world()
    if W == 1:
        return masked_bce(logits_BT, labels_BT, mask_BT, weights_B, task_weights_T, domain_B,
                          num_domains)
    with torch.no_grad():
        den_local = (mask_BT.to(logits_BT.dtype) * weights_B.unsqueeze(1)).sum(0)
        den_global = den_local.clone()
        dist.all_reduce(den_global)
        scale = W * den_local.clamp(min=1e-12) / den_global.clamp(min=1e-12)
    return masked_bce(logits_BT, labels_BT, mask_BT, weights_B, task_weights_T * scale, domain_B,
                      num_domains)
