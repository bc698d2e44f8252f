"""`make test-gpu`: the GPU check as one script that always gets to its sweep and report.

1. the gpu-marked tests (`pytest -m gpu`), results read from their JUnit XML;
2. a short real sweep (both backends, five optimizers, model=minilm) into its own store;
3. the plan's predicted peak against the measured one on the device (bench/plan_accuracy.py, a subset);
4. the comparison report of that sweep;
5. one summary table (what passed, what was skipped and why, the sweep's figures), printed, written to
   OUT/summary.md and into docs/gpu.md between the gpu-check markers.

A failing step never stops the next one; the exit code is 1 when any step failed. Job processes are counted
up front (each costs a process start-up, imports and CUDA set-up: ~8 s measured on 2 CPU cores, see
bench/RESULTS.md) so the whole check stays short by construction.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "gpu.md"
START, END = "<!-- gpu-check:start -->", "<!-- gpu-check:end -->"
SWEEP = (
    "backend=trainer,accelerator optim=adamw,adafactor,adamw_8bit,paged_adamw_8bit,adamw_torchao_8bit "
    "model=minilm train.max_steps=20"
)
# the plan's accuracy on the device: one process, jobs in it (bench/plan_accuracy.py)
ACCURACY = ["--models", "minilm,distilbert-base-cased,qwen2.5-0.5b", "--optims", "adamw,adafactor,adamw_8bit"]
ACCURACY += ["--precisions", "fp32,bf16", "--checkpointing", "false"]
# job processes the gpu-marked tests start on one GPU (tests/test_gpu.py, tests/test_scale.py), and on two
TEST_JOBS = {"one GPU": 6 + 3 + 2 + 2 + 2, "two GPUs": 6 + 3 + 2 + 2 + 2 + 3}
JOB_START_S = 8.2  # fixed overhead of one job (bench/RESULTS.md (b): start-up, imports, loading, MLflow)
COLUMNS = {  # summary column <- MLflow metric or tag
    "state [MB]": "optimizer_state_mb",
    "estimate [MB]": "estimated_optimizer_state_mb",
    "paged [MB]": "paged_state_mb",
    "peak [MB]": "peak_memory_mb",
    "reserved [MB]": "peak_memory_reserved_mb",
    "breakdown [MB]": "peak_breakdown_mb",
    "untracked [MB]": "peak_untracked_mb",
    "predicted [MB]": "predicted_peak_mb",
    "prediction error [%]": "predicted_peak_error_pct",
    "samples/s": "train_samples_per_second",
    "warm-up [s]": "train_warmup_s",
    "skipped steps": "optimizer_steps_skipped",
}


def run(command: list[str], log: Path, timeout: float) -> tuple[int, float]:
    """(exit code, seconds) of a command whose output goes to the console and to `log`."""
    print(f"\n[gpu-check] $ {shlex.join(command)}", flush=True)
    start = time.perf_counter()
    with log.open("w") as out:
        try:
            proc = subprocess.Popen(
                command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            for line in proc.stdout:
                sys.stdout.write(line)
                out.write(line)
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = 124
    return code, time.perf_counter() - start


def test_rows(junit: Path) -> list[dict]:
    """One row per test from pytest's JUnit XML: outcome, seconds, and the reason of a skip or failure."""
    if not junit.exists():
        return []
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, reason = "passed", ""
        for tag in ("skipped", "failure", "error"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                reason = (
                    (node.get("message") or "").strip().splitlines()[0][:120] if node.get("message") else ""
                )
                break
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        rows.append({"test": name, "outcome": outcome, "s": float(case.get("time", 0)), "reason": reason})
    return rows


def sweep_rows(store: Path) -> list[dict]:
    """The sweep's job runs: status, the settings that vary, the figures of COLUMNS."""
    if not store.exists():
        return []
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{store}")
    rows = []
    for experiment in client.search_experiments():
        for r in client.search_runs([experiment.experiment_id], max_results=1000):
            if r.data.tags.get("kind") == "sweep":
                continue
            p, m, t = r.data.params, r.data.metrics, r.data.tags
            row = {"backend": p.get("backend"), "optim": p.get("optim"), "precision": p.get("precision")}
            row["status"] = (
                r.info.status if r.info.status == "FINISHED" else f"{r.info.status}: {t.get('error', '')}"
            )
            row |= {col: m.get(key) for col, key in COLUMNS.items()}
            row["breakdown"] = t.get("peak_breakdown", "")
            rows.append(row)
    return sorted(rows, key=lambda row: (row["backend"] or "", row["optim"] or ""))


def markdown(rows: list[dict]) -> list[str]:
    if not rows:
        return ["(none)"]
    columns = [c for c in rows[0] if any(row.get(c) not in (None, "") for row in rows)]

    def cell(v) -> str:
        if v is None:
            return ""
        return f"{v:.4g}" if isinstance(v, float) else str(v).replace("|", "/")

    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    return lines + ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]


def accuracy_summary(path: Path) -> list[str]:
    """The plan-accuracy page's verdict and worst error per model family, for the summary."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("**")), None)
    end = next((i for i, line in enumerate(lines) if line.startswith("| model | optim")), len(lines))
    return ["Plan against measured peak (full table: `plan-accuracy.md` in the work folder):", ""] + (
        lines[start:end] if start is not None else []
    )


def device_line() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            return f"{len(names)} x {names[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}"
        return f"no CUDA device (torch {torch.__version__}): the gpu tests skip, the sweep runs on CPU"
    except ImportError:
        return "torch not importable"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="work folder (default: outputs/gpu-check/<time>/)")
    parser.add_argument("--sweep", default=SWEEP, help="the sweep's overrides (default: %(default)s)")
    parser.add_argument(
        "--pytest-args", default="", help="extra pytest arguments, e.g. '-k known_allocation'"
    )
    parser.add_argument("--accuracy", default=shlex.join(ACCURACY), help="bench.plan_accuracy's arguments")
    parser.add_argument("--docs", type=Path, default=DOCS, help="page whose gpu-check section is rewritten")
    parser.add_argument("--no-docs", action="store_true", help="leave the docs page alone")
    parser.add_argument("--timeout", type=float, default=420, help="seconds for each step (default: 420)")
    args = parser.parse_args(argv)
    out = (
        args.out or ROOT / "outputs" / "gpu-check" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    ).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sweep = shlex.split(args.sweep)
    n_sweep = 1
    for arg in sweep:
        if "," in arg:
            n_sweep *= len(arg.split("=", 1)[1].split(","))
    device = device_line()
    print(f"[gpu-check] {device}")
    print(
        f"[gpu-check] job processes: tests {TEST_JOBS['one GPU']} on one GPU ({TEST_JOBS['two GPUs']} on two), "
        f"sweep {n_sweep}; start-up alone ~{(TEST_JOBS['one GPU'] + n_sweep) * JOB_START_S / 60:.1f} min "
        f"at {JOB_START_S} s a job"
    )
    python = sys.executable
    started = time.perf_counter()
    steps = []
    junit = out / "pytest.xml"
    pytest = [python, "-m", "pytest", "-m", "gpu", "-s", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    code, seconds = run(pytest + shlex.split(args.pytest_args), out / "pytest.log", args.timeout)
    steps.append(("gpu tests (`pytest -m gpu`)", code == 0, seconds, f"exit {code}"))
    code, seconds = run(
        [python, "-m", "pipeline", "-m", *sweep, f"outputs_dir={out}"], out / "sweep.log", args.timeout
    )
    steps.append((f"sweep `{args.sweep}`", code == 0, seconds, f"exit {code}"))
    accuracy = out / "plan-accuracy.md"  # the plan against the device's measured peaks
    code, seconds = run(
        [python, "-m", "bench.plan_accuracy", *shlex.split(args.accuracy), "--out", str(accuracy)],
        out / "plan.log",
        args.timeout,
    )
    steps.append(("plan accuracy (`bench.plan_accuracy`)", code == 0, seconds, f"exit {code}"))
    report = [python, "-m", "pipeline.report", "--tracking-uri", f"sqlite:///{out / 'mlflow.db'}"]
    code, seconds = run(
        [*report, "--whole-experiment", "--out", str(out / "report")], out / "report.log", 300
    )
    steps.append(("report (`python -m pipeline.report`)", code == 0, seconds, f"exit {code}"))
    total = time.perf_counter() - started

    tests, jobs = test_rows(junit), sweep_rows(out / "mlflow.db")
    failed = [s for s in steps if not s[1]] + [t for t in tests if t["outcome"] in ("failed", "error")]
    when = datetime.now().strftime("%Y-%m-%d %H:%M")
    summary = [
        f"Run {when} on {device}; Python {platform.python_version()}; took {total / 60:.1f} min "
        f"(command: `make test-gpu`; work folder `{out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}`).",
        "",
        "| step | result | seconds |",
        "| --- | --- | --- |",
        *[f"| {name} | {'ok' if ok else 'FAILED'} ({note}) | {s:.0f} |" for name, ok, s, note in steps],
        "",
        "Tests (skips need what their reason says: the two-rank NCCL / ZeRO-1 / FSDP test needs 2 GPUs):",
        "",
        *markdown(tests),
        "",
        "Sweep jobs (MB = 2^20 bytes; peak = `torch.cuda.max_memory_allocated` on CUDA, the tensor tracker's "
        "peak on CPU; reserved = `max_memory_reserved`; untracked = what the allocator held at step 2's start outside the tensors "
        "the breakdown tracks; paged state lies outside the allocator):",
        "",
        *markdown(jobs),
        "",
        *accuracy_summary(accuracy),
        f"**{'all steps passed' if not failed else f'{len(failed)} failed'}**",
    ]
    text = "\n".join(summary)
    (out / "summary.md").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps({"steps": steps, "tests": tests, "jobs": jobs}, indent=1))
    print("\n" + text)
    if not args.no_docs and args.docs.exists():
        page = args.docs.read_text()
        if START in page and END in page:
            head, rest = page.split(START, 1)
            page = head + START + "\n" + text + "\n" + END + rest.split(END, 1)[1]
            args.docs.write_text(page)
            print(f"[gpu-check] written into {args.docs}")
    print(f"[gpu-check] summary: {out / 'summary.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
