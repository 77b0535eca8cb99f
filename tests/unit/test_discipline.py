import pytest

from opengem.discipline import (
    DEV_WORLD_SEEDS,
    HELD_OUT_WORLD_SEED_MIN,
    DisciplineError,
    held_out_world_seeds,
    quality_world_seeds,
    race_world_seeds,
    require_dev_world,
    require_tuning_split,
)


def test_tuning_refuses_the_test_split_and_names_the_choice():
    assert require_tuning_split("valid", "x") == "valid"
    with pytest.raises(DisciplineError, match="the race's learning rate.*test split"):
        require_tuning_split("test", "the race's learning rate")


@pytest.mark.parametrize("seed", [-1, 100, 999, 1000, 1234])
def test_tuning_refuses_world_seeds_outside_development(seed):
    with pytest.raises(DisciplineError, match="development world seeds 0-99"):
        require_dev_world(seed, "the demo recipe")


def test_development_and_held_out_seeds_do_not_overlap():
    assert require_dev_world(0, "x") == 0 and require_dev_world(99, "x") == 99
    held = held_out_world_seeds(3)
    assert held == [1000, 1001, 1002] and min(held) == HELD_OUT_WORLD_SEED_MIN
    assert not set(held) & set(DEV_WORLD_SEEDS)
    with pytest.raises(ValueError):
        held_out_world_seeds(0)
    # the races' block is held out and apart from the quality figures' seeds (1000-1002, 2000-2004)
    race = race_world_seeds(3)
    assert race == [2100, 2101, 2102]
    assert not set(race) & (set(DEV_WORLD_SEEDS) | set(range(2000, 2005)) | set(held))
    with pytest.raises(DisciplineError, match="held-out seed"):
        require_dev_world(race[0], "x")
    # the fresh quality block: five seeds, apart from the worn one and the races'
    fresh = quality_world_seeds(5)
    assert fresh == [2000, 2001, 2002, 2003, 2004]
    assert not set(fresh) & (set(held) | set(race) | set(DEV_WORLD_SEEDS))
    with pytest.raises(ValueError, match="2000-2004"):
        quality_world_seeds(6)


@pytest.mark.parametrize("choose", ["select_on_valid", "valid_gains"])
def test_the_transfer_sweeps_guard_checks_the_split_it_reads(choose):
    """The guard is handed the split the choice reads, so pointing the choice at test fires it."""
    from opengem.transfer import sweep

    per_seed = [{"cells": {"c": {"valid": {n: {"ne": ne} for n,
                                           ne in (("alone", 0.9), ("kd", 0.8))},
                                 "test": {n: {"ne": 0.5} for n in ("alone", "kd")}}}}]
    getattr(sweep, choose)(per_seed, "c", ["kd"])  # valid, the default: allowed
    with pytest.raises(DisciplineError, match="technique set.*test split"):
        getattr(sweep, choose)(per_seed, "c", ["kd"], split="test")
