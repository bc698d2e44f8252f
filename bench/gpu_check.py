"""`make test-gpu`: what the pipeline measures on a GPU, checked against what it should be, in under 12 minutes
(docs/gpu.md#make-test-gpu says each step and check).

First the GPUs: torch must see those `nvidia-smi -L` lists, else the check stops with one line and fails. Then
each step (STEPS: known_allocation, sweep, budget, batch_search, ddp with 2 GPUs; real_qlora, real_lora,
real_full only when named, as bench/gpu_lease.sh names them) runs as a process group of its own under a time-out
(SIGTERM at the deadline, SIGKILL GRACE_S later), and its figures are checked, each a named check of the
summary: peaks against the plan for this GPU (PLAN_GOAL_PCT; REAL_GOAL_PCT for Llama-3.1-8B's real-size points),
an out-of-memory point that fails alone, warm parallel jobs' own peaks, the batch search within its budget.

Each time-out is 1.5 times what the first GPU run needed (an H200: the known allocation 11 s, the batch search
46 s, a job started cold up to 40 s: JOB_S a job, START_S a sweep's own start), under 12 minutes on one GPU in
all (`one_gpu_budget_s`). The summary is printed and written to OUT/summary.md, and into docs/gpu.md between the
gpu-check markers only when every check passed on a GPU. The exit code is 1 when a step or a check failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from bench.gpu_summary import DOCS, figure_rows, status, summary_text, write_docs

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 12 * 60  # the whole check on one GPU
# the time-outs: 1.5 x what the first GPU run needed (an H200, 2026-12-04; docs/gpu.md)
JOB_S = 60  # a job: 1.5 x the slowest cold job's 40 s (a warm one needs far less)
START_S = 20  # a sweep command's own start (Hydra, MLflow, the store) and its report
OWN_S = 40  # the script's own work outside the steps: importing torch and MLflow, reading the stores
GRACE_S = 5  # between a timed-out step's SIGTERM and its SIGKILL
NVIDIA_SMI_TIMEOUT_S = 15
PLAN_GOAL_PCT = 5.0
REAL_GOAL_PCT = 3.0  # the real-size points' goal
KNOWN_MB = 256
OOM_BATCH, FIT_BATCHES, BUDGET_MB = 4096, (8, 32), 2000
SEARCH_BUDGET_MB = 1000
SHORT = {"data.val_fraction": "0", "data.max_eval_samples": "256"}  # evaluation is not what is checked here
# the real-size points: an 8B decoder made on the GPU with random weights (the memory does not depend on their
# values), 2 steps (the second starts with the optimizer state in place) at 1024 tokens, batch 1 (`--set
# batch_size=2`: the next)
REAL = {
    "task": "causal_lm",
    "model": "llama-3.1-8b",
    "model.pretrained": "false",
    "train.max_length": "1024",
    "train.padding": "max_length",
    "train.max_steps": "2",
    "batch_size": "1",
    "data.val_fraction": "0",
    "data.max_train_samples": "64",
    "data.max_eval_samples": "4",
}


@dataclass(frozen=True)
class Step:
    name: str
    what: str
    timeout_s: float | None  # None: a sweep's, by its jobs (`step_timeout`)
    overrides: dict[str, str] = field(default_factory=dict)  # a sweep's (none: the known allocation)
    exit_code: int = 0  # what its command should end with
    gpus: int = 0  # skipped where fewer GPUs are visible
    default: bool = True  # in the run that names no steps (`make test-gpu`); else only when named


STEPS = (
    Step("known_allocation", f"PeakMemory around a {KNOWN_MB} MiB tensor", 20),  # 1.5 x 11 s
    Step(
        "sweep",
        "both backends x 3 optimizers on minilm",
        None,
        {
            "model": "minilm",
            "backend": "trainer,accelerator",
            "optim": "adamw,adafactor,adamw_8bit",
            "train.max_steps": "20",
            **SHORT,
        },
    ),
    Step(
        "budget",
        f"launcher=parallel, batch {OOM_BATCH}, {FIT_BATCHES[0]}, {FIT_BATCHES[1]} within {BUDGET_MB} MB",
        None,
        {
            "launcher": "parallel",
            "model": "minilm",
            "backend": "accelerator",
            "optim": "adamw",
            "batch_size": ",".join(map(str, (OOM_BATCH, *FIT_BATCHES))),
            "memory_budget_mb": str(BUDGET_MB),
            "train.padding": "max_length",
            "train.max_steps": "10",
            **SHORT,
        },
        exit_code=1,  # the point that runs out of memory fails
    ),
    Step(
        "batch_search",
        f"find_batch_size=true, Trainer backend, within {SEARCH_BUDGET_MB} MB",
        70,  # 1.5 x 46 s
        {
            "find_batch_size": "true",
            "model": "minilm",
            "backend": "trainer",
            "optim": "adamw",
            "memory_budget_mb": str(SEARCH_BUDGET_MB),
            **SHORT,
        },
    ),
    Step(
        "ddp",
        "2-rank Trainer DDP over NCCL",
        None,
        {
            "model": "minilm",
            "backend": "trainer",
            "optim": "adamw",
            "launcher.nproc_per_job": "2",
            "train.max_steps": "20",
            **SHORT,
        },
        gpus=2,
    ),
    *(
        Step(
            f"real_{name}",
            f"Llama-3.1-8B as a language model, {what}, seq 1024",
            None,
            {**REAL, **settings},
            default=False,
        )
        for name, what, settings in (
            (
                "qlora",
                "QLoRA + AdamW, bf16 compute",
                {"peft": "qlora", "optim": "adamw", "train.precision": "bf16"},
            ),
            (
                "lora",
                "LoRA + AdamW, the recipe: bf16 base, fp32 adapters",
                {"peft": "lora", "optim": "adamw", "train.precision": "bf16"},
            ),
            (
                "full",
                "full, 8-bit AdamW, bf16 weights",
                {"optim": "adamw_8bit", "train.precision": "bf16_pure"},
            ),
        )
    ),
)


def points(overrides: dict[str, str]) -> int:
    return math.prod(len(v.split(",")) for v in overrides.values())


def step_timeout(step: Step, overrides: dict[str, str]) -> float:
    """A step's time-out: its own, or a sweep's: START_S, and JOB_S for each round of its jobs (its points, two
    at a time under launcher=parallel)."""
    if step.timeout_s is not None:
        return step.timeout_s
    at_once = 2 if overrides.get("launcher") == "parallel" else 1
    return START_S + math.ceil(points(overrides) / at_once) * JOB_S


def one_gpu_budget_s() -> float:
    """The longest the check can take on one GPU: nvidia-smi's time-out, each step's time-out and grace, and the
    script's own work."""
    steps = [s for s in STEPS if s.gpus <= 1 and s.default]
    return NVIDIA_SMI_TIMEOUT_S + OWN_S + sum(step_timeout(s, s.overrides) + GRACE_S for s in steps)


assert one_gpu_budget_s() < BUDGET_S, "the steps' time-outs on one GPU must sum under 12 minutes"


@dataclass
class Check:
    name: str
    ok: bool | None  # None: skipped (`measured` says why)
    measured: str
    expected: str


def run(command: list[str], log: Path, timeout: float, env: dict | None = None) -> tuple[int, float, str]:
    """(exit code, seconds, note) of a command whose output goes to the console and to `log`. It runs in a new
    session (its own process group); at `timeout` the group gets SIGTERM, SIGKILL GRACE_S later, and the
    note says it timed out. Its output is read in a thread, so the deadline holds whatever the command does
    with its output."""
    print(f"\n[gpu-check] $ {shlex.join(command)}  (time-out {timeout:.0f} s)", flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )

    def copy() -> None:  # until every process holding the pipe has closed it
        with log.open("w") as out:
            for line in proc.stdout:
                sys.stdout.write(line)
                out.write(line)
                out.flush()

    reader = threading.Thread(target=copy, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout)
        note = f"exit {code}"
    except subprocess.TimeoutExpired:
        end_group(proc)
        code, note = 124, f"timed out after {timeout:.0f} s"
    except BaseException:  # this script stopped (Ctrl-C, or SIGTERM: `stopped`): the step's group goes too
        end_group(proc)
        raise
    reader.join(timeout=GRACE_S)  # a process outside the group may still hold the pipe: not waited for
    return code, time.perf_counter() - start, note


def end_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group of `proc` (a sweep then records its runs as KILLED), SIGKILL to whatever of
    the group is left once `proc` has ended or GRACE_S have passed."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def listed_gpus(nvidia_smi: str) -> tuple[int | None, str]:
    """How many GPUs `<nvidia_smi> -L` lists (None: no such command here), and why it failed, if it did."""
    command = [*shlex.split(nvidia_smi), "-L"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except FileNotFoundError:
        return None, ""
    except subprocess.TimeoutExpired:
        return 0, f"`{shlex.join(command)}` did not answer in {NVIDIA_SMI_TIMEOUT_S} s"
    if done.returncode != 0:
        said = (done.stdout + done.stderr).strip().splitlines()
        return 0, f"`{shlex.join(command)}` failed: {said[0] if said else f'exit {done.returncode}'}"
    return sum(line.startswith("GPU ") for line in done.stdout.splitlines()), ""


def device_check(nvidia_smi: str, allow_cpu: bool) -> tuple[Check, int]:
    """Whether torch sees the GPUs nvidia-smi lists (as many as CUDA_VISIBLE_DEVICES leaves visible), and how
    many it sees."""
    import torch

    listed, error = listed_gpus(nvidia_smi)
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    expected = listed or 0
    if visible is not None:
        expected = min(expected, len([d for d in visible.split(",") if d.strip()]))
    shown = "no nvidia-smi" if listed is None else f"nvidia-smi lists {listed}"
    if visible is not None:
        shown += f", CUDA_VISIBLE_DEVICES={visible!r}"
    measured = f"torch {torch.__version__} sees {seen}; {shown}"
    name = "GPUs: torch sees those nvidia-smi lists"
    if error:
        return Check(name, False, f"{error}; torch sees {seen}", "nvidia-smi answers"), seen
    if seen < expected:
        why = (
            "it is a CPU-only wheel (torch.version.cuda is None)"
            if torch.version.cuda is None
            else f"it is built for CUDA {torch.version.cuda}: does this driver support it? (nvidia-smi's header)"
        )
        measured = f"{shown} but torch {torch.__version__} sees {seen}: {why}; install the torch wheel for this driver"
        return Check(name, False, measured, f"{expected} seen"), seen
    if seen == 0:
        if allow_cpu:
            return Check(
                name, True, f"{measured}: the steps run on CPU (--allow-cpu)", "none (--allow-cpu)"
            ), 0
        return Check(name, False, f"{measured}: no GPU here", "at least 1 (--allow-cpu: run on CPU)"), 0
    return Check(name, True, measured, f"{max(expected, 1)} or more seen"), seen


def known_allocation(device: str) -> None:
    """Print (one `gpu-check:` JSON line) the pipeline's peak tracker's figures around a KNOWN_MB MiB tensor."""
    import torch

    from pipeline import MB
    from pipeline.memory import PeakMemory

    with PeakMemory(torch.device(device)) as peak:
        block = torch.empty(KNOWN_MB * MB, dtype=torch.uint8, device=device)
        del block
    print("gpu-check: " + json.dumps(peak.metrics()), flush=True)


def known_allocation_checks(log: Path) -> list[Check]:
    name = f"peak of a known allocation ({KNOWN_MB} MiB)"
    lines = [
        line
        for line in (log.read_text().splitlines() if log.exists() else [])
        if line.startswith("gpu-check: ")
    ]
    if not lines:
        return [Check(name, False, "no figures (see known_allocation.log)", f"{KNOWN_MB} MB ± 2%")]
    m = json.loads(lines[-1].split(" ", 1)[1])
    peak, reserved = m["peak_memory_mb"], m.get("peak_memory_reserved_mb")
    ok = abs(peak / KNOWN_MB - 1) <= 0.02 and (reserved is None or reserved >= peak)
    measured = f"{peak:.2f} MB" + ("" if reserved is None else f" (reserved {reserved:.2f} MB)")
    return [
        Check(name, ok, measured, f"{KNOWN_MB} MB ± 2%" + ("" if reserved is None else ", reserved ≥ it"))
    ]


def job_runs(store: Path) -> list:
    """The job runs (not the sweep's parent run) in an MLflow sqlite store."""
    if not store.exists():
        return []
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{store}")
    return [
        r
        for e in client.search_experiments()
        for r in client.search_runs([e.experiment_id], max_results=1000)
        if r.data.tags.get("kind") != "sweep"
    ]


def on(run, device: str) -> bool:
    return run.data.params.get("device", "").startswith(device)


def peak_and_plan(run) -> tuple[float | None, float | None]:
    m = run.data.metrics
    return m.get("peak_memory_mb"), m.get("predicted_peak_mb")


def within_plan(run, goal: float = PLAN_GOAL_PCT) -> bool:
    peak, predicted = peak_and_plan(run)
    return bool(peak and predicted) and abs(100 * (predicted / peak - 1)) <= goal


def plan_check(run, label: str, goal: float = PLAN_GOAL_PCT) -> Check:
    peak, predicted = peak_and_plan(run)
    name = f"plan within {goal:g}%: {label}"
    if peak is None or predicted is None:
        return Check(name, False, f"peak {peak} MB, predicted {predicted} MB", "both recorded")
    error = 100 * (predicted / peak - 1)
    return Check(
        name, within_plan(run, goal), f"{peak:.1f} MB ({error:+.1f}%)", f"{predicted:.1f} MB ± {goal:g}%"
    )


def sweep_checks(
    runs: list, overrides: dict[str, str], device: str, goal: float = PLAN_GOAL_PCT, label: str = "sweep"
) -> list[Check]:
    n = points(overrides)
    finished = sorted(
        (r for r in runs if r.info.status == "FINISHED"),
        key=lambda r: (r.data.params.get("backend", ""), r.data.params.get("optim", "")),
    )
    there = [r for r in finished if on(r, device)]
    checks = [
        Check(
            f"{label}: every job finished on the device",
            len(there) == len(runs) == n,
            f"{len(there)} of {len(runs)} FINISHED on {device}",
            f"{n} FINISHED on {device}",
        )
    ]
    # a job started cold on a GPU costs its imports again (tens of seconds): the step's time-out assumes warm ones
    start = overrides.get("launcher.start_jobs", "warm")
    starts = [r.data.tags.get("job_start") for r in runs]
    checks.append(
        Check(
            f"{label}: every job started {start}",
            bool(starts) and all(s == start for s in starts),
            ", ".join(f"{s}: {starts.count(s)}" for s in sorted(set(starts), key=str)) or "no runs",
            f"{start}: {n}",
        )
    )
    for r in finished:
        keys = ("backend", "optim") if label == "sweep" else ("method", "optim", "precision", "batch_size")
        what = " ".join(str(r.data.params.get(k)) for k in keys)
        checks.append(plan_check(r, what if label == "sweep" else f"{label} {what}", goal))
    return checks


def budget_checks(runs: list, device: str) -> list[Check]:
    by_batch = {int(r.data.params.get("batch_size", 0)): r for r in runs}
    big = by_batch.get(OOM_BATCH)
    fit = [by_batch.get(b) for b in FIT_BATCHES]
    shown = "; ".join(f"batch {b}: {status(r)}" for b, r in sorted(by_batch.items())) or "no runs"
    oom = Check(
        f"out of memory: batch {OOM_BATCH} one FAILED run (oom), the sweep goes on",
        big is not None
        and big.info.status == "FAILED"
        and big.data.tags.get("failure_reason") == "oom"
        and all(r is not None and r.info.status == "FINISHED" for r in fit)
        and len(runs) == 1 + len(FIT_BATCHES),
        shown,
        f"batch {OOM_BATCH}: FAILED (oom); " + "; ".join(f"batch {b}: FINISHED" for b in FIT_BATCHES),
    )
    name = "warm jobs in parallel: each its own peak"
    if any(r is None or r.info.status != "FINISHED" for r in fit):
        return [oom, Check(name, False, shown, "both FINISHED")]
    peaks = [peak_and_plan(r) for r in fit]
    starts = [r.data.tags.get("job_start") for r in fit]
    ok = (
        all(s == "warm" for s in starts)
        and all(on(r, device) and within_plan(r) for r in fit)
        and peaks[0][0] < peaks[1][0]
    )
    measured = ", ".join(f"{b}: {p or 0:.1f} MB" for b, (p, _) in zip(FIT_BATCHES, peaks, strict=True))
    measured += f"; started {'/'.join(map(str, starts))} on {', '.join(r.data.params.get('device', '?') for r in fit)}"
    expected = ", ".join(f"{b}: {q or 0:.1f} MB" for b, (_, q) in zip(FIT_BATCHES, peaks, strict=True))
    expected += f" (own plans ± {PLAN_GOAL_PCT:g}%, larger batch larger); started warm on {device}"
    return [oom, Check(name, ok, measured, expected)]


def batch_search_checks(runs: list, device: str) -> list[Check]:
    name = "find_batch_size on the Trainer backend"
    if len(runs) != 1:
        return [Check(name, False, f"{len(runs)} runs", "1 run")]
    r, m = runs[0], runs[0].data.metrics
    budget = float(r.data.params.get("memory_budget_mb", "nan"))
    batch, peak = m.get("max_batch_size"), m.get("max_batch_peak_memory_mb")
    ok = r.info.status == "FINISHED" and on(r, device) and bool(batch) and peak is not None and peak <= budget
    measured = f"{status(r)} on {r.data.params.get('device')}: batch {batch and int(batch)}, peak {peak and round(peak, 1)} MB"
    expected = f"FINISHED on {device}, a batch ≥ 1 with its peak ≤ {budget:g} MB"
    if m.get("predicted_max_batch_size"):
        expected += f" (plan: batch {int(m['predicted_max_batch_size'])})"
    return [Check(name, ok, measured, expected)]


def ddp_checks(runs: list) -> list[Check]:
    name = "2-rank Trainer DDP over NCCL"
    expected = "FINISHED on cuda, world size 2, parameters in sync, a peak per rank"
    if len(runs) != 1:
        return [Check(name, False, f"{len(runs)} runs", expected)]
    r, m = runs[0], runs[0].data.metrics
    ranks = [m.get(f"peak_memory_mb_rank{i}") for i in (0, 1)]
    ok = (
        r.info.status == "FINISHED"
        and on(r, "cuda")
        and r.data.params.get("world_size") == "2"
        and m.get("params_in_sync") == 1
        and all(ranks)
    )
    measured = (
        f"{status(r)} on {r.data.params.get('device')}, world size {r.data.params.get('world_size')}, "
        f"in sync {m.get('params_in_sync')}, peaks {' / '.join(f'{p or 0:.1f}' for p in ranks)} MB"
    )
    return [Check(name, ok, measured, expected)]


def step_command(step: Step, overrides: dict[str, str], folder: Path, device: str) -> list[str]:
    if not step.overrides:  # the known allocation
        code = f"from bench.gpu_check import known_allocation; known_allocation({device!r})"
        return [sys.executable, "-c", code]
    sweep = [f"{k}={v}" for k, v in overrides.items()]
    return [sys.executable, "-m", "pipeline", "-m", *sweep, f"outputs_dir={folder}"]


def step_checks(step: Step, overrides: dict[str, str], folder: Path, log: Path, device: str) -> list[Check]:
    """The checks of a step's figures: from its log (the known allocation) or its sweep's MLflow store."""
    if step.name == "known_allocation":
        return known_allocation_checks(log)
    runs = job_runs(folder / "mlflow.db")
    if step.name == "sweep":
        reports = list((folder / "report").glob("*/report.md"))
        report = Check("sweep: its report", bool(reports), f"{len(reports)} report.md", "1 report.md")
        return [*sweep_checks(runs, overrides, device), report]
    if step.name == "budget":
        return budget_checks(runs, device)
    if step.name == "batch_search":
        return batch_search_checks(runs, device)
    if step.name.startswith("real_"):
        return sweep_checks(runs, overrides, device, REAL_GOAL_PCT, step.name)
    return ddp_checks(runs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="work folder (default: outputs/gpu-check/<time>/)")
    parser.add_argument(
        "--only",
        help=f"steps to run, comma-separated (default: {','.join(s.name for s in STEPS if s.default)}; "
        f"also: {','.join(s.name for s in STEPS if not s.default)})",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override for every sweep (replacing the step's own for that key), e.g. --set model=tiny",
    )
    parser.add_argument(
        "--nvidia-smi", default="nvidia-smi", help="the command that lists the GPUs (default: %(default)s)"
    )
    parser.add_argument(
        "--allow-cpu",
        action="store_true",
        help="without a GPU, run the steps on CPU (a check of the script itself)",
    )
    parser.add_argument(
        "--timeout-scale",
        type=float,
        default=1.0,
        help="multiplies each step's time-out (a CPU runs the steps far slower than a GPU)",
    )
    parser.add_argument(
        "--within",
        type=float,
        metavar="S",
        help="finish within S seconds, this script's own start included: the steps' time-outs shrink to fit "
        "(never grow)",
    )
    parser.add_argument(
        "--docs", type=Path, default=DOCS, help="page whose gpu-check section a passing GPU run rewrites"
    )
    parser.add_argument("--no-docs", action="store_true", help="leave the docs page alone")
    given = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(given)
    out = (
        args.out or ROOT / "outputs" / "gpu-check" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    ).resolve()
    out.mkdir(parents=True, exist_ok=True)
    chosen = args.only.split(",") if args.only else [s.name for s in STEPS if s.default]
    unknown = sorted(set(chosen) - {s.name for s in STEPS})
    if unknown:
        parser.error(f"unknown step(s) {', '.join(unknown)}: choose among {', '.join(s.name for s in STEPS)}")
    extra = dict(item.split("=", 1) for item in args.set)

    started = time.perf_counter()
    gpus_check, gpus = device_check(args.nvidia_smi, args.allow_cpu)
    device = "cuda" if gpus else "cpu"
    running = [s for s in STEPS if s.name in chosen and s.gpus <= max(gpus, 1)]
    timeouts = {s.name: step_timeout(s, {**s.overrides, **extra}) for s in running}
    if args.within and running:  # what is left once the steps' graces and the summary are set aside
        left = args.within - (time.perf_counter() - started) - GRACE_S * (len(running) + 1)
        args.timeout_scale = min(args.timeout_scale, max(left, 1) / sum(timeouts.values()))
    budget = NVIDIA_SMI_TIMEOUT_S + OWN_S + sum(t * args.timeout_scale + GRACE_S for t in timeouts.values())
    if args.within:
        budget = args.within
    print(f"[gpu-check] {gpus_check.measured}")
    print(f"[gpu-check] time-outs: {', '.join(f'{n} {t * args.timeout_scale:.0f} s' for n, t in timeouts.items())}; "
          f"on this machine at most {budget / 60:.1f} min")  # fmt: skip
    checks, steps, figures = [gpus_check], [], []
    # SIGTERM (a time-out around this script) stops it as Ctrl-C does: the running step's group is ended
    # (`run`) and the summary of what ran is written
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if not gpus_check.ok:
        print(f"[gpu-check] FAILED: {gpus_check.measured}", flush=True)
    else:
        # each step's store is its own; the data and the simulated steps are cached once for all steps
        env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
        env.setdefault("PIPELINE_CACHE_DIR", str(out / "cache"))
        step = None
        try:
            for step in (s for s in STEPS if s.name in chosen):
                if gpus < step.gpus:
                    why = f"needs {step.gpus} GPUs, {gpus} visible"
                    steps.append((step, None, 0.0, why, 0.0))
                    checks.append(Check(step.what, None, why, f"{step.gpus} GPUs"))
                    continue
                folder, log = out / step.name, out / f"{step.name}.log"
                overrides = {**step.overrides, **extra}
                timeout = timeouts[step.name] * args.timeout_scale
                code, seconds, note = run(step_command(step, overrides, folder, device), log, timeout, env)
                steps.append((step, code == step.exit_code, seconds, note, timeout))
                checks += step_checks(step, overrides, folder, log, device)
                if step.name == "sweep" or step.name.startswith("real_"):
                    figures += figure_rows(job_runs(folder / "mlflow.db"), step.name)
        except KeyboardInterrupt:
            where = f"in step {step.name}" if step else "before the steps"
            checks.append(
                Check("not interrupted", False, f"stopped {where} (SIGTERM or Ctrl-C)", "to the end")
            )
    total = time.perf_counter() - started
    within = total < budget if device == "cuda" else None  # the budget is a GPU's: a CPU trains far slower
    checks.append(
        Check("time: the whole check", within, f"{total:.0f} s", f"< {budget:.0f} s on a GPU (its time-outs)")
    )

    failed = [s for s in steps if s[1] is False] + [c for c in checks if c.ok is False]
    where = out.relative_to(ROOT) if out.is_relative_to(ROOT) else out
    header = (
        f"Run {datetime.now():%Y-%m-%d %H:%M} on {gpus_check.measured}; Python {platform.python_version()}; "
        f"took {total / 60:.1f} min (command: `{shlex.join(['python', '-m', 'bench.gpu_check', *given])}`; "
        f"work folder `{where}`)."
    )
    text = summary_text(header, steps, checks, figures, args.set, len(failed))
    (out / "summary.md").write_text(text + "\n")
    (out / "summary.json").write_text(
        json.dumps({"checks": [vars(c) for c in checks], "jobs": figures}, indent=1)
    )
    print("\n" + text)
    if args.no_docs:
        pass
    elif failed or device != "cuda":
        print(f"[gpu-check] {args.docs} left as it is: it takes a GPU run whose every check passed")
    elif write_docs(args.docs, text):
        print(f"[gpu-check] written into {args.docs}")
    print(f"[gpu-check] summary: {out / 'summary.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
