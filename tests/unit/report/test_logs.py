"""Quiet by default: the libraries' INFO lines are hidden below --log-level debug, ours are not."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import fbgemm_gpu

from opengem.report.logs import LibraryInfoFilter

REPO = Path(__file__).resolve().parents[3]


def _record(path: str, level: int) -> logging.LogRecord:
    return logging.LogRecord("root", level, path, 1, "Successfully loaded: 'x.so'", None, None)


def test_the_filter_drops_library_info_by_file_and_keeps_warnings_and_ours():
    inside = str(Path(fbgemm_gpu.__file__).parent / "__init__.py")
    f = LibraryInfoFilter()
    assert not f.filter(_record(inside, logging.INFO))
    assert f.filter(_record(inside, logging.WARNING))
    assert f.filter(_record(__file__, logging.INFO))


def _import_fbgemm(level: str) -> str:
    code = ("import logging; from opengem.report.logs import LEVELS, configure_logging; "
            f"configure_logging(LEVELS[{level!r}]); logging.getLogger('opengem').info('ours'); "
            f"import fbgemm_gpu")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          check=True).stderr


def test_fbgemm_import_lines_show_at_debug_only():
    quiet, debug = _import_fbgemm("info"), _import_fbgemm("debug")
    assert len(quiet.splitlines()) == 1 and quiet.rstrip().endswith("INFO opengem: ours")
    assert "Successfully loaded" in debug and "INFO opengem: ours" in debug
