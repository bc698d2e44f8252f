"""`make ui` (= `python -m pipeline.browse`): the MLflow UI, opened where a sweep's results are.

MLflow 3's UI opens an experiment in its GenAI mode (traces, an overview of "0 traces") unless the URL asks
for the model-training one (`workflowType=machine_learning`), and its runs table starts with Dataset, Source
and Models. This prints the address of the experiment's runs table in the model-training mode with a saved
view ("Optimizer figures": the description, state, peak, F1 and throughput first) and the address of the
latest sweep's jobs, best first (a saved view per sweep, `sweep-<parent run id>`: the page that opens, its
jobs' method, optimizer, F1, peak, samples/s and state first, the figures as rounded display copies:
display_metrics), then serves a local store with `mlflow ui` (a server serves its own UI: the addresses are
printed only). The sweep's end prints its own view's address the same way (sweep_url, sweep_line). See
docs/mlflow.md.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from pipeline.tracking import (
    LOCAL_UI,
    SKIPPED_RUN,
    StoreError,
    Tracker,
    auth_error,
    is_server,
    refused,
    store_uri,
    ui_url,
)

EXPERIMENT = "optimizer-sweep"  # conf/tracking/local.yaml's tracking.experiment
HOST, PORT = "127.0.0.1", 5000  # LOCAL_UI: the address the sweep's links point to
VIEW_KEY, VIEW_NAME = "optimizer-figures", "Optimizer figures"
CREATED = "runDateAndNestInfo"  # the runs table's Created column (pinned beside the run's name)
# the saved view's columns after the run's name, start and description: metrics, then params, each in the
# order the UI gives them anyway (by name), since the 3.17 UI sometimes lays out a group before applying a
# view's column order within it
METRICS = ["eval_f1", "eval_macro_f1", "optimizer_state_mb", "peak_memory_mb", "train_samples_per_second"]
PARAMS = ["batch_size", "lr", "method", "model", "optim"]
# what a job of one sweep is, first in its view: how it trains (full, lora r=16, qlora r=16 nf4) and its
# optimizer
JOB_PARAMS = ["method", "optim"]
# display copies of four of those, rounded for the runs table (the 3.17 UI shows a metric's float as it is:
# no formatter, no precision setting): name -> (the exact metric it copies, how it rounds). Logged beside the
# exact metrics (which stay as they are), where the run's description is made (display_metrics). Capitalised:
# the UI sorts a group's keys by code unit, so they come before every lowercase metric, in this order
DISPLAY = {
    "F1": ("eval_f1", "f1"),
    "Peak MB": ("peak_memory_mb", "3 digits"),
    "Samples/s": ("train_samples_per_second", "3 digits"),
    "State MB": ("optimizer_state_mb", "3 digits"),
}
SWEEP_VIEW = "sweep-"  # + parent run id: the saved view of one sweep's jobs
METRIC_TAG, METRIC = "eval_metric", "macro_f1"  # the parent run's tag: the metric its jobs are ranked by
# a sweep of language models (task=causal_lm) is ranked by its jobs' eval loss, lowest first, and its view
# shows their loss, perplexity and next-token accuracy instead of a classifier's F1s (nothing collapses there)
LM_METRIC = "loss"
LOWER_IS_BETTER = {LM_METRIC}
LM_METRICS = [
    "eval_loss",
    "eval_next_token_accuracy",
    "eval_perplexity",
    "optimizer_state_mb",
    "peak_memory_mb",
    "train_samples_per_second",
]
# the most runs a sweep's view lists by id (a sweep with points FINISHED before; more: only the jobs it ran),
# within the 20,000 characters MLflow keeps of an experiment tag
LISTED_RUNS = 300


def _column(kind: str, key: str) -> str:
    """The runs table's column id (`metrics.\\`peak_memory_mb\\``), as the UI's selectedColumns hold it."""
    return f"{kind}.`{key}`"


def display_value(value: float, how: str) -> float:
    """`value` rounded as the runs table should read it: an F1 to 3 decimals (0.727, as the description),
    other figures (MB, samples/s) to 3 significant digits, whole from 1000 on (7.72, 22.9, 1234:
    pipeline.job.short_mb's figures)."""
    if how == "f1":
        return float(f"{value:.3f}")
    return float(f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}")


def display_metrics(metrics: dict) -> dict:
    """The display copies (DISPLAY) of a run's `metrics`, to log beside them: `F1` (eval_f1), `Peak MB`
    (peak_memory_mb), `Samples/s` (train_samples_per_second) and `State MB` (optimizer_state_mb), rounded
    (display_value); those whose exact metric the run lacks are left out. The exact metrics are not
    touched."""
    return {
        name: display_value(float(metrics[key]), how)
        for name, (key, how) in DISPLAY.items()
        if metrics.get(key) is not None
    }


def ranked(metric: str) -> str:
    """How a sweep's view orders its jobs: `best eval_macro_f1 first`, `lowest eval_loss first`."""
    return f"{'lowest' if metric in LOWER_IS_BETTER else 'best'} eval_{metric} first"


def view_state(search_filter: str | None = None, metric: str = METRIC) -> dict:
    """A saved view: the run's description (state, peak and F1, with units), the key metrics and params,
    then Dataset and Duration; Source and Models (empty for these runs) left out. Every run, sorted by start
    time, so a sweep's parent run keeps its jobs under it; or the runs `search_filter` finds (one sweep's
    jobs), best `eval_<metric>` first: the UI nests runs only when they are sorted by time, so these come as
    a flat list (sorted by time, a filter on the parent would show the parent's row with its jobs folded).
    One sweep's view starts with its jobs' method and optimizer (JOB_PARAMS), the display copies (F1, Peak
    MB, Samples/s, State MB: rounded, sortable) and the tag collapsed (true: a model whose F1 may look good
    though it predicts one class, as the description says) before the description, so that they are on the
    first screen; every run's view has no copies (a sweep's own row, the parent run, carries only the exact
    figures). A sweep of language models (`metric` `loss`): its jobs lowest eval_loss first, their loss,
    perplexity and next-token accuracy among the key metrics, no F1 copy (nothing collapses)."""
    description, dataset = _column("attributes", "Description"), _column("attributes", "Dataset")
    lm = metric in LOWER_IS_BETTER
    copies = [_column("metrics", key) for key in DISPLAY] + [_column("tags", "collapsed")]
    if lm:
        copies = [_column("metrics", key) for key, (exact, _) in DISPLAY.items() if exact != "eval_f1"]
    job = [_column("params", key) for key in JOB_PARAMS]
    shown = [*job, *copies] if search_filter else []
    metrics = [_column("metrics", key) for key in (LM_METRICS if lm and search_filter else METRICS)]
    params = [column for column in (_column("params", key) for key in PARAMS) if column not in shown]
    name = _column("attributes", "Run Name")
    order = [name, CREATED, *shown, description, *metrics, *params, dataset]
    # within the 940 px the table gets at 1600 px beside the sidebar and MLflow's Assistant panel (a fresh
    # browser opens both): a job's name and its start, then its method, optimizer, figures and the tag (one
    # sweep's view) or the 50 characters of a description the table shows (every run's view)
    widths = {name: 110 if search_filter else 300, CREATED: 140, description: 330, dataset: 260}
    widths |= {column: 130 for column in metrics} | {column: 110 for column in params}
    widths |= {column: 80 for column in shown} | ({job[0]: 115, job[1]: 90} if search_filter else {})
    state = {
        "selectedColumns": [*shown, description, *metrics, *params, dataset],
        "columnOrder": [*order, _column("attributes", "Duration")],
        "columnWidths": widths,
        "orderByKey": "attributes.start_time",
        "orderByAsc": False,
    }
    if search_filter:
        state |= {"searchFilter": search_filter, "orderByKey": _column("metrics", f"eval_{metric}")}
        state["orderByAsc"] = lm  # a loss: the lowest first
    return state


def runs_url(tracker: Tracker, found, local_ui: str = LOCAL_UI) -> str:
    """The runs table of the experiment `found` in the model-training mode with the saved view, after marking
    the experiment as model training and (re)writing the view."""
    try:
        tracker.mark_model_training(found)
        tracker.save_view(found.experiment_id, VIEW_KEY, VIEW_NAME, view_state())
    except Exception as err:  # a store this user may only read: the plain runs table, no saved view
        print(f"note: the saved view could not be written ({type(err).__name__}): the plain runs table opens")
        return ui_url(tracker.uri, found.experiment_id, local_ui=local_ui)
    return ui_url(tracker.uri, found.experiment_id, view=VIEW_KEY, local_ui=local_ui)


def sweep_url(tracker: Tracker, parent, local_ui: str = LOCAL_UI) -> str:
    """The address of one sweep's jobs (parent: its parent run), best first, after (re)writing its saved view
    `sweep-<parent run id>` (named by the sweep and its start); the parent run's page where the view cannot
    be written (a store this user may only read)."""
    experiment_id, run_id = parent.info.experiment_id, parent.info.run_id
    key, metric = f"{SWEEP_VIEW}{run_id}", parent.data.tags.get(METRIC_TAG, METRIC)
    started = time.strftime("%Y-%m-%d %H:%M", time.localtime(parent.info.start_time / 1000))
    # its jobs; with the runs its skipped points had FINISHED as before (tags skipped_run.<job>), by id
    found = [value for tag, value in parent.data.tags.items() if tag.startswith(SKIPPED_RUN)]
    where = f"tags.mlflow.parentRunId = '{run_id}'"
    jobs = ([r.info.run_id for r in tracker.child_runs(experiment_id, run_id)] + found) if found else []
    if 0 < len(jobs) <= LISTED_RUNS:
        where = "attributes.run_id IN ({})".format(", ".join(f"'{job}'" for job in dict.fromkeys(jobs)))
    try:
        tracker.save_view(
            experiment_id, key, f"{parent.info.run_name} ({started})", view_state(where, metric)
        )
    except Exception:
        return ui_url(tracker.uri, experiment_id, run_id, local_ui=local_ui)
    return ui_url(tracker.uri, experiment_id, view=key, local_ui=local_ui)


def sweep_line(uri: str, url: str) -> str:
    """The line a sweep's end prints: its jobs in the model-training mode, best first, where `make ui` serves a
    local store or at the server's address."""
    return f"[sweep] its runs in the MLflow UI: {url}" + ("" if is_server(uri) else " (make ui serves it)")


def latest_sweep(tracker: Tracker, experiment_id: str):
    """The experiment's latest sweep's parent run, None if it has none."""
    found = tracker.client.search_runs(
        [experiment_id], "tags.kind = 'sweep'", order_by=["attributes.start_time DESC"], max_results=1
    )
    return found[0] if found else None


def server_answers(url: str, timeout: float = 3) -> bool:
    """Whether an MLflow server answers its /health address."""
    try:
        urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout).close()
        return True
    except (urllib.error.URLError, OSError):
        return False


READY_WAIT_S = 600  # how long --ready waits for a starting server
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STOP_WAIT_S = 20  # how long a stopped server's processes get to end before SIGKILL


def ready_line(url: str) -> str:
    return (
        f"[server] ready: {url} answers (its UI at {url}/#/experiments; teammates record with "
        "MLFLOW_TRACKING_URI=http://<this host>:<port>, docs/mlflow.md)"
    )


def late_line(url: str) -> str:
    return f"[server] {url} did not answer within {READY_WAIT_S} s: see its log above"


def announce_ready(url: str) -> int:
    """The ready line, printed once the server at `url` answers its health check (its workers start in tens
    of seconds); 1, and a line saying so, when it does not within READY_WAIT_S."""
    deadline = time.monotonic() + READY_WAIT_S
    while not server_answers(url, timeout=1):
        if time.monotonic() > deadline:
            print(late_line(url), flush=True)
            return 1
        time.sleep(1)
    print(ready_line(url), flush=True)
    return 0


def blocked_stops(pid: int) -> set[int]:
    """The stop signals process `pid` blocks now (/proc/<pid>/status); none where that cannot be read."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return set()
    found = re.search(r"^SigBlk:\s*([0-9a-f]+)$", status, re.MULTILINE)
    mask = int(found[1], 16) if found else 0
    return {sig for sig in STOP_SIGNALS if mask >> (sig - 1) & 1}


def end_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group `proc` leads (a server and its workers), SIGKILL to what is left of it
    after STOP_WAIT_S; returns once none of it is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + STOP_WAIT_S
        while time.monotonic() < deadline:
            proc.poll()  # (a leader ended but not reaped still counts as one of the group)
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
    proc.wait()


def _end_with_parent() -> None:
    """In the server's process, before it starts: SIGTERM to it when the process that started it dies, even
    by SIGKILL, which leaves no time to end its group (Linux's PR_SET_PDEATHSIG; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def supervise(command: list[str], env: dict, url: str, on_ready) -> int:
    """Run a server's `command` in a process group of its own until it ends, or until this process is told to
    stop: SIGINT, SIGTERM or SIGHUP, or its parent handling one of them (make, sent SIGINT or SIGHUP alone,
    blocks it and waits for its recipe without passing it on), or its parent gone. Then the server's whole
    group ends (end_group): its workers too, its port free. `on_ready()` runs once the server at `url`
    answers. 0 when stopped, else the server's exit code (128 + the signal that ended it)."""
    stops: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: stops.append(signum)) for sig in STOP_SIGNALS}
    parent = os.getppid()
    held = blocked_stops(parent)  # what the parent blocks anyway
    proc = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=_end_with_parent)
    ready, deadline = False, time.monotonic() + READY_WAIT_S
    try:
        while (ended := proc.poll()) is None and not stops and os.getppid() == parent:
            if blocked_stops(parent) - held:
                break
            if not ready and server_answers(url, timeout=1):
                ready = True
                on_ready()
            elif not ready and time.monotonic() > deadline:
                ready = True
                print(late_line(url), flush=True)
            time.sleep(0.5)
    finally:
        end_group(proc)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if ended is None else ended if ended >= 0 else 128 - ended


def can_open_browser() -> bool:
    """A graphical browser is at hand (a desktop session): never a text browser taking over the terminal."""
    return sys.platform in ("darwin", "win32") or bool(
        os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")
    )


def serve(uri: str, host: str, port: int, url: str, open_browser: bool) -> int:
    """`mlflow ui` on the store (one worker: one person browsing) until Ctrl-C or SIGTERM, which stop its
    server and workers too (supervise); the page opens in a browser once the server answers, where there is
    one."""
    command = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri]
    command += ["--host", host, "--port", str(port), "--workers", "1"]
    # without MLflow's GenAI job runners (six processes, about 17 s of CPU at each start; browsing runs needs none)
    env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **os.environ}

    def opened() -> None:
        if open_browser:
            import webbrowser

            webbrowser.open(url)

    return supervise(command, env, f"http://{host}:{port}", opened)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.browse",
        description="Print the address of the experiment's runs in MLflow's model-training view (figures "
        "first), then serve a local store with `mlflow ui`; a server serves its own UI.",
    )
    parser.add_argument(
        "--tracking-uri",
        help="MLflow store (default: $MLFLOW_TRACKING_URI, else sqlite:///<abs>/outputs/mlflow.db)",
    )
    parser.add_argument("--experiment", default=EXPERIMENT, help="experiment to open (default: %(default)s)")
    parser.add_argument("--host", default=HOST, help="address `mlflow ui` listens on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=PORT, help="its port (default: %(default)s)")
    parser.add_argument("--no-serve", action="store_true", help="print the address only")
    parser.add_argument("--no-browser", action="store_true", help="do not open a browser")
    parser.add_argument(
        "--ready",
        action="store_true",
        help="say when the server at --tracking-uri answers; with a server's command after --, run it until "
        "Ctrl-C or SIGTERM (make server), else exit once it answers",
    )
    argv, command = sys.argv[1:] if argv is None else list(argv), []
    if "--" in argv:
        argv, command = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    args = parser.parse_args(argv)
    if args.ready and not args.tracking_uri:
        parser.error("--ready needs --tracking-uri (the server's address)")
    if args.ready and command:
        url = args.tracking_uri
        return supervise(command, dict(os.environ), url, lambda: print(ready_line(url), flush=True))
    if args.ready:
        return announce_ready(args.tracking_uri)
    uri = store_uri(args.tracking_uri, "outputs")
    if is_server(uri) and not server_answers(uri):
        print(
            f"error: MLflow server {uri} does not answer: start it (make server) or fix the uri",
            file=sys.stderr,
        )
        return 2
    local_ui = f"http://{args.host}:{args.port}"
    try:  # a store that cannot be opened or refuses this client: one line naming it and the fix
        tracker = Tracker(uri)
        experiment = tracker.client.get_experiment_by_name(args.experiment)
        url = experiment and runs_url(tracker, experiment, local_ui)
        latest = experiment and latest_sweep(tracker, experiment.experiment_id)
        latest_url = latest and sweep_url(tracker, latest, local_ui)
    except StoreError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        if not refused(err):
            raise
        print(f"error: {auth_error(uri, err)}", file=sys.stderr)
        return 2
    if url is None:
        url = ui_url(uri, local_ui=local_ui)
        print(f"no experiment {args.experiment!r} in {uri} yet (make run creates it); experiments: {url}")
    else:
        print(f"runs of {args.experiment!r} (model-training view, figures first): {url}", flush=True)
    if latest_url:  # what a browser opens: the latest sweep's jobs and their figures, on the first screen
        metric = latest.data.tags.get(METRIC_TAG, METRIC)
        print(
            f"latest sweep, {latest.info.run_name} (its runs, {ranked(metric)}): {latest_url}",
            flush=True,
        )
        url = latest_url
    if is_server(uri):
        print("(the server serves this UI itself)")
        return 0
    if args.no_serve:
        return 0
    return serve(uri, args.host, args.port, url, open_browser=not args.no_browser and can_open_browser())


if __name__ == "__main__":
    sys.exit(main())
