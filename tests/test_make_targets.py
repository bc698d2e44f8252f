"""Every make target runs in CI: each one of the Makefile's .PHONY list is run by a test named in RUN_BY below, at
the smallest settings that still go through its real code, or RUN_BY says in one line why not. The list comes from the Makefile itself, so a new target without a smoke run fails here. The smoke runs that
no other file holds are below: `make bench ARGS=--smoke`, `make plan-accuracy` on one case, the servers that run
until Ctrl-C (started, asked once, stopped with nothing left), `make ui` and `make server` stopped by one signal to
make, `make lint`, `make clean`."""

import ast
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from pipeline import browse
from tests.conftest import cli_env, free_port, running

ROOT = Path(__file__).resolve().parent.parent
MAKE = ["make", "-s", "-o", ".venv/.installed"]  # the install step taken as done: the suite runs in .venv


def phony_targets() -> list[str]:
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.startswith(".PHONY:"))
    return line.split(":", 1)[1].split()


RUN_BY = {  # make target -> the test that runs it (`file::name`), or why none does
    "install": "not by a test: `.ci/run` installs through it (`make test-ci` depends on it)",
    "run": "`tests/test_default_run.py::test_default_sweep_reaches_f1_and_records_everything` (its sweep as it ships)",
    "report": "`tests/test_report.py::test_cli_defaults_to_the_latest_sweep_of_the_tracking_uri` (its command)",
    "test": "not by a test: the suite without its slow tests, which CI runs whole (`make test-ci`)",
    "test-slow": "not by a test: the suite's slow tests, which CI runs with the rest (`make test-ci`)",
    "test-ci": "not by a test: it is what `.ci/run` runs",
    "coverage": "not by a test: CI's selection again under coverage, about 1.3 times its time",
    "test-cluster": "not by a test: the `cluster` tests, which CI runs with the rest (`make test-ci`)",
    "test-matrix": "not by a test: the matrix rows CI leaves out by design (about 3 min; CI runs a sample)",
    "test-gpu": "`tests/test_gpu_ready.py::test_the_gpu_check_runs_its_steps_and_checks_on_cpu` (`--allow-cpu`)",
    "gpu-bundle": "`tests/test_gpu_lease.py::test_the_bundle_runs_a_job_in_a_python_that_has_only_it_and_what_a_gpu_machine_has`",
    "ui": "`tests/test_browse.py::test_make_ui_opens_the_latest_sweeps_figures_on_the_first_screen` (its command, in Chromium); `tests/test_make_targets.py::test_make_ui_and_make_server_stop_with_one_signal_to_make`",
    "server": "`tests/test_store.py::test_make_server_says_when_it_is_ready_and_filters_starlettes_warning`; `tests/test_make_targets.py::test_make_ui_and_make_server_stop_with_one_signal_to_make`",
    "lint": "`tests/test_make_targets.py::test_make_lint_passes`",
    "clean": "`tests/test_make_targets.py::test_make_clean_removes_the_runs_and_keeps_the_readme`",
    "bench": "`tests/test_make_targets.py::test_make_bench_smoke_gives_every_goal_row_a_number` (`ARGS=--smoke`)",
    "bench-full": "not by a test: `make bench`'s code with more repeats, steps and samples (hours); its smoke run covers every row",
    "plan-accuracy": "`tests/test_make_targets.py::test_make_plan_accuracy_measures_one_case_against_its_plan`",
    "plan-accuracy-ranks": "`tests/test_make_targets.py::test_make_plan_accuracy_ranks_measures_each_rank_against_its_plan`",
    "fit-table": "`tests/test_fit_table.py::test_the_fit_table_has_task_and_method_columns_a_language_model_and_a_qlora_row` (its command's `main` on a sample)",
    "methods-table": "not by a test: 14 jobs on DistilBERT and 7 plans of an 8B model (28 min); `tests/test_methods_table.py` checks its two sweeps' points and its page from recorded runs",
    "optimizer-table": "`tests/test_optimizer_table.py::test_the_optimizer_table_puts_measured_analytic_and_meta_state_side_by_side` (its command on a sample)",
    "bench-server": "`tests/test_postgres.py::test_eight_clients_at_once_lose_nothing_on_sqlite_and_postgres` (its clients, on both stores)",
    "bench-server-slurm": "not by a test: 16 jobs through SLURM into a PostgreSQL server (10 min); `tests/test_slurm.py` sends sweeps through the same cluster",
    "slurm-up": "`tests/test_make_targets.py::test_make_slurm_up_serves_until_ctrl_c_and_leaves_nothing`",
    "postgres-up": "`tests/test_make_targets.py::test_make_postgres_up_serves_until_ctrl_c_and_leaves_nothing`",
}


def test_every_make_target_is_run_by_a_test_or_says_why_not():
    table = RUN_BY
    assert set(phony_targets()) - set(table) == set(), "make targets without an entry in RUN_BY"
    assert set(table) - set(phony_targets()) == set(), "entries in RUN_BY of targets the Makefile lacks"
    for target, runner in table.items():
        tests = re.findall(r"`(tests/test_\w+\.py)::(\w+)`", runner)
        if not tests:  # a reason, in words
            assert len(runner) > 20, f"{target}: neither a test nor a reason: {runner!r}"
            continue
        for path, name in tests:
            functions = {
                node.name
                for node in ast.walk(ast.parse((ROOT / path).read_text()))
                if isinstance(node, ast.FunctionDef)
            }
            assert name in functions, f"{target}: {path} has no test {name}"


def make(
    *args: str, timeout: float, cwd: Path = ROOT, env: dict | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*MAKE, *args], cwd=cwd, env=env or cli_env(), capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow  # 2-3 min: every row of make bench once
def test_make_bench_smoke_gives_every_goal_row_a_number(tmp_path):
    """`make bench ARGS=--smoke`: every row's code once, the page in its work folder; each goal row has a figure
    and a verdict. (It fails where any row's code fails: bench/probe.py once patched a function that had moved.)"""
    work = tmp_path / "bench"
    done = make("bench", f"ARGS=--smoke --work {work}", timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    page = (work / "RESULTS.md").read_text()
    goals = page.split("## Goals", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in goals.splitlines() if line.startswith("| (")]
    assert {row[3] for row in rows} == set("abcdegh"), rows  # every row's letter: "| (a) ..."
    for row in rows:
        measured, target = row.split("|")[2:4]
        assert re.match(r" ?[\d.]+", measured), row
        assert re.search(r"\*\*(met|missed|within noise)\*\*", target) or row.startswith("| (a) A/A"), row
    assert "`python -m bench --smoke`" in page
    assert [row for row in rows if row.startswith("| (a) A/A")], rows  # the machine's noise beside the ratios


@pytest.mark.slow  # about 10 s: one case's job and its plan
def test_make_plan_accuracy_measures_one_case_against_its_plan(tmp_path):
    out = tmp_path / "plan-accuracy.md"
    args = f"--models tiny --optims adamw --precisions fp32 --checkpointing false --steps 2 --out {out}"
    done = make("plan-accuracy", f"ARGS={args}", timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| tiny | adamw | fp32 |")]
    assert len(rows) == 1 and rows[0].endswith("| ok |"), out.read_text()
    assert out.with_suffix(".csv").exists()


@pytest.mark.slow  # about 20 s: one 2-rank job (torchrun) and its plan
def test_make_plan_accuracy_ranks_measures_each_rank_against_its_plan(tmp_path):
    doc = tmp_path / "plan-accuracy.md"
    args = f"--models tiny --optims adamw --shardings none --steps 2 --doc {doc}"
    done = make("plan-accuracy-ranks", f"ARGS={args}", timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert len(re.findall(r"\[plan-ranks\] tiny adamw none rank [01]: [-+]\d", done.stdout)) == 2, done.stdout
    assert (tmp_path / "plan-accuracy-ranks.csv").exists()


def test_make_lint_passes():
    done = make("lint", timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_make_clean_removes_the_runs_and_keeps_the_readme(tmp_path):
    """In a folder of its own (it removes outputs/ of the folder it runs in)."""
    outputs = tmp_path / "outputs"
    for name in ("mlflow.db", "runs/a/config.yaml", "cache/x", "report/r.md", "README.md"):
        (outputs / name).parent.mkdir(parents=True, exist_ok=True)
        (outputs / name).write_text("x")
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    done = make("clean", timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in outputs.iterdir()) == ["README.md"]


def serve_until_ctrl_c(target: str, ready: str, tmp_path: Path, timeout: float = 180):
    """Start `make <target>` (`<kind>-up`: skipped where tests/services.py says that kind is missing) in a
    session of its own; the line starting with `ready` that it prints once up."""
    from tests import services

    reason = services.missing(target.removesuffix("-up"))
    if reason:
        pytest.skip(reason)
    log = tmp_path / f"{target}.log"
    out = log.open("w")
    proc = subprocess.Popen(
        [*MAKE, target], cwd=ROOT, env=cli_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        found = [line for line in log.read_text().splitlines() if line.startswith(ready)]
        if found:
            return proc, found[0], log
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"make {target} did not print {ready!r}: {log.read_text()[-3000:]}")


def ctrl_c(proc: subprocess.Popen, log: Path, folder: Path) -> None:
    """What a terminal's Ctrl-C does: SIGINT to the foreground process group (make passes it on and ends by
    it); then nothing of the group is left, nor any process of the server's `folder` (a daemon of a session
    of its own: PostgreSQL's)."""
    group = proc.pid
    os.killpg(group, signal.SIGINT)
    assert proc.wait(timeout=120) in (0, -signal.SIGINT), log.read_text()[-3000:]
    in_group = lambda entry: int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) == group  # noqa: E731
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and processes(in_group):
        time.sleep(0.2)
    assert not processes(in_group), log.read_text()[-3000:]
    assert not serving(folder), log.read_text()[-3000:]
    assert not folder.exists() and f"stopped, {folder} removed" in log.read_text()


def processes(where) -> list[int]:
    """The live processes whose /proc entry `where` accepts."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and where(entry):
                found.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return [pid for pid in found if running(pid)]


def serving(folder: Path) -> list[int]:
    """The processes whose command line names `folder`."""
    return processes(lambda entry: str(folder).encode() in (entry / "cmdline").read_bytes())


@pytest.mark.slow  # about 10 s
def test_make_postgres_up_serves_until_ctrl_c_and_leaves_nothing(tmp_path):
    proc, line, log = serve_until_ctrl_c("postgres-up", "PostgreSQL up in ", tmp_path)
    uri = line.split("store: ", 1)[1].strip()
    import sqlalchemy

    with sqlalchemy.create_engine(uri).connect() as connection:
        assert connection.execute(sqlalchemy.text("select 1")).scalar() == 1
    folder = Path(line.split("PostgreSQL up in ", 1)[1].split(";", 1)[0])
    assert serving(folder)  # its postmaster
    ctrl_c(proc, log, folder)


@pytest.mark.slow  # about 20 s
def test_make_slurm_up_serves_until_ctrl_c_and_leaves_nothing(tmp_path):
    proc, _, log = serve_until_ctrl_c("slurm-up", "SLURM node ", tmp_path)
    conf = next(line for line in log.read_text().splitlines() if "export SLURM_CONF=" in line)
    conf = conf.split("export SLURM_CONF=", 1)[1].strip()
    asked = subprocess.run(
        ["sinfo", "--noheader", "--format=%T"],
        env={**os.environ, "SLURM_CONF": conf},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert asked.returncode == 0 and asked.stdout.strip() == "idle", asked.stdout + asked.stderr
    ctrl_c(proc, log, Path(conf).parent)


def descendants(pid: int) -> list[int]:
    """The live processes below `pid` (its children, theirs, ...), by /proc's parent links."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit():
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry.name))
        except (OSError, ValueError):
            continue
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return [p for p in found if running(p)]


def port_free(port: int) -> bool:
    """Whether a new server could listen on `port` (as servers bind: SO_REUSEADDR, so that connections
    closed moments ago do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


SECRETS = {
    "MLFLOW_AUTH_ADMIN_PASSWORD": "admin-password-for-tests",
    "MLFLOW_FLASK_SERVER_SECRET_KEY": "test-key",
}


@pytest.mark.slow  # mlflow ui or mlflow server starts in 10-30 s on 2 busy cores
@pytest.mark.parametrize(
    ("target", "sig"),
    [("ui", signal.SIGTERM), ("ui", signal.SIGINT), ("server", signal.SIGTERM)],
    ids=["ui-SIGTERM", "ui-SIGINT", "server-SIGTERM"],  # (the server's recipe stops the same way on either)
)
def test_make_ui_and_make_server_stop_with_one_signal_to_make(target, sig, tmp_path):
    """One SIGTERM or SIGINT to make alone (not to its group: make passes SIGTERM on to its recipe, not SIGINT)
    ends make, its recipe's process and the MLflow server under it with its workers, and frees the port. (Run
    in the background of a non-interactive shell, make ignores SIGINT: see docs/testing.md.)"""
    port, env = free_port(), cli_env()
    if target == "ui":
        variables = [f"UI_PORT={port}", f"MLFLOW_UI_URI=sqlite:///{tmp_path}/mlflow.db"]
    else:
        env = {**{k: v for k, v in env.items() if not k.startswith("MLFLOW_")}, **SECRETS}
        variables = [f"SERVER_PORT={port}", "SERVER_WORKERS=1", "SERVER_HOST=127.0.0.1"]
        variables += [
            f"SERVER_STORE=sqlite:///{tmp_path}/mlflow.db",
            f"SERVER_ARTIFACTS={tmp_path}/artifacts",
        ]
        variables += [
            f"SERVER_AUTH_STORE=sqlite:///{tmp_path}/auth.db",
            f"SERVER_AUTH_CONFIG={tmp_path}/auth.ini",
        ]
    log = tmp_path / "make.log"
    proc = subprocess.Popen(
        [*MAKE, target, *variables],
        cwd=ROOT,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    tree: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while not browse.server_answers(f"http://127.0.0.1:{port}", timeout=2):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        tree = descendants(proc.pid)
        assert len(tree) >= 3, tree  # pipeline.browse, the mlflow command, its uvicorn server
        started = time.monotonic()
        os.kill(proc.pid, sig)
        assert proc.wait(timeout=60) == -sig, log.read_text()[-3000:]
        while [p for p in tree if running(p)] and time.monotonic() - started < 60:
            time.sleep(0.2)
        assert not [p for p in tree if running(p)], log.read_text()[-3000:]
        assert port_free(port)
        print(f"make {target}: {sig.name} to make, all gone in {time.monotonic() - started:.1f} s")
    finally:
        for pid in [proc.pid, *tree]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
