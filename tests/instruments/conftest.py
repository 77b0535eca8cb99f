"""Fixtures shared by the peer benchmarks' tests."""

import pytest

from opengem.world.generate import generate
from opengem.world.presets import world_config


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    """Development world 0 at quality.py --quick's size (1,500 users), written once for the session;
    tests copy it before changing anything in it."""
    data = tmp_path_factory.mktemp("world") / "data"
    generate(world_config("tiny", seed=0, overrides=["sizes.num_users=1500"]), data, progress=False)
    return data
