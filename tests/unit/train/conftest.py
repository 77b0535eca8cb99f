"""The tiny world (seed 0) that the training tests read; generated once per session and never
written to."""

import pytest

from opengem.world.generate import generate
from opengem.world.presets import world_config


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    data = tmp_path_factory.mktemp("tiny") / "data"
    generate(world_config("tiny", seed=0), data, progress=False)
    return data
