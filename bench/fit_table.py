"""`make fit-table`: docs/fit-table.md, from plans only (pipeline.plan, pipeline.plan_ranks): for each shipped
decoder x optimizer x precision x gradient checkpointing x sequence length, on each named GPU, the smallest
number of GPUs at which one sample per GPU fits (over the shardings each optimizer can take) and the largest
batch per GPU there. Nothing is trained and no GPU measured it: every figure is a simulated step.

    python -m bench.fit_table                      # the whole table (minutes on 2 CPU cores)
    python -m bench.fit_table --models qwen2.5-0.5b --optims adamw --out /tmp/fit.md
"""

from __future__ import annotations

import argparse
import itertools
import platform
import sys
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"
MODELS = ("qwen2.5-0.5b", "llama-3.2-1b", "mistral-7b", "llama-3.1-8b")
OPTIMS = ("adamw", "adamw_8bit", "adafactor", "adamw_torchao_4bit", "galore_adamw", "apollo_adamw", "muon")
NOT_PLANNED = {"lomo": "updates inside the backward pass: no separate optimizer step to simulate (train it)"}
PRECISIONS = ("bf16", "bf16_pure")
SEQS = (512, 2048)
# one GPU per memory size (pipeline.plan.DEVICE_MEMORY_GB; the others of a size fit alike)
GPUS = ("t4", "a10", "v100-32gb", "a100-40gb", "l40s", "h100-80gb", "h200")
SHARDINGS = ("none", "zero1", "zero2", "fsdp")


def shardings_for(optim: str) -> tuple[str, ...]:
    from pipeline.config import MATRIX_OPTIMIZERS

    return ("none", "zero1") if optim.startswith(MATRIX_OPTIMIZERS) else SHARDINGS


def cell(prediction, layout, optim: str, budget: float, extra: float) -> str:
    """`N sharding, b/GPU`: the smallest N (ties: the largest batch) over the shardings, or `-`."""
    from pipeline import plan_ranks

    best = None
    for sharding in shardings_for(optim):
        n = plan_ranks.smallest_world(prediction, layout, sharding, 1, budget, extra)
        if n is None:
            continue
        batch = plan_ranks.largest_batch(prediction, layout, sharding, n, budget, extra)
        if best is None or (n, -batch) < (best[0], -best[2]):
            best = (n, sharding if n > 1 else "", batch)
    if best is None:
        return "-"
    n, sharding, batch = best
    return f"{n}{' ' + sharding if sharding else ''}, {min(batch, 9999)}"


def rows(models, optims, precisions, seqs, gpus):
    from hydra import compose, initialize_config_dir

    from pipeline import models as catalog
    from pipeline import optimizers, plan, plan_ranks

    extra = plan.CUBLAS_WORKSPACES_MB
    for model, precision, ckpt in itertools.product(models, precisions, (False, True)):
        for optim in optims:
            overrides = [f"model={model}", f"optim={optim}", f"train.precision={precision}", "plan=true"]
            overrides.append(f"train.gradient_checkpointing={str(ckpt).lower()}")
            with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
                cfg = compose("config", overrides)
            spec = optimizers.spec_for(cfg.optim)
            config = catalog.model_config(cfg.model, num_labels=2)
            if config.pad_token_id is None:
                config.pad_token_id = 0
            names = tuple(catalog.load_tokenizer(cfg.model).model_input_names)
            layout = None
            for seq in seqs:
                prediction = plan.simulate(config, spec, cfg, 1, seq, cuda=True, names=names)
                if layout is None:
                    layout = plan_ranks.Layout(prediction["model"], spec, cfg, foreach=True)
                cells = [cell(prediction, layout, optim, plan.usable_mb(g), extra) for g in gpus]
                yield [model, optim, precision, "on" if ckpt else "off", str(seq), *cells]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--optims", default=",".join(OPTIMS))
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--seqs", default=",".join(map(str, SEQS)))
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "fit-table.md")
    args = parser.parse_args(argv)
    import torch

    start = time.perf_counter()
    gpus = GPUS
    found = []
    for row in rows(
        args.models.split(","),
        args.optims.split(","),
        args.precisions.split(","),
        [int(s) for s in args.seqs.split(",")],
        gpus,
    ):
        found.append(row)
        print(" | ".join(row), flush=True)
    minutes = (time.perf_counter() - start) / 60
    command = "python -m bench.fit_table " + " ".join(sys.argv[1:] if argv is None else argv)
    from pipeline import plan

    header = ["model", "optimizer", "precision", "checkpointing", "seq [tokens]"]
    header += [f"{g} ({plan.usable_mb(g):,.0f} MB)" for g in gpus]
    lines = [
        "# Fit table: how many GPUs, and what batch per GPU",
        "",
        f"Generated by `{command.strip()}` (`make fit-table`) on {datetime.now():%Y-%m-%d %H:%M} in "
        f"{minutes:.1f} min on a CPU ({platform.machine()}, torch {torch.__version__}). **From plans only: "
        "every figure is a training step simulated on fake tensors (docs/plan.md), for a CUDA target; no GPU "
        "measured any of it.** The plan's one-process figures are within 5% of measured peaks on CPU "
        "([plan-accuracy.md](plan-accuracy.md)); its CUDA figures are untested until `make test-gpu` runs.",
        "",
        "Each cell: the smallest number of GPUs of that kind on which one sample per GPU fits, with the "
        "sharding that gets there first (docs/plan.md: `zero1` ZeRO-1, `zero2` ZeRO-2, `fsdp` FSDP full "
        "shard; none shown for one GPU), then the largest batch per GPU at that number (sequences of `seq` "
        "tokens, every one at full length; 9999 = 9999 or more). `-`: no number up to 4096 fits. Usable "
        "memory = the data sheet's less 512 MiB for the CUDA context; MB = 2^20 bytes. Sequence "
        "classification head, the optimizer's own step (`foreach` on CUDA), gradient clipping. GaLore, APOLLO "
        "and Muon work on whole weight matrices: planned with DDP and ZeRO-1 only. Not planned: "
        + "; ".join(f"{k} ({v})" for k, v in NOT_PLANNED.items())
        + ".",
        "",
        "| " + " | ".join(header) + " |",
        "|" + " --- |" * len(header),
        *["| " + " | ".join(row) + " |" for row in found],
        "",
    ]
    args.out.write_text("\n".join(lines))
    print(f"[fit-table] {args.out} ({len(found)} rows, {minutes:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
