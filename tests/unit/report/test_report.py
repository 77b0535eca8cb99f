"""The HTML report of a hand-made run directory: files written, figures readable, drawn
values right."""

import io
import json
import logging
import math
import re
from pathlib import PurePosixPath

import numpy as np
import pytest
from matplotlib.image import imread

from opengem.report import build_report, make_report, reliability_bins
from opengem.report.build import render, summary_section
from opengem.report.calibration import slice_bins
from opengem.report.logs import JsonFormatter, configure_logging
from opengem.report.plots import (
    ema,
    entropy,
    oracle_ne,
    plot_heldout_ne,
    plot_loss,
    plot_metric_bars,
    plot_train_ne,
)
from opengem.report.sources import load_sources
from opengem.run import BASE_RATES_FILE, EVALUATION_FILE, FINAL_FILE, METRICS_FILE, REPORT_DIR

STEPS = [10, 20, 30, 40]
LOSS = {"feed/click": [0.30, 0.28, 0.26, 0.25], "feed/conversion": [0.050, 0.045, 0.040, 0.041],
        "video/click": [0.40, 0.35, 0.33, 0.31], "video/conversion": [0.060, 0.050, 0.049, 0.047]}
RATES = {"click": 0.1, "conversion": 0.02, "feed/click": 0.09, "feed/conversion": 0.015,
         "video/click": 0.11, "video/conversion": 0.025}
NE_AUC = {"feed/click": (0.81, 0.74), "video/click": (0.85, 0.71), "all/click": (0.83, 0.73),
          "feed/conversion": (0.9, 0.8), "video/conversion": (0.92, 0.78),
          "all/conversion": (0.91, 0.79)}
METRICS = {k: {"ne": ne, "auc": auc, "calibration": 1.01, "logloss": 0.2, "n": 100, "positives": 9}
           for k, (ne, auc) in NE_AUC.items()}
BINS = {"feed/click": {"p": [0.02, 0.1, 0.3], "y": [0.03, 0.09, 0.33], "n": [40, 40, 20]},
        "all/click": {"p": [0.05, 0.2], "y": [0.0, 0.25], "n": [50, 50]}}


def fake_run(root, eval_lines=()):
    run = root / "run"
    run.mkdir()
    lines = [{"step": s, "examples": 64 * s, "loss": sum(v[i] for v in LOSS.values()),
              "lr_factor": s / 40, "examples_per_s": 1000.0 + s,
              "loss_by_domain_task": {k: v[i] for k, v in LOSS.items()}}
             for i, s in enumerate(STEPS)]
    (run / METRICS_FILE).write_text("".join(json.dumps(x) + "\n" for x in [*lines, *eval_lines]))
    (run / BASE_RATES_FILE).write_text(json.dumps(RATES))
    (run / FINAL_FILE).write_text(json.dumps({
        "steps": 40, "examples": 2560, "parameters": {"dense": 700, "sparse": 300, "total": 1000},
        "wall_s": 12.5, "examples_per_s": 204.8, "recipe": "tiny",
        "quarantined": {"bad_label": 3, "nan_dense": 1},
        "repaired": {"truncated_rows": {"ads": 2}}, "world_size": 1, "peak_rss_mb": [512.0],
        "checkpoint": "step-40"}))
    (root / EVALUATION_FILE).write_text(json.dumps({"split": "test", "rows": 200, "run": str(run),
                                                      "metrics": METRICS,
                                                    "calibration_bins": BINS}))
    scaling = {"eps_1": 1000.0, "eps_2": 1800.0, "eps_4": 3000.0, "scaling_2": 1.8,
               "scaling_4": 3.0, "peak_rss_mb": {"1": [500], "2": [400, 410], "4": [300] * 4},
               "device": "cpu", "cpu_cores": 2}
    (root / "scaling.log").write_text("1 process(es): …\n" + json.dumps(scaling) + "\n")
    rows = {n: {"ne": {"mean": ne, "std": 0.01}, "auc": {"mean": 0.7, "std": 0},
                "calibration": {"mean": 1.0, "std": 0},
                "r": {"mean": r, "std": 0.02}, "r_conversion": {"mean": r / 2, "std": 0}}
            for n, ne, r in (("alone", 0.9, 0.0), ("kd", 0.85, 0.4), ("kd+share", 0.84, 0.5))}
    (root / "transfer.json").write_text(json.dumps({"r_kd": 0.4, "r_best": 0.5, "best": "kd+share",
                                                    "ratio_best_vs_kd": 1.25, "rows": rows,
                                                    "teacher": {"ne": 0.78}}))
    return run


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One full report (drawing the figures is most of these tests' time): (html path, Report)."""
    root = tmp_path_factory.mktemp("report")
    run = fake_run(root)
    report = make_report(run, root / "out",
                         benchmarks=[root / "scaling.log", root / "transfer.json"])
    path = root / "out" / "report.html"
    path.write_text(render(report))
    return path, report


def test_report_files_and_figures(built):
    path, _ = built
    text = path.read_text()
    images = re.findall(r"<img src='([^']+)'", text)
    assert set(images) == {"loss.png", "train_ne.png", "throughput.png", "metrics.png",
                           "calibration.png", "scaling.png", "transfer.png"}
    for name in images:
        pixels = imread(path.parent / name)
        assert pixels.ndim == 3 and pixels.shape[0] >= 250 and pixels.shape[1] >= 400, name
        assert pixels[..., :3].std() > 0.01, f"{name} is blank"
    assert "<script" not in text
    for shown in ("bad_label", "nan_dense", "truncated_rows.ads", "1,000", "kd+share",
                  "Not recorded"):
        assert shown in text
    assert "no held-out NE over training" in text


def test_build_report_writes_into_the_run_and_says_what_is_missing(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / FINAL_FILE).write_text(json.dumps({"steps": 0, "quarantined": {"bad_label": 2}}))
    path = build_report(run)
    assert path == run / REPORT_DIR / "report.html"
    text = path.read_text()
    assert "<img" not in text and "bad_label" in text
    assert (
        "no training records" in text
        and "no evaluation JSON" in text
        and "no calibration curves" in text
    )


def test_plotted_series_are_the_logged_values(built):
    _, rep = built
    loss = rep.plot("loss.png").series
    assert loss["click loss|feed"] == (STEPS, LOSS["feed/click"])
    assert loss["conversion loss|video"] == (STEPS, LOSS["video/conversion"])
    total = [sum(v[i] for v in LOSS.values()) for i in range(4)]
    assert loss["loss (task-weighted sum)|loss"][1] == pytest.approx(total)
    ne = rep.plot("train_ne.png").series["click training NE|video"]
    assert ne[1] == pytest.approx([v / entropy(RATES["video/click"]) for v in LOSS["video/click"]])
    bars = rep.plot("metrics.png").series
    assert bars["NE|click"] == (["feed", "video", "all"], [0.81, 0.85, 0.83])
    assert bars["AUC|conversion"] == (["feed", "video", "all"], [0.8, 0.78, 0.79])
    cal = rep.plot("calibration.png").series
    assert cal["click calibration|feed"] == (BINS["feed/click"]["p"], BINS["feed/click"]["y"])
    # an observed rate of 0 is off a log axis
    assert cal["click calibration|all"] == ([0.2], [0.25])
    assert rep.plot("scaling.png").series["data-parallel scaling|measured"] == (
        [1, 2, 4],
        [1000, 1800, 3000],
    )
    assert rep.plot("transfer.png").series["transfer ratio R|R"] == (["kd", "kd+share"], [0.4, 0.5])
    assert rep.plot("throughput.png").series["learning-rate schedule|lr factor"] == (
        STEPS,
        [0.25, 0.5, 0.75, 1.0],
    )


def test_heldout_ne_lines_are_plotted_and_a_missing_final_is_noted(tmp_path):
    evals = [{"step": 20, "eval_split": "valid",
              "eval": {"all/click": {"ne": 0.95, "ne_bayes": 0.7}}},
             {"step": 40, "eval_split": "valid",
              "eval": {"all/click": {"ne": 0.9, "ne_bayes": 0.7}}}]
    run = fake_run(tmp_path, evals)
    (run / FINAL_FILE).unlink()
    src = load_sources(run)
    # eval lines are not training records
    assert [r["step"] for r in src.records] == STEPS and src.evals == evals
    held = plot_heldout_ne(src.evals, tmp_path)
    assert held.series["click held-out NE|all"] == ([20, 40], [0.95, 0.9])
    assert held.series["click held-out NE|NE_bayes (all)"][1] == [0.7, 0.7]
    assert "valid" in held.title
    summary_section(src)
    assert any("final.json" in n for n in src.notes)
    report = make_report(run, tmp_path / "out")
    assert [s.title for s in report.sections][1:3] == ["Held-out NE over training", "Training loss"]
    assert "valid" in report.sections[1].body


def test_ne_bars_mark_ne_bayes_and_the_oracle(tmp_path):
    m = {k: dict(v) for k, v in METRICS.items()}
    for k in m:
        m[k]["ne_bayes"] = 0.6
    m["all/click"]["oracle_captured"] = 0.5  # the oracle's NE: 1 − 0.5 · (1 − 0.6) = 0.8
    s = plot_metric_bars(m, tmp_path).series
    assert s["NE|NE_bayes"][1] == [0.6] * 6
    assert s["NE|oracle NE"][1] == pytest.approx([0.8])
    assert s["NE|oracle NE"][0] == pytest.approx([s["NE|NE_bayes"][0][2]])  # over the all/click bar
    assert "AUC|NE_bayes" not in s and oracle_ne({"ne": 0.9}) is None
    assert "NE|NE_bayes" not in plot_metric_bars(METRICS, tmp_path).series  # nothing to mark


def test_long_curves_are_smoothed_and_keep_the_raw_points(tmp_path):
    run = fake_run(tmp_path)
    lines = [{"step": 10 * s, "loss": float(s % 2),
              "loss_by_domain_task": {"feed/click": float(s % 2)}}
             for s in range(20)]
    (run / METRICS_FILE).write_text("".join(json.dumps(x) + "\n" for x in lines)
                                    + '{"step": 200, "lo')
    src = load_sources(run)
    p = plot_loss(src.records, tmp_path)
    assert p.series["click loss|raw:feed"][1] == [float(i % 2) for i in range(20)]
    # span 20 // 5
    assert p.series["click loss|feed"][1] == pytest.approx(
        ema([float(i % 2) for i in range(20)], 4)
    )
    assert "EMA, span 4 logged steps (~40 steps)" in p.title
    assert any("did not parse" in n for n in src.notes)
    # α = 0.5, normalised
    assert ema([1, 2, 3], 3) == pytest.approx([1, (2 + 0.5) / 1.5, (3 + 1 + 0.25) / 1.75])


def test_rare_task_spikes_do_not_set_the_y_range(tmp_path):
    lines = [{"step": s, "loss": 0.1,
              "loss_by_domain_task": {"feed/conversion": 8.0 if s % 7 == 0 else 0.05}}
             for s in range(1, 41)]
    p = plot_train_ne(lines, {"feed/conversion": 0.02}, tmp_path)
    assert p.series["conversion training NE|raw:feed"][1][6] > 50  # the logged spike is kept
    # the EMA's
    assert (
        max(p.series["conversion training NE|feed"][1]) < p.ylim["conversion training NE"][1] < 50
    )


def test_reliability_bins():
    p = np.array([0.1, 0.2, 0.3, 0.4, 0.9, 0.8])
    y = np.array([0, 0, 1, 0, 1, 1])
    assert reliability_bins(p, y, n_bins=3) == {"p": [0.15, 0.35, 0.85], "y": [0.0, 0.5, 1.0],
                                                "n": [2, 2, 2]}
    u = reliability_bins(p, y, n_bins=2, strategy="uniform")
    assert u["n"] == [4, 2] and u["y"] == [0.25, 1.0] and u["p"] == pytest.approx([0.25, 0.85])
    assert reliability_bins(p, y, n_bins=10)["n"] == [1] * 6  # no more bins than rows
    with pytest.raises(ValueError):
        reliability_bins(p, y[:3])


def test_slice_bins_pool_domains_and_keep_enough_rows_per_bin():
    rng = np.random.default_rng(0)
    p0, p1 = rng.uniform(0, 0.2, 300), rng.uniform(0, 0.2, 50)
    y0, y1 = (rng.uniform(size=300) < p0).astype(float), (rng.uniform(size=50) < p1).astype(float)
    rows = {(0, 0): [(p0[:100], y0[:100]), (p0[100:], y0[100:])], (1, 0): [(p1, y1)]}
    bins = slice_bins(rows, ["feed", "video"], ["click"], n_bins=20, min_rows=100)
    assert set(bins) == {"feed/click", "video/click", "all/click"}
    assert bins["feed/click"]["n"] == [100, 100, 100] and bins["video/click"]["n"] == [50]
    assert sum(bins["all/click"]["n"]) == 350 and len(bins["all/click"]["n"]) == 3
    assert bins["video/click"]["p"] == pytest.approx([p1.mean()]) and bins["video/click"]["y"] == [
        y1.mean()
    ]


def test_json_log_lines_parse():
    rec = logging.LogRecord("opengem.train", logging.WARNING, __file__, 1, "step %d of %d", (3, 9),
                            None)
    rec.step = 3
    out = json.loads(JsonFormatter().format(rec))
    assert (
        out["level"] == "WARNING"
        and out["logger"] == "opengem.train"
        and out["message"] == "step 3 of 9"
    )
    assert out["step"] == 3 and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", out["time"])

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    stream = io.StringIO()
    try:
        configure_logging(logging.INFO, "json", stream)
        logging.getLogger("opengem.x").info("hello",
                                            extra={"path": PurePosixPath("some/dir"),
                                                   "eps": math.pi})
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logging.getLogger("opengem.x").exception("failed")
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    first, second = (json.loads(x) for x in stream.getvalue().splitlines())
    assert first["message"] == "hello" and first["eps"] == math.pi
    assert first["path"] == "some/dir"  # not JSON-serialisable: written with str()
    assert second["level"] == "ERROR" and "RuntimeError: boom" in second["exc_info"]
    with pytest.raises(ValueError):
        configure_logging(logging.INFO, "yaml")
