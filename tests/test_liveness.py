"""Whether a run's process still runs (pipeline.liveness), from the tags it was opened with: real processes of
this host, a pid given to a later process, a zombie, another host; a SLURM job on a real one-node cluster."""

import os
import socket
import subprocess
import sys
import time

import psutil

from pipeline import liveness


def tags_of(pid: int, **more) -> dict:
    started = f"{psutil.Process(pid).create_time():.2f}"
    return {liveness.HOST: socket.gethostname(), liveness.PID: str(pid), liveness.PID_START: started, **more}


def test_this_process_is_where_its_tags_say_and_runs():
    tags = liveness.process_tags()
    assert tags[liveness.HOST] == socket.gethostname() and tags[liveness.PID] == str(os.getpid())
    assert abs(float(tags[liveness.PID_START]) - psutil.Process().create_time()) < 0.01
    assert liveness.states([tags]) == [True]


def test_a_process_that_ended_is_gone_and_one_that_runs_is_not():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        tags = tags_of(child.pid)
        assert liveness.states([tags]) == [True]
        child.kill()
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.01)
        assert liveness.states([tags]) == [False]  # killed, not reaped yet: a zombie
        child.wait()
        assert liveness.states([tags]) == [False]
    finally:
        child.kill()
        child.wait()


def test_a_pid_given_to_a_later_process_is_gone():
    """Pids are reused: the process holding the recorded pid now started at another time."""
    tags = tags_of(os.getpid())
    tags[liveness.PID_START] = f"{float(tags[liveness.PID_START]) - 3600:.2f}"
    assert liveness.states([tags]) == [False]
    del tags[liveness.PID_START]  # none recorded: the pid alone says
    assert liveness.states([tags]) == [True]


def test_another_host_cannot_be_told():
    elsewhere = {**tags_of(os.getpid()), liveness.HOST: "another-host"}
    assert liveness.states([elsewhere, {}]) == [None, None]  # none: a run opened before these tags


def test_a_slurm_job_on_this_host_is_its_pid_and_elsewhere_needs_squeue(monkeypatch, tmp_path):
    """On this host the pid decides; elsewhere, where squeue cannot be asked (not installed here), nothing."""
    monkeypatch.setenv("PATH", str(tmp_path))
    here = tags_of(os.getpid(), slurm_job_id="12")
    elsewhere = {**here, liveness.HOST: "node7"}
    assert liveness.states([here, elsewhere]) == [True, None]


def test_a_slurm_job_runs_while_squeue_lists_it(slurm_cluster, tmp_path):
    done = slurm_cluster.command("sbatch", "--parsable", f"--chdir={tmp_path}", "--wrap", "sleep 300")
    job = done.stdout.strip().split(";")[0]
    elsewhere = {liveness.HOST: "node7", liveness.PID: "1", liveness.SLURM_JOB: job}
    never = {**elsewhere, liveness.SLURM_JOB: "999999"}
    assert liveness.states([elsewhere, never]) == [True, False]
    assert liveness.states([never]) == [False]  # (squeue's error for one job id it does not hold)
    slurm_cluster.command("scancel", job)
    deadline = time.time() + 120
    while job in slurm_cluster.queue():
        assert time.time() < deadline, "scancel: the job stays in the queue"
        time.sleep(0.5)
    assert liveness.states([elsewhere, never]) == [False, False]
