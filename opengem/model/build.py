"""Build a model the way training, evaluation and teachers all do: meta → materialise → init.

``opengem.parallel`` (sharding, FSDP2) slots in between ``build_gem`` and ``materialize``.
``model.arch`` picks the model: ``gem`` (GEM), or a peer baseline, ``dlrm`` | ``dlrm_dcn`` | ``din``
(``opengem.model.peers``: TorchRec's DLRM and DIN on the same tables and batches, one process only).
"""

from __future__ import annotations

from pathlib import Path

import torch

from opengem.data.dense_stats import train_dense_stats
from opengem.features.schema import FeatureSchema
from opengem.model.dense_norm import DenseNormalizer
from opengem.model.foundation import GEM, GEMConfig
from opengem.model.peers import PeerModel


def build_gem(schema: FeatureSchema, cfg: GEMConfig) -> GEM | PeerModel:
    """The model ``cfg.arch`` names, on the meta device: no memory, any size (a 1B-parameter preset
    builds instantly). GEM unless ``arch`` names a peer (the trainer and evaluator take either)."""
    if cfg.arch == "gem":
        return GEM(schema, cfg, device="meta")
    return PeerModel(schema, cfg, device="meta")


def materialize(model: GEM | PeerModel, device: str | torch.device = "cpu", seed: int = 0,
                base_rates: list[float] | None = None) -> GEM | PeerModel:
    model.to_empty(device=device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.init_weights(base_rates, seed)
    return model


def fit_dense_norm(
    model: torch.nn.Module, data_dir: str | Path, schema: FeatureSchema, split: str
) -> dict | None:
    """Fit the model's dense normaliser (``model.dense_norm``) on ``split`` (the training split;
    every rank computes the same figures). Returns the statistics, or None when the mode
    fits nothing."""
    norms = [m for m in model.modules() if isinstance(m, DenseNormalizer) and m.needs_fit]
    if not norms:
        return None
    stats = train_dense_stats(data_dir, schema, split)
    for m in norms:
        m.fit(stats, [f.name for f in schema.dense])
    return stats


def dense_norm_stats(model: torch.nn.Module) -> dict | None:
    """The statistics the model's dense normaliser was fitted with in this process (None:
    nothing fitted)."""
    return next((m.stats for m in model.modules() if isinstance(m, DenseNormalizer)
                 and m.stats is not None), None)


def count_parameters(model: torch.nn.Module) -> dict[str, int]:
    sparse = {id(p) for p in model.sparse_parameters()}
    n_sparse = sum(p.numel() for p in model.parameters() if id(p) in sparse)
    n_all = sum(p.numel() for p in model.parameters())
    return {"total": n_all, "sparse": n_sparse, "dense": n_all - n_sparse}
