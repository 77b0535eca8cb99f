"""The printed metrics table: '-' where a metric is undefined, and one footnote saying why."""

import math

from opengem.report.text import distill_line, format_table, recalibration_line

FULL = {"ne": 0.9, "auc": 0.7, "gauc": 0.65, "calibration": 1.02, "logloss": 0.2, "ne_bayes": 0.6,
        "captured": 0.25, "n": 1234}


def test_defined_metrics_print_as_numbers_without_a_footnote():
    out = format_table({"all/click": FULL})
    assert out.splitlines()[1].split() == ["all/click", "0.9000", "0.7000", "0.6500", "1.0200",
                                           "0.2000", "0.6000", "0.2500", "1,234"]
    assert "-" not in out and "undefined" not in out


def test_undefined_metrics_print_a_dash_and_the_footnote_names_only_their_columns():
    no_users = {**FULL, "gauc": math.nan}
    no_positive = {k: v for k, v in FULL.items() if k not in ("ne_bayes", "captured")} | {
        "calibration": math.inf
    }
    out = format_table({"feed/click": FULL, "video/click": no_users,
                        "video/conversion": no_positive})
    lines = out.splitlines()
    assert "nan" not in out and "inf" not in out
    assert (
        lines[2].split()[3] == "-"
        and lines[3].split()[4] == "-"
        and lines[3].split()[6:8] == ["-", "-"]
    )
    assert lines[-1] == ("- : undefined on this slice (gAUC needs users with both labels; "
                         "calibration needs a positive; NE_bayes and captured need true "
                         "probabilities and a defined NE)")
    assert sum("undefined" in x for x in lines) == 1


def test_summary_lines():
    rec = {"split": "valid", "rows": 969, "offsets": {"feed/click": 0.059},
           "calibration_before": {"feed/click": 0.733}, "calibration_after": {"feed/click": 0.775}}
    assert (
        recalibration_line(rec)
        == "recalibrated on valid (969 rows): feed/click +0.059 (calibration 0.733 → 0.775)"
    )
    m = {"all/click": {"ne": 0.9, "auc": 0.6}}
    vm = {"domains": ["video"], "split": "test", "rows": 314, "metrics": m, "teacher": m,
          "transfer_ratio": {"click": 0.5}}
    assert distill_line(vm) == ("click on video, test (314 rows): student NE 0.9000 AUC 0.6000; "
                                "teacher NE 0.9000 AUC 0.6000; transfer ratio R 0.500")
    vm["transfer_ratio"] = {"click": float("nan")}  # the teacher is not ahead of the student alone
    assert distill_line(vm).endswith("transfer ratio R - (undefined: the teacher is not ahead of "
                                     "the student alone)")
