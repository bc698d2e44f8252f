"""Hugging Face Trainer backend: the optimizer is chosen by TrainingArguments(optim=<registry string>)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import ProgressCallback, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import has_length

from pipeline import learning_rate, quiet
from pipeline.backends import (
    CHECKPOINTING_KWARGS,
    METRIC_KEYS,
    NonFiniteLoss,
    TrainOutput,
    check_device,
    checkpointing_name,
    classification_metrics,
    optimizer_step_mode,
    training_memory,
)


class StopOnNonFiniteLoss(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(loss):
            raise NonFiniteLoss(state.global_step, loss)


class UpdatedInBackward(TrainerCallback):
    """Ends the peak tracker's step after the Trainer's optimizer step, for an optimizer that updates inside
    the backward pass: accelerate's wrapper skips LOMO's step, so no optimizer step hook marks the end."""

    def __init__(self, peak):
        self.peak = peak

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.peak.updated_in_backward(getattr(optimizer, "optimizer", optimizer))


class QuietProgress(ProgressCallback):
    """The Trainer's progress bars without its per-step log dicts (`{'loss': ..., 'grad_norm': ...}`, one line
    a step at logging_steps=1): the quiet console (pipeline.quiet). The training bar shows at once and stays;
    an evaluation's bar shows only when the evaluation is slow (tqdm's delay) and is erased when it ends."""

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.training_bar = tqdm(total=state.max_steps, dynamic_ncols=True, delay=0)
        self.current_step = 0

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if state.is_world_process_zero and has_length(eval_dataloader):
            if self.prediction_bar is None:
                self.prediction_bar = tqdm(total=len(eval_dataloader), leave=False, dynamic_ncols=True)
            self.prediction_bar.update(1)

    def on_log(self, args, state, control, logs=None, **kwargs):
        pass  # the log history keeps every entry: the losses are recorded from it, not from the console


def close_progress_bars(trainer: Trainer) -> None:
    """Close the bars of a training that raised (out of memory, NaN): the Trainer closes them only at the end
    of a training, and an open bar would have the next printed line (a traceback, a probe's verdict) glued
    onto it."""
    for callback in trainer.callback_handler.callbacks:
        for name in ("training_bar", "prediction_bar"):
            bar = getattr(callback, name, None)
            if bar is not None:
                bar.close()
                setattr(callback, name, None)


def train(cfg, model, splits, spec, collate, job_dir: Path, evaluate: bool = True) -> TrainOutput:
    # the Trainer's own optim= string where its path carries the config's settings; otherwise it is handed
    # the registry's optimizer (the one the Accelerator loop builds)
    optim = spec.trainer_string(cfg)
    optim_args = {"optim": optim, **spec.trainer_args(cfg)} if optim else {}
    checkpointing = checkpointing_name(TrainingArguments)  # the Trainer enables it on the model at train()
    # periodic validation: the Trainer's own eval_strategy="steps" on the validation split
    every = cfg.eval.get("every_steps", 0) if splits.val is not None and evaluate else 0
    args = TrainingArguments(
        output_dir=str(job_dir / "trainer"),
        max_steps=cfg.train.max_steps,
        per_device_train_batch_size=cfg.batch_size,
        per_device_eval_batch_size=cfg.eval.batch_size,
        learning_rate=learning_rate(cfg),
        weight_decay=cfg.train.weight_decay,
        lr_scheduler_type=cfg.train.lr_scheduler,
        warmup_steps=cfg.train.warmup_steps,
        max_grad_norm=cfg.train.max_grad_norm,
        seed=cfg.seed,
        logging_strategy="steps",
        logging_steps=1,
        eval_strategy="steps" if every else "no",
        eval_steps=every or None,
        save_strategy="no",
        report_to="none",  # the pipeline records to MLflow itself: exactly one run per job
        logging_nan_inf_filter=False,  # a NaN loss must show, not be smoothed over
        # under torchrun the Trainer would scale the (already per-batch mean) classification loss by the number
        # of ranks, doubling gradients and logged losses on 2 ranks; one process is unaffected
        average_tokens_across_devices=False,
        use_cpu=not torch.cuda.is_available(),
        bf16=cfg.train.precision == "bf16",
        fp16=cfg.train.precision == "fp16",
        train_sampling_strategy="group_by_length" if cfg.train.group_by_length else "random",
        **{
            checkpointing: cfg.train.gradient_checkpointing,
            f"{checkpointing}_kwargs": dict(CHECKPOINTING_KWARGS),
        },
        **optim_args,
    )
    check_device(spec, args.device)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=splits.train,
        eval_dataset=splits.val if every else splits.eval,
        data_collator=collate,
        compute_metrics=lambda p: classification_metrics(p.predictions, p.label_ids, splits.num_labels),
        optimizers=(None, None) if optim else (spec.build(model, cfg), None),
        callbacks=[StopOnNonFiniteLoss()],
    )
    if quiet.is_quiet():
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(QuietProgress())
    with training_memory(cfg, spec, args.device, model) as peak, optimizer_step_mode(spec, args.device):
        if spec.in_backward:
            trainer.add_callback(UpdatedInBackward(peak))
        start = time.perf_counter()
        try:
            trainer.train()
        except BaseException:
            close_progress_bars(trainer)
            raise
        runtime = time.perf_counter() - start
    history = trainer.state.log_history
    losses = [entry["loss"] for entry in history if "loss" in entry]
    val_series: dict[str, dict[int, float]] = {}
    for entry in history:  # the periodic validation passes (the last step's is the final one, below)
        if "eval_loss" in entry and entry["step"] < cfg.train.max_steps:
            for key in ("loss", *METRIC_KEYS):
                if f"eval_{key}" in entry:
                    val_series.setdefault(key, {})[entry["step"]] = entry[f"eval_{key}"]

    def evaluated(dataset, prefix: str) -> dict[str, float]:
        metrics = trainer.evaluate(eval_dataset=dataset, metric_key_prefix=prefix)
        return {k: metrics[f"{prefix}_{k}"] for k in ("loss", *METRIC_KEYS) if f"{prefix}_{k}" in metrics}

    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # unwrap accelerate's wrapper
    return TrainOutput(
        optimizer=optimizer,
        losses=losses,
        eval_metrics=evaluated(splits.eval, "eval") if evaluate else {},
        # (the Trainer's eval-time spent inside train() is taken out of the throughput by the StepTimer)
        train_runtime_s=runtime,
        peak=peak,
        device=str(args.device),
        val_metrics=evaluated(splits.val, "val") if evaluate and splits.val is not None else {},
        val_series=val_series,
    )
