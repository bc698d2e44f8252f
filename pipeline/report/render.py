"""The report's files (report.md, report.html, runs.csv, comparison.csv, fits.csv, plots) and console text;
`build` runs the whole pipeline: read the runs -> tables -> plots -> files."""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

import pandas as pd

from pipeline.report.columns import BASELINE, LEGEND
from pipeline.report.plots import (
    BREAKDOWN,
    PLOTS,
    _colors,
    _labels,
    plot_breakdown,
    plot_f1_peak,
    plot_losses,
    plot_peak,
    plot_state,
    plot_throughput,
)
from pipeline.report.runs import EXPERIMENT, OUTPUTS, find_sweeps, job_table, loss_history, search_jobs
from pipeline.report.tables import (
    _fmt,
    _optimizer_order,
    _plain,
    compare,
    console_table,
    failed_table,
    fit_table,
    format_table,
    is_fit_job,
    is_plan_job,
    pareto_front,
    plan_display,
    plan_table,
    point_columns,
)


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
    plans: pd.DataFrame | None = None,
) -> None:
    """report.md, report.html, runs.csv, comparison.csv (fits.csv, plan.csv) and the PNG plots, into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    jobs.to_csv(out / "runs.csv", index=False)
    table.to_csv(out / "comparison.csv", index=False)
    fits = pd.DataFrame() if fits is None else fits
    (out / "fits.csv").unlink(missing_ok=True)
    if len(fits):
        fits.to_csv(out / "fits.csv", index=False)
    plans = pd.DataFrame() if plans is None else plans
    (out / "plan.csv").unlink(missing_ok=True)
    if len(plans):
        plans.to_csv(out / "plan.csv", index=False)
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
    plan_title = "Plan: a training step's memory, predicted"
    plan_note = (
        "(plan=true: the step simulated on fake tensors, no weights, nothing trained; the parts at the "
        "predicted peak; fits = predicted peak within the budget; MB = 2^20 bytes)"
    )
    md = [f"# {title}", "", *[f"- {line}" for line in about], ""]
    if len(plans):
        md += [f"## {plan_title}", "", plan_note, "", _markdown(plan_display(plans)), ""]
    md += ["## Comparison", "", _markdown(shown) if len(shown) else "No finished training jobs.", ""]
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
{f"<h2>{plan_title}</h2><p>{plan_note}</p>{table_html(plan_display(plans))}" if len(plans) else ""}
<h2>Comparison</h2><div class="wide">{table_html(shown, "No finished training jobs.")}</div>
{f"<h2>{html.escape(fit_title)}</h2><p>{fit_note}</p>{table_html(_plain(fits))}" if len(fits) else ""}
<h2>Failed jobs</h2>{table_html(failed, "None.", "text")}
<h2>Plots</h2>{"".join(image(name) for name in plots)}
<p>Pareto front (no other point has less peak memory and a higher F1): {html.escape(front)}.</p>
<h2>Columns</h2>{table_html(legend, css="text")}
</body></html>
"""
    (out / "report.html").write_text(page)


def console_text(out: Path, table: pd.DataFrame) -> str:
    """What a sweep and `make report` print: the short table, and the largest batches when searched."""
    text = console_table(table) if len(table) else "no finished training jobs"
    if (out / "plan.csv").exists():
        plans = pd.read_csv(out / "plan.csv")
        text = (
            ("" if len(table) else "plan:\n")
            + plan_display(plans).to_string(index=False)
            + ("\n\n" + text if len(table) else "")
        )
    if (out / "fits.csv").exists():
        fits = pd.read_csv(out / "fits.csv")
        text += "\n\nlargest batch that fits:\n" + _plain(fits).to_string(index=False)
    return text


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
    table = compare(jobs[~is_fit_job(jobs) & ~is_plan_job(jobs)], baseline)
    name = experiment if parents is None else "+".join(names.values())
    out = Path(out) if out else Path(root) / name
    title = f"Optimizer comparison: {name}"
    about = _about(uri, parents, jobs, baseline)
    history = loss_history(uri, jobs)
    fits, plans = fit_table(jobs, baseline), plan_table(jobs, baseline)
    write_report(out, title, about, jobs, table, history, baseline, fits, plans)
    return out, table
