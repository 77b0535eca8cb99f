"""The report's figures: one function per PNG, each returning what it drew.

Figures are drawn with matplotlib's object API on the Agg canvas (no pyplot, no global backend
switch, no display). Each function returns a :class:`Plot` whose ``series`` are read back from the
Axes after drawing (``"<axes title>|<label>" → (x, y)``; bar charts give category names as x), so
tests check the drawn values, not the intended ones.

Slices are ``"<domain>/<task>"`` keys (``"all/<task>"`` pools the domains), as in the evaluation JSON
and ``metrics.jsonl``'s ``loss_by_domain_task``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from matplotlib.container import BarContainer
from matplotlib.figure import Figure
from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

DPI = 100
PANEL = (4.4, 3.3)  # inches per subplot
RAW = "_raw:"  # label prefix of the unsmoothed lines: kept out of the legend, kept in Plot.series


@dataclass
class Plot:
    file: str  # PNG name, relative to the report directory
    title: str
    series: dict[str, tuple[list, list]] = field(default_factory=dict)


def split_slice(key: str) -> tuple[str, str]:
    domain, _, task = key.partition("/")
    return domain, task


def entropy(rate: float) -> float:
    if not 0.0 < rate < 1.0:
        return math.nan
    return -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))


def _figure(n: int) -> tuple[Figure, list]:
    fig = Figure(figsize=(PANEL[0] * n, PANEL[1]), dpi=DPI, layout="constrained")
    return fig, list(np.atleast_1d(fig.subplots(1, n, squeeze=False)[0]))


def _save(fig: Figure, out: Path, name: str, title: str) -> Plot:
    fig.savefig(out / name)
    series = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            label = line.get_label()
            if label.startswith(RAW) or not label.startswith("_"):
                series[f"{ax.get_title()}|{label.lstrip('_')}"] = ([float(v) for v in line.get_xdata()],
                                                                 [float(v) for v in line.get_ydata()])
        for c in ax.containers:
            if isinstance(c, BarContainer) and not c.get_label().startswith("_"):
                flat = c.orientation == "horizontal"
                names = [t.get_text() for t in (ax.get_yticklabels() if flat else ax.get_xticklabels())]
                values = [float(p.get_width() if flat else p.get_height()) for p in c.patches]
                series[f"{ax.get_title()}|{c.get_label()}"] = (names, values)
    return Plot(name, title, series)


def _tasks(keys) -> list[str]:
    return list(dict.fromkeys(split_slice(k)[1] for k in keys))


def _domains(keys) -> list[str]:
    seen = list(dict.fromkeys(split_slice(k)[0] for k in keys))
    return [d for d in seen if d != "all"] + (["all"] if "all" in seen else [])


def _per_slice(records: list[dict], values) -> dict[str, tuple[list, list]]:
    """slice → (steps, values(record, slice)) over the records that have the slice."""
    out: dict[str, tuple[list, list]] = {}
    for rec in records:
        for key in rec.get("loss_by_domain_task", {}):
            v = values(rec, key)
            if v is not None and math.isfinite(v):
                xs, ys = out.setdefault(key, ([], []))
                xs.append(rec["step"])
                ys.append(v)
    return out


def smooth(y: list[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` points (fewer at the start)."""
    c = np.cumsum(np.concatenate([[0.0], np.asarray(y, dtype=np.float64)]))
    i = np.arange(1, len(y) + 1)
    return list((c[i] - c[np.maximum(i - window, 0)]) / np.minimum(i, window))


def _curve(ax, x: list, y: list, label: str) -> None:
    """The logged points faintly, their trailing mean (a tenth of the points) on top: one logged step
    is one batch, so a slice with few positives jumps from step to step."""
    window = max(1, len(y) // 10)
    if window == 1:
        ax.plot(x, y, label=label)
        return
    raw = ax.plot(x, y, lw=0.8, alpha=0.3, label=RAW + label)[0]
    ax.plot(x, smooth(y, window), color=raw.get_color(), label=label)


def plot_loss(records: list[dict], out: Path, name: str = "loss.png") -> Plot:
    """Training loss over steps: the task-weighted total, then one panel per task, a line per domain."""
    curves = _per_slice(records, lambda rec, k: rec["loss_by_domain_task"][k])
    tasks = _tasks(curves)
    fig, axes = _figure(1 + len(tasks))
    _curve(axes[0], [r["step"] for r in records], [r["loss"] for r in records], "loss")
    axes[0].set_title("loss (task-weighted sum)")
    for ax, task in zip(axes[1:], tasks):
        for key, xy in curves.items():
            if split_slice(key)[1] == task:
                _curve(ax, *xy, split_slice(key)[0])
        ax.set_title(f"{task} loss")
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    return _save(fig, out, name, "Training loss (per logging step's global batch)")


def plot_train_ne(records: list[dict], base_rates: dict[str, float], out: Path, name: str = "train_ne.png") -> Plot:
    """Loss / H(training base rate) per domain/task: NE on the training batches (not held out)."""
    def ne(rec, key):
        h = entropy(base_rates.get(key, math.nan))
        return rec["loss_by_domain_task"][key] / h if h > 0 else None

    curves = _per_slice(records, ne)
    tasks = _tasks(curves)
    fig, axes = _figure(max(len(tasks), 1))
    for ax, task in zip(axes, tasks):
        for key, xy in curves.items():
            if split_slice(key)[1] == task:
                _curve(ax, *xy, split_slice(key)[0])
        ax.axhline(1.0, color="grey", lw=0.8, ls=":", label="_base rate")
        ax.set_title(f"{task} training NE")
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    return _save(fig, out, name, "Training-batch NE (loss / entropy of the training base rate)")


def plot_heldout_ne(evals: list[dict], out: Path, name: str = "heldout_ne.png") -> Plot:
    """Held-out NE over training from periodic evaluation records ``{"step", "eval": {slice: {"ne"}}}``."""
    curves: dict[str, tuple[list, list]] = {}
    for rec in evals:
        for key, m in rec["eval"].items():
            v = m.get("ne") if isinstance(m, dict) else None
            if v is not None and math.isfinite(v):
                xs, ys = curves.setdefault(key, ([], []))
                xs.append(rec["step"])
                ys.append(v)
    tasks = _tasks(curves)
    fig, axes = _figure(max(len(tasks), 1))
    for ax, task in zip(axes, tasks):
        for key, xy in curves.items():
            if split_slice(key)[1] == task:
                ax.plot(*xy, marker="o", ms=3, label=split_slice(key)[0])
        ax.set_title(f"{task} held-out NE")
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    return _save(fig, out, name, "Held-out NE over training")


def plot_throughput(records: list[dict], out: Path, name: str = "throughput.png") -> Plot:
    """examples/s and the lr factor over steps."""
    fig, axes = _figure(2)
    steps = [r["step"] for r in records]
    axes[0].plot(steps, [r.get("examples_per_s", math.nan) for r in records], label="examples/s")
    axes[0].set_title("throughput")
    axes[1].plot(steps, [r.get("lr_factor", math.nan) for r in records], label="lr factor")
    axes[1].set_title("learning-rate schedule")
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    return _save(fig, out, name, "Throughput and learning rate")


def plot_calibration(bins: dict[str, dict], out: Path, name: str = "calibration.png") -> Plot:
    """Reliability curves per task (log-log): mean prediction vs observed rate per bin, a line per slice."""
    tasks = _tasks(bins)
    fig, axes = _figure(max(len(tasks), 1))
    for ax, task in zip(axes, tasks):
        lo, hi = 1.0, 0.0
        for key in sorted(bins, key=lambda k: (split_slice(k)[0] == "all", k)):
            b = bins[key]
            if split_slice(key)[1] != task:
                continue
            pts = [(p, y) for p, y in zip(b["p"], b["y"]) if p > 0 and y > 0]  # log axes: observed 0 is off-scale
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, label=split_slice(key)[0])
                lo, hi = min(lo, *(min(x) for x in zip(*pts))), max(hi, *(max(x) for x in zip(*pts)))
        if hi > 0:
            ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8, ls=":", label="_ideal")
        ax.set_xscale("log")
        ax.set_yscale("log")
        subs = (1.0, 2.0, 5.0) if 0 < lo and hi / lo <= 200 else (1.0,)  # labelled 1-2-5 ticks up to ~2 decades
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_locator(LogLocator(subs=subs))
            axis.set_major_formatter(FormatStrFormatter("%g"))
            axis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{task} calibration")
        ax.set_xlabel("mean predicted")
        ax.set_ylabel("observed rate")
        ax.legend(fontsize=8)
    return _save(fig, out, name, "Calibration (reliability bins, log axes: bins with no positives are not drawn; "
                                 "dotted: perfect calibration)")


def plot_metric_bars(metrics: dict[str, dict], out: Path, keys=("ne", "auc"), name: str = "metrics.png") -> Plot:
    """One panel per metric: a group of bars per domain ("all" last), a bar per task."""
    tasks, domains = _tasks(metrics), _domains(metrics)
    fig, axes = _figure(len(keys))
    width = 0.8 / max(len(tasks), 1)
    x = np.arange(len(domains))
    for ax, metric in zip(axes, keys):
        for i, task in enumerate(tasks):
            vals = [metrics.get(f"{d}/{task}", {}).get(metric) for d in domains]
            ax.bar(x + (i - (len(tasks) - 1) / 2) * width, [math.nan if v is None else v for v in vals],
                   width, label=task)
        ax.set_xticks(x, domains)
        ax.set_title(metric.upper() if metric in ("ne", "auc") else metric)
        top = max((b.get_height() for b in ax.patches if math.isfinite(b.get_height())), default=1.0)
        ax.set_ylim(*((0.5, 1.05) if metric == "auc" else (0.0, 1.25 * top)))  # headroom for the legend
        ax.legend(fontsize=8, loc="upper left", ncols=len(tasks))
    return _save(fig, out, name, f"{' and '.join(k.upper() for k in keys)} per domain")


def plot_transfer(rows: dict[str, tuple[float, float]], out: Path, name: str = "transfer.png") -> Plot:
    """Transfer ratio R per technique: horizontal bars (mean, with ± std when given)."""
    names = list(rows)
    fig = Figure(figsize=(7.5, max(2.6, 0.35 * len(names) + 1.2)), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    means = [rows[n][0] for n in names]
    stds = [rows[n][1] for n in names]
    ax.barh(np.arange(len(names)), means, 0.6, xerr=stds if any(s > 0 for s in stds) else None, label="R")
    ax.set_yticks(np.arange(len(names)), names)
    ax.invert_yaxis()
    ax.axvline(0.0, color="grey", lw=0.8)
    ax.set_title("transfer ratio R")
    ax.set_xlabel("R = (NE_alone − NE_with) / (NE_alone − NE_teacher)")
    return _save(fig, out, name, "Knowledge transfer")


def plot_scaling(eps: dict[int, float], out: Path, name: str = "scaling.png") -> Plot:
    """examples/s per process count, next to linear scaling from the smallest count."""
    procs = sorted(eps)
    fig, axes = _figure(1)
    ax = axes[0]
    ax.plot(procs, [eps[n] for n in procs], marker="o", label="measured")
    ax.plot(procs, [eps[procs[0]] * n / procs[0] for n in procs], color="grey", ls=":", label="linear")
    ax.set_xscale("log", base=2)
    ax.set_xticks(procs, [str(n) for n in procs])
    ax.set_title("data-parallel scaling")
    ax.set_xlabel("processes")
    ax.set_ylabel("examples/s (all ranks)")
    ax.legend(fontsize=8)
    return _save(fig, out, name, "Scaling")
