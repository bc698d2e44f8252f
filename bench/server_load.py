"""`python -m bench.server_load [--clients 32] [--stores sqlite,postgres]`: the team server under load.

For each store, `make server` (basic-auth, 4 workers, as a team runs it) on that store: a sqlite file, or a
database of a real PostgreSQL server (tests/services.py starts one). Then N client processes, started together,
each records one run as a sweep's job does through pipeline.tracking (its params, a loss series and the figures
at the end, tags, the config file as an artifact, the run closed FINISHED), under one parent run, through an
account of the server. Afterwards everything is counted from the store: runs, FINISHED runs, metric rows,
params, tags, artifacts, each against what the clients sent; the errors the clients saw (after MLflow's own
retries) and the time from the start signal to the last client done. Writes bench/server-load.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "server-load.md"
USER, PASSWORD = "loader", "loader-password-1"
STEPS = 100  # loss series length (what a 100-step job logs)
SERIES = ("train_loss", "learning_rate", "grad_norm")
FIGURES = 24  # scalar metrics at the end (a job logs about that many)
PARAMS = 25
TAGS = 8


@dataclass
class Load:
    store: str
    clients: int
    runs_expected: int
    runs_found: int
    runs_finished: int
    metric_rows_expected: int
    metric_rows_found: int
    params_lost: int
    tags_lost: int
    artifacts_lost: int
    client_errors: int
    seconds_all: float  # start signal -> last client done
    seconds_client_median: float
    seconds_client_max: float
    errors: list

    @property
    def runs_lost(self) -> int:
        return self.runs_expected - self.runs_finished

    @property
    def metric_rows_lost(self) -> int:
        return self.metric_rows_expected - self.metric_rows_found


def _job_record(n: int) -> tuple[dict, dict, dict, dict]:
    """(params, scalar metrics, series, tags) of client n's run."""
    params = {f"param_{i}": f"value-{n}-{i}" for i in range(PARAMS)}
    metrics = {f"figure_{i}": n + i / 10 for i in range(FIGURES)}
    series = {key: [n + step / STEPS for step in range(1, STEPS + 1)] for key in SERIES}
    tags = {f"tag_{i}": f"client-{n}" for i in range(TAGS)}
    return params, metrics, series, tags


def client(n: int, uri: str, experiment_id: str, parent: str, folder: str, ready, go, out) -> None:
    """One job's recording, as pipeline.runner and pipeline.journal do it: once imported and connected it says
    so on `ready`, and records when `go` is set."""
    os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"] = USER, PASSWORD
    from pipeline.tracking import Tracker

    params, metrics, series, tags = _job_record(n)
    config = Path(folder) / f"config-{n}.yaml"
    config.write_text("".join(f"{k}: {v}\n" for k, v in params.items()) * 4)
    tracker = Tracker(uri)
    ready.put(n)
    go.wait(timeout=1800)
    start, error = time.time(), None
    try:
        run_id = tracker.start_run(experiment_id, f"client-{n}", parent, {"client": str(n)})
        tracker.log(run_id, params=params)
        tracker.log(run_id, metrics, series, tags=tags)
        tracker.log_artifact(run_id, config)
        tracker.end(run_id, "FINISHED")
    except Exception as err:  # noqa: BLE001 (counted and reported)
        error = f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"
    out.put({"n": n, "start": start, "end": time.time(), "error": error})


def measure(store: str, uri_of_store: str, auth_store: str, folder: Path, clients: int) -> Load:
    """`make server` on the store, `clients` processes at once, then everything counted from the store."""
    from mlflow import MlflowClient
    from mlflow.server import get_app_client

    from pipeline.tracking import Tracker
    from tests import services

    server = services.start_team_server(folder / "server", uri_of_store, auth_store)
    try:
        os.environ["MLFLOW_TRACKING_USERNAME"] = "admin"
        os.environ["MLFLOW_TRACKING_PASSWORD"] = services.ADMIN_PASSWORD
        get_app_client("basic-auth", tracking_uri=server.uri).create_user(USER, PASSWORD)
        os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"] = USER, PASSWORD
        tracker = Tracker(server.uri)
        experiment_id = tracker.experiment_id("server-load")
        parent = tracker.start_run(experiment_id, f"load-{clients}", tags={"kind": "sweep"})
        ctx = multiprocessing.get_context("spawn")
        ready, go, out = ctx.Queue(), ctx.Event(), ctx.Queue()
        procs = [
            ctx.Process(
                target=client, args=(n, server.uri, experiment_id, parent, str(folder), ready, go, out)
            )
            for n in range(clients)
        ]
        for proc in procs:
            proc.start()
        for _ in procs:  # every client imported and connected before the signal
            ready.get(timeout=1800)
        go.set()
        done = [out.get(timeout=1800) for _ in procs]
        for proc in procs:
            proc.join(timeout=60)
        tracker.end(parent, "FINISHED")
        # count from the store
        mlflow = MlflowClient(server.uri)
        runs = mlflow.search_runs(
            [experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent}'", max_results=10000
        )
        expected_rows = clients * (FIGURES + len(SERIES) * STEPS)
        rows = params_lost = tags_lost = artifacts_lost = 0
        for run in runs:
            n = int(run.data.tags["client"])
            params, metrics, series, tags = _job_record(n)
            rows += sum(1 for key in metrics if key in run.data.metrics)
            rows += sum(len(mlflow.get_metric_history(run.info.run_id, key)) for key in SERIES)
            params_lost += sum(run.data.params.get(k) != v for k, v in params.items())
            tags_lost += sum(run.data.tags.get(k) != v for k, v in tags.items())
            artifacts_lost += f"config-{n}.yaml" not in {
                a.path for a in mlflow.list_artifacts(run.info.run_id)
            }
        missing_runs = clients - len(runs)
        errors = [d["error"] for d in done if d["error"]]
        spans = [d["end"] - d["start"] for d in done]
        return Load(
            store=store,
            clients=clients,
            runs_expected=clients,
            runs_found=len(runs),
            runs_finished=sum(r.info.status == "FINISHED" for r in runs),
            metric_rows_expected=expected_rows,
            metric_rows_found=rows,
            params_lost=params_lost + missing_runs * PARAMS,
            tags_lost=tags_lost + missing_runs * TAGS,
            artifacts_lost=artifacts_lost + missing_runs,
            client_errors=len(errors),
            seconds_all=max(d["end"] for d in done) - min(d["start"] for d in done),
            seconds_client_median=statistics.median(spans),
            seconds_client_max=max(spans),
            errors=sorted(set(errors))[:5],
        )
    finally:
        for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            os.environ.pop(key, None)
        server.stop()


def run(stores: list[str], clients: int, folder: Path, pg=None) -> list[Load]:
    """One measure per store; `pg`: a PostgreSQL server already up (else one is started for the run)."""
    from tests import services

    loads = []
    for store in stores:
        where = folder / store
        where.mkdir(parents=True, exist_ok=True)
        if store == "sqlite":
            loads.append(
                measure(
                    store,
                    f"sqlite:///{where / 'mlflow.db'}",
                    f"sqlite:///{where / 'auth.db'}",
                    where,
                    clients,
                )
            )
            continue
        own = pg is None
        if own:
            reason = services.missing("postgres")
            if reason:
                raise SystemExit(f"error: {reason}")
            pg = services.start_postgres(where / "pg")
        try:
            tag = f"{os.getpid()}_{int(time.time())}"
            stores_ = (pg.create_database(f"load_runs_{tag}"), pg.create_database(f"load_auth_{tag}"))
            loads.append(measure(store, *stores_, where, clients))
        finally:
            if own:
                pg.stop()
    return loads


def slurm_sweeps(folder: Path, sweeps: int = 2, jobs: int = 8) -> list[str]:
    """`sweeps` sweeps of `jobs` tiny jobs each (other seeds each: other points), through a one-node SLURM
    cluster, at once into one PostgreSQL-backed `make server`: the lines of what each sweep left in the store."""
    import subprocess

    from mlflow import MlflowClient

    from tests import services

    for kind in ("postgres", "slurm"):
        if services.missing(kind):
            raise SystemExit(f"error: {services.missing(kind)}")
    pg = services.start_postgres(folder / "pg")
    cluster = services.start_slurm(folder / "slurm")
    server = None
    try:
        server = services.start_team_server(
            folder / "server", pg.create_database("runs"), pg.create_database("auth")
        )
        admin = {"MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": services.ADMIN_PASSWORD}
        env = {**{k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}, **cluster.env, **admin}
        tiny = ["model=tiny", "data.max_train_samples=64", "data.max_eval_samples=32", "train.max_steps=3"]
        started, procs = time.time(), []
        for n in range(sweeps):
            seeds = ",".join(str(n * jobs + i) for i in range(jobs))
            cmd = [sys.executable, "-m", "pipeline", "-m", f"seed={seeds}", *tiny, "launcher=slurm"]
            cmd += ["hydra.launcher.cpus_per_task=1", "tracking=server", f"tracking.uri={server.uri}"]
            cmd += [f"outputs_dir={folder / f'sweep{n}'}"]
            log = open(folder / f"sweep{n}.log", "w")  # noqa: SIM115 (the sweep's console)
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        codes = [proc.wait(timeout=3600) for proc in procs]
        seconds = time.time() - started
        os.environ.update(admin)
        client = MlflowClient(server.uri)
        lines = [
            f"{sweeps} sweeps of {jobs} tiny jobs through SLURM at once: exit codes {codes}, {seconds:.0f} s"
        ]
        for n in range(sweeps):
            ids = json.loads(next((folder / f"sweep{n}").glob("multirun/*/mlflow_sweep.json")).read_text())
            parent = client.get_run(ids["parent_run_id"])
            children = client.search_runs(
                [ids["experiment_id"]], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
            )
            own = sum(str(folder / f"sweep{n}") in r.data.tags.get("job_dir", "") for r in children)
            finished = sum(r.info.status == "FINISHED" for r in children)
            lines.append(
                f"sweep {n}: parent {parent.info.status}, {len(children)} children ({finished} FINISHED, "
                f"{own} from its own sweep folder)"
            )
        every = client.search_runs([ids["experiment_id"]], max_results=10000)
        lines.append(f"runs in the experiment: {len(every)}; in Default: {len(client.search_runs(['0']))}")
        return lines
    finally:
        if server is not None:
            server.stop()
        cluster.stop()
        pg.stop()


def table(loads: list[Load]) -> str:
    lines = [
        "| store | clients | runs lost | metric rows lost | params / tags / artifacts lost | client errors "
        "| time to record all [s] | per client, median (max) [s] |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for x in loads:
        lines.append(
            f"| {x.store} | {x.clients} | {x.runs_lost} of {x.runs_expected} | {x.metric_rows_lost} of "
            f"{x.metric_rows_expected} | {x.params_lost} / {x.tags_lost} / {x.artifacts_lost} | {x.client_errors} "
            f"| {x.seconds_all:.1f} | {x.seconds_client_median:.1f} ({x.seconds_client_max:.1f}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--stores", default="sqlite,postgres")
    parser.add_argument("--out", type=Path, default=OUT, help="where the table goes (markdown)")
    parser.add_argument(
        "--slurm-sweeps", action="store_true", help="instead: 2 sweeps of 8 tiny jobs through SLURM at once"
    )
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="server-load-"))
    folder.chmod(0o755)  # PostgreSQL's account reaches its folder inside
    if args.slurm_sweeps:
        try:
            lines = slurm_sweeps(folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        print("\n".join(lines))
        return 0
    started = time.time()
    try:
        loads = run(args.stores.split(","), args.clients, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    text = "\n".join(
        [
            "# The team server under load",
            "",
            f"- date: {datetime.now():%Y-%m-%d %H:%M} (took {time.time() - started:.0f} s)",
            f"- machine: {platform.node()}, {os.cpu_count()} cores; load average at the end "
            f"{os.getloadavg()[0]:.1f}; Python {platform.python_version()}",
            f"- command: `python -m bench.server_load --clients {args.clients} --stores {args.stores}` "
            "(`make bench-server`)",
            f"- each client: one run under one parent: {PARAMS} params, {len(SERIES)} series of {STEPS} steps and "
            f"{FIGURES} figures ({len(SERIES) * STEPS + FIGURES} metric rows), {TAGS} tags, one artifact, closed "
            "FINISHED; `make server` with basic-auth and 4 workers; MLflow's default client retries",
            "",
            table(loads),
            "",
        ]
        + [f"- {x.store}: client errors: {'; '.join(x.errors)}" for x in loads if x.errors]
    )
    args.out.write_text(text + "\n")
    print(text)
    print(json.dumps([asdict(x) for x in loads]), file=sys.stderr)
    return 0 if all(x.runs_lost == 0 and x.metric_rows_lost == 0 for x in loads) else 1


if __name__ == "__main__":
    import signal

    def _stop(signum, frame):  # `timeout`, a scheduler: the servers still stop (the finally blocks)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, _stop)
    sys.exit(main())
