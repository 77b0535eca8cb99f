"""benchmarks/quality.py makes each world once under ``--work``: a rerun reuses it, a cut-off one is made again."""

import importlib.util
import sys
from pathlib import Path

from opengem.data.parquet import MANIFEST

QUALITY = Path(__file__).resolve().parents[3] / "benchmarks" / "quality.py"


def _quality():
    spec = importlib.util.spec_from_file_location("quality_bench", QUALITY)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_a_world_is_generated_once_and_a_half_written_one_again(tmp_path):
    q = _quality()
    mode = q.Mode(dev_worlds=[0], held_out=[], train_seeds=[0], world=["sizes.num_users=80"],
                  dense_lrs=(1e-3,), table_lrs=(0.1,), max_epochs=1)
    out = q.synthetic_world(tmp_path, 0, mode)
    first = (out / MANIFEST).stat().st_mtime_ns
    assert q.synthetic_world(tmp_path, 0, mode) == out
    assert (out / MANIFEST).stat().st_mtime_ns == first  # reused: the check looked for a file generate never writes
    (out / MANIFEST).unlink()  # as if generation had been killed before its last write
    q.synthetic_world(tmp_path, 0, mode)
    assert (out / MANIFEST).exists()
