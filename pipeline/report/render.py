"""The report's files (report.md, report.html, runs.csv, comparison.csv, tuned.csv, fits.csv, plots) and
console text; `build` runs the whole pipeline: read the runs -> tables -> plots -> files."""

from __future__ import annotations

import base64
import html
import json
import re
from pathlib import Path
from typing import NamedTuple

import pandas as pd

from pipeline.data import SHORT_RUN_STEPS
from pipeline.report.columns import (
    BASELINE,
    CAUSAL_LM,
    CLASSIFICATION,
    COLLAPSED,
    FULL,
    KEY_LABELS,
    LEGEND,
    LM_METRIC,
    LOWER_IS_BETTER,
    METHOD,
    METRIC_LABELS,
    PEFT_LEGEND,
    QUALITY,
    QUALITY_METRICS,
    TARGET_FRACTION,
    TASK_LEGEND,
    TASKS,
    TUNED_LEGEND,
    TUNED_LEGEND_LM,
    VARIANTS,
)
from pipeline.report.plots import (
    LM_BREAKDOWN_CAPTION,
    LM_TUNED_PLOTS,
    PARTS,
    PLOTS,
    TUNED_F1_CAPTION,
    TUNED_PERPLEXITY_CAPTION,
    TUNED_PLOTS,
    _colors,
    _labels,
    breakdown_parts,
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
    by_task,
    collapsed_note,
    compare,
    console_table,
    decision_table,
    failed_table,
    fit_table,
    format_table,
    has_lm,
    has_peft,
    is_fit_job,
    is_plan_job,
    own_baseline,
    pareto_front,
    plan_display,
    plan_table,
    point_columns,
    split_baseline,
    task_of,
    task_title,
    tasks_in,
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
from pipeline.report.verdict import LOGITS_PART, plan_console, plan_verdict


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
    same = f"of the same {'task, ' if has_lm(jobs) else ''}model, batch size and backend"
    if has_peft(jobs):  # every method's row against one baseline: the baseline optimizer's full fine-tuning
        optim, method = split_baseline(baseline)
        named = "full fine-tuning (method `full`)" if method == FULL else f"method `{method}`"
        delta = (
            f"Δ = row − `{optim}` with {named} {same}, whatever the row's method (in % of its value; a group "
            "without it has no Δ)"
        )
    else:
        delta = f"Δ = optimizer − `{baseline}` {same} (in % of `{baseline}`'s value)"
    lines.append(
        f"{delta}; "
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


def sample_note(jobs: pd.DataFrame) -> str | None:
    """The line naming the finished runs whose test or validation split was cut to a sample (param
    `eval_sample`, the most texts evaluated on, reached by `eval_samples` or `val_samples`): their eval and val
    figures are that sample's."""
    done = jobs[jobs.status == "FINISHED"]
    figures = done.reindex(columns=["eval_sample", "eval_samples", "val_samples"]).apply(
        pd.to_numeric, errors="coerce"
    )
    cap = figures.eval_sample
    sampled = cap[cap.notna() & figures[["eval_samples", "val_samples"]].eq(cap, axis=0).any(axis=1)]
    if sampled.empty:
        return None
    runs = "every run" if len(sampled) == len(done) else f"{len(sampled)} of {len(done)} runs"
    at_most = " or ".join(f"{int(n):,}" for n in sorted(sampled.unique()))
    return (
        f"sampled evaluation: {runs} evaluated on at most {at_most} texts of the test and the validation split "
        f"(param `eval_sample`; eval.sample=auto samples a run of fewer than {SHORT_RUN_STEPS} steps): their eval "
        "and val figures are that sample's; eval.sample=null evaluates on all"
    )


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


def _tuned_by_task(tuned) -> dict:
    """The tuned sections by task (a Tuned whose rates a loss picked is a language model's)."""
    found = [] if tuned is None else [tuned] if isinstance(tuned, Tuned) else list(tuned)
    return {(CAUSAL_LM if t.metric in LOWER_IS_BETTER else CLASSIFICATION): t for t in found}


def tuned_csv(tuned) -> pd.DataFrame:
    """tuned.csv: the tuned tables of every task, one after the other; where a language model's is among them,
    the column `task` first (its figures' columns are its own: empty on the other task's rows)."""
    found = _tuned_by_task(tuned)
    if CAUSAL_LM not in found:
        return next(iter(found.values())).table
    frames = [t.table.assign(task=task) for task, t in sorted(found.items(), key=lambda f: f[0] == CAUSAL_LM)]
    both = pd.concat(frames, ignore_index=True)
    return both[["task", *[c for c in both if c != "task"]]]


class Section(NamedTuple):
    """One task's part of the page: its comparison (lead, all columns), its tuned table, its quality plot."""

    task: str
    heading: str  # `Comparison`, or `Comparison: language model (task=causal_lm)` where a language model is
    lead: pd.DataFrame
    shared: str
    shown: pd.DataFrame
    marked: str | None
    tuned: Tuned | None
    tuned_shown: pd.DataFrame
    tuned_note: str
    front: str


def _tuned_note(tuned: Tuned, baseline: str) -> str:
    label = METRIC_LABELS[tuned.metric]
    if tuned.metric in LOWER_IS_BETTER:
        return (
            f"(each optimizer at the learning rate with the lowest mean validation {label} over seeds "
            f"(`val_{tuned.metric}`, validation split carved out of the training data); test figures on the "
            f"held-out test split (`eval_*`), mean ± sample std; Δ and p against `{baseline}` at its own "
            f"best rate, p = Welch's two-sided t-test over seeds; edge: the best rate is the lowest or highest "
            f"tried, widen the grid there; steps to target: the first evaluation step at which the mean "
            f"validation {label} falls to the best final one in the point / {tuned.target_fraction:g})"
        )
    return (
        f"(each optimizer at the learning rate with the highest mean validation {label} over seeds "
        f"(`val_{tuned.metric}`, validation split carved out of the training data); test figures on the "
        f"held-out test split (`eval_*`), mean ± sample std; Δ and p against `{baseline}` at its own "
        f"best rate, p = Welch's two-sided t-test over seeds; edge: the best rate is the lowest or highest "
        f"tried, widen the grid there; steps to target: the first evaluation step at which the mean "
        f"validation {label} reaches {tuned.target_fraction:g} × the best final one in the point)"
    )


def _quality(task: str, rows: pd.DataFrame, tuned: Tuned | None) -> tuple[pd.DataFrame, str, str, str, bool]:
    """What a task's quality plot and Pareto front read: (frame, column, name, file, lower is better), from
    the comparison's rows or, where rates were tuned, the tuned table's test figures (a best rate's runs
    never collapsed: its rows carry no collapsed count)."""
    if task == CAUSAL_LM:
        if tuned is not None:
            return tuned.table, "test perplexity", "test perplexity", "perplexity_vs_peak.png", True
        return rows, "eval perplexity", "eval perplexity", "perplexity_vs_peak.png", True
    if tuned is not None:
        label = METRIC_LABELS[tuned.metric]
        best = tuned.table.drop(columns=COLLAPSED, errors="ignore")
        return best, f"test {label} [0-1]", f"test {label}", "f1_vs_peak.png", False
    return rows, "eval F1 [0-1]", "eval F1", "f1_vs_peak.png", False


def _legend(tasks: list[str], tuned: dict, peft: bool = False) -> pd.DataFrame:
    """The page's column legend: the entries of the tasks it holds (with PEFT runs, the method's and its
    columns' after `n [seeds]`), and of each tuned table (a language model's entries marked as such where a
    classifier's tuned table is there too)."""
    other = {c for t, cs in TASK_LEGEND.items() if t not in tasks for c in cs}
    rows = []
    for column, meaning in LEGEND.items():
        rows += [] if column in other else [(column, meaning)]
        rows += list(PEFT_LEGEND.items()) if peft and column == "n [seeds]" else []
    if CLASSIFICATION in tuned:
        rows += list(TUNED_LEGEND.items())
    if CAUSAL_LM in tuned:
        lm = {k: v for k, v in TUNED_LEGEND.items() if k in ("rates tried", "edge")}
        lm |= TUNED_LEGEND_LM
        lm |= {
            k: v for k, v in TUNED_LEGEND.items() if k in ("p (Welch), n vs baseline", "state / peak [MB]")
        }
        mark = " (language model)" if CLASSIFICATION in tuned else ""
        seen = {column for column, _ in rows}
        rows += [(k + (mark if k in seen else ""), v) for k, v in lm.items()]
    return pd.DataFrame(rows, columns=["column", "meaning"])


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
    tuned: Tuned | list[Tuned] | None = None,
) -> None:
    """report.md, report.html, runs.csv, comparison.csv (tuned.csv, fits.csv, plan.csv) and the PNG plots,
    into `out`. Where a language model is among the rows, the comparison (and the tuned table) comes as one
    table per task; `tuned`: one Tuned, or one per task."""
    out.mkdir(parents=True, exist_ok=True)
    tuned_of = _tuned_by_task(tuned)
    jobs.to_csv(out / "runs.csv", index=False)
    # the table's words as the console and the page show them: `optimizer`, `batch size [samples]` ...
    table.rename(columns=KEY_LABELS).to_csv(out / "comparison.csv", index=False)
    (out / "tuned.csv").unlink(missing_ok=True)
    if tuned_of:
        tuned_csv(tuned).to_csv(out / "tuned.csv", index=False)
    fits = pd.DataFrame() if fits is None else fits
    (out / "fits.csv").unlink(missing_ok=True)
    if len(fits):
        fits.to_csv(out / "fits.csv", index=False)
    plans = pd.DataFrame() if plans is None else plans
    (out / "plan.csv").unlink(missing_ok=True)
    if len(plans):
        plans.to_csv(out / "plan.csv", index=False)
    for stale in [*PLOTS, *TUNED_PLOTS, *LM_TUNED_PLOTS]:
        (out / stale).unlink(missing_ok=True)
    captions = dict(PLOTS)
    # one part per task where a language model is among the rows (each with its own quality columns)
    titled = has_lm(table)
    parts = by_task(table) if titled else [(CLASSIFICATION, table)]
    colors = _colors(_optimizer_order(table.optim, baseline)) if not table.empty else {}
    sections = []
    for task, rows in parts:
        task_tuned = tuned_of.get(task)
        if task_tuned is not None and task == CAUSAL_LM:
            captions |= LM_TUNED_PLOTS
            captions["perplexity_vs_peak.png"] = TUNED_PERPLEXITY_CAPTION
        elif task_tuned is not None:
            label = METRIC_LABELS[task_tuned.metric]
            captions |= {file: caption.format(label) for file, caption in TUNED_PLOTS.items()}
            captions["f1_vs_peak.png"] = TUNED_F1_CAPTION.format(label, label)
        # with tuned rates, quality is compared at each optimizer's best rate: the quality picture uses those
        quality, y, name, file, lower = _quality(task, rows, task_tuned)
        if not rows.empty and y in quality and quality[y].notna().sum() >= 2:  # one point: the table says it
            plot_f1_peak(quality, colors, out / file, y, name, lower)
        if not rows.empty and task_tuned is not None:
            lm = task == CAUSAL_LM
            label = METRIC_LABELS[task_tuned.metric]
            files = (
                ("val_loss_vs_lr.png", "val_loss_curves.png") if lm else ("val_vs_lr.png", "val_curves.png")
            )
            plot_val_vs_lr(task_tuned.rates, colors, out / files[0], label)
            if not task_tuned.curves.empty:
                plot_val_curves(task_tuned.curves, colors, out / files[1], label)
        front = "none"
        if not quality.empty and y in quality:
            labels = _labels(quality, ["optim", *point_columns(quality)])
            front = ", ".join(labels[pareto_front(quality, y=y, lower=lower)]) or "none"
        better = name if task_tuned is not None else "perplexity" if task == CAUSAL_LM else "F1"
        whose = f", {TASKS[task]}" if titled else ""
        front = (
            f"Pareto front{whose} (no other point has less peak memory and a {'lower' if lower else 'higher'} "
            f"{better}): {front}."
        )
        if COLLAPSED in quality and quality[COLLAPSED].fillna(0).gt(0).any():
            front += (
                " Rows with a collapsed run (predictions (nearly) all in one class) are drawn hollow and left "
                "off the front."
            )
        lead, shared = decision_table(rows) if len(rows) else (pd.DataFrame(), "")
        sections.append(
            Section(
                task,
                "Comparison" + (f": {task_title(task)}" if titled else ""),
                lead,
                shared,
                format_table(rows),
                collapsed_note(rows) if len(rows) else None,
                task_tuned,
                format_tuned(task_tuned.table) if task_tuned is not None else pd.DataFrame(),
                _tuned_note(task_tuned, baseline) if task_tuned is not None else "",
                front,
            )
        )
    if not table.empty:
        plot_state(table, colors, out / "state_mb.png")
        plot_peak(table, colors, out / "peak_memory.png")
        if not history.empty and history.groupby("run_id").step.nunique().max() >= 2:  # a curve to draw
            plot_losses(history, jobs, colors, out / "train_loss.png")
        if table["throughput [tokens/s]"].notna().any():
            plot_throughput(table, colors, out / "throughput.png")
        if table[PARTS].notna().all(axis=1).any():  # (a language model's logits: where its rows have them)
            steps = jobs.reindex(columns=["peak_breakdown"]).peak_breakdown.dropna()
            step = next((t for t in steps if str(t).startswith("step ")), "profiled step")
            broken_down = table.dropna(subset=PARTS)
            plot_breakdown(broken_down, out / "peak_breakdown.png", step)
            if "logits" in breakdown_parts(broken_down):
                captions["peak_breakdown.png"] = LM_BREAKDOWN_CAPTION
    plots = {file: caption for file, caption in captions.items() if (out / file).exists()}
    failed = failed_table(jobs)
    details_title = "All columns"
    legend = _legend([task for task, _ in parts], tuned_of, METHOD in table)
    tuned_title = "Tuned learning rate"

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
    if "logits [MB]" in plans:  # a language model's plan
        plan_note = plan_note.removesuffix(")") + f"; {LOGITS_PART})"
    md = [f"# {title}", "", *[f"- {line}" for line in about], ""]
    if len(plans):
        md += [f"## {plan_title}", "", plan_note, "", _markdown(plan_display(plans)), ""]
        md += [*[f"**Verdict**: {line}" for line in plan_verdict(plans)], ""]
    for s in sections:
        md += [f"## {s.heading}", "", _markdown(s.lead) if len(s.lead) else "No finished training jobs.", ""]
        md += [s.marked, ""] if s.marked else []
        if len(s.shown):
            md += [f"({s.shared})", ""] if s.shared else []
            md += [f"### {details_title}", "", _markdown(s.shown), ""]
        if len(s.tuned_shown):
            heading = tuned_title + (f": {task_title(s.task)}" if titled else "")
            md += [f"## {heading}", "", s.tuned_note, "", _markdown(s.tuned_shown), ""]
    if len(fits):
        md += [f"## {fit_title}", "", fit_note, "", _markdown(_plain(fits)), ""]
    md += ["## Failed jobs", ""]
    md += [_markdown(failed) if len(failed) else "None.", "", "## Plots", ""]
    md += [f"![{caption}]({name})\n\n*{caption}*\n" for name, caption in plots.items()]
    md += [line for s in sections for line in (s.front, "")]
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
    comparison_html = ""
    for s in sections:
        comparison_html += (
            f"<h2>{html.escape(s.heading)}</h2>{table_html(s.lead, 'No finished training jobs.')}"
        )
        comparison_html += f"<p>{code(s.marked)}</p>" if s.marked else ""
        if len(s.shown):  # every column, one click away (a wide table: it scrolls, the page does not)
            comparison_html += f"<p>{html.escape(f'({s.shared})')}</p>" if s.shared else ""
            comparison_html += f"<details><summary>{details_title} ({len(s.shown.columns)})</summary>"
            comparison_html += f'<div class="wide">{table_html(s.shown)}</div></details>'
        if len(s.tuned_shown):
            heading = tuned_title + (f": {task_title(s.task)}" if titled else "")
            comparison_html += f"\n<h2>{html.escape(heading)}</h2><p>{code(s.tuned_note)}</p>"
            comparison_html += f'<div class="wide">{table_html(s.tuned_shown)}</div>'
    fronts = "".join(f"<p>{html.escape(s.front)}</p>" for s in sections)
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
{comparison_html}
{f"<h2>{html.escape(fit_title)}</h2><p>{fit_note}</p>{table_html(_plain(fits))}" if len(fits) else ""}
<h2>Failed jobs</h2>{table_html(failed, "None.", "text")}
<h2>Plots</h2>{"".join(image(name) for name in plots)}
{fronts}
<h2>Columns</h2>{table_html(legend, css="text")}
</body></html>
"""
    (out / "report.html").write_text(page)


def console_text(out: Path, table: pd.DataFrame) -> str:
    """What a sweep and `make report` print: the short table, the tuned one when rates were tuned, and the
    largest batches when searched."""
    jobs = pd.read_csv(out / "runs.csv") if len(table) and (out / "runs.csv").exists() else None
    note = f1_note(jobs) if jobs is not None else None
    blocks = []
    for task, rows in by_task(table) if has_lm(table) else [(CLASSIFICATION, table)]:
        # a language model among the rows: one table per task, headed by it (the task column said there)
        block = f"{task_title(task)}:\n{console_table(rows.drop(columns='task'))}" if has_lm(table) else ""
        block = block or console_table(rows)
        marked = collapsed_note(rows)  # a classifier's notes under its own table
        block += f"\n{marked.replace('`', '')}" if marked else ""
        block += f"\n({note.replace('`', '')})" if note and task == CLASSIFICATION else ""
        blocks.append(block)
    text = "\n\n".join(blocks) if len(table) else "no finished training jobs"
    training = jobs[~is_fit_job(jobs) & ~is_plan_job(jobs)] if jobs is not None else None
    for line in (off_reference(training), sample_note(training)) if jobs is not None else ():
        text += f"\n{line.replace('`', '')}" if line else ""
    if (out / "tuned.csv").exists():
        tuned = pd.read_csv(out / "tuned.csv")
        text += "\n\ntuned learning rate (each optimizer at its best validation rate; test split):\n"
        text += "\n\n".join(
            f"{task_title(task)}:\n{tuned_console(rows.drop(columns='task'))}"
            if "task" in rows
            else tuned_console(rows)
            for task, rows in tuned_parts(tuned)
        )
    if (out / "plan.csv").exists():
        plans = pd.read_csv(out / "plan.csv")
        text = ("" if len(table) else "plan:\n") + plan_console(plans) + ("\n\n" + text if len(table) else "")
    if (out / "fits.csv").exists():  # a sweep of searches only: their table is the whole story
        fits = "largest batch that fits:\n" + _plain(pd.read_csv(out / "fits.csv")).to_string(index=False)
        text = text + "\n\n" + fits if len(table) else fits
    return text


def tuned_parts(tuned: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """tuned.csv read back, task by task: each task's rows without the figures of the other task's metric
    (those of a classifier's rows: `val macro-F1 [0-1]`, `test F1 [0-1]`, ...; a language model's: `val loss
    [nats]`, `test perplexity`, ...), which are empty on its rows."""
    if "task" not in tuned:
        return [(CLASSIFICATION, tuned)]
    parts = []
    for task in tasks_in(tuned):
        rows = tuned[task_of(tuned).eq(task)].reset_index(drop=True)
        named = [
            c
            for c in rows
            if c.startswith(("val ", "test ", "Δ test ", "target [")) or c == "collapsed [runs]"
        ]
        parts.append((task, rows.drop(columns=[c for c in named if rows[c].isna().all()])))
    return parts


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
    sweeps. `quality_metric` (macro_f1, f1, accuracy) picks each classifier's rate where rates were tuned (a
    language model's: the lowest `val_loss`, whatever is asked), and `target_fraction` sets the steps-to-target
    target; `status`: the sweep's final status, from a caller that
    builds the report before closing the sweep's parent run (sweep_status). Each point counts once
    (one_per_point)."""
    parents = None if whole_experiment or runs else find_sweeps(uri, sweeps, experiment)
    raw = search_jobs(uri, parents, experiment, runs)
    jobs, left_out = one_per_point(job_table(raw, sweep_names(uri)))
    training = jobs[~is_fit_job(jobs) & ~is_plan_job(jobs)]
    asked, baseline = baseline, own_baseline(training[training.status == "FINISHED"], baseline)
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
    if baseline != asked:  # none of the runs is the baseline asked for
        about.append(
            f"baseline: `{baseline}`, what most of the runs ran (none ran `{asked}`; `--baseline` picks one)"
        )
    pooled = parents is None or len(parents) > 1 or bool(skipped_runs(parents))
    notes = [count_note(jobs, left_out, pooled and not runs), f1_note(jobs), sample_note(training)]
    notes += variant_notes(training)
    tasks, tuned = tasks_in(training), []
    for task in tasks:  # each task's rates picked by its own metric: a language model's by its lowest loss
        rows = training[task_of(training).eq(task)]
        metric = (
            LM_METRIC
            if task == CAUSAL_LM
            else quality_metric
            if quality_metric in QUALITY_METRICS
            else QUALITY
        )
        note = rate_note(rows, metric)
        notes.append(f"{TASKS[task]}: {note}" if note and len(tasks) > 1 else note)
        validation = validation_history(uri, rows, f"val_{metric}") if is_tuned(rows) else None
        found = tuned_section(rows, validation, metric, baseline, target_fraction)
        if found is not None and len(found.table):  # no optimizer with a validated rate: no section
            tuned.append(found)
    notes.append(off_reference(training))
    about += [note for note in notes if note]
    history = loss_history(uri, jobs)
    fits, plans = fit_table(jobs, baseline), plan_table(jobs, baseline)
    write_report(out, title, about, jobs, table, history, baseline, fits, plans, tuned)
    return out, table
