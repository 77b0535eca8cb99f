"""Parameter sharing: a student starts from (or reuses) the teacher's embedding tables.

Legend: R rows of a table, D_t teacher dim, D_s student dim.

Tables are matched by name (``t_ad_id``, ``t_organic_item`` …: the schema names them, so every
model built from the same data has the same table names and row counts). Per table:

    D_s = D_t   copy
    D_s < D_t   W_s = W_t V_{:, :D_s}     V: right singular vectors of W_t (PCA without centring), so the
                                          student keeps the directions along which the teacher's ids differ most
    D_s > D_t   W_s[:, :D_t] = W_t        columns D_t.. keep the student's initialisation: the extra
                                          directions start as random as in a student of its own

``rescale`` (default) then scales the shared columns to the standard deviation the student's own
initialisation gave them (the kept columns stay as they are; a std taken over zero-padded columns
would inflate the copied ones by up to sqrt(D_s/D_t)): what transfers is the geometry (which ids
are alike), while the student's layers, learning rates and row-wise Adagrad see inputs of the scale
they were tuned for (trained teacher tables are several times wider than the init, and copied as
they are they slowed the student down: docs/experiments.md, 'Figures moved from code docstrings').
``freeze`` turns the shared tables off for the optimiser (reuse as they are). The domain embedding
(an ``nn.Embedding``, dense) is shared the same way.
"""

from __future__ import annotations

import logging

import torch

from opengem.model.foundation import GEM
from opengem.transfer.config import ShareConfig

log = logging.getLogger(__name__)


def project_table(w_RD: torch.Tensor, dim: int) -> torch.Tensor:
    """The columns a student of width ``dim`` takes from the table (module docstring): all D of them
    when D <= ``dim``, else the leading ``dim`` principal directions (min(R, ``dim``) of them: a
    table of R < dim rows has R). The student's own init fills any column beyond."""
    if w_RD.shape[1] <= dim:
        return w_RD.clone()
    _, _, vh = torch.linalg.svd(w_RD.double(), full_matrices=False)
    return (w_RD.double() @ vh[:dim].T).to(w_RD.dtype)


@torch.no_grad()
def share_parameters(student: GEM, teacher: GEM, cfg: ShareConfig) -> list[str]:
    """Copy the teacher's tables into ``student`` (in place); returns the names shared."""
    mine, theirs = student.sparse_arch.tables(), teacher.sparse_arch.tables()
    names = list(cfg.tables) or [n for n in mine if n in theirs]
    missing = [n for n in names if n not in mine or n not in theirs]
    if missing:
        raise ValueError(f"cannot share tables {missing}: not in both models "
                         f"(student {sorted(mine)}, "
                         f"teacher {sorted(theirs)})")
    pairs = [(n, mine[n], theirs[n]) for n in names]
    if cfg.domain_emb:
        pairs.append(("domain_emb", student.domain_emb.weight, teacher.domain_emb.weight))
    shared = []
    for name, w, t in pairs:
        if w.shape[0] != t.shape[0]:
            log.warning("not sharing %s: %d rows in the student, %d in the teacher", name,
                        w.shape[0], t.shape[0])
            continue
        new = project_table(t.detach().to(w.dtype), w.shape[1])
        cols = w[:, :new.shape[1]]  # a wider student keeps its own init in the rest
        if cfg.rescale:
            new = new * (cols.std() / new.std().clamp(min=1e-12))
        cols.copy_(new)
        if cfg.freeze:
            w.requires_grad_(False)
        shared.append(name)
    return shared
