"""Student presets: one dial from ``vm_xs`` (no sequence towers: the cheapest servable model) to
``fm_domain`` (a per-domain foundation model, the middle level of hierarchical transfer).

A student is a small GEM (``opengem.model.student``); the presets share ``StudentSize``'s optimiser
defaults (batch 128, lr 3e-3, a 20-step warm-up).
"""

from __future__ import annotations

from dataclasses import dataclass

from opengem.config import Config, DataConfig, OptimConfig, TrainConfig
from opengem.model.foundation import GEMConfig
from opengem.model.heads import HeadsConfig
from opengem.model.interaction_arch import WukongConfig
from opengem.model.interformer import InterFormerConfig
from opengem.model.sequence_arch import SequenceConfig
from opengem.recipes.gem import RECIPES, recipe


@dataclass(frozen=True)
class StudentSize:
    """One point of the student dial; every other field keeps its default.

    Args:
        embedding_dim: D.
        use_sequences: False drops the sequence towers (and InterFormer) altogether.
        max_seq_len: the history cap of every stream.
        num_layers / num_tokens / fm_rank / fm_mlp: Wukong, as in ``GEMSize``.
        recent_len: K (``min_recent`` is min(4, K)); num_pooled: M; num_heads: tower heads.
        num_sum: InterFormer's non-sequence summary tokens (one PMA and one recent token each side).
        trunk_dims: the head trunk (a task tower is half its last width, at least 16).
        batch_size / lr / sparse_lr / warmup_steps: the optimisers, as in ``GEMSize``.
    """

    embedding_dim: int
    use_sequences: bool
    max_seq_len: int
    num_layers: int
    num_tokens: int
    fm_rank: int
    fm_mlp: tuple[int, ...]
    recent_len: int
    num_pooled: int
    num_heads: int
    num_sum: int
    trunk_dims: tuple[int, ...]
    batch_size: int = 128
    lr: float = 3e-3
    sparse_lr: float = 0.1
    warmup_steps: int = 20

    def config(self, name: str) -> Config:
        """The full, validated ``Config`` of this student, recorded as recipe ``name``."""
        model = GEMConfig(
            embedding_dim=self.embedding_dim, max_seq_len=self.max_seq_len,
            use_sequences=self.use_sequences,
            wukong=WukongConfig(num_layers=self.num_layers, num_fm=self.num_tokens,
                                num_lc=self.num_tokens,
                                fm_rank=self.fm_rank, mlp_dims=self.fm_mlp),
            sequence=SequenceConfig(num_heads=self.num_heads, recent_len=self.recent_len,
                                    min_recent=min(4, self.recent_len), num_pooled=self.num_pooled),
            interformer=InterFormerConfig(num_sum=self.num_sum, num_pma=1, num_recent=1),
            heads=HeadsConfig(trunk_dims=self.trunk_dims,
                              task_dims=(max(16, self.trunk_dims[-1] // 2),)),
        )
        return Config(recipe=name, model=model, data=DataConfig(batch_size=self.batch_size),
                      optim=OptimConfig(lr=self.lr, sparse_lr=self.sparse_lr,
                                        warmup_steps=self.warmup_steps),
                      train=TrainConfig()).validate()


def vm_xs() -> Config:
    """The cheapest servable model: no sequence towers, D = 8, one Wukong layer."""
    return StudentSize(embedding_dim=8, use_sequences=False, max_seq_len=8, num_layers=1,
                       num_tokens=4, fm_rank=4, fm_mlp=(32,), recent_len=8, num_pooled=1,
                       num_heads=1, num_sum=2, trunk_dims=(32,)).config("vm_xs")


def vm_s() -> Config:
    """``vm_xs`` plus one tiny tower per stream over the latest 32 events."""
    return StudentSize(embedding_dim=8, use_sequences=True, max_seq_len=32, num_layers=1,
                       num_tokens=4, fm_rank=4, fm_mlp=(32,), recent_len=8, num_pooled=1,
                       num_heads=1, num_sum=2, trunk_dims=(32,)).config("vm_s")


def vm_m() -> Config:
    """Twice ``vm_s``'s width, 64 events of history."""
    return StudentSize(embedding_dim=16, use_sequences=True, max_seq_len=64, num_layers=1,
                       num_tokens=8, fm_rank=4, fm_mlp=(64,), recent_len=16, num_pooled=2,
                       num_heads=2, num_sum=2, trunk_dims=(64, 32)).config("vm_m")


def fm_domain() -> Config:
    """A per-domain foundation model: taught by GEM, it teaches the VMs of its surface (hierarchical
    transfer); two Wukong layers, 128 events of history."""
    return StudentSize(embedding_dim=16, use_sequences=True, max_seq_len=128, num_layers=2,
                       num_tokens=4, fm_rank=4, fm_mlp=(64,), recent_len=16, num_pooled=2,
                       num_heads=2, num_sum=4, trunk_dims=(64, 32)).config("fm_domain")


STUDENTS = {f.__name__: f for f in (vm_xs, vm_s, vm_m, fm_domain)}


def student_recipe_names() -> list[str]:
    return list(STUDENTS)


def student_recipe(name: str) -> Config:
    """A student preset as a full ``Config`` (model, batch, optimiser); a GEM recipe name (``tiny``,
    ``demo`` …) is accepted too, for a GEM-sized student."""
    if name in STUDENTS:
        return STUDENTS[name]()
    if name in RECIPES:
        return recipe(name)
    raise ValueError(f"unknown student recipe {name!r}; choose from "
                     f"{student_recipe_names() + list(RECIPES)}")
