"""The real CLI with stopwatches around its phases (the pipeline's code runs unchanged).

    python -m bench.probe cli OUT_JSON [pipeline overrides ...]   # as `python -m pipeline ...`
    python -m bench.probe job JOB_DIR                              # as `python -m pipeline.job JOB_DIR`

`cli` wraps every Tracker method (MLflow), notes when the job process starts and ends, swaps the job's command
for `bench.probe job` (a cold start) and the module a warm job process runs for this one (`main`), then runs `pipeline.__main__` as
`python -m pipeline` would, and writes its phase times (seconds) to OUT_JSON. `main` times the job's imports
(none left to make in a warm job process: the starter made them) and each loading step, then runs
`pipeline.job.main`; its phases go to JOB_DIR/bench_phases.json. A wrapper costs about a microsecond per call: nothing measurable next to a job.
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import sys
import time
from collections import defaultdict
from pathlib import Path

START = time.perf_counter()
PHASES: dict[str, float] = defaultdict(float)  # phase name -> seconds
JOB_PHASES_FILE = "bench_phases.json"


def timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            PHASES[name] += time.perf_counter() - start
            if name.startswith("mlflow.") and "cli.job_end_at" in PHASES:  # recording the job's result
                PHASES["cli.mlflow_after_job"] += time.perf_counter() - start

    return wrapper


def patch(owner, attr: str, name: str) -> None:
    setattr(owner, attr, timed(name, getattr(owner, attr)))


def cli(out: Path, overrides: list[str]) -> None:
    from pipeline import starter

    starter.prestart_from_command(overrides)  # where `python -m pipeline` does: before the imports below
    from pipeline import placement, runner, tracking

    for method in ("__init__", "experiment_id", "finished_run", "start_run", "log", "log_artifact", "end"):
        patch(tracking.Tracker, method, f"mlflow.{method}")
    real_run, real_command = runner.run, placement.job_command

    def run(*args):
        PHASES["cli.until_runner"] = time.perf_counter() - START  # interpreter, imports, Hydra compose
        return real_run(*args)

    def probed_command(*args):
        cmd = real_command(*args)
        at = cmd.index("pipeline.job")
        cmd[at : at + 1] = ["bench.probe", "job"]  # [python, -m, bench.probe, job, JOB_DIR]
        return cmd

    runner.run = run
    placement.job_command = probed_command
    starter.JOB_MODULE = "bench.probe"  # a warm job process runs main() below
    real_init, real_wait = starter.Job.__init__, starter.Job.wait

    def init(*args):  # the job's start and end, on the CLI's clock (MLflow's opening may run in between)
        PHASES["cli.job_start_at"] = time.perf_counter() - START
        real_init(*args)

    def wait(self):
        try:
            return real_wait(self)
        finally:
            PHASES["cli.job_end_at"] = time.perf_counter() - START

    starter.Job.__init__, starter.Job.wait = init, wait
    sys.argv = ["pipeline", *overrides]
    try:
        runpy.run_module("pipeline", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        code = exit_.code or 0
    PHASES["cli.total"] = time.perf_counter() - START
    out.write_text(json.dumps({"exit_code": code, **PHASES}, indent=1))
    sys.exit(code)


def main(job_dir: Path) -> int:
    """`pipeline.job.main` with stopwatches; its exit code."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    step_ends = []
    register_optimizer_step_post_hook(lambda *_: step_ends.append(time.perf_counter()))
    start = time.perf_counter()
    import accelerate  # noqa: F401  the job's heavy imports, in the order pipeline.job.run makes them
    import datasets  # noqa: F401
    import transformers  # noqa: F401

    from pipeline import backends, cache, job, models, state, timing

    PHASES["job.imports"] = time.perf_counter() - start
    patch(models, "load_tokenizer", "job.load_tokenizer")
    patch(models, "load_model", "job.load_model")
    # the splits: read back from the cache, or read, sampled, tokenized and kept
    patch(cache, "cached_dataset", "job.load_data")
    # (where the train stage reads them after training)
    patch(state, "optimizer_state_size", "job.state_size")
    patch(timing, "peak_flops", "job.peak_flops")
    real_get = backends.get

    def get(name):  # the job imports only its own backend: its import counts with the imports
        module = timed("job.imports", real_get)(name)
        if not hasattr(module.train, "__wrapped__"):
            patch(module, "train", "job.backend_train")
        return module

    backends.get = get
    code = job.main(job_dir)
    PHASES["job.threads"] = torch.get_num_threads()
    if step_ends:
        PHASES["job.first_step_end"] = step_ends[0] - START
        PHASES["job.last_step_end"] = step_ends[-1] - START
    PHASES["job.total"] = time.perf_counter() - START
    (job_dir / JOB_PHASES_FILE).write_text(json.dumps(PHASES, indent=1))
    return code


def job(job_dir: Path) -> None:
    """A cold job process: main(), then the end `python -m pipeline.job` has."""
    code = main(job_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    mode, target, *rest = sys.argv[1:]
    cli(Path(target), rest) if mode == "cli" else job(Path(target))
