"""`python -m pipeline.report`: MLflow runs -> pandas comparison report (tables and plots) for one decision.

One row per (model, batch size, backend, optimizer; and method, `full` / `lora r=16` / `qlora r=16 nf4`, where
PEFT runs are among them): what the optimizer keeps in state and at peak, the difference against the baseline
optimizer's (AdamW's) full fine-tuning of the same model, batch size and backend, and what that
costs in loss, accuracy, F1 and speed (a language model's, task=causal_lm: loss, perplexity and next-token
accuracy, in a table of its own); seeds are aggregated to mean ± sample std. The report reads only what
the tracker wrote: child runs by `mlflow.search_runs`, loss curves by `MlflowClient.get_metric_history`.

Where an optimizer ran at several learning rates in a point, a tuned section: each optimizer at the rate
with the best mean validation metric over seeds (a language model's: the lowest validation loss), compared on
the held-out test split with Welch's test against the baseline (tuned.py).

Writes report.md, report.html (self-contained), runs.csv (one row per job), comparison.csv (the table as
numbers), tuned.csv (where rates were tuned) and PNG plots to outputs/report/<sweep>/.
"""

from pipeline.report.cli import main
from pipeline.report.columns import BASELINE, COLUMNS
from pipeline.report.plots import PLOTS, TUNED_PLOTS
from pipeline.report.render import build, console_text, write_report
from pipeline.report.runs import (
    EXPERIMENT,
    ReportError,
    default_tracking_uri,
    find_sweeps,
    job_table,
    loss_history,
    search_jobs,
    validation_history,
)
from pipeline.report.tables import compare, console_table, failed_table, fit_table, format_table, pareto_front
from pipeline.report.tuned import Tuned, format_tuned, is_tuned, rate_note, tuned_section, welch

__all__ = [
    "BASELINE",
    "COLUMNS",
    "EXPERIMENT",
    "PLOTS",
    "TUNED_PLOTS",
    "ReportError",
    "Tuned",
    "build",
    "compare",
    "console_table",
    "console_text",
    "default_tracking_uri",
    "failed_table",
    "find_sweeps",
    "fit_table",
    "format_table",
    "format_tuned",
    "is_tuned",
    "job_table",
    "loss_history",
    "main",
    "pareto_front",
    "rate_note",
    "search_jobs",
    "tuned_section",
    "validation_history",
    "welch",
    "write_report",
]
