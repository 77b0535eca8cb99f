"""The report's figures: one function per PNG, each returning what it drew.

Figures are drawn with matplotlib's object API on the Agg canvas (no pyplot, no global backend
switch, no display). Each function returns a :class:`Plot` whose ``series`` are read back from the
Axes after drawing (``"<axes title>|<label>" → (x, y)``; bar charts give category names as x), so
tests check the drawn values, not the intended ones.

Slices are ``"<domain>/<task>"`` keys (``"all/<task>"`` pools the domains), as in the evaluation
JSON and ``metrics.jsonl``'s ``loss_by_domain_task``.
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
    ylim: dict[str, tuple[float, float]] = field(default_factory=dict)  # axes title → drawn y-range


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
    series, ylim = {}, {ax.get_title(): tuple(map(float, ax.get_ylim())) for ax in fig.axes}
    for ax in fig.axes:
        for line in ax.get_lines():
            label = line.get_label()
            if label.startswith(RAW) or not label.startswith("_"):
                series[f"{ax.get_title()}|{label.lstrip('_')}"] = (
                    [float(v) for v in line.get_xdata()],
                    [float(v) for v in line.get_ydata()],
                )
        for c in ax.containers:
            if isinstance(c, BarContainer) and not c.get_label().startswith("_"):
                flat = c.orientation == "horizontal"
                names = [t.get_text()
                         for t in (ax.get_yticklabels() if flat else ax.get_xticklabels())]
                values = [float(p.get_width() if flat else p.get_height()) for p in c.patches]
                series[f"{ax.get_title()}|{c.get_label()}"] = (names, values)
    return Plot(name, title, series, ylim)


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


def ema(y: list[float], span: int) -> list[float]:
    """Exponential moving average, weight ``α = 2 / (span + 1)`` on the newest point, normalised by
    the weights seen so far (pandas' ``ewm(span, adjust=True)``): no pull towards 0 at the start."""
    a, num, den, out = 2.0 / (span + 1), 0.0, 0.0, []
    for v in y:
        num, den = (1 - a) * num + v, (1 - a) * den + 1
        out.append(num / den)
    return out


def ema_span(n: int) -> int:
    """The EMA's span for ``n`` logged points: a fifth of them. One logged step is one batch, and a
    conversion slice of 256 rows holds a positive or two, so its loss jumps ~10× from step
    to step."""
    return max(1, n // 5)


def _curve(ax, x: list, y: list, label: str) -> None:
    """The logged points faintly, out of the y-range (the spikes of a rare task would set it), and
    their EMA (``ema_span``) on top."""
    span = ema_span(len(y))
    if span == 1:
        ax.plot(x, y, label=label)
        return
    raw = ax.plot(x, y, lw=0.6, alpha=0.25, label=RAW + label)[0]
    ax.plot(x, ema(y, span), color=raw.get_color(), label=label)


def _fit_y(ax) -> None:
    """The y-range of the lines that are not ``RAW``: the faint logged points are clipped to it."""
    ys = [v for line in ax.get_lines() if not line.get_label().startswith(RAW)
          for v in np.asarray(line.get_ydata(), dtype=np.float64) if math.isfinite(v)]
    if ys:
        lo, hi = min(ys), max(ys)
        pad = 0.05 * (hi - lo) or 0.05 * abs(hi) or 0.05
        ax.set_ylim(lo - pad, hi + pad)


def _ema_title(fig: Figure, what: str, records: list[dict]) -> str:
    """``what`` with the EMA's span in logged and in training steps (the figure's title
    and caption)."""
    span = ema_span(len(records))
    if span == 1:
        title = f"{what} (each logged step, not smoothed)"
    else:
        every = (records[-1]["step"] - records[0]["step"]) / max(len(records) - 1, 1)
        title = f"{what}: EMA, span {span} logged steps (~{span * every:,.0f} steps); faint: each logged step"
    fig.suptitle(title, fontsize=10)
    return title


def plot_loss(records: list[dict], out: Path, name: str = "loss.png") -> Plot:
    """Training loss over steps: the task-weighted total, then one panel per task, a line
    per domain."""
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
        _fit_y(ax)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    return _save(fig, out, name,
                 _ema_title(fig, "Training loss of the logged steps' global batches", records))


def plot_train_ne(records: list[dict], base_rates: dict[str, float], out: Path,
                  name: str = "train_ne.png") -> Plot:
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
        _fit_y(ax)
        ax.set_title(f"{task} training NE")
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    return _save(fig, out, name,
                 _ema_title(fig, "Training-batch NE (loss / entropy of the training base rate)",
                                            records))


def plot_heldout_ne(evals: list[dict], out: Path, name: str = "heldout_ne.png") -> Plot:
    """Held-out NE over training from periodic evaluation records ``{"step", "eval":
    {slice: {"ne"}}}``."""
    curves: dict[str, tuple[list, list]] = {}
    for rec in evals:
        for key, m in rec["eval"].items():
            v = m.get("ne") if isinstance(m, dict) else None
            if v is not None and math.isfinite(v):
                xs, ys = curves.setdefault(key, ([], []))
                xs.append(rec["step"])
                ys.append(v)
    tasks, domains = _tasks(curves), _domains(curves)
    last = evals[-1]["eval"] if evals else {}
    fig, axes = _figure(max(len(tasks), 1))
    for ax, task in zip(axes, tasks):
        for domain in domains:
            if f"{domain}/{task}" in curves:
                ax.plot(*curves[f"{domain}/{task}"], marker="o", ms=3, label=domain,
                        **({"color": "black", "lw": 1.8} if domain == "all" else {}))
        bayes = (last.get(f"all/{task}") or {}).get("ne_bayes")  # the same rows at every evaluation
        if bayes is not None and math.isfinite(bayes):
            ax.axhline(bayes, color="grey", lw=0.8, ls=":", label="NE_bayes (all)")
        ax.set_title(f"{task} held-out NE")
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    split = evals[-1].get("eval_split", "held-out") if evals else "held-out"
    title = f"Held-out NE over training: {split}, scored by the trainer's periodic evaluation"
    fig.suptitle(title, fontsize=10)
    return _save(fig, out, name, title)


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
    """Reliability curves per task (log-log): mean prediction vs observed rate per bin, a line
    per slice."""
    tasks = _tasks(bins)
    fig, axes = _figure(max(len(tasks), 1))
    for ax, task in zip(axes, tasks):
        lo, hi = 1.0, 0.0
        for key in sorted(bins, key=lambda k: (split_slice(k)[0] == "all", k)):
            b = bins[key]
            if split_slice(key)[1] != task:
                continue
            # log axes: observed 0 is off-scale
            pts = [(p, y) for p, y in zip(b["p"], b["y"]) if p > 0 and y > 0]
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, label=split_slice(key)[0])
                lo, hi = min(lo,
                             *(min(x) for x in zip(*pts))), max(hi, *(max(x) for x in zip(*pts)))
        if hi > 0:
            ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8, ls=":", label="_ideal")
        ax.set_xscale("log")
        ax.set_yscale("log")
        # labelled 1-2-5 ticks up to ~2 decades
        subs = (1.0, 2.0, 5.0) if 0 < lo and hi / lo <= 200 else (1.0,)
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_locator(LogLocator(subs=subs))
            axis.set_major_formatter(FormatStrFormatter("%g"))
            axis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{task} calibration")
        ax.set_xlabel("mean predicted")
        ax.set_ylabel("observed rate")
        ax.legend(fontsize=8)
    return _save(fig, out, name,
                 "Calibration (reliability bins, log axes: bins with no positives are not drawn; "
                                 "dotted: perfect calibration)")


def plot_metric_bars(metrics: dict[str, dict], out: Path, keys=("ne", "auc"),
                     name: str = "metrics.png") -> Plot:
    """One panel per metric: a group of bars per domain ("all" last), a bar per task."""
    tasks, domains = _tasks(metrics), _domains(metrics)
    fig, axes = _figure(len(keys))
    width = 0.8 / max(len(tasks), 1)
    x = np.arange(len(domains))
    for ax, metric in zip(axes, keys):
        for i, task in enumerate(tasks):
            vals = [metrics.get(f"{d}/{task}", {}).get(metric) for d in domains]
            ax.bar(x + (i - (len(tasks) - 1) / 2) * width,
                   [math.nan if v is None else v for v in vals],
                   width, label=task)
        if metric == "ne":
            _ne_limits(ax, metrics, tasks, domains, x, width)
        ax.set_xticks(x, domains)
        ax.set_title(metric.upper() if metric in ("ne", "auc") else metric)
        top = max((b.get_height() for b in ax.patches if math.isfinite(b.get_height())),
                  default=1.0)
        # headroom for the legend
        ax.set_ylim(*((0.5, 1.05) if metric == "auc" else (0.0, 1.25 * top)))
        ax.legend(fontsize=8, loc="upper left", ncols=len(tasks))
    return _save(fig, out, name, f"{' and '.join(k.upper() for k in keys)} per domain")


def oracle_ne(m: dict) -> float | None:
    """The world's oracle's NE on a slice: ``captured = (1 − NE) / (1 − NE_bayes)`` solved
    for NE."""
    oc, bayes = m.get("oracle_captured"), m.get("ne_bayes")
    return None if oc is None or bayes is None else 1.0 - oc * (1.0 - bayes)


def _ne_limits(ax, metrics: dict[str, dict], tasks: list[str], domains: list[str], x,
               width: float) -> None:
    """A tick across each NE bar at NE_bayes (the true probabilities) and at the oracle's NE, where
    the evaluation has them (synthetic data; the oracle where the manifest holds it)."""
    for label, value, style in (("NE_bayes", lambda m: m.get("ne_bayes"), {"color": "black"}),
                                ("oracle NE", oracle_ne, {"color": "crimson"})):
        pts = [(x[j] + (i - (len(tasks) - 1) / 2) * width, value(metrics[f"{d}/{t}"]))
               for i, t in enumerate(tasks) for j, d in enumerate(domains) if f"{d}/{t}" in metrics]
        pts = [(px, v) for px, v in pts if v is not None and math.isfinite(v)]
        if pts:
            ax.plot(*zip(*pts), ls="none", marker="_", ms=max(6.0, 220 * width / len(domains)),
                    mew=2, label=label, **style)


def plot_transfer(rows: dict[str, tuple[float, float]], out: Path,
                  name: str = "transfer.png") -> Plot:
    """Transfer ratio R per technique: horizontal bars (mean, with ± std when given)."""
    names = list(rows)
    fig = Figure(figsize=(7.5, max(2.6, 0.35 * len(names) + 1.2)), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    means = [rows[n][0] for n in names]
    stds = [rows[n][1] for n in names]
    ax.barh(np.arange(len(names)), means, 0.6, xerr=stds if any(s > 0 for s in stds) else None,
            label="R")
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
    ax.plot(procs, [eps[procs[0]] * n / procs[0] for n in procs], color="grey", ls=":",
            label="linear")
    ax.set_xscale("log", base=2)
    ax.set_xticks(procs, [str(n) for n in procs])
    ax.set_title("data-parallel scaling")
    ax.set_xlabel("processes")
    ax.set_ylabel("examples/s (all ranks)")
    ax.legend(fontsize=8)
    return _save(fig, out, name, "Scaling")


def plot_outcomes(points: dict[str, tuple[float, float]], out: Path,
                  name: str = "outcomes.png") -> Plot:
    """Expected conversions ÷ the truth ranking's against expected conversion NE: one point per
    policy, so how far NE and outcomes move together is seen, not assumed."""
    fig, axes = _figure(1)
    ax = axes[0]
    for label, (x, y) in points.items():
        ax.scatter([x], [y], s=30)
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("expected NE, conversion (candidates at the top slot)")
    ax.set_ylabel("expected conversions ÷ truth ranking's")
    ax.set_title("outcomes against NE")
    return _save(fig, out, name, "Outcomes against NE")
