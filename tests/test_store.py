"""The store at its edges, with real processes: sweeps started at once on a fresh sqlite store, stores that
cannot be opened, a server that goes away for longer than the client retries, and the team server of
`make server` (MLflow's basic-auth app) with and without logins."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient

from pipeline import liveness
from pipeline.journal import RECORD_KEY
from pipeline.tracking import StoreError, Tracker
from tests.conftest import ROOT, TINY, cli_env, free_port, run_cli, start_mlflow_server, stop_mlflow_server

PLAN = ["model=tiny", "plan=true"]  # a job that trains nothing: shapes only, in the launching process
N_SWEEPS = 4


# ---- sweeps at once on a fresh store ---------------------------------------------------------------------


@pytest.mark.slow  # four sweep processes at once on 2 cores
def test_sweeps_started_at_once_on_a_fresh_store_all_finish(tmp_path):
    """N sweeps, one outputs folder, one new sqlite store, started together: each takes the lock beside the
    database in turn while MLflow creates the schema and the experiment, and its own sweep folder."""
    env = cli_env()
    sweeps = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pipeline",
                "-m",
                "optim=adamw,adafactor",
                *PLAN,
                f"seed={seed}",
                f"outputs_dir={tmp_path}",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for seed in range(N_SWEEPS)
    ]
    for sweep in sweeps:
        out, err = sweep.communicate(timeout=900)
        assert sweep.returncode == 0, err[-3000:]
    assert (tmp_path / "mlflow.db.lock").exists()
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")  # the store opens afterwards
    (experiment,) = [e for e in client.search_experiments() if e.name == "optimizer-sweep"]
    sweep_files = sorted(tmp_path.glob("multirun/*/mlflow_sweep.json"))
    assert len(sweep_files) == N_SWEEPS  # one folder each, even when started in the same second
    seeds = set()
    for path in sweep_files:
        ids = json.loads(path.read_text())
        assert ids["experiment_id"] == experiment.experiment_id
        parent = client.get_run(ids["parent_run_id"])
        assert parent.info.status == "FINISHED"
        children = client.search_runs(
            [experiment.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{ids['parent_run_id']}'"
        )
        assert sorted(r.data.params["optim"] for r in children) == ["adafactor", "adamw"]
        assert {r.info.status for r in children} == {"FINISHED"}
        (seed,) = {r.data.params["seed"] for r in children}  # a sweep's jobs, not another sweep's
        seeds.add(seed)
        assert all(Path(r.data.tags["job_dir"]).parent == path.parent for r in children)
    assert seeds == {str(s) for s in range(N_SWEEPS)}
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == N_SWEEPS * 3  # every run recorded once: a parent and two jobs per sweep
    assert not client.search_runs(["0"])  # nothing in Default


# ---- stores that cannot be opened ------------------------------------------------------------------------


def _immutable(folder: Path) -> bool:
    """Make a folder unwritable, for root too (chattr +i) where the system lets us; False where it does not."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return True
    return (
        shutil.which("chattr") is not None and subprocess.run(["chattr", "+i", str(folder)]).returncode == 0
    )


@pytest.fixture
def read_only(tmp_path):
    folder = tmp_path / "read-only"
    folder.mkdir()
    if not _immutable(folder):
        pytest.skip("cannot make a folder read-only here")
    yield folder
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(folder)])
    folder.chmod(0o755)


def test_stores_that_cannot_be_opened_say_which_and_the_fix(tmp_path, read_only):
    corrupt = tmp_path / "corrupt.db"
    corrupt.write_bytes(b"not a database, " * 400)
    cases = {
        f"sqlite:///{corrupt}": f"{corrupt} is not a sqlite database MLflow can read (file is not a database): "
        f"move it aside (e.g. mv {corrupt} {corrupt}.broken) for a fresh store",
        "sqlit:///x.db": "has an unknown scheme 'sqlit': use sqlite:///<path>/mlflow.db, http(s)://",
        str(tmp_path / "runs"): f"is a folder, which MLflow 3 no longer records to: use a sqlite file in it, "
        f"e.g. tracking.uri=sqlite:///{tmp_path / 'runs' / 'mlflow.db'}",
        f"sqlite:///{read_only}/mlflow.db": f"{read_only} is not writable: make it writable, or point "
        "tracking.uri (or MLFLOW_TRACKING_URI) at a folder you can write",
        f"sqlite:///{read_only}/new/mlflow.db": f"{read_only}/new is not writable",
    }
    for uri, message in cases.items():
        with pytest.raises(StoreError) as err:
            Tracker(uri, tmp_path).experiment_id("optimizer-sweep")
        assert str(err.value).startswith(f"tracking uri {uri} "), str(err.value)
        assert message in str(err.value), str(err.value)
        assert "\n" not in str(err.value)
    assert corrupt.read_bytes() == b"not a database, " * 400  # nothing touched


def test_a_corrupt_store_is_one_line_for_a_sweep_a_single_run_the_report_and_the_ui(tmp_path):
    corrupt = tmp_path / "mlflow.db"
    corrupt.write_bytes(b"not a database, " * 400)
    report = [sys.executable, "-m", "pipeline.report", f"outputs_dir={tmp_path}"]
    ui = [sys.executable, "-m", "pipeline.browse", f"--tracking-uri=sqlite:///{corrupt}", "--no-serve"]
    for args in (["-m", "seed=1,2"], [], report, ui):
        if args in (report, ui):
            proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
        else:
            proc = run_cli(tmp_path, *args, *PLAN)
        assert proc.returncode == 2, proc.stderr[-2000:]
        errors = [line for line in proc.stderr.splitlines() if "Traceback" in line or "error" in line.lower()]
        assert errors == [
            f"error: tracking uri sqlite:///{corrupt} cannot be opened: {corrupt} is not a sqlite database "
            f"MLflow can read (file is not a database): move it aside (e.g. mv {corrupt} {corrupt}.broken) "
            "for a fresh store, or point tracking.uri at another file"
        ], proc.stderr[-2000:]
    # no run's or sweep's folder left (the store's lock file is made as it is opened)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db", "mlflow.db.lock"]
    # a run folder that existed before stays, with what was in it
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("kept")
    assert run_cli(tmp_path, *PLAN, f"hydra.run.dir={mine}").returncode == 2
    assert (mine / "notes.txt").read_text() == "kept"


# ---- the team server: make server ------------------------------------------------------------------------

ADMIN_PASSWORD = "admin-password-for-tests"  # MLflow wants 12 characters or more
USER, PASSWORD = "alice", "alice-password-1"


def host_address() -> str | None:
    """This host's own non-loopback IPv4 address (what a teammate's machine would connect to), if any."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 9))  # no packet is sent: only the route is looked up
            address = s.getsockname()[0]
    except OSError:
        found = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
        address = next((a for a in found if "." in a), "127.0.0.1")
    return None if address.startswith("127.") else address


def make_server(
    tmp: Path, port: int, env: dict, *variables: str, stores: tuple[str, str] | None = None
) -> subprocess.Popen:
    """`make server` (the install step taken as done) with its artifacts under tmp, its runs and accounts in
    `stores` (store, auth store), by default sqlite files under tmp."""
    store, auth = stores or (f"sqlite:///{tmp / 'mlflow.db'}", f"sqlite:///{tmp / 'auth.db'}")
    cmd = ["make", "-s", "-o", ".venv/.installed", "server", f"SERVER_PORT={port}", "SERVER_WORKERS=1"]
    cmd += [f"SERVER_STORE={store}", f"SERVER_ARTIFACTS={tmp / 'artifacts'}"]
    cmd += [f"SERVER_AUTH_STORE={auth}", f"SERVER_AUTH_CONFIG={tmp / 'auth.ini'}"]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}, **env}
    log = open(tmp / "server.log", "w")  # noqa: SIM115 (the server's own output, read on failure)
    return subprocess.Popen(
        [*cmd, *variables], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def test_make_server_refuses_to_start_without_its_secrets(tmp_path):
    for env, message in (
        ({}, "MLFLOW_AUTH_ADMIN_PASSWORD is not set: export it"),
        ({"MLFLOW_AUTH_ADMIN_PASSWORD": "short"}, "MLFLOW_AUTH_ADMIN_PASSWORD is too short"),
        ({"MLFLOW_AUTH_ADMIN_PASSWORD": ADMIN_PASSWORD}, "MLFLOW_FLASK_SERVER_SECRET_KEY is not set"),
    ):
        server = make_server(tmp_path, free_port(), env)
        assert server.wait(timeout=60) == 2
        (line,) = (tmp_path / "server.log").read_text().splitlines()
        assert message in line, line
    assert not (tmp_path / "auth.db").exists()


# `make server` started for real (its workers take tens of seconds): CI (make test-ci)
@pytest.fixture(
    scope="module", params=[pytest.param(store, marks=pytest.mark.slow) for store in ("sqlite", "postgres")]
)
def team_server(request, tmp_path_factory):
    """`make server` on a free port: basic-auth, allowed hosts from this host's name and addresses; its runs
    and accounts in sqlite files, or in two databases of a real PostgreSQL server."""
    tmp = tmp_path_factory.mktemp(f"team_server_{request.param}")
    port = free_port()
    secrets = {"MLFLOW_AUTH_ADMIN_PASSWORD": ADMIN_PASSWORD, "MLFLOW_FLASK_SERVER_SECRET_KEY": "test-key"}
    stores = None
    if request.param == "postgres":
        pg = request.getfixturevalue("postgres")
        stores = (pg.create_database(f"runs_{port}"), pg.create_database(f"auth_{port}"))
    server = make_server(tmp, port, secrets, stores=stores)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600  # seconds on an idle machine; minutes on a loaded one
    try:
        while True:
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=2).close()
                break
            except OSError:
                log = (tmp / "server.log").read_text()[-3000:]
                assert server.poll() is None and time.time() < deadline, log
                time.sleep(0.5)
        yield uri, port, tmp / "server.log"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def test_make_server_says_when_it_is_ready_and_filters_starlettes_warning(team_server):
    _, port, log = team_server
    deadline = time.time() + 60  # the ready line follows the first health check that answers
    while "[server] ready" not in log.read_text() and time.time() < deadline:
        time.sleep(0.5)
    text = log.read_text()
    assert f"[server] ready: http://127.0.0.1:{port} answers" in text, text[-3000:]
    assert "StarletteDeprecationWarning" not in text


def login(monkeypatch, user: str | None, password: str | None) -> dict:
    """The two client variables, for this process and for a CLI it starts."""
    variables = {"MLFLOW_TRACKING_USERNAME": user, "MLFLOW_TRACKING_PASSWORD": password}
    for key, value in variables.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    return {k: v for k, v in variables.items() if v is not None}


def test_a_server_that_wants_a_login_is_one_line_naming_the_variables(team_server, tmp_path, monkeypatch):
    uri, _, _ = team_server
    login(monkeypatch, None, None)
    proc = run_cli(tmp_path, "-m", "seed=1,2", *PLAN, "tracking=server", f"tracking.uri={uri}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: tracking uri {uri} wants credentials: set MLFLOW_TRACKING_USERNAME / "
        "MLFLOW_TRACKING_PASSWORD to your account on that server (the server's admin sets accounts up: "
        "docs/mlflow.md)"
    )
    assert "Traceback" not in proc.stderr
    login(monkeypatch, USER, "wrong-password")  # a single run this time
    proc = run_cli(tmp_path, *PLAN, "tracking=server", f"tracking.uri={uri}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: tracking uri {uri} refused the credentials of user 'alice': check MLFLOW_TRACKING_USERNAME "
        "/ MLFLOW_TRACKING_PASSWORD (the server's admin sets accounts up: docs/mlflow.md)"
    )
    assert "Traceback" not in proc.stderr


def test_a_teammate_with_an_account_records_through_the_hosts_address(team_server, tmp_path, monkeypatch):
    uri, port, _ = team_server
    address = host_address()
    if address is None:
        pytest.skip("this host has no non-loopback address")
    # the admin adds the teammate's account, as docs/mlflow.md shows
    login(monkeypatch, "admin", ADMIN_PASSWORD)
    from mlflow.server import get_app_client

    get_app_client("basic-auth", tracking_uri=uri).create_user(USER, PASSWORD)
    remote = f"http://{address}:{port}"  # not loopback: the Host header a teammate's client sends
    env = login(monkeypatch, USER, PASSWORD)
    proc = run_cli(
        tmp_path, "-m", "seed=1,2", *PLAN, "tracking=server", f"tracking.uri={remote}", env=env, timeout=1500
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(remote)
    (sweep_file,) = tmp_path.glob("multirun/*/mlflow_sweep.json")
    ids = json.loads(sweep_file.read_text())
    children = client.search_runs(
        [ids["experiment_id"]], filter_string=f"tags.mlflow.parentRunId = '{ids['parent_run_id']}'"
    )
    assert sorted(r.data.params["seed"] for r in children) == ["1", "2"]
    assert {r.info.status for r in children} == {"FINISHED"}
    assert {r.data.tags["mlflow.user"] for r in children} == {USER}
    # a stranger reaching the same address is turned away
    login(monkeypatch, None, None)
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{remote}/api/2.0/mlflow/experiments/search?max_results=1", timeout=10)
    assert err.value.code == 401


def test_sweeps_creating_the_experiment_at_once_on_a_server_get_one(team_server, monkeypatch):
    uri, _, _ = team_server
    login(monkeypatch, "admin", ADMIN_PASSWORD)
    ids, errors = [], []

    def create():
        try:
            ids.append(Tracker(uri).experiment_id("created-at-once"))
        except Exception as err:  # noqa: BLE001 (reported below)
            errors.append(repr(err))

    threads = [threading.Thread(target=create) for _ in range(N_SWEEPS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and len(ids) == N_SWEEPS and len(set(ids)) == 1, (errors, ids)


# ---- a tracking server that goes away for longer than the client's retries ----------------------------------

# MLflow's own client settings (documented environment variables): one quick try, then give up, instead of the
# default 7 tries with backoff over about 4-5 minutes; what matters is that the outage outlasts them
SHORT_RETRIES = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}
THREE_POINTS = ["-m", "seed=1,2,3", *TINY]
# what differs between two runs of the same point by nature: where and when it ran, how fast, the process
WHERE_AND_WHEN = {"job_dir", "mlflow.parentRunId", RECORD_KEY, liveness.PID, liveness.PID_START}
HOW_FAST = ("_per_second", "/s", "_ms", "_s")  # /s: Samples/s, the throughput's display copy
PROCESS = {"mfu", "peak_rss_mb", "device_peak_tflops"}


def comparable(client: MlflowClient, run) -> dict:
    """A run as the comparison sees it: name, status, params, tags, which metrics (and the values of those
    that do not measure speed), its loss curve and its artifacts."""
    metrics, tags = run.data.metrics, run.data.tags
    # the two sweeps record into two experiments (in one, the second would skip every point)
    overrides = " ".join(
        o for o in tags["overrides"].split() if not o.startswith(("tracking.experiment=", "outputs_dir="))
    )
    return {
        "status": run.info.status,
        "params": run.data.params,
        "tags": {**{k: v for k, v in tags.items() if k not in WHERE_AND_WHEN}, "overrides": overrides},
        "metric_keys": sorted(metrics),
        "metrics": {k: v for k, v in metrics.items() if not k.endswith(HOW_FAST) and k not in PROCESS},
        "train_loss": [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train_loss")],
        "artifacts": sorted(a.path for a in client.list_artifacts(run.info.run_id)),
    }


def sweep_of(client: MlflowClient, folder: Path):
    """(parent run, {run name: comparable child}) of the one sweep folder under or at `folder`."""
    (sweep_file,) = {*folder.glob("mlflow_sweep.json"), *folder.glob("*/mlflow_sweep.json")}
    ids = json.loads(sweep_file.read_text())
    children = client.search_runs(
        [ids["experiment_id"]], filter_string=f"tags.mlflow.parentRunId = '{ids['parent_run_id']}'"
    )
    return client.get_run(ids["parent_run_id"]), {r.info.run_name: comparable(client, r) for r in children}


@pytest.mark.slow  # three tiny sweeps and two server starts: about 3 minutes on 2 cores
def test_a_server_away_longer_than_the_retries_loses_no_result(tmp_path):
    folder, port = tmp_path / "server", free_port()
    folder.mkdir()
    uri = f"http://127.0.0.1:{port}"
    on_server = ["tracking=server", f"tracking.uri={uri}"]
    server = start_mlflow_server(folder, port)
    try:
        reference = run_cli(
            tmp_path / "reference", *THREE_POINTS, *on_server, "tracking.experiment=reference"
        )
        assert reference.returncode == 0, reference.stderr[-3000:]
        # the server goes away while the first job trains and comes back after the sweep has ended; the sweep
        # is in a folder of its own (hydra.sweep.dir), outside outputs_dir
        out, sweep_dir = tmp_path / "outage", tmp_path / "elsewhere" / "outage"
        env = {**cli_env(), **SHORT_RETRIES}
        cmd = [sys.executable, "-m", "pipeline", *THREE_POINTS, *on_server, "tracking.experiment=outage"]
        cmd += [f"hydra.sweep.dir={sweep_dir}"]
        with open(tmp_path / "sweep.out", "w") as stdout, open(tmp_path / "sweep.err", "w") as stderr:
            sweep = subprocess.Popen(
                [*cmd, f"outputs_dir={out}"], cwd=ROOT, env=env, stdout=stdout, stderr=stderr
            )
            deadline = time.time() + 300
            while not list(sweep_dir.glob("0/config.yaml")):  # its run is open, its job process starts
                assert sweep.poll() is None and time.time() < deadline, (tmp_path / "sweep.err").read_text()
                time.sleep(0.2)
            stop_mlflow_server(server)
            assert sweep.wait(timeout=900) == 1
        err = (tmp_path / "sweep.err").read_text()
        assert sorted(p.parent.name for p in sweep_dir.glob("*/unrecorded.json")) == ["0", "1", "2"], err
        assert sorted(p.parent.name for p in sweep_dir.glob("*/result.json")) == ["0", "1", "2"]
        assert "Traceback" not in err, err[-3000:]
        assert (
            f"[sweep] 3 trained, not recorded (the store did not answer): their results wait in their job "
            f"folders; once the store is back, `python -m pipeline.record {sweep_dir}` records them" in err
        ), err[-3000:]
        server = start_mlflow_server(folder, port)

        def record(where: Path) -> subprocess.CompletedProcess:
            command = [sys.executable, "-m", "pipeline.record", str(where)]
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stderr[-3000:]
            return done

        # one job folder by hand, then the same sweep again, in outputs_dir's own sweep folder this time: it
        # finds the other two where the outage's parent run says its folder is, records them instead of
        # training them, and skips every point
        assert "[record] 1 results recorded, 0 sweeps closed" in record(sweep_dir / "0").stdout
        rerun = run_cli(out, *THREE_POINTS, *on_server, "tracking.experiment=outage")
        assert rerun.returncode == 0, rerun.stderr[-3000:]
        assert rerun.stdout.count("[job] recorded the result that waited in") == 2, rerun.stdout
        assert "[sweep] 3 skipped" in rerun.stdout
        assert len(list(sweep_dir.glob("*/result.json"))) == 3
        assert not list(out.glob("multirun/*/*/result.json"))  # nothing trained again
        # the outage's sweep itself: its parent run closes once none of its outcomes waits
        assert "[record] 0 results recorded, 1 sweeps closed" in record(sweep_dir).stdout
        assert not list(sweep_dir.glob("*/unrecorded.json"))
        # the store now holds what the uninterrupted sweep left, run by run
        client = MlflowClient(uri)
        parent, runs = sweep_of(client, sweep_dir)
        ref_parent, ref_runs = sweep_of(client, tmp_path / "reference" / "multirun")
        assert sorted(runs) == sorted(ref_runs) and len(runs) == 3
        for name, run in runs.items():
            for part, value in run.items():
                assert value == ref_runs[name][part], (name, part)
        assert parent.info.status == ref_parent.info.status == "FINISHED"
        # (its best figures too, but for the throughput: a speed, like the jobs' own)
        steady = lambda metrics: {k: v for k, v in metrics.items() if not k.endswith(HOW_FAST)}  # noqa: E731
        assert steady(parent.data.metrics) == steady(ref_parent.data.metrics)
        assert "train_samples_per_second" in parent.data.metrics
        assert parent.data.tags["mlflow.note.content"] == ref_parent.data.tags["mlflow.note.content"]
        assert "report" in {a.path for a in client.list_artifacts(parent.info.run_id)}
        # recording again records nothing twice
        assert "nothing waits to be recorded" in record(out).stdout
        # the outage's parent and its three jobs, and the rerun's parent (a reference to the three)
        assert len(client.search_runs([parent.info.experiment_id])) == 5
    finally:
        stop_mlflow_server(server)


# ---- a result whose runner ended before it recorded it ---------------------------------------------------


@pytest.mark.slow  # a sweep, then pipeline.record: CI (make test-ci)
def test_a_result_on_disk_whose_run_its_sweep_marked_failed_is_recorded_by_pipeline_record(tmp_path):
    """A job wrote its result.json, then its runner ended before it wrote the outcome down (a scheduler killed
    it with the job's allocation) and the launching process, failing, marked the run FAILED with no metrics:
    `python -m pipeline.record <sweep folder>` finds the result and records it into that run, FINISHED with its
    figures, as the runner would have; a second call records nothing."""
    done = run_cli(tmp_path, "-m", "seed=0", *TINY)
    assert done.returncode == 0, done.stderr[-3000:]
    (sweep_file,) = tmp_path.glob("multirun/*/mlflow_sweep.json")
    ids = json.loads(sweep_file.read_text())
    client = MlflowClient(ids["tracking_uri"])
    (finished,) = client.search_runs(
        [ids["experiment_id"]], f"tags.mlflow.parentRunId = '{ids['parent_run_id']}'"
    )
    # the same point as its runner opened it, ended FAILED by the launching process, its metrics never logged
    client.delete_run(finished.info.run_id)
    keep = ("job_dir", "overrides", "config_hash", "mlflow.parentRunId")
    run = client.create_run(
        ids["experiment_id"], tags={k: finished.data.tags[k] for k in keep}, run_name=finished.info.run_name
    )
    client.set_terminated(run.info.run_id, "FAILED")

    def record() -> str:
        command = [sys.executable, "-m", "pipeline.record", str(sweep_file.parent)]
        out = subprocess.run(command, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout

    assert f"[record] run {run.info.run_id} recorded (FINISHED)" in record()
    recorded = client.get_run(run.info.run_id)
    assert recorded.info.status == "FINISHED"
    assert recorded.data.metrics == finished.data.metrics
    assert recorded.data.params == finished.data.params
    assert "nothing waits to be recorded" in record()
