"""Where a job's processes run: its own GPUs from the sweep's pool, its share of the CPU cores, its ranks.

The engines do the work (Hydra launchers run jobs side by side, torchrun / submitit start the ranks of one
job); this module only decides what each job process gets, through its environment.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import signal
import sys
import time
from pathlib import Path

LOCK_DIR = "gpu_locks"
SCHEDULED = ("slurm", "submitit_local")  # launchers whose scheduler places the job (GPUs, ranks)
SUBMITIT_DIR = ".submitit"  # in the sweep folder: submitit's folder per job (the presets' submitit_folder)


def nvml_device_count(library: str = "libnvidia-ml.so.1") -> int | None:
    """How many NVIDIA GPUs the driver's management library (NVML) counts, None where it cannot be asked. NVML
    never initialises CUDA, and asking it costs no torch import (seconds in the launching process)."""
    import ctypes

    try:
        nvml = ctypes.CDLL(library)
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count = ctypes.c_uint(0)
        return count.value if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0 else None
    finally:
        nvml.nvmlShutdown()


def visible_gpus() -> list[str]:
    """The GPUs this process may hand out: $CUDA_VISIBLE_DEVICES when set, else every device NVML counts (torch's
    count where NVML cannot answer: ROCm)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    if not any(Path("/dev").glob("nvidia[0-9]*")) and not Path("/dev/kfd").exists():
        return []  # no NVIDIA or ROCm device node: spare the launching process torch's import (seconds)
    count = nvml_device_count()
    if count is None:
        import torch  # only when the variable is unset: torch's NVML count does not initialise CUDA

        count = torch.cuda.device_count()
    return [str(i) for i in range(count)]


def too_few_gpus(nproc: int, gpus: list[str]) -> str:
    return (
        f"launcher.nproc_per_job={nproc} is invalid here: it needs {nproc} GPUs and {len(gpus)} "
        f"{'is' if len(gpus) == 1 else 'are'} visible (CUDA_VISIBLE_DEVICES={','.join(gpus)})"
    )


class GpuPool:
    """One lock file per device in the sweep folder, held (fcntl.flock) by the runner of the job using it.

    No two running jobs can hold the same device; a finished job's device is free again at once, and the OS
    drops the locks of a runner that dies, so a crash never strands a device.
    """

    def __init__(self, folder: Path, devices: list[str]):
        self.folder = Path(folder) / LOCK_DIR
        self.folder.mkdir(parents=True, exist_ok=True)
        self.devices = devices

    def _try_take(self, count: int) -> list | None:
        held = []
        for device in self.devices:
            file = open(self.folder / f"gpu{device}.lock", "w")  # held until release
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                file.close()
                continue
            held.append((device, file))
            if len(held) == count:
                return held
        for _, file in held:  # not enough free: give back what we took so another job can finish its set
            file.close()
        return None

    @contextlib.contextmanager
    def take(self, count: int, poll_s: float = 0.2):
        """Block until `count` devices are free; yields their ids and holds them for the block."""
        if count > len(self.devices):
            raise RuntimeError(too_few_gpus(count, self.devices))
        while (held := self._try_take(count)) is None:
            time.sleep(poll_s)
        try:
            yield [device for device, _ in held]
        finally:
            for _, file in held:
                file.close()


def cpu_threads(n_jobs: int, nproc_per_job: int) -> int:
    """Each process's share of the cores when n_jobs jobs of nproc_per_job processes run at once."""
    return max(1, len(os.sched_getaffinity(0)) // (n_jobs * nproc_per_job))


def submitit_ranks() -> dict[str, str]:
    """torch.distributed's env:// variables of this submitit task (one task = one rank of the job)."""
    from submitit.helpers import TorchDistributedEnvironment

    dist = TorchDistributedEnvironment()  # master: first host, port derived from the job id (same on all)
    return {
        "MASTER_ADDR": dist.master_addr,
        "MASTER_PORT": str(dist.master_port),
        "RANK": str(dist.rank),
        "WORLD_SIZE": str(dist.world_size),
        "LOCAL_RANK": str(dist.local_rank),
        "LOCAL_WORLD_SIZE": str(dist.local_world_size),
    }


def job_command(job_dir: Path, nproc: int, ranks_given: bool) -> list[str]:
    """`python -m pipeline.job`, or torchrun starting nproc of them (unless a scheduler started the ranks)."""
    job = ["-m", "pipeline.job", str(job_dir)]
    if nproc == 1 or ranks_given:
        return [sys.executable, *job]
    # --standalone: a rendezvous on a free local port, so parallel jobs never collide on MASTER_PORT
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *job]


def cancel_scheduled(sweep_dir: Path, launcher: str, wait_s: float = 30) -> list[str]:
    """Cancel the jobs submitit started for a sweep that have not ended (their folders .submitit/<job id>
    hold no result yet), as submitit's own job objects do: SLURM's through `scancel`, the local executor's by
    SIGINT to its controller process (whose pid is the job id), which stops its tasks, waited for up to
    `wait_s`. The ids of the jobs cancelled."""
    folder = Path(sweep_dir) / SUBMITIT_DIR
    if launcher not in SCHEDULED or not folder.is_dir():
        return []
    from submitit.core.utils import JobPaths

    # the job folders (`<id>`, `<array id>_<task>`): not the submission's template folder nor its script
    jobs = [p for p in sorted(folder.iterdir()) if p.is_dir() and re.fullmatch(r"\d+(_\d+)?", p.name)]
    names = [p.name for p in jobs]  # an array's own folder `<id>` beside its tasks' `<id>_<n>` is no job
    jobs = [p for p in jobs if not any(n.startswith(f"{p.name}_") for n in names)]
    pending = [p.name for p in jobs if not JobPaths(p, p.name, 0).result_pickle.exists()]
    if launcher == "slurm":
        import submitit

        for job_id in pending:
            submitit.SlurmJob(folder / job_id, job_id).cancel(check=False)
        deadline = time.time() + wait_s  # their runners record how they ended (KILLED) as SLURM stops them
        while time.time() < deadline and _in_queue(pending):
            time.sleep(0.5)
        return pending
    cancelled = []
    for job_id in pending:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(job_id), signal.SIGINT)
            cancelled.append(job_id)
    deadline = time.time() + wait_s
    while time.time() < deadline and any(_alive(int(job_id)) for job_id in cancelled):
        time.sleep(0.2)
    return cancelled


def _alive(pid: int) -> bool:
    """The process runs (not gone, not a zombie waiting to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _in_queue(job_ids: list[str]) -> bool:
    """Any of these SLURM jobs still listed by squeue (pending, running or completing)."""
    import subprocess

    try:
        done = subprocess.run(
            ["squeue", "-h", "-o", "%i", "-j", ",".join(job_ids)], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 and bool(done.stdout.split())
