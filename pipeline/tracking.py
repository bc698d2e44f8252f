"""MLflow: the store, a sweep's parent run, one child run per job, batched logging.

Only the launching process creates things (the sqlite schema, the experiment, the parent run), before any
job starts; jobs find their ids in SWEEP_FILE in the sweep folder, so parallel jobs never race on creation.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

SWEEP_FILE = "mlflow_sweep.json"
SUMMARY_METRICS = ("optimizer_state_mb", "peak_memory_mb", "eval_loss", "eval_f1", "train_samples_per_second")
_MAX_METRICS, _MAX_PARAMS, _MAX_TAGS = 1000, 100, 100  # MLflow's log_batch limits
_MAX_TAG_CHARS = 8000


def store_uri(uri: str | None, outputs_dir: str | Path) -> str:
    """uri, else $MLFLOW_TRACKING_URI, else a sqlite file under outputs_dir."""
    return (
        uri
        or os.environ.get("MLFLOW_TRACKING_URI")
        or f"sqlite:///{Path(outputs_dir).resolve() / 'mlflow.db'}"
    )


def tracking_uri(cfg: DictConfig) -> str:
    return store_uri(cfg.tracking.uri, cfg.outputs_dir)


def _chunks(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i : i + size]


class Tracker:
    def __init__(self, cfg: DictConfig):
        from mlflow import MlflowClient

        self.cfg = cfg
        self.uri = tracking_uri(cfg)
        if self.uri.startswith("sqlite:///"):
            Path(self.uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(self.uri)

    def experiment_id(self) -> str:
        """Get or create the experiment; on a local store its artifacts go to outputs_dir/mlartifacts."""
        name = self.cfg.tracking.experiment
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        location = None
        if self.uri.startswith("sqlite:"):
            location = (Path(self.cfg.outputs_dir).resolve() / "mlartifacts").as_uri()
        return self.client.create_experiment(name, artifact_location=location)

    def start_run(self, experiment_id: str, name: str, parent_run_id: str | None = None, tags=None) -> str:
        tags = dict(tags or {})
        if parent_run_id:
            tags["mlflow.parentRunId"] = parent_run_id
        return self.client.create_run(experiment_id, run_name=name, tags=tags).info.run_id

    def log(self, run_id: str, metrics=None, series=None, params=None, tags=None) -> None:
        """Everything in as few log_batch calls as MLflow's limits allow (one call costs 50-80 ms)."""
        from mlflow.entities import Metric, Param, RunTag

        now = int(time.time() * 1000)
        rows = [Metric(k, float(v), now, 0) for k, v in (metrics or {}).items()]
        for key, values in (series or {}).items():  # a list counts steps from 1; a dict gives them
            steps = values.items() if isinstance(values, dict) else enumerate(values, start=1)
            rows += [Metric(key, float(v), now, int(step)) for step, v in steps]
        params = [Param(k, str(v)) for k, v in (params or {}).items()]
        tags = [RunTag(k, str(v)[:_MAX_TAG_CHARS]) for k, v in (tags or {}).items()]
        for chunk in _chunks(rows, _MAX_METRICS):
            self.client.log_batch(run_id, metrics=chunk)
        for chunk in _chunks(params, _MAX_PARAMS):
            self.client.log_batch(run_id, params=chunk)
        for chunk in _chunks(tags, _MAX_TAGS):
            self.client.log_batch(run_id, tags=chunk)

    def log_artifact(self, run_id: str, path: Path) -> None:
        self.client.log_artifact(run_id, str(path))

    def end(self, run_id: str, status: str) -> None:
        self.client.set_terminated(run_id, status=status)

    def finished_run(self, experiment_id: str, config_hash: str):
        """The latest FINISHED run of the same point (same config hash), if any."""
        runs = self.client.search_runs(
            [experiment_id],
            filter_string=f"tags.config_hash = '{config_hash}' and attributes.status = 'FINISHED'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        return runs[0] if runs else None

    def child_runs(self, experiment_id: str, parent_run_id: str):
        return self.client.search_runs(
            [experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'", max_results=10000
        )


def sweep_ids(sweep_dir: Path) -> dict | None:
    path = Path(sweep_dir) / SWEEP_FILE
    return json.loads(path.read_text()) if path.exists() else None


def summary_table(runs) -> str:
    """Short console table of a sweep's jobs (the full comparison is `make report`)."""
    import pandas as pd

    rows = [
        {
            "run": r.info.run_name,
            "status": r.info.status,
            **{k: r.data.metrics.get(k) for k in SUMMARY_METRICS},
        }
        for r in sorted(runs, key=lambda r: r.info.start_time)
    ]
    frame = pd.DataFrame(rows).rename(
        columns={
            "optimizer_state_mb": "state [MB]",
            "peak_memory_mb": "peak [MB]",
            "eval_loss": "eval loss",
            "eval_f1": "eval F1",
            "train_samples_per_second": "samples/s",
        }
    )
    return frame.to_string(index=False, float_format=lambda v: f"{v:.4g}", na_rep="")


ACTIVE_SWEEP: dict = {}  # the ids of the sweep this (launching) process opened, for an interrupt


def mark_sweep_killed() -> None:
    """After Ctrl-C / SIGTERM in the launching process: the parent run and every job run still RUNNING
    become KILLED. Parallel workers may be torn down before their own runner could do it."""
    if not ACTIVE_SWEEP:
        return
    from mlflow import MlflowClient

    client = MlflowClient(ACTIVE_SWEEP["tracking_uri"])
    parent = ACTIVE_SWEEP["parent_run_id"]
    running = client.search_runs(
        [ACTIVE_SWEEP["experiment_id"]],
        filter_string=f"tags.mlflow.parentRunId = '{parent}' and attributes.status = 'RUNNING'",
    )
    for run_id in [r.info.run_id for r in running] + [parent]:
        if client.get_run(run_id).info.status == "RUNNING":
            client.set_terminated(run_id, status="KILLED")


def failed_job_lines(runs) -> list[str]:
    """`name (reason: error)` of every job run that did not finish, as the sweep's summary prints them."""
    return [
        f"{r.info.run_name} ({r.data.tags.get('failure_reason', r.info.status.lower())}: "
        f"{r.data.tags.get('error', r.info.status)})"
        for r in sorted(runs, key=lambda r: r.info.start_time)
        if r.info.status != "FINISHED"
    ]


class SweepCallback(Callback):
    """Opens the sweep's parent run before the first job and closes it after the last one."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        from pipeline.config import ConfigError, check_tracking_uri

        try:  # before MLflow's client would retry a dead server for minutes
            check_tracking_uri(config)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        tracker = Tracker(config)
        experiment_id = tracker.experiment_id()
        overrides = " ".join(config.hydra.overrides.task)
        parent = tracker.start_run(
            experiment_id,
            name=f"sweep-{sweep_dir.name}",
            tags={"sweep_dir": str(sweep_dir.resolve()), "overrides": overrides, "kind": "sweep"},
        )
        ids = {"tracking_uri": tracker.uri, "experiment_id": experiment_id, "parent_run_id": parent}
        (sweep_dir / SWEEP_FILE).write_text(json.dumps(ids))
        ACTIVE_SWEEP.update(ids)
        print(
            f"[sweep] MLflow parent run {parent} in {tracker.uri} (experiment {config.tracking.experiment})"
        )

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        ids = sweep_ids(Path(config.hydra.sweep.dir))
        if ids is None:
            return
        tracker = Tracker(config)
        runs = tracker.child_runs(ids["experiment_id"], ids["parent_run_id"])
        failed = [r for r in runs if r.info.status != "FINISHED"]
        # the summary and exit code come from the store, not from this process's lists: with a parallel or
        # cluster launcher the jobs ran in other processes
        from pipeline import runner

        runner.FAILED_JOBS[:] = failed_job_lines(runs)
        skipped = list(Path(config.hydra.sweep.dir).glob(f"**/{runner.SKIPPED_FILE}"))
        runner.SKIPPED_JOBS[:] = [path.parent.name for path in skipped]
        tracker.log(ids["parent_run_id"], metrics={"jobs": len(runs), "jobs_failed": len(failed)})
        print(f"\n[sweep] {len(runs)} jobs, {len(failed)} failed; parent run {ids['parent_run_id']}")
        if runs:
            self._report(tracker, ids["parent_run_id"], runs, Path(config.outputs_dir))
        tracker.end(ids["parent_run_id"], "FAILED" if failed else "FINISHED")

    @staticmethod
    def _report(tracker: Tracker, parent_run_id: str, runs, outputs_dir: Path) -> None:
        """Build the sweep's report, log it to the parent run and print its short table."""
        try:
            from pipeline import report

            out, table = report.build(tracker.uri, [parent_run_id], root=outputs_dir / "report")
            tracker.client.log_artifacts(parent_run_id, str(out), "report")
            print(report.console_text(out, table))
            print(f"[sweep] report: {out.resolve() / 'report.html'} (and in the parent run's artifacts)")
        except Exception as err:  # the report is a convenience: it must never hide the sweep's results
            print(f"[sweep] report not built: {type(err).__name__}: {err}")
            print(summary_table(runs))
