"""`python -m pipeline.report`: the command line (options, exit codes, what it prints)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.report.columns import BASELINE, QUALITY, QUALITY_METRICS, TARGET_FRACTION
from pipeline.report.render import build, console_text
from pipeline.report.runs import EXPERIMENT, ReportError, default_tracking_uri


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.report",
        description="Comparison report of a sweep's MLflow runs: report.md, report.html, runs.csv, "
        "comparison.csv (tuned.csv where learning rates were tuned) and PNG plots. Default: the latest sweep "
        "of the experiment.",
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
    parser.add_argument(
        "--quality-metric",
        default=QUALITY,
        choices=list(QUALITY_METRICS),
        help="where an optimizer ran at several learning rates: the validation metric (val_<metric>) that "
        "picks its rate, and the test metric (eval_<metric>) compared (default: %(default)s)",
    )
    parser.add_argument(
        "--target-fraction",
        type=float,
        default=TARGET_FRACTION,
        metavar="F",
        help="steps to target: the first step at which an optimizer's mean validation metric reaches F x "
        "the best final one among the optimizers of its point (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    if args.sweep and args.whole_experiment:
        parser.error("--sweep and --whole-experiment exclude each other")
    if not 0 < args.target_fraction <= 1:
        parser.error(f"--target-fraction must be in (0, 1], got {args.target_fraction}")
    uri = default_tracking_uri(args.tracking_uri)
    # a missing sqlite file would be created empty by MLflow: say what is wrong instead
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        print(f"error: no MLflow store at {uri}: run a sweep first (make run)", file=sys.stderr)
        return 2
    try:
        out, table = build(
            uri,
            args.sweep,
            args.experiment,
            args.whole_experiment,
            args.out,
            baseline=args.baseline,
            quality_metric=args.quality_metric,
            target_fraction=args.target_fraction,
        )
    except ReportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(console_text(out, table))
    tuned = ", tuned.csv" if (out / "tuned.csv").exists() else ""
    print(f"\nreport: {out / 'report.html'} ({out / 'report.md'}, runs.csv, comparison.csv{tuned}, plots)")
    return 0
