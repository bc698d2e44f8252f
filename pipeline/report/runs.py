"""Reading the tracker: sweeps, their jobs (params and metrics) and loss curves from MLflow -> DataFrames."""

from __future__ import annotations

import os
from contextlib import contextmanager

import pandas as pd

EXPERIMENT = "optimizer-sweep"  # conf/tracking/local.yaml's tracking.experiment
OUTPUTS = "outputs"  # conf/config.yaml's outputs_dir


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
        columns=[
            "tags.mlflow.runName",
            "tags.mlflow.parentRunId",
            "tags.error",
            "tags.failure_reason",
            "tags.collapsed",
        ]
    )
    tags.columns = ["run_name", "sweep_run_id", "error", "failure_reason", "collapsed"]
    # predictions (nearly) all one class: True / False, empty where the job did not say (older runs)
    collapsed = tags.collapsed.map({"true": True, "false": False}).astype("boolean")
    jobs = pd.concat(
        [raw.run_id, tags.run_name, tags.sweep_run_id.map(sweep_names or {}).rename("sweep")], axis=1
    )
    jobs = pd.concat(
        [
            jobs,
            tags.sweep_run_id,
            raw.status,
            tags.failure_reason,
            tags.error,
            collapsed,
            raw.start_time,
            raw.end_time,
        ],
        axis=1,
    )
    params = sorted(c for c in raw if c.startswith("params."))
    metrics = sorted(c for c in raw if c.startswith("metrics."))
    params = raw[params].rename(columns=lambda c: c.removeprefix("params.")).apply(_typed)
    metrics = raw[metrics].rename(columns=lambda c: c.removeprefix("metrics."))
    return pd.concat([jobs, params, metrics], axis=1)


def _histories(uri: str, jobs: pd.DataFrame, key: str) -> list[tuple]:
    """(run_id, step, value) of every finished job's `key` series."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    return [
        (run_id, m.step, m.value)
        for run_id in jobs.loc[jobs.status == "FINISHED", "run_id"]
        for m in client.get_metric_history(run_id, key)
    ]


def loss_history(uri: str, jobs: pd.DataFrame) -> pd.DataFrame:
    """Every finished job's train_loss series: run_id, step, train_loss."""
    return pd.DataFrame(_histories(uri, jobs, "train_loss"), columns=["run_id", "step", "train_loss"])


def validation_history(uri: str, jobs: pd.DataFrame, key: str = "val_macro_f1") -> pd.DataFrame:
    """Every finished job's validation series `key` (logged every eval.every_steps and at the last step):
    run_id, step, value; a job that logged no such metric (an older run) adds no rows."""
    return pd.DataFrame(_histories(uri, jobs, key), columns=["run_id", "step", "value"])
