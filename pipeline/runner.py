"""One sweep point: validate, open its MLflow run, run `pipeline.job` in a fresh process, record the result.

A job that fails for any reason (bad value, exception, killed process) becomes a FAILED run with its error
text, and the sweep goes on; every run this module opens ends FINISHED, FAILED or KILLED.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from pipeline.config import ConfigError, validate
from pipeline.job import CONFIG_FILE, ERROR_FILE, RESULT_FILE

FAILED_JOBS: list[str] = []  # names of this process's failed jobs, for the exit code


def run_name(cfg: DictConfig) -> str:
    return (
        f"{cfg.optim.name}-{cfg.model.name}-{cfg.data.name}-{cfg.backend.name}-bs{cfg.batch_size}-s{cfg.seed}"
    )


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
    }


def run_job_process(job_dir: Path, outputs_dir: Path) -> str | None:
    """Run the job in a fresh interpreter; None on success, else the error text."""
    # torch.compile's cache (torchao optimizers compile their step) is shared by the jobs of all sweeps
    env = {
        "TORCHINDUCTOR_CACHE_DIR": str(outputs_dir.resolve() / "cache" / "torchinductor"),
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
    }
    proc = subprocess.run([sys.executable, "-m", "pipeline.job", str(job_dir)], env=env)
    if proc.returncode == 0:
        return None
    error_file = job_dir / ERROR_FILE
    if error_file.exists():
        return error_file.read_text()
    how = (
        f"was killed by signal {-proc.returncode}"
        if proc.returncode < 0
        else f"exited with {proc.returncode}"
    )
    return f"job process {how}"


def run(cfg: DictConfig) -> float | None:
    """Hydra task function. Returns eval F1 (for sweepers that optimise), None when the job failed."""
    from pipeline.tracking import Tracker, sweep_ids

    hydra_cfg = HydraConfig.get()
    job_dir = Path(hydra_cfg.runtime.output_dir)
    sweep = sweep_ids(Path(hydra_cfg.sweep.dir)) if hydra_cfg.mode == RunMode.MULTIRUN else None
    tracker = Tracker(cfg)
    experiment_id = sweep["experiment_id"] if sweep else tracker.experiment_id()
    name = run_name(cfg)
    run_id = tracker.start_run(
        experiment_id,
        name,
        parent_run_id=sweep and sweep["parent_run_id"],
        tags={"job_dir": str(job_dir.resolve()), "overrides": " ".join(hydra_cfg.overrides.task)},
    )
    print(f"[job] {name}: MLflow run {run_id}", flush=True)
    try:
        error = None
        try:
            validate(cfg)
        except ConfigError as err:
            error = f"ConfigError: {err}"
        tracker.log(run_id, params=job_params(cfg))
        OmegaConf.save(cfg, job_dir / CONFIG_FILE, resolve=True)
        tracker.log_artifact(run_id, job_dir / CONFIG_FILE)
        if error is None:
            error = run_job_process(job_dir, Path(cfg.outputs_dir))
        if error is None:
            result = json.loads((job_dir / RESULT_FILE).read_text())
            tracker.log(run_id, result["metrics"], result["series"], result["params"], result["tags"])
            tracker.end(run_id, "FINISHED")
            return result["metrics"]["eval_f1"]
        summary = error.strip().splitlines()[0]
        tracker.log(run_id, tags={"error": summary})
        tracker.log_artifact(run_id, _write(job_dir / ERROR_FILE, error))
        tracker.end(run_id, "FAILED")
        FAILED_JOBS.append(name)
        print(f"[job] {name} FAILED: {summary}", file=sys.stderr, flush=True)
        return None
    except BaseException:
        tracker.end(run_id, "KILLED" if sys.exc_info()[0] is KeyboardInterrupt else "FAILED")
        if sweep:
            tracker.end(sweep["parent_run_id"], "KILLED")
        raise


def _write(path: Path, text: str) -> Path:
    if not path.exists():
        path.write_text(text)
    return path
