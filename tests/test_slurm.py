"""Sweeps on a real one-node SLURM cluster (tests/services.py: munged, slurmctld, slurmd from Debian's packages,
accounting off, as on many small clusters), through the CLI as users run them: the shipped preset on a
partition without GPUs, a request sbatch refuses, Ctrl-C / SIGTERM, a job cancelled from outside, a time limit,
a requeue, a job of 2 ranks as 2 SLURM tasks. Skipped where SLURM is not installed (CI installs it: .ci/run)."""

import signal
import subprocess
import time

import pytest

from tests.conftest import TINY, run_cli, store, sweep_runs
from tests.test_failures import start_sweep

# two jobs at once on the 2-core node (the preset asks for as many cores as a node has, up to 8)
ONE_CORE = ["launcher=slurm", "hydra.launcher.cpus_per_task=1"]
LONG = [*TINY, "train.max_steps=100000"]  # a job that trains until it is stopped
WAIT_S = 1500  # a sweep's wall time on a loaded 2-core machine (cold starts: jobs SLURM starts import torch)


def wait_for(check, what: str, timeout: float = 900, sweep=None):
    deadline = time.time() + timeout
    while not (found := check()):
        assert time.time() < deadline, f"{what}: not within {timeout} s"
        assert sweep is None or sweep.poll() is None, sweep.stderr.read()[-3000:]
        time.sleep(0.5)
    return found


def training(tmp_path, n: int):
    """The pids of the sweep's job processes once n of them run."""

    def found():
        out = subprocess.run(
            ["pgrep", "-f", f"pipeline.job {tmp_path}"], capture_output=True, text=True
        ).stdout
        pids = [int(p) for p in out.split()]
        return pids if len(pids) >= n else None

    return found


def runs_by_seed(tmp_path) -> dict:
    return {r.data.params["seed"]: r for r in sweep_runs(tmp_path)[1]}


def test_a_request_sbatch_refuses_is_one_line_and_opens_nothing(slurm_cluster, tmp_path):
    proc = run_cli(
        tmp_path, "-m", "seed=0,1", *TINY, *ONE_CORE, "hydra.launcher.gpus_per_node=1", timeout=300
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "error: sbatch refuses the sweep's jobs: Invalid generic resource (gres) specification: set "
        "hydra.launcher.gpus_per_node (0 on a partition without GPUs) (docs/scaling.md)"
    ]
    assert not (tmp_path / "mlflow.db").exists() and not list(tmp_path.glob("multirun/*/mlflow_sweep.json"))
    assert slurm_cluster.queue() == []


@pytest.mark.slow  # 4 tiny jobs, 2 at a time, each a cold start (56 s on 2 cores)
def test_four_points_through_slurm_finish_under_one_parent_tagged_with_their_jobs(slurm_cluster, tmp_path):
    # the shipped preset as it is (no GPUs asked on this partition), but for the cores per task
    points = ["optim=adamw,adafactor", "backend=trainer,accelerator"]
    proc = run_cli(tmp_path, "-m", *points, *TINY, *ONE_CORE, timeout=WAIT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parent, children = sweep_runs(tmp_path)
    assert parent.info.status == "FINISHED" and len(children) == 4
    assert {r.info.status for r in children} == {"FINISHED"}
    arrays = {r.data.tags["slurm_array_job_id"] for r in children}
    assert len(arrays) == 1  # one array, a task per point
    assert sorted(r.data.tags["slurm_array_task_id"] for r in children) == ["0", "1", "2", "3"]
    assert {r.data.tags["slurm_node"] for r in children} == {slurm_cluster.host}
    (array,) = arrays
    assert {r.data.tags["slurm_job_id"] for r in children} == {f"{array}_{n}" for n in range(4)}
    # as quiet as a local sweep: no sacct complaint where accounting is off
    assert "sacct" not in proc.stdout + proc.stderr and "accounting" not in proc.stdout + proc.stderr
    assert "[sweep] 4 jobs: 4 finished, 0 failed" in proc.stdout and "eval F1" in proc.stdout
    assert slurm_cluster.queue() == []


@pytest.mark.slow  # two jobs started and stopped (21 s)
def test_sigterm_to_the_sweep_cancels_its_jobs_and_marks_every_run_killed(slurm_cluster, tmp_path):
    sweep = start_sweep(tmp_path, "seed=0,1", *LONG, *ONE_CORE)
    wait_for(training(tmp_path, 2), "two job processes", sweep=sweep)
    sweep.send_signal(signal.SIGTERM)
    out, err = sweep.communicate(timeout=WAIT_S)
    assert sweep.returncode == 130, err[-3000:]
    assert "[sweep] cancelled 2 slurm jobs" in out, out
    assert "error" not in (out + err).lower(), out + err  # no scancel of a file taken for a job id
    assert slurm_cluster.queue() == []
    parent, children = sweep_runs(tmp_path)
    assert parent.info.status == "KILLED"
    assert len(children) == 2 and {r.info.status for r in children} == {"KILLED"}


@pytest.mark.slow  # one job cancelled, one trained (37 s)
def test_a_job_cancelled_from_outside_ends_killed_with_that_reason_and_the_sweep_goes_on(
    slurm_cluster, tmp_path
):
    # two points: one that trains until it is stopped (cancelled below), one short
    sweep = start_sweep(tmp_path, "seed=0", *TINY, *ONE_CORE, "train.max_steps=100000,3")
    wait_for(training(tmp_path, 1), "a job process", sweep=sweep)
    job = wait_for(lambda: _job_of(tmp_path, "100000"), "the long job's SLURM id", sweep=sweep)
    slurm_cluster.command("scancel", job)
    out, err = sweep.communicate(timeout=WAIT_S)
    assert sweep.returncode == 1, err[-3000:]
    runs = {r.data.params["max_steps"]: r for r in sweep_runs(tmp_path)[1]}
    assert runs["3"].info.status == "FINISHED"
    cancelled = runs["100000"]
    assert cancelled.info.status == "KILLED"
    assert cancelled.data.tags["failure_reason"] == "cancelled"
    assert cancelled.data.tags["error"].startswith(f"SLURM cancelled job {job} (scancel")
    assert sweep_runs(tmp_path)[0].info.status == "FAILED"
    assert "Traceback" not in err


@pytest.mark.slow  # 4 tiny jobs, 2 at a time, one of them cancelled in SLURM's prolog (about a minute)
def test_a_job_cancelled_before_its_code_runs_is_killed_and_every_other_point_is_recorded(
    slurm_cluster, tmp_path
):
    """A job cancelled while SLURM holds it in its prolog (RUNNING to squeue, none of its code started) leaves
    no result for submitit to collect: its point is one KILLED run with reason `cancelled`, the 3 others
    FINISHED with their figures, and the sweep ends with its summary, no traceback, exit 1."""
    with slurm_cluster.held():
        sweep = start_sweep(tmp_path, "seed=0,1,2,3", *TINY, *ONE_CORE)
        job = wait_for(
            lambda: next((j for j in slurm_cluster.running() if j.endswith("_0")), None),
            "job 0 RUNNING",
            sweep=sweep,
        )
        slurm_cluster.command("scancel", job)
    out, err = sweep.communicate(timeout=WAIT_S)
    assert sweep.returncode == 1, err[-3000:]
    assert "Traceback" not in err and "UncompletedJobError" not in err, err[-3000:]
    assert "[sweep] 4 jobs: 3 finished, 1 failed" in out, out[-3000:]
    runs = runs_by_seed(tmp_path)
    assert sorted(runs) == ["0", "1", "2", "3"]
    cancelled = runs["0"]
    assert cancelled.info.status == "KILLED"
    assert cancelled.data.tags["failure_reason"] == "cancelled"
    assert cancelled.data.tags["error"].startswith(f"SLURM cancelled job {job} ")
    for seed in "123":
        assert runs[seed].info.status == "FINISHED" and "eval_f1" in runs[seed].data.metrics, seed
    assert sweep_runs(tmp_path)[0].info.status == "FAILED"
    assert (tmp_path / "report").is_dir()


def _job_of(tmp_path, max_steps: str) -> str | None:
    """The SLURM job id its runner tagged the run of the point with that max_steps (once it is open)."""
    if not (tmp_path / "mlflow.db").exists():
        return None
    runs = [r for r in sweep_runs(tmp_path)[1] if r.data.params.get("max_steps") == max_steps]
    return runs[0].data.tags.get("slurm_job_id") if runs else None


@pytest.mark.slow  # SLURM's shortest time limit is a minute, submitit's warning 30 s before it
def test_jobs_at_their_time_limit_are_failed_with_that_reason_and_the_sweep_ends(slurm_cluster, tmp_path):
    # submitit warns a job signal_delay_s before its limit; both points train past it
    limit = ["hydra.launcher.timeout_min=1", "hydra.launcher.signal_delay_s=30"]
    proc = run_cli(tmp_path, "-m", "seed=0,1", *LONG, *ONE_CORE, *limit, timeout=WAIT_S)
    assert proc.returncode == 1, proc.stderr[-3000:]
    parent, children = sweep_runs(tmp_path)
    assert parent.info.status == "FAILED" and len(children) == 2
    for run in children:
        assert run.info.status == "FAILED" and run.data.tags["failure_reason"] == "time_limit"
        assert run.data.tags["error"].startswith(
            "SLURM's time limit reached (hydra.launcher.timeout_min=1: raise it for this job)"
        )
        # submitit's warning stopped the job at the end of a step, checkpointed: the same command resumes it
        assert "stopped by SIGUSR2 at the end of step" in run.data.tags["error"], run.data.tags["error"]
        assert store(tmp_path).get_metric_history(run.info.run_id, "train_loss")
    assert len(list(tmp_path.glob("checkpoints/*/step-*"))) == 2
    assert "[sweep] 2 jobs: 0 finished, 2 failed" in proc.stdout
    assert "Traceback" not in proc.stderr
    # SLURM lists a job it stopped at its limit until the job's processes are gone (completing): on a loaded
    # machine, for seconds after the sweep has recorded it and ended (KillWait: 5 s)
    wait_for(lambda: slurm_cluster.queue() == [], "SLURM's queue empty after the time limit", timeout=30)


def test_a_time_limit_shorter_than_submitits_warning_is_one_line(slurm_cluster, tmp_path):
    proc = run_cli(tmp_path, "-m", "seed=0,1", *TINY, *ONE_CORE, "hydra.launcher.timeout_min=1")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "error: hydra.launcher.signal_delay_s=120 is invalid with hydra.launcher.timeout_min=1: submitit warns "
        "a job 120 s before its time limit, so every job would stop as timed out at once: set "
        "hydra.launcher.signal_delay_s below 60"
    ]


@pytest.mark.slow
@pytest.mark.cluster  # a job started twice (SLURM holds a requeued job back a while)
def test_a_requeued_job_resumes_from_its_checkpoint_and_records_its_point_once(slurm_cluster, tmp_path):
    sweep = start_sweep(
        tmp_path, "seed=0", *TINY, "train.max_steps=400", "train.checkpoint_every=20", *ONE_CORE
    )
    wait_for(training(tmp_path, 1), "the job process", sweep=sweep)
    job = wait_for(lambda: _job_of(tmp_path, "400"), "its SLURM id", sweep=sweep)
    # (training has begun, and the job listens for SIGTERM)
    wait_for(lambda: list(tmp_path.glob("checkpoints/*/step-*")), "its first checkpoint", sweep=sweep)
    slurm_cluster.command("scontrol", "requeue", job)
    out, err = sweep.communicate(timeout=WAIT_S)
    assert sweep.returncode == 0, err[-3000:]
    parent, children = sweep_runs(tmp_path)
    assert parent.info.status == "FINISHED"
    (run,) = children  # recorded once
    assert run.info.status == "FINISHED" and run.data.tags["slurm_restarts"] == "1"
    steps = [m.step for m in store(tmp_path).get_metric_history(run.info.run_id, "train_loss")]
    assert sorted(steps) == list(range(1, 401))  # each step's loss once: the restart resumed
    assert run.data.metrics["segments"] == 2 and run.data.tags["segments"].startswith("steps 1-")


@pytest.mark.slow
@pytest.mark.cluster  # 2 ranks on the 2-core node, then the same job under torchrun (~1.5 min)
def test_a_two_rank_job_as_two_slurm_tasks_gives_the_figures_of_torchrun(slurm_cluster, tmp_path):
    args = ["backend=accelerator", "launcher.nproc_per_job=2", *TINY]
    on_slurm = run_cli(tmp_path / "slurm", "-m", *args, *ONE_CORE, timeout=WAIT_S)
    assert on_slurm.returncode == 0, on_slurm.stderr[-3000:]
    local = run_cli(tmp_path / "torchrun", "-m", *args, timeout=WAIT_S)
    assert local.returncode == 0, local.stderr[-3000:]
    (a,), (b,) = sweep_runs(tmp_path / "slurm")[1], sweep_runs(tmp_path / "torchrun")[1]
    assert a.info.status == b.info.status == "FINISHED"
    assert a.data.params["world_size"] == "2" and a.data.metrics["params_in_sync"] == 1
    for key in ("optimizer_state_mb", "optimizer_state_mb_rank1", "model_num_params", "train_tokens"):
        assert a.data.metrics[key] == b.data.metrics[key], key
    assert a.data.metrics["eval_loss"] == pytest.approx(b.data.metrics["eval_loss"], rel=1e-5)
    losses = [
        [m.value for m in store(tmp_path / where).get_metric_history(r.info.run_id, "train_loss")]
        for where, r in (("slurm", a), ("torchrun", b))
    ]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_the_cluster_names_this_host_and_its_cores(slurm_cluster):
    assert slurm_cluster.node_state() == "idle"
    out = slurm_cluster.command("scontrol", "show", "node", slurm_cluster.host).stdout
    assert f"NodeName={slurm_cluster.host}" in out and "State=IDLE" in out
