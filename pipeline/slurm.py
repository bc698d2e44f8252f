"""SLURM as a sweep meets it, around hydra-submitit-launcher (which submits the jobs):

- what the preset asks for: GPUs only on a partition that has them, no more cores per task than its nodes have
  (the resolvers `slurm_gpus` and `slurm_cpus` in conf/launcher/slurm.yaml, read from `sinfo`);
- a request sbatch refuses, found before anything is submitted (`sbatch --test-only` of the array submitit
  would submit): one line naming sbatch's reason and the key to set;
- submitit's "Bypassing sacct error" warnings, printed on every status poll where SLURM's accounting is off,
  kept off a quiet console (shown with log_level=info);
- inside a job: its SLURM ids (tags of its run), and how SLURM ended it when the job process was stopped
  (cancelled, requeued, its time limit);
- whether squeue still lists a run's job (pipeline.liveness).

It imports nothing of ours.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import tempfile

from omegaconf import OmegaConf

SACCT_NOISE = "Bypassing sacct error"
# sbatch's reasons -> the key that sets what it refused
KEYS = {
    "generic resource": "hydra.launcher.gpus_per_node (0 on a partition without GPUs)",
    "node configuration is not available": "hydra.launcher.cpus_per_task, tasks_per_node or mem_gb",
    "partition": "hydra.launcher.partition",
    "time limit": "hydra.launcher.timeout_min",
    "account": "hydra.launcher.account",
    "qos": "hydra.launcher.qos",
}


def _sinfo() -> list[tuple[str, int, str]] | None:
    """(partition, CPUs of a node, generic resources) per line of `sinfo`; None where SLURM cannot be
    asked (no sinfo, no controller)."""
    if shutil.which("sinfo") is None:
        return None
    try:
        done = subprocess.run(
            ["sinfo", "-h", "-o", "%P|%c|%G"], capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    rows = []
    for line in done.stdout.splitlines():
        name, cpus, gres = line.split("|", 2)
        rows.append((name, int(re.sub(r"\D", "", cpus) or 0), gres))
    return rows


def _partition_rows(partition: str | None) -> list[tuple[int, str]] | None:
    """(CPUs, gres) of the nodes of `partition` (None: the default one, marked `*` by sinfo)."""
    rows = _sinfo()
    if rows is None:
        return None
    if partition in (None, "", "None", "null"):
        return [(c, g) for p, c, g in rows if p.endswith("*")] or None
    return [(c, g) for p, c, g in rows if p.rstrip("*") == partition] or None


def gpus_per_node(nproc, partition=None) -> int:
    """One GPU per rank where the partition has GPUs (or SLURM cannot be asked), else none."""
    rows = _partition_rows(partition)
    if rows is not None and not any("gpu" in gres for _, gres in rows):
        return 0
    return int(nproc)


def cpus_per_task(want, nproc, partition=None) -> int:
    """`want` cores per task, at most what a node of the partition has for each of its nproc tasks."""
    rows = _partition_rows(partition)
    if rows is None:
        return int(want)
    return max(1, min(int(want), min(c for c, _ in rows) // int(nproc)))


OmegaConf.register_new_resolver("slurm_gpus", gpus_per_node, replace=True)
OmegaConf.register_new_resolver("slurm_cpus", cpus_per_task, replace=True)


# ---- before submitting ---------------------------------------------------------------------------------


def refusal(params: dict, jobs: int) -> str | None:
    """Why sbatch would refuse the array submitit is about to submit with the launcher's params (as the
    launcher hands them to submitit), as one line naming the key to set; None when it would take it."""
    import submitit
    from submitit.slurm.slurm import _make_sbatch_string

    init = {"slurm_max_num_timeout": params["max_num_timeout"]} if "max_num_timeout" in params else {}
    with tempfile.TemporaryDirectory() as folder:
        executor = submitit.AutoExecutor(cluster="slurm", folder=folder, **init)
        from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

        base = set(OmegaConf.structured(BaseQueueConf).keys())
        skip = {"submitit_folder", "max_num_timeout"}
        executor.update_parameters(
            **{k if k in base else f"slurm_{k}": v for k, v in params.items() if k not in skip}
        )
        text = _make_sbatch_string(
            command="true", folder=folder, map_count=jobs, **executor._executor.parameters
        )
        script = os.path.join(folder, "test.sh")
        with open(script, "w") as file:
            file.write(text)
        try:
            done = subprocess.run(
                ["sbatch", "--test-only", script], capture_output=True, text=True, timeout=60
            )
        except (OSError, subprocess.SubprocessError) as err:
            return f"sbatch could not be run ({err})"
    if done.returncode == 0:
        return None
    lines = [ln.strip() for ln in done.stderr.splitlines() if ln.strip()]
    reason = next((ln for ln in lines if "error" in ln.lower()), lines[-1] if lines else "no reason given")
    reason = re.sub(r"^sbatch: error: ", "", reason)
    key = next((k for text, k in KEYS.items() if text in reason.lower()), "hydra.launcher.<key>")
    return f"sbatch refuses the sweep's jobs: {reason}: set {key} (docs/scaling.md)"


class _DropSacct(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return SACCT_NOISE not in str(record.msg)


def quiet_sacct() -> None:
    """submitit's sacct warnings off the console: where accounting is off, every status poll of submitit's
    job watcher logs one warning, and sacct itself writes "Slurm accounting storage is disabled" to the
    launching process's stderr. The warning is filtered at submitit's logger; sacct's own stderr goes to that
    warning's text (a watcher that captures it, in place of submitit's shared one)."""
    from submitit.slurm import slurm as submitit_slurm

    logger = logging.getLogger("submitit")
    if not any(isinstance(f, _DropSacct) for f in logger.filters):
        logger.addFilter(_DropSacct())
    if type(submitit_slurm.SlurmJob.watcher).__name__ != "CapturingWatcher":
        submitit_slurm.SlurmJob.watcher = _capturing_watcher()(delay_s=600)


def _capturing_watcher():
    """submitit's SLURM job watcher, its sacct call's stderr captured (submitit's own update otherwise)."""
    import time

    from submitit.core import logger
    from submitit.slurm.slurm import SlurmInfoWatcher

    class CapturingWatcher(SlurmInfoWatcher):
        def update(self) -> None:
            command = self._make_command()
            if command is None:
                return
            self._num_calls += 1
            done = subprocess.run(command, capture_output=True)
            if done.returncode != 0:
                text = done.stderr.decode(errors="replace").strip() or f"exit status {done.returncode}"
                logger.get_logger().warning(
                    f"Call #{self.num_calls} - {SACCT_NOISE} {text}, status may be inaccurate."
                )
                self._info_dict.update(self._from_squeue())
            else:
                self._output = done.stdout
                self._info_dict.update(self.read_info(self._output))
            self._last_status_check = time.time()
            for job_id in self._registered - self._finished:
                if self.is_done(job_id, mode="cache"):
                    self._finished.add(job_id)

        def _from_squeue(self) -> dict:
            """Without accounting: the jobs squeue still lists, with its state; a registered job it no
            longer lists has ended (COMPLETED: its result file says how, and a job that left none is an
            error of submitit's instead of a wait that never ends)."""
            try:
                done = subprocess.run(
                    ["squeue", "-h", "-r", "-o", "%i|%T"],
                    capture_output=True,
                    text=True,
                    timeout=30,
                    check=True,
                )
            except (OSError, subprocess.SubprocessError):
                return {}
            listed = dict(line.split("|", 1) for line in done.stdout.split())
            return {
                job: {"JobID": job, "State": listed.get(job, "COMPLETED")}
                for job in self._registered - self._finished
            }

    return CapturingWatcher


def signal_delay_error(params: dict) -> str | None:
    """submitit's warning signal (SIGUSR2, signal_delay_s before the time limit) must come after the start:
    with a time limit shorter than the delay, every job is stopped as timed out the moment it starts."""
    delay, minutes = params.get("signal_delay_s"), params.get("timeout_min")
    if delay is None or minutes is None or delay < minutes * 60:
        return None
    return (
        f"hydra.launcher.signal_delay_s={delay} is invalid with hydra.launcher.timeout_min={minutes}: submitit "
        f"warns a job {delay} s before its time limit, so every job would stop as timed out at once: set "
        f"hydra.launcher.signal_delay_s below {minutes * 60}"
    )


# ---- inside a job --------------------------------------------------------------------------------------


def job_tags() -> dict[str, str]:
    """The SLURM ids of the job this process runs in (empty outside SLURM)."""
    env = os.environ
    if "SLURM_JOB_ID" not in env:
        return {}
    array = env.get("SLURM_ARRAY_JOB_ID")
    task = env.get("SLURM_ARRAY_TASK_ID")
    return {
        "slurm_job_id": f"{array}_{task}" if array and task else env["SLURM_JOB_ID"],
        **({"slurm_array_job_id": array, "slurm_array_task_id": task} if array and task else {}),
        "slurm_node": env.get("SLURMD_NODENAME") or env.get("SLURM_NODELIST", ""),
    }


def listed(jobs: list[str]) -> set[str] | None:
    """Those of the SLURM jobs `jobs` (`12`, an array task `12_3`) that squeue still lists (pending, running,
    completing); None where SLURM cannot be asked (no squeue, no controller)."""
    try:
        done = subprocess.run(
            ["squeue", "-h", "-r", "-o", "%i", "-j", ",".join(jobs)],
            capture_output=True,
            text=True,
            timeout=10,  # a controller that answers takes well under a second
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode == 0:
        return set(done.stdout.split()) & set(jobs)
    # asked for one job it no longer holds, squeue answers with an error
    return set() if "Invalid job id" in done.stderr else None


def restarts() -> int:
    """How many times SLURM has requeued this job (0 on its first start)."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)


def _show_job(job: str) -> str:
    """`scontrol show job JOB` (SLURM keeps an ended job there for MinJobAge, 300 s by default), '' if unknown."""
    try:
        done = subprocess.run(
            ["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout


def state_of(job: str) -> str:
    """SLURM's state of job JOB (`12` or an array task `12_3`): CANCELLED, TIMEOUT, COMPLETED ..., '' if
    unknown (accounting need not be on)."""
    found = re.search(r"JobState=(\S+)", _show_job(job))
    return found.group(1) if found else ""


def job_state() -> str:
    """SLURM's state of this job now (CANCELLED, REQUEUED, TIMEOUT, RUNNING, COMPLETING...), '' if unknown."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return ""
    shown = _show_job(job)
    found = re.search(r"JobState=(\S+)", shown)
    state = found.group(1) if found else ""
    restarted = re.search(r"Restarts=(\d+)", shown)
    if restarted and int(restarted.group(1)) > restarts():  # requeued while this process ran
        return "REQUEUED"
    return state
