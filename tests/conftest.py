"""Shared pytest configuration."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "distributed: starts several processes with torch.distributed (gloo, CPU)"
    )
