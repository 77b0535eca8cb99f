"""Which parts of a synthetic world's signal a model has learned (synthetic data only).

The world's true click logit is a sum of named terms (``latent.click_terms``: surface,
position, ad quality, segment × category, sequence match, ads history, …), and the conditional
conversion logit likewise. Regressing the model's logit on the centred terms (least squares, all
terms at once) gives one slope per term: 1 means the model reproduces that term at full strength,
0 that it has not picked it up. With ``captured`` (evaluate) it says *where* the missing signal is.

    z_model = a + Σ_k s_k · (term_k − mean term_k) + residual        one slope s_k per term

Terms are correlated (a user's segment shapes their history), so a slope is a partial effect:
a model can carry part of one term through a correlated one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from opengem.data.loader import ShardLoader, read_split
from opengem.data.parquet import DatasetManifest
from opengem.evaluation import EVAL_BATCH
from opengem.features.schema import FeatureSchema
from opengem.world.generate import columns_from_table, world_from_manifest
from opengem.world.latent import probabilities


def term_slopes(z_model: np.ndarray, terms: dict[str, np.ndarray]) -> dict:
    """Least-squares slopes of ``z_model`` on every centred term, their variances and corr(z_model,
    Σ terms)."""
    names = list(terms)
    x = np.stack([terms[k] - terms[k].mean() for k in names], 1)
    coef, *_ = np.linalg.lstsq(np.c_[np.ones(len(z_model)), x], z_model, rcond=None)
    z_true = x.sum(1)
    corr = (
        float(np.corrcoef(z_model, z_true)[0, 1])
        if z_model.std() > 0 and z_true.std() > 0
        else float("nan")
    )
    return {"slopes": {k: round(float(c), 4) for k, c in zip(names, coef[1:])},
            "term_var": {k: round(float(terms[k].var()), 4) for k in names},
            "corr": round(corr, 4), "var_model": round(float(z_model.var()), 4),
            "var_true": round(float(z_true.var()), 4)}


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-12, 1 - 1e-12)
    return np.log(p) - np.log1p(-p)


@torch.no_grad()
def signal_decomposition(model, schema: FeatureSchema, data_dir: str | Path, split: str = "test",
                         batch_size: int = EVAL_BATCH) -> dict:
    """Slopes of the model's click logit and conditional conversion logit on the world's terms.

    ``model(batch)`` returns logits [B, T] in schema task order (click, then conversion chained
    on it).
    """
    manifest = DatasetManifest.load(data_dir)
    world = world_from_manifest(manifest)  # raises on non-synthetic data
    loader = ShardLoader(data_dir, split, batch_size, schema, shuffle=False, epochs=1,
                         max_seq_len=model.max_seq_len(), prefetch=0)
    logits = np.concatenate([model(b).double().numpy() for b in loader])
    if loader.quarantined:
        raise ValueError(f"{data_dir}: {dict(loader.quarantined)} rows were quarantined; "
                         f"the decomposition "
                         "needs every row of the split")
    # Every column, histories joined in v2: the world's terms need the rows the loader scored.
    cols = columns_from_table(read_split(data_dir, schema, split))
    if len(cols["p_click"]) != len(logits):
        raise ValueError(f"{len(logits)} scored rows but {len(cols['p_click'])} rows in the split")
    _, _, click_terms, conv_terms = probabilities(world, cols)
    tasks = schema.task_names
    p = 1 / (1 + np.exp(-logits))
    out = {"click": term_slopes(logits[:, tasks.index("click")], click_terms)}
    if "conversion" in tasks:
        cvr = p[:, tasks.index("conversion")] / np.maximum(p[:, tasks.index("click")], 1e-12)
        out["conversion_given_click"] = term_slopes(_logit(cvr), conv_terms)
    return out
