"""What the commands print: the metrics table and the one-line summaries, as plain text.

    format_table({"all/click": {"ne": 0.93, "auc": 0.64, "gauc": nan, "n": 967, …}, …})
    →
    slice                           ne         auc        gauc …           n
    all/click                   0.9352      0.6391           - …         967

    - : undefined on this slice (gAUC needs users with both labels)

A metric that is undefined on a slice (``nan``/``inf`` in the evaluation, or absent) prints ``-``;
one footnote under the table says why, for the columns that have one. The functions read the
dicts that ``evaluate_run``, ``recalibrate_run`` and ``distill`` return and import nothing else.
"""

from __future__ import annotations

import math

COLUMNS = ("ne", "auc", "gauc", "calibration", "logloss", "ne_bayes", "captured", "n")

# Why a column can be undefined (opengem.evaluation.metrics): (what, what it needs), said once under
# the table.
WHY_UNDEFINED = {
    "ne": ("NE", "a base rate strictly between 0 and 1"),
    "auc": ("AUC", "both labels"),
    "gauc": ("gAUC", "users with both labels"),
    "calibration": ("calibration", "a positive"),
    "logloss": ("logloss", "rows"),
    "ne_bayes": ("NE_bayes", "true probabilities and a defined NE"),
    "captured": ("captured", "true probabilities and a defined NE"),
}


def _defined(v) -> bool:
    return v is not None and not (isinstance(v, float) and not math.isfinite(v))


def _cell(v) -> str:
    if not _defined(v):
        return f"{'-':>12}"
    return f"{v:>12,d}" if isinstance(v, int) else f"{v:>12.4f}"


def format_table(metrics: dict) -> str:
    """One row per slice (sorted), one column per metric of ``COLUMNS``, and the footnote if a ``-``
    was printed."""
    lines = [f"{'slice':<22}" + "".join(f"{c:>12}" for c in COLUMNS)]
    undefined = set()
    for key in sorted(metrics):
        m = metrics[key]
        undefined |= {c for c in COLUMNS if not _defined(m.get(c))}
        lines.append(f"{key:<22}" + "".join(_cell(m.get(c)) for c in COLUMNS))
    why = _why([c for c in COLUMNS if c in undefined and c in WHY_UNDEFINED])
    if why:
        lines += ["", f"- : undefined on this slice ({why})"]
    return "\n".join(lines)


def _why(columns: list[str]) -> str:
    needs: dict[str, list[str]] = {}
    for c in columns:
        what, need = WHY_UNDEFINED[c]
        needs.setdefault(need, []).append(what)
    return "; ".join(f"{' and '.join(w)} {'need' if len(w) > 1 else 'needs'} {need}" for need,
                     w in needs.items())


def recalibration_line(rec: dict) -> str:
    """The offsets ``recalibrate_run`` fitted, with each slice's calibration before → after."""
    before, after = rec["calibration_before"], rec["calibration_after"]
    slopes = rec.get("slopes")
    return (f"recalibrated on {rec['split']} ({rec['rows']:,} rows): "
            + (", ".join(f"slope {t} {a:.3f}" for t, a in slopes.items()) + "; " if slopes else "")
            + ", ".join(f"{k} {rec['offsets'][k]:+.3f} (calibration {before[k]:.3f} "
                        f"→ {after[k]:.3f})"
                        for k in before))


def distill_line(out: dict, task: str = "click") -> str:
    """One line of ``distill``'s evaluation: the student's NE and AUC next to the student alone, its
    teacher and GEM, and R."""
    key = f"all/{task}"
    parts = [f"{name} NE {out[k][key]['ne']:.4f} AUC {out[k][key]['auc']:.4f}"
             for name,
             k in (("student", "metrics"), ("alone", "alone"), ("teacher", "teacher"),
                   ("GEM", "gem"))
             if k in out]
    ratio = out.get("transfer_ratio", {}).get(task, "absent")
    r = "" if ratio == "absent" else (f"; transfer ratio R {ratio:.3f}" if _defined(ratio) else
                                      "; transfer ratio R - (undefined: the teacher is not ahead "
                                      "of the student alone)")
    return (
        f"{task} on {'+'.join(out['domains'])}, {out['split']} ({out['rows']:,} rows): "
        + "; ".join(parts)
        + r
    )


def signal_lines(signal: dict) -> str:
    """``evaluate --signal``: per part of the model, the slope of its logit on each true term."""
    return "\n".join(f"\n{part}: slope of the model's logit on each true term (1 = fully learned), "
                     f"corr {d['corr']:.3f}\n  "
                     + ", ".join(f"{k} {v:+.2f}" for k, v in d["slopes"].items())
                     for part, d in signal.items())


SEGMENT_COLUMNS = ("n", "positives", "ne", "ne_bayes", "auc", "calibration", "calibration_bayes",
                   "calibration_z")


def segment_lines(seg: dict) -> str:
    """``evaluate --segments``: per task, every segment's figures (``_bayes``: the truth's), the
    worst segments by calibration and by NE, and the calibration spread."""
    lines = []
    for task, d in seg["tasks"].items():
        lines += [(f"segments of {task} (NE within each segment; * fewer than "
                  f"{seg['min_rows']:,} rows: out of the worst lists and the spread)"),
                  f"{'segment':<34}" + "".join(f"{c.replace('calibration', 'cal'):>12}"
                                               for c in SEGMENT_COLUMNS)]
        for key, m in d["segments"].items():
            mark = "*" if m["n"] < seg["min_rows"] else " "
            lines.append(f"{key[:33]:<33}{mark}" + "".join(_cell(m.get(c))
                                                          for c in SEGMENT_COLUMNS))
        lines.append(segment_summary(seg, task))
        lines.append("")
    lines += [f"note: {n}" for n in seg.get("notes", [])]
    return "\n".join(lines).rstrip()


def segment_summary(seg: dict, task: str) -> str:
    """The worst segments of ``task`` by calibration and by NE, and the calibration spread, in
    three lines."""
    d = seg["tasks"][task]
    s, segs = d["spread"], d["segments"]
    worst_cal = ", ".join(f"{k} {segs[k]['calibration']:.3f} (z {segs[k]['calibration_z']:+.1f})"
                          for k in d["worst_calibration"])
    worst_ne = ", ".join(f"{k} {segs[k]['ne']:.4f}"
                         + (f" (truth {segs[k]['ne_bayes']:.4f})" if "ne_bayes" in segs[k] else "")
                         for k in d["worst_ne"])
    spread = (f"calibration spread over {s['segments']} segments of ≥ {seg['min_rows']:,} rows: "
              f"max {s['max']:.3f} ({s['max_segment']}) / min {s['min']:.3f} "
              f"({s['min_segment']}) = {s['ratio']:.3f}"
              + (f"; the truth's own {s['ratio_bayes']:.3f}" if "ratio_bayes" in s else "")
              if s else f"calibration spread: no segment of ≥ {seg['min_rows']:,} rows")
    return (f"worst calibration: {worst_cal or '-'}\nworst NE: {worst_ne or '-'}\n{spread}")


def worst_segment_line(seg: dict) -> str:
    """One line naming the worst-calibrated segment of the first task (``opengem demo``)."""
    task = next(iter(seg["tasks"]))
    d = seg["tasks"][task]
    if not d["worst_calibration"]:
        return f"worst-calibrated segment: none of ≥ {seg['min_rows']:,} rows"
    key = d["worst_calibration"][0]
    m = d["segments"][key]
    truth = (f", the truth's {m['calibration_bayes']:.3f}" if "calibration_bayes" in m else "")
    return (f"worst-calibrated segment ({task}, of {d['spread']['segments']} with ≥ "
            f"{seg['min_rows']:,} rows): {key}, {m['n']:,} rows, calibration "
            f"{m['calibration']:.3f} (z {m['calibration_z']:+.1f}{truth}); spread max/min "
            f"{d['spread']['ratio']:.3f}")


def segment_recalibration_lines(out: dict) -> str:
    """``recalibrate --segments``: per task, the held-out log loss and calibration spread with no
    offsets, the per-domain ones and per-segment ones on top."""
    lines = [(f"offsets per segment of {out['family']} ({len(out['segments'])} segments) on "
             f"{out['split']} ({out['rows']:,} rows), fitted on one half by user and scored on "
             f"the other, both ways (prior_std {out['prior_std']}):")]
    for task, forms in out["tasks"].items():
        d = forms["domain"]["logloss"]
        lines.append(f"  {task}: " + "; ".join(
            f"{f} logloss {m['logloss']:.5f} ({(m['logloss'] / d - 1) * 100:+.2f} % vs domain), "
            f"calibration max/min {m['calibration_ratio']:.3f}" for f, m in forms.items()))
    return "\n".join(lines)
