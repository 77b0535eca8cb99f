"""benchmarks/quality.py keeps each finished trial under ``--work``: a rerun reads it back instead
of running it again; a trial that failed leaves nothing."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from test_quality_worlds import _quality

CALLS: list = []


def _fit(data: str, grid: list, seed: int) -> dict:
    CALLS.append((data, seed))
    return {"metrics": {"all/click": {"ne": 0.8125}}, "grid": grid, "n": np.int64(seed),
            "curve": np.arange(3, dtype=np.float32)}


def _fails(data: str) -> dict:
    raise RuntimeError(f"no rows in {data}")


def test_a_finished_trial_is_read_back_and_not_run_again(tmp_path):
    q = _quality()
    CALLS.clear()
    with ThreadPoolExecutor(1) as ex:
        first = q.Trials(ex, tmp_path / "trials")
        r = first.submit(_fit, "world-0", [[1e-3, 0.1]], 1).result()
        other = first.submit(_fit, "world-0", [[1e-3, 0.1]], 2).result()
    assert CALLS == [("world-0", 1), ("world-0", 2)] and other["n"] == 2
    assert len(list((tmp_path / "trials").glob("_fit-*.json"))) == 2  # one file per argument set
    with ThreadPoolExecutor(1) as ex:
        again = q.Trials(ex, tmp_path / "trials")
        kept = again.submit(_fit, "world-0", [[1e-3, 0.1]], 1).result()
    assert CALLS == [("world-0", 1), ("world-0", 2)]  # not run a third time
    assert again.reused == 1
    # the same values, numpy ones as their Python values (tuples come back as lists)
    assert kept == {"metrics": {"all/click": {"ne": 0.8125}}, "grid": [[1e-3, 0.1]], "n": 1,
                    "curve": [0.0, 1.0, 2.0]}
    assert r["metrics"] == kept["metrics"]


def test_a_failed_trial_raises_and_keeps_nothing(tmp_path):
    q = _quality()
    with ThreadPoolExecutor(1) as ex:
        trials = q.Trials(ex, tmp_path / "trials")
        with pytest.raises(RuntimeError, match="no rows in world-9"):
            trials.submit(_fails, "world-9").result()
    assert list((tmp_path / "trials").iterdir()) == []
