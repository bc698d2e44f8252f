import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

# No hub here: any attempt to download must fail at once instead of waiting on the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# The sweeps of the suite, each in its own outputs folder, share one cache (pipeline.cache: its keys never let an
# entry stand for other inputs): the packaged data is read and split once, not once per test. The tests of the
# caches themselves use their own (tests/test_cache.py, tests/test_starter.py).
os.environ.setdefault("PIPELINE_CACHE_DIR", str(Path(tempfile.gettempdir()) / "optimizer-sweep-tests-cache"))
# The commands of the suite with the same environment share one job starter (pipeline.starter), kept between
# them: a command's jobs start without importing torch & co. again. Two minutes after the suite's last
# command it ends, or as the suite ends (pytest_unconfigure). (Tests that look for a sweep's job processes
# start a starter of their own.)
os.environ.setdefault("PIPELINE_STARTER_KEEP_S", "120")


def pytest_configure(config):
    """The CPU tests run on CPU on a GPU machine too (their figures, messages and budgets are the CPU
    tracker's): unless the mark expression selects the gpu tests (`pytest -m gpu`), this
    process and every job it starts see no GPU. Set before any test module imports torch."""
    if not selects_gpu_tests(config.option.markexpr):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if not hasattr(config, "workerinput"):  # this session's tag (its workers inherit it; a pytest that a test
        # starts gets its own): in every command's environment, it names the starters the session ends
        os.environ["PIPELINE_TEST_SESSION"] = f"{os.getpid()}-{time.time_ns()}"
    own_cores(os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def pytest_unconfigure(config):
    """The job starters the suite kept end with it (the controller's, once every worker is done)."""
    if hasattr(config, "workerinput"):
        return
    tag = f"PIPELINE_TEST_SESSION={os.environ.get('PIPELINE_TEST_SESSION')}".encode()
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(ValueError, OSError):
            if b"pipeline.starter" in (entry / "cmdline").read_bytes() and tag in (
                (entry / "environ").read_bytes().split(b"\0")
            ):
                os.kill(int(entry.name), signal.SIGTERM)


# the files of CI's longest tests (minutes each: the default sweep, the SLURM cluster's, the PostgreSQL server's,
# the team server's), handed out first, longest first
LONGEST_FIRST = (
    "test_default_run.py",
    "test_make_targets.py",
    "test_slurm.py",
    "test_postgres.py",
    "test_store.py",
    "test_gpu_lease.py",
)


def pytest_collection_modifyitems(config, items):
    """The files of CI's longest tests first, then the other files that hold slow tests, each file's tests in
    their order: `make test-ci` (both suites in one session, `--no-loadscope-reorder`) then hands them out
    first, so the long ones run beside the short files instead of after them."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}

    def rank(item) -> int:
        name = item.path.name
        if name in LONGEST_FIRST and item.path in slow_files:
            return LONGEST_FIRST.index(name)
        return len(LONGEST_FIRST) + (item.path not in slow_files)

    items.sort(key=rank)


def own_cores(worker: str | None, workers: int) -> None:
    """Under pytest-xdist (`make test` runs `-n 2`), each worker and every job it starts get their own share
    of the cores: torch's thread pools spin while they wait, so two of them on the same cores run several
    times slower than one after the other. The jobs' thread count follows (pipeline.placement.cpu_threads)."""
    cores = sorted(os.sched_getaffinity(0))
    if worker is None or workers < 2 or len(cores) < workers:
        return
    os.sched_setaffinity(0, cores[int(worker.removeprefix("gw")) :: workers])


def selects_gpu_tests(markexpr: str) -> bool:
    """Whether a pytest -m expression can select a test marked only `gpu` (pytest's own evaluator)."""
    from _pytest.mark.expression import Expression

    return bool(markexpr) and Expression.compile(markexpr).evaluate(lambda mark: mark == "gpu")


def ci_sample(values, sample, mark=None) -> list:
    """A matrix axis for pytest.mark.parametrize: the values in `sample` run in CI (with `mark`, e.g.
    pytest.mark.slow, when given), every other one is marked `matrix`, which `make test` and `make test-slow`
    leave out and `make test-matrix` runs."""
    assert set(sample) <= set(values), set(sample) - set(values)
    return [
        pytest.param(v, marks=(() if mark is None else mark) if v in sample else pytest.mark.matrix)
        for v in values
    ]


# a tiny job: small model, few samples, few steps
TINY = ["model=tiny", "data.max_train_samples=64", "data.max_eval_samples=32", "train.max_steps=3"]


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def cli_env() -> dict[str, str]:
    """The environment the suite's commands start in: this process's, less the tracking URI (each test names
    its store) and pytest's name of the running test (no command reads it, and commands share a job starter
    only where their environments are the same: pipeline.starter)."""
    return {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PYTEST_CURRENT_TEST")}


def running(pid: int) -> bool:
    """Alive and not a zombie (a killed child nobody reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def starter_processes(tag: str) -> tuple[int | None, list[int]]:
    """(the job starter started with TEST_TAG=`tag` in its environment, the job processes it forked)."""
    mine = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(ValueError, OSError):
            if b"-m\0pipeline.starter" in (entry / "cmdline").read_bytes() and f"TEST_TAG={tag}".encode() in (
                (entry / "environ").read_bytes().split(b"\0")
            ):
                mine.append(int(entry.name))
    parents = {}
    for pid in mine:
        with contextlib.suppress(OSError):
            parents[pid] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    servers = [pid for pid in mine if pid in parents and parents[pid] not in mine]
    return (servers[0] if servers else None), [pid for pid in mine if parents.get(pid) in mine]


def run_cli(tmp_path: Path, *args: str, timeout: float = 600, env=None) -> subprocess.CompletedProcess:
    """The real CLI, with its outputs and MLflow store under tmp_path (`env`: variables to set for it)."""
    env = {**cli_env(), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args, f"outputs_dir={tmp_path}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def free_port() -> int:
    """A TCP port nothing listens on now (for a test's own server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_mlflow_server(folder: Path, port: int) -> subprocess.Popen:
    """`mlflow server` on 127.0.0.1:port, its sqlite store and proxied artifacts in `folder` (a server started
    again on the same folder serves the same runs); back once it answers its health check."""
    import time
    import urllib.request

    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}", "--workers", "1"]
    cmd += ["--artifacts-destination", str(folder / "artifacts")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # as make server runs it: no GenAI job runners
    with open(folder / "server.log", "a") as log:
        server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 300  # seconds on an idle machine; a minute or more on a loaded one
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
            return server
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                stop_mlflow_server(server)
                raise RuntimeError((folder / "server.log").read_text()[-3000:]) from None
            time.sleep(0.5)


def stop_mlflow_server(server: subprocess.Popen) -> None:
    """The server and its workers, gone (its port refuses connections afterwards)."""
    import signal

    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def store(tmp_path: Path):
    from mlflow import MlflowClient

    return MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")


def sweep_runs(tmp_path: Path):
    """(parent run, child runs) of the one sweep in tmp_path's store."""
    client = store(tmp_path)
    (sweep_file,) = tmp_path.glob("multirun/*/mlflow_sweep.json")
    ids = json.loads(sweep_file.read_text())
    parent = client.get_run(ids["parent_run_id"])
    children = client.search_runs(
        [ids["experiment_id"]], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    return parent, children


def report_folder(parent) -> str:
    """A sweep's report folder name, `sweep-<its folder's name>`, from its parent run (tag sweep_dir)."""
    return f"sweep-{Path(parent.data.tags['sweep_dir']).name}"


@pytest.fixture(autouse=True)
def cpu_unless_marked_gpu(request, monkeypatch):
    """A test not marked gpu, run beside gpu tests (`-m "gpu or ..."`), still starts its jobs without GPUs."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture(scope="session")
def tmp_session(tmp_path_factory):
    return tmp_path_factory.mktemp("session")


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server for the session (tests/services.py), skipped where it is not installed."""
    from tests import services

    reason = services.missing("postgres")
    if reason:
        pytest.skip(reason)
    pg = services.start_postgres()
    yield pg
    pg.stop()
    shutil.rmtree(pg.folder, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A one-node SLURM cluster for the session (tests/services.py), SLURM_CONF set for this process and
    everything it starts; skipped where SLURM is not installed."""
    from tests import services

    reason = services.missing("slurm")
    if reason:
        pytest.skip(reason)
    cluster = services.start_slurm()
    saved = os.environ.get("SLURM_CONF")
    os.environ.update(cluster.env)
    yield cluster
    cluster.stop()
    if saved is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = saved
    shutil.rmtree(cluster.folder, ignore_errors=True)


@pytest.fixture
def fresh_accelerate_state():
    """accelerate's process-wide state reset before and after a test that builds an Accelerator of its own (an
    earlier test in the same worker may have made one with other settings)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
