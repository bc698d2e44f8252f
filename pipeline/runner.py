"""One sweep point: validate, open its MLflow run, run `pipeline.job` in a fresh process, record the result.

A job that fails for any reason (bad value, exception, killed process) becomes a FAILED run with its error
text, and the sweep goes on; every run this module opens ends FINISHED, FAILED or KILLED.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from pipeline.config import ConfigError, validate
from pipeline.job import CONFIG_FILE, ERROR_FILE, FAILURE_FILE, RESULT_FILE

FAILED_JOBS: list[str] = []  # this process's failed jobs with their reason: the summary and the exit code
SKIPPED_JOBS: list[str] = []  # points that had FINISHED before (resume)


def run_name(cfg: DictConfig) -> str:
    what = f"fit{cfg.memory_budget_mb or 'device'}MB" if cfg.find_batch_size else f"bs{cfg.batch_size}"
    return f"{cfg.optim.name}-{cfg.model.name}-{cfg.data.name}-{cfg.backend.name}-{what}-s{cfg.seed}"


def job_params(cfg: DictConfig) -> dict:
    return {
        "optim": cfg.optim.name,
        "model": cfg.model.name,
        "data": cfg.data.name,
        "backend": cfg.backend.name,
        "batch_size": cfg.batch_size,
        "seed": cfg.seed,
        "lr": cfg.train.lr,
        "max_steps": cfg.train.max_steps,
        "max_length": cfg.train.max_length,
        "weight_decay": cfg.train.weight_decay,
        "pretrained": cfg.model.pretrained,
        "precision": cfg.train.precision,
        "padding": cfg.train.padding,
        "group_by_length": cfg.train.group_by_length,
        "memory_budget_mb": cfg.memory_budget_mb,
        "memory_track_steps": cfg.memory_track_steps,
        "find_batch_size": cfg.find_batch_size,
    }


@dataclass
class Failure:
    reason: str  # config | exception | nan_loss | oom | killed
    text: str  # a one-line summary, then details (the traceback)
    metrics: dict = field(default_factory=dict)  # figures at the time (e.g. memory at an out-of-memory)

    @property
    def summary(self) -> str:
        return self.text.strip().splitlines()[0]


def run_job_process(job_dir: Path, outputs_dir: Path) -> Failure | None:
    """Run the job in a fresh interpreter; None on success. An exception here (Ctrl-C) kills the job."""
    # torch.compile's cache (torchao optimizers compile their step) is shared by the jobs of all sweeps
    env = {
        "TORCHINDUCTOR_CACHE_DIR": str(outputs_dir.resolve() / "cache" / "torchinductor"),
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
    }
    proc = subprocess.run([sys.executable, "-m", "pipeline.job", str(job_dir)], env=env)
    if proc.returncode == 0:
        return None
    if (job_dir / FAILURE_FILE).exists():
        info = json.loads((job_dir / FAILURE_FILE).read_text())
        return Failure(info["reason"], (job_dir / ERROR_FILE).read_text(), info["metrics"])
    if proc.returncode < 0:
        return Failure("killed", f"job process was killed by signal {signal.Signals(-proc.returncode).name}")
    return Failure("exception", f"job process exited with {proc.returncode} and no error report")


def config_hash(cfg: DictConfig) -> str:
    """What makes two jobs the same point: the resolved config, less where results go and `force`."""
    point = OmegaConf.to_container(cfg, resolve=True)
    for key in ("outputs_dir", "tracking", "force"):
        point.pop(key, None)
    return hashlib.sha256(json.dumps(point, sort_keys=True).encode()).hexdigest()[:16]


def run(cfg: DictConfig) -> float | None:
    """Hydra task function. Returns eval F1 (for sweepers that optimise), None when the job failed."""
    from pipeline.tracking import Tracker, sweep_ids

    hydra_cfg = HydraConfig.get()
    job_dir = Path(hydra_cfg.runtime.output_dir)
    sweep = sweep_ids(Path(hydra_cfg.sweep.dir)) if hydra_cfg.mode == RunMode.MULTIRUN else None
    tracker = Tracker(cfg)
    experiment_id = sweep["experiment_id"] if sweep else tracker.experiment_id()
    name, point = run_name(cfg), config_hash(cfg)
    if not cfg.force:
        done = tracker.finished_run(experiment_id, point)
        if done is not None:
            print(f"[job] {name}: skipped, FINISHED before as run {done.info.run_id} (force=true reruns it)")
            SKIPPED_JOBS.append(name)
            return done.data.metrics.get("eval_f1")
    run_id = tracker.start_run(
        experiment_id,
        name,
        parent_run_id=sweep and sweep["parent_run_id"],
        tags={
            "job_dir": str(job_dir.resolve()),
            "overrides": " ".join(hydra_cfg.overrides.task),
            "config_hash": point,
        },
    )
    print(f"[job] {name}: MLflow run {run_id}", flush=True)
    try:
        failure = None
        try:
            validate(cfg)
        except ConfigError as err:
            failure = Failure("config", f"ConfigError: {err}")
        tracker.log(run_id, params=job_params(cfg))
        OmegaConf.save(cfg, job_dir / CONFIG_FILE, resolve=True)
        tracker.log_artifact(run_id, job_dir / CONFIG_FILE)
        if failure is None:
            failure = run_job_process(job_dir, Path(cfg.outputs_dir))
        if failure is None:
            result = json.loads((job_dir / RESULT_FILE).read_text())
            tracker.log(run_id, result["metrics"], result["series"], result["params"], result["tags"])
            tracker.end(run_id, "FINISHED")
            return result["metrics"].get("eval_f1")
        tracker.log(
            run_id, failure.metrics, tags={"error": failure.summary, "failure_reason": failure.reason}
        )
        (job_dir / ERROR_FILE).write_text(failure.text)
        tracker.log_artifact(run_id, job_dir / ERROR_FILE)
        tracker.end(run_id, "FAILED")
        FAILED_JOBS.append(f"{name} ({failure.reason}: {failure.summary})")
        print(f"[job] {name} FAILED ({failure.reason}): {failure.summary}", file=sys.stderr, flush=True)
        return None
    except BaseException as err:  # Ctrl-C / SIGTERM (the job process is already killed), or a store failure
        status = "KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED"
        tracker.end(run_id, status)
        if sweep:
            tracker.end(sweep["parent_run_id"], status)
        raise
