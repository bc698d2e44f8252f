"""The jobs of a submitit launcher (SLURM, or submitit's local executor) that left no result, each the outcome
of its own point.

hydra-submitit-launcher collects its jobs' results in one list: the first job that left none (cancelled before
its own code ran, or killed with the runner that records it) raises submitit's error there, and the launching
process would stop with a traceback, no summary and no report, while the other jobs go on unrecorded. With
`collect_each()` in force (the sweep's callback sets it up for these launchers), such a job gives Hydra an empty
return and waits in LOST; the other jobs are collected as before; at the sweep's end `record_lost` records each
lost job's point from its job folder (pipeline.runner.record_left: a result the job process wrote is recorded
FINISHED; otherwise the run ends KILLED with reason `cancelled` where SLURM cancelled it, FAILED with the
scheduler's word otherwise), and the sweep ends with its summary and report.
"""

from __future__ import annotations

import sys
from pathlib import Path

LOST: list = []  # (submitit job, its error) of each job of this process's sweep that left no result


def collect_each() -> None:
    """submitit's Job.results, for this process: a job whose result cannot be had joins LOST and gives Hydra an
    empty return (the launcher reads one result per job), instead of raising out of the whole launch."""
    from hydra.core.utils import JobReturn, JobStatus
    from submitit.core import core

    if getattr(core.Job.results, "collects_each", False):
        return
    results = core.Job.results

    def collected(job):
        try:
            return results(job)
        except Exception as err:  # UncompletedJobError, FailedJobError: this job's outcome alone
            LOST.append((job, err))
            return [JobReturn(status=JobStatus.COMPLETED, _return_value=None)]

    collected.collects_each = True
    core.Job.results = collected


def failure_of(job, err: Exception, launcher: str):
    """A lost job's failure, from what its scheduler says of it."""
    from pipeline.runner import Failure, time_limit_text
    from pipeline.slurm import state_of

    state = (state_of(job.job_id) if launcher == "slurm" else "") or str(getattr(job, "state", "") or "")
    details = f"\n\nstate: {state or 'unknown'}\n{type(err).__name__}: {err}"
    if state.startswith("CANCELLED"):
        summary = f"SLURM cancelled job {job.job_id} (scancel, or the sweep was stopped) before its job ended"
        return Failure("cancelled", summary + details)
    if state.startswith("TIMEOUT"):
        return Failure("time_limit", time_limit_text(None, f"SLURM ended job {job.job_id}") + details)
    return Failure(
        "exception", f"{launcher} job {job.job_id} left no result ({state or 'state unknown'})" + details
    )


def record_lost(ids: dict) -> list[str]:
    """Record the point of each job in LOST into the sweep whose MLflow ids are `ids`, from its config composed
    as the job's own would have been (its submission holds the launcher, its overrides and its number); one line
    each. The summary lines (`job (reason: error)`) of those that could not be recorded."""
    left = []
    while LOST:
        job, err = LOST.pop(0)
        try:
            _record(job, err, ids)
        except Exception as error:  # the store went away, a folder that cannot be written: said, and counted
            line = f"{job.job_id} (exception: left no result, and recording that failed: {error})"
            print(f"[job] {line}", file=sys.stderr, flush=True)
            left.append(line)
    return left


def _record(job, err: Exception, ids: dict) -> None:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    from pipeline import runner

    submission = job.submission()
    launcher, (overrides, _, idx) = submission.function, submission.args[:3]
    job_config = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, list(overrides))
    with open_dict(job_config.hydra.job):
        job_config.hydra.job.id = str(job.job_id)
        job_config.hydra.job.num = idx
    hydra = HydraConfig.instance()
    saved = hydra.cfg
    hydra.set_config(job_config)  # what ${hydra:...} in the job's config resolves against
    try:
        job_dir = Path(str(job_config.hydra.sweep.dir)) / str(job_config.hydra.sweep.subdir)
        cfg = OmegaConf.masked_copy(job_config, [k for k in job_config if k != "hydra"])
        name = cfg.launcher.name
        failure = failure_of(job, err, name)
        tags = {"slurm_job_id": str(job.job_id)} if name == "slurm" else {}
        recorded = runner.record_left(cfg, ids, job_dir, list(overrides), failure, tags)
    finally:
        hydra.cfg = saved
    if recorded is not None:
        run_id, status = recorded
        what = "its result, FINISHED" if status == "FINISHED" else f"{status} ({failure.line})"
        print(f"[job] {runner.run_name(cfg)}: {name} job {job.job_id} left no result to collect: recorded {what} "
              f"as run {run_id}", flush=True)  # fmt: skip
