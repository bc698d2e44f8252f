"""`make methods-table`: docs/methods-table.md and .csv, the ways to train side by side: full fine-tuning with
AdamW, 8-bit AdamW, Adafactor, GaLore and APOLLO, and LoRA and QLoRA adapters with AdamW.

- measured: one real sweep (two commands: the five optimizers, then peft=lora,qlora with AdamW) of short jobs on
  DistilBERT with random weights, on this machine, into its own outputs_dir; the figures are read back from its
  MLflow runs (pipeline.report);
- planned: the same seven ways for Llama-3.1-8B as a language model in bf16 (with adapters the recipe peft runs:
  a bf16 frozen base, fp32 adapters) on an RTX 4090 (`plan=true`, two commands likewise): the predicted peak,
  whether one sequence of 512 tokens fits, the largest batch, and each command's verdict line.

    python -m bench.methods_table             # both, then the page (a rerun trains only the points not FINISHED)
    python -m bench.methods_table --steps 5 --outputs-dir /tmp/methods --out /tmp/methods.md
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (peft, optim): the ways to train, in the table's order, and the table's name for each
NAMES = {
    ("none", "adamw"): "AdamW",
    ("none", "adamw_8bit"): "8-bit AdamW",
    ("none", "adafactor"): "Adafactor",
    ("none", "galore_adamw"): "GaLore (AdamW)",
    ("none", "apollo_adamw"): "APOLLO (AdamW)",
    ("lora", "adamw"): "LoRA + AdamW",
    ("qlora", "adamw"): "QLoRA + AdamW",
}
WAYS = tuple(NAMES)
# the measured jobs: DistilBERT from its architecture (no pretrained weights offline), short texts, few steps
MEASURED = [
    "model=distilbert-base-cased",
    "model.pretrained=false",
    "batch_size=16",
    "train.max_length=64",
    "data.max_train_samples=320",
    "data.max_val_samples=100",
    "data.max_eval_samples=200",
]
PLANNED = [
    "plan=true",
    "task=causal_lm",
    "model=llama-3.1-8b",
    "train.precision=bf16",
    "batch_size=1",
    "train.max_length=512",
    "device_memory=rtx-4090",
    "force=true",
]
PARENT = re.compile(r"parent run ([0-9a-f]{32})")


def commands(common: list[str]) -> list[list[str]]:
    """The sweep's two commands: full fine-tuning with each optimizer, then the adapters with AdamW."""
    full = ",".join(o for p, o in WAYS if p == "none")
    adapters = ",".join(p for p, _ in WAYS if p != "none")
    (optim,) = {o for p, o in WAYS if p != "none"}
    return [[*common, f"optim={full}"], [*common, f"peft={adapters}", f"optim={optim}"]]


def sweep(overrides: list[str]) -> tuple[str, list[str], float]:
    """Runs `python -m pipeline -m <overrides>`, its console shown as it comes: its parent run's id, its
    verdict lines and its wall time (s). A failed job is a FAILED run, a row of the table: the exit code is not
    checked."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "-m", *overrides],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line.rstrip("\n"))
    proc.wait()
    found = [m.group(1) for m in map(PARENT.search, lines) if m]
    if not found:
        raise RuntimeError(f"no parent run in the output of python -m pipeline -m {' '.join(overrides)}")
    verdicts = [line.strip() for line in lines if line.strip().startswith("verdict:")]
    return found[0], verdicts, time.perf_counter() - start


def jobs_of(outputs_dir: Path, parents: list[str]):
    """The sweeps' jobs (and the runs they found FINISHED before) as the report reads them: one row per run,
    params typed, each metric's last value; a point's latest run."""
    from pipeline import report
    from pipeline.report.runs import one_per_point
    from pipeline.tracking import store_uri

    uri = store_uri(None, outputs_dir)
    jobs = report.job_table(report.search_jobs(uri, report.find_sweeps(uri, parents)))
    return one_per_point(jobs)[0]


def run_of(jobs, peft: str, optim: str):
    """The row of one way to train (param `method`: `full`, `lora r=16`, `qlora r=16 nf4`), or None."""
    method = jobs["method"].fillna("full").str.split().str[0].replace("full", "none")
    found = jobs[(jobs["optim"] == optim) & (method == peft)]
    return None if found.empty else found.sort_values("start_time").iloc[-1]


def value(run, key: str):
    if run is None or key not in run.index:
        return None
    import pandas as pd

    v = run[key]
    return None if pd.isna(v) else v


def measured_rows(jobs) -> list[dict]:
    rows = []
    for peft, optim in WAYS:
        run = run_of(jobs, peft, optim)
        status = "not run" if run is None else run["status"]
        if run is not None and status != "FINISHED":
            status += f": {value(run, 'error') or value(run, 'failure_reason') or ''}".rstrip(": ")
        trainable = value(run, "model_trainable_params") or value(run, "model_num_params")
        rows.append(
            {
                "way": NAMES[peft, optim],
                "method": value(run, "method") or "",
                "optimizer": optim,
                "status": status,
                "trainable params": trainable,
                "all params": value(run, "model_num_params"),
                "optimizer state [MB]": value(run, "optimizer_state_mb"),
                "peak [MB]": value(run, "peak_memory_mb"),
                "predicted peak [MB]": value(run, "predicted_peak_mb"),
                "prediction error [%]": value(run, "predicted_peak_error_pct"),
                "eval loss": value(run, "eval_loss"),
                "eval accuracy": value(run, "eval_accuracy"),
                "eval F1": value(run, "eval_f1"),
                "eval macro-F1": value(run, "eval_macro_f1"),
                # the job's tag: its predictions (nearly) all one class
                "collapsed": {True: "yes", False: "no"}.get(value(run, "collapsed"), ""),
                "throughput [samples/s]": value(run, "train_samples_per_second"),
                "started (UTC)": None if run is None else f"{run['start_time']:%Y-%m-%d %H:%M}",
                "ended (UTC)": None
                if value(run, "end_time") is None
                else f"{run['end_time']:%Y-%m-%d %H:%M}",
            }
        )
    return rows


def planned_rows(jobs) -> list[dict]:
    rows = []
    for peft, optim in WAYS:
        run = run_of(jobs, peft, optim)
        fits = value(run, "fits")
        rows.append(
            {
                "way": NAMES[peft, optim],
                "method": value(run, "method") or "",
                "optimizer": optim,
                "trainable params": value(run, "model_trainable_params") or value(run, "model_num_params"),
                "base / trained dtype": f"{value(run, 'base_dtype') or '-'} / {value(run, 'trainable_dtype') or ''}",
                "optimizer state [MB]": value(run, "estimated_optimizer_state_mb"),
                "planned peak [MB]": value(run, "predicted_peak_mb"),
                "weights at peak [MB]": value(run, "predicted_peak_params_mb"),
                "budget [MB]": value(run, "budget_mb"),
                "fits": None if fits is None else ("yes" if fits else "no"),
                "largest batch [samples]": value(run, "predicted_max_batch_size"),
            }
        )
    return rows


def fmt(v, digits: int = 0) -> str:
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    return f"{v:,.{digits}f}"


def table(rows: list[dict], digits: dict[str, int]) -> list[str]:
    header = [
        k
        for k in rows[0]
        if k in digits
        or k in ("way", "method", "optimizer", "status", "collapsed", "fits", "base / trained dtype")
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(fmt(r[k], digits.get(k, 0)) for k in header) + " |" for r in rows]
    return lines


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def page(measured, planned, verdicts, train_cmds, plan_cmds, times, steps: int) -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    started = sorted(r["started (UTC)"] for r in measured if r["started (UTC)"])
    ended = sorted(r["ended (UTC)"] for r in measured if r["ended (UTC)"])
    when = f"from {started[0]} to {ended[-1] if ended else '...'} UTC" if started else "not yet"
    cmd = "python -m pipeline -m "
    now = datetime.now(timezone.utc)
    measured_digits = {
        "trainable params": 0,
        "optimizer state [MB]": 2,
        "peak [MB]": 1,
        "predicted peak [MB]": 1,
        "prediction error [%]": 4,
        "eval loss": 4,
        "eval accuracy": 3,
        "eval F1": 3,
        "eval macro-F1": 3,
        "throughput [samples/s]": 2,
    }
    planned_digits = {
        "trainable params": 0,
        "optimizer state [MB]": 0,
        "planned peak [MB]": 0,
        "weights at peak [MB]": 0,
        "largest batch [samples]": 0,
    }
    lines = [
        "# The ways to train, side by side",
        "",
        f"Generated by `python -m bench.methods_table` (`make methods-table`) on {now:%Y-%m-%d %H:%M} UTC on a "
        f"CPU machine ({cpu_name()}, {os.cpu_count()} cores shared with other work, {gpu}; torch "
        f"{torch.__version__}). MB = 2^20 bytes. Full fine-tuning with five optimizers, and LoRA and QLoRA adapters "
        "(rank 16 on the attention projections, `conf/peft/`) with AdamW. Two parts:",
        "",
        "- **Measured** (on this CPU, real training): DistilBERT (`distilbert-base-cased`) with **random weights** "
        "(`model.pretrained=false`: no pretrained weights on this offline machine; MiniLM's tokenizer stands in for "
        f"its own), {steps} optimizer steps of 16 texts of at most 64 tokens, fp32, the Trainer backend, each way one "
        "job of one sweep run as two commands:",
        "",
        *[f"      {cmd}{' '.join(c)}" for c in train_cmds],
        "",
        f"  The jobs ran {when}, one at a time (this run of the two commands: {times[0]:.0f} s wall; a rerun trains "
        "only the points not FINISHED before). *optimizer state*: what the optimizer object holds after training "
        "(`optimizer_state_mb`); *peak*: the training step's peak of every live tensor (`peak_memory_mb`, CPU: "
        "tensor-level accounting); *predicted peak*: the job's own plan of its step from shapes alone "
        "(`predicted_peak_mb`), and its error against the peak (`predicted_peak_error_pct`); *trainable params*: "
        "what the optimizer updates (the adapters and the classifier's head, `pre_classifier` included, for LoRA "
        "and QLoRA); throughput over the steady steps (`train_samples_per_second`), measured while other "
        "jobs shared the cores, at a load that changed from job to job: it compares the load as much as the ways "
        "to train. **Quality after so few steps from random weights says nothing about the "
        "methods' quality**: the eval figures (200 held-out texts) are here to show that every way ran end to "
        "end, not to rank them ([tuning.md](tuning.md) for a fair comparison).",
        "",
        *table(measured, measured_digits),
        "",
        "- **Planned** (no training, no GPU: a training step simulated on fake tensors, [plan.md](plan.md)): "
        "Llama-3.1-8B as a language model (`task=causal_lm`: 8.03 B parameters, the 128,256-row LM head and its "
        "logits), bf16 mixed precision (with adapters the recipe peft runs: the frozen base in bf16, the adapters "
        "and their AdamW state in fp32, [config.md](config.md#peft-lora-and-qlora)), one sequence of 512 tokens, "
        "against an RTX 4090's 24 GB (22,376 MB usable), one GPU, the same seven ways:",
        "",
        *[f"      {cmd}{' '.join(c)}" for c in plan_cmds],
        "",
        f"  ({times[1]:.0f} s wall.) *trainable params*: all of them for full fine-tuning; *optimizer state*: the "
        "exact analytic state (`estimated_optimizer_state_mb`); *weights at peak*: weights and buffers at the "
        "predicted peak (QLoRA's 4-bit base in its packed bytes and constants); *base / trained dtype*: the frozen "
        "base's weights and the trained ones (params `base_dtype`, `trainable_dtype`); *fits*: one sequence "
        "within the budget; *largest batch*: the largest that fits (0: not even one sample). The commands' verdict "
        "lines:",
        "",
        *[f"      {v}" for v in verdicts],
        "",
        *table(planned, planned_digits),
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.methods_table", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--steps", type=int, default=20, help="the measured jobs' optimizer steps")
    parser.add_argument(
        "--outputs-dir", type=Path, default=Path("outputs/methods-table"), help="relative to the checkout"
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "docs" / "methods-table.md", help="and its .csv beside it"
    )
    args = parser.parse_args(argv)
    import pandas as pd

    train_dir, plan_dir = args.outputs_dir, args.outputs_dir / "plan"
    train_cmds = commands([*MEASURED, f"train.max_steps={args.steps}", f"outputs_dir={train_dir}"])
    plan_cmds = commands([*PLANNED, f"outputs_dir={plan_dir}"])
    times, parents, verdicts = [0.0, 0.0], ([], []), []
    for i, cmds in enumerate((train_cmds, plan_cmds)):
        for overrides in cmds:
            parent, said, seconds = sweep(overrides)
            parents[i].append(parent)
            verdicts += said if i else []
            times[i] += seconds
    measured = measured_rows(jobs_of(train_dir, parents[0]))
    planned = planned_rows(jobs_of(plan_dir, parents[1]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page(measured, planned, verdicts, train_cmds, plan_cmds, times, args.steps))
    frame = pd.concat(
        [pd.DataFrame(measured).assign(part="measured"), pd.DataFrame(planned).assign(part="planned")]
    )
    frame.to_csv(args.out.with_suffix(".csv"), index=False)
    print(f"[methods-table] {args.out} and {args.out.with_suffix('.csv').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
