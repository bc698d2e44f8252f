"""The report's PNG plots (matplotlib, Agg): optimizer state, peak memory, F1 (a language model's: perplexity)
against peak, loss curves, throughput and the peak's breakdown; where learning rates were tuned, the validation
metric against the rate and over steps."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from pipeline.report.columns import COLLAPSED, PEFT_SETTINGS, PHASES
from pipeline.report.tables import pareto_front, peak_phase, point_columns, with_method
from pipeline.report.tuned import tuned_points

# the training-loss plot's smoothing: an exponential moving average with this weight on the previous value
# (about the last 1 / (1 - weight) = 10 steps), bias-corrected so that its first steps are not pulled to 0
EMA_WEIGHT = 0.9
PLOTS = {
    "state_mb.png": "Optimizer state per optimizer (log scale)",
    "peak_memory.png": "Peak memory per optimizer and batch size (error bars: std over seeds)",
    "f1_vs_peak.png": "Eval F1 against peak memory; the Pareto front (less memory, higher F1) is marked",
    "perplexity_vs_peak.png": "A language model's eval perplexity (log scale) against peak memory; the Pareto "
    "front (less memory, lower perplexity) is marked",
    "train_loss.png": "Training loss per optimizer (line: exponential moving average, weight "
    f"{EMA_WEIGHT}, of the mean over seeds; faint: the raw per-step mean, band: min to max over seeds)",
    "throughput.png": "Training throughput (non-padding tokens/s) per optimizer and precision",
    "peak_breakdown.png": "Memory at the moment of the peak of the profiled step, by part (not each part's own "
    "maximum), with the phase the parts show (in brackets) and the measured and the predicted peak",
}
# the tuned section's plots ({} = the quality metric's label), drawn only where learning rates were tuned
TUNED_PLOTS = {
    "val_vs_lr.png": "Validation {} against the learning rate (line: mean over seeds, band: ± std; ring: the "
    "chosen rate, x: a rate with a collapsed run)",
    "val_curves.png": "Validation {} over training steps at each optimizer's chosen rate (mean over seeds; "
    "dotted: the steps-to-target target)",
}
# a language model's (task=causal_lm), drawn where its rates were tuned: the validation loss
LM_TUNED_PLOTS = {
    "val_loss_vs_lr.png": "A language model's validation loss against the learning rate (line: mean over seeds, "
    "band: ± std; ring: the chosen rate, the lowest)",
    "val_loss_curves.png": "A language model's validation loss over training steps at each optimizer's chosen "
    "rate (mean over seeds; dotted: the steps-to-target target)",
}
# f1_vs_peak.png's caption when the tuned section exists: its points are then the tuned ones
TUNED_F1_CAPTION = (
    "Test {} at each optimizer's tuned learning rate against peak memory; the Pareto front (less memory, "
    "higher {}) is marked"
)
TUNED_PERPLEXITY_CAPTION = (
    "A language model's test perplexity (log scale) at each optimizer's tuned learning rate against peak "
    "memory; the Pareto front (less memory, lower perplexity) is marked"
)
# the peak's parts, stacked in this order, and their colours
BREAKDOWN = {
    "weights": "peak: weights [MB]",
    "gradients": "peak: gradients [MB]",
    "optimizer state": "peak: optimizer state [MB]",
    "activations": "peak: activations [MB]",
    "logits": "peak: logits [MB]",
    "other": "peak: other [MB]",
}
BREAKDOWN_COLORS = {
    "weights": "#4c72b0",
    "gradients": "#dd8452",
    "optimizer state": "#c44e52",
    "activations": "#55a868",
    "logits": "#8172b3",
    "other": "#8c8c8c",
}
# the parts only a language model's breakdown has (task=causal_lm); every job's breakdown has the others
LM_PARTS = ["logits"]
PARTS = [column for part, column in BREAKDOWN.items() if part not in LM_PARTS]
# peak_breakdown.png's caption where a language model's logits are among its parts
LM_BREAKDOWN_CAPTION = (
    "Memory at the moment of the peak of the profiled step, by part (not each part's own maximum; a language "
    "model's logits a part of their own), with the phase the parts show (in brackets) and the measured and the "
    "predicted peak"
)
DPI = 110


def import_matplotlib() -> None:
    """Import what the plots draw with (a third of a second here) ahead of them: a sweep does it as it begins,
    while its jobs' starter still imports torch & co., so that its report does not wait for it."""
    import matplotlib.backends.backend_agg  # noqa: F401
    import matplotlib.figure  # noqa: F401
    import matplotlib.ticker  # noqa: F401


def _figure(width: float = 8, height: float = 4.5):
    import matplotlib
    from matplotlib.figure import Figure

    # files only: Agg, unless the caller (a notebook) already chose a backend
    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    return fig, fig.subplots()


def _colors(optims: list[str]) -> dict:
    """One colour per optimizer, the same in every plot: tab10, then tab20's light shades (20 in all)."""
    from matplotlib import colormaps

    palette = [*colormaps["tab10"].colors, *colormaps["tab20"].colors[1::2]]
    return {optim: palette[i % len(palette)] for i, optim in enumerate(optims)}


def _labels(table: pd.DataFrame, columns: list[str]) -> pd.Series:
    """Row labels from the columns that vary (batch size and optimizer always, when asked for; the method,
    `lora r=16`, where it varies)."""
    always = ("batch_size", "optim")
    shown = [c for c in columns if c in always or table[c].nunique(dropna=False) > 1] or columns[:1]
    named = {"batch_size": "bs {}", "model": "{}", "backend": "{}", "data": "{}", "optim": "{}", "task": "{}"}
    named["method"] = "{}"
    # (an adapter's setting, `peft_alpha=32`, left out of a full fine-tuning row's label, which has none)
    return table[shown].apply(
        lambda row: " · ".join(
            named.get(c, c + "={}").format(row[c])
            for c in shown
            if not (c in PEFT_SETTINGS and pd.isna(row[c]))
        ),
        axis=1,
    )


def _bars(table: pd.DataFrame, labels: pd.Series, column: str, colors: dict, ax, logy=False, errors=True):
    """Bars of `column`: one group per label, one colour per optimizer; error bars = std over seeds."""
    frame = table.assign(label=labels)
    pivot = lambda values: frame.pivot_table(index="label", columns="optim", values=values, sort=False)  # noqa: E731
    mean = pivot(column).reindex(columns=[o for o in colors if o in set(frame.optim)])
    std = pivot(f"{column} std").reindex(index=mean.index, columns=mean.columns).fillna(0) if errors else None
    mean.plot.bar(ax=ax, yerr=std, logy=logy, rot=0, color=[colors[o] for o in mean], capsize=3)
    for bars in ax.containers:
        if hasattr(bars, "patches"):
            ax.bar_label(bars, fmt="%.3g", fontsize=8, padding=2)
    ax.set_xlabel("")
    ax.legend(title="optimizer")


def plot_state(table: pd.DataFrame, colors: dict, path: Path) -> None:
    from matplotlib.ticker import FuncFormatter

    fig, ax = _figure()
    # the state does not depend on the batch size: one bar per optimizer and model (backend, ...)
    series = [c for c in point_columns(table) if c != "batch_size"]
    _bars(table, _labels(table, series), "state [MB]", colors, ax, logy=True, errors=False)

    def minor(value, _):  # 2 and 5 of each decade, when the axis spans less than 2 decades
        low, high = ax.get_ylim()
        lead = round(value / 10 ** math.floor(math.log10(value)))
        return f"{value:g}" if high / low < 100 and lead in (2, 5) else ""

    # plain numbers (0.1, 1, 10) rather than 10^-1
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(minor))
    ax.set_ylabel("optimizer state [MB] (log scale)")
    ax.set_title("Optimizer state")
    fig.savefig(path)


def plot_peak(table: pd.DataFrame, colors: dict, path: Path) -> None:
    fig, ax = _figure()
    _bars(table, _labels(table, point_columns(table)), "peak [MB]", colors, ax, logy=False)
    ax.set_ylabel("peak memory while training [MB]")
    ax.set_title("Peak memory per optimizer and batch size")
    fig.savefig(path)


def plot_throughput(table: pd.DataFrame, colors: dict, path: Path) -> None:
    fig, ax = _figure()
    _bars(table, _labels(table, point_columns(table)), "throughput [tokens/s]", colors, ax)
    ax.set_ylabel("training throughput [tokens/s]")
    ax.set_title("Throughput per optimizer and precision")
    fig.savefig(path)


def breakdown_parts(table: pd.DataFrame) -> dict[str, str]:
    """The parts of the peak a table's breakdown has (part -> column), in BREAKDOWN's order: those of every
    job, and a language model's logits where some row has them (a classifier's table: not that part)."""
    return {
        part: column
        for part, column in BREAKDOWN.items()
        if part not in LM_PARTS or (column in table and table[column].notna().any())
    }


def plot_breakdown(table: pd.DataFrame, path: Path, step: str = "step 2") -> None:
    """Stacked bars of what memory holds at the moment of the peak per row (the phase the parts show under
    each label), the measured peak (black tick) and the predicted one (red). A language model's rows stack
    their logits too; a classifier's row beside them has none (0)."""
    fig, ax = _figure(width=max(8, 0.7 * len(table) + 3))
    phases = peak_phase(table).map(lambda p: f"\n({PHASES[p].split(' (')[0]})" if p else "")
    labels = _labels(table, ["optim", *point_columns(table)]) + phases
    shown = breakdown_parts(table)
    none = {column: 0.0 for part, column in shown.items() if part in LM_PARTS}
    parts = table[list(shown.values())].fillna(none).set_axis(list(shown), axis=1).set_index(labels)
    parts.plot.bar(ax=ax, stacked=True, rot=30, color=[BREAKDOWN_COLORS[part] for part in shown])
    x = range(len(table))
    ax.scatter(x, table["peak [MB]"], marker="_", s=900, color="k", zorder=3, label="measured peak")
    if table["predicted peak [MB]"].notna().any():
        ax.scatter(x, table["predicted peak [MB]"], marker="_", s=900, color="r", zorder=3, label="predicted")
    ax.set_xlabel("")
    ax.set_ylabel("memory at the moment of the peak [MB]")
    ax.set_title(f"Memory at the moment of the peak ({step}), by part")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.savefig(path)


def place_labels(ax, points, texts, fontsize: float = 8) -> list:
    """Annotate each point with its text at the first of a few places around it where the label overlaps no
    label placed before (points on top of each other get labels stacked beside them); the boxes drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = ax.figure
    if not hasattr(fig.canvas, "get_renderer"):  # a bare Figure: Agg, as savefig would use for a PNG
        FigureCanvasAgg(fig)
    fig.canvas.draw()  # the layout and the axes' limits as they will be saved
    renderer = fig.canvas.get_renderer()
    offsets = [
        (6, 6),
        (6, -14),
        (-6, 6),
        (-6, -14),
        (6, 18),
        (6, -26),
        (-6, 18),
        (-6, -26),
        (6, 30),
        (6, -38),
    ]
    boxes = []
    for (x, y), text in zip(points, texts, strict=True):
        best = None
        for dx, dy in offsets:
            note = ax.annotate(
                text,
                (x, y),
                textcoords="offset points",
                xytext=(dx, dy),
                fontsize=fontsize,
                ha="left" if dx > 0 else "right",
            )
            box = note.get_window_extent(renderer).expanded(1.05, 1.1)
            free = not any(box.overlaps(b) for b in boxes)
            if free:
                best = (note, box)
                break
            note.remove()
        if best is None:  # nowhere free: the first place, offset down by the labels already there
            note = ax.annotate(
                text, (x, y), textcoords="offset points", xytext=(6, 6 - 12 * len(boxes)), fontsize=fontsize
            )
            best = (note, note.get_window_extent(renderer))
        boxes.append(best[1])
    return boxes


def plot_f1_peak(
    table: pd.DataFrame,
    colors: dict,
    path: Path,
    y: str = "eval F1 [0-1]",
    name: str = "eval F1",
    lower: bool = False,
) -> list:
    """`y` against peak memory, one point per row, the Pareto front marked (the comparison's eval F1, or the
    tuned table's test metric at each optimizer's best rate); `lower`: y is better when lower (a language
    model's perplexity, on a log scale)."""
    x = "peak [MB]"
    fig, ax = _figure()
    front = pareto_front(table, x, y, lower)
    points = table.assign(label=_labels(table, point_columns(table)), front=front)
    # a row with a collapsed run (predictions all one class): a hollow marker, named in the legend
    hollow = points.get(COLLAPSED, pd.Series(0, index=points.index)).fillna(0).gt(0)
    for optim, rows in points.groupby("optim", sort=False):
        for empty, part in rows.groupby(hollow[rows.index]):
            ax.errorbar(
                part[x],
                part[y],
                part[f"{y} std"],
                part[f"{x} std"],
                "o",
                color=colors[optim],
                mfc="none" if empty else colors[optim],
                label=f"{optim} (collapsed: hollow)" if empty else optim,
            )
    front = points[points.front].sort_values(x)
    ax.plot(front[x], front[y], "k--", drawstyle="steps-post", lw=1, label="Pareto front")
    ax.scatter(front[x], front[y], s=220, facecolors="none", edgecolors="k", lw=1.2)
    ax.set_xlabel("peak memory while training [MB]")
    ax.set_ylabel(name + (" (log scale)" if lower else ""))
    if lower:
        from matplotlib.ticker import FuncFormatter

        ax.set_yscale("log")

        def plain(value, _=None):  # 27,000 rather than 2.7 x 10^4
            return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"

        def minor(value, _):  # labelled within a decade (where there may be no major tick), else crowded
            low, high = ax.get_ylim()
            return plain(value) if high / low < 10 else ""

        ax.yaxis.set_major_formatter(FuncFormatter(plain))
        ax.yaxis.set_minor_formatter(FuncFormatter(minor))
    better = "down and left" if lower else "up and left"
    ax.set_title(f"{name[0].upper()}{name[1:]} against peak memory ({better} is better)")
    ax.grid(alpha=0.3)
    ax.legend()
    shown = points.dropna(subset=[x, y])
    # the labels last, where the axes' limits are final: points on top of each other get labels that do not
    boxes = place_labels(ax, list(zip(shown[x], shown[y], strict=True)), list(shown.label))
    fig.savefig(path)
    return boxes


def ema(values, weight: float = EMA_WEIGHT) -> np.ndarray:
    """Exponential moving average, bias-corrected (as Adam's moments): s_t = w s_(t-1) + (1 - w) x_t from
    s_0 = 0, divided by 1 - w^t; a NaN (a step not logged) leaves the average where it was."""
    out, running, weights = [], 0.0, 0.0
    for value in np.asarray(values, dtype=float):
        if not np.isnan(value):
            running, weights = weight * running + (1 - weight) * value, weight * weights + (1 - weight)
        out.append(running / weights if weights else np.nan)
    return np.array(out)


def plot_losses(history: pd.DataFrame, jobs: pd.DataFrame, colors: dict, path: Path) -> None:
    """Per optimizer (and point): the loss smoothed (EMA) over the faint raw per-step mean and its band over
    seeds; raw losses of a few optimizers cross each other at every step."""
    jobs = with_method(jobs)  # a run recorded without the param `method` is full fine-tuning
    keys = point_columns(jobs[jobs.status == "FINISHED"])
    curves = history.merge(jobs[["run_id", "optim", *keys]], on="run_id")
    curves = curves.groupby(["optim", *keys, "step"], sort=False).train_loss.agg(["mean", "min", "max"])
    curves = curves.reset_index()
    fig, ax = _figure()
    styles = ["-", "--", ":", "-."]
    labels = _labels(curves, keys)
    for i, (label, by_label) in enumerate(curves.assign(label=labels).groupby("label", sort=False)):
        for optim, curve in by_label.groupby("optim", sort=False):
            curve = curve.sort_values("step")
            color, style = colors[optim], styles[i % len(styles)]
            ax.plot(curve.step, curve["mean"], style, color=color, alpha=0.3, lw=0.8)
            ax.fill_between(curve.step, curve["min"], curve["max"], color=color, alpha=0.1, lw=0)
            ax.plot(curve.step, ema(curve["mean"]), style, color=color, lw=2, label=f"{optim} · {label}")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss [nats]")
    ax.set_title(f"Training loss per optimizer (EMA, weight {EMA_WEIGHT}; faint: raw)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncols=2, title=f"EMA, weight {EMA_WEIGHT}", title_fontsize=8)
    fig.savefig(path)


def plot_val_vs_lr(rates: pd.DataFrame, colors: dict, path: Path, name: str = "macro-F1") -> None:
    """The tuned section's rate table: validation metric against the learning rate (log x), one line per
    optimizer (and point), band ± std over seeds, the chosen rate ringed, a rate with a collapsed run
    crossed."""
    fig, ax = _figure()
    styles = ["-", "--", ":", "-."]
    points = rates.assign(label=_labels(rates, tuned_points(rates)))
    for i, (label, at_point) in enumerate(points.groupby("label", sort=False)):
        for optim, line in at_point.groupby("optim", sort=False):
            line, color, style = line.sort_values("lr"), colors[optim], styles[i % len(styles)]
            ax.plot(line.lr, line["mean"], style, marker="o", ms=4, color=color, label=f"{optim} · {label}")
            spread = line["std"].fillna(0)
            ax.fill_between(
                line.lr, line["mean"] - spread, line["mean"] + spread, color=color, alpha=0.15, lw=0
            )
            best, collapsed = line[line.best], line[line.collapsed > 0]
            ax.scatter(best.lr, best["mean"], s=180, facecolors="none", edgecolors=color, lw=1.5)
            ax.scatter(collapsed.lr, collapsed["mean"], marker="x", s=70, color=color)
    ax.set_xscale("log")
    ax.set_xlabel("learning rate (log scale)")
    ax.set_ylabel(f"validation {name}")
    ax.set_title(f"Validation {name} against the learning rate")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, ncols=2)
    fig.savefig(path)


def plot_val_curves(curves: pd.DataFrame, colors: dict, path: Path, name: str = "macro-F1") -> None:
    """The validation series at each optimizer's chosen rate (mean over seeds by step), with each point's
    steps-to-target target dotted."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = _figure()
    styles = ["-", "--", ":", "-."]
    points = curves.assign(label=_labels(curves, tuned_points(curves)))
    for i, (label, at_point) in enumerate(points.groupby("label", sort=False)):
        style = styles[i % len(styles)]
        for optim, curve in at_point.groupby("optim", sort=False):
            curve, color = curve.sort_values("step"), colors[optim]
            ax.plot(
                curve.step, curve["mean"], style, marker="o", ms=3, color=color, label=f"{optim} · {label}"
            )
        ax.axhline(at_point.target.max(), ls=":", color="0.4", lw=1, label=f"target · {label}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"validation {name}")
    ax.set_title(f"Validation {name} at each optimizer's chosen rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncols=2)
    fig.savefig(path)
