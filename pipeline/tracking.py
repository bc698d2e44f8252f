"""MLflow adapter: the store's URI, one client on it, experiments, runs and batched logging.

It knows nothing of sweeps, jobs or reports (pipeline.sweep and pipeline.runner use it), and imports nothing of
ours but `pipeline` itself.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from omegaconf import DictConfig

_MAX_METRICS, _MAX_PARAMS, _MAX_TAGS = 1000, 100, 100  # MLflow's log_batch limits
_MAX_TAG_CHARS = 8000


def store_uri(uri: str | None, outputs_dir: str | Path) -> str:
    """uri, else $MLFLOW_TRACKING_URI, else a sqlite file under outputs_dir."""
    return (
        uri
        or os.environ.get("MLFLOW_TRACKING_URI")
        or f"sqlite:///{Path(outputs_dir).resolve() / 'mlflow.db'}"
    )


def _chunks(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i : i + size]


class Tracker:
    """One MLflow client on one store; a local (sqlite) store keeps its artifacts under outputs_dir/mlartifacts."""

    def __init__(self, uri: str, outputs_dir: str | Path = "outputs"):
        from mlflow import MlflowClient

        self.uri = uri
        self.outputs_dir = Path(outputs_dir)
        if self.uri.startswith("sqlite:///"):
            Path(self.uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(self.uri)

    @classmethod
    def for_config(cls, cfg: DictConfig) -> Tracker:
        """The store a job's config names (tracking.uri, else $MLFLOW_TRACKING_URI, else under outputs_dir)."""
        return cls(store_uri(cfg.tracking.uri, cfg.outputs_dir), cfg.outputs_dir)

    def experiment_id(self, name: str) -> str:
        """Get or create the experiment; on a local store its artifacts go to outputs_dir/mlartifacts."""
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        location = None
        if self.uri.startswith("sqlite:"):
            location = (self.outputs_dir.resolve() / "mlartifacts").as_uri()
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
        series = series or {}
        # a metric also given as a series is logged as the series alone (whose last step holds its value)
        rows = [Metric(k, float(v), now, 0) for k, v in (metrics or {}).items() if k not in series]
        for key, values in series.items():  # a list counts steps from 1; a dict gives them
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

    def log_artifacts(self, run_id: str, folder: Path, artifact_path: str) -> None:
        self.client.log_artifacts(run_id, str(folder), artifact_path)

    def end(self, run_id: str, status: str) -> None:
        self.client.set_terminated(run_id, status=status)

    def status(self, run_id: str) -> str:
        return self.client.get_run(run_id).info.status

    def finished_run(self, experiment_id: str, config_hash: str):
        """The latest FINISHED run of the same point (same config hash), if any."""
        runs = self.client.search_runs(
            [experiment_id],
            filter_string=f"tags.config_hash = '{config_hash}' and attributes.status = 'FINISHED'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        return runs[0] if runs else None

    def child_runs(self, experiment_id: str, parent_run_id: str, status: str | None = None):
        """The runs under a parent run (a sweep's jobs), those of one status when given."""
        where = f"tags.mlflow.parentRunId = '{parent_run_id}'"
        if status is not None:
            where += f" and attributes.status = '{status}'"
        return self.client.search_runs([experiment_id], filter_string=where, max_results=10000)
