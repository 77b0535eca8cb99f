"""The transfer sweep's bookkeeping (benchmarks/transfer.py): cells, the choice on valid,
the headline.

A cell is (lag, student days, objective); per seed it holds, for each technique set, its metrics on
the ``valid`` day and on the ``test`` day. The set is chosen from the valid rows only
(``select_on_valid`` never touches ``test``: the unit tests hand it results whose ``test`` raises);
the test rows then grade KD and the chosen set once.

    R = (NE_alone − NE_with) / (NE_alone − NE_reference)

with the reference the teacher on the cell's task: its own head for a matched objective, its
closest head recalibrated (Platt, on the students' days) for a task it never trained on.

R is undefined (NaN) where the reference is not ahead of the student alone, which is where a stale
FM ends up once the student has a few days of its own: so each cell also has the gain over the
student alone, ``gain = NE_alone − NE_with``, defined everywhere, and ``gain_ratio`` = gain(best) /
gain(KD) where KD's mean gain is positive and larger than its spread over seeds (a gain within noise
of 0 makes the quotient noise; docs/experiments.md, 'Figures moved from code docstrings'). Where
both R are defined it is the ratio of R's numerators.
"""

from __future__ import annotations

import collections
import math
import statistics

from opengem.discipline import require_tuning_split

CHOICE_SPLIT, REPORT_SPLIT = "valid", "test"
KD = "kd"


def cell_key(lag: int, days: int, objective: str) -> str:
    return f"lag{lag}/data{days}/{objective}"


def select_on_valid(per_seed: list[dict], cell: str, cands: list[str],
                    split: str | None = None) -> tuple[str, list[str]]:
    """(the set chosen for ``cell``, each seed's own choice): per seed the lowest NE on ``split``,
    over seeds the majority (a tie: the larger mean NE gain over the student alone). Reads ``split``
    (default ``CHOICE_SPLIT``) only, and refuses test."""
    split = require_tuning_split(split or CHOICE_SPLIT, "the transfer sweep's technique set")
    rows = [seed["cells"][cell][split] for seed in per_seed]
    own = [min(cands, key=lambda n, x=x: x[n]["ne"]) for x in rows]
    gain = {n: statistics.fmean(x["alone"]["ne"] - x[n]["ne"] for x in rows) for n in cands}
    votes = collections.Counter(own)
    best = max((n for n in cands if votes[n] == max(votes.values())), key=gain.get)
    return best, own


def valid_gains(per_seed: list[dict], cell: str, cands: list[str],
                split: str | None = None) -> dict[str, float]:
    """Each candidate's mean NE gain over the student alone on ``split`` (default ``CHOICE_SPLIT``):
    what a default is chosen on."""
    split = require_tuning_split(split or CHOICE_SPLIT, "the transfer sweep's technique set")
    rows = [seed["cells"][cell][split] for seed in per_seed]
    return {n: statistics.fmean(x["alone"]["ne"] - x[n]["ne"] for x in rows) for n in cands}


def _ms(xs) -> tuple[float, float]:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return math.nan, math.nan
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def grade_cell(per_seed: list[dict], cell: str, best: str) -> dict:
    """Test figures of KD and the chosen set (mean, std over seeds), once the choice is made."""
    test = [seed["cells"][cell][REPORT_SPLIT] for seed in per_seed]
    r_kd, r_best = _ms(x[KD]["r"] for x in test), _ms(x[best]["r"] for x in test)
    g_kd, g_best = (_ms(x["alone"]["ne"] - x[n]["ne"] for x in test) for n in (KD, best))
    out = {"r_kd": r_kd[0], "r_kd_std": r_kd[1], "r_best": r_best[0], "r_best_std": r_best[1],
           "best": best, "ratio": r_best[0] / r_kd[0] if r_kd[0] and not math.isnan(r_kd[0])
                         and r_kd[0] > 0 else math.nan,
           "r_auc_best": _ms(x[best]["r_auc"] for x in test)[0],
           "r_auc_kd": _ms(x[KD]["r_auc"] for x in test)[0],
           # calibration vs ranking: what the adapter adds to KD's R, and R measured on AUC instead
           # of NE
           "r_adapter_gain": _ms(x["kd+adapter"]["r"] - x[KD]["r"] for x in test
                                 if "kd+adapter" in x)[0],
           "calibration_best": _ms(x[best]["calibration"] for x in test)[0],
           "ne_reference": _ms(x["_reference"]["ne"] for x in test)[0],
           "ne_alone": _ms(x["alone"]["ne"] for x in test)[0],
           "ne_kd": _ms(x[KD]["ne"] for x in test)[0],
           "ne_best": _ms(x[best]["ne"] for x in test)[0],
           "gain_kd": g_kd[0], "gain_kd_std": g_kd[1], "gain_best": g_best[0],
           "gain_best_std": g_best[1],
           "gain_ratio": g_best[0] / g_kd[0] if g_kd[0] > max(g_kd[1], 0.0) else math.nan,
           # every candidate's test gain, reported beside the choice (which read valid only)
           "gains": {n: _ms(x["alone"]["ne"] - x[n]["ne"] for x in test)[0]
                     for n in test[0] if n not in ("alone", "_reference")}}
    return out


def headline(cells: dict[str, dict], stale_below: float = 0.5) -> dict:
    """``ratio_best_vs_kd_stale``: the mean ratio over cells with R(KD) ≤ ``stale_below``; ``_all``:
    over all."""
    ratios = {c: v["ratio"] for c, v in cells.items() if not math.isnan(v["ratio"])}
    stale = [r for c, r in ratios.items() if cells[c]["r_kd"] <= stale_below]
    mism = [r for c, r in ratios.items() if c.endswith("/mismatched")]
    gains = [v["gain_ratio"] for v in cells.values()
             if not math.isnan(v.get("gain_ratio", math.nan))]
    return {"ratio_best_vs_kd_stale": statistics.fmean(stale) if stale else math.nan,
            "stale_cells": [c for c in ratios if cells[c]["r_kd"] <= stale_below],
            "ratio_best_vs_kd_mismatched": statistics.fmean(mism) if mism else math.nan,
            "ratio_best_vs_kd_all": statistics.fmean(ratios.values()) if ratios else math.nan,
            "gain_ratio_best_vs_kd_all": statistics.fmean(gains) if gains else math.nan,
            "gain_ratio_cells": len(gains)}
