"""The measuring discipline in code: what may shape a choice and what may only grade it.

Two rules, each one function that tuning code calls before it reads anything:

* **Tune on valid, report on test, once.** A choice (a learning rate, a recipe value, a technique
  set, a recalibration prior, the oracle's L2) is made on a split that is not ``test``;
  ``require_tuning_split`` raises otherwise. The test split is read only for the figure reported.
* **Worlds we did not design on.** Synthetic world seeds ``DEV_WORLD_SEEDS`` (0-99) are for
  development: every choice is made on them. Seeds from ``HELD_OUT_WORLD_SEED_MIN`` (1000) on are
  for reporting only; ``require_dev_world`` refuses to tune on them. Do not tune on a held-out seed,
  not even by hand: a choice read off one is a choice shaped by it, and the figure it gives is no
  longer one of a world the model was not designed on.

This module sits at the bottom of the house (it imports nothing of ours), so data, evaluation,
training, transfer and the benchmarks can all call it.
"""

from __future__ import annotations

DEV_WORLD_SEEDS = range(0, 100)
HELD_OUT_WORLD_SEED_MIN = 1000
# held-out worlds of the quality figures from issue 48 on: 1000-1002 were read in 13+ sections while
# the recipe changed (worn), so new quality figures read this block (2000-2004) instead
QUALITY_WORLD_SEED_MIN = 2000
QUALITY_WORLD_SEEDS = 5
# held-out worlds the speed races run on, each with its own structure (not the demo's): a block of
# its own, so races never read the quality figures' seeds (1000-1002 worn, 2000-2004)
RACE_WORLD_SEED_MIN = 2100
# held-out worlds of the outcome replay (benchmarks/outcomes.py), a block of its own likewise
OUTCOME_WORLD_SEED_MIN = 2200
REPORT_SPLIT = "test"


class DisciplineError(ValueError):
    """A tuning step was pointed at data it may only be graded on."""


def require_tuning_split(split: str, what: str) -> str:
    """``split`` if ``what`` (a choice, e.g. "the race's learning rate") may be made on it; the test
    split never may."""
    if split == REPORT_SPLIT:
        raise DisciplineError(f"{what} is chosen on a split other than {REPORT_SPLIT!r} "
                              f"(use 'valid'): the test split only grades the choice, once")
    return split


def require_dev_world(world_seed: int, what: str) -> int:
    """``world_seed`` if ``what`` may be tuned on it: a development seed (0-99), never a
    held-out one."""
    if world_seed not in DEV_WORLD_SEEDS:
        raise DisciplineError(f"{what} is tuned on development world seeds {DEV_WORLD_SEEDS.start}-"
                              f"{DEV_WORLD_SEEDS.stop - 1}, got {world_seed}"
                              + (" (a held-out seed: report on it, never choose on it)"
                                 if world_seed >= HELD_OUT_WORLD_SEED_MIN else ""))
    return world_seed


def race_world_seeds(n: int) -> list[int]:
    """The first ``n`` race world seeds (2100, 2101, …); generate each with
    ``structure_seed`` = its seed, so the race runs on a structure nothing was shaped on."""
    if n < 1:
        raise ValueError(f"need at least one race world seed, got {n}")
    return list(range(RACE_WORLD_SEED_MIN, RACE_WORLD_SEED_MIN + n))


def outcome_world_seeds(n: int) -> list[int]:
    """The first ``n`` outcome-replay world seeds (2200, 2201, …), structure seed = the seed."""
    if n < 1:
        raise ValueError(f"need at least one outcome world seed, got {n}")
    return list(range(OUTCOME_WORLD_SEED_MIN, OUTCOME_WORLD_SEED_MIN + n))


def quality_world_seeds(n: int) -> list[int]:
    """The first ``n`` of the quality figures' held-out seeds (2000 … 2004), structure seed = the
    seed: the block nothing was read on while the recipe changed."""
    if not 1 <= n <= QUALITY_WORLD_SEEDS:
        last = QUALITY_WORLD_SEED_MIN + QUALITY_WORLD_SEEDS - 1
        raise ValueError(f"the quality block has {QUALITY_WORLD_SEEDS} world seeds "
                         f"({QUALITY_WORLD_SEED_MIN}-{last}), asked for {n}")
    return list(range(QUALITY_WORLD_SEED_MIN, QUALITY_WORLD_SEED_MIN + n))


def held_out_world_seeds(n: int) -> list[int]:
    """The first ``n`` held-out world seeds (1000, 1001, …): the old ruler, worn by reads while
    the recipe changed (``quality_world_seeds`` for new figures)."""
    if n < 1:
        raise ValueError(f"need at least one held-out world seed, got {n}")
    return list(range(HELD_OUT_WORLD_SEED_MIN, HELD_OUT_WORLD_SEED_MIN + n))
