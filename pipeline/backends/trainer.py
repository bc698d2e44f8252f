"""Hugging Face Trainer backend: the optimizer is chosen by TrainingArguments(optim=<registry string>)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import ProgressCallback, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_pt_utils import nested_gather
from transformers.trainer_utils import has_length
from transformers.training_args import ParallelMode

from pipeline import checkpoint, learning_rate, quiet
from pipeline.backends import (
    CHECKPOINTING_KWARGS,
    StepLosses,
    TrainOutput,
    check_device,
    checkpointing_name,
    classification_metrics,
    language_model_metrics,
    metric_keys,
    next_token_accuracy,
    optimizer_step_mode,
    restored,
    training_memory,
)
from pipeline.timing import step_sizes


class LossKeepingTrainer(Trainer):
    """The Trainer, keeping each step's training loss (what its `training_step` returns, summed over a step's
    batches) on the device in `step_losses`: its own logging would read the loss and the gradient norm at
    every logged step."""

    def __init__(self, *args, step_losses: StepLosses, saves: checkpoint.Checkpoints, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_losses, self.saves = step_losses, saves
        self.meta = None  # step -> what pipeline.json keeps of the steps so far (set once training starts)
        self._writing: Path | None = None

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.step_losses.add(loss)
        return loss

    def _save_checkpoint(self, model, trial):
        """The Trainer's own checkpoint (weights, or a peft model's adapters; optimizer, schedule, random
        streams, its state), written whole or not at all (pipeline.checkpoint.Checkpoints.save)."""

        def write(folder: Path) -> None:
            self._writing = folder
            try:
                super(LossKeepingTrainer, self)._save_checkpoint(model, trial)
            finally:
                self._writing = None

        self.saves.save(self.state.global_step, write, self.meta(self.state.global_step))

    def _get_output_dir(self, trial) -> str:
        return str(self._writing) if self._writing is not None else super()._get_output_dir(trial)


class ReadLosses(TrainerCallback):
    """Reads the kept losses every LOSS_READ_STEPS steps, after the optimizer step (StepLosses.step_ended): a
    NaN or infinite loss ends the training there. A checkpoint due at this step is saved, and a job asked to
    stop stops (pipeline.checkpoint). `per_epoch`: the batches of an epoch (what groups them into steps)."""

    def __init__(self, step_losses: StepLosses, saves: checkpoint.Checkpoints):
        self.step_losses, self.saves = step_losses, saves
        self.per_epoch = None

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        self.per_epoch = len(train_dataloader)

    def on_step_end(self, args, state, control, **kwargs):
        self.step_losses.step_ended()
        control.should_save = self.saves.due(state.global_step)
        control.should_training_stop = control.should_training_stop or checkpoint.stop_asked()


def mean_over_ranks(args: TrainingArguments):
    """Each step's loss as the Trainer's logging would give it: in fp32, over several ranks their mean (the
    ranks' values gathered in rank order, then averaged step by step, as its `nested_gather(...).mean()`)."""

    def combine(stacked: torch.Tensor) -> torch.Tensor:
        stacked = stacked.float()
        if args.parallel_mode != ParallelMode.DISTRIBUTED:
            return stacked
        ranks = nested_gather(stacked, args.parallel_mode).view(-1, len(stacked))
        return torch.stack([ranks[:, step].contiguous().mean() for step in range(len(stacked))])

    return combine


class UpdatedInBackward(TrainerCallback):
    """Ends the peak tracker's step after the Trainer's optimizer step, for an optimizer that updates inside
    the backward pass: accelerate's wrapper skips LOMO's step, so no optimizer step hook marks the end."""

    def __init__(self, peak):
        self.peak = peak

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.peak.updated_in_backward(getattr(optimizer, "optimizer", optimizer))


class QuietProgress(ProgressCallback):
    """The Trainer's progress bars without its log dicts (the training's summary at its end, evaluations'
    figures): the quiet console (pipeline.quiet). The training bar shows at once and stays; an evaluation's
    bar, named by its split (`split`: eval, val) as the Accelerator loop's, shows only when the evaluation is
    slow (tqdm's delay) and is erased when it ends."""

    split = "val"  # the split evaluated next: the periodic passes while training validate

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.training_bar = tqdm(total=state.max_steps, desc="train", dynamic_ncols=True, delay=0)
        self.current_step = 0

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if state.is_world_process_zero and has_length(eval_dataloader):
            if self.prediction_bar is None:
                self.prediction_bar = tqdm(
                    total=len(eval_dataloader), desc=self.split, leave=False, dynamic_ncols=True
                )
            self.prediction_bar.update(1)

    def on_log(self, args, state, control, logs=None, **kwargs):
        pass  # the log history keeps every entry; the console shows none


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


def quality(splits) -> dict:
    """The Trainer's compute_metrics for the splits' task. A language model's: the logits reduced to their
    argmax batch by batch (a whole split's logits, sequence x vocabulary per text, would not fit in memory)
    and perplexity from the loss, which the Trainer computes itself (eval_loss) and hands to no metric."""
    if splits.task != "causal_lm":
        return {
            "compute_metrics": lambda p: classification_metrics(p.predictions, p.label_ids, splits.num_labels)
        }

    def compute(p):
        return {"next_token_accuracy": next_token_accuracy(p.predictions, p.label_ids)}

    return {
        "compute_metrics": compute,
        "preprocess_logits_for_metrics": lambda logits, labels: logits.argmax(dim=-1),
    }


def with_perplexity(metrics: dict, prefix: str) -> dict:
    """The Trainer's evaluation of a language model with its perplexity (exp of the eval loss)."""
    key = f"{prefix}_next_token_accuracy"
    if key not in metrics:
        return metrics
    lm = language_model_metrics(metrics[f"{prefix}_loss"], metrics[key])
    return {**metrics, **{f"{prefix}_{k}": v for k, v in lm.items()}}


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
        gradient_accumulation_steps=cfg.train.gradient_accumulation_steps,
        per_device_train_batch_size=cfg.batch_size,
        per_device_eval_batch_size=cfg.eval.batch_size,
        learning_rate=learning_rate(cfg),
        weight_decay=cfg.train.weight_decay,
        lr_scheduler_type=cfg.train.lr_scheduler,
        warmup_steps=cfg.train.warmup_steps,
        max_grad_norm=cfg.train.max_grad_norm,
        seed=cfg.seed,
        # no logging while training: it would read the loss and the gradient norm from the device at every
        # logged step. Each step's loss is kept on the device instead (LossKeepingTrainer, StepLosses)
        logging_strategy="no",
        eval_strategy="steps" if every else "no",
        eval_steps=every or None,
        save_strategy="no",
        report_to="none",  # the pipeline records to MLflow itself: exactly one run per job
        # a NaN loss must show, not be smoothed over (and the filter reads every step's loss from the device)
        logging_nan_inf_filter=False,
        # under torchrun the Trainer would scale the (already per-batch mean) classification loss by the number
        # of ranks, doubling gradients and logged losses on 2 ranks; one process is unaffected
        average_tokens_across_devices=False,
        use_cpu=not torch.cuda.is_available(),
        # each batch copied to the device from pinned memory (dataloader_pin_memory, on by default) without the
        # host waiting for the copy (accelerate's default copy blocks, once a step)
        accelerator_config={"non_blocking": True},
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
    step_losses = StepLosses(mean_over_ranks(args))
    saves = checkpoint.Checkpoints.of_job(cfg, bool(spec.in_backward))
    found = saves.latest()
    trainer = LossKeepingTrainer(
        model=model,
        args=args,
        train_dataset=splits.train,
        eval_dataset=splits.val if every else splits.eval,
        data_collator=collate,
        **quality(splits),
        optimizers=(None, None) if optim else (spec.build(model, cfg), None),
        callbacks=[reading := ReadLosses(step_losses, saves)],
        step_losses=step_losses,
        saves=saves,
    )
    if splits.task != "causal_lm":
        # a classifier's loss ignores num_items_in_batch, which the Trainer would then count as scaled: it divides
        # each batch's mean loss by the batches a step instead (the step's loss is their mean, as one big batch's)
        trainer.model_accepts_loss_kwargs = False
    if quiet.is_quiet():
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(QuietProgress())
    keys = ("loss", *metric_keys(splits.task))  # the figures an evaluation gives
    with training_memory(cfg, spec, args.device, model) as peak, optimizer_step_mode(spec, args.device):
        if spec.in_backward:
            trainer.add_callback(UpdatedInBackward(peak))
        start, first, resume = time.perf_counter(), 1, None
        if found is not None:  # the Trainer's own resume: its state, the data order, the random streams
            restored(saves.meta, collate, step_losses, {})
            first, resume = saves.meta["step"] + 1, str(next(found.glob("checkpoint-*")))
            print(f"[job] resumed from {found} at step {first}", flush=True)

        def meta(step: int) -> dict:  # (the validation series are in the Trainer's state)
            peak_mb, took = peak.metrics()["peak_memory_mb"], time.perf_counter() - start
            segments = saves.segments(peak_mb, took, first, step)
            return {
                "losses": step_losses.read(),
                "batches": collate.batches[: sum(step_sizes(step, reading.per_epoch, cfg))],
                "val_series": {},
                "segments": segments,
            }

        trainer.meta = meta
        try:
            trainer.train(resume_from_checkpoint=resume)
            step_losses.read()  # the steps since the last reading
        except BaseException:
            close_progress_bars(trainer)
            raise
        runtime = time.perf_counter() - start
    history = trainer.state.log_history
    val_series: dict[str, dict[int, float]] = {}
    for entry in history:  # the periodic validation passes (the last step's is the final one, below)
        entry = with_perplexity(entry, "eval")
        if "eval_loss" in entry and entry["step"] < cfg.train.max_steps:
            for key in keys:
                if f"eval_{key}" in entry:
                    val_series.setdefault(key, {})[entry["step"]] = entry[f"eval_{key}"]
    if checkpoint.stop_asked():
        step = trainer.state.global_step
        saved = saves.latest() if saves.meta.get("step") == step else None
        raise checkpoint.Preempted(step, saved, step_losses.values, val_series)

    def evaluated(dataset, prefix: str) -> dict[str, float]:
        for callback in trainer.callback_handler.callbacks:  # its bar's name
            if isinstance(callback, QuietProgress):
                callback.split = prefix
        metrics = with_perplexity(trainer.evaluate(eval_dataset=dataset, metric_key_prefix=prefix), prefix)
        return {k: metrics[f"{prefix}_{k}"] for k in keys if f"{prefix}_{k}" in metrics}

    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # unwrap accelerate's wrapper
    start = time.perf_counter()
    eval_metrics = evaluated(splits.eval, "eval") if evaluate else {}
    val_metrics = evaluated(splits.val, "val") if evaluate and splits.val is not None else {}
    saves.finished()  # (once evaluated: a job stopped while it evaluates resumes from its last checkpoint)
    return TrainOutput(
        optimizer=optimizer,
        losses=step_losses.values,
        eval_metrics=eval_metrics,
        # (the Trainer's eval-time spent inside train() is taken out of the throughput by the StepTimer)
        train_runtime_s=runtime,
        peak=peak,
        device=str(args.device),
        val_metrics=val_metrics,
        val_series=val_series,
        eval_runtime_s=time.perf_counter() - start,
        segments=saves.segments(peak.metrics()["peak_memory_mb"], runtime, first, cfg.train.max_steps),
        checkpoints=saves.meta.get("checkpoints"),
        per_epoch=reading.per_epoch,
    )
