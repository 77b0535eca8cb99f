"""Masked, weighted binary cross-entropy per (domain, task).

Legend: B rows, T tasks, G domains.

    loss = Σ_t w_t · Σ_b ω_b m_bt ℓ_bt / Σ_b ω_b m_bt        ℓ = BCE-with-logits, m = label mask,
                                                            ω = sample weight, w_t = task weight
Each task is a mean over its labelled rows of all domains (every impression counts once); the
per-(domain, task) table is returned for logging, so a surface whose loss diverges is visible.
"""

from __future__ import annotations

import torch
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
        dom = domain_B if domain_B is not None else torch.zeros(ll.shape[0], dtype=torch.long, device=ll.device)
        num = ll.new_zeros(num_domains, ll.shape[1]).index_add_(0, dom, ll.detach() * w)
        den = ll.new_zeros(num_domains, ll.shape[1]).index_add_(0, dom, w)
        table = torch.where(den > 0, num / den.clamp(min=1e-12), torch.full_like(num, float("nan")))
    return loss, table
