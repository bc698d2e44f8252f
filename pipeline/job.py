"""One job in its own process: data, model, optimizer -> train -> evaluate -> measure -> result.json.

Run by the sweep runner as `python -m pipeline.job JOB_DIR` (JOB_DIR/config.yaml holds the resolved
config), so no job's peak-memory counters, caches or global state can leak into the next one. The result
goes to JOB_DIR/result.json and, on an exception, a one-line summary and the traceback to JOB_DIR/error.txt;
MLflow is left to the runner.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipeline import MB

RESULT_FILE, ERROR_FILE, CONFIG_FILE = "result.json", "error.txt", "config.yaml"
FAILURE_FILE = "failure.json"  # the failure reason and the figures at the time, for the runner


def library_versions() -> dict[str, str]:
    import accelerate
    import datasets
    import torch
    import transformers

    return {m.__name__: m.__version__ for m in (torch, transformers, accelerate, datasets)}


def eager_compile(fn=None, **options):
    """Stand-in for torch.compile that returns the function unchanged."""
    return fn if fn is not None else (lambda f: f)


def run(cfg: DictConfig, job_dir: Path) -> dict:
    import torch
    import transformers

    from pipeline import backends, data, distributed, models, optimizers, predict
    from pipeline.memory import optimizer_state_size, peak_rss_mb
    from pipeline.timing import StepTimer, peak_flops

    spec = optimizers.get(cfg.optim.name)
    distributed.check_world_size(cfg, "environment")
    tags = {f"version.{k}": v for k, v in library_versions().items()}
    if torch.cuda.is_available():  # the devices the runner's GPU pool gave this job
        tags["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES", "all")
    if spec.compiles_step and not torch.cuda.is_available():
        # torch.compile cannot trace through the CPU peak tracker (a TorchDispatchMode) and torchao asks for
        # fullgraph=True, which then raises: run its step eagerly instead (same math, same state)
        torch.compile = eager_compile
        tags["optim_compiled"] = "false: eager on CPU, where the tensor-level peak tracker is active"
    precision = cfg.train.precision
    if precision == "fp16" and not torch.cuda.is_available():
        raise ValueError(
            "train.precision=fp16 needs a CUDA device and torch sees none: use bf16 or fp32 here"
        )
    transformers.set_seed(cfg.seed)
    tokenizer = models.load_tokenizer(cfg.model)
    splits = data.load_splits(cfg.data)
    model = models.load_model(cfg.model, splits.num_labels)
    model.config.pad_token_id = tokenizer.pad_token_id
    if precision == "bf16_pure":
        # bf16 weights, no fp32 master copy: the optimizer's state follows their dtype
        model.to(torch.bfloat16)
    splits = data.tokenize(splits, tokenizer, cfg.train.max_length, models.vocab_size(model))
    collate = data.PaddingCollator(tokenizer, cfg.train.padding, cfg.train.max_length)
    backend = cfg.backend.name
    variant = spec.trainer_variant if backend == "trainer" and spec.trainer_optim else None
    num_params = sum(p.numel() for p in model.parameters())
    estimate = spec.estimate(optimizers.param_infos(model), cfg, variant, model.config)
    if cfg.find_batch_size:
        return find_batch_size(cfg, model, splits, spec, tokenizer, estimate, job_dir, tags)

    with StepTimer() as steps:
        out = backends.get(backend).train(cfg, model, splits, spec, collate, job_dir)

    world_size = distributed.check_world_size(cfg, "process group")
    state = optimizer_state_size(out.optimizer)
    if cfg.train.sharding == "zero1":  # this rank's shard: the estimate of the parameters it owns
        owned = {id(p) for group in out.optimizer.param_groups for p in group["params"]}
        trainable = [p for p in model.parameters() if p.requires_grad]
        infos = [i for i, p in zip(optimizers.param_infos(model), trainable, strict=True) if id(p) in owned]
        estimate = spec.estimate(infos, cfg, variant, model.config)
    tokens, padded_tokens = collate.token_counts(cfg.train.max_steps)
    memory = out.peak.metrics()
    ranks = distributed.gather_ranks(
        {
            "optimizer_state_bytes": state.bytes,
            "peak_memory_mb": memory["peak_memory_mb"],
            # (compared across ranks: one process has nothing to compare with)
            "param_checksum": None
            if world_size == 1 or cfg.train.sharding == "fsdp"
            else distributed.param_checksum(model),
            "tokens": tokens,
            "padded_tokens": padded_tokens,
        },
        job_dir,
    )
    # throughput of the whole job: every rank's batches
    samples = cfg.train.max_steps * cfg.batch_size * world_size
    tokens, padded_tokens = sum(r["tokens"] for r in ranks), sum(r["padded_tokens"] for r in ranks)
    peak, peak_source = peak_flops(out.device, precision, Path(cfg.outputs_dir) / "cache")
    peak = peak and peak * world_size
    tags["mfu_peak"] = peak_source
    tags["peak_breakdown"] = out.peak.breakdown_na or f"step {out.peak.breakdown_step}"
    if len(out.peak.largest_batch) == 2 and cfg.train.sharding != "fsdp":  # FSDP: no per-device model yet
        # (batch, seq) of the largest batch: the shapes the peak comes from
        memory.update(
            predict.predicted_peak(
                optimizers.param_infos(model),
                estimate.bytes,
                model.config,
                *out.peak.largest_batch,
                precision,
                spec.step_temporaries,
            )
        )
        memory["predicted_peak_error_pct"] = 100 * (
            memory["predicted_peak_mb"] / memory["peak_memory_mb"] - 1
        )
    # training costs about 6 FLOPs per parameter per (non-padding) token: 2 forward, 4 backward
    model_flops_per_s = 6 * num_params * tokens / out.train_runtime_s
    metrics = {
        "model_num_params": num_params,
        "optimizer_state_numel": state.numel,
        "optimizer_state_bytes": state.bytes,
        "optimizer_state_mb": state.mb,
        "optimizer_state_bytes_per_param": state.bytes / num_params,
        **({} if cfg.train.sharding == "fsdp" else {"estimated_optimizer_state_mb": estimate.mb}),
        "optimizer_step_ms": steps.median_ms,
        # steady state: the first steps run under the CPU peak tracker (and warm up)
        **({"train_step_ms": ms} if (ms := steps.train_step_ms(skip=cfg.memory_track_steps or 1)) else {}),
        **memory,
        "peak_rss_mb": peak_rss_mb(),
        "train_loss_final": out.losses[-1],
        "train_runtime_s": out.train_runtime_s,
        "train_samples_per_second": samples / out.train_runtime_s,
        "train_tokens": tokens,
        "train_tokens_per_second": tokens / out.train_runtime_s,
        "padding_fraction": 1 - tokens / padded_tokens,
        **({"mfu": model_flops_per_s / peak, "device_peak_tflops": peak / 1e12} if peak else {}),
        **{f"eval_{k}": v for k, v in out.eval_metrics.items()},
        **distributed.rank_metrics(ranks),
    }
    if "paged" in spec.name and not out.device.startswith("cuda"):
        tags["optim_paged"] = "false: bitsandbytes falls back to non-paged state off CUDA"
    return {
        "metrics": metrics,
        "series": {"train_loss": out.losses},
        "params": {
            "device": out.device,
            "num_labels": splits.num_labels,
            "train_samples": len(splits.train),
            "eval_samples": len(splits.eval),
            "optim_variant": variant or "plain",
            "largest_batch": "x".join(map(str, out.peak.largest_batch)),
        },
        "tags": tags,
    }


def find_batch_size(cfg, model, splits, spec, tokenizer, estimate, job_dir: Path, tags: dict) -> dict:
    """The largest batch that fits the memory budget (measured by probes), beside the predicted one."""
    import torch

    from pipeline import backends, batch_size, data, optimizers, predict

    budget = cfg.memory_budget_mb
    if budget is None and not torch.cuda.is_available():
        raise ValueError("find_batch_size=true on CPU needs memory_budget_mb=<MB>: there is no device limit")
    best, fitting = batch_size.search(
        cfg,
        model,
        splits,
        spec,
        lambda probe: data.PaddingCollator(tokenizer, probe.train.padding, probe.train.max_length),
        job_dir,
        backends.get(cfg.backend.name).train,
    )
    params = optimizers.param_infos(model)

    def predicted_fit(n: int) -> bool:
        figures = predict.predicted_peak(
            params,
            estimate.bytes,
            model.config,
            n,
            cfg.train.max_length,
            cfg.train.precision,
            spec.step_temporaries,
        )
        return figures["predicted_peak_mb"] <= budget

    metrics = {"max_batch_size": best, "model_num_params": sum(p.numel() for p in model.parameters())}
    if budget is not None:
        metrics["predicted_max_batch_size"] = batch_size.largest_fitting(predicted_fit, len(splits.train))
    if best:
        at_best = fitting[best]
        state = at_best.pop("state")
        metrics.update({f"max_batch_{k}": v for k, v in at_best.items()})
        metrics.update(
            optimizer_state_mb=state.mb,
            optimizer_state_numel=state.numel,
            estimated_optimizer_state_mb=estimate.mb,
        )
    tags["mode"] = "find_batch_size"
    return {
        "metrics": metrics,
        "series": {"probe_peak_mb": {n: f["peak_memory_mb"] for n, f in sorted(fitting.items())}},
        "params": {
            "device": "cuda" if torch.cuda.is_available() else "cpu",
            "num_labels": splits.num_labels,
            "train_samples": len(splits.train),
            "probe_padding": "max_length",
        },
        "tags": tags,
    }


def failure_info(err: BaseException) -> dict:
    """Why a job failed (`oom`, `nan_loss` or `exception`) and the figures that explain it."""
    import torch

    from pipeline.backends import NonFiniteLoss

    if isinstance(err, torch.OutOfMemoryError):
        if hasattr(err, "figures_mb"):  # the CPU budget
            return {"reason": "oom", "metrics": err.figures_mb}
        return {
            "reason": "oom",
            "metrics": {
                "memory_allocated_mb": torch.cuda.memory_allocated() / MB,
                "peak_memory_mb": torch.cuda.max_memory_allocated() / MB,
            },
        }
    if isinstance(err, NonFiniteLoss):
        return {"reason": "nan_loss", "metrics": {"nan_step": err.step}}
    return {"reason": "exception", "metrics": {}}


def main(job_dir: Path) -> int:
    cfg = OmegaConf.load(job_dir / CONFIG_FILE)
    rank = int(os.environ.get("RANK", "0"))  # a job of several processes: only rank 0 reports
    try:
        result = run(cfg, job_dir)
    except BaseException as err:  # every failure goes to the runner: reason, figures, summary, traceback
        message = str(err).strip().splitlines()
        summary = f"{type(err).__name__}: {message[0] if message else ''}"
        if rank == 0:
            (job_dir / ERROR_FILE).write_text(f"{summary}\n\n{traceback.format_exc()}")
            (job_dir / FAILURE_FILE).write_text(json.dumps(failure_info(err)))
        traceback.print_exc()
        return 1
    if rank != 0:
        return 0
    (job_dir / RESULT_FILE).write_text(json.dumps(result, indent=1))
    m = result["metrics"]
    if cfg.find_batch_size:
        print(f"[job] largest batch that fits: {m['max_batch_size']}", flush=True)
        return 0
    print(
        f"[job] state {m['optimizer_state_mb']:.2f} MB "
        f"(estimated {m.get('estimated_optimizer_state_mb', float('nan')):.2f}), "
        f"peak {m['peak_memory_mb']:.1f} MB, eval F1 {m['eval_f1']:.3f}, "
        f"{m['train_samples_per_second']:.1f} samples/s",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    code = main(Path(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # everything is written: skip tearing down torch & co. (1-2 s per job process)
