"""`make fit-table`: docs/fit-table.md and .csv, from plans only (pipeline.plan_step, pipeline.plan_ranks): for each
task (a sequence classifier, or task=causal_lm: the decoder with its LM head, next-token labels) x shipped
decoder x method (full fine-tuning with each optimizer; LoRA and QLoRA adapters with AdamW) x precision x
gradient checkpointing x sequence length, on each named GPU, the smallest number of GPUs at which one sample per
GPU fits (over the shardings each can take) and the largest batch per GPU there. Nothing is trained and no GPU
measured it: every figure is a simulated step. The simulated passes and optimizer steps are kept under
outputs/cache/plan (pipeline.cache), so a rerun plans again only what changed.

    python -m bench.fit_table                      # the whole table (648 rows)
    python -m bench.fit_table --tasks causal_lm --models qwen2.5-0.5b --optims adamw --peft qlora --out /tmp/fit.md
"""

from __future__ import annotations

import argparse
import csv
import importlib.metadata
import itertools
import platform
import sys
import time
from datetime import datetime
from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"
TASKS = ("classification", "causal_lm")
# the models each task's rows cover, smallest first: classifiers of the four 0.5-8B decoders; as language models,
# the published decoders conf/model ships (pipeline.models.decoders() with a hub_id: not the tests' tiny ones)
MODELS = {
    "classification": ("qwen2.5-0.5b", "llama-3.2-1b", "mistral-7b", "llama-3.1-8b"),
    "causal_lm": ("gpt2", "qwen2.5-0.5b", "llama-3.2-1b", "mistral-7b", "llama-3.1-8b"),
}
OPTIMS = ("adamw", "adamw_8bit", "adafactor", "adamw_torchao_4bit", "galore_adamw", "apollo_adamw", "muon")
NOT_PLANNED = {"lomo": "updates inside the backward pass: no separate optimizer step to simulate (train it)"}
PRECISIONS = ("bf16", "bf16_pure")
CHECKPOINTING = ("off", "on")
SEQS = (512, 2048)
# one GPU per memory size (pipeline.plan_step.DEVICE_MEMORY_GB; the others of a size fit alike)
GPUS = ("t4", "a10", "v100-32gb", "a100-40gb", "l40s", "h100-80gb", "h200")
SHARDINGS = ("none", "zero1", "zero2", "fsdp")
# the adapters' rows (conf/peft: rank 16 on the family's attention projections; QLoRA's base in 4-bit NF4), each
# with AdamW only: beside full fine-tuning's AdamW row, what the adapters change
PEFT = ("lora", "qlora")
PEFT_OPTIMS = ("adamw",)


def shardings_for(optim: str, peft: str = "none") -> tuple[str, ...]:
    """The shardings a row is planned with: DDP and ZeRO-1 only for the optimizers of whole matrices; no FSDP
    for an optimizer whose step cannot take its shards (models.fsdp_refusal); no ZeRO-2 for adapters (plan=true
    refuses it with them: config._check_peft)."""
    from omegaconf import OmegaConf

    from pipeline.models import MATRIX_OPTIMIZERS, fsdp_refusal
    from pipeline.optimizers import get

    if optim.startswith(MATRIX_OPTIMIZERS):
        return ("none", "zero1")
    fsdp = OmegaConf.create({"train": {"sharding": "fsdp"}, "optim": {"name": optim}})
    refused = {"fsdp"} if fsdp_refusal(fsdp, get(optim)) else set()
    refused |= {"zero2"} if peft != "none" else set()
    return tuple(s for s in SHARDINGS if s not in refused)


def cell(prediction, layout, optim: str, budget: float, extra: float, peft: str = "none") -> str:
    """`N sharding, b/GPU`: the smallest N (ties: the largest batch) over the shardings, or `-`."""
    from pipeline import plan_ranks

    best = None
    for sharding in shardings_for(optim, peft):
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


def plan_store(outputs_dir: Path):
    """Where the simulated passes and optimizer steps are kept between runs (<outputs_dir>/cache/plan, as a
    sweep's jobs keep theirs), under the plan's code and the libraries it simulates."""
    from pipeline import cache, measurements

    versions = measurements.library_versions()
    versions |= {name: importlib.metadata.version(name) for name in measurements.PEFT_LIBRARIES}
    sources = measurements.PLAN_SOURCES + measurements.PEFT_SOURCES
    return cache.Store(cache.folder(outputs_dir, "plan"), "fit table", versions, sources=sources)


def rows(task, models, optims, precisions, checkpointing, seqs, gpus, failed: dict[str, str], pefts, store):
    """The table's rows of one task: full fine-tuning with each of `optims`, then each of `pefts`' adapters
    with PEFT_OPTIMS; a model the plan cannot simulate gets n/a cells, and why in `failed` (`model (task)` ->
    reason)."""
    from hydra import compose, initialize_config_dir

    from pipeline import adapters, cuda_reductions, optimizers, plan_job, plan_ranks, plan_step
    from pipeline import models as catalog

    ways = [("none", o) for o in optims] + [(p, o) for p in pefts for o in PEFT_OPTIMS]
    for model, precision, ckpt in itertools.product(models, precisions, checkpointing):
        for peft, optim in ways:
            overrides = [f"model={model}", f"task={task}", f"optim={optim}", f"train.precision={precision}"]
            overrides += ["plan=true", f"train.gradient_checkpointing={str(ckpt == 'on').lower()}"]
            overrides += [f"peft={peft}"]
            with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
                cfg = compose("config", overrides)
            spec = optimizers.spec_for(cfg.optim)
            config = plan_job.planned_config(cfg)
            names = tuple(catalog.load_tokenizer(cfg.model, local_only=True).model_input_names)
            layout = None
            key = [model, task, adapters.method(cfg), optim, precision, ckpt]

            on = {
                g: OmegaConf.merge(cfg, {"device_memory": g}) for g in gpus
            }  # its grid, its cuBLAS workspaces
            for seq in seqs:
                try:  # each GPU's plan: the pass once, the optimizer step once per grid (its reductions' buffers)
                    planned = {
                        g: plan_step.simulate(
                            config, spec, on[g], 1, seq, True, names, store, cuda_reductions.NAMED_GRIDS[g]
                        )
                        for g in gpus
                    }
                except RuntimeError as err:  # the plan cannot simulate this model: its rows say so
                    failed[f"{model} ({task})"] = str(err)
                    yield [*key, str(seq), *["n/a"] * len(gpus)]
                    continue
                if layout is None:
                    nccl = plan_ranks.NCCL_BUFFERS_MB
                    model_built = planned[gpus[0]]["model"]
                    layout = plan_ranks.Layout(model_built, spec, cfg, cuda=True, nccl_mb=nccl)
                cells = [
                    cell(planned[g], layout, optim, plan_step.usable_mb(g), planned[g]["workspaces"], peft)
                    for g in gpus
                ]
                yield [*key, str(seq), *cells]


def page(
    found: list[list[str]], failed: dict[str, str], command: str, minutes: float, torch_version: str
) -> str:
    from pipeline import plan_ranks, plan_step

    header = columns()
    lines = [
        "# Fit table: how many GPUs, and what batch per GPU",
        "",
        f"Generated by `{command}` (`make fit-table`) on {datetime.now():%Y-%m-%d %H:%M} in "
        f"{minutes:.1f} min on a CPU ({platform.machine()}, torch {torch_version}). **From plans only: "
        "every figure is a training step simulated on fake tensors (docs/plan.md), for a CUDA target; no GPU "
        "measured any of it.** The plan's one-process figures are within 5% of measured peaks on CPU "
        "([plan-accuracy.md](plan-accuracy.md)). Its CUDA plan has met a GPU once, on MiniLM on an H200 "
        "(AdamW −0.7%, 8-bit AdamW +2.9%, Adafactor −13.1%; planned again with CUDA's reduction buffers and "
        "dropout counted, −0.8%, 0.0% and −1.3%, not rerun on a GPU: [gpu.md](gpu.md#the-first-run-on-a-gpu)); "
        "the decoders, bf16 (CUDA's autocast policy) and several GPUs are untested on a GPU.",
        "",
        "Each cell: the smallest number of GPUs of that kind on which one sample per GPU fits, with the "
        "sharding that gets there first (docs/plan.md: `zero1` ZeRO-1, `zero2` ZeRO-2, `fsdp` FSDP full "
        "shard; none shown for one GPU), then the largest batch per GPU at that number (sequences of `seq` "
        "tokens, every one at full length; 9999 = 9999 or more). `-`: no number up to 4096 fits. Usable "
        f"memory = the data sheet's GB (10^9 bytes) in MB less {plan_step.CUDA_CONTEXT_MB} MiB for the CUDA context; "
        f"on more than one GPU each also holds {plan_ranks.NCCL_BUFFERS_MB} MiB of NCCL buffers (stated, not "
        "measured); MB = 2^20 bytes. Task `classification`: the sequence classification head (2 labels, one per "
        "sequence); task `causal_lm`: the decoder with its LM head (tied to the embeddings in GPT-2, Qwen2.5-0.5B "
        "and Llama-3.2-1B; a weight of its own in Mistral-7B and Llama-3.1-8B) trained on next-token labels, one "
        "per token, so the step holds the logits (batch x seq x vocabulary), which transformers' loss upcasts to "
        "fp32, and their gradient in backward. Attention "
        "as CUDA's fused kernels run it (flash or memory-efficient: no heads x S x S probabilities kept), the "
        "optimizer's own step "
        "(`foreach` on CUDA), gradient clipping. GaLore, APOLLO and Muon work on whole weight matrices: planned "
        "with DDP and ZeRO-1 only. Column `method`: `full` trains every weight; `lora r=16` trains rank-16 LoRA "
        "adapters (peft) on the attention projections, the base frozen (no gradients, no state), a classifier's "
        "head in full; `qlora r=16 nf4` the same on a base whose Linear layers are 4-bit NF4 (bitsandbytes, "
        "double quantization), as `peft=lora` and `peft=qlora` train them (docs/plan.md#lora-and-qlora-peft); the "
        "adapters' rows with AdamW only, and **planned on one GPU, with DDP, ZeRO-1 and FSDP** (its shards of the "
        "frozen base too): `plan=true` refuses ZeRO-2 with adapters (it counts shards of whole trainable weights, "
        "not ZeRO-2's flat partitions of a frozen base). Not planned: "
        + "; ".join(f"{k} ({v})" for k, v in NOT_PLANNED.items())
        + "."
        + "".join(f" **n/a for {m}: the plan failed ({why}).**" for m, why in failed.items()),
        "",
        "| " + " | ".join(header) + " |",
        "|" + " --- |" * len(header),
        *["| " + " | ".join(row) + " |" for row in found],
        "",
    ]
    return "\n".join(lines)


def columns() -> list[str]:
    from pipeline import plan_step

    header = ["model", "task", "method", "optimizer", "precision", "checkpointing", "seq [tokens]"]
    return header + [f"{g} ({plan_step.usable_mb(g):,.0f} MB)" for g in GPUS]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--models", default=None, help="a,b,c for every task (default: each task's MODELS)")
    parser.add_argument("--optims", default=",".join(OPTIMS), help="full fine-tuning's optimizers")
    parser.add_argument(
        "--peft",
        default=",".join(PEFT),
        help=f"the adapters' rows, each with {','.join(PEFT_OPTIMS)} ('': none)",
    )
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument(
        "--checkpointing", default=",".join(CHECKPOINTING), help="off,on: gradient checkpointing"
    )
    parser.add_argument("--seqs", default=",".join(map(str, SEQS)))
    parser.add_argument(
        "--out", type=Path, default=ROOT / "docs" / "fit-table.md", help="and its .csv beside it"
    )
    parser.add_argument(
        "--outputs-dir", type=Path, default=ROOT / "outputs", help="its cache/plan keeps the simulated steps"
    )
    args = parser.parse_args(argv)
    import torch

    start = time.perf_counter()
    command = "python -m bench.fit_table " + " ".join(sys.argv[1:] if argv is None else argv)
    models = {t: args.models.split(",") if args.models else MODELS[t] for t in args.tasks.split(",")}
    optims, precisions, seqs = args.optims.split(","), args.precisions.split(","), args.seqs.split(",")
    checkpointing, pefts = args.checkpointing.split(","), [p for p in args.peft.split(",") if p]
    ways = len(optims) + len(pefts) * len(PEFT_OPTIMS)
    total = sum(map(len, models.values())) * ways * len(precisions) * len(checkpointing) * len(seqs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    found = []
    failed: dict[str, str] = {}
    lengths = [int(s) for s in seqs]
    store = plan_store(args.outputs_dir)
    planned = (
        rows(t, m, optims, precisions, checkpointing, lengths, GPUS, failed, pefts, store)
        for t, m in models.items()
    )
    for row in itertools.chain.from_iterable(planned):
        found.append(row)
        print(" | ".join(row), flush=True)
        # written after every row: a table stopped early keeps what it planned, and says so
        minutes = (time.perf_counter() - start) / 60
        done = "" if len(found) == total else f" (stopped early? {len(found)} of {total} rows so far)"
        args.out.write_text(page(found, failed, command.strip() + done, minutes, torch.__version__))
        with args.out.with_suffix(".csv").open("w", newline="") as f:
            csv.writer(f).writerows([columns(), *found])
    print(f"[fit-table] {args.out} ({len(found)} rows, {(time.perf_counter() - start) / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
