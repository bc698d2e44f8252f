"""Real services for the tests, and for trying the cluster paths by hand: a PostgreSQL server and a one-node
SLURM cluster, each in a temporary folder of its own (its config, state, logs, sockets and ports), started from
Debian's binaries without systemd, waited for until it answers, and stopped by PID.

By hand (as root for SLURM; the services stay up until Ctrl-C):

    .venv/bin/python -m tests.services postgres     # prints the database URI
    .venv/bin/python -m tests.services slurm        # prints `export SLURM_CONF=...`

`missing(kind)` says why a service cannot start here (its packages absent), for a test's skip reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PG_USER = "postgres"  # the account initdb and the server run as when we are root (PostgreSQL refuses root)
SLURM_PACKAGES = "slurmctld slurmd slurm-client munge"
PG_PACKAGES = "postgresql-15"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pg_bin() -> Path | None:
    """The folder of PostgreSQL's server binaries (Debian keeps them off PATH, per version)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    if found:
        return found[-1].parent
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


def missing(kind: str) -> str | None:
    """Why `kind` (postgres | slurm) cannot start here, or None."""
    if kind == "postgres":
        if _pg_bin() is None:
            return f"PostgreSQL's server is not installed (apt-get install {PG_PACKAGES})"
        if os.geteuid() == 0 and not _has_user(PG_USER):
            return f"running as root without a '{PG_USER}' account to run PostgreSQL as"
        return None
    tools = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol")
    absent = [t for t in tools if shutil.which(t, path=f"{os.environ.get('PATH', '')}:/usr/sbin") is None]
    if absent:
        return f"SLURM is not installed ({', '.join(absent)} missing: apt-get install {SLURM_PACKAGES})"
    if os.geteuid() != 0:
        return "a one-node SLURM cluster here runs its daemons as root"
    return None


def _has_user(name: str) -> bool:
    import pwd

    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def _wait(check, what: str, log: Path, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not check():
        if time.time() > deadline:
            tail = log.read_text()[-3000:] if log.exists() else ""
            raise RuntimeError(f"{what} did not come up in {timeout:.0f} s; {log}:\n{tail}")
        time.sleep(0.2)


def _kill_pidfile(pidfile: Path, sig=signal.SIGTERM, timeout: float = 30) -> None:
    """Signal the process whose PID the file holds and wait until it is gone (SIGKILL past the timeout)."""
    try:
        pid = int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    _kill_pid(pid, sig, timeout)


def _kill_pid(pid: int, sig=signal.SIGTERM, timeout: float = 30) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return
    deadline = time.time() + timeout
    while _alive(pid):
        if time.time() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    if state == "Z":  # a child of ours: reap it
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        return False
    return True


# ---- PostgreSQL ------------------------------------------------------------------------------------------


@dataclass
class Postgres:
    folder: Path
    port: int
    user: str = PG_USER

    @property
    def data(self) -> Path:
        return self.folder / "data"

    def uri(self, database: str) -> str:
        """SQLAlchemy's URI of a database on this server (trust authentication on loopback)."""
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"

    def _run(self, *cmd: str, **kw) -> subprocess.CompletedProcess:
        as_user = {"user": self.user} if os.geteuid() == 0 else {}
        return subprocess.run(cmd, check=True, capture_output=True, text=True, **as_user, **kw)

    def create_database(self, name: str) -> str:
        self._run(str(_pg_bin() / "createdb"), "-h", str(self.folder), "-p", str(self.port), name)
        return self.uri(name)

    def start(self) -> None:
        self._run(
            str(_pg_bin() / "pg_ctl"),
            "start",
            "-w",
            "-D",
            str(self.data),
            "-l",
            str(self.folder / "postgres.log"),
            "-o",
            f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c max_connections=300 -c fsync=off",
        )
        _wait(self.ready, "PostgreSQL", self.folder / "postgres.log")

    def ready(self) -> bool:
        done = subprocess.run(
            [str(_pg_bin() / "pg_isready"), "-h", str(self.folder), "-p", str(self.port)], capture_output=True
        )
        return done.returncode == 0

    def stop(self) -> None:
        """Its postmaster, by the PID in its data folder (SIGINT: PostgreSQL's fast shutdown)."""
        _kill_pidfile(self.data / "postmaster.pid", signal.SIGINT)


def start_postgres(folder: Path | None = None) -> Postgres:
    """initdb in a folder of its own (owned by the postgres account when we are root), then the server on a
    free local port, its unix socket in that folder."""
    folder = Path(folder or tempfile.mkdtemp(prefix="pg-"))
    folder.mkdir(parents=True, exist_ok=True)
    pg = Postgres(folder, free_port(), PG_USER if os.geteuid() == 0 else _login())
    if os.geteuid() == 0:
        shutil.chown(folder, PG_USER, PG_USER)
    pg._run(str(_pg_bin() / "initdb"), "-D", str(pg.data), "-U", pg.user, "--auth=trust", "-E", "UTF8")
    pg.start()
    return pg


def _login() -> str:
    import getpass

    return getpass.getuser()


# ---- the team server (make server) ----------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
ADMIN_PASSWORD = "admin-password-for-tests"  # MLflow wants 12 characters or more
SECRETS = {"MLFLOW_AUTH_ADMIN_PASSWORD": ADMIN_PASSWORD, "MLFLOW_FLASK_SERVER_SECRET_KEY": "test-key"}


@dataclass
class TeamServer:
    process: subprocess.Popen
    uri: str
    log: Path

    def stop(self) -> None:
        """The server and its workers (its own process group), gone."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def start_team_server(
    folder: Path, store: str, auth_store: str, port: int | None = None, workers: int = 4
) -> TeamServer:
    """`make server` (the install step taken as done: the venv at hand) with basic-auth, its runs in `store`,
    accounts in `auth_store`, artifacts in `folder`; back once it answers its health check."""
    import urllib.request

    port = port or free_port()
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [
        "make",
        "-s",
        "-o",
        ".venv/.installed",
        "server",
        f"SERVER_PORT={port}",
        f"SERVER_WORKERS={workers}",
    ]
    cmd += [f"SERVER_STORE={store}", f"SERVER_ARTIFACTS={folder / 'artifacts'}", "SERVER_HOST=127.0.0.1"]
    cmd += [f"SERVER_AUTH_STORE={auth_store}", f"SERVER_AUTH_CONFIG={folder / 'auth.ini'}"]
    cmd += [f"BIN={Path(sys.executable).parent}"]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}, **SECRETS}
    log = folder / "server.log"
    with open(log, "a") as out:
        process = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    server = TeamServer(process, f"http://127.0.0.1:{port}", log)

    def healthy() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"make server ended with {process.returncode}: {log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"{server.uri}/health", timeout=2).close()
            return True
        except OSError:
            return False

    try:
        _wait(healthy, "make server", log, timeout=600)
    except BaseException:
        server.stop()
        raise
    return server


# ---- SLURM -----------------------------------------------------------------------------------------------

# cred_expire: a job step's credential lifetime, and how long a requeued job waits before it starts again
# (SLURM's default 120 s; the prolog and a job's start on this one node take seconds: 15 s)
SLURM_CONF = """\
ClusterName=pipeline-test
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={folder}/munge.socket,cred_expire=15
CredType=cred/munge
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
KillWait=5
MinJobAge=300
Prolog={folder}/prolog.sh
InactiveLimit=0
MessageTimeout=20
SlurmctldTimeout=30
SlurmdTimeout=60
NodeName={host} CPUs={cpus} RealMemory={memory} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


PROLOG_HOLD_S = 120
# run by slurmd before each job's own code (the batch script): it waits while the folder holds `hold`
PROLOG = """#!/bin/sh
end=$(($(date +%s) + {seconds}))
while [ -e {folder}/hold ] && [ "$(date +%s)" -lt "$end" ]; do sleep 0.2; done
exit 0
"""


@dataclass
class Slurm:
    folder: Path
    host: str
    munged_pid: int = 0
    env: dict = field(default_factory=dict)
    pids: list = field(default_factory=list)  # slurmctld, slurmd

    @property
    def conf(self) -> Path:
        return self.folder / "slurm.conf"

    def command(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster."""
        return subprocess.run(
            cmd, env={**os.environ, **self.env}, capture_output=True, text=True, check=check, timeout=60
        )

    def node_state(self) -> str:
        done = self.command("sinfo", "-h", "-N", "-o", "%T", check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    def queue(self) -> list[str]:
        """The job ids squeue lists (all states it shows)."""
        done = self.command("squeue", "-h", "-o", "%i")
        return done.stdout.split()

    def running(self) -> list[str]:
        """The ids of the jobs squeue shows RUNNING (held in the prolog too), array tasks as `<array>_<task>`."""
        return self.command("squeue", "-h", "-t", "R", "-o", "%i").stdout.split()

    @contextlib.contextmanager
    def held(self):
        """Jobs that start in this block wait in SLURM's prolog (RUNNING to squeue, none of their own code
        started) until it ends, or for PROLOG_HOLD_S at most."""
        (self.folder / "hold").touch()
        try:
            yield
        finally:
            (self.folder / "hold").unlink(missing_ok=True)

    def stop(self) -> None:
        """scancel whatever is left, then slurmd, slurmctld and munged, each by its PID."""
        with contextlib.suppress(Exception):
            self.command("scancel", "--full", "--user", _login(), check=False)
        for pid in reversed(self.pids):
            _kill_pid(pid)
        if self.munged_pid:
            _kill_pid(self.munged_pid)


def _real_memory_mb() -> int:
    """What slurmd counts as this node's memory, less a margin (slurmd refuses a node claiming more)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024 - 512
    return 1024


def start_slurm(folder: Path | None = None, cpus: int | None = None) -> Slurm:
    """munged, slurmctld and slurmd for a one-node cluster named after this host, from a slurm.conf written
    in `folder` (its own ports, state, spool and munge socket); back once the node is idle."""
    folder = Path(folder or tempfile.mkdtemp(prefix="slurm-"))
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)  # jobs run as the submitting user and read their scripts from the sweep folder
    host = socket.gethostname().split(".")[0]
    for sub in ("state", "spool"):
        (folder / sub).mkdir(exist_ok=True)
    cpus = cpus or os.cpu_count() or 1
    conf = SLURM_CONF.format(
        host=host,
        folder=folder,
        ctld_port=free_port(),
        slurmd_port=free_port(),
        cpus=cpus,
        memory=_real_memory_mb(),
    )
    (folder / "slurm.conf").write_text(conf)
    (folder / "prolog.sh").write_text(PROLOG.format(folder=folder, seconds=PROLOG_HOLD_S))
    (folder / "prolog.sh").chmod(0o755)
    # munge: a key of our own (copied from the system's, else made), its socket in the folder
    key = folder / "munge.key"
    if Path("/etc/munge/munge.key").exists():
        shutil.copyfile("/etc/munge/munge.key", key)
    else:
        key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sbin = f"{os.environ.get('PATH', '')}:/usr/sbin"
    munged = subprocess.Popen(
        [
            shutil.which("munged", path=sbin),
            "--foreground",
            "--force",
            f"--socket={folder / 'munge.socket'}",
            f"--key-file={key}",
            f"--pid-file={folder / 'munged.pid'}",
            f"--log-file={folder / 'munged.log'}",
            f"--seed-file={folder / 'munged.seed'}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(folder / "munged.err", "w"),  # noqa: SIM115 (the daemon's own output)
        start_new_session=True,
    )
    cluster = Slurm(folder, host, munged.pid, {"SLURM_CONF": str(folder / "slurm.conf")})
    try:
        _wait(lambda: (folder / "munge.socket").exists(), "munged", folder / "munged.err", 30)
        env = {**os.environ, **cluster.env}
        for daemon in ("slurmctld", "slurmd"):
            # in the foreground, children of ours (stopped by PID, reaped); slurmctld -c: a clean state
            args = [shutil.which(daemon, path=sbin), "-D"] + (["-c", "-i"] if daemon == "slurmctld" else [])
            with open(folder / f"{daemon}.err", "w") as err:
                proc = subprocess.Popen(args, env=env, stdout=err, stderr=err, start_new_session=True)
            cluster.pids.append(proc.pid)
        _wait(lambda: cluster.node_state() == "idle", "the SLURM node", folder / "slurmd.log", timeout=120)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def main(argv: list[str]) -> int:
    kind = argv[0] if argv else ""
    if kind not in ("postgres", "slurm"):
        print("usage: python -m tests.services postgres|slurm  (stays up until Ctrl-C)", file=sys.stderr)
        return 2
    reason = missing(kind)
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    if kind == "postgres":
        pg = start_postgres()
        print(f"PostgreSQL up in {pg.folder}; store: {pg.create_database('mlflow')}", flush=True)
        stop, folder = pg.stop, pg.folder
    else:
        cluster = start_slurm()
        print(
            f"SLURM node {cluster.host} idle; in another shell:\n  export SLURM_CONF={cluster.conf}",
            flush=True,
        )
        stop, folder = cluster.stop, cluster.folder
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        stop()
        shutil.rmtree(
            folder, ignore_errors=True
        )  # its data, logs and sockets: nothing left in the temp folder
        print(f"{kind} stopped, {folder} removed", flush=True)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    sys.exit(main(sys.argv[1:]))
