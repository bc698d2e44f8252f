"""Reading the tracker: sweeps, their jobs (params and metrics) and loss curves from MLflow -> DataFrames."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import pandas as pd

from pipeline.tracking import SKIPPED_RUN

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
            # the latest sweep with results: jobs it ran, or points it found FINISHED before (a rerun whose
            # points were all done refers to their runs); a sweep still running has neither yet
            sweeps = mlflow.search_runs(
                experiment_names=[experiment],
                filter_string="tags.kind = 'sweep'",
                order_by=["attributes.start_time DESC"],
                max_results=200,
            )
            counts = sweeps.reindex(columns=["metrics.jobs", "metrics.jobs_skipped"]).fillna(0)
            sweeps = sweeps[counts.sum(axis=1) > 0].head(1)
    if sweeps.empty:
        raise ReportError(f"no sweep in {uri}" + ("" if selectors else f", experiment {experiment!r}"))
    if not selectors:
        return sweeps
    chosen, folders = [], folder_names(sweeps)
    for selector in selectors:
        named = (sweeps["tags.mlflow.runName"] == selector) | (folders == selector)
        match = sweeps[sweeps.run_id == selector]
        if match.empty:  # a name several sweeps share (the same command run twice): the latest of them
            match = sweeps[named].sort_values("start_time").tail(1)
        if match.empty:
            latest = sweeps.assign(folder=folders).sort_values("start_time").tail(3)
            known = "; ".join(
                f"{f} ({n})" for f, n in zip(latest.folder, latest["tags.mlflow.runName"], strict=True)
            )
            raise ReportError(f"no sweep with run id, name or folder {selector!r} in {uri} (latest: {known})")
        chosen.append(match)
    return pd.concat(chosen).drop_duplicates("run_id").sort_values("start_time")


def folder_names(sweeps: pd.DataFrame) -> pd.Series:
    """Each sweep's report folder name, `sweep-<its folder's name>` (`sweep-2026-12-01_14-03-45`, from its
    parent run's tag sweep_dir): unique and free of spaces, unlike the sweep's name (its overrides)."""
    where = sweeps.reindex(columns=["tags.sweep_dir"]).iloc[:, 0]
    named = where.map(lambda path: f"sweep-{Path(path).name}" if isinstance(path, str) else None)
    return named.fillna(sweeps["tags.mlflow.runName"])


def _by_id(mlflow, run_ids: list[str]) -> pd.DataFrame:
    """Runs by id, in any experiment, as mlflow.search_runs gives them."""
    parts = []
    for i in range(0, len(run_ids), 100):
        chunk = ", ".join(f"'{run_id}'" for run_id in run_ids[i : i + 100])
        parts.append(
            mlflow.search_runs(search_all_experiments=True, filter_string=f"attributes.run_id IN ({chunk})")
        )
    return pd.concat([p for p in parts if not p.empty] or [pd.DataFrame()], ignore_index=True)


def skipped_runs(sweeps: pd.DataFrame) -> list[str]:
    """The run ids `sweeps` refer to for their skipped points (tags skipped_run.<job>)."""
    columns = [c for c in sweeps if c.startswith(f"tags.{SKIPPED_RUN}")]
    return list(dict.fromkeys(v for c in columns for v in sweeps[c].dropna()))


def search_jobs(
    uri: str, sweeps: pd.DataFrame | None = None, experiment: str = EXPERIMENT, runs=()
) -> pd.DataFrame:
    """Child runs of `sweeps` and the runs they found FINISHED before (their skipped points), or the runs
    `runs` (ids), or every job of `experiment`, as mlflow.search_runs gives them."""
    with _store(uri) as mlflow:
        if runs:
            raw = _by_id(mlflow, list(runs))
            missing = [r for r in runs if raw.empty or r not in set(raw.run_id)]
            if missing:
                raise ReportError(f"no run with id {missing[0]!r} in {uri}")
        elif sweeps is None:
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
            found = skipped_runs(sweeps)
            parts.append(_by_id(mlflow, found) if found else pd.DataFrame())
            raw = pd.concat([p for p in parts if not p.empty] or [pd.DataFrame()], ignore_index=True)
            raw = raw.drop_duplicates("run_id") if "run_id" in raw else raw
    if raw.empty:
        raise ReportError(f"no jobs in {uri} for the selected sweep(s)")
    return raw


def sweep_names(uri: str) -> dict[str, str]:
    """Parent run id -> name of every sweep in the store."""
    with _store(uri) as mlflow:
        sweeps = mlflow.search_runs(filter_string="tags.kind = 'sweep'", search_all_experiments=True)
    return {} if sweeps.empty else sweeps.set_index("run_id")["tags.mlflow.runName"].to_dict()


def list_sweeps(uri: str) -> pd.DataFrame:
    """The sweeps of a store, oldest first: folder, experiment, status, jobs (run by it), finished, skipped
    (points found FINISHED before), started (UTC), parent run id, name; then the runs outside any sweep."""
    with _store(uri) as mlflow:
        every = mlflow.search_runs(search_all_experiments=True)
        experiments = {e.experiment_id: e.name for e in mlflow.search_experiments()}
    if every.empty:
        raise ReportError(f"no runs in {uri}: run a sweep first (make run)")
    tags = every.reindex(columns=["tags.kind", "tags.mlflow.parentRunId", "tags.mlflow.runName"])
    is_sweep = tags["tags.kind"].eq("sweep")
    sweeps, jobs = every[is_sweep], every[~is_sweep].assign(parent=tags["tags.mlflow.parentRunId"])
    by_parent = jobs.groupby("parent").status
    rows = pd.DataFrame(
        {
            "folder": folder_names(sweeps),
            "experiment": sweeps.experiment_id.map(experiments),
            "status": sweeps.status,
            "jobs": sweeps.run_id.map(by_parent.size()).fillna(0).astype(int),
            "finished": sweeps.run_id.map(by_parent.apply(lambda s: int(s.eq("FINISHED").sum()))).fillna(0),
            "skipped": sweeps.reindex(columns=["metrics.jobs_skipped"]).iloc[:, 0].fillna(0),
            "started (UTC)": sweeps.start_time.dt.strftime("%Y-%m-%d %H:%M:%S"),
            "parent run": sweeps.run_id,
            "sweep": sweeps["tags.mlflow.runName"],  # what it swept (last: the longest)
        }
    )
    rows[["finished", "skipped"]] = rows[["finished", "skipped"]].astype(int)
    alone = jobs[jobs.parent.isna()]
    rows.attrs["single_runs"] = len(alone)
    return rows.sort_values("started (UTC)", ignore_index=True)


def one_per_point(jobs: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """Each point once: of the runs with the same `config_hash` (one point, rerun with force=true or pooled
    from several sweeps), its latest FINISHED run, or its latest run where none finished; runs without a
    hash (older ones) all stay. The runs kept, and how many were left out."""
    if "config_hash" not in jobs or jobs.config_hash.isna().all():
        return jobs, 0
    order = jobs.assign(_done=jobs.status.eq("FINISHED")).sort_values(["_done", "start_time"])
    hashed = order[order.config_hash.notna()]
    keep = set(hashed.drop_duplicates("config_hash", keep="last").index) | set(
        jobs.index[jobs.config_hash.isna()]
    )
    kept = jobs[jobs.index.isin(keep)].reset_index(drop=True)
    return kept, len(jobs) - len(kept)


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
            "tags.config_hash",
            "tags.replaced_by",
            "tags.trainer_optim",
            "tags.peak_breakdown",
        ]
    )
    tags.columns = [c.removeprefix("tags.") for c in tags.columns]
    tags = tags.rename(columns={"mlflow.runName": "run_name", "mlflow.parentRunId": "sweep_run_id"})
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
            tags[["config_hash", "replaced_by", "trainer_optim", "peak_breakdown"]],
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
