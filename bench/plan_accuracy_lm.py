"""The plan of a language model (task=causal_lm) against the peak its training measures, on CPU.

Each row is a real job in this process (`pipeline.job.run`, accelerator backend, a few steps): a tiny decoder
(llama-tiny, qwen-tiny, gpt2-tiny: hidden 64, vocabulary 30,522, so the logits dominate the step) at one batch
size and sequence length, every sequence at full length (`train.padding=max_length`, or `train.packing=true`:
full blocks), with or without gradient checkpointing. Its `predicted_peak_mb` (pipeline.plan_step: the same step on
fake tensors, LM head and loss included) is set against its `peak_memory_mb`, beside the logits' share of the
measured peak (`peak_logits_mb` of the step-2 breakdown) and of the predicted one. Prints a Markdown table.

    python -m bench.plan_accuracy_lm                          # 3 models x 2 batches x 2 lengths x packing x ckpt
    python -m bench.plan_accuracy_lm --models llama-tiny --batches 4 --lengths 32,128 --precisions bf16
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"
MODELS = ("llama-tiny", "qwen-tiny", "gpt2-tiny")
GOAL_PCT = 5.0
TOKENS_PER_TEXT = 20  # fewer than a Rotten Tomatoes snippet's: packing gets enough blocks for every step


def overrides(
    model, batch, seq, packing, checkpointing, precision, optim, steps, work, backend="accelerator"
) -> list[str]:
    """The job's config: every batch `batch` x `seq` tokens (padded to max_length, or packed blocks)."""
    texts = max(64, math.ceil(batch * seq * (steps + 1) / TOKENS_PER_TEXT)) if packing else max(64, batch)
    eval_texts = math.ceil(2 * seq / TOKENS_PER_TEXT) if packing else 4  # packed: at least one block
    return [
        "task=causal_lm",
        f"model={model}",
        f"optim={optim}",
        f"train.precision={precision}",
        f"train.gradient_checkpointing={str(checkpointing).lower()}",
        f"train.packing={str(packing).lower()}",
        "train.padding=max_length",
        f"train.max_length={seq}",
        f"batch_size={batch}",
        f"train.max_steps={steps}",
        f"backend={backend}",
        f"data.max_train_samples={texts}",
        f"data.max_eval_samples={eval_texts}",
        "eval.batch_size=4",
        "data.val_fraction=0",  # no validation passes: they change no training peak
        f"outputs_dir={work}",
    ]


def case(
    model: str,
    batch: int,
    seq: int,
    packing: bool,
    checkpointing: bool,
    work: Path,
    precision: str = "fp32",
    optim: str = "adamw",
    steps: int = 2,
    backend: str = "accelerator",
    extra: tuple[str, ...] = (),
) -> dict:
    """One real language-model job in this process (`extra`: more overrides): its measured and predicted peak
    (MB) and the logits' parts (step 2 holds the peak: every batch has the same shape, and step 2 starts with
    the optimizer state)."""
    from hydra import compose, initialize_config_dir

    from bench.plan_accuracy import clear_between_cases
    from pipeline import job

    key = {"model": model, "batch": batch, "seq": seq, "packing": packing, "checkpointing": checkpointing}
    key |= {
        "precision": precision,
        "optim": optim,
        "backend": backend,
        **dict(o.split("=", 1) for o in extra),
    }
    clear_between_cases(" ".join(map(str, key.values())))
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(
            "config",
            overrides(model, batch, seq, packing, checkpointing, precision, optim, steps, work, backend)
            + list(extra),
        )
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # each job its own mixed precision, as a process
    job_dir = work / "-".join(map(str, key.values()))
    job_dir.mkdir(parents=True, exist_ok=True)
    result = job.run(cfg, job_dir)
    m = result["metrics"]
    return {
        **key,
        "largest batch": result["params"]["largest_batch"],
        "measured [MB]": m["peak_memory_mb"],
        "predicted [MB]": m.get("predicted_peak_mb"),
        "error [%]": m.get("predicted_peak_error_pct"),
        "logits measured [MB]": m.get("peak_logits_mb"),
        "logits predicted [MB]": m.get("predicted_logits_mb"),
        "breakdown [MB]": m.get("peak_breakdown_mb"),
        "metrics": m,
    }


COLUMNS = ["model", "batch", "seq", "packing", "checkpointing", "precision", "measured [MB]"]
COLUMNS += ["predicted [MB]", "error [%]", "logits measured [MB]", "logits predicted [MB]"]


def cell(value, column: str) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:+.2f}" if column.endswith("[%]") else f"{value:,.2f}"
    return str(value)


def markdown(rows: list[dict], command: str, seconds: float) -> str:
    ran = [r for r in rows if r.get("error [%]") is not None]
    within = sum(abs(r["error [%]"]) <= GOAL_PCT for r in ran)
    worst = max((abs(r["error [%]"]) for r in ran), default=float("nan"))
    lines = [
        f"`{command}`, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {seconds / 60:.1f} min on CPU: "
        f"{within} of {len(ran)} within ±{GOAL_PCT:g}% (worst {worst:.2f}%). MB = 2^20 bytes.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + " --- |" * len(COLUMNS),
        *["| " + " | ".join(cell(row.get(c), c) for c in COLUMNS) + " |" for row in rows],
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="(default: %(default)s)")
    parser.add_argument("--batches", default="2,8", help="samples per batch (default: %(default)s)")
    parser.add_argument("--lengths", default="32,128", help="tokens per sequence (default: %(default)s)")
    parser.add_argument("--packing", default="false,true", help="(default: %(default)s)")
    parser.add_argument("--checkpointing", default="false,true", help="(default: %(default)s)")
    parser.add_argument("--precisions", default="fp32", help="(default: %(default)s)")
    parser.add_argument("--optim", default="adamw", help="(default: %(default)s)")
    args = parser.parse_args(argv)
    command = "python -m bench.plan_accuracy_lm " + " ".join(sys.argv[1:] if argv is None else argv)
    grid = itertools.product(
        args.models.split(","),
        [int(b) for b in args.batches.split(",")],
        [int(s) for s in args.lengths.split(",")],
        [p == "true" for p in args.packing.split(",")],
        [c == "true" for c in args.checkpointing.split(",")],
        args.precisions.split(","),
    )
    rows, start = [], time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        for model, batch, seq, packing, checkpointing, precision in grid:
            row = case(model, batch, seq, packing, checkpointing, Path(work), precision, args.optim)
            rows.append(row)
            print(
                f"[plan-accuracy-lm] {model} {batch}x{seq} packing={packing} ckpt={checkpointing} {precision}: "
                f"{row['measured [MB]']:.2f} MB measured, {row['predicted [MB]']:.2f} predicted "
                f"({row['error [%]']:+.2f}%)",
                flush=True,
            )
    print(markdown(rows, command.strip(), time.perf_counter() - start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
