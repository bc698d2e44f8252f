"""How a job's process starts: warm, forked from a starter that has imported the heavy libraries once, or cold,
a new interpreter. Either way each job is a process of its own, with its own exit status.

Warm (`launcher.start_jobs=warm`, the default for the local and parallel launchers): a starter process
(`python -m pipeline.starter`) imports PRELOAD once (torch, transformers, accelerate, datasets, the job's own
modules: seconds), then forks a fresh child per job (milliseconds). It starts as the command does where the
command line shows a warm start (prestart_from_command), else once the config is composed; a sweep whose points
were all FINISHED when the same command last ended (FINISHED_NOTE) starts it only with a job that runs (ahead).
The child has its own allocator, peak statistics, caches, console, folder and environment; whatever ends it
ends it alone, and the starter reports its exit status as the operating system does. Cold
(`launcher.start_jobs=cold`): `python -m pipeline.job JOB_DIR`, as is a job of several ranks or a scheduler's.

A starter serves every command of the same user, interpreter, folder, environment, pipeline source, installed
libraries and CPU set (its socket's name is a digest of them: ADDRESS_DIR) while one of them runs, then
$PIPELINE_STARTER_KEEP_S seconds more (KEEP_ENV; default 0). Kept, the next command's jobs start without waiting
for the imports. A command killed outright (SIGKILL) takes its running job with it.

CUDA: a process that has initialised the CUDA driver must never fork. PRELOAD's imports leave the driver alone
(pipeline.preload), availability checks go through NVML. Should CUDA be initialised all the same, the starter
serves no job, writes why in its log (REFUSED) and ends; the jobs start cold. Each child sets its whole
environment (PER_JOB: its GPUs, threads) before any torch work; one forked from a process with CUDA initialised
exits with BAD_FORK and starts again cold (Job.wait). A job whose environment differs from the starter's in more
than PER_JOB (a swept `log_level`) starts cold.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("warm", "cold")  # launcher.start_jobs
PRELOAD = "pipeline.preload"  # the module the starter imports once (torch, transformers, ...)
STARTER_ENV = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}  # torch.cuda.is_available() without the driver
# set by each child for itself (inductor reads its compile cache's folder as it compiles; only dynamo's precompile
# cache, used with TORCH_CACHING_PRECOMPILE=1 alone, takes it at import)
PER_JOB = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "TORCHINDUCTOR_CACHE_DIR", "PIPELINE_CHECKPOINTS")
STOP_WAIT_S = 60  # a job sent SIGTERM (pipeline.checkpoint) has this long to checkpoint and stop
IMPORT_SET = {"KMP_DUPLICATE_LIB_OK": "True", "KMP_INIT_AT_FORK": "FALSE"}  # scikit-learn's import sets them
# overrides that decide whether a command's jobs start warm, or the environment they start in: a command with
# one of them starts its starter once its config is composed (runner.prestart), not from its command line
DECIDING = tuple(
    "launcher plan log_level hydra/launcher hydra.launcher hydra.verbose hydra.job.env_set hydra.job.env_copy".split()
)
# overrides of DECIDING keys to what the config has by default: they leave the start from the command line be
DEFAULTS = ("launcher=local", "launcher.start_jobs=warm", "log_level=warning")
JOB_MODULE = "pipeline.job"  # the module whose main(job_dir) a warm child runs (bench.probe swaps it)

KEEP_ENV = "PIPELINE_STARTER_KEEP_S"  # seconds a starter waits for another command once its last one ended
ADDRESS_DIR = f"optimizer-sweep-starters-{os.getuid()}"  # in the temporary folder: sockets and logs
CONNECT_WAIT_S = 30  # how long a job waits for a starter just started to listen
REFUSED = "[starter] serves no job:"  # the line a starter that found CUDA initialised leaves in its log
# a warm child's exit status when it finds itself forked after CUDA's initialisation (EX_TEMPFAIL)
BAD_FORK = 75
STATUS = struct.Struct("q")  # a job's pid, then its exit status, as the starter sends them
# beside the sockets, named by a digest of a sweep's command (finished_note): its points were all FINISHED when
# it last ended, so the same command again is expected to run no job
FINISHED_NOTE = ".finished"

_started_with: dict | None = None  # the environment this process's starter runs with (less PER_JOB)
_address: str | None = None  # where that starter listens
_holds: list = []  # what keeps it running while this process runs: a connection, and the pipe to one it started
_note: Path | None = None  # this command's FINISHED_NOTE (a sweep's launching process)
_ahead = True  # whether the starter starts ahead of this command's first job (False: its note was found)


def _shared(env: dict) -> dict:
    """What a job's environment must share with the starter's to start warm: all of it, less PER_JOB, what the
    launching process's MLflow client sets on itself as it opens the store (the tracking settings, the telemetry
    session id) and IMPORT_SET's values (Optuna's sweeper imports scikit-learn after the starter started)."""
    kept = (k for k, v in env.items() if k not in PER_JOB and IMPORT_SET.get(k) != v)
    return {k: env[k] for k in kept if not k.startswith(("MLFLOW_", "_MLFLOW_"))}


def prestart(env: dict) -> bool:
    """Find this process's starter for `env`, or start one with `env` (it imports PRELOAD in the background,
    while this process goes on: opens the MLflow store), unless done already. Whether a job of this
    environment can start warm."""
    global _started_with, _address
    if _started_with is None:
        _started_with = _shared(env)
        try:
            keep_seconds(env)
        except ValueError as err:
            print(f"[job] {err}: the job starter ends with the command", file=sys.stderr)
        try:
            _address = address(env)
            refused = refusal(_address)
            if refused:
                _address = None
                print(f"[job] no job starter ({refused}): jobs start cold", file=sys.stderr)
            elif not _hold():
                _start(env)
        except OSError as err:  # no private folder for its socket, or no process: jobs start cold
            _address = None
            print(f"[job] no job starter ({err}): jobs start cold", file=sys.stderr)
    return _address is not None and _shared(env) == _started_with


def address(env: dict) -> str:
    """The socket of the starter for jobs of `env` started from this process: one per user (a private folder),
    interpreter, folder, environment (less PER_JOB), pipeline source, installed libraries and CPU set."""
    from pipeline import cache

    stamp = [
        sys.executable,
        os.getcwd(),
        sorted(_shared(env).items()),
        cache.code_digest(),
        # the folders of installed libraries: an install or uninstall changes their times
        [(p, os.stat(p).st_mtime_ns) for p in sys.path if p and p != os.getcwd() and os.path.isdir(p)],
        sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    ]
    return str(_folder() / hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:24])


def _folder() -> Path:
    """The starters' folder (sockets, logs, notes): this user's alone."""
    folder = Path(tempfile.gettempdir()) / ADDRESS_DIR
    folder.mkdir(mode=0o700, exist_ok=True)
    info = folder.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{folder} is not this user's alone")
    return folder


def finished_note(args: list[str]) -> Path:
    """Where a sweep's command notes that its points were all FINISHED as it ended: named by a digest of what
    decides its points and where they are looked up (the stamp below)."""
    from pipeline import cache

    stamp = [
        sys.executable,
        os.getcwd(),
        args,
        sorted(_shared(dict(os.environ)).items()),
        cache.code_digest(),
        cache.file_stamp(cache.PACKAGE.parent / "conf"),
    ]
    return _folder() / (hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:24] + FINISHED_NOTE)


def note_finished(finished: bool) -> None:
    """At a sweep's end, in its launching process: note whether its points are all FINISHED (the same command
    again then starts no starter ahead of its first job), or remove the note."""
    if _note is None:
        return
    with contextlib.suppress(OSError):
        if finished:
            _note.touch()
        else:
            _note.unlink(missing_ok=True)


def refusal(path: str) -> str | None:
    """Why the starter at `path` serves no job (its REFUSED line, less the prefix), or None."""
    with contextlib.suppress(OSError):
        for line in Path(path + ".log").read_text(errors="replace").splitlines():
            if line.startswith(REFUSED):
                return line[len(REFUSED) :].strip()
    return None


def cuda_initialised(maps: str = "/proc/self/maps") -> bool:
    """Whether this process has initialised CUDA (or was forked from one that had), as torch says, or as the
    driver says where this process's memory map (`maps`) holds it (a runtime call initialises it unseen)."""
    import torch

    if torch.cuda.is_initialized() or torch.cuda._is_in_bad_fork():
        return True
    try:
        lines = Path(maps).read_text().splitlines()
    except OSError:
        return False
    library = next((line.split(maxsplit=5)[-1] for line in lines if "/libcuda.so" in line), None)
    return library is not None and driver_initialised(library)


CUDA_ERROR_NOT_INITIALIZED = 3


def driver_initialised(library: str) -> bool:
    """Whether the CUDA driver `library` has been initialised (cuInit): until then cuDeviceGetCount answers
    CUDA_ERROR_NOT_INITIALIZED. A library that cannot be asked counts as initialised (its jobs start cold)."""
    import ctypes

    try:
        get_count = ctypes.CDLL(library).cuDeviceGetCount
    except (OSError, AttributeError):
        return True
    count = ctypes.c_int()
    return get_count(ctypes.byref(count)) != CUDA_ERROR_NOT_INITIALIZED


def keep_seconds(env: dict) -> float:
    """$PIPELINE_STARTER_KEEP_S of `env`: seconds >= 0 (unset or empty: 0)."""
    text = env.get(KEEP_ENV) or "0"
    keep = -1.0
    with contextlib.suppress(ValueError):
        keep = float(text)
    if not keep >= 0:
        raise ValueError(f"{KEEP_ENV}={text} is invalid: a number of seconds >= 0 (0: the job starter ends with "
                         "the last command it served)")  # fmt: skip
    return keep


def _connect(path: str, wait_s: float = 0) -> socket.socket:
    """A connection to the starter at `path`, waiting up to `wait_s` for one just started to listen."""
    deadline = time.monotonic() + wait_s
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(path + ".sock")
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.02)


def _hold() -> bool:
    """Keep the starter at _address running while this process runs (a connection it closes as it ends)."""
    try:
        sock = _connect(_address)
        sock.send(b"hold")
    except OSError:
        return False
    _holds.append(sock)
    return True


def _start(env: dict) -> None:
    """Start a starter for `env` at _address, held by a pipe this process keeps open to its end."""
    alive_r, alive_w = os.pipe()
    with open(_address + ".log", "ab") as log:  # what the starter says: an import that failed
        _holds.append(
            subprocess.Popen(
                [sys.executable, "-m", "pipeline.starter", _address, str(alive_r)],
                env={**env, **STARTER_ENV},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                pass_fds=(alive_r,),
                start_new_session=True,  # no Ctrl-C of this terminal: it outlives this command when kept
            )
        )
    os.close(alive_r)
    _holds.append(alive_w)


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
    composes the config (half a second sooner), where warm_from_command says its jobs start warm; a sweep's
    command whose points were all FINISHED when it last ended (its note) starts none ahead (see ahead)."""
    global _note, _ahead
    from pipeline import quiet

    if "-m" in args or "--multirun" in args:
        try:
            _note = finished_note(args)
            _ahead = not _note.exists()
        except OSError:  # no private folder: no note, the starter starts ahead as before
            _note = None
    if warm_from_command(args):
        ahead(base_env(quiet.DEFAULT))


def ahead(env: dict) -> None:
    """Start this process's starter for `env` ahead of its first job (it imports while this process composes
    the config and opens the store), unless this command is a sweep whose points were all FINISHED when it
    last ended: it then expects no job, and a job that does run starts the starter itself (Job), waiting for
    its imports. The 5 s of CPU of imports no job uses are spared to a rerun of a finished sweep."""
    if _ahead:
        prestart(env)


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
    sys.stdout.reconfigure(line_buffering=os.isatty(1))  # as a new interpreter on the command's stdout would
    import importlib

    import torch

    code = 1
    try:
        # a fork after CUDA's initialisation is unusable: torch marks it a bad fork (is_initialized() then reads
        # False in the child, whose first CUDA call would fail with torch's generic error); the command starts
        # the job again cold (Job.wait)
        if torch.cuda._is_in_bad_fork() or torch.cuda.is_initialized():
            code = BAD_FORK
            print(f"[job] {Path(job_dir).name}: forked from a job starter with CUDA initialised: it does not run "
                  "here", file=sys.stderr)  # fmt: skip
        else:
            torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or torch.get_num_threads()))
            code = importlib.import_module(module).main(Path(job_dir))
    except BaseException:  # before the job's own reporting began (its module's import): on the console
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # as `python -m pipeline.job` ends: nothing of the starter's state is torn down


def _kill(pid: int) -> None:
    """SIGKILL to a job's process group (its session: whatever it started too), or to the job alone when it is
    killed before its own session began."""
    with contextlib.suppress(ProcessLookupError):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            os.kill(pid, signal.SIGKILL)


class Job:
    """One job's process(es), started at once: forked from the starter when `warm` and the starter runs with
    this environment (the request is sent now; the starter forks once its imports are done), else `command` in
    a new interpreter. wait() gives its exit status (negative: killed by that signal); kill() ends it where it
    still runs. `how` it started: `warm` or `cold`."""

    def __init__(self, job_dir: Path, env: dict, command: list[str], warm: bool):
        self.job_dir, self.env, self.command = job_dir, env, command
        self.pid: int | None = None
        self.status: int | None = None
        self.sock: socket.socket | None = None
        self.popen: subprocess.Popen | None = None
        if warm and not prestart(env):
            if _address is not None:
                mine = _shared(env)
                differ = sorted(k for k in {*mine, *_started_with} if mine.get(k) != _started_with.get(k))
                print(f"[job] {job_dir.name}: starts cold: its environment differs from the job starter's in "
                      f"{', '.join(differ)}", file=sys.stderr, flush=True)  # fmt: skip
        elif warm:
            try:
                self.sock = _request(job_dir, env)
            except OSError as err:
                self._gone(err)
        if self.sock is None:
            self._cold()
        self.how = "warm" if self.sock is not None else "cold"

    def _cold(self) -> None:
        # its own session: a kill reaches torchrun's ranks too, not only torchrun
        self.popen = subprocess.Popen(self.command, env=self.env, start_new_session=True)
        self.pid = self.popen.pid

    def _gone(self, err: Exception) -> None:
        """The starter died (an import of PRELOAD failed) or refused to serve (CUDA initialised by its imports):
        this job and the command's next ones start cold."""
        global _address
        refused = refusal(_address) if _address is not None else None
        if refused:
            print(f"[job] {self.job_dir.name}: the job starter serves no job ({refused}): this command's jobs "
                  "start cold", file=sys.stderr)  # fmt: skip
        else:
            print(f"[job] {self.job_dir.name}: the job starter is gone ({err!r}, its log: {_address}.log): "
                  "this command's jobs start cold", file=sys.stderr)  # fmt: skip
        _address = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _status(self) -> int:
        """Wait for the job's end: its exit status, as the operating system or its starter reports it (a
        starter killed meanwhile killed its jobs too)."""
        if self.popen is not None:
            return self.popen.wait()
        reply = self.sock.recv(STATUS.size)
        return STATUS.unpack(reply)[0] if len(reply) == STATUS.size else -signal.SIGKILL

    def wait(self) -> int:
        """The job's exit status, once it ended; an exception meanwhile (Ctrl-C, SIGTERM) kills it first."""
        try:
            if self.pid is None:  # the starter's reply: the pid of the process it forked
                try:
                    reply = self.sock.recv(STATUS.size)
                    if len(reply) != STATUS.size:
                        raise EOFError("the job starter ended before it started the job")
                    self.pid = STATUS.unpack(reply)[0]
                except (OSError, EOFError) as err:
                    self._gone(err)
                    self._cold()
                    self.how = "cold"
            self.status = self._status()
            if self.status == BAD_FORK and self.popen is None:  # forked after CUDA's initialisation: cold
                self._restart_cold()
                self.status = self._status()
        except BaseException as err:
            # SIGTERM, or submitit's time-limit warning: the job stops by itself at the end of its step
            self.kill(ask_first=str(err) == "signal SIGTERM" or type(err).__name__ == "UncompletedJobError")
            raise
        finally:
            if self.sock is not None and self.status is not None:
                self.sock.close()
        return self.status

    def _restart_cold(self) -> None:
        """The warm child found itself forked after CUDA's initialisation and did not run: the job starts cold,
        and so do the command's next ones."""
        global _address
        print(f"[job] {self.job_dir.name}: the job starter had CUDA initialised: this job and the command's "
              "next ones start cold", file=sys.stderr, flush=True)  # fmt: skip
        _address = None
        self.sock.close()
        self.sock, self.status, self.pid = None, None, None
        self._cold()
        self.how = "cold"

    def kill(self, ask_first: bool = False) -> None:
        """End the job where it still runs (SIGKILL to its process group) and wait for that end; `ask_first`:
        SIGTERM first, and up to STOP_WAIT_S for it to end by itself. A warm job the starter has not forked yet
        is ended by the starter: the connection its request came on closes."""
        if self.status is None and self.popen is None and self.sock is not None:
            if self.pid is None:  # forked already: its pid came back
                self.pid = self._reply()
            if self.pid is not None:  # ended already: its exit status came back too (nothing to kill)
                self.status = self._reply()
        if self.status is None and self.pid is not None and ask_first:
            os.kill(self.pid, signal.SIGTERM)
            if self.sock is not None:  # (kept below: once the job is gone its status comes at once)
                self.sock.settimeout(STOP_WAIT_S)
            with contextlib.suppress(subprocess.TimeoutExpired, TimeoutError):
                self.status = self.popen.wait(STOP_WAIT_S) if self.popen is not None else self._status()
        if self.status is None and self.pid is not None:
            _kill(self.pid)
            self.status = self._status()
        if self.sock is not None:
            self.sock.close()
        self.status = -signal.SIGKILL if self.status is None else self.status

    def _reply(self) -> int | None:
        """What the starter sent back and this process has not read yet, without waiting: a pid or an exit
        status (None: nothing yet, or the connection's end)."""
        try:
            reply = self.sock.recv(STATUS.size, socket.MSG_DONTWAIT)
        except OSError:
            return None
        return STATUS.unpack(reply)[0] if len(reply) == STATUS.size else None


def _request(job_dir: Path, env: dict) -> socket.socket:
    """Ask the starter for a job process on this process's console and in its folder: the connection its pid,
    then its exit status come back on."""
    for held in _holds:
        if isinstance(held, subprocess.Popen):
            held.poll()  # reaped: the process that started the starter ends at once (pipeline.starter's main)
    try:
        sock = _connect(_address, 5)  # a starter just started listens within a second
    except (FileNotFoundError, ConnectionRefusedError):  # it ended as this command began: a new one
        if refusal(_address):  # ended serving no job: so would another
            raise
        _start(env)
        sock = _connect(_address, CONNECT_WAIT_S)
    if not any(isinstance(h, socket.socket) for h in _holds):
        _hold()  # held by a connection too (one this process started may have found another serving)
    try:
        request = pickle.dumps((str(job_dir), env, JOB_MODULE, os.getcwd()))
        socket.send_fds(sock, [request], [_console_fd(fd) for fd in (0, 1, 2)])
    except BaseException:
        sock.close()
        raise
    return sock


def _console_fd(fd: int) -> int:
    """`fd` if open, else /dev/null in its place (a command started with its stdin closed)."""
    try:
        os.fstat(fd)
        return fd
    except OSError:
        return os.open(os.devnull, os.O_RDWR)


def serve(path: str, alive_fd: int) -> None:
    """The starter (`python -m pipeline.starter PATH ALIVE_FD`): import PRELOAD, then fork a child per job
    request on PATH.sock until no command holds it (the pipe ALIVE_FD from the command that started it, a
    connection from each other one) nor runs a job, for KEEP_ENV seconds."""
    import fcntl
    import importlib
    import selectors

    try:
        keep = keep_seconds(os.environ)
    except ValueError:  # the command that started it said so
        keep = 0
    deadline = time.monotonic() + 5
    while True:  # one starter per address: the lock on its log, this process's stderr, held to its end
        try:
            fcntl.flock(2, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:  # another starter serves PATH, or is ending (its socket gone already)
            if os.path.exists(path + ".sock") or time.monotonic() > deadline:
                return
            time.sleep(0.02)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path + ".sock")  # left by a starter that was killed
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".sock")
    listener.listen(64)
    bound = os.stat(path + ".sock").st_ino
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `pkill -f pipeline.starter`: the same clean end
    try:
        importlib.import_module(PRELOAD)
        if cuda_initialised():  # a job forked now could not use CUDA
            print(f"{REFUSED} CUDA was initialised by the imports of {PRELOAD} (a fork cannot use it)",
                  file=sys.stderr, flush=True)  # fmt: skip
            return
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # its wakeup byte: a job ended
        events = selectors.DefaultSelector()
        events.register(listener, selectors.EVENT_READ, "accept")
        events.register(wake_r, selectors.EVENT_READ, "ended")
        events.register(alive_fd, selectors.EVENT_READ, "hold")
        holds, jobs, idle_since = 1, {}, None
        own = [wake_r, wake_w]  # what a job process closes, with every registered connection
        while True:
            if holds or jobs:
                idle_since, timeout = None, None
            else:
                idle_since = idle_since or time.monotonic()
                timeout = idle_since + keep - time.monotonic()
                if timeout <= 0:
                    break
            for key, _ in events.select(timeout):
                if key.data == "accept":
                    conn, _ = listener.accept()
                    conn.settimeout(5)  # a command stopped between its connection and its request: not all
                    try:
                        request, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                    except OSError:
                        conn.close()
                        continue
                    if request == b"hold":
                        holds += 1
                        events.register(conn, selectors.EVENT_READ, "hold")
                    elif len(fds) == 3 and _closed(conn):  # the command ended or stopped the job meanwhile
                        for fd in fds:
                            os.close(fd)
                        conn.close()
                    elif len(fds) == 3:
                        closing = [*own, conn, *(k.fileobj for k in events.get_map().values())]
                        pid = _serve_one(pickle.loads(request), fds, closing)
                        for fd in fds:
                            os.close(fd)
                        with contextlib.suppress(OSError):
                            conn.send(STATUS.pack(pid))
                        jobs[pid] = conn
                        events.register(conn, selectors.EVENT_READ, pid)
                    else:
                        conn.close()
                elif key.data == "hold":  # a command ended
                    holds -= 1
                    _close(events, key.fileobj)
                elif key.data == "ended":
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_r, 4096)
                    _reap(events, jobs)
                else:  # the command of a running job ended (killed outright): the job with it
                    if key.data in jobs:  # (not reaped in this same round: its pid is not reused yet)
                        _kill(key.data)
                    with contextlib.suppress(KeyError, ValueError):
                        events.unregister(key.fileobj)
    except SystemExit:  # SIGTERM: the end an idle starter has
        pass
    finally:  # (an exception, an import of PRELOAD that failed, goes on to the log after this)
        with contextlib.suppress(OSError):  # before the lock goes with this process: the next starter waits
            if os.stat(path + ".sock").st_ino == bound:
                os.unlink(path + ".sock")
        listener.close()
    with contextlib.suppress(OSError):
        if not os.fstat(2).st_size:
            os.unlink(path + ".log")  # nothing said


def _closed(conn: socket.socket) -> bool:
    """Whether the command at the other end of `conn` closed it (nothing left to read but its end)."""
    timeout = conn.gettimeout()
    conn.settimeout(0)  # a look, no wait
    try:
        return conn.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        conn.settimeout(timeout)


def _serve_one(request: tuple, fds: list[int], closing: list) -> int:
    """Fork a job process: the command's console on 0, 1, 2, its folder, then _child. Its pid."""
    job_dir, env, module, cwd = request
    pid = os.fork()
    if pid:
        return pid
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        closed = set()
        for obj in closing:  # the starter's own files and sockets (each once)
            fd = obj if isinstance(obj, int) else obj.fileno()
            if fd >= 0 and fd not in closed:
                closed.add(fd)
                obj.close() if hasattr(obj, "close") else os.close(obj)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(cwd)
    except BaseException:
        os._exit(1)
    _child(job_dir, env, module)  # never returns


def _reap(events, jobs: dict) -> None:
    """Send each ended job's exit status to its command."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        conn = jobs.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.send(STATUS.pack(os.waitstatus_to_exitcode(status)))
            _close(events, conn)


def _close(events, obj) -> None:
    with contextlib.suppress(KeyError, ValueError):
        events.unregister(obj)
    obj.close() if hasattr(obj, "close") else os.close(obj)


if __name__ == "__main__":
    # out of the process tree of the command that started it (init adopts it): a kill of that tree (joblib's
    # workers are ended with theirs) leaves the jobs of the other commands it serves alone
    if os.fork():
        os._exit(0)
    from pipeline.starter import serve as _serve  # the module the jobs share, not this __main__ copy of it

    _serve(sys.argv[1], int(sys.argv[2]))
