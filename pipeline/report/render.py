"""The report's files (report.md, report.html, runs.csv, comparison.csv, tuned.csv, fits.csv, plots) and
console text; `build` runs the whole pipeline: read the runs -> tables -> plots -> files."""

from __future__ import annotations

import base64
import html
import json
import re
from pathlib import Path

import pandas as pd

from pipeline.report.columns import (
    BASELINE,
    KEY_LABELS,
    LEGEND,
    QUALITY,
    QUALITY_METRICS,
    TARGET_FRACTION,
    TUNED_LEGEND,
    VARIANTS,
)
from pipeline.report.plots import (
    BREAKDOWN,
    PLOTS,
    TUNED_F1_CAPTION,
    TUNED_PLOTS,
    _colors,
    _labels,
    plot_breakdown,
    plot_f1_peak,
    plot_losses,
    plot_peak,
    plot_state,
    plot_throughput,
    plot_val_curves,
    plot_val_vs_lr,
)
from pipeline.report.runs import (
    EXPERIMENT,
    OUTPUTS,
    find_sweeps,
    folder_names,
    job_table,
    loss_history,
    one_per_point,
    search_jobs,
    skipped_runs,
    sweep_names,
    validation_history,
)
from pipeline.report.tables import (
    _fmt,
    _optimizer_order,
    _plain,
    collapsed_note,
    compare,
    console_table,
    decision_table,
    failed_table,
    fit_table,
    format_table,
    is_fit_job,
    is_plan_job,
    pareto_front,
    plan_console,
    plan_display,
    plan_table,
    plan_verdict,
    point_columns,
)
from pipeline.report.tuned import (
    Tuned,
    format_tuned,
    is_tuned,
    off_reference,
    rate_note,
    tuned_console,
    tuned_section,
)


def _markdown(frame: pd.DataFrame) -> str:
    # (DataFrame.to_markdown needs tabulate; a pipe table is three lines of code)
    cell = lambda v: str(v).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = ["| " + " | ".join(map(cell, frame.columns)) + " |", "|" + " --- |" * len(frame.columns)]
    lines += ["| " + " | ".join(map(cell, row)) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines)


def sweep_status(sweep: dict, jobs: pd.DataFrame, status: str | None = None) -> str:
    """A sweep's status for the header: `status` when its caller knows it (the sweep's end builds the report
    before it closes the parent run), else the store's; a parent run still RUNNING whose jobs have all ended
    gets the status its jobs give it (FAILED when one did not finish, as the sweep closes it), marked so."""
    if status:
        return status
    if sweep["status"] != "RUNNING":
        return sweep["status"]
    mine = jobs[jobs.sweep_run_id == sweep["run_id"]] if "sweep_run_id" in jobs else jobs
    if mine.empty or (mine.status == "RUNNING").any():
        return "RUNNING"
    ended = "FINISHED" if (mine.status == "FINISHED").all() else "FAILED"
    return f"{ended} (from its jobs: the parent run is still open)"


def _about(
    uri: str, sweeps: pd.DataFrame | None, jobs: pd.DataFrame, baseline: str, status: str | None = None
) -> list[str]:
    """The report's preamble: where the numbers come from and how to read them, one markdown item each."""
    lines = [f"store: `{uri}`"]
    for sweep in [] if sweeps is None else sweeps.to_dict("records"):
        overrides = sweep.get("tags.overrides") or ""
        lines.append(
            f"sweep `{sweep['tags.mlflow.runName']}`: {sweep_status(sweep, jobs, status)}; "
            f"run `{sweep['run_id']}`, started {sweep['start_time']:%Y-%m-%d %H:%M:%S} UTC; "
            f"overrides `{overrides}`"
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


def f1_note(jobs: pd.DataFrame) -> str | None:
    """Which class `eval F1` is about, from each data set's `label_names` (class names by id)."""
    if "label_names" not in jobs:
        return None
    notes = []
    pairs = jobs.reindex(columns=["data", "label_names"]).dropna(subset=["label_names"]).drop_duplicates()
    for data, names in pairs.itertuples(index=False):
        try:
            labels = {int(k): v for k, v in json.loads(names).items()}
        except (ValueError, AttributeError):
            continue
        classes = ", ".join(f"{k} = {v}" for k, v in sorted(labels.items()))
        on = f" on {data}" if isinstance(data, str) and len(pairs) > 1 else ""
        if len(labels) == 2:
            notes.append(
                f"eval F1{on} is the F1 of class 1, `{labels[1]}` (classes {classes}; param `label_names`)"
            )
        else:
            notes.append(f"eval F1{on} is the macro-F1 over {len(labels)} classes ({classes})")
    return "; ".join(notes) or None


def variant_notes(jobs: pd.DataFrame) -> list[str]:
    """One line per optimizer the Trainer ran otherwise than the plain one (param `optim_variant`)."""
    if "optim_variant" not in jobs:
        return []
    ran = jobs[jobs.optim_variant.isin(list(VARIANTS))].reindex(
        columns=["optim", "optim_variant", "trainer_optim"]
    )
    return [
        f"`{optim} ({VARIANTS[variant][0]})`: {VARIANTS[variant][1]}"
        + (f" (Trainer `optim={string}`)" if isinstance(string, str) else "")
        for optim, variant, string in ran.drop_duplicates(["optim", "optim_variant"]).itertuples(index=False)
    ]


def count_note(jobs: pd.DataFrame, left_out: int, pooled: bool) -> str | None:
    """How pooled runs count: each point (config hash) once."""
    if not pooled and not left_out:
        return None
    replaced = ""
    if "replaced_by" in jobs and left_out:
        replaced = " (a point rerun with force=true: the earlier run has the tag `replaced_by`)"
    return (
        "each point counted once: the latest FINISHED run per config hash (tag `config_hash`), so pooled sweeps "
        f"and reruns add no duplicate seeds; {left_out} earlier run{'s' if left_out != 1 else ''} of the same "
        f"points left out{replaced}"
    )


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
    tuned: Tuned | None = None,
) -> None:
    """report.md, report.html, runs.csv, comparison.csv (tuned.csv, fits.csv, plan.csv) and the PNG plots,
    into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    jobs.to_csv(out / "runs.csv", index=False)
    # the table's words as the console and the page show them: `optimizer`, `batch size [samples]` ...
    table.rename(columns=KEY_LABELS).to_csv(out / "comparison.csv", index=False)
    (out / "tuned.csv").unlink(missing_ok=True)
    if tuned is not None:
        tuned.table.to_csv(out / "tuned.csv", index=False)
    fits = pd.DataFrame() if fits is None else fits
    (out / "fits.csv").unlink(missing_ok=True)
    if len(fits):
        fits.to_csv(out / "fits.csv", index=False)
    plans = pd.DataFrame() if plans is None else plans
    (out / "plan.csv").unlink(missing_ok=True)
    if len(plans):
        plans.to_csv(out / "plan.csv", index=False)
    for stale in [*PLOTS, *TUNED_PLOTS]:
        (out / stale).unlink(missing_ok=True)
    captions = dict(PLOTS)
    # with tuned rates, quality is compared at each optimizer's best rate: the F1 picture uses those points
    quality, y, name = table, "eval F1 [0-1]", "eval F1"
    if tuned is not None:
        label = QUALITY_METRICS[tuned.metric]
        captions |= {file: caption.format(label) for file, caption in TUNED_PLOTS.items()}
        captions["f1_vs_peak.png"] = TUNED_F1_CAPTION.format(label, label)
        quality, y, name = tuned.table, f"test {label} [0-1]", f"test {label}"
    if not table.empty:
        colors = _colors(_optimizer_order(table.optim, baseline))
        plot_state(table, colors, out / "state_mb.png")
        plot_peak(table, colors, out / "peak_memory.png")
        if quality[y].notna().any():
            plot_f1_peak(quality, colors, out / "f1_vs_peak.png", y, name)
        if not history.empty:
            plot_losses(history, jobs, colors, out / "train_loss.png")
        if table["throughput [tokens/s]"].notna().any():
            plot_throughput(table, colors, out / "throughput.png")
        if table[list(BREAKDOWN.values())].notna().all(axis=1).any():
            steps = jobs.reindex(columns=["peak_breakdown"]).peak_breakdown.dropna()
            step = next((t for t in steps if str(t).startswith("step ")), "profiled step")
            plot_breakdown(table.dropna(subset=list(BREAKDOWN.values())), out / "peak_breakdown.png", step)
        if tuned is not None:
            plot_val_vs_lr(tuned.rates, colors, out / "val_vs_lr.png", label)
            if not tuned.curves.empty:
                plot_val_curves(tuned.curves, colors, out / "val_curves.png", label)
    plots = {file: caption for file, caption in captions.items() if (out / file).exists()}
    shown, failed = format_table(table), failed_table(jobs)
    lead, shared = decision_table(table) if len(table) else (pd.DataFrame(), "")
    marked = collapsed_note(table) if len(table) else None
    details_title = "All columns"
    front = "none"
    if not quality.empty:
        labels = _labels(quality, ["optim", *point_columns(quality)])
        front = ", ".join(labels[pareto_front(quality, y=y)]) or "none"
    higher = name if tuned is not None else "F1"
    front = f"Pareto front (no other point has less peak memory and a higher {higher}): {front}."
    legend = pd.DataFrame(
        {**LEGEND, **(TUNED_LEGEND if tuned is not None else {})}.items(), columns=["column", "meaning"]
    )
    tuned_title = "Tuned learning rate"
    tuned_shown, tuned_note = pd.DataFrame(), ""
    if tuned is not None:
        tuned_shown = format_tuned(tuned.table)
        tuned_note = (
            f"(each optimizer at the learning rate with the highest mean validation {label} over seeds "
            f"(`val_{tuned.metric}`, validation split carved out of the training data); test figures on the "
            f"held-out test split (`eval_*`), mean ± sample std; Δ and p against `{baseline}` at its own "
            f"best rate, p = Welch's two-sided t-test over seeds; edge: the best rate is the lowest or highest "
            f"tried, widen the grid there; steps to target: the first evaluation step at which the mean "
            f"validation {label} reaches {tuned.target_fraction:g} × the best final one in the point)"
        )

    fit_title = "Largest batch that fits in " + (
        " / ".join(f"{_fmt(b)} MB" for b in fits["budget [MB]"].unique()) if len(fits) else "the budget"
    )
    fit_note = "(find_batch_size=true; every text padded to max_length; MB = 2^20 bytes)"
    plan_title = "Plan: a training step's memory, predicted"
    plan_note = (
        "(plan=true: the step simulated on fake tensors, no weights, nothing trained; the parts at the "
        "predicted peak (the largest rank's, for several ranks); fits = predicted peak within the budget; ranks "
        "needed = the smallest number of ranks at which the batch fits with that sharding; MB = 2^20 bytes)"
    )
    md = [f"# {title}", "", *[f"- {line}" for line in about], ""]
    if len(plans):
        md += [f"## {plan_title}", "", plan_note, "", _markdown(plan_display(plans)), ""]
        md += [*[f"**Verdict**: {line}" for line in plan_verdict(plans)], ""]
    md += ["## Comparison", "", _markdown(lead) if len(lead) else "No finished training jobs.", ""]
    md += [marked, ""] if marked else []
    if len(shown):
        md += [f"({shared})", ""] if shared else []
        md += [f"### {details_title}", "", _markdown(shown), ""]
    if len(tuned_shown):
        md += [f"## {tuned_title}", "", tuned_note, "", _markdown(tuned_shown), ""]
    if len(fits):
        md += [f"## {fit_title}", "", fit_note, "", _markdown(_plain(fits)), ""]
    md += ["## Failed jobs", ""]
    md += [_markdown(failed) if len(failed) else "None.", "", "## Plots", ""]
    md += [f"![{caption}]({name})\n\n*{caption}*\n" for name, caption in plots.items()]
    md += [front, ""]
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

    def code(text: str) -> str:  # escaped, markdown `code` as <code>
        return re.sub(r"`([^`]*)`", r"<code>\1</code>", html.escape(text))

    items = "".join(f"<li>{code(line)}</li>" for line in about)
    verdict_html = "<ul>" + "".join(f"<li>{code(line)}</li>" for line in plan_verdict(plans)) + "</ul>"
    details_html = f"<p>{code(marked)}</p>" if marked else ""
    if len(shown):  # every column, one click away (a wide table: it scrolls, the page does not)
        details_html += f"<p>{html.escape(f'({shared})')}</p>" if shared else ""
        details_html += f"<details><summary>{details_title} ({len(shown.columns)})</summary>"
        details_html += f'<div class="wide">{table_html(shown)}</div></details>'
    tuned_html = ""
    if len(tuned_shown):
        tuned_html = f"\n<h2>{tuned_title}</h2><p>{code(tuned_note)}</p>"
        tuned_html += f'<div class="wide">{table_html(tuned_shown)}</div>'
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
details {{ margin-bottom: 1.5em; }}
summary {{ cursor: pointer; color: #1f4e99; margin-bottom: 0.5em; }}
</style></head><body>
<h1>{html.escape(title)}</h1><ul>{items}</ul>
{f"<h2>{plan_title}</h2><p>{plan_note}</p>{table_html(plan_display(plans))}{verdict_html}" if len(plans) else ""}
<h2>Comparison</h2>{table_html(lead, "No finished training jobs.")}{details_html}{tuned_html}
{f"<h2>{html.escape(fit_title)}</h2><p>{fit_note}</p>{table_html(_plain(fits))}" if len(fits) else ""}
<h2>Failed jobs</h2>{table_html(failed, "None.", "text")}
<h2>Plots</h2>{"".join(image(name) for name in plots)}
<p>{html.escape(front)}</p>
<h2>Columns</h2>{table_html(legend, css="text")}
</body></html>
"""
    (out / "report.html").write_text(page)


def console_text(out: Path, table: pd.DataFrame) -> str:
    """What a sweep and `make report` print: the short table, the tuned one when rates were tuned, and the
    largest batches when searched."""
    text = console_table(table) if len(table) else "no finished training jobs"
    text += f"\n{collapsed_note(table).replace('`', '')}" if len(table) and collapsed_note(table) else ""
    jobs = pd.read_csv(out / "runs.csv") if len(table) and (out / "runs.csv").exists() else None
    note = f1_note(jobs) if jobs is not None else None
    text += f"\n({note.replace('`', '')})" if note else ""
    off = off_reference(jobs[~is_fit_job(jobs) & ~is_plan_job(jobs)]) if jobs is not None else None
    text += f"\n{off}" if off else ""
    if (out / "tuned.csv").exists():
        tuned = pd.read_csv(out / "tuned.csv")
        text += "\n\ntuned learning rate (each optimizer at its best validation rate; test split):\n"
        text += tuned_console(tuned)
    if (out / "plan.csv").exists():
        plans = pd.read_csv(out / "plan.csv")
        text = ("" if len(table) else "plan:\n") + plan_console(plans) + ("\n\n" + text if len(table) else "")
    if (out / "fits.csv").exists():  # a sweep of searches only: their table is the whole story
        fits = "largest batch that fits:\n" + _plain(pd.read_csv(out / "fits.csv")).to_string(index=False)
        text = text + "\n\n" + fits if len(table) else fits
    return text


def outputs_of(uri: str, parents: pd.DataFrame | None) -> Path:
    """The outputs_dir a report goes under when none is given: the sweep's own (its parent run's tag
    `outputs_dir`; for a sweep recorded before that tag, the folder two above its `sweep_dir`, the default
    <outputs_dir>/multirun/<time>) where that folder is on this machine, else the folder of a local (sqlite)
    store, which lives at <outputs_dir>/mlflow.db, else `outputs`. So `make report` writes where the sweep's
    own report went, wherever hydra.sweep.dir put the sweep."""
    for _, parent in [] if parents is None else parents.iterrows():
        own, sweep_dir = parent.get("tags.outputs_dir"), parent.get("tags.sweep_dir")
        if isinstance(own, str) and Path(own).is_dir():
            return Path(own)
        if isinstance(sweep_dir, str) and Path(sweep_dir).is_dir():
            return Path(sweep_dir).parent.parent
    if uri.startswith("sqlite:///"):
        return Path(uri.removeprefix("sqlite:///")).parent
    return Path(OUTPUTS)


def build(
    uri: str,
    sweeps=(),
    experiment: str = EXPERIMENT,
    whole_experiment: bool = False,
    out: Path | None = None,
    root: Path | None = None,
    baseline: str = BASELINE,
    quality_metric: str = QUALITY,
    target_fraction: float = TARGET_FRACTION,
    status: str | None = None,
    runs=(),
) -> tuple[Path, pd.DataFrame]:
    """Read the runs, write the report to `out` (default root/<sweep folder>, folder_names; root: outputs_of),
    titled by the sweeps' names; the folder and the table. `runs`: run ids to report on their own, instead of
    sweeps. `quality_metric` (macro_f1, f1, accuracy) picks each optimizer's rate where rates were tuned, and
    `target_fraction` sets the steps-to-target target; `status`: the sweep's final status, from a caller that
    builds the report before closing the sweep's parent run (sweep_status). Each point counts once
    (one_per_point)."""
    parents = None if whole_experiment or runs else find_sweeps(uri, sweeps, experiment)
    raw = search_jobs(uri, parents, experiment, runs)
    jobs, left_out = one_per_point(job_table(raw, sweep_names(uri)))
    training = jobs[~is_fit_job(jobs) & ~is_plan_job(jobs)]
    table = compare(training, baseline)
    if runs:
        name = folder = "+".join(dict.fromkeys(jobs.run_name.astype(str)))
    elif parents is None:
        name = folder = experiment
    else:  # titled by what the sweeps swept, in the folder named by their own folders
        name, folder = " + ".join(parents["tags.mlflow.runName"]), "+".join(folder_names(parents))
    out = Path(out) if out else Path(root or outputs_of(uri, parents) / "report") / folder
    title = f"Optimizer comparison: {name}"
    about = _about(uri, parents, jobs, baseline, status)
    pooled = parents is None or len(parents) > 1 or bool(skipped_runs(parents))
    notes = [count_note(jobs, left_out, pooled and not runs), f1_note(jobs), *variant_notes(training)]
    notes += [rate_note(training, quality_metric), off_reference(training)]
    about += [note for note in notes if note]
    history = loss_history(uri, jobs)
    validation = None
    if is_tuned(training):
        validation = validation_history(uri, training, f"val_{quality_metric}")
    tuned = tuned_section(training, validation, quality_metric, baseline, target_fraction)
    if tuned is not None and not len(tuned.table):  # no optimizer with a validated rate: no section
        tuned = None
    fits, plans = fit_table(jobs, baseline), plan_table(jobs, baseline)
    write_report(out, title, about, jobs, table, history, baseline, fits, plans, tuned)
    return out, table
