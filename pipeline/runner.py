"""One sweep point: validate, open its MLflow run, run `pipeline.job` in a fresh process, record the result.

A job that fails for any reason (bad value, exception, killed process) becomes a FAILED run with its error
text, and the sweep goes on; every run this module opens ends FINISHED, FAILED or KILLED, or, when the store
does not answer as the job ends, waits in the job folder's journal entry to be recorded (pipeline.journal).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import signal
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from pipeline import adapters, learning_rate, liveness, reference_lr
from pipeline.config import ConfigError, validate
from pipeline.data import eval_sample
from pipeline.job import CONFIG_FILE, ERROR_FILE, FAILURE_FILE, RESULT_FILE
from pipeline.optimizers import ADDED_SETTINGS

SKIPPED_FILE = "skipped.txt"  # in a job folder: the point had FINISHED before (holds that run's id)


def method_suffix(cfg: DictConfig) -> str:
    """A PEFT run's method in its name, after the optimizer (`adamw-lora-r16-...`, `adamw-qlora-r16-nf4-...`);
    nothing for full fine-tuning."""
    if adapters.name(cfg) == "none":
        return ""
    return "-" + adapters.method(cfg).replace(" ", "-").replace("=", "")


def run_name(cfg: DictConfig) -> str:
    budget = cfg.memory_budget_mb
    what = f"bs{cfg.batch_size}" if not cfg.find_batch_size else f"fit{budget}MB" if budget else "fit-device"
    if cfg.get("plan"):
        what = f"plan-bs{cfg.batch_size}" + (f"-{cfg.device_memory}" if cfg.device_memory else "")
    optim = cfg.optim.name + method_suffix(cfg)
    data = "" if cfg.get("plan") else f"-{cfg.data.name}"  # a plan reads no data
    name = f"{optim}-{cfg.model.name}{data}-{cfg.backend.name}-{what}-s{cfg.seed}"
    nproc = cfg.launcher.get("nproc_per_job", 1)
    if nproc != 1:  # a multi-process job: its ranks and sharding
        name += f"-x{nproc}" + (
            "" if cfg.train.get("sharding", "none") == "none" else f"-{cfg.train.sharding}"
        )
    return name


def selection_metric(cfg: DictConfig) -> str:
    """The metric a point is selected by, on the validation split: `eval.metric` (higher is better); a
    language model's (task=causal_lm) loss (lower is better)."""
    return "val_loss" if OmegaConf.select(cfg, "task.name") == "causal_lm" else f"val_{cfg.eval.metric}"


def job_params(cfg: DictConfig) -> dict:
    return {
        "optim": cfg.optim.name,
        "model": cfg.model.name,
        "task": cfg.task.name,
        "method": adapters.method(cfg),  # full, lora r=16, qlora r=16 nf4
        **peft_params(cfg),
        "data": cfg.data.name,
        "backend": cfg.backend.name,
        "batch_size": cfg.batch_size,
        "seed": cfg.seed,
        "lr": learning_rate(cfg),
        "lr_scale": cfg.train.lr_scale,
        # the job's reference rate (conf/optim/<name>.yaml `lr`; a language model with random weights: that x
        # task.random_weights_lr_scale), and whether this job ran at the optimizer's where a tuning sweep picked
        # it (`lr_tuned: true`): the report names the optimizers that did not
        "lr_reference": reference_lr(cfg.optim.lr, _root_=cfg),
        "lr_tuned": bool(cfg.optim.get("lr_tuned", False)) and learning_rate(cfg) == cfg.optim.lr,
        "max_steps": cfg.train.max_steps,
        # the most texts of each evaluation split evaluated on (eval.sample; None: all the data keeps)
        "eval_sample": eval_sample(cfg),
        "max_length": cfg.train.max_length,
        "weight_decay": cfg.train.weight_decay,
        "pretrained": cfg.model.pretrained,
        # a model of one's own: the config.json or folder it came from (`pretrained`: its weights loaded or random)
        **({"model_source": cfg.model.config} if cfg.model.get("config") is not None else {}),
        "precision": cfg.train.precision,
        "padding": cfg.train.padding,
        "group_by_length": cfg.train.group_by_length,
        "packing": cfg.train.packing,
        "gradient_checkpointing": cfg.train.gradient_checkpointing,
        "memory_budget_mb": cfg.memory_budget_mb,
        "memory_track_steps": cfg.memory_track_steps,
        "find_batch_size": cfg.find_batch_size,
        "plan": cfg.plan,
        "device_memory": cfg.device_memory,
        "world_size": cfg.launcher.nproc_per_job,
        "sharding": cfg.train.sharding,
        # a custom optimizer's class (module.Class), beside the name its runs carry
        **({"optim_target": cfg.optim.target} if cfg.optim.get("target") else {}),
    }


def peft_params(cfg: DictConfig) -> dict:
    """A PEFT run's settings as params (`peft_r`, `peft_alpha`, ...; its resolved targets come from the job);
    none for full fine-tuning."""
    used = adapters.used(OmegaConf.to_container(cfg.peft)) if "peft" in cfg else {}
    return {f"peft_{k}": v for k, v in used.items() if k not in ("name", "target_modules")}


@dataclass
class Outcome:
    """What one point came to, for the sweep's summary and for Hydra: `score` is what the task function returns
    (what a Hydra sweeper optimises), the validation split's `val_<eval.metric>`: never the held-out test."""

    name: str
    status: (
        str  # FINISHED | FAILED | SKIPPED | UNRECORDED (trained, waiting to be recorded: pipeline.journal)
    )
    score: float | None = None
    reason: str = ""  # `reason: one-line error` of a failure


@dataclass
class Failure:
    reason: str  # config | exception | nan_loss | oom | killed | preempted
    text: str  # a one-line summary, then details (the traceback)
    metrics: dict = field(default_factory=dict)  # figures at the time (e.g. memory at an out-of-memory)
    series: dict | None = None  # a stopped job's: its steps' losses so far
    stop: BaseException | None = None  # the signal that stopped the job: the sweep stops once it is recorded

    @property
    def summary(self) -> str:
        return self.text.strip().splitlines()[0]

    @property
    def line(self) -> str:
        """`reason: one-line error`, as the sweep's summary prints it."""
        return f"{self.reason}: {self.summary}"


def job_env(cfg: DictConfig, ranks: dict) -> dict[str, str]:
    """The environment of a job's process(es), less its GPUs (the sweep's pool hands them out per job)."""
    from pipeline import cache, checkpoint, placement, quiet, starter

    # torch.compile's cache (torchao optimizers compile their step) is shared by the jobs of all sweeps; what
    # the environment sets wins
    env = {
        "TORCHINDUCTOR_CACHE_DIR": str(cache.folder(cfg.outputs_dir, "torchinductor")),
        **starter.base_env(quiet.log_level(cfg)),
        **ranks,
        checkpoint.ENV: str(checkpoints_dir(cfg)),
    }
    n_jobs, nproc = cfg.launcher.n_jobs, cfg.launcher.nproc_per_job
    if n_jobs > 1 or nproc > 1:  # jobs side by side split the cores instead of fighting over them
        env["OMP_NUM_THREADS"] = str(placement.cpu_threads(n_jobs, nproc))
    return env


def starts_warm(cfg: DictConfig, ranks: dict) -> bool:
    """A job forked from the warm starter (pipeline.starter): one process, started by this process."""
    return (
        OmegaConf.select(cfg, "launcher.start_jobs", default="cold") == "warm"
        and cfg.launcher.nproc_per_job == 1
        and not ranks
        and not cfg.get("plan")
    )


def prestart(cfg: DictConfig) -> None:
    """Start this process's warm starter now, if its jobs will start warm and the command expects to run one
    (pipeline.starter.ahead)."""
    from pipeline import starter

    ranks = scheduler_ranks(cfg)
    if starts_warm(cfg, ranks):
        with contextlib.suppress(ValueError):  # a bad log_level: the job's own start says it
            starter.ahead(job_env(cfg, ranks))


@contextlib.contextmanager
def job_process(cfg: DictConfig, job_dir: Path, pool_dir: Path, ranks: dict):
    """Start the job in fresh process(es) (its GPUs taken from the pool at `pool_dir`); yields a function that
    waits for their end: (None on success, else its failure; how it started: `warm` or `cold`,
    pipeline.starter). A job still running as the block is left (Ctrl-C, or its point found done meanwhile)
    is killed."""
    from pipeline import placement, starter

    try:
        env = job_env(cfg, ranks)  # the job's console (pipeline.quiet)
    except ValueError as err:  # a bad value: this point fails, the sweep goes on
        failure = Failure("config", f"ConfigError: {err}")
        yield lambda: (failure, "cold")
        return
    nproc = cfg.launcher.nproc_per_job
    command = placement.job_command(job_dir, nproc, bool(ranks))
    gpus = [] if cfg.launcher.name in placement.SCHEDULED else placement.visible_gpus()
    if gpus and nproc > len(gpus):  # a bad value for this machine: this point fails, the sweep goes on
        yield lambda: (Failure("config", f"ConfigError: {placement.too_few_gpus(nproc, gpus)}"), "cold")
        return
    with placement.GpuPool(pool_dir, gpus).take(nproc) if gpus else contextlib.nullcontext() as devices:
        if devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
            print(f"[job] {job_dir.name}: GPU {env['CUDA_VISIBLE_DEVICES']}", flush=True)
        job = starter.Job(job_dir, env, command, starts_warm(cfg, ranks))
        try:
            yield functools.partial(job_outcome, cfg, job_dir, job)
        finally:
            job.kill()


def job_outcome(cfg: DictConfig, job_dir: Path, job) -> tuple[Failure | None, str]:
    """Wait for a job's end (a pipeline.starter.Job): (None on success, else its failure; how it started)."""

    def stopped() -> Failure | None:  # a job asked to stop (starter.Job.kill) that stopped at a step's end
        failure = exit_failure(job_dir, job.status) if job.status is not None else None
        return failure if failure is not None and failure.reason == "preempted" else None

    try:
        returncode = job.wait()
    except KeyboardInterrupt as err:  # SIGTERM
        if (failure := stopped()) is None:
            raise
        failure.stop = err
        return failure, job.how
    except Exception as err:  # submitit's time-limit signal handler raised here (the job was asked to stop)
        if type(err).__name__ != "UncompletedJobError":
            raise
        text = time_limit_text(cfg, str(err))
        if (failure := stopped()) is not None:  # at the end of a step, checkpointed
            return Failure("time_limit", f"{text}; {failure.text}", failure.metrics, failure.series), job.how
        return Failure("time_limit", text), job.how
    if cfg.launcher.name == "slurm" and returncode == -signal.SIGTERM:
        return slurm_stop(cfg), job.how
    return exit_failure(job_dir, returncode), job.how


def run_job_process(
    cfg: DictConfig, job_dir: Path, pool_dir: Path, ranks: dict
) -> tuple[Failure | None, str]:
    """Run the job in fresh process(es) to their end: (None on success, else its failure; how it started). An
    exception here (Ctrl-C) kills the job."""
    with job_process(cfg, job_dir, pool_dir, ranks) as outcome:
        return outcome()


def time_limit_text(cfg: DictConfig, detail: str) -> str:
    minutes = HydraConfig.get().launcher.get("timeout_min") if HydraConfig.initialized() else None
    limit = f"hydra.launcher.timeout_min={minutes}" if minutes is not None else "hydra.launcher.timeout_min"
    return f"SLURM's time limit reached ({limit}: raise it for this job): {detail}"


def slurm_stop(cfg: DictConfig) -> Failure:
    """SLURM stopped the job process (SIGTERM to the whole job): why, from SLURM. A requeued job waits for
    SLURM to end this attempt, its run left open for the next one (which records the point once)."""
    from pipeline import slurm

    state = slurm.job_state()
    job = slurm.job_tags().get("slurm_job_id", "?")
    if state == "REQUEUED" or state.startswith("REQUEUE"):
        print(f"[job] SLURM requeued job {job}: its next start trains this point again", flush=True)
        while True:  # SLURM kills this attempt (KillWait); nothing is recorded for it
            signal.pause()
    if state == "TIMEOUT":
        return Failure("time_limit", time_limit_text(cfg, f"SLURM ended job {job} at its time limit"))
    return Failure("cancelled", f"SLURM cancelled job {job} (scancel, or the sweep was stopped)")


def exit_failure(job_dir: Path, returncode: int) -> Failure | None:
    """What a job process's exit status and its folder say: None when it finished."""
    if returncode == 0:
        return None
    if (job_dir / FAILURE_FILE).exists():
        info = json.loads((job_dir / FAILURE_FILE).read_text())
        return Failure(
            info["reason"], (job_dir / ERROR_FILE).read_text(), info["metrics"], info.get("series")
        )
    if returncode < 0:
        return Failure("killed", f"job process was killed by signal {signal.Signals(-returncode).name}")
    return Failure("exception", f"job process exited with {returncode} and no error report")


def plan_text(cfg: DictConfig, result: dict) -> str:
    """A single plan's table and verdict, as a sweep's report prints them (pipeline.report.verdict)."""
    import pandas as pd

    from pipeline.plan_job import logits_line
    from pipeline.report.tables import plan_table
    from pipeline.report.verdict import plan_console

    params = {k: str(v) for k, v in {**job_params(cfg), **result["params"]}.items() if v is not None}
    table = plan_table(pd.DataFrame([{**params, **result["metrics"], "status": "FINISHED"}]))
    logits = logits_line(result["metrics"])  # a language model's
    return plan_console(table) + ("" if logits is None else "\n" + logits)


def plan_in_process(cfg: DictConfig) -> tuple[Failure | None, dict | None]:
    """A plan job's record, made here: it loads no weights and trains nothing."""
    from pipeline import plan_job

    try:
        return None, plan_job.plan_result(cfg)
    except Exception as err:
        return Failure("exception", f"{type(err).__name__}: {err}\n\n{traceback.format_exc()}"), None


def config_hash(cfg: DictConfig) -> str:
    """What makes two jobs the same point: the resolved config, less where results go and `force`."""
    point = OmegaConf.to_container(cfg, resolve=True)
    # custom_optim: what it selects is in `optim` (name and target) at the points of optim=custom, and at the
    # other points it selects nothing
    for key in ("outputs_dir", "tracking", "force", "launcher", "log_level", "custom_optim"):
        point.pop(key, None)
    point["train"].pop("checkpoint_every", None)  # how often it is saved: not what it trains
    point["optim"].pop("lr_tuned", None)  # where the reference rate came from, not a setting
    # keys added later count only when set, so points recorded before them are still recognised
    if point["train"].get("sharding") == "none":
        del point["train"]["sharding"]
    if point["train"].get("gradient_checkpointing") is False:
        del point["train"]["gradient_checkpointing"]
    if point["train"].get("packing") is False:
        del point["train"]["packing"]
    if point.get("task", {}).get("name") == "classification":
        del point["task"]
    if point.get("peft", {}).get("name") == "none":
        del point["peft"]
    elif "peft" in point:  # the keys its method reads (lora has qlora's too, unused)
        point["peft"] = adapters.used(point["peft"])
    if point["model"].get("config", False) is None:  # a catalog model (model.config: one's own, its entry)
        del point["model"]["config"]
    for key, unset in (("plan", False), ("device_memory", None)):
        if point.get(key, unset) == unset:
            point.pop(key, None)
    for key, unset in ADDED_SETTINGS.get(point["optim"].get("name"), {}).items():
        if point["optim"].get(key, unset) == unset:
            point["optim"].pop(key, None)
    for group, key, unset in (
        ("train", "lr_scale", 1.0),
        ("eval", "every_steps", 0),
        ("eval", "collapse_share", 0.95),
        ("eval", "metric", "macro_f1"),
    ):
        if point[group].get(key, unset) == unset:
            point[group].pop(key, None)
    # eval.sample counts as what it comes to: a run that evaluates on all the data keeps is the point it was
    point["eval"].pop("sample", None)
    if eval_sample(cfg) is not None:
        point["eval"]["sample"] = eval_sample(cfg)
    # task.random_weights_lr_scale counts in train.lr, the rate it makes
    point.get("task", {}).pop("random_weights_lr_scale", None)
    # train.lr is the rate itself (resolved): a changed reference rate in conf/optim makes new points, and
    # runs from before the validation split (data.val_fraction) trained on more data: they are other points
    nproc = cfg.launcher.get("nproc_per_job", 1)
    if isinstance(nproc, int) and nproc > 1:  # the number of ranks changes the result (global batch)
        point["world_size"] = cfg.launcher.nproc_per_job
    return hashlib.sha256(json.dumps(point, sort_keys=True).encode()).hexdigest()[:16]


def scheduler_ranks(cfg: DictConfig) -> dict[str, str]:
    """torch.distributed variables when a scheduler (submitit) started this task as one rank of the job."""
    from pipeline import placement

    nproc = cfg.launcher.get("nproc_per_job", 1)
    if cfg.launcher.get("name") in placement.SCHEDULED and isinstance(nproc, int) and nproc > 1:
        return placement.submitit_ranks()
    return {}


def scheduler_tags(cfg: DictConfig) -> dict[str, str]:
    """A SLURM job's ids and node (tags of its run)."""
    if cfg.launcher.get("name") != "slurm":
        return {}
    from pipeline import slurm

    return {**slurm.job_tags(), **({"slurm_restarts": str(slurm.restarts())} if slurm.restarts() else {})}


def requeued_run(tracker, experiment_id: str, tags: dict) -> str | None:
    """A requeued SLURM job's run, left open by its earlier start: this start records into it (the point is
    recorded once)."""
    if "slurm_restarts" not in tags:
        return None
    runs = tracker.client.search_runs(
        [experiment_id],
        filter_string=f"tags.slurm_job_id = '{tags['slurm_job_id']}' and tags.config_hash = '{tags['config_hash']}'"
        " and attributes.status = 'RUNNING'",
        max_results=1,
    )
    if not runs:
        return None
    tracker.log(runs[0].info.run_id, tags={"slurm_restarts": tags["slurm_restarts"]})
    print(f"[job] requeued by SLURM: recording into run {runs[0].info.run_id} again", flush=True)
    return runs[0].info.run_id


def checkpoints_dir(cfg: DictConfig) -> Path:
    """Where a point's checkpoints go (pipeline.checkpoint): one folder per config hash."""
    return Path(cfg.outputs_dir).resolve() / "checkpoints" / config_hash(cfg)


def resumed_run(tracker, experiment_id: str, cfg: DictConfig, tags: dict, parent: str | None) -> str | None:
    """The latest run of this point, where a stop ended it (failure reason `preempted`, or `time_limit`) and a
    checkpoint of it waits: it opens again, under this sweep's `parent` run, and the job resumes into it."""
    from pipeline.checkpoint import Checkpoints

    saves = Checkpoints(checkpoints_dir(cfg))
    if saves.latest() is None:
        return None
    runs = tracker.client.search_runs(
        [experiment_id],
        filter_string=f"tags.config_hash = '{tags['config_hash']}'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    if not runs or runs[0].data.tags.get("failure_reason") not in ("preempted", "time_limit"):
        return None
    run_id = runs[0].info.run_id
    tracker.client.update_run(run_id, status="RUNNING")
    for tag in ("failure_reason", "error"):
        tracker.client.delete_tag(run_id, tag)
    # this process's now: its job folder, its liveness, its scheduler's ids, its sweep
    tracker.log(run_id, tags={**tags, **({"mlflow.parentRunId": parent} if parent else {})})
    print(f"[job] resuming run {run_id} from its checkpoint at step {saves.meta['step']}", flush=True)
    return run_id


def save_config(cfg: DictConfig, job_dir: Path) -> None:
    """Write the resolved config atomically: every rank of a submitit job writes it, each job process reads it."""
    tmp = job_dir / f".{CONFIG_FILE}.{os.getpid()}"
    OmegaConf.save(cfg, tmp, resolve=True)
    os.replace(tmp, job_dir / CONFIG_FILE)


def follow_rank(cfg: DictConfig, job_dir: Path, pool_dir: Path, ranks: dict) -> Outcome:
    """A rank other than 0 of a scheduler-started job: only its job process; rank 0 records the run."""
    name = run_name(cfg)
    try:
        validate(cfg)
    except ConfigError:
        return Outcome(name, "FAILED", reason="config: recorded by rank 0")
    save_config(cfg, job_dir)
    failure, _ = run_job_process(cfg, job_dir, pool_dir, ranks)
    if failure is not None:
        print(f"[job] rank {ranks['RANK']} failed: {failure.summary}", file=sys.stderr, flush=True)
        return Outcome(name, "FAILED", reason=failure.line)
    return Outcome(name, "FINISHED")


def record_left(
    cfg: DictConfig, sweep: dict, job_dir: Path, overrides: list[str], failure: Failure | None, tags=None
):
    """A point whose runner ended before it recorded the outcome (a scheduler cancelled the job before its code
    ran, or killed the job with its runner), recorded from its job folder as its runner would have: a journal
    entry waiting is recorded; else a result the job process wrote is recorded FINISHED; else `failure`. Into
    the run its runner opened, where that holds no outcome yet (pipeline.journal.awaits_outcome), else into a
    new run under the sweep's parent (with `tags`: the scheduler's ids). (run id, status), or None where its run
    holds an outcome already."""
    from pipeline import journal
    from pipeline.tracking import Tracker

    tracker = Tracker.opened(sweep["tracking_uri"], cfg.outputs_dir)
    job_dir = Path(job_dir)
    if not (job_dir / journal.UNRECORDED_FILE).exists():
        run = tracker.job_run(sweep["experiment_id"], job_dir)
        if run is not None and not journal.awaits_outcome(run):
            return None
        job_dir.mkdir(parents=True, exist_ok=True)
        if not (job_dir / CONFIG_FILE).exists():
            save_config(cfg, job_dir)
        if (job_dir / RESULT_FILE).exists():
            failure = None
        elif failure is not None:
            (job_dir / ERROR_FILE).write_text(failure.text)
        else:
            return None  # nothing to record: no result, no failure known
        entry = journal.entry(
            tracking_uri=tracker.uri,
            experiment_id=sweep["experiment_id"],
            name=run_name(cfg),
            run_id=run and run.info.run_id,
            parent_run_id=sweep["parent_run_id"],
            tags={
                "job_dir": str(job_dir.resolve()),
                "config_hash": config_hash(cfg),
                **({"overrides": " ".join(overrides)} if overrides else {}),  # (else the run's own stays)
                **(tags or {}),
            },
            params=job_params(cfg),
            start_time=run.info.start_time if run is not None else journal.now_ms(),
            failure=failure,
        )
        journal.write(job_dir, entry)
    return journal.record(tracker, job_dir)


@functools.cache
def earlier_sweep_dirs(tracker, experiment_id: str) -> list[str]:
    """The folders the experiment's sweeps ran in, asked once per process (a sweep's own is its Hydra
    sweep.dir; earlier ones do not move)."""
    return tracker.sweep_dirs(experiment_id)


def finished_before(tracker, cfg: DictConfig, experiment_id: str, point: str):
    """(the point's latest FINISHED run or None, the job folder of its FINISHED result still waiting to be
    recorded or None). A waiting result is recorded now when the store takes it: a resumed sweep records a
    point trained while the store was away instead of training it again. A store that does not answer is
    said in one line: the point is trained (its result will wait in the journal)."""
    from pipeline import journal

    try:
        done = tracker.finished_run(experiment_id, point)
    except Exception:  # the store is away: whether the point was done is not known; opening its run says so
        done = None
    if done is not None:
        return done, None
    hydra_cfg = HydraConfig.get() if HydraConfig.initialized() else None
    folders = [hydra_cfg.sweep.dir] if hydra_cfg is not None and hydra_cfg.mode == RunMode.MULTIRUN else []
    try:  # the folders of the experiment's earlier sweeps, wherever hydra.sweep.dir put them
        folders += earlier_sweep_dirs(tracker, experiment_id)
    except Exception:  # the store is away: this sweep's own folder and outputs_dir's are looked in
        pass
    folder = journal.finished_waiting(Path(cfg.outputs_dir), tracker.uri, point, folders)
    if folder is None:
        return None, None
    try:
        journal.record(tracker, folder)
        print(f"[job] recorded the result that waited in {folder}", flush=True)
        return tracker.finished_run(experiment_id, point), None
    except Exception:  # still away
        return None, folder


def starts_first(cfg: DictConfig, sweep: dict | None) -> bool:
    """Whether a point's job starts before the store is open: a single run (a sweep's launching process opened
    the store before its first point) of a valid config whose job starts warm. It trains while this process
    imports MLflow and opens the store; should the point turn out FINISHED before, the job ends unrecorded. Not
    a stopped run's rerun: its job could finish and remove its checkpoints before the run reopens (resumed_run)."""
    from pipeline.checkpoint import Checkpoints

    if sweep is not None or not starts_warm(cfg, scheduler_ranks(cfg)):
        return False
    if Checkpoints(checkpoints_dir(cfg)).latest() is not None:
        return False
    try:
        validate(cfg)
    except ConfigError:  # recorded as the point's failure, once its run is open
        return False
    return True


def run(cfg: DictConfig, sweep: dict | None) -> Outcome:
    """One point: skip it when it FINISHED before, else open its run (under the sweep's parent run, whose ids
    `sweep` holds; None for a single run), run its job process and record the result or the failure. The
    outcome goes through the journal (pipeline.journal): when the store is away at the end, it waits in the
    job folder to be recorded later, and the sweep goes on. A single run's job starts first (starts_first)."""
    from pipeline import journal

    job_dir = Path(HydraConfig.get().runtime.output_dir)
    prestart(cfg)  # the starter imports the libraries while this process opens the store
    with contextlib.ExitStack() as started:
        early = None
        if starts_first(cfg, sweep):
            save_config(cfg, job_dir)
            early = journal.now_ms(), started.enter_context(job_process(cfg, job_dir, job_dir, {}))
        return record(cfg, sweep, job_dir, early)


def record(cfg: DictConfig, sweep: dict | None, job_dir: Path, early: tuple | None) -> Outcome:
    """run() once its job started where it starts first: `early` is (its start in ms, the function that waits
    for its outcome), else None."""
    from pipeline import journal, placement
    from pipeline.tracking import StoreError, Tracker, ui_url

    hydra_cfg = HydraConfig.get()
    stopped = "; its job, started as the store opened, ends unrecorded" if early else ""
    try:  # a store that cannot be opened or refuses this client: one line naming it and the fix
        tracker = Tracker.for_config(cfg)
        experiment_id = sweep["experiment_id"] if sweep else tracker.experiment_id(cfg.tracking.experiment)
    except StoreError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    name, point = run_name(cfg), config_hash(cfg)
    ranks = scheduler_ranks(cfg)
    done, waiting = finished_before(
        tracker, cfg, experiment_id, point
    )  # skipped, or with force=true replaced
    if waiting is not None and not cfg.force:
        print(f"[job] {name}: skipped, trained before: its result waits to be recorded in {waiting}{stopped}")
        return Outcome(name, "UNRECORDED", reason=f"waits in {waiting}")
    if done is not None and not cfg.force:
        print(
            f"[job] {name}: skipped, FINISHED before as run {done.info.run_id} (force=true reruns it){stopped}"
        )
        (job_dir / SKIPPED_FILE).write_text(done.info.run_id)  # counted by the sweep (parallel workers)
        return Outcome(name, "SKIPPED", done.data.metrics.get(selection_metric(cfg)))
    pool_dir = Path(hydra_cfg.sweep.dir) if sweep else job_dir
    if ranks.get("RANK", "0") != "0":
        return follow_rank(cfg, job_dir, pool_dir, ranks)
    parent_run_id = sweep and sweep["parent_run_id"]
    tags = {
        "job_dir": str(job_dir.resolve()),
        "overrides": " ".join(hydra_cfg.overrides.task),
        "config_hash": point,
        **({"replaces": done.info.run_id} if done is not None else {}),
        **liveness.process_tags(),  # a later sweep ends it if this process goes without ending it
        **(scheduler_tags(cfg)),
    }
    start, run_id = early[0] if early else journal.now_ms(), None
    try:  # the run opens now, so that the UI shows it while it trains; a store away opens it when recorded
        run_id = (
            requeued_run(tracker, experiment_id, tags)
            or resumed_run(tracker, experiment_id, cfg, tags, parent_run_id)
            or tracker.start_run(experiment_id, name, parent_run_id, tags, start_time=start)
        )
        print(f"[job] {name}: {ui_url(tracker.uri, experiment_id, run_id)}", flush=True)
        tracker.log(run_id, params=job_params(cfg))
    except Exception as err:
        print(
            f"[job] {name}: the store does not answer ({journal.first_line(err)}): training anyway, the result "
            f"will wait in {job_dir / journal.UNRECORDED_FILE}",
            file=sys.stderr,
            flush=True,
        )
    try:
        failure = None
        try:
            validate(cfg)
        except ConfigError as err:
            failure = Failure("config", f"ConfigError: {err}")
        save_config(cfg, job_dir)
        result = None
        if failure is None and cfg.plan:  # shapes only, no weights: in this process, in seconds
            failure, result = plan_in_process(cfg)
            if result is not None:
                (job_dir / RESULT_FILE).write_text(json.dumps(result))
        elif early:
            failure, tags["job_start"] = early[1]()
        elif failure is None:
            failure, tags["job_start"] = run_job_process(cfg, job_dir, pool_dir, ranks)
        if failure is not None:
            (job_dir / ERROR_FILE).write_text(failure.text)
        journal.write(
            job_dir,
            journal.entry(
                tracking_uri=tracker.uri,
                experiment_id=experiment_id,
                name=name,
                run_id=run_id,
                parent_run_id=parent_run_id,
                tags=tags,
                params=job_params(cfg),
                start_time=start,
                failure=failure,
                replaces=done.info.run_id if done is not None else None,
            ),
        )
        score = None
        if failure is None:
            score = json.loads((job_dir / RESULT_FILE).read_text())["metrics"].get(selection_metric(cfg))
        try:
            journal.record(tracker, job_dir)
        except Exception as err:  # the store is away: the outcome waits in the journal, the sweep goes on
            what = "FINISHED" if failure is None else f"FAILED ({failure.line})"
            print(
                f"[job] {name} {what}, not recorded: the store does not answer ({journal.first_line(err)}); "
                f"it waits in {job_dir / journal.UNRECORDED_FILE}",
                file=sys.stderr,
                flush=True,
            )
            return Outcome(name, "UNRECORDED", score, reason=f"waits in {job_dir}")
        if failure is not None and failure.reason == "preempted" and cfg.launcher.name == "slurm":
            slurm_stop(cfg)  # requeued: this start waits for SLURM to end it, the next resumes into its run
        if failure is not None and failure.stop is not None:  # recorded: the sweep stops as it was asked
            print(f"[job] {name} KILLED ({failure.line}); the same command resumes it", file=sys.stderr)
            raise failure.stop
        if failure is None:
            if cfg.plan and not sweep:  # a single plan's answer (a sweep's comes in its report)
                print(plan_text(cfg, result))
            elif cfg.plan:  # a language model's logits, beside the sweep's plan table
                from pipeline.plan_job import logits_line

                if (logits := logits_line(result["metrics"])) is not None:
                    print(f"[plan] {name}: {logits}", flush=True)
            return Outcome(name, "FINISHED", score)
        status = journal.status_of(failure.reason)  # as the run ends: KILLED for a cancel, else FAILED
        print(f"[job] {name} {status} ({failure.reason}): {failure.summary}", file=sys.stderr, flush=True)
        return Outcome(name, "FAILED", reason=failure.line)
    except BaseException as err:  # Ctrl-C / SIGTERM (the job process is already killed)
        status = "KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED"
        with contextlib.suppress(Exception):  # a store that is away keeps them RUNNING
            if run_id is not None:
                tracker.end(run_id, status)
            if sweep and cfg.launcher.name not in placement.SCHEDULED:  # a job SLURM runs leaves the sweep's
                tracker.end(sweep["parent_run_id"], status)  # parent to the launching process
        raise
