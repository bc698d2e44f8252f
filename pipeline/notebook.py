"""The pipeline from Python (a notebook), as `pipeline.plan` and `pipeline.runs`: `plan(overrides)` plans points
in this process and answers the plan's table as a DataFrame, nothing recorded; `runs(sweep)` reads a sweep's runs
from the project's store, opening none where there is none."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

# where `make run` and `python -m pipeline` write from the project's folder (conf/config.yaml's outputs_dir)
PROJECT_OUTPUTS = Path(__file__).resolve().parent.parent / "outputs"


def points(overrides) -> list[list[str]]:
    """The sweep's points as the command line's overrides make them (`optim=adamw,adafactor batch_size=8,16`:
    four points, in Hydra's order), each a list of single-valued overrides."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(
        [overrides] if isinstance(overrides, str) else overrides
    )
    return [list(point) for batch in BasicSweeper.split_arguments(parsed, None) for point in batch]


def plan(overrides=(), budget_verdict: bool = True) -> pd.DataFrame:
    """The plan of each point the overrides make (as `python -m pipeline -m plan=true <overrides>`, a config.json
    through `model.config=` included), planned in this process and recorded nowhere: the plan's table, one row a
    point (pipeline.report.tables.plan_table: its keys, parts, peak, whether it fits and the largest batch that
    does, the recipe where one was searched). A bad value raises pipeline.config.ConfigError, one line.
    `budget_verdict`: the verdict's lines beside it, as the frame's `attrs["verdict"]`."""
    from hydra import compose, initialize_config_dir

    from pipeline import plan_job, quiet, runner
    from pipeline.config import CONF_DIR, own_model, validate
    from pipeline.report import tables, verdict

    quiet.install()  # the libraries' noise filtered at their loggers, as on the command line
    rows = []
    for point in points(overrides):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=[*point, "plan=true"])
        validate(cfg)
        cfg = own_model(cfg)
        record = plan_job.plan_result(cfg)
        rows.append({**runner.job_params(cfg), **record["params"], **record["metrics"], "status": "FINISHED"})
    table = tables.plan_table(pd.DataFrame(rows))
    if budget_verdict:
        table.attrs["verdict"] = verdict.plan_verdict(table)
    return table


def runs(sweep: str | None = None, uri: str | None = None) -> pd.DataFrame:
    """A sweep's runs, one row a job (its params and the last value of each metric; pipeline.report.runs'
    job_table): the sweep named or id'd by `sweep`, else the latest. The store: `uri`, else
    $MLFLOW_TRACKING_URI, else the project's own (outputs/mlflow.db beside conf/, from whatever folder this
    runs in). pipeline.report.runs.ReportError where there is no such store or sweep: nothing is created."""
    from pipeline.report import runs as report_runs
    from pipeline.tracking import store_uri

    uri = store_uri(uri, PROJECT_OUTPUTS)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        raise report_runs.ReportError(f"no store at {uri}: run a sweep first (make run)")
    sweeps = report_runs.find_sweeps(uri, [sweep] if sweep else [])
    return report_runs.job_table(report_runs.search_jobs(uri, sweeps), report_runs.sweep_names(uri))
