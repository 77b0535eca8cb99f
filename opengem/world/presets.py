"""Synthetic-world presets: one function per world, each a ``WorldConfig`` that differs from the
defaults (the ``demo`` world) in its sizes (``tiny`` also in its event caps and impression rate):
the click and conversion models are the same in every world. Their functional form is the
``structure_seed`` knob (``opengem generate --world-seed N``, ``opengem.world.structure``),
0 by default: any preset can be any member of the family.

``world_config("demo", seed=3, overrides=["sizes.num_users=3000"])`` is what ``opengem generate
--preset demo --seed 3 sizes.num_users=3000`` generates; overrides go through the one override path
(``opengem.config.apply_overrides``).
"""

from __future__ import annotations

from collections.abc import Iterable

from opengem.config import apply_overrides
from opengem.world.generate import Behaviour, Impressions, WorldConfig, WorldSizes


def tiny() -> WorldConfig:
    """~4k rows in a fraction of a second: tests and smoke runs."""
    return WorldConfig(
        sizes=WorldSizes(num_users=400, users_per_block=160, num_days=4, history_days=14,
                         num_categories=16, num_segments=8, num_content_items=1500,
                         num_advertisers=30, num_campaigns=90,
                         initial_ads=300, new_ads_per_day=30, initial_ad_span_days=30,
                         latent_rank=4),
        behaviour=Behaviour(max_events=300, ads_max_events=60),
        impressions=Impressions(impressions_per_day=2.5))


def demo() -> WorldConfig:
    """~660k rows: the demo trains on days 0-5, validates on day 6, tests on day 7."""
    return WorldConfig()


def small() -> WorldConfig:
    """~2.6M rows."""
    return WorldConfig(sizes=WorldSizes(num_users=115000, num_days=10, num_categories=64,
                                        num_segments=48, num_content_items=20000,
                                        num_advertisers=600, num_campaigns=2000,
                                        initial_ads=4000, new_ads_per_day=300, latent_rank=6))


def large() -> WorldConfig:
    """~23M rows, streamed block by block."""
    return WorldConfig(sizes=WorldSizes(num_users=1000000, num_days=10, num_categories=128,
                                        num_segments=64, num_content_items=100000,
                                        num_advertisers=2000, num_campaigns=8000,
                                        initial_ads=16000, new_ads_per_day=1200, latent_rank=8))


WORLDS = {f.__name__: f for f in (tiny, demo, small, large)}


def world_names() -> list[str]:
    return list(WORLDS)


def world_config(preset: str, seed: int | None = None,
                 overrides: Iterable[str] = ()) -> WorldConfig:
    """The preset's config with ``seed`` and dotted ``key=value`` overrides
    (``click.target_ctr=0.05``) applied, validated; an unknown key fails with the list of
    valid ones."""
    if preset not in WORLDS:
        raise ValueError(f"unknown synthetic preset {preset!r}; choose from {sorted(WORLDS)}")
    cfg = WORLDS[preset]()
    if seed is not None:
        cfg.seed = seed
    return apply_overrides(cfg, overrides)
