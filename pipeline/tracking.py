"""MLflow adapter: the store's URI, one client on it, experiments, runs, batched logging, dataset inputs,
saved views of the runs table and the UI's addresses; the lock beside a sqlite store while it is created, and
the one-line StoreError of a store that cannot be opened or a server that refuses this client.

It knows nothing of sweeps, jobs or reports (pipeline.sweep and pipeline.runner use it), and imports nothing of
ours but pipeline.cache (where a new sqlite store's empty schema is kept).
"""

from __future__ import annotations

import contextlib
import functools
import getpass
import json
import os
import time
from pathlib import Path
from urllib.parse import urlencode, urlparse

from omegaconf import DictConfig

_MAX_TAG_CHARS = 8000
# MLflow 3's UI: the experiment kind its "Machine learning" (model training) mode stands for, the URL
# parameter that opens that mode (a fresh browser defaults to GenAI), a run's description, and a saved view of
# the runs table (an experiment tag, listed under "Views", opened by `viewStateShareKey`); see docs/mlflow.md
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
MODEL_TRAINING = {"workflowType": "machine_learning"}
DESCRIPTION = "mlflow.note.content"
# a sweep's parent-run tag prefix: skipped_run.<job number> = the run that skipped point FINISHED as before
SKIPPED_RUN = "skipped_run."
VIEW_TAG, VIEW_PARAM = "mlflow.sharedViewState.", "viewStateShareKey"
LOCAL_UI = "http://127.0.0.1:5000"  # where `make ui` serves a local store
# `datasets` column types -> MLflow schema types (anything else is described as a string)
_SCHEMA_TYPES = {
    "int64": "long",
    "int32": "integer",
    "bool": "boolean",
    "float32": "float",
    "float64": "double",
}


def store_uri(uri: str | None, outputs_dir: str | Path) -> str:
    """uri, else $MLFLOW_TRACKING_URI, else a sqlite file under outputs_dir."""
    return (
        uri
        or os.environ.get("MLFLOW_TRACKING_URI")
        or f"sqlite:///{Path(outputs_dir).resolve() / 'mlflow.db'}"
    )


def is_server(uri: str) -> bool:
    """An MLflow tracking server (it serves its own UI at the same address), not a database or a folder."""
    return uri.startswith(("http://", "https://"))


def ui_url(
    uri: str,
    experiment_id: str | None = None,
    run_id: str | None = None,
    view: str | None = None,
    local_ui: str = LOCAL_UI,
) -> str:
    """The UI's address of an experiment's runs table (`view`: a saved view's key), of one run, or of the
    experiments list, in the model-training mode: a server's own address, else where `make ui` serves."""
    base = uri.rstrip("/") if is_server(uri) else local_ui.rstrip("/")
    path = (
        "/experiments"
        + (f"/{experiment_id}/runs" if experiment_id else "")
        + (f"/{run_id}" if run_id else "")
    )
    query = {**MODEL_TRAINING, **({VIEW_PARAM: view} if view and not run_id else {})}
    return f"{base}/#{path}?{urlencode(query)}"


class StoreError(Exception):
    """The store cannot be opened, or a server refuses this client: one line naming the store and the fix."""


# what MLflow opens: a sqlite file, a server, a database (the folder store is retired in MLflow 3)
SCHEMES = ("sqlite", "http", "https", "postgresql", "mysql", "mssql")
AUTH_VARIABLES = "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD"
LOCK_TIMEOUT_S = 600  # how long a process waits for another one creating or migrating the same sqlite store


def sqlite_path(uri: str) -> Path | None:
    """The database file of a sqlite store URI, None for any other store."""
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


def seed_sqlite(path: Path, outputs_dir) -> None:
    """A new sqlite store begins as a copy of an empty one that MLflow created and migrated once (kept in
    pipeline.cache's folder `mlflow/`, keyed by the MLflow, SQLAlchemy and alembic versions and this module):
    MLflow's migrations of a new file take seconds, a copy milliseconds. The copy holds no experiment: MLflow adds its
    Default one, with this store's artifact location and time, when it opens the store. Where the cache cannot
    be written (or the empty store cannot be made), nothing is copied and MLflow creates the schema itself."""
    import shutil
    import sqlite3
    from importlib.metadata import version

    from pipeline import cache

    folder = cache.folder(outputs_dir, "mlflow")
    # (made by these versions and this module: an edit elsewhere in the pipeline keeps it)
    versions = [version(p) for p in ("mlflow", "sqlalchemy", "alembic")]
    empty = folder / f"empty-{cache.key(*versions, code=cache.source_digest('tracking.py'))}.db"
    try:
        if not empty.exists():
            from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".{empty.name}.{os.getpid()}"
            try:
                tmp.unlink(missing_ok=True)
                store = SqlAlchemyStore(f"sqlite:///{tmp}", str(folder))  # creates and migrates the schema
                store.engine.dispose()
                with contextlib.closing(sqlite3.connect(tmp)) as db, db:
                    db.execute("DELETE FROM experiments")
                os.replace(tmp, empty)  # whole or not at all: sweeps started at once may make it together
            finally:
                tmp.unlink(missing_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        try:
            shutil.copyfile(empty, tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    except Exception:  # the cache cannot be written, or the empty store made: MLflow makes this one itself
        pass


@contextlib.contextmanager
def creation_lock(uri: str):
    """An inter-process lock beside a sqlite database (`mlflow.db.lock`), held while MLflow creates or
    migrates its schema and while an experiment is looked up or created, so that any number of processes can
    start at once on a fresh store; nothing for another store (a server or a database serialises its own
    writes). A folder where the lock cannot be written (read-only) gets none: the store is only read there."""
    path = sqlite_path(uri)
    if path is None:
        yield
        return
    from filelock import FileLock, Timeout

    lock = FileLock(f"{path}.lock", timeout=LOCK_TIMEOUT_S)
    try:
        lock.acquire()
    except PermissionError:
        if not path.exists():
            raise StoreError(not_writable(uri, path.parent)) from None
        yield
        return
    except Timeout:
        raise StoreError(
            f"tracking uri {uri}: another process has held {lock.lock_file} for {LOCK_TIMEOUT_S} s while "
            "creating the store: wait for it to finish, or stop it"
        ) from None
    try:
        yield
    finally:
        lock.release()


def not_writable(uri: str, folder: Path) -> str:
    return (
        f"tracking uri {uri} cannot be opened: {folder} is not writable: make it writable, or point "
        "tracking.uri (or MLFLOW_TRACKING_URI) at a folder you can write"
    )


def refused(err: BaseException) -> bool:
    """A server's 401 (no or wrong credentials) or 403 (this user may not do that)."""
    code = getattr(err, "error_code", None)
    return code in ("UNAUTHENTICATED", "PERMISSION_DENIED") or any(
        f"error code {status} " in str(err) for status in (401, 403)
    )


def auth_error(uri: str, err: BaseException) -> str:
    """The one line for a server that refused this client: which variables to set."""
    user = os.environ.get("MLFLOW_TRACKING_USERNAME")
    if getattr(err, "error_code", None) == "PERMISSION_DENIED" or "error code 403 " in str(err):
        return (
            f"tracking uri {uri} refused user {user!r} (permission denied): ask the server's admin for "
            f"EDIT permission, or set {AUTH_VARIABLES} to another account"
        )
    if user and os.environ.get("MLFLOW_TRACKING_PASSWORD"):
        return (
            f"tracking uri {uri} refused the credentials of user {user!r}: check {AUTH_VARIABLES} "
            "(the server's admin sets accounts up: docs/mlflow.md)"
        )
    return (
        f"tracking uri {uri} wants credentials: set {AUTH_VARIABLES} to your account on that server "
        "(the server's admin sets accounts up: docs/mlflow.md)"
    )


def open_error(uri: str, err: BaseException) -> str:
    """The one line for a store MLflow could not open (or a server that refused this client): the store, what
    is wrong and the fix."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if refused(err):
        return auth_error(uri, err)
    scheme = urlparse(uri).scheme
    if scheme in ("", "file"):
        return (
            f"tracking uri {uri} is a folder, which MLflow 3 no longer records to: use a sqlite file in it, "
            f"e.g. tracking.uri=sqlite:///{Path(uri.removeprefix('file://')).resolve() / 'mlflow.db'}"
        )
    if scheme not in SCHEMES:
        return (
            f"tracking uri {uri} has an unknown scheme {scheme!r}: use sqlite:///<path>/mlflow.db, "
            "http(s)://<server>:<port> or a database URI (postgresql://, mysql://)"
        )
    path = sqlite_path(uri)
    if path is not None:
        if isinstance(err, PermissionError):  # the folder could not be made
            return not_writable(uri, Path(err.filename or path.parent))
        if "readonly database" in text or "unable to open database file" in text:
            folder = path.parent if path.exists() and os.access(path, os.W_OK) else path
            return not_writable(uri, folder)
        if "file is not a database" in text or "malformed" in text:
            return (
                f"tracking uri {uri} cannot be opened: {path} is not a sqlite database MLflow can read "
                f"({text.split(') ')[-1]}): move it aside (e.g. mv {path} {path}.broken) for a fresh store, "
                "or point tracking.uri at another file"
            )
    if isinstance(err, ImportError):
        fix = 'pip install -e ".[postgres]"' if scheme.startswith("postgresql") else "pip install it"
        return f"tracking uri {uri} needs a package that is not installed ({text}): {fix}"
    return f"tracking uri {uri} cannot be opened ({type(err).__name__}: {text}): check the uri and the store"


def login_name() -> str:
    """This process's user name, or "unknown" where the system has none for it (some containers)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


class Tracker:
    """One MLflow client on one store; a local (sqlite) store keeps its artifacts under outputs_dir/mlartifacts."""

    def __init__(self, uri: str, outputs_dir: str | Path = "outputs"):
        from mlflow import MlflowClient

        # MLflow's own "View run at" lines (a server store) open in the GenAI mode: ui_url's links replace
        # them
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
        self.uri = uri
        self.outputs_dir = Path(outputs_dir)
        path = sqlite_path(uri)
        try:
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
            with creation_lock(uri):  # MLflow creates or migrates a sqlite schema when it opens the store
                if path is not None and not path.exists():
                    seed_sqlite(path, self.outputs_dir)
                self.client = MlflowClient(self.uri)
        except StoreError:
            raise
        except Exception as err:
            raise StoreError(open_error(uri, err)) from err

    @classmethod
    def for_config(cls, cfg: DictConfig) -> Tracker:
        """The store a job's config names (tracking.uri, else $MLFLOW_TRACKING_URI, else under outputs_dir),
        opened once per process: a sweep's launching process opens it once for all its jobs."""
        return _opened(store_uri(cfg.tracking.uri, cfg.outputs_dir), str(cfg.outputs_dir))

    @classmethod
    def opened(cls, uri: str, outputs_dir: str | Path) -> Tracker:
        """The store at `uri`, opened once per process."""
        return _opened(uri, str(outputs_dir))

    def experiment_id(self, name: str) -> str:
        """Get or create the experiment, marked as a model-training one; on a local store its artifacts go to
        outputs_dir/mlartifacts. Processes creating it at once get the same one: under the creation lock on
        sqlite, and a server's "already exists" answer to all but the first. A server that refuses this
        client (no or wrong credentials) raises StoreError."""
        from mlflow.exceptions import MlflowException

        try:
            with creation_lock(self.uri):
                experiment = self.client.get_experiment_by_name(name)
                if experiment is not None:
                    self.mark_model_training(experiment)
                    return experiment.experiment_id
                location = None
                if self.uri.startswith("sqlite:"):
                    location = (self.outputs_dir.resolve() / "mlartifacts").as_uri()
                try:
                    return self.client.create_experiment(
                        name, artifact_location=location, tags=dict([EXPERIMENT_KIND])
                    )
                except MlflowException as err:
                    if err.error_code != "RESOURCE_ALREADY_EXISTS":
                        raise
                    return self.client.get_experiment_by_name(name).experiment_id  # another sweep made it
        except MlflowException as err:
            if refused(err):
                raise StoreError(auth_error(self.uri, err)) from err
            raise

    def mark_model_training(self, experiment) -> None:
        """Tag an experiment created before the kind was set (or by hand) as model training, as MLflow 3's UI
        does when one picks "Machine learning" in the experiment's header; a kind set by a person is kept."""
        key, kind = EXPERIMENT_KIND
        if key not in experiment.tags:
            self.client.set_experiment_tag(experiment.experiment_id, key, kind)

    def save_view(self, experiment_id: str, key: str, name: str, state: dict) -> None:
        """A saved view of the experiment's runs table (columns, their order and widths, sort), as the UI's
        "Views > Save view" writes it (the envelope name / createdAt / updatedAt / state): listed under
        "Views", opened by ui_url(..., view=key). Written only when absent or different (a person's
        "Override saved view" of this one included); other views are never touched."""
        tag, text = VIEW_TAG + key, json.dumps(state, sort_keys=True)
        old = self.client.get_experiment(experiment_id).tags.get(tag)
        try:
            envelope = json.loads(old) if old else {}
        except ValueError:
            envelope = {}
        envelope = envelope if isinstance(envelope, dict) else {}
        if envelope.get("state") == text:
            return
        now = int(time.time() * 1000)
        envelope = {
            "name": name,
            "createdAt": envelope.get("createdAt", now),
            "updatedAt": now,
            "state": text,
        }
        self.client.set_experiment_tag(experiment_id, tag, json.dumps(envelope))

    def describe(self, run_id: str, text: str) -> None:
        """The run's description (the UI's Description column and the run page's note)."""
        self.client.set_tag(run_id, DESCRIPTION, text[:_MAX_TAG_CHARS])

    def start_run(
        self, experiment_id: str, name: str, parent_run_id: str | None = None, tags=None, start_time=None
    ) -> str:
        tags = dict(tags or {})
        if parent_run_id:
            tags["mlflow.parentRunId"] = parent_run_id
        # who recorded it (the UI's User column): the account on a server that wants one, else the login, as
        # MLflow's own mlflow.start_run sets it
        tags.setdefault("mlflow.user", os.environ.get("MLFLOW_TRACKING_USERNAME") or login_name())
        run = self.client.create_run(experiment_id, start_time=start_time, run_name=name, tags=tags)
        return run.info.run_id

    def log(self, run_id: str, metrics=None, series=None, params=None, tags=None, timestamp=None) -> None:
        """Everything in as few log_batch calls as MLflow's limits allow (one call costs 50-80 ms); the metrics
        stamped `timestamp` (ms), else now."""
        from mlflow.entities import Metric, Param, RunTag

        now = timestamp or int(time.time() * 1000)
        series = series or {}
        # a metric also given as a series is logged as the series alone (whose last step holds its value)
        rows = [Metric(k, float(v), now, 0) for k, v in (metrics or {}).items() if k not in series]
        for key, values in series.items():  # a list counts steps from 1; a dict gives them
            steps = values.items() if isinstance(values, dict) else enumerate(values, start=1)
            rows += [Metric(key, float(v), now, int(step)) for step, v in steps]
        params = [Param(k, str(v)) for k, v in (params or {}).items()]
        tags = [RunTag(k, str(v)[:_MAX_TAG_CHARS]) for k, v in (tags or {}).items()]
        # MLflow's client packs them into as few store calls as its limits allow
        self.client.log_batch(run_id, metrics=rows, params=params, tags=tags)

    def log_datasets(self, run_id: str, datasets: list[dict]) -> None:
        """Each dataset as one MLflow dataset input: name, digest, source, schema and row count (`profile`),
        its role in the input tag `mlflow.data.context`, all in one log_inputs call. A dataset is a dict:
        context, name, digest, rows, columns ({column: `datasets` dtype}) and source ({"uri": file URI} or
        {"hub": path, "subset": name, "split": split})."""
        from mlflow.entities import Dataset, DatasetInput, InputTag
        from mlflow.exceptions import MlflowException
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        inputs = []
        for data in datasets:
            meta = _meta_dataset(data).to_dict()
            entity = Dataset(
                name=meta["name"],
                digest=meta["digest"],
                source_type=meta["source_type"],
                source=meta["source"],
                schema=meta.get("schema"),
                profile=json.dumps({"num_rows": data["rows"]}),
            )
            inputs.append(DatasetInput(entity, [InputTag(MLFLOW_DATASET_CONTEXT, data["context"])]))
        try:
            self.client.log_inputs(run_id, datasets=inputs)
        except MlflowException as err:
            if "unique constraint" not in str(err).lower():
                raise
            # parallel jobs of one sweep log the same splits: MLflow's SQL store looks a dataset up, then inserts
            # it, so the slower of two at the same moment fails; the row exists now, and the call is one
            # transaction: a second call links this run to it
            self.client.log_inputs(run_id, datasets=inputs)

    def log_artifact(self, run_id: str, path: Path) -> None:
        self.client.log_artifact(run_id, str(path))

    def log_artifacts(self, run_id: str, folder: Path, artifact_path: str) -> None:
        self.client.log_artifacts(run_id, str(folder), artifact_path)

    def end(self, run_id: str, status: str, end_time: int | None = None) -> None:
        self.client.set_terminated(run_id, status=status, end_time=end_time)

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

    def sweep_dirs(self, experiment_id: str) -> list[str]:
        """The folders of the experiment's sweeps, as their parent runs name them (tag `sweep_dir`)."""
        runs = self.client.search_runs(
            [experiment_id], filter_string="tags.kind = 'sweep'", max_results=10000
        )
        return sorted({r.data.tags["sweep_dir"] for r in runs if "sweep_dir" in r.data.tags})

    def runs(self, experiment_id: str, run_ids) -> list:
        """The experiment's runs of these ids, in one search."""
        if not run_ids:
            return []
        listed = ", ".join(f"'{run_id}'" for run_id in dict.fromkeys(run_ids))
        return self.client.search_runs(
            [experiment_id], filter_string=f"attributes.run_id IN ({listed})", max_results=10000
        )

    def job_run(self, experiment_id: str, job_dir) -> object | None:
        """The latest run a runner opened for the job folder `job_dir` (its tag job_dir), if any."""
        found = self.client.search_runs(
            [experiment_id],
            filter_string=f"tags.job_dir = '{Path(job_dir).resolve()}'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        return found[0] if found else None

    def child_runs(self, experiment_id: str, parent_run_id: str, status: str | None = None):
        """The runs under a parent run (a sweep's jobs), those of one status when given."""
        where = f"tags.mlflow.parentRunId = '{parent_run_id}'"
        if status is not None:
            where += f" and attributes.status = '{status}'"
        return self.client.search_runs([experiment_id], filter_string=where, max_results=10000)


@functools.cache
def _opened(uri: str, outputs_dir: str) -> Tracker:
    return Tracker(uri, outputs_dir)


def _meta_dataset(data: dict):
    """mlflow.data's description of a dataset that stays where it is (MetaDataset): its source (a local file
    or folder, or a Hugging Face hub dataset), name, digest and column schema."""
    from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.data.sources import LocalArtifactDatasetSource
    from mlflow.types import ColSpec, Schema

    where = data["source"]
    if "uri" in where:
        source = LocalArtifactDatasetSource(where["uri"])
    else:
        source = HuggingFaceDatasetSource(
            path=where["hub"], config_name=where.get("subset"), split=where.get("split")
        )
    columns = [ColSpec(_SCHEMA_TYPES.get(dtype, "string"), name) for name, dtype in data["columns"].items()]
    return MetaDataset(source, name=data["name"], digest=data["digest"], schema=Schema(columns))
