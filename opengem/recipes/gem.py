"""GEM recipes: one dial from ``tiny`` to ``xl`` (≥ 1B parameters), one function per point.

The dial scales embedding dim, depth (Wukong layers), width (FM/LC tokens, FM rank, MLPs), attended
tokens (recent window, pooled tokens) and batch size together, as Wukong's recipe suggests (grow
depth first, then the rest). ``tiny`` and ``demo`` are sized for the synthetic worlds of the same
name. Every recipe trains one pass, as online ads training does. The measurements behind the
choices are in docs/experiments.md ("Recipe choices").
"""

from __future__ import annotations

from dataclasses import dataclass

from opengem.config import Config, DataConfig, OptimConfig, TrainConfig
from opengem.model.foundation import GEMConfig
from opengem.model.heads import HeadsConfig
from opengem.model.interaction_arch import WukongConfig
from opengem.model.interformer import InterFormerConfig
from opengem.model.sequence_arch import SequenceConfig
from opengem.model.sparse_arch import SparseArchConfig


@dataclass(frozen=True)
class GEMSize:
    """One point of the GEM dial: what a recipe chooses; every other field keeps its default.

    Args:
        embedding_dim: D, the width of every table and token.
        num_layers: Wukong layers.
        num_tokens: n_F = n_L, the FM and the linear-compress tokens of a Wukong layer.
        fm_rank: k, the rank of the optimised FM projection.
        fm_mlp: the FM block's MLP widths.
        num_heads: attention heads of a sequence tower.
        recent_len: K, the recent events a tower attends over (``min_recent`` is min(8, K)).
        num_pooled: M, the learned-query tokens that pool the older history.
        trunk_dims: the shared head trunk (a task tower is half its last width, at least 32).
        batch_size: rows per step (per rank).
        lr: the dense AdamW lr.
        sparse_lr: the tables' row-wise Adagrad lr.
        warmup_steps: the dense lr's linear warm-up.
        max_seq_len: the history cap of every stream.
        max_rows_per_table: 0 keeps a row per id; else ids hash into this many rows, so the sparse
            size of the big presets is explicit.
        ema_decay: > 0 serves an exponential average of the dense weights (``opengem.train.ema``); its
            best value grows with the steps of a run, so each size measures its own.
        ema_warmup: the average's decay warmed up over its first updates (``train.ema_warmup``).
    """

    embedding_dim: int
    num_layers: int
    num_tokens: int
    fm_rank: int
    fm_mlp: tuple[int, ...]
    num_heads: int
    recent_len: int
    num_pooled: int
    trunk_dims: tuple[int, ...]
    batch_size: int
    lr: float
    sparse_lr: float = 0.1
    warmup_steps: int = 200
    max_seq_len: int = 4096
    max_rows_per_table: int = 0
    ema_decay: float = 0.0
    ema_warmup: bool = False

    def config(self, name: str) -> Config:
        """The full, validated training ``Config`` of this point, recorded as recipe ``name``."""
        model = GEMConfig(
            embedding_dim=self.embedding_dim,
            max_seq_len=self.max_seq_len,
            sparse=SparseArchConfig(max_rows_per_table=self.max_rows_per_table),
            wukong=WukongConfig(num_layers=self.num_layers, num_fm=self.num_tokens,
                                num_lc=self.num_tokens,
                                fm_rank=self.fm_rank, mlp_dims=self.fm_mlp),
            sequence=SequenceConfig(num_heads=self.num_heads, recent_len=self.recent_len,
                                    min_recent=min(8, self.recent_len), num_pooled=self.num_pooled),
            interformer=InterFormerConfig(),
            heads=HeadsConfig(trunk_dims=self.trunk_dims,
                              task_dims=(max(32, self.trunk_dims[-1] // 2),)),
        )
        return Config(recipe=name, model=model, data=DataConfig(batch_size=self.batch_size),
                      optim=OptimConfig(lr=self.lr, sparse_lr=self.sparse_lr,
                                        warmup_steps=self.warmup_steps),
                      train=TrainConfig(ema_decay=self.ema_decay,
                                        ema_warmup=self.ema_warmup)).validate()


def tiny() -> Config:
    """Tests and smoke runs on the tiny world: a pass in seconds on a CPU, so a short warm-up. The
    EMA decay 0.9 was chosen on valid of development worlds (docs/experiments.md, 'EMA of the
    dense weights')."""
    return GEMSize(embedding_dim=16, num_layers=2, num_tokens=4, fm_rank=4, fm_mlp=(64,),
                   num_heads=2, recent_len=16, num_pooled=2, trunk_dims=(64, 32), batch_size=128,
                   lr=3e-3, warmup_steps=50, max_seq_len=256, ema_decay=0.9).config("tiny")


def demo() -> Config:
    """The demo world in one pass, within the demo's 10 minutes on 2 CPU cores. K = 16 recent events
    (the pooled tokens carry the older history) and D = 32 were read off a development world's test
    day before ``opengem.discipline`` existed, so the demo's own figure is a development world's,
    not a held-out one's (``benchmarks/heldout_demo.py`` reads held-out ones). The learning rates
    and the EMA decay were re-chosen on valid of development worlds at this size, the decay's
    horizon scaled to the pass's length (docs/experiments.md, 'Recipe choices' and 'Figures moved
    from code docstrings'); the decay is warmed up (``train.ema_warmup``) so that a short budget's
    average, or an early evaluation's, is not mostly the initial weights: a full pass ends as it
    did, shorter passes end better on development worlds of both families (docs/speed.md,
    'Cheaper forms and the EMA's warm-up on both families'). Valid is scored every 250 steps (the
    report's held-out NE over training; ``opengem demo`` scores a third of its files): under a
    forked RNG, on a loader of its own, so the trained parameters are those of a run without it;
    no best checkpoint is kept."""
    cfg = GEMSize(embedding_dim=32, num_layers=2, num_tokens=8, fm_rank=8, fm_mlp=(256,),
                  num_heads=2, recent_len=16, num_pooled=4, trunk_dims=(256, 128), batch_size=256,
                  lr=3e-3, sparse_lr=0.3, max_seq_len=256, ema_decay=0.99,
                  ema_warmup=True).config("demo")
    cfg.train.eval_every = 250
    return cfg.validate()


def small() -> Config:
    """One step up from demo: a third Wukong layer, histories of up to 4,096 events."""
    return GEMSize(embedding_dim=64, num_layers=3, num_tokens=16, fm_rank=16, fm_mlp=(512, 512),
                   num_heads=4, recent_len=64, num_pooled=8, trunk_dims=(512, 256), batch_size=1024,
                   lr=1e-3).config("small")


def medium() -> Config:
    """The first size with capped tables (1M rows each)."""
    return GEMSize(embedding_dim=128, num_layers=4, num_tokens=32, fm_rank=24, fm_mlp=(1024, 1024),
                   num_heads=4, recent_len=128, num_pooled=8, trunk_dims=(1024, 512),
                   batch_size=2048, lr=1e-3, max_rows_per_table=1_000_000).config("medium")


def large() -> Config:
    """A multi-GPU size: 4M rows per table, batch 4,096 per rank."""
    return GEMSize(embedding_dim=256, num_layers=6, num_tokens=48, fm_rank=48,
                   fm_mlp=(2048, 2048, 2048), num_heads=8, recent_len=256, num_pooled=16,
                   trunk_dims=(2048, 1024), batch_size=4096,
                   lr=1e-3, max_rows_per_table=4_000_000).config("large")


def xl() -> Config:
    """The ≥ 1B-parameter point (only built on the meta device here)."""
    return GEMSize(embedding_dim=512, num_layers=8, num_tokens=96, fm_rank=96,
                   fm_mlp=(8192, 8192, 8192), num_heads=8, recent_len=512, num_pooled=32,
                   trunk_dims=(4096, 2048), batch_size=8192,
                   lr=5e-4, max_rows_per_table=8_000_000).config("xl")


RECIPES = {f.__name__: f for f in (tiny, demo, small, medium, large, xl)}


def recipe(name: str) -> Config:
    """The GEM recipe ``name`` as a full, validated ``Config`` (a fresh copy each call)."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose from {sorted(RECIPES)}")
    return RECIPES[name]()


def recipe_names() -> list[str]:
    return list(RECIPES)
