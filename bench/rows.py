"""How each row of `make bench` is measured (bench/__main__.py runs them in turn): the commands it runs, each
through the real CLI, and what it reads back from them. The page they make: bench/results.py."""

from __future__ import annotations

import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
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
# (h): 6 steps of the tiny model (its steps 2-5 counted), in one process
SYNCS_JOB = ["model=tiny", "data.max_train_samples=128", "data.max_eval_samples=32", "train.max_steps=6"]


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
    # (a): more interleaved repeats of the step ratios alone, until each ratio's 95% interval is within
    # ±step_noise_pct of its mean, or step_repeats repeats (the main ones counted), or step_cap_s seconds of them
    step_repeats: int = 10
    step_cap_s: float = 900
    step_noise_pct: float = 3.0
    sweep_jobs: int = 8  # (g)
    sweep_points: int = 3  # (b) in a sweep: jobs of one sweep, the first left out (it fills the caches)
    floor_readings: int = 3  # a repeat's import floor: the median of this many (one process start is noisy)
    bad_input_repeats: int = 3  # (d)


QUICK = Settings(2, "minilm", 8, 20, 64, 64, 5, "tiny", 5)
FULL = Settings(5, "minilm", 16, 60, 64, 1000, 20, "minilm", 10)
# `make bench`'s every row once, on the tiny model, at the fewest steps and jobs that still give each figure (a
# steady step after 3 warm-up steps, a job inside a sweep after its first): a check of the bench's own code
SMOKE = Settings(1, "tiny", 8, 6, 32, 16, 2, "tiny", 1, step_repeats=2, sweep_jobs=2, sweep_points=2,
                 floor_readings=1, bad_input_repeats=1)  # fmt: skip


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


def sweep_overheads(s: Settings, backend: str, rep: int, work: Path) -> list[float]:
    """(b) inside a sweep: a sweep of `s.sweep_points` jobs (as (b)'s single run, other seeds); for each job
    after the first, its run's time from opening to its job process's end, less its training loop and its
    evaluations (s)."""
    from mlflow import MlflowClient

    name = f"sweep-{backend}-{rep}"
    seeds = ",".join(str(1000 * (rep + 1) + i) for i in range(s.sweep_points))
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
        (r.info.end_time - r.info.start_time) / 1000
        - r.data.metrics["train_runtime_s"]
        - r.data.metrics["eval_runtime_s"]
        for r in runs[1:]
    ]


def step_ratios(steps: dict[str, list[float]]) -> dict[str, list[float]]:
    """(a)'s ratios, one per repeat: each backend's step time over the bare loop's run after it, and the A/A
    ratio, the bare loop's run after the jobs over its run before them (the machine's own noise)."""
    after = steps["bare"]
    return {
        **{b: [j / a for j, a in zip(steps[b], after, strict=True)] for b in ("trainer", "accelerator")},
        "bare": [a / b for a, b in zip(after, steps["bare_before"], strict=True)],
    }


def interval(values: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """The mean and the half-width of its `level` confidence interval (Student's t), relative to the mean (a
    fraction); None for fewer than 2 values."""
    if len(values) < 2:
        return None
    from scipy import stats as scipy_stats

    mean = statistics.fmean(values)
    half = scipy_stats.t.ppf((1 + level) / 2, len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5
    return mean, half / mean


def steps_settled(steps: dict[str, list[float]], noise_pct: float) -> bool:
    """Each ratio of (a), the A/A one among them, within ±noise_pct of its mean at 95%."""
    found = [interval(v) for v in step_ratios(steps).values()]
    return all(f is not None and f[1] * 100 <= noise_pct for f in found)


def bare_config(s: Settings, work: Path) -> Path:
    """The config (a)'s jobs are composed from (job_overrides), saved for the bare loop's runs."""
    from omegaconf import OmegaConf

    from bench.bare_loop import compose

    overrides = [o for o in job_overrides(s, "trainer", 0, work, "bare") if not o.startswith("hydra.")]
    path = work / "bare-config.yaml"
    OmegaConf.save(compose(overrides), path, resolve=True)
    return path


def step_repeat(s: Settings, config: Path, rep: int, work: Path) -> dict[str, float]:
    """(a) alone, once: the bare loop, each backend's job (in turn first), the bare loop again; step times (ms)."""
    found = {"bare_before": bare_loop(config, work, f"bare-before-{rep}")["train_step_ms"]}
    for backend in ("trainer", "accelerator")[:: 1 if rep % 2 == 0 else -1]:
        found[backend] = pipeline_job(s, backend, 200 + rep, work)["train_step_ms"]
    found["bare"] = bare_loop(config, work, f"bare-{rep}")["train_step_ms"]
    return found


def bare_loop(config: Path, work: Path, name: str, peak_tracker: bool = False) -> dict:
    cmd = [PY, "-m", "bench.bare_loop", str(config), *(["--peak-tracker"] if peak_tracker else [])]
    run(cmd, work / f"{name}.log")
    return json.loads((work / f"{name}.log").read_text().strip().splitlines()[-1])


def import_floor(work: Path, readings: int) -> float:
    cmd = [PY, "-c", "import torch, transformers, mlflow"]
    return statistics.median(run(cmd, work / "floor.log")[0] for _ in range(readings))


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


def sweep_per_job(work: Path, start: str, jobs: int, alive: dict | None = None) -> float:
    """(g) Wall time of a `jobs`-job tiny sweep of one step each (the whole command: sweep start, its job starter's
    start, parent run, report), divided by its jobs; `start`: launcher.start_jobs. The bench's starters are
    ended first (end_own_starters: what it found goes into `alive`, a list per start)."""
    found = end_own_starters()
    if alive is not None:
        alive.setdefault(start, []).append(found)
    seeds = ",".join(map(str, range(jobs)))
    overrides = [
        "model=tiny",
        f"seed={seeds}",
        "train.max_steps=1",
        "force=true",
        f"launcher.start_jobs={start}",
    ]
    overrides += [f"outputs_dir={work}", f"hydra.sweep.dir={work}/multirun/sweep8-{start}-{time.time_ns()}"]
    wall, _ = run([PY, "-m", "pipeline", "-m", *overrides], work / f"sweep8-{start}.log")
    return wall / jobs


def optimizer_steps(s: Settings, work: Path) -> list[dict]:
    log = work / "optim_steps.log"
    run([PY, "-m", "bench.optim_steps", s.optim_model, str(s.optim_steps)], log)
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def host_syncs(work: Path) -> dict[str, dict]:
    """(h) bench.bare_loop.HostSyncs' reads per step, for each backend and the bare loop."""
    log = work / "syncs.log"
    run([PY, "-m", "bench.bare_loop", "--syncs", *SYNCS_JOB, f"outputs_dir={work}"], log)
    return json.loads(log.read_text().strip().splitlines()[-1])


def sweep_first(s: Settings, work: Path, say) -> dict:
    """(g)'s first run, measured apart: it tokenizes the tiny model's splits and simulates its jobs' batch shapes;
    every later one finds them in the caches, as any rerun or later seed of a shape does."""
    say(f"import floor, then the first {s.sweep_jobs}-job tiny sweep (caches empty)")
    alive: dict = {}
    first = {
        "floor": import_floor(work, s.floor_readings),
        "per_job": sweep_per_job(work, "warm", s.sweep_jobs, alive),
    }
    return {**first, "starters": alive["warm"][0]}


def sweep_repeat(s: Settings, r: dict, rep: int, work: Path, say) -> None:
    """(g) in one repeat: the sweep with its jobs started warm and cold (in turn first), each command with none
    of the bench's job starters alive."""
    for start in ("warm", "cold")[:: 1 if rep % 2 == 0 else -1]:
        r["sweep8"][start].append(sweep_per_job(work, start, s.sweep_jobs, r["sweep8_starters"]))
    found = r["sweep8_starters"]["warm"][-1]
    say(
        f"  {s.sweep_jobs}-job sweep, s per job: warm {r['sweep8']['warm'][-1]:.2f}, cold "
        f"{r['sweep8']['cold'][-1]:.2f} (job starters alive before the warm one: {found['others']}; the bench's "
        f"ended first: {found['ended']})"
    )
