"""One job as several processes (ranks): world-size checks, ZeRO-1 and FSDP for the Accelerator loop, and the
per-rank figures that rank 0 records.

torchrun (or submitit) starts the ranks; Accelerate / the Trainer join them into one process group (gloo on
CPU, NCCL on CUDA). `optimizer_state_mb` stays what one device holds: rank 0's share; the sum over ranks is
`optimizer_state_mb_total`.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline import MB


def env_rank() -> int:
    """This process's rank as torchrun / submitit set it (0 when the job is one process)."""
    return int(os.environ.get("RANK", "0"))


def check_world_size(cfg, where: str) -> int:
    """The job must run as exactly launcher.nproc_per_job processes: never a silent single-process fallback."""
    expected = cfg.launcher.nproc_per_job
    if where == "environment":
        size = int(os.environ.get("WORLD_SIZE", "1"))
    else:  # the process group the backend joined
        size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if size != expected:
        raise RuntimeError(
            f"launcher.nproc_per_job={expected} but the job runs as {size} process(es) ({where}): "
            "it must be started by torchrun / submitit with that many ranks, and the backend must join them"
        )
    return size


def zero1(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The same optimizer (class, settings, parameter groups) with its state sharded over the ranks."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    groups = [dict(group) for group in optimizer.param_groups]
    # the defaults the class takes back (torch's AdamW inherits an Adam default its constructor refuses)
    accepted = inspect.signature(type(optimizer)).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), **defaults)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose state this rank holds (ZeRO-1 keeps its shard in `.optim`)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def fully_sharded(model: torch.nn.Module, layers) -> torch.nn.Module:
    """The model under FSDP2 (torch's `fully_shard`, on CUDA/NCCL and on CPU/gloo alike): every parameter,
    adapters and frozen base alike, sharded over the ranks by its first dimension (padded to a multiple of
    them), a unit per transformer layer (`layers`: its stack), then the root (embeddings, head, final norm).
    A rank gathers a unit's weights for its forward and again for its backward (prefetching the next unit's there), and frees them after; the root's stay
    gathered from the forward to the end of the backward. Each unit's gradients are reduce-scattered to the
    rank's shard at the end of its backward. Weights are gathered in their own dtype (mixed precision is
    autocast's, as on one process), so the optimizer steps the shards of the weights it steps on one process.
    pipeline.plan_ranks plans this layout."""
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer)
    return fully_shard(model)


def param_checksum(model) -> str:
    """sha256 of every parameter's bytes: equal on every rank when DDP / ZeRO kept the replicas in sync."""
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


@dataclass
class Ranks:
    """What the ranks of a job measured, on every rank: how many they are, each one's record (rank 0's first)
    and the per-rank and total figures rank 0 records (rank_metrics)."""

    size: int
    records: list[dict]
    metrics: dict[str, float]


def gather(cfg, model, record: dict, job_dir: Path) -> Ranks:
    """Every rank's `record`, with its parameters' checksum where the ranks hold whole replicas to compare, on
    every rank (a collective: all ranks call it), once the process group is known to hold
    launcher.nproc_per_job ranks (check_world_size); each rank also writes its own record (gather_ranks)."""
    size = check_world_size(cfg, "process group")
    # (one process has nothing to compare with; FSDP's ranks hold different shards)
    checksum = None if size == 1 or cfg.train.sharding == "fsdp" else param_checksum(model)
    records = gather_ranks({**record, "param_checksum": checksum}, job_dir)
    return Ranks(size, records, rank_metrics(records))


def gather_ranks(record: dict, job_dir: Path) -> list[dict]:
    """Every rank's record, on every rank (a collective: all ranks call it). Each rank also writes its own
    record to JOB_DIR/rank<r>.json, evidence that does not depend on the gather."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    (job_dir / f"rank{rank}.json").write_text(json.dumps(record, indent=1))
    if not dist.is_initialized():
        return [record]
    records = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    return records


def rank_metrics(records: list[dict]) -> dict[str, float]:
    """Per-rank and total figures of a multi-process job (nothing for a single process)."""
    if len(records) == 1:
        return {}
    # (the world size itself is the run's param `world_size`)
    metrics = {
        "optimizer_state_mb_total": sum(r["optimizer_state_bytes"] for r in records) / MB,
    }
    checksums = {r["param_checksum"] for r in records}
    if None not in checksums:  # FSDP ranks hold different shards: nothing to compare
        metrics["params_in_sync"] = float(len(checksums) == 1)
    for rank, r in enumerate(records):
        metrics[f"optimizer_state_mb_rank{rank}"] = r["optimizer_state_bytes"] / MB
        metrics[f"peak_memory_mb_rank{rank}"] = r["peak_memory_mb"]
    return metrics
