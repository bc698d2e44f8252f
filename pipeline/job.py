"""One job in its own process: load -> train (or search the largest batch) -> measure -> result.json.

Run by the sweep runner as `python -m pipeline.job JOB_DIR` (JOB_DIR/config.yaml holds the resolved
config), so no job's peak-memory counters, caches or global state can leak into the next one. The result
goes to JOB_DIR/result.json and, on an exception, a one-line summary and the traceback to JOB_DIR/error.txt;
MLflow is left to the runner.
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipeline import MB

RESULT_FILE, ERROR_FILE, CONFIG_FILE = "result.json", "error.txt", "config.yaml"
FAILURE_FILE = "failure.json"  # the failure reason and the figures at the time, for the runner
# peft.save_adapter=true: the trained adapter (peft's save_pretrained) in the job folder, the run's artifact
ADAPTER_DIR = "adapter"


def load(cfg: DictConfig):
    """The data and model stages: (tokenizer, tokenized splits, model)."""
    from pipeline import data, models

    tokenizer, splits, _ = data.prepare(cfg)
    return tokenizer, splits, models.build(cfg, splits.label_names, tokenizer.pad_token_id).model


def run(cfg: DictConfig, job_dir: Path) -> dict:
    """A job's stages, each entered once: data (read, sample, tokenize), model (load, dtypes, adapters), train
    (or search the largest batch), measure (the figures beside the plan's prediction), and the record for the
    runner (with the trained adapter where peft.save_adapter is set)."""
    import torch
    import transformers

    from pipeline import backends, data, measurements, models, optimizers

    if cfg.train.precision == "fp16" and not torch.cuda.is_available():
        raise ValueError(
            "train.precision=fp16 needs a CUDA device and torch sees none: use bf16 or fp32 here"
        )
    transformers.set_seed(cfg.seed)
    tokenizer, splits, collate = data.prepare(cfg)
    built = models.build(cfg, splits.label_names, tokenizer.pad_token_id)
    # the optimizer asked of the registry once: its entry, the Trainer's optim= string, the estimate's variant
    choice = optimizers.choose(cfg)
    trained = backends.run(cfg, choice.spec, built.model, splits, collate, job_dir)
    result = measurements.measure(cfg, choice, built, splits, trained)
    if trained.output is not None and cfg.peft.get("save_adapter") and int(os.environ.get("RANK", "0")) == 0:
        built.model.save_pretrained(job_dir / ADAPTER_DIR)  # the adapters and the head: what peft saves
    return {**result, "datasets": splits.inputs}  # the runner logs them as the run's dataset inputs


def failure_info(err: BaseException) -> dict:
    """Why a job failed (`oom`, `nan_loss`, `preempted` or `exception`) and the figures that explain it (a
    stopped job: the losses and validation figures of its steps so far, as series)."""
    import torch

    from pipeline.backends import NonFiniteLoss
    from pipeline.checkpoint import Preempted

    if isinstance(err, Preempted):
        metrics = {"train_loss_final": err.losses[-1]} if err.losses else {}
        series = {"train_loss": err.losses, **{f"val_{k}": v for k, v in err.val_series.items()}}
        return {"reason": "preempted", "metrics": metrics, "series": series}

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


def result_line(metrics: dict) -> str:
    """The job's result in one line with units, as it prints it (and, for a search or a plan, its run's
    description in MLflow)."""
    m = metrics
    if "max_batch_size" in m:
        return f"largest batch that fits: {m['max_batch_size']}"
    if "optimizer_state_mb" not in m:  # a plan: predicted, nothing trained
        return f"predicted peak {m.get('predicted_peak_mb', float('nan')):.1f} MB"
    return (
        f"state {m['optimizer_state_mb']:.2f} MB "
        f"(estimated {m.get('estimated_optimizer_state_mb', float('nan')):.2f}), "
        f"peak {m['peak_memory_mb']:.1f} MB, {quality_text(m, 'eval ')}, "
        f"{m['train_samples_per_second']:.1f} samples/s"
    )


def quality_text(metrics: dict, prefix: str = "") -> str:
    """The held-out figure a run is read by: a classifier's F1 (`F1 0.727`), a language model's perplexity
    (`perplexity 312.4`)."""
    if "eval_perplexity" in metrics:
        return f"{prefix}perplexity {metrics['eval_perplexity']:,.1f}"
    return f"{prefix}F1 {metrics.get('eval_f1', float('nan')):.3f}"


def short_mb(value: float) -> str:
    """MB as the runs table reads them: 3 significant digits, whole MB from 1000 on (`7.72`, `22.9`, `1,234`)."""
    return f"{value:,.0f}" if value >= 1000 else f"{value:.3g}"


def collapse_line(cfg, metrics: dict, tags: dict) -> str | None:
    """What a collapsed run (tag collapsed: nearly every prediction in one class) says on the console: that the
    model did not learn, and what to try; None for a run that did not collapse."""
    if tags.get("collapsed") != "true":
        return None
    share = max(metrics.get(f"{split}_top_class_share", 0) for split in ("eval", "val"))
    if cfg.model.get("pretrained"):
        hint = "try other rates (train.lr_scale=0.3,1,3 in a sweep) or more steps (train.max_steps)"
    else:  # the reference rates are tuned for a pretrained model: random weights learn slowly at them
        hint = (
            "its weights are random (model.pretrained=false) and the optimizers' reference rates are tuned for "
            "a pretrained model: try train.lr_scale=10 or more steps (train.max_steps), or a pretrained model "
            "(model=minilm)"
        )
    return f"collapsed: {share:.0%} of the predictions in one class, the model did not learn; {hint}"


def hardly_learned_line(metrics: dict, tags: dict) -> str | None:
    """What a language model that hardly learned (tag hardly_learned: its loss near a uniform guess's) says on
    the console: how near, and what to try; None for any other run."""
    if tags.get("hardly_learned") != "true":
        return None
    which, loss = (
        ("eval", metrics["eval_loss"])
        if "eval_loss" in metrics
        else ("training", metrics["train_loss_final"])
    )
    uniform = loss / metrics["loss_vs_uniform"]  # ln(vocabulary size)
    return (
        f"hardly learned: its {which} loss, {loss:.2f} nats, is {metrics['loss_vs_uniform']:.0%} of a uniform "
        f"guess's over the vocabulary, ln({round(math.exp(uniform)):,}) = {uniform:.2f}; try more steps "
        "(train.max_steps) or a larger rate (train.lr_scale=3,10 in a sweep)"
    )


def run_description(metrics: dict, tags: dict | None = None) -> str:
    """The run's description in MLflow: the figures that decide, within the 50 characters the runs table
    shows (its tooltip and the run page show all of it): `state 7.72 MB, peak 22.9 MB, F1 0.727`, and
    ` (collapsed)` where (nearly) every prediction fell in one class (tag collapsed: its F1 measures the
    class balance, not a trained model), ` (hardly learned)` for a language model near a uniform guess."""
    m, tags = metrics, tags or {}
    if "optimizer_state_mb" not in m or not ("eval_f1" in m or "eval_perplexity" in m):
        return result_line(m)
    marks = {"collapsed": " (collapsed)", "hardly_learned": " (hardly learned)"}
    mark = "".join(text for tag, text in marks.items() if tags.get(tag) == "true")
    return (
        f"state {short_mb(m['optimizer_state_mb'])} MB, peak {short_mb(m['peak_memory_mb'])} MB, "
        f"{quality_text(m)}{mark}"
    )


def main(job_dir: Path) -> int:
    from pipeline import checkpoint, distributed, quiet, starter

    starter.die_with_parent()
    quiet.install()  # before torch, transformers and torchao log anything
    cfg = OmegaConf.load(job_dir / CONFIG_FILE)
    rank = int(os.environ.get("RANK", "0"))  # a job of several processes: only rank 0 reports
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:  # SIGTERM: stop at the end of a step, checkpointed
        checkpoint.listen()
    try:
        distributed.check_world_size(cfg, "environment")  # as many processes as the config says, or none
        result = run(cfg, job_dir)
    except BaseException as err:  # every failure goes to the runner: reason, figures, summary, traceback
        message = str(err).strip().splitlines()
        summary = f"{type(err).__name__}: {message[0] if message else ''}"
        if rank == 0:
            (job_dir / ERROR_FILE).write_text(f"{summary}\n\n{traceback.format_exc()}")
            (job_dir / FAILURE_FILE).write_text(json.dumps(failure_info(err)))
        if not isinstance(err, checkpoint.Preempted):  # (a stop is no error: its line says it)
            traceback.print_exc()
        return 1
    if rank != 0:
        return 0
    (job_dir / RESULT_FILE).write_text(json.dumps(result, indent=1))
    print(f"[job] {result_line(result['metrics'])}", flush=True)
    for line in (
        collapse_line(cfg, result["metrics"], result["tags"]),
        hardly_learned_line(result["metrics"], result["tags"]),
    ):
        if line:
            print(f"[job] {line}", flush=True)
    return 0


if __name__ == "__main__":
    code = main(Path(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # everything is written: skip tearing down torch & co. (1-2 s per job process)
