"""Fixtures for the transfer tests."""

import pytest
import torch

from opengem.testing import tiny_schema


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def schema():
    return tiny_schema()
