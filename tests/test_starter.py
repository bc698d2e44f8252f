"""Jobs started warm (forked from the starter, pipeline.starter) against jobs started cold (a new interpreter):
the starter never touches CUDA, and both ways record the same figures, from the caches or without them."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from conftest import ROOT, TINY, cli_env, compose_cfg, run_cli, running, starter_processes, store, sweep_runs

from pipeline import quiet, starter

# Run in a fresh interpreter as on a CUDA build on a machine with a GPU: `torch.version.cuda` set (the CPU wheel
# has None, and libraries skip their CUDA branches on it), torch's CUDA entry points replaced by recorders that
# answer as one GPU would (availability and the device count too: without NVML they reach the driver), and
# triton importable (from
# TRITON's own folder, where it installs); then the modules imported. Prints the entry points that were called
# (each initialises the CUDA driver), with where from.
CUDA_PROBE = """
import json, os, sys, traceback
os.environ.update(json.loads(sys.argv[1]))
if sys.argv[2]:
    sys.path.insert(0, sys.argv[2])
import torch
torch.version.cuda = "12.8"
called = []
def recorder(name, value):
    def call(*args, **kwargs):
        stack = [f for f in traceback.extract_stack()[:-1] if "importlib" not in f.filename]
        called.append([name, " <- ".join(f"{'/'.join(f.filename.split('/')[-3:])}:{f.lineno}" for f in stack[-3:])])
        return value
    return call
properties = type("Properties", (), {"major": 9, "minor": 0, "name": "GPU", "total_memory": 80 * 10**9})()
for name, value in [("is_available", True), ("device_count", 1), ("_lazy_init", None), ("init", None),
                    ("get_device_capability", (9, 0)),
                    ("get_device_properties", properties), ("current_device", 0), ("get_device_name", "GPU"),
                    ("set_device", None), ("synchronize", None), ("mem_get_info", (0, 0))]:
    setattr(torch.cuda, name, recorder(name, value))
for module in sys.argv[3:]:
    try:
        __import__(module)
    except Exception as err:  # a module that takes the recorders' answers for a real GPU and fails later on
        called.append(["import failed", f"{module}: {type(err).__name__}"])
print(json.dumps([called, "triton" in sys.modules]))
"""
TRITON = (
    "triton==3.9.0"  # the compiler a CUDA build of torch imports (Linux wheels on PyPI; not on the CPU wheel)
)


@pytest.fixture(scope="module")
def triton_folder() -> str:
    """A folder with TRITON in it, installed there once (not into the venv: the CPU wheel runs without it), or
    "" where it does not install."""
    folder = Path(os.environ["PIPELINE_CACHE_DIR"]) / f"probe-{TRITON.replace('==', '-')}"
    if not (folder / "triton").is_dir():
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(folder), TRITON],
            capture_output=True,
            text=True,
        )
        if proc.returncode:
            warnings.warn(
                f"{TRITON} does not install here; the probe runs without it: {proc.stderr[-300:]}",
                stacklevel=2,
            )
            return ""
    return str(folder)


def cuda_calls(triton: str, *modules: str) -> tuple[list, bool]:
    """(the CUDA entry points that importing `modules` calls on a simulated CUDA build, whether triton was
    imported)."""
    env = json.dumps(starter.STARTER_ENV)
    proc = subprocess.run(
        [sys.executable, "-c", CUDA_PROBE, env, triton, *modules],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    called, imported = json.loads(proc.stdout.strip().splitlines()[-1])
    return called, imported


@pytest.mark.slow  # a simulated CUDA build probed in fresh interpreters (and triton installed once): CI (make test-ci)
def test_the_starter_never_initialises_cuda_on_a_cuda_build(triton_folder):
    """What the starter imports reaches none of torch's CUDA entry points on a CUDA build: a process forked from it
    can use CUDA. The probe catches what does: transformers' model code with torchao visible (its MX kernels read
    the compute capability, and triton's check the current device), and bitsandbytes."""
    assert starter.STARTER_ENV == {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    called, imported = cuda_calls(triton_folder, starter.PRELOAD)
    assert called == []
    assert imported == bool(triton_folder)  # the preload's libraries did import triton where it is
    modelling, _ = cuda_calls(triton_folder, "transformers.models.bert.modeling_bert")
    assert any(name == "get_device_capability" and "torchao" in where for name, where in modelling), modelling
    if triton_folder:
        assert any(name == "current_device" for name, _ in modelling), modelling
    bnb, _ = cuda_calls(triton_folder, "bitsandbytes")
    assert any(name == "get_device_capability" for name, _ in bnb), bnb


# A sitecustomize that, in the process that imports pipeline.preload (the starter alone), marks CUDA initialised
# once that import ends, as a library that initialised the driver at import would leave it on a GPU machine.
INITIALISING = """
import importlib.abc, importlib.machinery, sys

class Initialising(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "pipeline.preload":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            import torch
            torch.cuda._initialized = True
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, Initialising())
"""


def site_env(tmp_path, site: str) -> dict:
    """The environment of commands with `site` as their sitecustomize (their own job starter: TEST_TAG)."""
    (tmp_path / "site").mkdir(exist_ok=True)
    (tmp_path / "site" / "sitecustomize.py").write_text(site)
    return {"PYTHONPATH": f"{tmp_path / 'site'}:{ROOT}", "TEST_TAG": str(tmp_path)}


def cold_sweep_under(tmp_path, site: str) -> list[str]:
    """A 2-point tiny sweep with `site` as its sitecustomize: both points FINISHED, both started cold; the
    launching process's `[job]` lines."""
    env = site_env(tmp_path, site)
    proc = run_cli(tmp_path, "-m", "seed=0,1", *TINY, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sweep_runs(tmp_path)[1]
    assert [r.data.tags["job_start"] for r in runs] == ["cold", "cold"]
    assert [r.info.status for r in runs] == ["FINISHED", "FINISHED"]
    return [line for line in proc.stderr.splitlines() if line.startswith("[job]")]


def fake_driver(folder: Path, answer: int) -> Path:
    """A shared library named as the CUDA driver's whose cuDeviceGetCount answers `answer` (3: not initialised)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build a stand-in driver library")
    folder.mkdir()
    source = folder / "driver.c"
    source.write_text(f"int cuDeviceGetCount(int *count) {{ *count = 1; return {answer}; }}\n")
    library = folder / "libcuda.so.1"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library


def test_the_driver_library_counts_as_initialised_only_when_it_says_so(tmp_path):
    """A CUDA build of torch loads the driver's library at import and a fork after that uses CUDA (seen on an
    H200): the starter asks the library, which answers CUDA_ERROR_NOT_INITIALIZED until a runtime call that
    torch's flags do not record (cudaGetDeviceCount) initialised it. A library that cannot be asked counts as
    initialised (cold starts)."""
    assert not starter.cuda_initialised()  # this CPU process
    line = "7f02-7f03 r-xp 00000000 08:01 2                          {}\n"
    cases = {"runtime only": ("/usr/lib/x86_64-linux-gnu/libcudart.so.12", False)}
    for answer, initialised in ((3, False), (0, True)):
        library = fake_driver(tmp_path / f"driver{answer}", answer)
        cases[f"driver answering {answer}"] = (str(library), initialised)
    cases["driver that cannot be asked"] = (str(tmp_path / "gone" / "libcuda.so.1"), True)
    for name, (library, _) in cases.items():
        (tmp_path / name).write_text(line.format(library))
    # in a process of their own: a library loaded here would stay in this test process's memory map
    code = "import sys; from pipeline.starter import cuda_initialised; print([cuda_initialised(m) for m in sys.argv[1:]])"
    maps = [str(tmp_path / name) for name in cases]
    proc = subprocess.run([sys.executable, "-c", code, *maps], capture_output=True, text=True)
    assert proc.stdout.strip() == str([initialised for _, initialised in cases.values()]), proc.stderr[-2000:]


# A sitecustomize that, in the process that imports pipeline.preload (the starter alone), makes every child it
# forks a bad fork, as torch's own fork handler marks the children of a process with CUDA initialised.
BAD_FORKS = INITIALISING.replace(
    "torch.cuda._initialized = True",
    "os.register_at_fork(after_in_child=lambda: setattr(torch.cuda, '_is_in_bad_fork', lambda: True))",
).replace("import importlib.abc", "import os, importlib.abc")


@pytest.mark.slow  # a sweep whose every fork is a bad fork: each job restarted cold
def test_a_job_forked_after_cudas_initialisation_starts_again_cold(tmp_path):
    """A warm child that finds itself a bad fork does not run: the command starts that job cold, with one line,
    and its next jobs cold too; every point finishes."""
    lines = cold_sweep_under(tmp_path, BAD_FORKS)
    assert len(lines) == 2, lines
    assert lines[0].endswith("forked from a job starter with CUDA initialised: it does not run here"), lines
    assert lines[1].endswith(
        "the job starter had CUDA initialised: this job and the command's next ones start cold"
    )


@pytest.mark.slow  # two commands started cold with a starter of their own
def test_a_starter_whose_imports_initialise_cuda_serves_no_job_and_the_jobs_start_cold(tmp_path):
    """Where CUDA is initialised once the starter has imported what it preloads, the starter forks nothing: the
    command's jobs start cold and finish, with one line saying why; the next command reads the starter's log and
    starts its jobs cold at once, with the same reason."""
    lines = cold_sweep_under(tmp_path, INITIALISING)
    reason = f"CUDA was initialised by the imports of {starter.PRELOAD} (a fork cannot use it)"
    assert len(lines) == 1 and lines[0].endswith(
        f"the job starter serves no job ({reason}): this command's jobs start cold"
    ), lines
    again = run_cli(tmp_path, "-m", "seed=2", *TINY, env=site_env(tmp_path, INITIALISING))
    assert again.returncode == 0, again.stderr[-3000:]
    lines = [line for line in again.stderr.splitlines() if line.startswith("[job]")]
    assert lines == [f"[job] no job starter ({reason}): jobs start cold"]
    assert starter_processes(str(tmp_path)) == (None, [])


@pytest.mark.slow  # a one-point sweep with a starter of its own
def test_a_starter_that_loaded_an_uninitialised_driver_library_serves_warm_jobs(tmp_path):
    """As `import torch` on a CUDA build does (seen on an H200), the starter's imports load the driver's
    library, here a stand-in answering as a driver not initialised: the job starts warm and finishes. (A
    library answering "initialised" counts as CUDA initialised, and the starter then serves no job: both
    tested above.)"""
    library = fake_driver(tmp_path / "driver", 3)
    loading = INITIALISING.replace(
        "torch.cuda._initialized = True", f"import ctypes; ctypes.CDLL({str(library)!r})"
    )
    proc = run_cli(tmp_path, "-m", "seed=0", *TINY, env=site_env(tmp_path, loading))
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sweep_runs(tmp_path)[1]
    assert [(r.data.tags["job_start"], r.info.status) for r in runs] == [("warm", "FINISHED")]


# figures that depend on the machine's speed or on the process, not on the job
TIMING = (
    "_per_second",
    "/s",
    "_ms",
    "_s",
    "mfu",
    "peak_rss_mb",
    "device_peak_tflops",
)  # /s: Samples/s, a display copy


def figures(folder, client) -> dict:
    """backend -> (metrics, train_loss series, params, datasets, job_start) of each run of the sweep in
    `folder` (the latest sweep when there are several)."""
    runs = (
        sweep_runs(folder)[1] if len(list(folder.glob("multirun/*"))) == 1 else latest_sweep(folder, client)
    )
    out = {}
    for run in runs:
        metrics = {k: v for k, v in run.data.metrics.items() if not k.endswith(TIMING)}
        losses = [m.value for m in client.get_metric_history(run.info.run_id, "train_loss")]
        inputs = sorted((i.dataset.name, i.dataset.digest) for i in run.inputs.dataset_inputs)
        out[run.data.params["backend"]] = (
            metrics,
            losses,
            run.data.params,
            inputs,
            run.data.tags["job_start"],
        )
    return out


def latest_sweep(folder, client):
    sweep_file = sorted(folder.glob("multirun/*/mlflow_sweep.json"))[-1]
    ids = json.loads(sweep_file.read_text())
    return client.search_runs(
        [ids["experiment_id"]], filter_string=f"tags.mlflow.parentRunId = '{ids['parent_run_id']}'"
    )


def cold_lines(proc) -> list[str]:
    """What the launching process said of a job that started cold where it could have started warm."""
    return [line for line in proc.stderr.splitlines() if "cold" in line and line.startswith("[job]")]


def warm_against_cold(tmp_path, *args):
    """The same sweep started cold (caches empty: the splits read and the step simulated in the job), then warm
    (force=true: trained again, the splits and the simulated step from the caches): every figure alike."""
    own_cache = {"PIPELINE_CACHE_DIR": str(tmp_path / "cache")}  # empty at first: not the suite's shared one
    cold = run_cli(tmp_path, "-m", *args, "launcher.start_jobs=cold", env=own_cache)
    assert cold.returncode == 0, cold.stderr[-3000:]
    cold_figures = figures(tmp_path, store(tmp_path))
    assert (tmp_path / "cache" / "splits").is_dir() and any((tmp_path / "cache" / "plan").iterdir())
    warm = run_cli(tmp_path, "-m", *args, "force=true", env=own_cache)
    assert warm.returncode == 0, warm.stderr[-3000:]
    warm_figures = figures(tmp_path, store(tmp_path))
    assert warm_figures.keys() == cold_figures.keys()
    for backend, (metrics, losses, params, inputs, start) in warm_figures.items():
        assert start == "warm" and cold_figures[backend][4] == "cold", cold_lines(warm)
        assert metrics == cold_figures[backend][0], backend
        assert losses == cold_figures[backend][1] and len(losses) == 3
        assert params == cold_figures[backend][2] and inputs == cold_figures[backend][3]
        assert metrics["optimizer_state_bytes"] > 0 and metrics["peak_breakdown_mb"] > 0
        assert "predicted_peak_mb" in metrics and "eval_f1" in metrics
    return warm


@pytest.mark.slow  # the same sweep cold, then warm: CI (make test-ci)
def test_warm_jobs_record_what_cold_ones_do(tmp_path):
    warm_against_cold(tmp_path, "backend=trainer,accelerator", *TINY)


@pytest.mark.slow
def test_warm_jobs_record_what_cold_ones_do_on_minilm(tmp_path):
    small = ["data.max_train_samples=48", "data.max_eval_samples=32", "data.max_val_samples=32"]
    warm_against_cold(tmp_path, "model=minilm", "batch_size=8", "train.max_steps=3", *small)


@pytest.mark.slow  # two sweeps, one cold: CI (make test-ci)
def test_a_job_whose_environment_differs_from_the_starters_starts_cold(tmp_path):
    """The starter keeps the environment it started with (tqdm's delay, read at import, follows log_level): a
    point of another log_level starts cold, and both finish."""
    # (log_level is no part of a point: force=true trains the second one too)
    proc = run_cli(tmp_path, "-m", "log_level=warning,info", "force=true", *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sorted(sweep_runs(tmp_path)[1], key=lambda r: r.info.start_time)
    assert [r.data.tags["job_start"] for r in runs] == ["warm", "cold"], cold_lines(proc)
    assert [r.info.status for r in runs] == ["FINISHED", "FINISHED"]


@pytest.mark.parametrize(
    "args, early",
    [
        ([], True),  # the default run
        (
            [
                "-m",
                "optim=adamw,adafactor",
                "model=tiny",
                "seed=0,1",
                "hydra.sweep.dir=x",
                "+protocol=tune_lr",
            ],
            True,
        ),
        (["--help"], False),
        (["-m", "--cfg", "job"], False),
        (["-m", "launcher=slurm"], False),
        (["launcher.start_jobs=cold"], False),
        (["-m", "seed=0,1", "launcher=local", "launcher.start_jobs=warm", "log_level=warning"], True),
        (["launcher=parallel"], False),
        (["plan=true"], False),
        (["-m", "log_level=warning,info"], False),
        (["hydra.verbose=true"], False),
        (["+hydra.job.env_set.X=1"], False),
        (["hydra/launcher=basic"], False),
        (["model"], False),
    ],
)
def test_the_starter_starts_from_the_command_line_only_where_it_shows_a_warm_start(args, early):
    """A plain command starts the starter before Hydra composes its config; a command whose overrides decide
    how its jobs start (or whose console is not the default) waits for the composed config; the console
    level it starts with, and the overrides it takes for the defaults, are the config's defaults."""
    assert starter.warm_from_command(args) is early
    cfg = compose_cfg()
    assert quiet.DEFAULT == cfg.log_level
    assert starter.DEFAULTS == (
        f"launcher={cfg.launcher.name}",
        f"launcher.start_jobs={cfg.launcher.start_jobs}",
        f"log_level={cfg.log_level}",
    )


# ---- a starter kept between commands (PIPELINE_STARTER_KEEP_S) ------------------------------------------------


@pytest.mark.slow  # a starter of its own over two commands, one killed: CI (make test-ci)
def test_a_kept_starter_serves_the_next_command_and_kills_the_job_of_a_command_killed_outright(tmp_path):
    """With PIPELINE_STARTER_KEEP_S the starter outlives its command: the next command with the same environment
    forks its jobs from it; that command killed outright (SIGKILL), the starter kills its running job and
    stays for the next one."""
    env = {**cli_env(), starter.KEEP_ENV: "60", "TEST_TAG": str(tmp_path)}
    assert run_cli(tmp_path, "-m", "seed=0", *TINY, env=env).returncode == 0
    server, jobs = starter_processes(str(tmp_path))
    assert server is not None and not jobs  # kept after its command ended
    try:
        cmd = [sys.executable, "-m", "pipeline", "-m", "seed=1", *TINY, "train.max_steps=100000"]
        sweep = subprocess.Popen(
            [*cmd, f"outputs_dir={tmp_path}"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL
        )
        deadline = time.time() + 120
        while not jobs and time.time() < deadline:
            time.sleep(0.2)
            jobs = starter_processes(str(tmp_path))[1]
        assert jobs, "no job process was forked from the kept starter"
        sweep.kill()
        sweep.wait(timeout=60)
        deadline = time.time() + 60
        while running(jobs[0]) and time.time() < deadline:
            time.sleep(0.2)
        assert not running(jobs[0])
        assert starter_processes(str(tmp_path))[0] == server  # still there for the next command
        runs = {r.data.params.get("seed"): r for r in store(tmp_path).search_runs(["1"])}
        assert runs["0"].data.tags["job_start"] == "warm" and runs["0"].info.status == "FINISHED"
    finally:
        os.kill(server, signal.SIGTERM)


@pytest.mark.slow  # a starter of its own, waited out: CI (make test-ci)
def test_by_default_the_starter_ends_with_its_command_and_a_bad_keep_is_one_line(tmp_path):
    env = {**cli_env(), starter.KEEP_ENV: "soon", "TEST_TAG": str(tmp_path)}
    proc = run_cli(tmp_path, "-m", "seed=0", *TINY, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if starter.KEEP_ENV in line]
    assert lines == [
        f"[job] {starter.KEEP_ENV}=soon is invalid: a number of seconds >= 0 (0: the job starter ends with the "
        "last command it served): the job starter ends with the command"
    ]
    deadline = time.time() + 30
    while starter_processes(str(tmp_path))[0] is not None and time.time() < deadline:
        time.sleep(0.2)
    assert starter_processes(str(tmp_path))[0] is None


def end_starter(server: int) -> None:
    """The starter `server` ended (SIGTERM, its clean end), and gone."""
    os.kill(server, signal.SIGTERM)
    deadline = time.time() + 30
    while running(server) and time.time() < deadline:
        time.sleep(0.1)
    assert not running(server)


@pytest.mark.slow  # three sweeps: CI (make test-ci)
def test_a_rerun_whose_points_are_all_finished_starts_no_job_starter(tmp_path):
    """A sweep whose points all ended FINISHED notes it (pipeline.starter.FINISHED_NOTE): the same command again
    skips every point and starts no job starter (the suite's starters wait 2 minutes for the next command, so
    one started would still be there). A point no longer FINISHED (its run deleted) runs all the same: its job
    starts the starter, and starts warm."""
    env = {"TEST_TAG": str(tmp_path)}
    args = ["-m", "optim=adamw,adafactor", *TINY]
    assert run_cli(tmp_path, *args, env=env).returncode == 0
    server, _ = starter_processes(str(tmp_path))
    assert server is not None  # kept for the next command
    end_starter(server)
    again = run_cli(tmp_path, *args, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "2 skipped (FINISHED before" in again.stdout
    assert starter_processes(str(tmp_path))[0] is None
    [done] = store(tmp_path).search_runs(["1"], "params.optim = 'adafactor'")
    store(tmp_path).delete_run(done.info.run_id)
    third = run_cli(tmp_path, *args, env=env)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "1 skipped (FINISHED before" in third.stdout
    server, _ = starter_processes(str(tmp_path))
    try:
        assert server is not None
        [rerun] = store(tmp_path).search_runs(
            ["1"], "params.optim = 'adafactor' and attributes.status = 'FINISHED'"
        )
        assert rerun.data.tags["job_start"] == "warm"
    finally:
        if server is not None:
            end_starter(server)


# ---- a single run: its job starts before the store opens -----------------------------------------------------


@pytest.mark.slow  # two single runs, the store held: CI (make test-ci)
def test_a_single_runs_job_trains_while_the_store_opens_and_a_rerun_of_its_point_ends_it_unrecorded(tmp_path):
    """Without -m the job is forked before the launching process opens the MLflow store: it trains to its end
    while the store stays closed (its creation lock, held here), and its run, opened once the store answers, is
    FINISHED from the job's start. The same point again: skipped, and the job it started ends unrecorded."""
    from filelock import FileLock

    env = {**cli_env(), "TEST_TAG": str(tmp_path)}
    args = [*TINY, f"hydra.run.dir={tmp_path}/runs/one", f"outputs_dir={tmp_path}"]
    result = tmp_path / "runs" / "one" / "result.json"
    with FileLock(f"{tmp_path / 'mlflow.db'}.lock"), (tmp_path / "first.err").open("w") as err:
        first = subprocess.Popen(
            [sys.executable, "-m", "pipeline", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        deadline = time.time() + 120
        while not result.exists() and first.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert result.exists(), (tmp_path / "first.err").read_text()[-3000:]
        assert first.poll() is None  # waiting for the store
    assert first.wait(timeout=300) == 0, (tmp_path / "first.err").read_text()[-3000:]
    [run] = store(tmp_path).search_runs(["1"])
    assert run.info.status == "FINISHED" and run.data.tags["job_start"] == "warm"
    assert run.info.start_time <= result.stat().st_mtime * 1000 <= run.info.end_time
    again = run_cli(tmp_path, *args[:-1], env={"TEST_TAG": str(tmp_path)})
    assert again.returncode == 0, again.stderr[-3000:]
    assert (
        f"skipped, FINISHED before as run {run.info.run_id} (force=true reruns it); its job, started as the store "
        "opened, ends unrecorded"
    ) in again.stdout
    assert starter_processes(str(tmp_path))[1] == []  # killed before the command ended, or never forked
    assert [r.info.run_id for r in store(tmp_path).search_runs(["1"])] == [run.info.run_id]


def test_what_scikit_learns_import_sets_on_itself_leaves_a_job_warm():
    """A sweeper that imports scikit-learn once the starter has started (Optuna's) sets two variables on its
    process with their defaults: its jobs share the starter's environment all the same; another value differs."""
    from pipeline.starter import _shared

    env = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1"}
    assert _shared({**env, "KMP_DUPLICATE_LIB_OK": "True", "KMP_INIT_AT_FORK": "FALSE"}) == _shared(env)
    assert _shared({**env, "KMP_INIT_AT_FORK": "TRUE"}) != _shared(env)
