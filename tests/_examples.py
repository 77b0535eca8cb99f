"""Load a script of ``examples/`` as a module, for the tests that run or reuse it."""

import importlib.util
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parents[1] / "examples"


def load_example(name: str):
    """``examples/<name>.py`` as module ``name`` (examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
