"""`python -m pipeline.report`: MLflow runs -> pandas comparison report (tables and plots) for one decision.

One row per (model, batch size, backend, optimizer): what the optimizer keeps in state and at peak, the
difference against the baseline optimizer (AdamW) of the same model, batch size and backend, and what that
costs in loss, accuracy, F1 and speed; seeds are aggregated to mean ± sample std. The report reads only what
the tracker wrote: child runs by `mlflow.search_runs`, loss curves by `MlflowClient.get_metric_history`.

Writes report.md, report.html (self-contained), runs.csv (one row per job), comparison.csv (the table as
numbers) and PNG plots to outputs/report/<sweep>/.
"""

from __future__ import annotations

import argparse
import base64
import html
import math
import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path

import pandas as pd

EXPERIMENT = "optimizer-sweep"  # conf/tracking/local.yaml's tracking.experiment
BASELINE = "adamw"
OUTPUTS = "outputs"  # conf/config.yaml's outputs_dir
# the comparison group of a row: Δ is taken against the baseline optimizer of the same group
GROUP = ["model", "batch_size", "backend", "precision"]
# settings that split rows further when a sweep varies them (never the seed: seeds are the repeats)
OTHER_SETTINGS = [
    "data",
    "lr",
    "max_steps",
    "max_length",
    "weight_decay",
    "pretrained",
    "world_size",
    "sharding",
]
# comparison-table column (unit in brackets) <- MLflow metric
COLUMNS = {
    "state [MB]": "optimizer_state_mb",
    "estimated state [MB]": "estimated_optimizer_state_mb",
    "peak [MB]": "peak_memory_mb",
    "peak reserved [MB]": "peak_memory_reserved_mb",
    "predicted peak [MB]": "predicted_peak_mb",
    "prediction error [%]": "predicted_peak_error_pct",
    "peak: weights [MB]": "peak_params_mb",
    "peak: gradients [MB]": "peak_grads_mb",
    "peak: optimizer state [MB]": "peak_optimizer_mb",
    "peak: activations [MB]": "peak_activations_mb",
    "peak: other [MB]": "peak_other_mb",
    "train loss [nats]": "train_loss_final",
    "eval loss [nats]": "eval_loss",
    "eval accuracy [0-1]": "eval_accuracy",
    "eval F1 [0-1]": "eval_f1",
    "throughput [samples/s]": "train_samples_per_second",
    "throughput [tokens/s]": "train_tokens_per_second",
    "padding [0-1]": "padding_fraction",
    "MFU [0-1]": "mfu",
    "optimizer step [ms]": "optimizer_step_ms",
}
DELTAS = {"state": "state [MB]", "peak": "peak [MB]"}
SEEDS = "n [seeds]"
KEY_LABELS = {
    "optim": "optimizer",
    "batch_size": "batch size [samples]",
    "max_steps": "max steps [steps]",
    "max_length": "max length [tokens]",
    "weight_decay": "weight decay",
}
CONSOLE = ["state [MB]", "Δ state [%]", "peak [MB]", "Δ peak [%]", "eval loss [nats]", "eval F1 [0-1]"]
CONSOLE += ["throughput [samples/s]"]
LEGEND = {
    "n [seeds]": "finished jobs (seeds) behind the row; with n > 1 every value is mean ± sample std (ddof=1)",
    "state [MB]": "measured optimizer state after the last step (`optimizer_state_mb`, MB = 2^20 bytes)",
    "estimated state [MB]": "analytic state size from the parameter shapes (`estimated_optimizer_state_mb`)",
    "Δ state [MB], [%]": "state minus the baseline's state in the same model / batch size / backend group, "
    "and that difference in % of the baseline's state (negative = saves memory)",
    "peak [MB]": "peak device memory while training (`peak_memory_mb`: CUDA allocator peak, or CPU tensor peak)",
    "Δ peak [MB], [%]": "peak minus the baseline's peak in the same group, absolute and in % of the baseline's",
    "peak reserved [MB]": "CUDA caching allocator's peak (`peak_memory_reserved_mb`); empty on CPU",
    "predicted peak [MB]": "peak predicted from shapes alone (`predicted_peak_mb`: weights + state + the larger "
    "of activations and gradients + the optimizer step's temporaries), for the largest batch",
    "prediction error [%]": "(predicted − measured) / measured peak (`predicted_peak_error_pct`)",
    "peak: weights / gradients / optimizer state / activations / other [MB]": "what the peak of the profiled "
    "step (step 2) is made of, by PyTorch's MemTracker (`peak_params_mb`, ...); other = the backward pass's "
    "and the optimizer step's temporaries; empty where the tracker cannot follow the optimizer",
    "train loss [nats]": "cross-entropy of the last training step (`train_loss_final`)",
    "eval loss [nats]": "mean cross-entropy on the eval split (`eval_loss`)",
    "eval accuracy [0-1], eval F1 [0-1]": "on the eval split; F1 of label 1 for 2 labels, macro F1 otherwise",
    "throughput [samples/s]": "max_steps × batch_size / training wall time (`train_samples_per_second`)",
    "throughput [tokens/s]": "non-padding training tokens per second of training wall time (`train_tokens_per_second`)",
    "padding [0-1]": "share of the training batches' tokens that are padding (`padding_fraction`)",
    "MFU [0-1]": "model FLOPs utilisation: 6 × parameters × tokens/s against the device's peak for the precision",
    "optimizer step [ms]": "median wall time of one optimizer.step() (`optimizer_step_ms`)",
}
PLOTS = {
    "state_mb.png": "Optimizer state per optimizer (log scale)",
    "peak_memory.png": "Peak memory per optimizer and batch size (error bars: std over seeds)",
    "f1_vs_peak.png": "Eval F1 against peak memory; the Pareto front (less memory, higher F1) is marked",
    "train_loss.png": "Training loss per optimizer (line: mean over seeds, band: min to max)",
    "throughput.png": "Training throughput (non-padding tokens/s) per optimizer and precision",
    "peak_breakdown.png": "What the peak is made of (profiled step), with the measured and the predicted peak",
}
BREAKDOWN = {
    "weights": "peak: weights [MB]",
    "gradients": "peak: gradients [MB]",
    "optimizer state": "peak: optimizer state [MB]",
    "activations": "peak: activations [MB]",
    "other": "peak: other [MB]",
}
# the largest-batch table (find_batch_size=true jobs) <- MLflow metric
FIT_KEYS = ["model", "backend", "precision", "max_length", "memory_budget_mb", "optim"]
FIT_COLUMNS = {
    "largest batch [samples]": "max_batch_size",
    "predicted largest batch [samples]": "predicted_max_batch_size",
    "peak at largest batch [MB]": "max_batch_peak_memory_mb",
    "state [MB]": "optimizer_state_mb",
}
DPI = 110


class ReportError(RuntimeError):
    """What was asked for is not in the store: one line for the user, exit code 2."""


def default_tracking_uri(uri: str | None = None) -> str:
    """`uri`, else the pipeline's own rule: $MLFLOW_TRACKING_URI, else sqlite:///<abs outputs>/mlflow.db."""
    from pipeline.tracking import store_uri

    return store_uri(uri, OUTPUTS)


@contextmanager
def _store(uri: str):
    # mlflow.search_runs reads the global tracking URI, and set_tracking_uri also exports it to os.environ:
    # set it for the search only, so a caller's later runs (or tests in the same process) are untouched
    import mlflow

    previous = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield mlflow
    finally:
        mlflow.set_tracking_uri(previous)


# ---- reading -------------------------------------------------------------------------------------------


def find_sweeps(uri: str, selectors=(), experiment: str = EXPERIMENT) -> pd.DataFrame:
    """Parent runs (tag kind=sweep): those named or id'd by `selectors`, else the latest of `experiment`."""
    with _store(uri) as mlflow:
        if selectors:  # an id or a name is enough, whatever experiment the sweep is in
            sweeps = mlflow.search_runs(filter_string="tags.kind = 'sweep'", search_all_experiments=True)
        elif mlflow.get_experiment_by_name(experiment) is None:
            raise ReportError(f"no experiment {experiment!r} in {uri}: run a sweep first (make run)")
        else:
            # the latest sweep that ran jobs (a rerun whose points were all done before runs none)
            sweeps = mlflow.search_runs(
                experiment_names=[experiment],
                filter_string="tags.kind = 'sweep' and metrics.jobs > 0",
                order_by=["attributes.start_time DESC"],
                max_results=1,
            )
    if sweeps.empty:
        raise ReportError(f"no sweep in {uri}" + ("" if selectors else f", experiment {experiment!r}"))
    if not selectors:
        return sweeps
    chosen = []
    for selector in selectors:
        match = sweeps[(sweeps.run_id == selector) | (sweeps["tags.mlflow.runName"] == selector)]
        if match.empty:
            known = ", ".join(sweeps.sort_values("start_time")["tags.mlflow.runName"].tail(5))
            raise ReportError(f"no sweep with run id or name {selector!r} in {uri} (latest: {known})")
        chosen.append(match)
    return pd.concat(chosen).drop_duplicates("run_id").sort_values("start_time")


def search_jobs(uri: str, sweeps: pd.DataFrame | None = None, experiment: str = EXPERIMENT) -> pd.DataFrame:
    """Child runs of `sweeps` (or every job of `experiment`) as mlflow.search_runs gives them."""
    with _store(uri) as mlflow:
        if sweeps is None:
            if mlflow.get_experiment_by_name(experiment) is None:
                raise ReportError(f"no experiment {experiment!r} in {uri}")
            raw = mlflow.search_runs(experiment_names=[experiment])
            if "tags.kind" in raw:
                raw = raw[raw["tags.kind"] != "sweep"]
        else:
            parts = [
                mlflow.search_runs(
                    experiment_ids=[sweep.experiment_id],
                    filter_string=f"tags.mlflow.parentRunId = '{sweep.run_id}'",
                )
                for sweep in sweeps.itertuples()
            ]
            raw = pd.concat([p for p in parts if not p.empty] or [pd.DataFrame()], ignore_index=True)
    if raw.empty:
        raise ReportError(f"no jobs in {uri} for the selected sweep(s)")
    return raw


def _typed(column: pd.Series) -> pd.Series:
    """Params are strings in MLflow: integers become integers (so batch size 8 sorts before 16), other
    numbers floats, the rest stays text; each prints back as MLflow holds it."""
    text = column.dropna().astype(str)
    if len(text) and text.str.fullmatch(r"-?\d+").all():
        return pd.to_numeric(column).astype("Int64")
    numbers = pd.to_numeric(column, errors="coerce")
    return numbers if numbers.notna().sum() == column.notna().sum() else column


def job_table(raw: pd.DataFrame, sweep_names: dict[str, str] | None = None) -> pd.DataFrame:
    """One row per job: identity, status, error, every param (typed) and every metric's last value."""
    raw = raw.sort_values("start_time", ignore_index=True)
    tags = raw.reindex(
        columns=["tags.mlflow.runName", "tags.mlflow.parentRunId", "tags.error", "tags.failure_reason"]
    )
    tags.columns = ["run_name", "sweep_run_id", "error", "failure_reason"]
    jobs = pd.concat(
        [raw.run_id, tags.run_name, tags.sweep_run_id.map(sweep_names or {}).rename("sweep")], axis=1
    )
    jobs = pd.concat(
        [jobs, tags.sweep_run_id, raw.status, tags.failure_reason, tags.error, raw.start_time, raw.end_time],
        axis=1,
    )
    params = sorted(c for c in raw if c.startswith("params."))
    metrics = sorted(c for c in raw if c.startswith("metrics."))
    params = raw[params].rename(columns=lambda c: c.removeprefix("params.")).apply(_typed)
    metrics = raw[metrics].rename(columns=lambda c: c.removeprefix("metrics."))
    return pd.concat([jobs, params, metrics], axis=1)


def loss_history(uri: str, jobs: pd.DataFrame) -> pd.DataFrame:
    """Every finished job's train_loss series: run_id, step, train_loss."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    rows = [
        (run_id, m.step, m.value)
        for run_id in jobs.loc[jobs.status == "FINISHED", "run_id"]
        for m in client.get_metric_history(run_id, "train_loss")
    ]
    return pd.DataFrame(rows, columns=["run_id", "step", "train_loss"])


# ---- the comparison -------------------------------------------------------------------------------------


def point_columns(jobs: pd.DataFrame) -> list[str]:
    """What makes a comparison row besides the optimizer: the group, plus any other setting the jobs vary."""
    varied = [c for c in OTHER_SETTINGS if c in jobs and jobs[c].nunique(dropna=False) > 1]
    return GROUP + varied


def _optimizer_order(optims, baseline: str) -> list[str]:
    return sorted(set(optims), key=lambda o: (o != baseline, str(o)))


def compare(jobs: pd.DataFrame, baseline: str = BASELINE) -> pd.DataFrame:
    """The comparison table as numbers: one row per point, seeds aggregated; `<col> std` beside each mean."""
    columns = list(dict.fromkeys([*jobs.columns, *GROUP, "optim"]))  # a key no job logged stays empty
    done = jobs[jobs.status == "FINISHED"].reindex(columns=columns)
    keys = point_columns(done) + ["optim"]
    values = done.reindex(columns=list(COLUMNS.values())).astype(float)
    values.columns = list(COLUMNS)
    grouped = pd.concat([done[keys], values], axis=1).groupby(keys, dropna=False)
    table = pd.concat(
        [grouped.size().rename(SEEDS), grouped.mean(), grouped.std(ddof=1).add_suffix(" std")], axis=1
    ).reset_index()
    # Δ against the baseline optimizer of the same group (empty where the group has no finished baseline)
    group = keys[:-1]
    reference = table[table.optim == baseline].set_index(group)[list(DELTAS.values())]
    reference = table[group].join(reference, on=group)
    for name, column in DELTAS.items():
        table[f"Δ {name} [MB]"] = table[column] - reference[column]
        table[f"Δ {name} [%]"] = 100 * (table[column] - reference[column]) / reference[column]
    table["optim"] = pd.Categorical(table.optim, _optimizer_order(table.optim, baseline))
    table = table.sort_values(keys, ignore_index=True)
    table["optim"] = table.optim.astype(str)
    order = [*keys, SEEDS, "state [MB]", "estimated state [MB]", "Δ state [MB]", "Δ state [%]", "peak [MB]"]
    order += ["Δ peak [MB]", "Δ peak [%]", *list(COLUMNS)[3:]]
    return table[[c for column in order for c in (column, f"{column} std") if c in table]]


def pareto_front(table: pd.DataFrame, x: str = "peak [MB]", y: str = "eval F1 [0-1]") -> pd.Series:
    """Rows no other row beats: none has x <= and y >= with one of them strict (less memory, higher F1)."""
    points = table.dropna(subset=[x, y])
    px, py = points[x].to_numpy(), points[y].to_numpy()
    # [i, j]: row j is at least as good as row i on both and better on one
    beats = (px <= px[:, None]) & (py >= py[:, None]) & ((px < px[:, None]) | (py > py[:, None]))
    return pd.Series(~beats.any(axis=1), index=points.index).reindex(table.index, fill_value=False)


def _fmt(value, spec: str = ".4g") -> str:
    return "" if pd.isna(value) else format(value, spec)


def format_table(table: pd.DataFrame, columns=None) -> pd.DataFrame:
    """Strings for people: 4 significant digits, ± std (2 digits) where there is a std, empty where nothing
    was measured."""
    keys = [c for c in table if c in GROUP + OTHER_SETTINGS + ["optim"]]
    out = table[keys].rename(columns=KEY_LABELS)
    out[SEEDS] = table[SEEDS]
    for column in columns or [c for c in table.columns[len(keys) + 1 :] if not c.endswith(" std")]:
        spec = "+.4g" if column.startswith("Δ") else ".4g"
        std = table.get(f"{column} std", pd.Series(float("nan"), index=table.index))
        out[column] = [
            _fmt(m, spec) + (f" ± {_fmt(s, '.2g')}" if pd.notna(s) else "")
            for m, s in zip(table[column], std, strict=True)
        ]
    return out


FAILURE_LABELS = {
    "oom": "does not fit (out of memory)",
    "nan_loss": "loss became NaN/inf",
    "killed": "killed",
}


def failed_table(jobs: pd.DataFrame) -> pd.DataFrame:
    columns = [
        "run_name",
        "optim",
        "model",
        "batch_size",
        "backend",
        "seed",
        "status",
        "failure_reason",
        "error",
    ]
    failed = jobs.loc[jobs.status != "FINISHED"].reindex(columns=columns)
    failed["failure_reason"] = failed.failure_reason.map(lambda r: FAILURE_LABELS.get(r, r))
    return failed.rename(columns={"run_name": "run", "failure_reason": "why", **KEY_LABELS}).fillna("")


def is_fit_job(jobs: pd.DataFrame) -> pd.Series:
    """Jobs run with find_batch_size=true: they search a batch size instead of training."""
    return jobs["max_batch_size"].notna() if "max_batch_size" in jobs else pd.Series(False, index=jobs.index)


def fit_table(jobs: pd.DataFrame, baseline: str = BASELINE) -> pd.DataFrame:
    """Largest batch that fits the memory budget, per optimizer (seeds: the smallest found)."""
    done = jobs[is_fit_job(jobs) & (jobs.status == "FINISHED")].reindex(
        columns=list(dict.fromkeys([*FIT_KEYS, *FIT_COLUMNS.values()]))
    )
    if done.empty:
        return pd.DataFrame()
    values = done[list(FIT_COLUMNS.values())].astype(float).set_axis(list(FIT_COLUMNS), axis=1)
    table = pd.concat([done[FIT_KEYS], values], axis=1).groupby(FIT_KEYS, dropna=False).min().reset_index()
    table["optim"] = pd.Categorical(table.optim, _optimizer_order(table.optim, baseline))
    table = table.sort_values(FIT_KEYS, ignore_index=True)
    table["optim"] = table.optim.astype(str)
    labels = {**KEY_LABELS, "memory_budget_mb": "budget [MB]"}
    return table.rename(columns=labels)


def console_table(table: pd.DataFrame) -> str:
    """The short table printed at the end of a sweep."""
    return format_table(table, [c for c in CONSOLE if c in table]).to_string(index=False)


def _plain(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.map(lambda v: _fmt(v) if isinstance(v, float) else v)


def console_text(out: Path, table: pd.DataFrame) -> str:
    """What a sweep and `make report` print: the short table, and the largest batches when searched."""
    text = console_table(table) if len(table) else "no finished training jobs"
    if (out / "fits.csv").exists():
        fits = pd.read_csv(out / "fits.csv")
        text += "\n\nlargest batch that fits:\n" + _plain(fits).to_string(index=False)
    return text


# ---- plots ----------------------------------------------------------------------------------------------


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
    """Row labels from the columns that vary (batch size and optimizer always, when asked for)."""
    always = ("batch_size", "optim")
    shown = [c for c in columns if c in always or table[c].nunique(dropna=False) > 1] or columns[:1]
    named = {"batch_size": "bs {}", "model": "{}", "backend": "{}", "data": "{}", "optim": "{}"}
    return table[shown].apply(
        lambda row: " · ".join(named.get(c, c + "={}").format(row[c]) for c in shown), axis=1
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


def plot_breakdown(table: pd.DataFrame, path: Path) -> None:
    """Stacked bars of the peak's parts per row, the measured peak (black tick) and the predicted one (red)."""
    fig, ax = _figure(width=max(8, 0.7 * len(table) + 3))
    labels = _labels(table, ["optim", *point_columns(table)])
    parts = table[list(BREAKDOWN.values())].set_axis(list(BREAKDOWN), axis=1).set_index(labels)
    parts.plot.bar(ax=ax, stacked=True, rot=30, color=["#4c72b0", "#dd8452", "#c44e52", "#55a868", "#8c8c8c"])
    x = range(len(table))
    ax.scatter(x, table["peak [MB]"], marker="_", s=900, color="k", zorder=3, label="measured peak")
    if table["predicted peak [MB]"].notna().any():
        ax.scatter(x, table["predicted peak [MB]"], marker="_", s=900, color="r", zorder=3, label="predicted")
    ax.set_xlabel("")
    ax.set_ylabel("memory at the peak [MB]")
    ax.set_title("What the peak is made of")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.savefig(path)


def plot_f1_peak(table: pd.DataFrame, colors: dict, path: Path) -> None:
    x, y = "peak [MB]", "eval F1 [0-1]"
    fig, ax = _figure()
    points = table.assign(label=_labels(table, point_columns(table)), front=pareto_front(table, x, y))
    for optim, rows in points.groupby("optim", sort=False):
        ax.errorbar(
            rows[x], rows[y], rows[f"{y} std"], rows[f"{x} std"], "o", color=colors[optim], label=optim
        )
        for _, row in rows.iterrows():
            ax.annotate(row.label, (row[x], row[y]), textcoords="offset points", xytext=(6, 6), fontsize=8)
    front = points[points.front].sort_values(x)
    ax.plot(front[x], front[y], "k--", drawstyle="steps-post", lw=1, label="Pareto front")
    ax.scatter(front[x], front[y], s=220, facecolors="none", edgecolors="k", lw=1.2)
    ax.set_xlabel("peak memory while training [MB]")
    ax.set_ylabel("eval F1")
    ax.set_title("Eval F1 against peak memory (up and left is better)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path)


def plot_losses(history: pd.DataFrame, jobs: pd.DataFrame, colors: dict, path: Path) -> None:
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
            ax.plot(curve.step, curve["mean"], style, color=color, label=f"{optim} · {label}")
            ax.fill_between(curve.step, curve["min"], curve["max"], color=color, alpha=0.15, lw=0)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss [nats]")
    ax.set_title("Training loss per optimizer")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncols=2)
    fig.savefig(path)


# ---- the report -----------------------------------------------------------------------------------------


def _markdown(frame: pd.DataFrame) -> str:
    # (DataFrame.to_markdown needs tabulate; a pipe table is three lines of code)
    cell = lambda v: str(v).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = ["| " + " | ".join(map(cell, frame.columns)) + " |", "|" + " --- |" * len(frame.columns)]
    lines += ["| " + " | ".join(map(cell, row)) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines)


def _about(uri: str, sweeps: pd.DataFrame | None, jobs: pd.DataFrame, baseline: str) -> list[str]:
    """The report's preamble: where the numbers come from and how to read them, one markdown item each."""
    lines = [f"store: `{uri}`"]
    for sweep in [] if sweeps is None else sweeps.to_dict("records"):
        overrides = sweep.get("tags.overrides") or ""
        lines.append(
            f"sweep `{sweep['tags.mlflow.runName']}` (run `{sweep['run_id']}`, {sweep['status']}, "
            f"started {sweep['start_time']:%Y-%m-%d %H:%M:%S} UTC): `{overrides}`"
        )
    finished = int((jobs.status == "FINISHED").sum())
    lines.append(f"jobs: {len(jobs)}, {finished} finished, {len(jobs) - finished} not finished")
    found = lambda c: ", ".join(map(str, jobs[c].dropna().unique())) if c in jobs else ""  # noqa: E731
    lines.append(f"device: {found('device')}; data: {found('data')}; max steps: {found('max_steps')}")
    lines.append(
        f"Δ = optimizer − `{baseline}` of the same model, batch size and backend (in % of `{baseline}`'s value); "
        "with several seeds a value is mean ± sample std (ddof=1) over n seeds; "
        "an empty cell was not measured (e.g. CUDA figures on CPU); MB = 2^20 bytes"
    )
    return lines


def write_report(
    out: Path,
    title: str,
    about: list[str],
    jobs: pd.DataFrame,
    table: pd.DataFrame,
    history: pd.DataFrame,
    baseline: str = BASELINE,
    fits: pd.DataFrame | None = None,
) -> None:
    """report.md, report.html, runs.csv, comparison.csv (fits.csv) and the PNG plots, into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    jobs.to_csv(out / "runs.csv", index=False)
    table.to_csv(out / "comparison.csv", index=False)
    fits = pd.DataFrame() if fits is None else fits
    (out / "fits.csv").unlink(missing_ok=True)
    if len(fits):
        fits.to_csv(out / "fits.csv", index=False)
    for stale in PLOTS:
        (out / stale).unlink(missing_ok=True)
    if not table.empty:
        colors = _colors(_optimizer_order(table.optim, baseline))
        plot_state(table, colors, out / "state_mb.png")
        plot_peak(table, colors, out / "peak_memory.png")
        if table["eval F1 [0-1]"].notna().any():
            plot_f1_peak(table, colors, out / "f1_vs_peak.png")
        if not history.empty:
            plot_losses(history, jobs, colors, out / "train_loss.png")
        if table["throughput [tokens/s]"].notna().any():
            plot_throughput(table, colors, out / "throughput.png")
        if table[list(BREAKDOWN.values())].notna().all(axis=1).any():
            plot_breakdown(table.dropna(subset=list(BREAKDOWN.values())), out / "peak_breakdown.png")
    plots = {name: caption for name, caption in PLOTS.items() if (out / name).exists()}
    shown, failed = format_table(table), failed_table(jobs)
    front = "none"
    if not table.empty:
        front = ", ".join(_labels(table, ["optim", *point_columns(table)])[pareto_front(table)]) or "none"
    legend = pd.DataFrame(LEGEND.items(), columns=["column", "meaning"])

    fit_title = "Largest batch that fits in " + (
        " / ".join(f"{_fmt(b)} MB" for b in fits["budget [MB]"].unique()) if len(fits) else "the budget"
    )
    fit_note = "(find_batch_size=true; every text padded to max_length; MB = 2^20 bytes)"
    md = [f"# {title}", "", *[f"- {line}" for line in about], "", "## Comparison", ""]
    md += [_markdown(shown) if len(shown) else "No finished training jobs.", ""]
    if len(fits):
        md += [f"## {fit_title}", "", fit_note, "", _markdown(_plain(fits)), ""]
    md += ["## Failed jobs", ""]
    md += [_markdown(failed) if len(failed) else "None.", "", "## Plots", ""]
    md += [f"![{caption}]({name})\n\n*{caption}*\n" for name, caption in plots.items()]
    md += [f"Pareto front (no other point has less peak memory and a higher F1): {front}.", ""]
    md += ["## Columns", "", _markdown(legend), ""]
    (out / "report.md").write_text("\n".join(md))

    def table_html(frame: pd.DataFrame, empty: str = "", css: str = "") -> str:
        if not len(frame):
            return f"<p>{empty}</p>"
        # markdown `code` in cells becomes <code> (to_html has escaped everything else)
        return re.sub(r"`([^`<]*)`", r"<code>\1</code>", frame.to_html(index=False, border=0, classes=css))

    def image(name: str) -> str:
        data = base64.b64encode((out / name).read_bytes()).decode()
        img = f'<img src="data:image/png;base64,{data}" alt="{html.escape(plots[name])}">'
        return f"<figure>{img}<figcaption>{html.escape(plots[name])}</figcaption></figure>"

    items = re.sub(
        r"`([^`]*)`", r"<code>\1</code>", "".join(f"<li>{html.escape(line)}</li>" for line in about)
    )
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; font-size: 12px; margin-bottom: 1.5em; }}
th, td {{ border: 1px solid #ccc; padding: 3px 5px; text-align: right; font-variant-numeric: tabular-nums; }}
td {{ white-space: nowrap; }}
table.text td, table.text th {{ text-align: left; white-space: normal; }}
code {{ font-size: 12px; background: #f3f3f3; padding: 0 3px; }}
th {{ background: #eef2f7; }}
tbody tr:nth-child(even) {{ background: #f8f9fb; }}
figure {{ display: inline-block; margin: 0 1em 1em 0; }}
img {{ max-width: 880px; border: 1px solid #ddd; }}
figcaption {{ font-size: 13px; color: #555; }}
.wide {{ overflow-x: auto; }}  /* many columns: the table scrolls, the page does not */
</style></head><body>
<h1>{html.escape(title)}</h1><ul>{items}</ul>
<h2>Comparison</h2><div class="wide">{table_html(shown, "No finished training jobs.")}</div>
{f"<h2>{html.escape(fit_title)}</h2><p>{fit_note}</p>{table_html(_plain(fits))}" if len(fits) else ""}
<h2>Failed jobs</h2>{table_html(failed, "None.", "text")}
<h2>Plots</h2>{"".join(image(name) for name in plots)}
<p>Pareto front (no other point has less peak memory and a higher F1): {html.escape(front)}.</p>
<h2>Columns</h2>{table_html(legend, css="text")}
</body></html>
"""
    (out / "report.html").write_text(page)


def build(
    uri: str,
    sweeps=(),
    experiment: str = EXPERIMENT,
    whole_experiment: bool = False,
    out: Path | None = None,
    root: Path = Path(OUTPUTS) / "report",
    baseline: str = BASELINE,
) -> tuple[Path, pd.DataFrame]:
    """Read the runs, write the report to `out` (default root/<sweep name>); the folder and the table."""
    parents = None if whole_experiment else find_sweeps(uri, sweeps, experiment)
    raw = search_jobs(uri, parents, experiment)
    names = {} if parents is None else parents.set_index("run_id")["tags.mlflow.runName"].to_dict()
    jobs = job_table(raw, names)
    table = compare(jobs[~is_fit_job(jobs)], baseline)
    name = experiment if parents is None else "+".join(names.values())
    out = Path(out) if out else Path(root) / name
    title = f"Optimizer comparison: {name}"
    about = _about(uri, parents, jobs, baseline)
    history = loss_history(uri, jobs)
    write_report(out, title, about, jobs, table, history, baseline, fit_table(jobs, baseline))
    return out, table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.report",
        description="Comparison report of a sweep's MLflow runs: report.md, report.html, runs.csv, "
        "comparison.csv and PNG plots. Default: the latest sweep of the experiment.",
    )
    parser.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="ID_OR_NAME",
        help="a sweep's parent run id or run name (e.g. sweep-2026-01-31_12-00-00); repeat for several "
        "sweeps, whose jobs are then compared together (more seeds of the same points are pooled)",
    )
    parser.add_argument(
        "--experiment",
        default=EXPERIMENT,
        help="MLflow experiment of the default (latest) sweep and of --whole-experiment (default: %(default)s)",
    )
    parser.add_argument(
        "--whole-experiment", action="store_true", help="every job of the experiment, from every sweep"
    )
    parser.add_argument(
        "--tracking-uri",
        help="MLflow store (default: $MLFLOW_TRACKING_URI, else sqlite:///<abs path>/outputs/mlflow.db)",
    )
    parser.add_argument(
        "--out", type=Path, metavar="DIR", help="output folder (default: outputs/report/<sweep run name>/)"
    )
    parser.add_argument("--baseline", default=BASELINE, help="optimizer the Δ columns compare against")
    args = parser.parse_args(argv)
    if args.sweep and args.whole_experiment:
        parser.error("--sweep and --whole-experiment exclude each other")
    uri = default_tracking_uri(args.tracking_uri)
    # a missing sqlite file would be created empty by MLflow: say what is wrong instead
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        print(f"error: no MLflow store at {uri}: run a sweep first (make run)", file=sys.stderr)
        return 2
    try:
        out, table = build(
            uri, args.sweep, args.experiment, args.whole_experiment, args.out, baseline=args.baseline
        )
    except ReportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(console_text(out, table))
    print(f"\nreport: {out / 'report.html'} ({out / 'report.md'}, runs.csv, comparison.csv, plots)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
