"""How a job's process starts: warm, forked from a starter that has imported the heavy libraries once, or cold,
a new interpreter. Either way each job is a process of its own, with its own exit status.

Warm (`launcher.start_jobs=warm`, the default for the local and parallel launchers): Python's multiprocessing
forkserver, started once per launching process with PRELOAD imported (torch, transformers, accelerate,
datasets, the job's own modules: seconds), forks a fresh child per job (milliseconds). It starts as the command
does where the command line shows a warm start (prestart_from_command), else once the config is composed. The
child has its own allocator, peak statistics and caches, as a new interpreter would; a crash, `os._exit`, a
signal or the out-of-memory killer ends that child alone, and the forkserver reports its exit status
(negative: the signal) as the operating system does for a process of our own. Cold
(`launcher.start_jobs=cold`): `python -m pipeline.job JOB_DIR` in a new interpreter. A job of several ranks
(torchrun) and a job that a scheduler starts (submitit: SLURM or its local executor) always start cold.

CUDA: a process that has initialised the CUDA driver must never fork. PRELOAD imports only modules whose import
leaves the driver alone (bitsandbytes' import reads every device's compute capability: the job imports it);
torch's availability checks in the starter go through NVML (PYTORCH_NVML_BASED_CUDA_CHECK=1), which does not
initialise the driver. Each child sets its whole environment (CUDA_VISIBLE_DEVICES from the sweep's GPU pool,
its thread count, the console's level) before any torch work, and refuses to run if CUDA is initialised.

The starter keeps the environment it was started with (what the libraries read at import: tqdm's delay, the
hub's offline switches): a job whose environment differs in more than PER_JOB (a swept `log_level`) starts cold.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

MODES = ("warm", "cold")  # launcher.start_jobs
PRELOAD = "pipeline.preload"  # the module the starter imports once (torch, transformers, ...)
STARTER_ENV = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}  # torch.cuda.is_available() without the driver
# set by each child for itself (torch reads its compile cache's folder only as it compiles, never at import)
PER_JOB = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "TORCHINDUCTOR_CACHE_DIR")
# overrides that decide whether a command's jobs start warm, or the environment they start in: a command with
# one of them starts its starter once its config is composed (runner.prestart), not from its command line
DECIDING = (
    "launcher",
    "plan",
    "log_level",
    "hydra/launcher",
    "hydra.launcher",
    "hydra.verbose",
    "hydra.job.env_set",
    "hydra.job.env_copy",
)
# overrides of DECIDING keys to what the config has by default: they leave the start from the command line be
DEFAULTS = ("launcher=local", "launcher.start_jobs=warm", "log_level=warning")
JOB_MODULE = "pipeline.job"  # the module whose main(job_dir) a warm child runs (bench.probe swaps it)

_started_with: dict | None = None  # the environment this process's starter runs with (less PER_JOB)


def _shared(env: dict) -> dict:
    """What a job's environment must share with the starter's to start warm: all of it, less PER_JOB and the
    variables the launching process's MLflow client sets on itself as it opens the store (no job reads them:
    the tracking settings, and the telemetry session id `_MLFLOW_TELEMETRY_SESSION_ID` where MLflow's
    telemetry is on)."""
    return {k: v for k, v in env.items() if k not in PER_JOB and not k.startswith(("MLFLOW_", "_MLFLOW_"))}


@contextlib.contextmanager
def _environ(env: dict):
    """os.environ is `env` for the block (the forkserver inherits the environment it is started in)."""
    saved = dict(os.environ)
    for key in set(saved) - set(env):
        del os.environ[key]
    os.environ.update(env)
    try:
        yield
    finally:
        for key in set(os.environ) - set(saved):
            del os.environ[key]
        os.environ.update(saved)


@contextlib.contextmanager
def _start_method(method: str):
    """This process's default start method is `method` for the block: a new process is prepared with the
    default's name, which must exist in the child (a joblib worker's own, "loky", does not there)."""
    saved = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method(method, force=True)
    try:
        yield
    finally:
        multiprocessing.set_start_method(saved, force=True)


def prestart(env: dict) -> bool:
    """Start this process's starter with `env` unless it runs already: it imports PRELOAD in the background,
    while this process goes on (opens the MLflow store). Whether a job of this environment can start warm."""
    global _started_with
    if _started_with is None:
        from multiprocessing import forkserver

        forkserver.set_forkserver_preload([PRELOAD])
        with _environ({**env, **STARTER_ENV}):
            forkserver.ensure_running()
        _started_with = _shared(env)
    return _shared(env) == _started_with


def base_env(level: str) -> dict[str, str]:
    """The environment a job process starts from at the console level `level`, before what is its own
    (PER_JOB, a scheduler's ranks): the console's settings, this process's environment, tokenizers' threads
    left to torch."""
    from pipeline import quiet

    return {**quiet.job_env(level), **os.environ, "TOKENIZERS_PARALLELISM": "false"}


def warm_from_command(args: list[str]) -> bool:
    """Whether the command line alone shows that the command's jobs start warm, at the default console level:
    `-m` and key=value overrides, none of them DECIDING but to its default. Any other command (a flag such as
    --help or --cfg, another launcher, plan, log_level) leaves the start to runner.prestart and the composed
    config."""
    overrides = [a for a in args if a not in ("-m", "--multirun", *DEFAULTS)]
    if any(a.startswith("-") or "=" not in a for a in overrides):
        return False
    keys = [a.split("=", 1)[0].lstrip("+~") for a in overrides]
    return not any(k == d or k.startswith((f"{d}.", f"{d}/")) for k in keys for d in DECIDING)


def prestart_from_command(args: list[str]) -> None:
    """Start the starter from the command line, before the launching process imports Hydra and MLflow and
    composes the config (half a second sooner), where warm_from_command says its jobs start warm."""
    from pipeline import quiet

    if warm_from_command(args):
        prestart(base_env(quiet.DEFAULT))


def die_with_parent() -> None:
    """This job process ends (SIGKILL) when the process that started it does (Linux's PR_SET_PDEATHSIG): the
    runner, torchrun or the job starter killed outright (SIGKILL, the out-of-memory killer, a scheduler's
    cancel) leaves no job training on that nobody will record. A parent gone already: this one ends now."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # re-parented to init before the call took effect
        os._exit(1)


def _child(job_dir: str, env: dict, module: str) -> None:
    """A warm job process: its own session (a kill of its group reaches whatever it starts), its own
    environment and threads, then the job."""
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    # the start method a new interpreter has (the forkserver's children inherit "forkserver", under which
    # tqdm's lock would register its semaphore with the launching process's resource tracker)
    multiprocessing.set_start_method(None, force=True)
    import importlib

    import torch

    code = 1
    try:
        if torch.cuda.is_initialized():  # a fork after CUDA's initialisation is unusable
            raise RuntimeError(
                "the job starter had initialised CUDA before forking: start jobs cold (launcher.start_jobs=cold)"
            )
        torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or torch.get_num_threads()))
        code = importlib.import_module(module).main(Path(job_dir))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # as `python -m pipeline.job` ends: nothing of the starter's state is torn down


def _wait(pid: int, wait) -> int:
    """The exit status `wait()` returns; on an exception (Ctrl-C, SIGTERM) the job's process group is killed
    first."""
    try:
        return wait()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:  # killed before its own session began
                os.kill(pid, signal.SIGKILL)
        wait()
        raise


def run(job_dir: Path, env: dict, command: list[str], warm: bool) -> tuple[int, str]:
    """Run one job's process(es) to their end: forked from the starter when `warm` and the starter runs with
    this environment, else `command` in a new interpreter. (Its exit status, negative: killed by that signal;
    how it started: `warm` or `cold`.)"""
    if warm and not prestart(env):
        mine = _shared(env)
        differ = sorted(k for k in set(mine) | set(_started_with) if mine.get(k) != _started_with.get(k))
        print(f"[job] {job_dir.name}: starts cold: its environment differs from the job starter's in "
              f"{', '.join(differ)}", file=sys.stderr, flush=True)  # fmt: skip
    elif warm:
        ctx = multiprocessing.get_context("forkserver")
        proc = ctx.Process(target=_child, args=(str(job_dir), env, JOB_MODULE), name=f"job {job_dir.name}")
        try:
            with _start_method("forkserver"):
                proc.start()
        except (OSError, EOFError) as err:  # the starter died (an import of PRELOAD failed): start cold
            print(f"[job] {job_dir.name}: the job starter is gone ({err!r}): starting cold", file=sys.stderr)
        else:

            def exit_status() -> int:
                proc.join()
                return proc.exitcode

            return _wait(proc.pid, exit_status), "warm"
    # its own session: a kill reaches torchrun's ranks too, not only torchrun
    popen = subprocess.Popen(command, env=env, start_new_session=True)
    return _wait(popen.pid, popen.wait), "cold"
