"""``build_report``: one self-contained HTML page per run, PNG figures beside it, no JavaScript.

    OUT/report.html      summary (final.json), training curves, evaluation per slice, calibration,
                         transfer and scaling when their inputs are there; a note for every part
                         that is missing and why
    OUT/*.png            the figures (``plots.py``), referenced by relative path

OUT defaults to RUN/report. Calibration curves need reliability bins: an evaluation JSON's
``calibration_bins`` key, else ``data=`` (the data directory) computes them with one pass of the
model over ``split`` (``calibration.compute_bins``).
"""

from __future__ import annotations

import html
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from opengem.report import plots
from opengem.report.calibration import MIN_ROWS, compute_bins
from opengem.report.sources import Sources, load_sources
from opengem.report.text import segment_summary
from opengem.run import REPORT_DIR

EVAL_COLUMNS = ("ne", "ne_bayes", "captured", "auc", "gauc", "calibration", "logloss", "n",
                "positives")


@dataclass
class Section:
    title: str
    body: str = ""  # HTML
    plots: list[plots.Plot] = field(default_factory=list)


@dataclass
class Report:
    title: str
    sections: list[Section]
    notes: list[str]

    def plot(self, file: str) -> plots.Plot:
        return next(p for s in self.sections for p in s.plots if p.file == file)


def build_report(run_dir: str | Path, out: str | Path | None = None,
                 evaluation: str | Path | dict | None = None,
                 *, benchmarks=(), data: str | Path | None = None, split: str = "test",
                 n_bins: int = 20) -> Path:
    """Write ``report.html`` and its PNGs into ``out`` (default RUN/report); return the
    HTML's path."""
    out = Path(out) if out is not None else Path(run_dir) / REPORT_DIR
    report = make_report(run_dir, out, evaluation, benchmarks=benchmarks, data=data, split=split,
                         n_bins=n_bins)
    path = out / "report.html"
    path.write_text(render(report))
    return path


def make_report(run_dir, out: Path, evaluation=None, *, benchmarks=(), data=None,
                split: str = "test", n_bins: int = 20) -> Report:
    """The report's sections; draws the PNGs into ``out`` (``build_report`` adds the HTML)."""
    src = load_sources(run_dir, evaluation, benchmarks)
    out.mkdir(parents=True, exist_ok=True)
    sections = [summary_section(src), *training_sections(src, out),
                *evaluation_sections(src, out, data, split, n_bins),
                *transfer_sections(src, out), *scaling_sections(src, out),
                *outcome_sections(src, out), *explanation_sections(src), *dataset_sections(data)]
    title = f"OpenGEM run {'/'.join(src.run.resolve().parts[-2:])}"
    return Report(title, [s for s in sections if s is not None], src.notes)


# ---------------------------------------------------------------------------------- formatting
def fmt(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, bool) or not isinstance(v, int | float):
        return html.escape(str(v))
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def table(header: list[str] | None, rows: list[list]) -> str:
    head = (
        "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>" if header else ""
    )
    body = "".join("<tr>" + "".join(f"<td>{fmt(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table>{head}{body}</table>"


def _duration(s: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(s)) + f" ({s:,.1f} s)"


def _flat(d: dict, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for k, v in d.items():
        out += _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)]
    return out


# ---------------------------------------------------------------------------------- sections
def summary_section(src: Sources) -> Section:
    f = src.final
    if f is None:
        src.notes.append("no final.json: the run has not finished (figures show the steps "
                         "logged so far)")
        return Section("Summary", "<p>The run has not finished: no <code>final.json</code>.</p>")
    p = f.get("parameters", {})
    rows = [["recipe", f.get("recipe")], ["steps", f.get("steps")], ["examples", f.get("examples")],
            ["examples/s", f.get("examples_per_s")],
            ["wall time", _duration(f["wall_s"]) if "wall_s" in f else None],
            # a distilled student
            ["training time", _duration(f["train_s"]) if "train_s" in f else None],
            ["parameters (total / dense / sparse)",
             " / ".join(fmt(p.get(k)) for k in ("total", "dense", "sparse"))],
            ["world size", f.get("world_size")],
            ["peak RSS per rank (MB)", ", ".join(map(fmt, f.get("peak_rss_mb", []))) or None],
            ["checkpoint", f.get("checkpoint")], ["params_sha256", f.get("params_sha256")]]
    times = (src.evaluation or {}).get("times")  # opengem demo: seconds per stage
    if times:
        rows.append(["stage times",
                     ", ".join(f"{k.removesuffix('_s')} {v:,.0f} s" for k, v in times.items())])
    body = table(None, [r for r in rows if r[1] is not None])
    quarantined = f.get("quarantined") or {}
    body += "<h3>Quarantined rows</h3>" + (table(["reason", "rows"], sorted(quarantined.items()))
                                            if quarantined else "<p>none</p>")
    repaired = _flat(f.get("repaired") or {})
    if repaired:
        body += "<h3>Repaired</h3>" + table(["what", "count"], repaired)
    return Section("Summary", body)


def training_sections(src: Sources, out: Path) -> list[Section]:
    if not src.records:
        src.notes.append("no training records in metrics.jsonl: no training curves")
        return []
    loss = Section("Training loss",
                   "<p>Loss of the global batch at each logging step, per domain/task, as an "
                   "exponential moving average over the logged steps (the span is in each figure's "
                   "title); the logged values are drawn faintly. One logged step is one batch: a "
                   "rare task's loss jumps several-fold from one to the next, so the held-out NE "
                   "above is the curve to read.</p>",
                   [plots.plot_loss(src.records, out)])
    if src.base_rates:
        loss.plots.append(plots.plot_train_ne(src.records, src.base_rates, out))
        loss.body += ("<p>Training-batch NE is the logged loss over the entropy of the "
                      "training base rate (<code>base_rates.json</code>): it tracks the fit on the "
                      "batches trained on, not held-out data.</p>")
    loss.plots.append(plots.plot_throughput(src.records, out))
    if src.evals:
        split = html.escape(str(src.evals[-1].get("eval_split", "a held-out split")))
        held = Section("Held-out NE over training",
                       f"<p>NE on <b>{split}</b> after every periodic evaluation of the trainer "
                       f"(the same rows each "
                       "time; <code>train.eval_every</code>), with NE_bayes of all domains dotted "
                       "where the data has the true probabilities. Its time is left out "
                       "of examples/s.</p>",
                       [plots.plot_heldout_ne(src.evals, out)])
    else:
        src.notes.append("no held-out NE over training: the run did not evaluate periodically "
                         "(train.eval_every=0: metrics.jsonl holds training loss only); the final "
                         "evaluation is below")
        held = Section("Held-out NE over training",
                       "<p>Not recorded: the run was trained with train.eval_every=0; no periodic "
                       "evaluation lines (<code>{\"step\", \"eval\": {slice: {\"ne\"}}}</code>) "
                       "in metrics.jsonl.</p>")
    return [held, loss]


def evaluation_sections(src: Sources, out: Path, data, split: str, n_bins: int) -> list[Section]:
    ev = src.evaluation
    sections = []
    if ev is None:
        src.notes.append("no evaluation JSON (pass --eval FILE, or run opengem evaluate --json)")
    else:
        m = ev["metrics"]
        where = (
            f" from <code>{html.escape(src.evaluation_file)}</code>" if src.evaluation_file else ""
        )
        body = (f"<p>Split <b>{fmt(ev.get('split'))}</b>, {fmt(ev.get('rows'))} rows{where}. NE is "
                f"normalised by "
                "the training base rate; <i>captured</i> = (1 − NE) / (1 − NE of the "
                "true probabilities).</p>")
        body += table(["slice", *EVAL_COLUMNS],
                      [[k, *(m[k].get(c) for c in EVAL_COLUMNS)] for k in sorted(m)])
        if any("ne_bayes" in v for v in m.values()):
            body += ("<p>On the NE bars, a black tick marks NE_bayes (the true probabilities: "
                     "the floor)"
                     + (" and a red one the NE of the world's oracle, 1 − oracle_captured · (1 "
                        "− NE_bayes)"
                        if any("oracle_captured" in v for v in m.values()) else "") + ".</p>")
        sections.append(Section("Evaluation", body, [plots.plot_metric_bars(m, out)]))
        if "segments" in ev:
            sections.append(segment_section(ev["segments"]))
    bins = (ev or {}).get("calibration_bins")
    origin = "the evaluation JSON"
    if bins is None and data is not None:
        bins = compute_bins(src.run, data, split, n_bins)
        origin = (
            f"up to {n_bins} equal-count bins (at least {MIN_ROWS} rows each) of {split} in {data}"
        )
    if bins:
        sections.append(Section("Calibration",
                                f"<p>Reliability bins from {html.escape(str(origin))}.</p>",
                                [plots.plot_calibration(bins, out)]))
    else:
        src.notes.append("no calibration curves: the evaluation JSON has no calibration_bins; pass "
                         "--data DIR to compute them (one pass of the model over the split)")
    return sections


SEGMENT_COLUMNS = ("n", "positives", "ne", "ne_bayes", "auc", "auc_bayes", "calibration",
                   "calibration_bayes", "calibration_z")


def segment_section(seg: dict) -> Section:
    """``opengem evaluate --segments``' table per task (``opengem.evaluation.segments``), the worst
    segments and the calibration spread."""
    body = ("<p>NE within each segment (normalised by the segment's own label rate); "
            "<i>_bayes</i>: the stored true probabilities scored the same way; <i>calibration_z</i>"
            ": (Σp − Σy) / √Σp(1 − p), |z| ≤ 2 is what label noise alone gives. Segments under "
            f"{seg['min_rows']:,} rows are left out of the worst lists and the spread.</p><ul>"
            + "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(v)}</li>"
                      for k, v in seg["families"].items())
            + "".join(f"<li>{html.escape(n)}</li>" for n in seg.get("notes", [])) + "</ul>")
    for task, d in seg["tasks"].items():
        body += (f"<h3>{html.escape(task)}</h3><pre>{html.escape(segment_summary(seg, task))}</pre>"
                 + table(["segment", *SEGMENT_COLUMNS],
                         [[k, *(v.get(c) for c in SEGMENT_COLUMNS)]
                          for k, v in d["segments"].items()]))
    return Section("Segments", body)


def transfer_sections(src: Sources, out: Path) -> list[Section]:
    ev, sections = src.evaluation or {}, []
    if "transfer_ratio" in ev:
        models = [(n, k) for n,
                  k in (("student", "metrics"), ("alone", "alone"), ("teacher", "teacher"),
                                      ("GEM", "gem")) if k in ev]
        rows = [[task, *(ev[k].get(f"all/{task}", {}).get("ne") for _, k in models), r]
                for task, r in ev["transfer_ratio"].items()]
        body = (f"<p>Distilled student on "
                f"{html.escape('+'.join(ev.get('domains', [])))}, techniques "
                f"{html.escape(', '.join(ev.get('techniques', [])))}; NE per model and transfer "
                f"ratio R.</p>"
                + table(["task", *(f"NE {n}" for n, _ in models), "R"], rows))
        r = {t: (v, 0.0) for t,
             v in ev["transfer_ratio"].items() if v is not None and math.isfinite(v)}
        sections.append(Section("Knowledge transfer (this student)", body,
                                [plots.plot_transfer(r, out, "transfer_student.png")] if r else []))
    t = src.transfer
    if t is not None:
        rows = [[n, a["ne"]["mean"], a["ne"]["std"], a["auc"]["mean"], a["calibration"]["mean"],
                 a["r"]["mean"], a["r"]["std"], a.get("r_conversion", {}).get("mean")] for n,
                a in t["rows"].items()]
        body = (f"<p>benchmarks/transfer.py: R(KD) {fmt(t['r_kd'])}, best servable "
                f"set <b>{fmt(t['best'])}</b> "
                f"R {fmt(t['r_best'])} ({fmt(t['ratio_best_vs_kd'])} × KD); teacher "
                f"NE {fmt(t['teacher']['ne'])}.</p>"
                + table(["technique", "NE", "± std", "AUC", "calibration", "R", "± std",
                         "R (conversion)"], rows))
        r = {n: (a["r"]["mean"], a["r"]["std"]) for n, a in t["rows"].items() if n != "alone"}
        sections.append(Section("Knowledge transfer (benchmark)", body,
                                [plots.plot_transfer(r, out)]))
    return sections


def scaling_sections(src: Sources, out: Path) -> list[Section]:
    s = src.scaling
    if s is None:
        return []
    eps = {int(k[4:]): v for k, v in s.items() if k.startswith("eps_")}
    rss = s.get("peak_rss_mb", {})
    rows = [[n, eps[n], s.get(f"scaling_{n}", 1.0 if n == min(eps) else None),
             ", ".join(map(fmt, rss.get(str(n), [])))] for n in sorted(eps)]
    body = (f"<p>benchmarks/scaling.py on {fmt(s.get('device'))} ({fmt(s.get('cpu_cores'))} "
            f"cores), preset {fmt(s.get('preset'))}, per-rank batch "
            f"{fmt(s.get('per_rank_batch'))}, {fmt(s.get('steps'))} steps.</p>"
            + table(["processes", "examples/s", "scaling", "peak RSS per rank (MB)"], rows))
    return [Section("Scaling", body, [plots.plot_scaling(eps, out)])]


def outcome_sections(src: Sources, out: Path) -> list[Section]:
    """The auction replay: each policy's expected outcomes, its lifts over the baseline with
    their intervals, and conversions against expected NE, one point per model."""
    o = src.outcomes
    if o is None:
        return []
    base, ne = o["vs_baseline"]["baseline"], o.get("expected_ne", {})

    def lift(name: str, m: str) -> str:
        r = o["vs_baseline"].get(name, {}).get(m)
        return "–" if r is None else f"{r['ratio']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}]"

    rows = [[name, t["clicks"], t["conversions"], t["spend"], t["cost_per_conversion"],
             lift(name, "conversions"), lift(name, "cost_per_conversion"),
             o["vs_truth"].get(name, {}).get("conversions", {}).get("ratio"),
             ne.get(name, {}).get("click"), ne.get(name, {}).get("conversion")]
            for name, t in o["totals"].items()]
    body = (f"<p>Auction replay (<code>opengem outcomes</code>): {fmt(o['requests'])} requests of "
            f"{html.escape(o['split'])}, K = {o['candidates']} candidates, S = {o['slots']} slots, "
            f"second price with reserve {fmt(o['reserve'])}; expected outcomes from the world's "
            f"true probabilities; lifts over <b>{html.escape(base)}</b> with 90 % intervals over "
            f"request resamples. <i>+recal</i>: the same model recalibrated against the truth "
            f"(what calibration alone would win back).</p>"
            + table(["policy", "clicks", "conversions", "spend", "cost / conversion",
                     f"conversions ÷ {base}", f"cost / conv. ÷ {base}", "conversions ÷ truth",
                     "expected NE (click)", "expected NE (conv.)"], rows))
    points = {n: (ne[n]["conversion"], o["vs_truth"][n]["conversions"]["ratio"])
              for n in ne if n in o["vs_truth"] and "conversions" in o["vs_truth"][n]}
    return [Section("Outcomes (auction replay)", body,
                    [plots.plot_outcomes(points, out)] if points else [])]


def explanation_sections(src: Sources) -> list[Section]:
    """``opengem explain --json``: per group, mean |contribution| over the explained rows and the
    share of rows it ranks first on, per task (the largest groups first)."""
    e = src.explanations
    if e is None:
        return []
    tasks = e["tasks"]
    groups = sorted(e["summary"][tasks[0]], key=lambda g: -e["summary"][tasks[0]][g]["mean_abs"])
    rows = [[g, e["kinds"].get(g, "")] + [x for t in tasks
                                          for x in (e["summary"][t][g]["mean_abs"],
                                                    e["summary"][t][g]["first_share"])]
            for g in groups]
    body = (f"<p>Occlusion explanations (<code>opengem explain</code>) of {len(e['rows'])} rows, "
            f"logit units: a feature against {e['background_rows']} background rows of the train "
            f"split, a stream emptied; {e['forwards_per_row']} forwards per row, "
            f"{fmt(e['ms_per_row'])} ms per row.</p>"
            + table(["group", "kind"] + [h for t in tasks
                                         for h in (f"mean |Δ logit| ({t})", f"ranked first ({t})")],
                    rows))
    return [Section("Explanations", body, [])]


# ---------------------------------------------------------------------------------- HTML
STYLE = """body{font:14px/1.45 system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}
td:first-child,th:first-child{text-align:left}figure{margin:1em 0}img{max-width:100%}
figcaption{color:#555;font-size:13px}.notes{background:#fff8e1;padding:.5em 1em}"""


def dataset_sections(data) -> list[Section]:
    """The dataset card of ``--data`` (``opengem.data.card``): the manifest's, or computed from
    the shards for datasets written before cards existed."""
    if data is None:
        return []
    from opengem.data.card import card_lines, dataset_card
    from opengem.data.parquet import DatasetManifest

    card = DatasetManifest.load(data).card or dataset_card(data)
    return [Section("Dataset card", "<ul>" + "".join(f"<li>{html.escape(x)}</li>"
                                                      for x in card_lines(card)) + "</ul>")]


def render(report: Report) -> str:
    head = (f"<!DOCTYPE "
            f"html><html><head><meta charset='utf-8'><title>{html.escape(report.title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(report.title)}</h1>")
    parts = [head]
    if report.notes:
        parts.append("<div class='notes'><b>Not in this report</b><ul>"
                     + "".join(f"<li>{html.escape(n)}</li>" for n in report.notes) + "</ul></div>")
    for s in report.sections:
        parts.append(f"<h2>{html.escape(s.title)}</h2>{s.body}")
        parts += [f"<figure><img src='{html.escape(p.file)}' alt='{html.escape(p.title)}'>"
                  f"<figcaption>{html.escape(p.title)}</figcaption></figure>" for p in s.plots]
    parts.append("</body></html>\n")
    return "\n".join(parts)
