"""Results trained but not recorded yet: every job's outcome goes through a small journal entry
(`unrecorded.json` in its job folder, beside result.json or error.txt) before it goes to MLflow, and the entry
is removed once the store has it. A store that is away when a job ends (a server down for longer than
MLflow's own retries, a database locked) leaves the entry behind: nothing is lost, and `record` puts it in the
store later, once (running it again records nothing twice), as the runner would have.

It knows nothing of sweeps or jobs beyond their folders; pipeline.runner writes and records entries,
pipeline.sweep and `python -m pipeline.record` record what is still waiting.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from pathlib import Path

from pipeline.browse import display_metrics
from pipeline.job import ADAPTER_DIR, CONFIG_FILE, ERROR_FILE, RESULT_FILE, run_description
from pipeline.tracking import DESCRIPTION, Tracker

UNRECORDED_FILE = "unrecorded.json"
RECORD_KEY = "record_key"  # tag of a run created from an entry: a second `record` finds it instead of a twin
# failure reasons that end a run KILLED (a person or a scheduler stopped it), not FAILED
KILLED_BY = {"cancelled": "KILLED", "preempted": "KILLED"}


def status_of(failure_reason: str | None) -> str:
    """The status a run ends with: FINISHED without a failure, KILLED for one a person caused, else FAILED."""
    return "FINISHED" if failure_reason is None else KILLED_BY.get(failure_reason, "FAILED")


def awaits_outcome(run) -> bool:
    """Whether `run` holds no outcome of its job yet: still RUNNING, or ended FAILED or KILLED by its sweep
    (the launching process ends the runs it leaves behind as it fails or is stopped) without its job's failure
    recorded in it (no `failure_reason` tag)."""
    if run.info.status == "RUNNING":
        return True
    return run.info.status in ("FAILED", "KILLED") and "failure_reason" not in run.data.tags


def now_ms() -> int:
    return int(time.time() * 1000)


def entry(
    *,
    tracking_uri: str,
    experiment_id: str,
    name: str,
    run_id: str | None,
    parent_run_id: str | None,
    tags: dict,
    params: dict,
    start_time: int,
    failure=None,
    replaces: str | None = None,
) -> dict:
    """What recording a job's outcome needs besides the files in its folder: where it goes (store,
    experiment, parent; the run, when the store took it at the start), its name, tags and params, its times,
    and a failure (`reason`, the figures at the time) or None for a result in result.json."""
    return {
        "key": uuid.uuid4().hex,
        "tracking_uri": tracking_uri,
        "experiment_id": experiment_id,
        "parent_run_id": parent_run_id,
        "run_id": run_id,
        "name": name,
        "tags": tags,
        "params": params,
        "start_time": start_time,
        "end_time": now_ms(),
        "failure": None
        if failure is None
        else {"reason": failure.reason, "metrics": failure.metrics, "series": failure.series},
        "replaces": replaces,
    }


def write(job_dir: Path, record: dict) -> None:
    """The entry, atomically: a reader never sees half of one."""
    tmp = job_dir / f".{UNRECORDED_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, job_dir / UNRECORDED_FILE)


def read(job_dir: Path) -> dict:
    return json.loads((job_dir / UNRECORDED_FILE).read_text())


def waiting(folder: Path) -> list[Path]:
    """The job folders under `folder` (itself included) whose outcome waits to be recorded."""
    return sorted(path.parent for path in Path(folder).glob(f"**/{UNRECORDED_FILE}"))


def finished_waiting(outputs_dir: Path, tracking_uri: str, config_hash: str, sweep_dirs=()) -> Path | None:
    """A job folder of the default run and sweep folders (outputs_dir/runs, outputs_dir/multirun, and the
    `sweep_dirs` wherever hydra.sweep.dir put them) holding a FINISHED result of this point for this store that
    waits to be recorded: a resumed sweep records it instead of training the point again."""
    outputs_dir = Path(outputs_dir)
    found = {
        *outputs_dir.glob(f"multirun/*/*/{UNRECORDED_FILE}"),
        *outputs_dir.glob(f"runs/*/{UNRECORDED_FILE}"),
        *(path for folder in sweep_dirs for path in Path(folder).glob(f"*/{UNRECORDED_FILE}")),
    }
    for path in sorted(found):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if (
            record.get("failure") is None
            and record.get("tracking_uri") == tracking_uri
            and record.get("tags", {}).get("config_hash") == config_hash
        ):
            return path.parent
    return None


def _run_id(tracker: Tracker, record: dict) -> str:
    """The entry's run: the one opened when the job started, else the one an earlier `record` created from
    this entry, else a new one with the job's name, parent and start time."""
    if record["run_id"]:
        return record["run_id"]
    found = tracker.client.search_runs(
        [record["experiment_id"]], filter_string=f"tags.{RECORD_KEY} = '{record['key']}'", max_results=1
    )
    if found:
        return found[0].info.run_id
    tags = {**record["tags"], RECORD_KEY: record["key"]}
    return tracker.start_run(
        record["experiment_id"],
        record["name"],
        parent_run_id=record["parent_run_id"],
        tags=tags,
        start_time=record["start_time"],
    )


def not_logged(tracker: Tracker, run, series: dict | None) -> dict | None:
    """`series` less the steps `run` holds already (a run resumed from a checkpoint holds those of the steps
    before it)."""
    if not series or not any(key in run.data.metrics for key in series):
        return series
    kept = {}
    for key, values in series.items():
        steps = values.items() if isinstance(values, dict) else enumerate(values, start=1)
        logged = (
            {m.step for m in tracker.client.get_metric_history(run.info.run_id, key)}
            if key in run.data.metrics
            else set()
        )
        kept[key] = {int(step): v for step, v in steps if int(step) not in logged}
    return kept


def record(tracker: Tracker, job_dir: Path) -> tuple[str, str]:
    """Put a job's waiting outcome in the store and remove its entry; (run id, status). Idempotent: a run the
    store already holds with an outcome is left as it is (awaits_outcome)."""
    job_dir = Path(job_dir)
    entry_ = read(job_dir)
    run_id = _run_id(tracker, entry_)
    failure = entry_["failure"]
    status = status_of(failure and failure["reason"])
    run = tracker.client.get_run(run_id)
    if awaits_outcome(run):
        # the params and tags the run opened with, and those known only once the job ran (how its process
        # started, the result's), all in one call
        params, tags = entry_["params"], entry_["tags"]
        if failure is None:
            result = json.loads((job_dir / RESULT_FILE).read_text())
            metrics, series, params = result["metrics"], result["series"], {**params, **result["params"]}
            tags = {**tags, **result["tags"], DESCRIPTION: run_description(metrics, result["tags"])}
            # beside the exact figures, their rounded copies for the UI's runs table (F1, Peak MB, Samples/s, State MB)
            metrics = {**metrics, **display_metrics(metrics)}
        else:
            summary = (job_dir / ERROR_FILE).read_text().strip().splitlines()[0]
            metrics, series = failure["metrics"], failure.get("series")
            tags = {
                **tags,
                "error": summary,
                "failure_reason": failure["reason"],
                DESCRIPTION: f"{status}: {failure['reason']}: {summary}",
            }
        series = not_logged(tracker, run, series)
        tracker.log(run_id, metrics, series, params, tags, timestamp=entry_["end_time"])
        tracker.log_artifact(run_id, job_dir / CONFIG_FILE)
        if failure is not None:
            tracker.log_artifact(run_id, job_dir / ERROR_FILE)
        elif result.get("datasets"):
            tracker.log_datasets(run_id, result["datasets"])
        if failure is None and (job_dir / ADAPTER_DIR).is_dir():  # peft.save_adapter=true
            tracker.log_artifacts(run_id, job_dir / ADAPTER_DIR, ADAPTER_DIR)
        tracker.end(run_id, status, end_time=entry_["end_time"])
        if entry_["replaces"] and failure is None:  # force=true: the point's earlier result has a later one
            tracker.log(entry_["replaces"], tags={"replaced_by": run_id})
    (job_dir / UNRECORDED_FILE).unlink()
    return run_id, status


def record_all(folder: Path, tracker: Tracker | None = None) -> tuple[list[tuple[str, str]], list[Path], str]:
    """Record every outcome waiting under `folder`, each into its own store (`tracker` for the store it names,
    when given): (the (run id, status) recorded, the job folders still waiting, why they wait). The first store
    that does not answer stops it: each try costs MLflow's whole retry window."""
    trackers = {tracker.uri: tracker} if tracker is not None else {}
    folders, done = waiting(folder), []
    for n, job_dir in enumerate(folders):
        try:
            uri = read(job_dir)["tracking_uri"]
            if uri not in trackers:
                trackers[uri] = Tracker(uri)
            done.append(record(trackers[uri], job_dir))
        except Exception as err:  # the store is away (or refuses): the rest waits too
            return done, folders[n:], first_line(err)
    return done, [], ""


# MLflow's error for a server that did not answer: the server and the cause, without the request's details
_NO_ANSWER = re.compile(
    r"API request to (\S+?)/(?:api|ajax-api)/\S* failed with exception.*?(\[Errno -?\d+\] [^'\")]+|timed out)"
)


def first_line(err: BaseException) -> str:
    """An error as one short line: a server that did not answer as `<server>: <cause>` (MLflow's own text
    runs to several hundred characters), anything else as its first line."""
    text = str(err).strip()
    found = _NO_ANSWER.search(text)
    if found:
        return f"{found.group(1)}: {found.group(2).strip()}"
    text = text.splitlines()[0] if text else ""
    text = f"{type(err).__name__}: {text}" if text else type(err).__name__
    return text if len(text) <= 200 else text[:197] + "..."
