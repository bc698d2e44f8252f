"""A sweep's life: its MLflow parent run (opened before the first job, closed after the last by a Hydra
callback), the jobs' outcomes, the summary lines and exit code, the report at the end, the runs marked
KILLED on Ctrl-C / SIGTERM, and those an earlier process left RUNNING as it died (lost).

Only the launching process creates things (the sqlite schema, the experiment, the parent run), before any
job starts; jobs find their ids in SWEEP_FILE in the sweep folder, so parallel jobs never race on creation.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from pipeline import LABELS_IGNORED, browse, journal, liveness, runner, starter
from pipeline.job import short_mb
from pipeline.runner import SKIPPED_FILE, Outcome, selection_metric
from pipeline.tracking import DESCRIPTION, SKIPPED_RUN, StoreError, Tracker

SWEEP_FILE = "mlflow_sweep.json"
SUMMARY_METRICS = ("optimizer_state_mb", "peak_memory_mb", "eval_loss", "eval_f1", "train_samples_per_second")
# overrides that say where a sweep's results go, not what it sweeps: left out of its name
PLACE_KEYS = ("outputs_dir", "tracking.uri", "tracking.experiment", "log_level")
NAME_CHARS = 200  # a run name's length the UI still shows whole in its tooltip (MLflow stores 250)
# of the runs table's key metrics (browse.METRICS, browse.LM_METRICS: the parent run's own figures), those best
# when smallest
SMALLER_IS_BETTER = ("optimizer_state_mb", "peak_memory_mb", "eval_loss", "eval_perplexity")
# what a sweep with language-model points says once, as it starts: its jobs' runs carry it as the tag `labels`
LABELS_LINE = f"[sweep] the data's label column is {LABELS_IGNORED}"


@dataclass
class SweepResult:
    """What the jobs of this command came to: the summary lines and the exit code."""

    failed: list[str] = field(default_factory=list)  # `name (reason: error)` of each job that did not finish
    skipped: list[str] = field(default_factory=list)  # points that had FINISHED before (resume)
    unrecorded: list[str] = field(default_factory=list)  # job folders whose outcome waits (pipeline.journal)
    record_command: str = ""  # what records them once the store is back
    unclosed: bool = False  # the parent run could not be closed (the store was away at the end)

    def add(self, outcome: Outcome) -> None:
        if outcome.status == "SKIPPED":
            self.skipped.append(outcome.name)
        elif outcome.status == "UNRECORDED":
            self.unrecorded.append(outcome.reason.removeprefix("waits in "))
        elif outcome.status != "FINISHED":
            self.failed.append(f"{outcome.name} ({outcome.reason})")

    def finish(self) -> int:
        """Print the summary lines; the command's exit code (1 when a job failed or waits to be recorded)."""
        if self.skipped:
            print(f"[sweep] {len(self.skipped)} skipped (FINISHED before; force=true reruns them)")
        if self.unrecorded:
            command = self.record_command or f"python -m pipeline.record {self.unrecorded[0]}"
            print(
                f"[sweep] {len(self.unrecorded)} trained, not recorded (the store did not answer): their results "
                f"wait in their job folders; once the store is back, `{command}` records them (or rerun the "
                "sweep: it records them instead of training them again)",
                file=sys.stderr,
            )
        if self.failed:
            print(f"[sweep] {len(self.failed)} failed: " + "; ".join(self.failed), file=sys.stderr)
        return 1 if self.failed or self.unrecorded or self.unclosed else 0


# this process's jobs: filled job by job, and from the store at a sweep's end (parallel or cluster launchers
# run the jobs in other processes)
RESULT = SweepResult()
ACTIVE: dict = {}  # the ids of the sweep this (launching) process opened, for an interrupt
NEW: list[tuple[Path, Path]] = []  # a folder this command makes, and the top one making it creates (note_new)


def sweep_ids(sweep_dir: Path) -> dict | None:
    path = Path(sweep_dir) / SWEEP_FILE
    return json.loads(path.read_text()) if path.exists() else None


def write_ids(sweep_dir: Path, ids: dict) -> None:
    """The sweep's MLflow ids (and what closing it needs), atomically: parallel jobs read them."""
    tmp = Path(sweep_dir) / f".{SWEEP_FILE}.tmp"
    tmp.write_text(json.dumps(ids))
    os.replace(tmp, Path(sweep_dir) / SWEEP_FILE)


def current_ids() -> dict | None:
    """The MLflow ids of the sweep the running Hydra job belongs to (None for a single run)."""
    hydra_cfg = HydraConfig.get()
    return sweep_ids(Path(hydra_cfg.sweep.dir)) if hydra_cfg.mode == RunMode.MULTIRUN else None


def sweep_name(task_overrides) -> str:
    """The parent run's name: what the sweep sweeps, its command line's overrides (`optim=adamw,adafactor
    model=tiny`) without those naming where results go (outputs_dir, tracking.*, log_level);
    `(config defaults)` for none."""
    kept = [str(o) for o in task_overrides if str(o).split("=", 1)[0].lstrip("+~") not in PLACE_KEYS]
    name = " ".join(kept) or "(config defaults)"
    return name if len(name) <= NAME_CHARS else name[: NAME_CHARS - 1] + "…"


def claim_sweep_dir(config: DictConfig) -> None:
    """Sweeps started in the same second in one outputs_dir would share multirun/<time> (job folders and
    SWEEP_FILE): the first takes that folder, the others <time>-2, <time>-3, ... by giving Hydra's cached
    `${now:...}` that value, which every job of this sweep resolves its folder from. A folder given by hand
    (hydra.sweep.dir=...) or a pattern not ending in the time is used as it is."""
    if any(str(o).startswith("hydra.sweep.dir=") for o in config.hydra.overrides.hydra):
        return
    base = Path(str(config.hydra.sweep.dir))  # resolves (and caches) the time
    cache = OmegaConf.get_cache(config)
    key = next((k for k, v in cache.get("now", {}).items() if v == base.name), None)
    if key is None:
        return
    base.parent.mkdir(parents=True, exist_ok=True)
    name, n = base.name, 1
    while True:
        try:
            (base.parent / name).mkdir()
            break
        except FileExistsError:
            n += 1
            name = f"{base.name}-{n}"
    cache["now"][key] = name
    OmegaConf.set_cache(config, cache)


def note_new(folder: Path) -> None:
    """Note `folder` as this command's own when it does not exist yet (Hydra is about to make it, with its
    missing parents): a rejected command removes it (remove_new). A folder that exists already is not noted."""
    folder = Path(folder).absolute()
    if folder.exists():
        return
    top = folder
    while not top.parent.exists():
        top = top.parent
    NEW.append((folder, top))


def remove_new() -> None:
    """What a rejected command made goes: each folder note_new noted, and the parents made with it while they
    are empty (a folder another command put beside it stays)."""
    for folder, top in NEW:
        shutil.rmtree(folder, ignore_errors=True)
        while folder != top:
            folder = folder.parent
            try:
                folder.rmdir()
            except OSError:
                break
    NEW.clear()


def summary_table(runs) -> str:
    """Short console table of a sweep's jobs (the full comparison is `make report`): a language model's
    perplexity where some job logged one, a classifier's F1 where some job logged one."""
    import pandas as pd

    logged = {k for r in runs for k in r.data.metrics}
    keys = list(SUMMARY_METRICS)
    if "eval_perplexity" in logged:  # a language model's quality beside the loss; F1 only where logged too
        keys.insert(keys.index("eval_loss") + 1, "eval_perplexity")
        keys = [k for k in keys if k != "eval_f1" or k in logged]
    rows = [
        {
            "run": r.info.run_name,
            "status": r.info.status,
            **{k: r.data.metrics.get(k) for k in keys},
        }
        for r in sorted(runs, key=lambda r: r.info.start_time)
    ]
    frame = pd.DataFrame(rows).rename(
        columns={
            "optimizer_state_mb": "state [MB]",
            "peak_memory_mb": "peak [MB]",
            "eval_loss": "eval loss",
            "eval_perplexity": "perplexity",
            "eval_f1": "eval F1",
            "train_samples_per_second": "samples/s",
        }
    )
    return frame.to_string(index=False, float_format=lambda v: f"{v:.4g}", na_rep="")


def mark_killed() -> None:
    """After Ctrl-C / SIGTERM in the launching process: the jobs a scheduler started (submitit: SLURM or its
    local executor) are cancelled, so nothing keeps a GPU busy for a stopped sweep, and the parent run and
    every job run still RUNNING become KILLED. Parallel workers may be torn down before their own runner
    could do it."""
    if not ACTIVE:
        return
    from pipeline import placement

    cancelled = placement.cancel_scheduled(Path(ACTIVE["sweep_dir"]), ACTIVE["launcher"])
    if cancelled:
        print(f"[sweep] cancelled {len(cancelled)} {ACTIVE['launcher']} jobs: {' '.join(cancelled)}")
    tracker = Tracker(ACTIVE["tracking_uri"])
    parent = ACTIVE["parent_run_id"]
    running = tracker.child_runs(ACTIVE["experiment_id"], parent, status="RUNNING")
    for run_id in [r.info.run_id for r in running] + [parent]:
        if tracker.status(run_id) == "RUNNING":
            tracker.end(run_id, "KILLED")


def mark_failed() -> None:
    """After the launching process failed (a launcher's exception, Hydra's exit 1): the parent run and every
    job run still RUNNING become FAILED, so that nothing stays RUNNING for good."""
    if not ACTIVE:
        return
    tracker = Tracker(ACTIVE["tracking_uri"])
    parent = ACTIVE["parent_run_id"]
    running = tracker.child_runs(ACTIVE["experiment_id"], parent, status="RUNNING")
    for run_id in [r.info.run_id for r in running] + [parent]:
        if tracker.status(run_id) == "RUNNING":
            tracker.end(run_id, "FAILED")


LOST = "lost"  # failure_reason of a run whose process went without ending it


def waits_on_disk(run) -> bool:
    """Whether a run's outcome waits in its folder for `python -m pipeline.record`: a job's journal entry, or
    a sweep that ended while its outcomes waited (its parent left open) or whose outcomes wait."""
    tags = run.data.tags
    if "job_dir" in tags:
        return (Path(tags["job_dir"]) / journal.UNRECORDED_FILE).exists()
    if "sweep_dir" in tags:
        ids = sweep_ids(Path(tags["sweep_dir"])) or {}
        return bool(ids.get("ended") or journal.waiting(Path(tags["sweep_dir"])))
    return False


def close_lost(tracker: Tracker, experiment_id: str) -> list[str]:
    """End KILLED, with failure_reason `lost`, each run of the experiment still RUNNING whose process is gone
    (killed outright, or its machine died: nothing ended the run), but those whose outcome waits on disk
    (waits_on_disk). A run whose process cannot be checked from here (pipeline.liveness) stays RUNNING. The
    run ids ended."""
    running = tracker.client.search_runs(
        [experiment_id], filter_string="attributes.status = 'RUNNING'", max_results=10000
    )
    closed = []
    for run, alive in zip(running, liveness.states([r.data.tags for r in running]), strict=True):
        if alive is not False or waits_on_disk(run):
            continue
        tags = run.data.tags
        where = [f"SLURM job {tags[liveness.SLURM_JOB]}"] if liveness.SLURM_JOB in tags else []
        where += [f"pid {tags[liveness.PID]} on {tags[liveness.HOST]}"] if liveness.PID in tags else []
        error = (
            f"its process ({', '.join(where)}) is gone without ending this run (killed outright, or its "
            "machine died)"
        )
        tracker.log(
            run.info.run_id,
            tags={"failure_reason": LOST, "error": error, DESCRIPTION: f"KILLED: {LOST}: {error}"},
        )
        tracker.end(run.info.run_id, "KILLED")
        closed.append(run.info.run_id)
    return closed


JOB_KINDS = (("find_batch_size", "largest-batch search"), ("plan", "plan"))  # param == "True" -> kind
PLURALS = {"training": "training", "largest-batch search": "largest-batch searches", "plan": "plans"}


def job_kind(run) -> str:
    """What a job run did: `training`, `largest-batch search` (find_batch_size=true) or `plan`."""
    params = run.data.params
    return next((kind for param, kind in JOB_KINDS if params.get(param) == "True"), "training")


def count_line(runs) -> str:
    """`3 jobs: 3 finished (2 training, 1 largest-batch search), 0 failed`: every finished job counts, and
    the kinds are named when the sweep holds other jobs than training ones."""
    finished = [job_kind(r) for r in runs if r.info.status == "FINISHED"]
    kinds = {kind: finished.count(kind) for kind in dict.fromkeys(finished)}
    named = ", ".join(f"{n} {kind if n == 1 else PLURALS[kind]}" for kind, n in kinds.items())
    detail = f" ({named})" if set(kinds) - {"training"} else ""
    return f"{len(runs)} jobs: {len(finished)} finished{detail}, {len(runs) - len(finished)} failed"


def best_figures(runs) -> tuple[dict, str]:
    """The parent run's own figures, so that its row in the runs table reads them: for each key metric
    (browse.METRICS, and a language model's browse.LM_METRICS) the best value among its FINISHED training
    jobs, F1s only from jobs whose model did not collapse (tag collapsed); and the line that names them with
    their optimizers, `lowest peak 312 MB adafactor · best F1 0.853 adamw` (a language model's: `best
    perplexity 41.2 adamw`; empty without such jobs)."""
    done = [r for r in runs if r.info.status == "FINISHED" and job_kind(r) == "training"]
    learned = [r for r in done if r.data.tags.get("collapsed") != "true"]
    # language models': their eval loss is a next-token loss, not comparable with a classifier's
    models = [r for r in done if "eval_perplexity" in r.data.metrics]
    figures, by = {}, {}
    for key in dict.fromkeys([*browse.METRICS, *browse.LM_METRICS]):
        pool = models if key == "eval_loss" else learned if key.startswith("eval_") else done
        have = [r for r in pool if key in r.data.metrics]
        if have:
            best = (min if key in SMALLER_IS_BETTER else max)(have, key=lambda r: r.data.metrics[key])
            figures[key], by[key] = best.data.metrics[key], best.data.params.get("optim", best.info.run_name)
    parts = []
    if "peak_memory_mb" in figures:
        parts.append(f"lowest peak {short_mb(figures['peak_memory_mb'])} MB {by['peak_memory_mb']}")
    if "eval_f1" in figures:
        parts.append(f"best F1 {figures['eval_f1']:.3f} {by['eval_f1']}")
    elif any("eval_f1" in r.data.metrics for r in done):
        parts.append("no model learned (all collapsed)")
    if "eval_perplexity" in figures:
        parts.append(f"best perplexity {figures['eval_perplexity']:,.1f} {by['eval_perplexity']}")
    return figures, " · ".join(parts)


def failed_job_lines(runs) -> list[str]:
    """`name (reason: error)` of every job run that did not finish, as the sweep's summary prints them."""
    return [
        f"{r.info.run_name} ({r.data.tags.get('failure_reason', r.info.status.lower())}: "
        f"{r.data.tags.get('error', r.info.status)})"
        for r in sorted(runs, key=lambda r: r.info.start_time)
        if r.info.status != "FINISHED"
    ]


def sweep_tasks(config: DictConfig) -> list[str]:
    """The tasks (conf/task/) the sweep's points run: those it sweeps (`task=causal_lm,classification`), else
    the one its config composes (`task=causal_lm`, or the default)."""
    from pipeline.fail_fast import sweep_of

    sweep = sweep_of(config)
    swept = sweep.options.get("task") if sweep is not None else None
    return list(dict.fromkeys(swept)) if swept else [str(OmegaConf.select(config, "task.name"))]


def labels_ignored(config: DictConfig) -> bool:
    """Whether a language model of the sweep trains on data that has a label column (data.label_column not
    null), which it ignores: a plan reads no data."""
    label = OmegaConf.select(config, "data.label_column", default="label")
    return "causal_lm" in sweep_tasks(config) and not config.get("plan") and label is not None


def sweep_metric(config: DictConfig) -> str:
    """What the sweep's jobs are ranked by (its parent run's tag browse.METRIC_TAG, its saved view's order):
    `loss` (eval_loss, lowest first) where every point is a language model's (task=causal_lm), else the
    classifier's eval.metric (eval_<metric>, highest first)."""
    if sweep_tasks(config) == ["causal_lm"]:
        return browse.LM_METRIC
    return OmegaConf.select(config, "eval.metric", default=browse.METRIC)


def reject(err: Exception) -> None:
    """Stop the command on bad input: one line, exit code 2."""
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)


def scheduled(config: DictConfig) -> None:
    """Before a SLURM sweep opens anything: submitit's sacct warnings off a quiet console, and a request sbatch
    would refuse stopped with one line naming the key to set (exit code 2)."""
    from pipeline import quiet, slurm

    with_level = OmegaConf.select(config, "log_level", default=quiet.DEFAULT)
    if quiet.is_quiet(str(with_level).lower()) and not config.hydra.verbose:
        slurm.quiet_sacct()
    params = OmegaConf.to_container(config.hydra.launcher, resolve=True)
    params.pop("_target_", None)
    err = slurm.signal_delay_error(params) or slurm.refusal(params, jobs=1)
    if err is not None:
        reject(err)


class SweepCallback(Callback):
    """Checks a single run's config before Hydra makes its folder; opens a sweep's parent run before the first
    job and closes it after the last one."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        """A single run's bad input stops the command before its folder is made (in a sweep, a bad point becomes
        a FAILED run and the rest go on); the folder Hydra makes next is noted (note_new)."""
        from pipeline.config import ConfigError, unused_custom_optim, validate

        try:
            validate(config)
            unused = unused_custom_optim(config, [config.hydra.runtime.choices.get("optim")])
            if unused is not None:
                raise unused
        except ConfigError as err:
            reject(err)
        note_new(Path(str(config.hydra.run.dir)))

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        from pipeline.config import ConfigError, check_tracking_uri
        from pipeline.fail_fast import point_independent_error

        try:  # a bad value no point escapes fails the command as a single run's does, before any run opens
            err = point_independent_error(config)
            check_tracking_uri(config)  # before MLflow's client would retry a dead server for minutes
        except ConfigError as error:
            err = error
        if err is not None:
            reject(err)
        if OmegaConf.select(config, "launcher.name") == "slurm":
            scheduled(config)  # sbatch would refuse the jobs: one line, before any run opens
        if OmegaConf.select(config, "launcher.name") in ("slurm", "submitit_local"):
            from pipeline import scheduled as submitted

            submitted.collect_each()  # a job that leaves no result is its point's outcome alone
        if OmegaConf.select(config, "launcher.name") == "local":  # its jobs start from this process
            runner.prestart(config)  # the job starter imports while this process opens the store
        try:  # a store that cannot be opened or refuses this client: one line naming it and the fix
            tracker = Tracker.for_config(config)
            experiment_id = tracker.experiment_id(config.tracking.experiment)
        except StoreError as error:
            reject(error)
        try:  # the runs an earlier sweep left RUNNING as it died (its points run again, or were done)
            lost = close_lost(tracker, experiment_id)
            if lost:
                print(
                    f"[sweep] {len(lost)} runs left RUNNING by a process that is gone: ended KILLED ({LOST})"
                )
        except Exception as error:
            print(f"[sweep] runs left RUNNING not checked ({journal.first_line(error)})", file=sys.stderr)
        # the sweep's folder once nothing can reject the command
        claim_sweep_dir(config)  # another sweep started in the same second has its own folder
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        overrides = " ".join(config.hydra.overrides.task)
        metric = sweep_metric(config)
        parent = tracker.start_run(
            experiment_id,
            name=sweep_name(config.hydra.overrides.task),
            tags={
                "sweep_dir": str(sweep_dir.resolve()),
                "outputs_dir": str(Path(config.outputs_dir).resolve()),  # where its report goes
                "overrides": overrides,
                "kind": "sweep",
                # what its saved view ranks its jobs by (browse.sweep_url)
                browse.METRIC_TAG: metric,
                **liveness.process_tags(),  # a later sweep ends it if this process goes without ending it
            },
        )
        ids = {
            "tracking_uri": tracker.uri,
            "experiment_id": experiment_id,
            "parent_run_id": parent,
            # what closing the sweep later needs (`python -m pipeline.record`, when the store was away)
            "outputs_dir": str(Path(config.outputs_dir).resolve()),
            "metric": metric,
        }
        write_ids(sweep_dir, ids)
        ACTIVE.update(ids, sweep_dir=str(sweep_dir), launcher=OmegaConf.select(config, "launcher.name"))
        print(
            f"[sweep] MLflow parent run {parent} in {tracker.uri} (experiment {config.tracking.experiment})"
        )
        if labels_ignored(config):  # once for the sweep, not once per job
            print(LABELS_LINE)
        from pipeline.report import plots

        plots.import_matplotlib()  # for the report at the end, while the jobs' starter imports its libraries
        # what this process holds for the whole sweep (the libraries, the open store) out of the collector's
        # sight: its collections between jobs scan what the sweep adds, not a heap that takes 0.2 s a pass. A
        # command starts with the collector off (pipeline.__main__): the garbage of its start goes in one pass
        # first, and the collector is on from here
        started_off = not gc.isenabled()
        if started_off:
            gc.collect()
        gc.freeze()
        if started_off:
            gc.enable()

    def on_job_end(self, config: DictConfig, job_return, **kwargs) -> None:
        from hydra.core.utils import JobStatus

        if job_return.status == JobStatus.COMPLETED and job_return.return_value is not None:
            value = (
                job_return.return_value
            )  # the task function's: val_<eval.metric>, or a language model's loss
            print(
                f"[job] returns {selection_metric(config)}={value:.6f} (validation split: what a sweeper optimises)"
            )

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        ids = sweep_ids(sweep_dir)
        if ids is None:
            return
        tracker = Tracker.for_config(config)
        from pipeline import scheduled as submitted

        lost = submitted.record_lost(ids)  # jobs a scheduler ended before they recorded their point
        # outcomes that waited for the store (it was away when their job ended) go in now if it is back
        _, left, err = journal.record_all(sweep_dir, tracker)
        RESULT.unrecorded[:] = [str(path) for path in left]
        if not left:
            try:
                metric = ids.get("metric") or OmegaConf.select(config, "eval.metric", default="macro_f1")
                status = close(tracker, ids, sweep_dir, Path(config.outputs_dir), metric)
                RESULT.failed.extend(lost)  # points with no run to count them
                # the same command again finds every point FINISHED: it starts no job starter ahead of a job
                starter.note_finished(status == "FINISHED" and not lost and not config.force)
                return
            except Exception as error:  # the store went away at the very end
                err = journal.first_line(error)
        # the parent closes when `python -m pipeline.record` has recorded what waits
        RESULT.record_command = f"python -m pipeline.record {sweep_dir}"
        RESULT.unclosed = True
        print(
            f"\n[sweep] the store does not answer ({err}): the parent run stays open until "
            f"`{RESULT.record_command}` closes it"
        )
        write_ids(sweep_dir, {**ids, "ended": True})


def close(tracker: Tracker, ids: dict, sweep_dir: Path, outputs_dir: Path, metric: str) -> str:
    """A sweep's end, from what the store holds: the summary (and the exit code's RESULT), the parent run's
    counts, skipped points and description, the report, and the parent closed; its status."""
    runs = tracker.child_runs(ids["experiment_id"], ids["parent_run_id"])
    failed = [r for r in runs if r.info.status != "FINISHED"]
    # the summary and exit code come from the store, not from this process's outcomes: with a parallel or
    # cluster launcher the jobs ran in other processes
    RESULT.failed[:] = failed_job_lines(runs)
    skipped = list(sweep_dir.glob(f"**/{SKIPPED_FILE}"))
    RESULT.skipped[:] = [path.parent.name for path in skipped]
    # the parent refers to the runs its skipped points FINISHED as before (`skipped_run.<job>`): its
    # report covers every point, and a rerun whose points were all done is a reference, not an empty run
    found = {f"{SKIPPED_RUN}{path.parent.name}": path.read_text().strip() for path in skipped}
    # the parent's row in the runs table reads the sweep's best, of the runs it ran or found FINISHED before
    figures, best = best_figures([*runs, *tracker.runs(ids["experiment_id"], list(found.values()))])
    metrics = {"jobs": len(runs), "jobs_failed": len(failed), "jobs_skipped": len(found), **figures}
    tracker.log(ids["parent_run_id"], metrics=metrics, tags=found)
    line = count_line(runs) + (f", {len(found)} skipped (FINISHED before)" if found else "")
    print(f"\n[sweep] {line}; parent run {ids['parent_run_id']}")
    tracker.describe(ids["parent_run_id"], " · ".join(filter(None, (best, line))))
    status = "FAILED" if failed else "FINISHED"
    if runs or found:
        report_sweep(tracker, ids["parent_run_id"], runs, outputs_dir, metric, status)
    parent = tracker.client.get_run(ids["parent_run_id"])
    print(browse.sweep_line(tracker.uri, browse.sweep_url(tracker, parent)))
    tracker.end(ids["parent_run_id"], status)
    return status


def report_sweep(
    tracker: Tracker, parent_run_id: str, runs, outputs_dir: Path, metric: str, status: str | None = None
) -> None:
    """Build the sweep's report, log it to the parent run and print its short table."""
    try:
        from pipeline import report

        out, table = report.build(
            tracker.uri,
            [parent_run_id],
            root=outputs_dir / "report",
            quality_metric=metric,
            status=status,
        )
        tracker.log_artifacts(parent_run_id, out, "report")
        print(report.console_text(out, table))
        print(f"[sweep] report: {out.resolve() / 'report.html'} (and in the parent run's artifacts)")
    except Exception as err:  # the report is a convenience: it must never hide the sweep's results
        print(f"[sweep] report not built: {type(err).__name__}: {err}")
        print(summary_table(runs))
