"""The sweep's choice of technique set is made on valid only; test grades it once."""

import math

import pytest

from opengem.discipline import DisciplineError
from opengem.transfer import sweep
from opengem.transfer.sweep import cell_key, grade_cell, headline, select_on_valid

CANDS = ["kd", "kd+adapter", "kd+share"]


class _NoTest(dict):
    """A cell whose test rows may not be read."""

    def __getitem__(self, k):
        if k == "test":
            raise AssertionError("the choice read the test rows")
        return super().__getitem__(k)


def _row(ne, r=0.0):
    return {"ne": ne, "r": r, "r_auc": r, "calibration": 1.0}


def _seed(valid, test, cell):
    return {"cells": {cell: _NoTest(valid={n: _row(v) for n, v in valid.items()},
                                    test={n: _row(0.0, r) for n, r in test.items()})}}


def test_the_choice_reads_valid_only_and_test_would_have_chosen_otherwise():
    cell = cell_key(3, 1, "mismatched")
    valid = {"alone": 0.90, "kd": 0.85, "kd+adapter": 0.80, "kd+share": 0.84}  # valid: kd+adapter
    # test: kd+share
    test = {"alone": 0.0, "kd": 0.4, "kd+adapter": 0.2, "kd+share": 0.9, "_reference": 0.0}
    seeds = [_seed(valid, test, cell) for _ in range(3)]
    best, own = select_on_valid(seeds, cell, CANDS)
    assert best == "kd+adapter" and own == ["kd+adapter"] * 3
    for s in seeds:  # now grade: test is read only here
        s["cells"][cell] = dict(s["cells"][cell])
    g = grade_cell(seeds, cell, best)
    assert (
        g["r_kd"] == pytest.approx(0.4)
        and g["r_best"] == pytest.approx(0.2)
        and g["ratio"] == pytest.approx(0.5)
    )


def test_a_majority_over_seeds_and_a_tie_goes_to_the_larger_mean_gain():
    cell = cell_key(0, 1, "matched")
    a = {"alone": 1.0, "kd": 0.90, "kd+adapter": 0.95, "kd+share": 0.99}
    b = {"alone": 1.0, "kd": 0.97, "kd+adapter": 0.80, "kd+share": 0.99}
    best, own = select_on_valid([_seed(a, {}, cell), _seed(b, {}, cell)], cell, CANDS)
    # 1 vote each; gains 0.065 vs 0.125 - …
    assert own == ["kd", "kd+adapter"] and best == "kd+adapter"


def test_choosing_on_test_is_refused(monkeypatch):
    monkeypatch.setattr(sweep, "CHOICE_SPLIT", "test")
    with pytest.raises(DisciplineError):
        select_on_valid([], "c", CANDS)


def test_headline_means_over_stale_and_all_cells():
    cells = {"a/matched": {"r_kd": 0.9, "ratio": 1.1}, "b/matched": {"r_kd": 0.3, "ratio": 2.5},
             "c/mismatched": {"r_kd": 0.1, "ratio": 3.5},
             "d/mismatched": {"r_kd": 0.2, "ratio": math.nan}}
    h = headline(cells)
    assert h["ratio_best_vs_kd_stale"] == pytest.approx(3.0) and h[
        "ratio_best_vs_kd_all"
    ] == pytest.approx(7.1 / 3)
    assert h["ratio_best_vs_kd_mismatched"] == pytest.approx(3.5) and h["stale_cells"] == [
        "b/matched",
        "c/mismatched",
    ]


def test_the_gain_over_alone_is_defined_where_r_is_not():
    """A stale reference behind the student alone leaves R undefined; the NE gain over alone still
    says whether KD and the chosen set helped, and gain_ratio is their quotient."""
    cell = cell_key(7, 3, "matched")
    seeds = []
    for alone, kd, best in ((0.90, 0.88, 0.86), (0.92, 0.91, 0.88)):
        test = {"alone": _row(alone, math.nan), "kd": _row(kd, math.nan),
                "kd+adapter": _row(best, math.nan),
                "_reference": _row(0.95)}
        seeds.append({"cells": {cell: {"test": test}}})
    g = grade_cell(seeds, cell, "kd+adapter")
    assert math.isnan(g["r_kd"]) and math.isnan(g["ratio"])
    assert g["gain_kd"] == pytest.approx(0.015) and g["gain_best"] == pytest.approx(0.04)
    assert g["gain_ratio"] == pytest.approx(0.04 / 0.015) and g["ne_best"] == pytest.approx(0.87)
    h = headline({cell: g,
                  "x/mismatched": {"r_kd": -1.0, "ratio": math.nan, "gain_ratio": math.nan}})
    assert math.isnan(h["ratio_best_vs_kd_all"]) and h["gain_ratio_cells"] == 1
    assert h["gain_ratio_best_vs_kd_all"] == pytest.approx(0.04 / 0.015)


def test_no_gain_ratio_over_a_kd_gain_within_its_noise():
    cell = cell_key(7, 3, "matched")
    seeds = [{"cells": {cell: {"test": {"alone": _row(0.90), "kd": _row(kd), "kd+share": _row(0.89),
                                        "_reference": _row(0.95)}}}} for kd in (0.885, 0.906)]
    g = grade_cell(seeds, cell, "kd+share")  # KD's gain: 0.0045 +- 0.0148
    assert g["gain_kd"] == pytest.approx(0.0045) and math.isnan(g["gain_ratio"])


def test_valid_gains_read_valid_only():
    cell = cell_key(0, 1, "matched")
    valid = {"alone": 0.90, "kd": 0.85, "kd+adapter": 0.80, "kd+share": 0.95}
    seeds = [_seed(valid, {"alone": 0.0}, cell) for _ in range(2)]
    g = sweep.valid_gains(seeds, cell, CANDS)
    assert g == pytest.approx({"kd": 0.05, "kd+adapter": 0.10, "kd+share": -0.05})
