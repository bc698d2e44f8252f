"""bench/RESULTS.md from what `make bench` measured (bench/rows.py): the goals, each row's table, where a job's
time goes."""

from __future__ import annotations

import os
import platform
import statistics
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

from bench.rows import KEEP_S, PARALLEL_OVERRIDES, ROOT, SYNCS_JOB, Settings, interval, step_ratios
from pipeline import starter

GOALS = {
    "step": 1.03,
    "overhead": 1.0,  # the job starter kept from the command before: / import floor
    "cold": 1.5,  # one cold command: / import floor
    "in_sweep_s": 1.2,  # a job inside a sweep: seconds
    "mlflow": 0.02,
    "bad_input_s": 2.0,
    "parallel": 1.7,
    "sweep_job": 0.35,
}


def work_s(job: dict) -> float:
    """A job's own work: its training loop (train_runtime_s) and its evaluations after it (eval_runtime_s; a
    run measured before that metric existed counts none)."""
    return job["train_runtime_s"] + job.get("eval_runtime_s", 0.0)


def overhead_s(job: dict) -> float:
    """CLI wall time less the job's training and evaluation (work_s): start-up, loading, logging, exit."""
    return job["wall"] - work_s(job)


def mlflow_s(job: dict) -> float:
    return sum(v for k, v in job.items() if k.startswith("mlflow."))


def work_by_backend(jobs: dict[str, list[dict]]) -> dict[str, list[float]]:
    """Each backend's training loops and evaluations (work_s), one per repeat."""
    return {b: [work_s(j) for j in runs] for b, runs in jobs.items()}


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


def ratio_cell(values: list[float]) -> str:
    """The mean ratio ± its 95% interval (relative), and how many repeats it is over."""
    found = interval(values)
    if found is None:
        return f"{statistics.fmean(values):.3g} (1 repeat: no interval)"
    mean, half = found
    return f"{mean:.3g} ± {100 * half:.1f}% ({len(values)} repeats)"


def noisy_verdict(values: list[float], goal: float) -> str:
    """≤ goal: met where the whole 95% interval is, missed where none of it is, else within noise."""
    found = interval(values)
    if found is None:
        return verdict(statistics.fmean(values), goal)
    mean, half = found
    low, high = mean * (1 - half), mean * (1 + half)
    said = "**met**" if high <= goal else "**missed**" if low > goal else "**within noise**"
    return f"≤ {goal:g}: {said}"


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
            "job process: tokenizer + data (read back, or read, tokenized and kept) + model loading",
            each(lambda j: j["job.load_tokenizer"] + j["job.load_data"] + j["job.load_model"]),
        ),
        (
            "job process: backend setup",
            each(lambda j: j["job.backend_train"] - work_s(j)),
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
        (
            "evaluation of the test and validation splits (`eval_runtime_s`, not overhead)",
            each(lambda j: j.get("eval_runtime_s", 0.0)),
        ),
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
        f"- logs and work files: `{work.relative_to(ROOT) if work.is_relative_to(ROOT) else work}/`",
        "",
        f"Each cell: median (min – max) over {s.repeats} repeats, run interleaved; ratios are taken within a",
        "repeat. Absolute times drift on shared machines: read the ratios.",
        "",
        "## Goals",
        "",
        "| goal | measured | target |",
        "| --- | --- | --- |",
    ]
    steps = r.get("steps")  # (a run measured before the A/A row existed has none)
    if steps:
        ratios = step_ratios(steps)
        lines.append(
            "| (a) A/A: the bare loop after the jobs / the bare loop before them (the machine's noise) | "
            f"{ratio_cell(ratios['bare'])} | the noise the step ratios are read against |"
        )
        for backend in jobs:
            lines.append(
                f"| (a) step time, `backend={backend}` / bare loop | {ratio_cell(ratios[backend])} | "
                f"{noisy_verdict(ratios[backend], GOALS['step'])} |"
            )
    for backend, runs in jobs.items() if not steps else ():
        ratios = [j["train_step_ms"] / b["train_step_ms"] for j, b in zip(runs, bare, strict=True)]
        lines.append(
            f"| (a) step time, `backend={backend}` / bare loop | {cell(ratios)} | "
            f"{verdict(statistics.median(ratios), GOALS['step'])} |"
        )
    for backend, runs in jobs.items():
        ratios = [overhead_s(j) / f for j, f in zip(runs, floors, strict=True)]
        lines.append(
            f"| (b) fixed overhead of one cold command, `backend={backend}` / import floor | {cell(ratios)} | "
            f"{verdict(statistics.median(ratios), GOALS['cold'])} |"
        )
    for backend, values in r.get("kept", {}).items():
        ratios = [v / f for v, f in zip(values, floors, strict=True)]
        lines.append(
            f"| (b) fixed overhead of one job, the job starter kept from the command before "
            f"(`{starter.KEEP_ENV}={KEEP_S}`), `backend={backend}` / import floor | {cell(ratios)} | "
            f"{verdict(statistics.median(ratios), GOALS['overhead'])} |"
        )
    for backend, values in r["in_sweep"].items():
        lines.append(
            f"| (b) fixed overhead of one job inside a sweep, `backend={backend}` [s] | {cell(values)} | "
            f"{verdict(statistics.median(values), GOALS['in_sweep_s'], unit=' s')} |"
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
            f"| (g) {s.sweep_jobs}-job tiny sweep, jobs started {start} (the whole command"
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
        *(
            [
                f"| bare loop before the jobs (A/A) | {cell(r['steps']['bare_before'][: len(bare)])} | "
                f"{cell([a / b['train_step_ms'] for a, b in zip(r['steps']['bare_before'], bare, strict=False)])} |"
            ]
            if steps
            else []
        ),
        f"| bare loop inside the pipeline's CPU peak tracker | {cell([b['train_step_ms'] for b in tracked])} "
        f"| {cell([t['train_step_ms'] / b['train_step_ms'] for t, b in zip(tracked, bare, strict=True)])} |",
    ]
    for backend, runs in jobs.items():
        lines.append(
            f"| pipeline job, `backend={backend}` | {cell([j['train_step_ms'] for j in runs])} | "
            f"{cell([j['train_step_ms'] / b['train_step_ms'] for j, b in zip(runs, bare, strict=True)])} |"
        )

    if steps:
        n = len(steps["bare"])
        lines += [
            "",
            f"The table above holds the main repeats ({len(bare)}). The goals' (a) rows take {n} repeats: those, and "
            f"repeats of (a) alone (the bare loop, each backend's job in turn first, the bare loop again) added "
            f"until each ratio's 95% interval (Student's t over the repeats' ratios) was within "
            f"±{s.step_noise_pct:g}% of its mean, or {s.step_repeats} repeats, or {s.step_cap_s:.0f} s of added "
            "repeats. The A/A ratio compares the bare loop with itself, run around the jobs as the jobs are run "
            "around it: its interval is the machine's own noise. A goal is met where the whole interval is within "
            "it, missed where none of it is, and within noise otherwise.",
        ]
    lines += [
        "",
        "## (b) Fixed overhead of one job, and (c) MLflow",
        "",
        "Fixed overhead = wall time of `python -m pipeline ...` (one run, from the command to its exit) "
        "less the training loop (`train_runtime_s`) and the evaluations after it (`eval_runtime_s`): everything "
        "a job costs besides training and evaluating — both "
        "processes' start-up (the job's process forked from the starter, which imports torch & co. while "
        "the CLI composes the config and opens the MLflow store), imports, loading and tokenizing (the splits and the simulated step "
        "from outputs/cache after the first job), backend setup, MLflow, teardown; the evaluation "
        f"({s.eval_samples} samples of the test split and {s.eval_samples} of the validation split) is shown "
        "apart. Import floor = wall time of "
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
        f"The same job inside a sweep of {s.sweep_points} (`-m seed=a,b,...`, the same overrides): each job after the "
        "first, from its run's opening to its job process's end, less its training loop and evaluations — the "
        "job's process "
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
            "CLI wall time less the training loop and evaluations of the job above in the same repeat (the same "
            "shapes, run with the CLI idle): its own loop, beside MLflow's import on these cores, runs slower "
            "(seconds):",
            *backend_table(
                "fixed overhead of one job, the starter kept",
                r["kept"],
                *(
                    [
                        (
                            "training loop and evaluations of the job above (subtracted)",
                            work_by_backend(jobs),
                        ),
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
        "`bench/rows.py`); wall time of the whole command, sweep parent run and report included.",
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
    lines += ["", "## (g) A sweep of short jobs", "", *sweep_lines(s, r)]
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


def sweep_lines(s: Settings, r: dict) -> list[str]:
    """(g)'s section of the page: what was run, the job starters alive, the table."""
    floors, first, found = r["floors"], r.get("sweep8_first"), r.get("sweep8_starters")
    lines = [
        f"`python -m pipeline -m model=tiny seed=0,...,{s.sweep_jobs - 1} train.max_steps=1 force=true` with "
        "`launcher.start_jobs=warm` (the default: each job's process forked from the sweep's starter) and "
        "`=cold` (a new interpreter per job); the whole command's wall time (Hydra, its job starter's start and "
        f"imports, the MLflow store, the parent run, the report) divided by its {s.sweep_jobs} jobs, in seconds: "
        "what a user's sweep costs. The repeats run after the "
        f"same sweep ran once (its first run: the tiny model's splits tokenized and its {s.sweep_jobs} batch shapes' steps "
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
            f"{cell([j * s.sweep_jobs for j in r['sweep8'][start]], '{:.1f}')} | "
            f"{cell([j / f for j, f in zip(r['sweep8'][start], floors, strict=True)])} |"
            for start in ("warm", "cold")
        ),
    ]
    if first:  # (a run measured before this row existed has none)
        lines.append(
            f"| warm, the sweep's first run (caches empty; measured once, before the repeats) | "
            f"{first['per_job']:.2f} | {first['per_job'] * s.sweep_jobs:.1f} | {first['per_job'] / first['floor']:.3g} |"
        )
    lines += ["", f"Import floor: {cell(floors, '{:.2f}')} s; goal for warm: ≤ {GOALS['sweep_job']} of it."]
    return lines
