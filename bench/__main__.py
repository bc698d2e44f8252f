"""`python -m bench [--full]`: the pipeline's own cost, measured side by side, written to bench/RESULTS.md.

(a) steady-state step time of a pipeline job (both backends) against a bare PyTorch loop (bench/bare_loop.py)
(b) fixed overhead of one job against the import floor `python -c "import torch, transformers, mlflow"`, also with
    the job starter kept from the command before, and of a job inside a sweep
(c) time in MLflow calls as a share of the job's wall time
(d) time from command to error for bad input
(e) throughput of 4 tiny jobs, 2 at a time against one at a time
(f) optimizer.step() time of every registered optimizer (bench/optim_steps.py)
(g) wall time per job of an 8-job tiny sweep of one step each, jobs started warm and cold, against the import floor:
    the whole command, its job starter's start included, with no job starter of the bench's alive before it
(h) host-device synchronisations per training step of a job (both backends) and of the bare loop (bench/bare_loop.py)

Every figure is a ratio of things measured in the same run, interleaved, so machine drift cancels; each is a
median over repeats with min and max. Work files and logs go to outputs/bench/<time>/. `--only g` measures (g)
alone (its import floors, its first run and its repeats) and prints it, leaving RESULTS.md as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from pipeline import starter

# (e) the parallel launcher: overrides that make a `-m` sweep run 2 jobs at a time (each job then gets
# cores / 2 torch threads); an empty string (or a sweep that fails) leaves (e) as "not measured"
PARALLEL_OVERRIDES = "launcher=parallel launcher.n_jobs=2"

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
TAG = "BENCH_RUN"  # in every command's environment, this bench's process id: the job starters it started carry it
# as the runner sets it for every job; each command's starter ends with it, but where a row keeps it
ENV = {
    **{k: v for k, v in os.environ.items() if k != starter.KEEP_ENV},
    "TOKENIZERS_PARALLELISM": "false",
    TAG: str(os.getpid()),
}
GOALS = {
    "step": 1.03,
    "overhead": 1.0,
    "mlflow": 0.02,
    "bad_input_s": 2.0,
    "parallel": 1.7,
    "sweep_job": 0.35,
}
SWEEP_JOBS = 8  # (g)
# (h): 6 steps of the tiny model (its steps 2-5 counted), in one process
SYNCS_JOB = ["model=tiny", "data.max_train_samples=128", "data.max_eval_samples=32", "train.max_steps=6"]
FLOOR_READINGS = 3  # a repeat's import floor: the median of this many readings (one process start is noisy)


@dataclass(frozen=True)
class Settings:
    repeats: int
    model: str  # (a)-(c)
    batch_size: int
    steps: int
    max_length: int
    eval_samples: int
    parallel_steps: int  # (e): 4 tiny jobs of this many steps
    optim_model: str  # (f)
    optim_steps: int


QUICK = Settings(2, "minilm", 8, 20, 64, 64, 5, "tiny", 5)
FULL = Settings(5, "minilm", 16, 60, 64, 1000, 20, "minilm", 10)


def run(cmd: list[str], log: Path, check: bool = True, env: dict | None = None) -> tuple[float, int]:
    """(wall seconds, exit code) of a command; its output goes to `log`."""
    start = time.perf_counter()
    with log.open("w") as out:
        env = {**ENV, **(env or {})}
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    if check and code != 0:
        sys.exit(f"bench: `{shlex.join(cmd)}` exited with {code}; see {log}")
    return wall, code


def job_overrides(s: Settings, backend: str, seed: int, work: Path, name: str) -> list[str]:
    return [
        f"model={s.model}",
        f"backend={backend}",
        f"batch_size={s.batch_size}",
        f"seed={seed}",  # a new point each time: the resume lookup runs, nothing is skipped
        f"train.max_steps={s.steps}",
        f"train.max_length={s.max_length}",
        "train.padding=max_length",  # every batch the same shape: step times do not depend on data order
        f"data.max_eval_samples={s.eval_samples}",  # the test split
        f"data.max_val_samples={s.eval_samples}",  # and the validation split, each evaluated once at the end
        f"outputs_dir={work}",
        f"hydra.run.dir={work}/runs/{name}",
    ]


KEEP_S = 900  # (b) with the starter kept: how long it waits for the next command (more than a repeat takes)


def pipeline_job(s: Settings, backend: str, seed: int, work: Path, kept: bool = False) -> dict:
    """One job through the real CLI (with bench.probe's stopwatches): its result and phase times. `kept`: with
    the job starter kept between commands ($PIPELINE_STARTER_KEEP_S), found running from the one before."""
    name = f"{backend}-{seed}"
    phases = work / f"{name}.cli.json"
    cmd = [PY, "-m", "bench.probe", "cli", str(phases), *job_overrides(s, backend, seed, work, name)]
    wall, _ = run(cmd, work / f"{name}.log", env={starter.KEEP_ENV: str(KEEP_S)} if kept else None)
    job_dir = work / "runs" / name
    metrics = json.loads((job_dir / "result.json").read_text())["metrics"]
    return {
        "wall": wall,
        "config": job_dir / "config.yaml",
        **metrics,
        **json.loads(phases.read_text()),
        **json.loads((job_dir / "bench_phases.json").read_text()),
    }


SWEEP_POINTS = 3  # (b) in a sweep: MiniLM jobs of one sweep, the first left out (it fills the caches)


def sweep_overheads(s: Settings, backend: str, rep: int, work: Path) -> list[float]:
    """(b) inside a sweep: a sweep of SWEEP_POINTS MiniLM jobs (as (b)'s single run, other seeds); for each job
    after the first, its run's time from opening to its job process's end, less its training loop (s)."""
    from mlflow import MlflowClient

    name = f"sweep-{backend}-{rep}"
    seeds = ",".join(str(1000 * (rep + 1) + i) for i in range(SWEEP_POINTS))
    overrides = [o for o in job_overrides(s, backend, 0, work, name) if not o.startswith(("seed=", "hydra."))]
    overrides += [f"seed={seeds}", f"hydra.sweep.dir={work}/multirun/{name}"]
    run([PY, "-m", "pipeline", "-m", *overrides], work / f"{name}.log")
    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    folder = str((work / "multirun" / name).resolve())
    runs = [
        r
        for r in client.search_runs(experiments, max_results=1000)
        if r.data.tags.get("job_dir", "").startswith(folder)
    ]
    runs.sort(key=lambda r: r.info.start_time)
    return [
        (r.info.end_time - r.info.start_time) / 1000 - r.data.metrics["train_runtime_s"] for r in runs[1:]
    ]


def bare_loop(config: Path, work: Path, name: str, peak_tracker: bool = False) -> dict:
    cmd = [PY, "-m", "bench.bare_loop", str(config), *(["--peak-tracker"] if peak_tracker else [])]
    run(cmd, work / f"{name}.log")
    return json.loads((work / f"{name}.log").read_text().strip().splitlines()[-1])


def import_floor(work: Path) -> float:
    cmd = [PY, "-c", "import torch, transformers, mlflow"]
    return statistics.median(run(cmd, work / "floor.log")[0] for _ in range(FLOOR_READINGS))


BAD_INPUTS = {"optim=nope": ["optim=nope"], "batch_size=0": ["batch_size=0"]}


def bad_input(args: list[str], work: Path) -> float:
    log = work / "bad.log"
    wall, code = run([PY, "-m", "pipeline", *args, f"outputs_dir={work}"], log, check=False)
    if code != 2:
        sys.exit(f"bench: `python -m pipeline {' '.join(args)}` exited with {code}, not 2; see {log}")
    return wall


def sweep4(s: Settings, work: Path, name: str, parallel: str = "") -> float | None:
    """Wall time of a 4-job sweep of the tiny model (None when the command fails)."""
    overrides = ["model=tiny", "seed=0,1,2,3", f"train.max_steps={s.parallel_steps}", "force=true"]
    overrides += [f"outputs_dir={work}", f"hydra.sweep.dir={work}/multirun/{name}", *shlex.split(parallel)]
    cmd = [PY, "-m", "pipeline", "-m", *overrides]
    wall, code = run(cmd, work / f"sweep-{name}.log", check=False)
    return wall if code == 0 else None


def parallel_sweeps(s: Settings, work: Path) -> dict[str, float | None]:
    """The same 4 jobs one at a time and 2 at a time."""
    walls = {"one at a time": sweep4(s, work, "sequential")}
    if PARALLEL_OVERRIDES:
        walls["2 at a time"] = sweep4(s, work, "parallel", PARALLEL_OVERRIDES)
    return walls


def starters() -> list[tuple[int, bool]]:
    """The job starters alive, found in /proc by their command line (`-m pipeline.starter`; their serving
    processes, not the jobs they fork): (pid, whether this bench started it: TAG in its environment)."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if b"-m\0pipeline.starter\0" in (entry / "cmdline").read_bytes():
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                found[int(entry.name)] = parent
        except (ValueError, OSError):
            continue
    mine = f"{TAG}={ENV[TAG]}".encode()
    alive = []
    for pid, parent in found.items():
        if parent in found:  # a job it forked
            continue
        try:
            ours = mine in (Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
        except OSError:  # another user's
            ours = False
        alive.append((pid, ours))
    return alive


def end_own_starters() -> dict[str, int]:
    """Before a (g) command: the job starters this bench left (the kept one of (b)) ended (SIGTERM: their clean
    end), so that the command starts its own, as a user's sweep does, and none holds memory beside it.
    {"ended": how many, "others": the starters alive not the bench's (other commands'), left alone}."""
    alive = starters()
    ended = [pid for pid, ours in alive if ours]
    for pid in ended:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 30
    while any(pid in ended for pid, _ in starters()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = starters()
    if any(ours for _, ours in left):
        sys.exit(
            f"bench: a job starter of the bench's outlived SIGTERM: {[pid for pid, ours in left if ours]}"
        )
    return {"ended": len(ended), "others": len(left)}


def sweep_per_job(work: Path, start: str, alive: dict | None = None) -> float:
    """(g) Wall time of an 8-job tiny sweep of one step each (the whole command: sweep start, its job starter's
    start, parent run, report), divided by its jobs; `start`: launcher.start_jobs. The bench's starters are
    ended first (end_own_starters: what it found goes into `alive`, a list per start)."""
    found = end_own_starters()
    if alive is not None:
        alive.setdefault(start, []).append(found)
    seeds = ",".join(map(str, range(SWEEP_JOBS)))
    overrides = [
        "model=tiny",
        f"seed={seeds}",
        "train.max_steps=1",
        "force=true",
        f"launcher.start_jobs={start}",
    ]
    overrides += [f"outputs_dir={work}", f"hydra.sweep.dir={work}/multirun/sweep8-{start}-{time.time_ns()}"]
    wall, _ = run([PY, "-m", "pipeline", "-m", *overrides], work / f"sweep8-{start}.log")
    return wall / SWEEP_JOBS


def optimizer_steps(s: Settings, work: Path) -> list[dict]:
    log = work / "optim_steps.log"
    run([PY, "-m", "bench.optim_steps", s.optim_model, str(s.optim_steps)], log)
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def host_syncs(work: Path) -> dict[str, dict]:
    """(h) bench.bare_loop.HostSyncs' reads per step, for each backend and the bare loop."""
    log = work / "syncs.log"
    run([PY, "-m", "bench.bare_loop", "--syncs", *SYNCS_JOB, f"outputs_dir={work}"], log)
    return json.loads(log.read_text().strip().splitlines()[-1])


def overhead_s(job: dict) -> float:
    """CLI wall time less the training loop (train_runtime_s): start-up, loading, evaluation, logging, exit."""
    return job["wall"] - job["train_runtime_s"]


def mlflow_s(job: dict) -> float:
    return sum(v for k, v in job.items() if k.startswith("mlflow."))


def train_s(jobs: dict[str, list[dict]]) -> dict[str, list[float]]:
    """Each backend's training loops (train_runtime_s), one per repeat."""
    return {b: [j["train_runtime_s"] for j in runs] for b, runs in jobs.items()}


def mlflow_after(job: dict) -> float:
    """Time in MLflow calls after the job process ended (bench.probe)."""
    return job.get("cli.mlflow_after_job", 0.0)


def stats(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def cell(values: list[float], fmt: str = "{:.3g}") -> str:
    med, lo, hi = stats(values)
    return f"{fmt.format(med)} ({fmt.format(lo)} – {fmt.format(hi)})"


def verdict(value: float, goal: float, at_most: bool = True, unit: str = "") -> str:
    ok = value <= goal if at_most else value >= goal
    return f"{'≤' if at_most else '≥'} {goal:g}{unit}: " + ("**met**" if ok else "**missed**")


def versions() -> str:
    from importlib.metadata import version

    names = ["torch", "transformers", "accelerate", "datasets", "hydra-core", "mlflow"]
    names += ["hydra-joblib-launcher", "bitsandbytes", "torchao"]
    found = []
    for name in names:
        try:
            found.append(f"{name} {version(name)}")
        except Exception:
            found.append(f"{name} (not installed)")
    return ", ".join(found)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (
        f"{platform.node()}: {cpu}, {os.cpu_count()} cores, {gpu}; torch threads {torch.get_num_threads()}; "
        f"Python {platform.python_version()} on {platform.platform()}"
    )


def backend_table(label: str, seconds: dict[str, list[float]], *more: tuple[str, dict]) -> list[str]:
    """A table of seconds per backend (median, min – max), after a blank line: the row `label` (bold), then
    the rows `more` ((label, seconds) each)."""
    rows = [(f"**{label}**", seconds), *more]
    return [
        "",
        "| | " + " | ".join(f"`backend={b}`" for b in seconds) + " |",
        "| --- |" + " --- |" * len(seconds),
        *(
            f"| {name} | " + " | ".join(cell(v, "{:.2f}") for v in values.values()) + " |"
            for name, values in rows
        ),
    ]


def job_phases(jobs: list[dict]) -> list[tuple[str, list[float]]]:
    """Where one job's wall time goes, phase by phase (seconds, one value per repeat)."""

    def each(fn):
        return [fn(j) for j in jobs]

    train = each(lambda j: j["train_runtime_s"])
    rows = [
        (
            "CLI process: Python start, imports, Hydra compose (to runner.run)",
            each(lambda j: j["cli.until_runner"]),
        ),
        (
            "CLI process: to the job's start (its starter found or started, the config checked and saved)",
            each(lambda j: j["cli.job_start_at"] - j["cli.until_runner"]),
        ),
        (
            "job process: start (warm: the wait for the starter's imports, then a fork) and teardown",
            each(lambda j: j["cli.job_end_at"] - j["cli.job_start_at"] - j["job.total"]),
        ),
        (
            "job process: imports left to it (torch, transformers, accelerate, datasets, pipeline)",
            each(lambda j: j["job.imports"]),
        ),
        (
            "job process: tokenizer + data + model loading",
            each(lambda j: j["job.load_tokenizer"] + j["job.load_data"] + j["job.load_model"]),
        ),
        ("job process: tokenization", each(lambda j: j["job.tokenize"])),
        (
            "job process: backend setup + evaluation",
            each(lambda j: j["job.backend_train"] - j["train_runtime_s"]),
        ),
        (
            "job process: CPU peak FLOP/s (cached), state size, result",
            each(
                lambda j: (
                    j["job.total"]
                    - j["job.imports"]
                    - j["job.load_tokenizer"]
                    - j["job.load_data"]
                    - j["job.load_model"]
                    - j["job.tokenize"]
                    - j["job.backend_train"]
                )
            ),
        ),
        (
            "CLI process: after the job's end (the MLflow calls left, interpreter start and teardown)",
            each(lambda j: j["wall"] - j["cli.job_end_at"]),
        ),
        ("**fixed overhead** (all of the above)", each(overhead_s)),
        ("training loop (`train_runtime_s`, not overhead)", train),
        ("CLI wall time", each(lambda j: j["wall"])),
        (
            "*beside the job (not counted again):* MLflow's import and its store (Tracker init)",
            each(lambda j: j["mlflow.__init__"]),
        ),
        (
            "*beside the job (not counted again):* MLflow calls (lookup, run start, params)",
            each(lambda j: mlflow_s(j) - j["mlflow.__init__"] - mlflow_after(j)),
        ),
        (
            "*of the CLI's part after the job's end:* MLflow calls (metrics, artifacts, the run's end)",
            each(mlflow_after),
        ),
    ]
    return rows


def write_results(
    out: Path, s: Settings, command: str, r: dict, started: datetime, took: float, work: Path
) -> None:
    jobs, bare, tracked, floors = r["jobs"], r["bare"], r["tracked"], r["floors"]
    readings = r.get("floor_readings", 1)  # (a run measured before the median of several has one)
    floor_readings = f"the median of {readings} readings" if readings > 1 else "one reading"
    lines = [
        "# Benchmark results: the pipeline's own cost",
        "",
        f"- date: {started:%Y-%m-%d %H:%M} (took {took:.0f} s)",
        f"- machine: {machine()}",
        f"- libraries: {versions()}",
        f"- command: `{command}` (settings: {', '.join(f'{k}={v}' for k, v in asdict(s).items())})",
        f"- logs and work files: `{work.relative_to(ROOT)}/`",
        "",
        f"Each cell: median (min – max) over {s.repeats} repeats, run interleaved; ratios are taken within a",
        "repeat. Absolute times drift on shared machines: read the ratios.",
        "",
        "## Goals",
        "",
        "| goal | measured | target |",
        "| --- | --- | --- |",
    ]
    for backend, runs in jobs.items():
        ratios = [j["train_step_ms"] / b["train_step_ms"] for j, b in zip(runs, bare, strict=True)]
        lines.append(
            f"| (a) step time, `backend={backend}` / bare loop | {cell(ratios)} | "
            f"{verdict(statistics.median(ratios), GOALS['step'])} |"
        )
    for backend, runs in jobs.items():
        ratios = [overhead_s(j) / f for j, f in zip(runs, floors, strict=True)]
        lines.append(
            f"| (b) fixed overhead of one job, `backend={backend}` / import floor | {cell(ratios)} | "
            f"{verdict(statistics.median(ratios), GOALS['overhead'])} |"
        )
    for backend, values in r.get("kept", {}).items():
        ratios = [v / f for v, f in zip(values, floors, strict=True)]
        lines.append(
            f"| (b) fixed overhead of one job, the job starter kept from the command before "
            f"(`{starter.KEEP_ENV}={KEEP_S}`), `backend={backend}` / import floor | {cell(ratios)} | "
            f"{verdict(statistics.median(ratios), GOALS['overhead'])} |"
        )
    for backend, values in r["in_sweep"].items():
        ratios = [v / f for v, f in zip(values, floors, strict=True)]
        lines.append(
            f"| (b) fixed overhead of one job inside a sweep, `backend={backend}` / import floor | {cell(ratios)} | "
            f"{verdict(statistics.median(ratios), GOALS['overhead'])} |"
        )
    for backend, runs in jobs.items():
        calls = [(mlflow_s(j) - j["mlflow.__init__"]) / j["wall"] * 100 for j in runs]
        lines.append(
            f"| (c) MLflow calls only (no `Tracker()`), `backend={backend}` [% of wall] | {cell(calls)} | "
            f"{verdict(statistics.median(calls), GOALS['mlflow'] * 100, unit=' %')} |"
        )
        shares = [mlflow_s(j) / j["wall"] * 100 for j in runs]
        lines.append(
            f"| (c) MLflow share of the job's wall time, `backend={backend}` [%] | {cell(shares)} | "
            f"{verdict(statistics.median(shares), GOALS['mlflow'] * 100, unit=' %')} |"
        )
    for start in ("warm", "cold"):
        ratios = [job / f for job, f in zip(r["sweep8"][start], floors, strict=True)]
        lines.append(
            f"| (g) {SWEEP_JOBS}-job tiny sweep, jobs started {start} (the whole command"
            f"{', its starter started' if start == 'warm' else ''}): wall per job / import floor | "
            f"{cell(ratios)} | {verdict(statistics.median(ratios), GOALS['sweep_job'])} |"
        )
    for case, walls in r["bad"].items():
        lines.append(
            f"| (d) command to error, `python -m pipeline {case}` [s] | {cell(walls)} | "
            f"{verdict(statistics.median(walls), GOALS['bad_input_s'])} |"
        )
    syncs = r.get("syncs")  # (a run measured before this row existed has none)
    for backend in ("trainer", "accelerator") if syncs else ():
        ok = syncs[backend]["total"] <= syncs["bare"]["total"]
        lines.append(
            f"| (h) host-device syncs per training step, `backend={backend}` | {syncs[backend]['total']:g} "
            f"(bare loop {syncs['bare']['total']:g}) | ≤ the bare loop's: {'**met**' if ok else '**missed**'} |"
        )
    walls = r["sweep"]
    seq, par = walls["one at a time"], walls.get("2 at a time")
    if seq and par:
        lines.append(
            f"| (e) 4 tiny jobs, 2 at a time: throughput / one at a time | {seq / par:.2f} "
            f"({seq:.1f} s / {par:.1f} s) | {verdict(seq / par, GOALS['parallel'], at_most=False)} |"
        )
    else:
        lines.append(
            f"| (e) 4 tiny jobs, 2 at a time | not measured (`PARALLEL_OVERRIDES={PARALLEL_OVERRIDES!r}` "
            f"{'failed' if PARALLEL_OVERRIDES else 'unset'}) | ≥ {GOALS['parallel']} |"
        )

    lines += [
        "",
        "## (a) Steady-state step time",
        "",
        f"`model={s.model} batch_size={s.batch_size} train.max_length={s.max_length} "
        f"train.padding=max_length optim=adamw train.max_steps={s.steps}`, torch threads "
        f"{bare[0]['threads']} in the bare loop and {jobs['trainer'][0]['job.threads']:g} in the job. "
        "Step time: median wall time between the starts (the model's forward) of consecutive steps, the "
        "first 3 steps left out (the job's `train_step_ms`; the bare loop measures the same way).",
        "",
        "| loop | step [ms] | / bare |",
        "| --- | --- | --- |",
        f"| bare PyTorch loop (`bench/bare_loop.py`) | {cell([b['train_step_ms'] for b in bare])} | 1 |",
        f"| bare loop inside the pipeline's CPU peak tracker | {cell([b['train_step_ms'] for b in tracked])} "
        f"| {cell([t['train_step_ms'] / b['train_step_ms'] for t, b in zip(tracked, bare, strict=True)])} |",
    ]
    for backend, runs in jobs.items():
        lines.append(
            f"| pipeline job, `backend={backend}` | {cell([j['train_step_ms'] for j in runs])} | "
            f"{cell([j['train_step_ms'] / b['train_step_ms'] for j, b in zip(runs, bare, strict=True)])} |"
        )

    lines += [
        "",
        "## (b) Fixed overhead of one job, and (c) MLflow",
        "",
        "Fixed overhead = wall time of `python -m pipeline ...` (one run, from the command to its exit) "
        "less the training loop (`train_runtime_s`): everything a job costs besides training — both "
        "processes' start-up (the job's process forked from the starter, which imports torch & co. while "
        "the CLI composes the config and opens the MLflow store), imports, loading and tokenizing (the splits and the simulated step "
        "from outputs/cache after the first job), backend setup, evaluation "
        f"({s.eval_samples} samples of the test split and {s.eval_samples} of the validation split), MLflow, teardown. Import floor = wall time of "
        f'`python -c "import torch, transformers, mlflow"`, {floor_readings} at the start of each repeat: '
        f"{cell(floors)} s. MLflow = time inside "
        "the pipeline's `Tracker` (its construction, which imports mlflow and opens the store, and "
        "every call). Phases from `bench/probe.py` (stopwatches around the real code), in seconds, along the "
        "path from the command to its exit (they add up to the wall time; the job is forked before the CLI "
        "opens the store, so MLflow's opening runs beside it: the rows after the wall time):",
        "",
        "| phase | " + " | ".join(f"`backend={b}`" for b in jobs) + " |",
        "| --- |" + " --- |" * len(jobs),
    ]
    phase_rows = {b: job_phases(runs) for b, runs in jobs.items()}
    for i, (label, _) in enumerate(phase_rows["trainer"]):
        lines.append(
            f"| {label} | " + " | ".join(cell(rows[i][1], "{:.2f}") for rows in phase_rows.values()) + " |"
        )
    lines += [
        "",
        f"The same job inside a sweep of {SWEEP_POINTS} (`-m seed=a,b,c`, the same overrides): each job after the "
        "first, from its run's opening to its job process's end, less its training loop — the job's process "
        "forked from the sweep's starter, the splits and the simulated step from the caches, the MLflow store "
        "already open (seconds):",
        *backend_table("fixed overhead of a job inside a sweep", r["in_sweep"]),
    ]
    if r.get("kept"):
        lines += [
            "",
            f"The same single job with `{starter.KEEP_ENV}={KEEP_S}` (other seeds): the job starter kept from "
            "the command before with the same environment (a command the bench ran first), so the job's process "
            "is forked at once and trains while the CLI imports MLflow and opens its store. Fixed overhead = its "
            "CLI wall time less the training loop of the job above in the same repeat (the same shapes, trained "
            "with the CLI idle): its own loop, beside MLflow's import on these cores, runs slower (seconds):",
            *backend_table(
                "fixed overhead of one job, the starter kept",
                r["kept"],
                *(
                    [
                        ("training loop of the job above (subtracted)", train_s(jobs)),
                        ("its own training loop (`train_runtime_s`)", r["kept_train"]),
                    ]
                    if r.get("kept_train")
                    else []
                ),
            ),
        ]

    lines += [
        "",
        "## (d) Bad input",
        "",
        "Wall time from the command to its exit (code 2, one line on stderr).",
        "",
        "## (e) Parallel jobs",
        "",
        f"One `-m` sweep of 4 jobs (`model=tiny seed=0,1,2,3 train.max_steps={s.parallel_steps} "
        f"force=true`), run as is and with `{PARALLEL_OVERRIDES}` (`PARALLEL_OVERRIDES` in "
        "`bench/__main__.py`); wall time of the whole command, sweep parent run and report included.",
        "",
        "| sweep | wall [s] | throughput / one at a time |",
        "| --- | --- | --- |",
        *(
            f"| {name} | {wall:.1f} | {seq / wall:.2f} |" if wall and seq else f"| {name} | failed | |"
            for name, wall in walls.items()
        ),
        "",
        "## (f) Optimizer step time",
        "",
        f"`optimizer.step()` on `model={s.optim_model}` with fixed random gradients, each optimizer "
        f"built by the registry's direct factory; median over {s.optim_steps} steps after the first "
        "(which creates the state). Off CUDA, torchao's compiled step runs eagerly (as in a job). "
        "One run: compare optimizers within this table, not with other machines.",
        "",
        "| optimizer | step [ms] (min – max) | first step [ms] | / adamw |",
        "| --- | --- | --- | --- |",
    ]
    base = next((o["step_ms"] for o in r["optim"] if o["optim"] == "adamw" and "step_ms" in o), None)
    for o in r["optim"]:
        if "error" in o:
            lines.append(f"| {o['optim']} | not run: {o['error']} | | |")
        else:
            rel = f"{o['step_ms'] / base:.2f}" if base else ""
            lines.append(
                f"| {o['optim']} | {o['step_ms']:.1f} ({o['min_ms']:.1f} – {o['max_ms']:.1f}) | "
                f"{o['first_step_ms']:.1f} | {rel} |"
            )
    lines += ["", "## (g) A sweep of short jobs", "", *sweep_lines(r)]
    if syncs:
        lines += [
            "",
            "## (h) Host-device synchronisations per training step",
            "",
            f"`python -m bench.bare_loop --syncs {' '.join(SYNCS_JOB)}`: the job's training in one process, as "
            "`pipeline.job` runs it, on each backend, and the bare loop of the same config; on this machine's "
            "device. Each step's reads of a tensor's value by the host (`.item()`, `float()`, `bool()`: "
            "`aten._local_scalar_dense`, each a wait for the device's queue on a GPU), the mean over steps "
            "2-5; the optimizer's step and the data loader left out (`bench.bare_loop.HostSyncs`). The model's "
            "forward: its own reads (transformers' attention-mask check), the same in every loop; the rest of "
            "the step: what the loop reads (the bare loop: its `loss.item()`).",
            "",
            "| loop | per step | in the model's forward | in the rest of the step |",
            "| --- | --- | --- | --- |",
            *(
                f"| {name} | {syncs[key]['total']:g} | {syncs[key]['model']:g} | {syncs[key]['loop']:g} |"
                for key, name in (
                    ("bare", "bare PyTorch loop (`bench/bare_loop.py`)"),
                    ("trainer", "pipeline job, `backend=trainer`"),
                    ("accelerator", "pipeline job, `backend=accelerator`"),
                )
            ),
        ]
    out.write_text("\n".join(lines) + "\n")


def sweep_lines(r: dict) -> list[str]:
    """(g)'s section of the page: what was run, the job starters alive, the table."""
    floors, first, found = r["floors"], r.get("sweep8_first"), r.get("sweep8_starters")
    lines = [
        f"`python -m pipeline -m model=tiny seed=0,...,{SWEEP_JOBS - 1} train.max_steps=1 force=true` with "
        "`launcher.start_jobs=warm` (the default: each job's process forked from the sweep's starter) and "
        "`=cold` (a new interpreter per job); the whole command's wall time (Hydra, its job starter's start and "
        f"imports, the MLflow store, the parent run, the report) divided by its {SWEEP_JOBS} jobs, in seconds: "
        "what a user's sweep costs. The repeats run after the "
        f"same sweep ran once (its first run: the tiny model's splits tokenized and its {SWEEP_JOBS} batch shapes' steps "
        "simulated, each a new sequence length; every later run finds them in the caches, as a rerun, or "
        "a later seed whose batches have a length simulated already, does).",
    ]
    if found:  # (a run measured before the bench ended its starters before each (g) command has none)
        runs = [*([first["starters"]] if first else []), *found.get("warm", []), *found.get("cold", [])]
        fewest, most = min(f["others"] for f in runs), max(f["others"] for f in runs)
        lines += [
            "",
            f"Job starters alive as each of the {len(runs)} (g) commands began: {fewest}"
            f"{f' to {most}' if most != fewest else ''}, none of them the bench's (before each command it ended "
            f"those it had left, {sum(f['ended'] for f in runs)} in all: (b)'s kept starter, a (g) command's "
            "own still ending); the others are other commands', left alone. "
            "Each warm command started its own starter, as a user's sweep does.",
        ]
    lines += [
        "",
        "| jobs started | s per job | the command [s] | / import floor |",
        "| --- | --- | --- | --- |",
        *(
            f"| {start} | {cell(r['sweep8'][start], '{:.2f}')} | "
            f"{cell([j * SWEEP_JOBS for j in r['sweep8'][start]], '{:.1f}')} | "
            f"{cell([j / f for j, f in zip(r['sweep8'][start], floors, strict=True)])} |"
            for start in ("warm", "cold")
        ),
    ]
    if first:  # (a run measured before this row existed has none)
        lines.append(
            f"| warm, the sweep's first run (caches empty; measured once, before the repeats) | "
            f"{first['per_job']:.2f} | {first['per_job'] * SWEEP_JOBS:.1f} | {first['per_job'] / first['floor']:.3g} |"
        )
    lines += ["", f"Import floor: {cell(floors, '{:.2f}')} s; goal for warm: ≤ {GOALS['sweep_job']} of it."]
    return lines


MEASUREMENTS = "measurements.json"  # in the work folder: everything the page is written from


def sweep_first(work: Path, say) -> dict:
    """(g)'s first run, measured apart: it tokenizes the tiny model's splits and simulates its 8 batch shapes;
    every later one finds them in the caches, as any rerun or later seed of a shape does."""
    say(f"import floor, then the first {SWEEP_JOBS}-job tiny sweep (caches empty)")
    alive: dict = {}
    first = {"floor": import_floor(work), "per_job": sweep_per_job(work, "warm", alive)}
    return {**first, "starters": alive["warm"][0]}


def sweep_repeat(r: dict, rep: int, work: Path, say) -> None:
    """(g) in one repeat: the sweep with its jobs started warm and cold (in turn first), each command with none
    of the bench's job starters alive."""
    for start in ("warm", "cold")[:: 1 if rep % 2 == 0 else -1]:
        r["sweep8"][start].append(sweep_per_job(work, start, r["sweep8_starters"]))
    found = r["sweep8_starters"]["warm"][-1]
    say(
        f"  {SWEEP_JOBS}-job sweep, s per job: warm {r['sweep8']['warm'][-1]:.2f}, cold "
        f"{r['sweep8']['cold'][-1]:.2f} (job starters alive before the warm one: {found['others']}; the bench's "
        f"ended first: {found['ended']})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="The pipeline's own cost (make bench / make bench-full).")
    parser.add_argument("--full", action="store_true", help="more repeats, bigger batch, more steps")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "RESULTS.md")
    parser.add_argument(
        "--render",
        type=Path,
        metavar="WORK",
        help="write --out again from a run's work folder, measuring nothing",
    )
    parser.add_argument(
        "--only",
        choices=["g"],
        help="measure this row alone (its import floors, first run and repeats) and print it; RESULTS.md is "
        "left as it is",
    )
    args = parser.parse_args()
    if args.render:
        kept = json.loads((args.render / MEASUREMENTS).read_text())
        started, s = datetime.fromisoformat(kept["started"]), Settings(**kept["settings"])
        write_results(args.out, s, kept["command"], kept["r"], started, kept["took"], args.render.resolve())
        print(args.out.read_text())
        return
    s = FULL if args.full else QUICK
    started = datetime.now()
    work = ROOT / "outputs" / "bench" / f"{started:%Y-%m-%d_%H-%M-%S}"
    work.mkdir(parents=True)

    def say(text: str) -> None:
        print(f"[bench {(datetime.now() - started).total_seconds():4.0f} s] {text}", flush=True)

    say(f"work files in {work}")
    if args.only == "g":
        r = {"floors": [], "floor_readings": FLOOR_READINGS, "sweep8": {"warm": [], "cold": []}}
        r["sweep8_first"], r["sweep8_starters"] = sweep_first(work, say), {}
        for rep in range(s.repeats):
            say(f"repeat {rep + 1}/{s.repeats}: import floor, the {SWEEP_JOBS}-job sweeps")
            r["floors"].append(import_floor(work))
            sweep_repeat(r, rep, work, say)
        (work / MEASUREMENTS).write_text(
            json.dumps({"r": r, "settings": asdict(s), "only": "g"}, default=str)
        )
        print("\n".join(sweep_lines(r)))
        return
    # not measured: creates the MLflow store and the CPU peak-FLOP/s cache, warms the file cache
    pipeline_job(Settings(**{**asdict(s), "steps": 3}), "trainer", 10_000, work)
    r = {"floors": [], "jobs": {"trainer": [], "accelerator": []}, "bare": [], "tracked": []}
    r["floor_readings"] = FLOOR_READINGS
    r["sweep8"] = {"warm": [], "cold": []}
    r["sweep8_first"], r["sweep8_starters"] = sweep_first(work, say), {}
    r["in_sweep"] = {"trainer": [], "accelerator": []}
    r["kept"] = {"trainer": [], "accelerator": []}
    r["kept_train"] = {"trainer": [], "accelerator": []}
    for rep in range(s.repeats):
        say(f"repeat {rep + 1}/{s.repeats}: import floor, pipeline jobs, bare loops")
        r["floors"].append(import_floor(work))
        # not measured: starts the starter that the kept rows of (b) find running (it ends KEEP_S after the last,
        # or as (g) begins: each (g) command starts with none of the bench's alive)
        pipeline_job(Settings(**{**asdict(s), "steps": 3}), "trainer", 10_001 + rep, work, kept=True)
        for backend in ("trainer", "accelerator")[:: 1 if rep % 2 == 0 else -1]:
            r["jobs"][backend].append(pipeline_job(s, backend, rep, work))
            kept = pipeline_job(s, backend, 100 + rep, work, kept=True)
            # less the training loop of the job before (the same shapes), not its own: its own trains beside the
            # CLI's MLflow import, slower where cores are few (counting that as training would flatter the row)
            r["kept"][backend].append(kept["wall"] - r["jobs"][backend][-1]["train_runtime_s"])
            r["kept_train"][backend].append(kept["train_runtime_s"])
            r["in_sweep"][backend].append(statistics.median(sweep_overheads(s, backend, rep, work)))
        config = r["jobs"]["trainer"][-1]["config"]
        r["bare"].append(bare_loop(config, work, f"bare-{rep}"))
        r["tracked"].append(bare_loop(config, work, f"bare-tracked-{rep}", peak_tracker=True))
        sweep_repeat(r, rep, work, say)
        say(
            f"  step ms: trainer {r['jobs']['trainer'][-1]['train_step_ms']:.1f}, accelerator "
            f"{r['jobs']['accelerator'][-1]['train_step_ms']:.1f}, bare {r['bare'][-1]['train_step_ms']:.1f}"
        )
    say("bad input")
    r["bad"] = {case: [bad_input(a, work) for _ in range(3)] for case, a in BAD_INPUTS.items()}
    say("4 tiny jobs, one at a time, then 2 at a time")
    r["sweep"] = parallel_sweeps(s, work)
    say("optimizer step times")
    r["optim"] = optimizer_steps(s, work)
    say("host-device syncs per training step")
    r["syncs"] = host_syncs(work)
    command = "make bench-full" if args.full else "make bench"
    took = (datetime.now() - started).total_seconds()
    # kept before the page is written: `--render WORK` writes it again without measuring
    kept = {"r": r, "settings": asdict(s), "command": command, "started": started.isoformat(), "took": took}
    (work / MEASUREMENTS).write_text(json.dumps(kept, default=str))
    write_results(args.out, s, command, r, started, took, work)
    say(f"wrote {args.out}")
    print(args.out.read_text())


if __name__ == "__main__":
    main()
