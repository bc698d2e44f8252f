"""`python -m pipeline.report`: the command line (options, exit codes, what it prints)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.report.columns import BASELINE, QUALITY, QUALITY_METRICS, TARGET_FRACTION
from pipeline.report.render import build, console_text
from pipeline.report.runs import EXPERIMENT, OUTPUTS, ReportError, list_sweeps
from pipeline.tracking import StoreError, Tracker, auth_error, refused, store_uri

# what a sweep's command line names its store by, taken here too (`outputs_dir=DIR tracking.uri=URI`)
OVERRIDES = {
    "outputs_dir": "outputs_dir",
    "tracking.uri": "tracking_uri",
    "tracking.experiment": "experiment",
}


def overrides(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`key=value` arguments, as a sweep takes them, onto the options they stand for."""
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in OVERRIDES:
            parser.error(f"{item!r}: takes only {', '.join(k + '=...' for k in OVERRIDES)} (as a sweep does)")
        setattr(args, OVERRIDES[key], value)


def show_sweeps(uri: str) -> None:
    """`--list`: the sweeps of the store, one line each."""
    sweeps = list_sweeps(uri)
    print(f"store: {uri}")
    width = int(sweeps.sweep.str.len().max()) if len(sweeps) else 0  # names left-aligned, as written
    left = {"sweep": lambda name: f"{name:<{width}}"}
    table = sweeps.to_string(index=False, formatters=left, justify="left") if len(sweeps) else "no sweeps"
    print("\n".join(line.rstrip() for line in table.splitlines()))
    alone = sweeps.attrs.get("single_runs", 0)
    if alone:
        print(
            f"and {alone} single run{'s' if alone != 1 else ''} outside any sweep (report one: --run RUN_ID)"
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.report",
        description="Comparison report of a sweep's MLflow runs: report.md, report.html, runs.csv, "
        "comparison.csv (tuned.csv where learning rates were tuned) and PNG plots. Default: the latest sweep "
        "with results in the store of outputs_dir (outputs/ unless given), its report under <outputs_dir>/report/.",
    )
    parser.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="ID_OR_NAME",
        help="a sweep's parent run id, name (what it swept, e.g. 'optim=adamw,adafactor model=tiny': the latest "
        "sweep of that name) or folder (e.g. sweep-2026-01-31_12-00-00, as --list shows); repeat for several "
        "sweeps, whose jobs are then compared together (more seeds of the same points are pooled; each point, by "
        "config hash, counted once: its latest FINISHED run)",
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
        "--run",
        action="append",
        default=[],
        metavar="RUN_ID",
        help="report these job runs on their own (repeat for several), e.g. a single run's",
    )
    parser.add_argument(
        "--list",
        action="store_true",
        help="list the sweeps of the store (folder, status, jobs, ..., name) and exit",
    )
    parser.add_argument(
        "--tracking-uri",
        help="MLflow store (default: $MLFLOW_TRACKING_URI, else sqlite:///<abs path>/<outputs dir>/mlflow.db)",
    )
    parser.add_argument(
        "--outputs-dir",
        metavar="DIR",
        help="the sweep's outputs_dir: its store (unless --tracking-uri) and where the report goes "
        "(default: the sweep's own outputs_dir, else the local store's folder, else outputs)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="output folder (default: <outputs dir>/report/<sweep folder>/, e.g. report/sweep-2026-01-31_12-00-00)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="outputs_dir=DIR, tracking.uri=URI, tracking.experiment=NAME: the same as a sweep's (the "
        "options above)",
    )
    parser.add_argument(
        "--baseline",
        default=BASELINE,
        metavar="NAME",
        help="the row the Δ columns compare against: an optimizer's full fine-tuning (default: %(default)s), or "
        "an optimizer and a method, as the method column names it: 'adamw lora r=16'",
    )
    parser.add_argument(
        "--quality-metric",
        default=QUALITY,
        choices=list(QUALITY_METRICS),
        help="where an optimizer ran at several learning rates: the classification metric whose validation "
        "figure (val_<metric>, highest) picks its rate, and whose test figure (eval_<metric>) is compared "
        "(default: %(default)s); a language model's (task=causal_lm) rate is the one with the lowest val_loss, "
        "compared on eval_loss and eval_perplexity",
    )
    parser.add_argument(
        "--target-fraction",
        type=float,
        default=TARGET_FRACTION,
        metavar="F",
        help="steps to target: the first step at which an optimizer's mean validation metric reaches F x "
        "the best final one among the optimizers of its point (a language model's loss: falls to the lowest "
        "final one / F) (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    overrides(parser, args)
    if sum(map(bool, (args.sweep, args.whole_experiment, args.run))) > 1:
        parser.error("--sweep, --run and --whole-experiment exclude each other")
    if not 0 < args.target_fraction <= 1:
        parser.error(f"--target-fraction must be in (0, 1], got {args.target_fraction}")
    uri = store_uri(args.tracking_uri, args.outputs_dir or OUTPUTS)
    # a missing sqlite file would be created empty by MLflow: say what is wrong instead
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        print(f"error: no MLflow store at {uri}: run a sweep first (make run)", file=sys.stderr)
        return 2
    try:  # a store that cannot be opened: one line naming it and the fix
        Tracker(uri)
    except StoreError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        if args.list:
            show_sweeps(uri)
            return 0
        out, table = build(
            uri,
            args.sweep,
            args.experiment,
            args.whole_experiment,
            args.out,
            root=Path(args.outputs_dir) / "report" if args.outputs_dir else None,
            baseline=args.baseline,
            quality_metric=args.quality_metric,
            target_fraction=args.target_fraction,
            runs=args.run,
        )
    except ReportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # a server that refuses this client: which variables to set
        if not refused(err):
            raise
        print(f"error: {auth_error(uri, err)}", file=sys.stderr)
        return 2
    print(console_text(out, table))
    tuned = ", tuned.csv" if (out / "tuned.csv").exists() else ""
    print(f"\nreport: {out / 'report.html'} ({out / 'report.md'}, runs.csv, comparison.csv{tuned}, plots)")
    return 0
