"""Where a run's process runs (tags `host`, `pid`, `pid_start`, and `slurm_job_id` inside a SLURM job), and
whether it still does: on this host, while that pid runs and is still the same process (its start time);
elsewhere, a SLURM job while squeue lists it; anything else cannot be told from here.

It imports nothing of ours but pipeline.slurm.
"""

from __future__ import annotations

import os
import socket

from pipeline import slurm

HOST, PID, PID_START, SLURM_JOB = "host", "pid", "pid_start", "slurm_job_id"
START_SLACK_S = 2.0  # a pid whose process started further from its recorded start is another process


def process_tags() -> dict[str, str]:
    """The tags that say where this process runs."""
    import psutil

    tags = {HOST: socket.gethostname(), PID: str(os.getpid())}
    tags[PID_START] = f"{psutil.Process().create_time():.2f}"
    job = slurm.job_tags().get(SLURM_JOB)
    return {**tags, SLURM_JOB: job} if job else tags


def pid_alive(pid: int, started: float | None = None) -> bool:
    """Whether process `pid` runs (not a zombie) and, with `started` (its start, seconds since the epoch), is
    the process that started then, not a later one given the same pid. Another user's process counts as
    running: its start time may be hidden (/proc mounted hidepid)."""
    import psutil

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return started is None or abs(process.create_time() - started) <= START_SLACK_S
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def states(tag_sets: list[dict]) -> list[bool | None]:
    """For each run's tags: True while its process runs, False once it is gone, None where that cannot be
    told from here (no tags, or another host and no SLURM job squeue answers for). On this host the pid
    decides; elsewhere the SLURM job, all asked in one squeue call."""
    here = socket.gethostname()
    mine = [tags.get(HOST) == here and tags.get(PID, "").isdigit() for tags in tag_sets]
    jobs = sorted(
        {tags[SLURM_JOB] for tags, m in zip(tag_sets, mine, strict=True) if not m and SLURM_JOB in tags}
    )
    listed = slurm.listed(jobs) if jobs else None
    found = []
    for tags, on_this_host in zip(tag_sets, mine, strict=True):
        if on_this_host:
            started = tags.get(PID_START)
            found.append(pid_alive(int(tags[PID]), float(started) if started else None))
        elif SLURM_JOB in tags and listed is not None:
            found.append(tags[SLURM_JOB] in listed)
        else:
            found.append(None)
    return found
