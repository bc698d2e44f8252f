"""`make plan-accuracy`: the plan's predicted peak against the peak that training then measures.

For every runnable combination of model family x registered optimizer x precision x gradient checkpointing,
a real job (`pipeline.job.run`: load, train a few steps on the accelerator backend, measure) runs in this
process, and its `predicted_peak_mb` (pipeline.plan_step: the same step simulated on fake tensors) is set against
its `peak_memory_mb`, beside the errors of `accelerate estimate-memory`'s training figure and of the
18-bytes-per-parameter rule. Writes a Markdown table (default docs/plan-accuracy.md) with the worst |error|
per model family; a combination that cannot run says why.

    python -m bench.plan_accuracy                       # the whole matrix (hours on 2 CPU cores)
    python -m bench.plan_accuracy --models tiny --optims adamw,sgd --precisions fp32 --out /tmp/t.md

Every row also goes to a CSV beside the table (docs/plan-accuracy.csv), and a rerun measures only the
combinations not measured before (`--fresh` measures all again): a matrix too long for one sitting is finished
by running the same command again; `--table-only` writes the table of what the CSV holds, measuring nothing.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import platform
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"
# model -> (batch size, overrides): distilbert at a small batch, with random weights (none are packaged)
MODELS = {
    "tiny": (16, []),
    "minilm": (16, []),
    "distilbert-base-cased": (2, ["model.pretrained=false"]),
    "gpt2-tiny": (16, []),
    "llama-tiny": (16, []),
    "qwen-tiny": (16, []),
}
PRECISIONS = ("fp32", "bf16", "bf16_pure")
GOAL_PCT = 5.0


def clear_between_cases(before: str) -> None:
    """Free what the cases before left, so that the next case's peak is its own: Python's reference cycles
    first (accelerate's mixed-precision forward wrapper keeps the model in one; `del` alone does not free it),
    then, on CUDA, cuBLAS's workspaces and the allocator's cache. On CUDA the next case (`before`) starts only
    from nothing allocated: anything still there would count in its peak."""
    import torch

    gc.collect()
    if not torch.cuda.is_available():
        return
    torch._C._cuda_clearCublasWorkspaces()  # as a new process, the case allocates its own (the plan counts them)
    torch.cuda.empty_cache()
    left = torch.cuda.memory_allocated()
    if left:
        raise RuntimeError(
            f"{left / 2**20:.1f} MB still allocated on the GPU before case {before}: tensors of an earlier case "
            "are alive and would count in its peak"
        )


def case(model: str, optim: str, precision: str, checkpointing: bool, steps: int, work: Path) -> dict:
    """One real job in this process: its measured and predicted peak (MB) and the anchors' figures."""
    from hydra import compose, initialize_config_dir

    from pipeline import job, predict

    batch, extra = MODELS.get(model, (2, ["model.pretrained=false"]))
    overrides = [
        f"model={model}",
        f"optim={optim}",
        f"train.precision={precision}",
        f"train.gradient_checkpointing={str(checkpointing).lower()}",
        f"batch_size={batch}",
        f"train.max_steps={steps}",
        "backend=accelerator",
        "data.max_train_samples=64",
        "data.max_eval_samples=16",
        "data.val_fraction=0",  # no validation passes: they cost minutes on CPU and change no training peak
        f"outputs_dir={work}",
        *extra,
    ]
    row = {"model": model, "optim": optim, "precision": precision, "checkpointing": checkpointing}
    clear_between_cases(f"{model} {optim} {precision} ckpt={checkpointing}")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides)
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # each job its own mixed precision, as a process
    job_dir = work / f"{model}-{optim}-{precision}-{int(checkpointing)}"
    job_dir.mkdir(parents=True, exist_ok=True)
    try:
        result = job.run(cfg, job_dir)
    except Exception as err:
        return {**row, "status": f"{type(err).__name__}: {str(err).strip().splitlines()[0][:90]}"}
    m = result["metrics"]
    measured, n = m["peak_memory_mb"], m["model_num_params"]
    row |= {
        "device": result["params"]["device"],
        "batch": result["params"]["largest_batch"],
        "measured [MB]": measured,
        "predicted [MB]": m.get("predicted_peak_mb"),
        "error [%]": m.get("predicted_peak_error_pct"),
        "how": result["tags"].get("prediction_method", ""),
        "accelerate [%]": 100 * (predict.accelerate_estimate_mb(n, precision) / measured - 1),
        "18 B/param [%]": 100 * (predict.bytes_rule_mb(n) / measured - 1),
        "status": "ok",
    }
    del result
    return row


KEY = ("model", "optim", "precision", "checkpointing")


def measured_rows(path: Path) -> dict[tuple, dict]:
    """The rows a CSV holds from earlier runs, by (model, optim, precision, checkpointing)."""
    if not path.exists():
        return {}
    import pandas as pd

    frame = pd.read_csv(path).astype(object)
    frame = frame.where(frame.notna(), None)
    rows = frame.to_dict("records")
    for row in rows:
        row["checkpointing"] = str(row["checkpointing"]) == "True"
    return {tuple(row[k] for k in KEY): row for row in rows}


def write_rows(path: Path, rows) -> None:
    import pandas as pd

    pd.DataFrame(list(rows)).to_csv(path, index=False)


def cell(value, column: str) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, float):
        return f"{value:+.2f}" if column.endswith("[%]") else f"{value:,.2f}"
    return str(value).replace("|", "/")


def markdown(rows: list[dict], command: str, seconds: float) -> str:
    import torch

    columns = ["model", "optim", "precision", "checkpointing", "batch", "measured [MB]", "predicted [MB]"]
    columns += ["error [%]", "accelerate [%]", "18 B/param [%]", "how", "status"]
    worst: dict[str, tuple[float, str]] = {}
    for row in rows:
        if row.get("error [%]") is not None:
            err = abs(row["error [%]"])
            if err >= worst.get(row["model"], (-1.0, ""))[0]:
                worst[row["model"]] = (err, f"{row['optim']} {row['precision']} ckpt={row['checkpointing']}")
    ran = [r for r in rows if r["status"] == "ok"]
    within = sum(abs(r["error [%]"]) <= GOAL_PCT for r in ran)
    device = rows[0].get("device", "") if rows else ""
    lines = [
        "# The plan's accuracy: predicted against measured peak",
        "",
        f"Generated by `{command}` on {datetime.now():%Y-%m-%d %H:%M} ({platform.machine()}, "
        f"{torch.get_num_threads()} torch threads, device {device}, torch {torch.__version__}), in "
        f"{seconds / 60:.1f} min of measuring (over one or more runs of the command). Each row is a real job "
        "(accelerator backend, a few steps, the largest batch measured); error = predicted / measured − 1. "
        "Beside it, the errors of `accelerate estimate-memory`'s training figure (Adam, batch 1, no "
        "activations) and of the 18-bytes-per-parameter rule. MB = 2^20 bytes.",
        "",
        f"**{within} of {len(ran)} runnable combinations within ±{GOAL_PCT:g}%**; "
        f"{len(rows) - len(ran)} could not run here (status says why).",
        "",
        "| model family | worst abs(error) [%] | at |",
        "| --- | --- | --- |",
        *[f"| {model} | {err:.2f} | {where} |" for model, (err, where) in worst.items()],
        "",
        "| " + " | ".join(columns) + " |",
        "|" + " --- |" * len(columns),
        *["| " + " | ".join(cell(row.get(c), c) for c in columns) + " |" for row in rows],
        "",
    ]
    return "\n".join(lines)


def write_table(out: Path, rows: list[dict], command: str) -> None:
    """The Markdown table of `rows`, with the measuring time their CSV rows recorded; the per-rank section
    (bench.plan_ranks, after its marker) kept as it is."""
    from bench.plan_ranks import RANKS_MARKER

    kept = ""
    if out.exists() and RANKS_MARKER in out.read_text():
        kept = "\n" + RANKS_MARKER + out.read_text().split(RANKS_MARKER, 1)[1]
    out.write_text(markdown(rows, command, sum(r.get("seconds") or 0.0 for r in rows)) + kept)


def main(argv=None) -> int:
    from pipeline.optimizers import REGISTRY

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="model configs (default: %(default)s)")
    parser.add_argument("--optims", default=",".join(REGISTRY), help="optimizers (default: all registered)")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="(default: %(default)s)")
    parser.add_argument("--checkpointing", default="false,true", help="gradient checkpointing: false,true")
    parser.add_argument("--steps", type=int, default=3, help="training steps per job (default: 3)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "plan-accuracy.md", help="Markdown table")
    parser.add_argument("--fresh", action="store_true", help="measure every combination again")
    parser.add_argument(
        "--table-only", action="store_true", help="measure nothing: write the table of the rows the CSV holds"
    )
    args = parser.parse_args(argv)
    grid = list(
        itertools.product(
            args.models.split(","),
            args.optims.split(","),
            args.precisions.split(","),
            [c == "true" for c in args.checkpointing.split(",")],
        )
    )
    rows, csv_path = [], args.out.with_suffix(".csv")
    measured = {} if args.fresh else measured_rows(csv_path)
    command = "python -m bench.plan_accuracy " + " ".join(sys.argv[1:] if argv is None else argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.table_only:
        rows = [measured[key] for key in grid if key in measured]
        done = "" if len(rows) == len(grid) else f" ({len(rows)} of {len(grid)} rows measured so far)"
        write_table(args.out, rows, command.strip() + done)
        print(f"[plan-accuracy] {args.out}: {len(rows)} of {len(grid)} rows")
        return 0
    with tempfile.TemporaryDirectory() as work:
        for i, key in enumerate(grid, 1):
            row = measured.get(key)
            if row is None or row["status"] != "ok":
                start = time.perf_counter()
                row = {**case(*key, args.steps, Path(work)), "seconds": 0.0}
                row["seconds"] = time.perf_counter() - start
                measured[key] = row
                write_rows(csv_path, measured.values())
            rows.append(row)
            shown = f"{row['error [%]']:+.2f}%" if row.get("error [%]") is not None else row["status"]
            print(f"[{i}/{len(grid)}] {' '.join(map(str, key[:3]))} ckpt={key[3]}: {shown}", flush=True)
            # written after every row: a long matrix that stops early keeps what it measured
            done = "" if i == len(grid) else f" (stopped early? {i} of {len(grid)} rows so far)"
            write_table(args.out, rows, command.strip() + done)
    print(f"[plan-accuracy] {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
