"""Fixtures shared across unit test packages."""

import pytest


@pytest.fixture(scope="session")
def tiny_v2_world(tmp_path_factory):
    """A 600-user tiny synthetic world in layout v2 (with its truth), shared read-only."""
    from opengem.world.generate import generate
    from opengem.world.presets import world_config

    data = tmp_path_factory.mktemp("tiny-v2") / "data"
    generate(world_config("tiny", 3, ["sizes.num_users=600"]), data, progress=False, layout="v2")
    return data


@pytest.fixture(scope="session")
def tiny_v2_run(tiny_v2_world, tmp_path_factory):
    """The tiny recipe trained 40 steps on ``tiny_v2_world``, shared read-only."""
    from opengem.config import apply_overrides
    from opengem.recipes import recipe
    from opengem.train.trainer import train

    out = tmp_path_factory.mktemp("tiny-v2-run") / "run"
    cfg = apply_overrides(recipe("tiny"), ["train.max_steps=40", "train.threads=1",
                                           "train.progress=false", "optim.warmup_steps=2"])
    train(cfg, tiny_v2_world, out)
    return out
