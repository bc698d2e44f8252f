"""Accelerate backend: a plain loop, the optimizer object built directly from the registry."""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader, RandomSampler
from tqdm.auto import tqdm
from transformers import get_scheduler, set_seed
from transformers.trainer_pt_utils import LengthGroupedSampler

from pipeline import checkpoint, distributed
from pipeline.backends import (
    StepLosses,
    TrainOutput,
    check_device,
    classification_metrics,
    enable_checkpointing,
    language_model_metrics,
    optimizer_step_mode,
    restored,
    stopped,
    training_memory,
)
from pipeline.data import IGNORE_INDEX
from pipeline.fake_model import layer_stack  # (a real model's too: FSDP's units)
from pipeline.optimizers import LAYERWISE, LOMO
from pipeline.timing import step_sizes


def batches(loader, steps: int, accumulation: int = 1, reseed=None):
    """`steps` steps' batches, `accumulation` a step (train.gradient_accumulation_steps) and at an epoch's end
    those left, as the Trainer groups them; a new (reshuffled) epoch whenever the loader runs out, its order
    seeded by `reseed(epoch)` first where given (as accelerate's seedable sampler under the Trainer: the run's
    seed + the epoch)."""
    done = 0
    for epoch in itertools.count():
        if reseed is not None:
            reseed(epoch)
        group = []
        for batch in loader:
            if done == steps:
                return
            group.append(batch)
            if len(group) == accumulation:
                done += 1
                yield group
                group = []
        if group and done < steps:
            done += 1
            yield group


def accumulated(accelerator, model, group: list, causal: bool):
    """A step's batches, each with its loss scaled as the Trainer scales it: a language model's by the
    step's label tokens (`num_items_in_batch`: the sum over the step, not a mean of means), a classifier's
    mean loss divided by the step's batches; gradients synchronised over ranks at the last one only."""
    count = None
    if causal and len(group) > 1:
        count = sum((batch["labels"][..., 1:] != IGNORE_INDEX).sum() for batch in group)
    for i, batch in enumerate(group):
        with contextlib.nullcontext() if i == len(group) - 1 else accelerator.no_sync(model):
            if count is not None:
                yield model(**batch, num_items_in_batch=count).loss
            else:
                loss = model(**batch).loss
                yield loss / len(group) if len(group) > 1 else loss


def evaluation(accelerator, model, optimizer, eval_loader, spec, splits, desc="eval") -> dict[str, float]:
    """Loss and classification_metrics (a language model: language_model_metrics) over a split; the model (and
    a schedule-free optimizer) go back to training mode afterwards."""
    model.eval()
    if spec.needs_train_eval_mode:
        optimizer.optimizer.eval()
    causal = splits.task == "causal_lm"
    logits, labels, sample_losses = [], [], []
    with torch.no_grad():
        for batch in tqdm(eval_loader, desc=desc, disable=not accelerator.is_main_process, leave=False):
            out = model(**batch)
            # the batch's mean loss once per sample, gathered like the logits: the mean over the whole eval
            # split on any number of ranks (gather_for_metrics drops the samples a rank repeated)
            per_sample = out.loss.detach().float().expand(len(batch["labels"]))
            sample_losses.append(accelerator.gather_for_metrics(per_sample).double().cpu().numpy())
            if causal:  # each text's (right next tokens, positions with a label): the whole vocabulary's
                # logits of a split would not fit in memory
                predicted, target = out.logits.argmax(dim=-1)[:, :-1], batch["labels"][:, 1:]
                kept = target != IGNORE_INDEX
                counts = torch.stack([((predicted == target) & kept).sum(-1), kept.sum(-1)], dim=-1)
                labels.append(accelerator.gather_for_metrics(counts).cpu().numpy())
                continue
            logits.append(accelerator.gather_for_metrics(out.logits).float().cpu().numpy())
            labels.append(accelerator.gather_for_metrics(batch["labels"]).cpu().numpy())
    loss = float(np.concatenate(sample_losses).mean())
    if causal:
        right, counted = np.concatenate(labels).sum(axis=0)
        metrics = language_model_metrics(loss, float(right / counted))
    else:
        metrics = classification_metrics(np.concatenate(logits), np.concatenate(labels), splits.num_labels)
    if hasattr(model, "reshard"):  # FSDP2 leaves the root's weights gathered after a forward
        model.reshard()
    model.train()
    if spec.needs_train_eval_mode:
        optimizer.optimizer.train()
    return {"loss": loss, **metrics}


def schedule(cfg, optimizer, spec):
    """transformers' get_scheduler; for a layer-wise optimizer one per parameter, stepped from the parameter's
    hook after its optimizer, as GaLore's authors do (transformers' own layer-wise scheduler, which would do
    the same, fails on this torch), with a constant stand-in for the loop's whole-model schedule."""
    steps = (cfg.train.warmup_steps, cfg.train.max_steps)
    if spec.in_backward != LAYERWISE:
        return get_scheduler(cfg.train.lr_scheduler, optimizer, *steps)
    per_parameter = {
        p: get_scheduler(cfg.train.lr_scheduler, inner, *steps)
        for p, inner in optimizer.optimizer_dict.items()
    }
    for p in per_parameter:
        if p.requires_grad:  # registered after the optimizer's hook: runs after its step
            p.register_post_accumulate_grad_hook(lambda p: per_parameter[p].step())
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


def update_in_backward(accelerator, loss, optimizer, scheduler, spec) -> None:
    """One step of an optimizer that updates inside the backward pass, driven as its authors drive it: LOMO by
    `fused_backward(loss, lr)` (accelerate's `backward(loss, learning_rate=...)`, as the Trainer calls it, at
    the schedule's current rate), then the schedule's step; a layer-wise optimizer by a plain backward pass,
    each parameter's hook stepping its optimizer and its schedule. No whole-model step, and no clipping:
    each gradient is used and freed as it arrives (the Trainer clips after backward and finds none left)."""
    if spec.in_backward == LOMO:
        accelerator.backward(loss, learning_rate=scheduler.get_last_lr()[0])
        scheduler.step()
    else:
        accelerator.backward(loss)


def save_state(model, optimizer, scheduler, folder: Path) -> None:
    """The Accelerate loop's checkpoint: the trained weights (a LoRA run's adapters and head; every weight in
    full fine-tuning), the optimizer's and the schedule's state, the random streams."""
    weights = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    state = {"weights": weights, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    torch.save({**state, "rng": checkpoint.rng_states()}, folder / "state.pt")


def resume(saves, model, optimizer, scheduler, data, collate, losses, val_series) -> int:
    """The first step to train: 1, or the step after the latest checkpoint, whose state is loaded back. The
    data order is replayed up to it (its batches drawn as before: the same order, the same draws of the random
    streams), then the random streams are set as they were at the checkpoint."""
    found = saves.latest()
    if found is None:
        return 1
    state = torch.load(found / "state.pt", weights_only=False)
    unexpected = model.load_state_dict(state["weights"], strict=False).unexpected_keys
    if unexpected:
        raise ValueError(f"checkpoint {found} holds weights this model lacks: {unexpected[:3]}")
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    for _ in range(saves.meta["step"]):
        next(data)
    restored(saves.meta, collate, losses, val_series)
    checkpoint.set_rng_states(state["rng"])
    print(f"[job] resumed from {found} at step {saves.meta['step'] + 1}", flush=True)
    return saves.meta["step"] + 1


def train(cfg, model, splits, spec, collate, job_dir: Path, evaluate: bool = True) -> TrainOutput:
    # cpu=True off CUDA: under torchrun on CPU, Accelerator() otherwise runs unsynchronised copies
    mixed = {"bf16": "bf16", "fp16": "fp16"}.get(cfg.train.precision, "no")  # bf16_pure: the weights are bf16
    sharding = cfg.train.sharding
    cuda = torch.cuda.is_available()
    accelerator = Accelerator(
        cpu=not cuda,
        mixed_precision=mixed,
        # each batch copied to the device from pinned memory without the host waiting for the copy (accelerate's
        # default copy blocks, once a step)
        dataloader_config=DataLoaderConfiguration(non_blocking=True),
    )
    # the random streams as the Trainer leaves them once it is built (it seeds them with the run's seed after the
    # model is made): dropout draws the same masks on both backends
    set_seed(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    if cfg.train.group_by_length:
        lengths = [len(ids) for ids in splits.train["input_ids"]]
        sampler = LengthGroupedSampler(cfg.batch_size, lengths=lengths, generator=generator)
    else:
        sampler = RandomSampler(splits.train, generator=generator)
    loader = functools.partial(DataLoader, collate_fn=collate, pin_memory=cuda)
    train_loader = loader(splits.train, batch_size=cfg.batch_size, sampler=sampler)
    eval_loader = loader(splits.eval, batch_size=cfg.eval.batch_size)
    val_loader = None if splits.val is None else loader(splits.val, batch_size=cfg.eval.batch_size)
    if cfg.train.gradient_checkpointing:  # on the model itself, before any wrapper (DDP, FSDP)
        enable_checkpointing(model)
    if sharding == "fsdp":  # sharded first, so that the optimizer is built on the shards; FSDP's own hooks
        # reduce the gradients, so accelerate adds mixed precision and device placement only (no DDP)
        sharded = distributed.fully_sharded(model, layer_stack(model) or ())
        model = accelerator.prepare_model(sharded, evaluation_mode=True)
    check_device(spec, accelerator.device)
    optimizer = spec.build(model, cfg)
    if sharding == "zero1":
        optimizer = distributed.zero1(optimizer)
    scheduler = schedule(cfg, optimizer, spec)
    if sharding == "fsdp":  # the model is prepared already
        optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
            optimizer, train_loader, eval_loader, scheduler
        )
    else:
        # ZeRO-1's state lives on the rank that owns it: accelerate must not move it (its state_dict is global)
        placement = [True, sharding != "zero1", True, True, True]
        model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
            model, optimizer, train_loader, eval_loader, scheduler, device_placement=placement
        )

    if val_loader is not None:
        val_loader = accelerator.prepare(val_loader)
    every = cfg.eval.get("every_steps", 0) if val_loader is not None and evaluate else 0
    val_series: dict[str, dict[int, float]] = {}
    # several ranks record the mean over ranks (as the Trainer does), so all of them stop at the same reading
    losses = StepLosses(
        (lambda stacked: accelerator.reduce(stacked, "mean")) if accelerator.num_processes > 1 else None
    )
    model.train()
    if spec.needs_train_eval_mode:
        optimizer.optimizer.train()
    saves = checkpoint.Checkpoints.of_job(cfg, bool(spec.in_backward))
    reseed = None if cfg.train.group_by_length else (lambda epoch: generator.manual_seed(cfg.seed + epoch))
    data = batches(train_loader, cfg.train.max_steps, cfg.train.gradient_accumulation_steps, reseed)
    first = resume(
        saves, accelerator.unwrap_model(model), optimizer, scheduler, data, collate, losses, val_series
    )
    with (
        training_memory(cfg, spec, accelerator.device, model) as peak,
        optimizer_step_mode(spec, accelerator.device),
        # closed on an exception too (out of memory, NaN): what is printed next starts on its own line
        tqdm(
            total=cfg.train.max_steps,
            initial=first - 1,
            desc="train",
            disable=not accelerator.is_main_process,
            delay=0,
        ) as progress,
    ):
        start = time.perf_counter()
        for step, group in enumerate(data, start=first):
            if spec.in_backward:  # (one batch a step: config.py refuses accumulation)
                loss = model(**group[0]).loss
                losses.add(loss)
                update_in_backward(accelerator, loss, optimizer, scheduler, spec)
                peak.updated_in_backward(optimizer.optimizer)
            else:
                for loss in accumulated(accelerator, model, group, splits.task == "causal_lm"):
                    # kept on the device: read every LOSS_READ_STEPS steps (a NaN stops the run there)
                    losses.add(loss)
                    accelerator.backward(loss)
                if cfg.train.max_grad_norm:
                    accelerator.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            progress.update()
            losses.step_ended()
            if every and step % every == 0 and step < cfg.train.max_steps:  # as the Trainer's eval_steps
                for key, value in evaluation(
                    accelerator, model, optimizer, val_loader, spec, splits, "val"
                ).items():
                    val_series.setdefault(key, {})[step] = value
            if saves.due(step) or checkpoint.stop_asked():
                save = functools.partial(save_state, accelerator.unwrap_model(model), optimizer, scheduler)
                done = collate.batches[: sum(step_sizes(step, len(train_loader), cfg))]
                stopped(saves, step, save, done, losses, val_series, peak, time.perf_counter() - start, first)
        losses.read()  # the steps since the last reading (the loop's time includes the device's last step)
        runtime = time.perf_counter() - start

    start = time.perf_counter()
    eval_metrics = evaluation(accelerator, model, optimizer, eval_loader, spec, splits) if evaluate else {}
    val_metrics = (
        evaluation(accelerator, model, optimizer, val_loader, spec, splits, "val")
        if evaluate and val_loader is not None
        else {}
    )
    saves.finished()
    return TrainOutput(
        optimizer=distributed.local_optimizer(optimizer.optimizer),  # unwrap AcceleratedOptimizer (and ZeRO)
        losses=losses.values,
        eval_metrics=eval_metrics,
        train_runtime_s=runtime,
        peak=peak,
        device=str(accelerator.device),
        val_metrics=val_metrics,
        val_series=val_series,
        eval_runtime_s=time.perf_counter() - start,
        segments=saves.segments(peak.metrics()["peak_memory_mb"], runtime, first, cfg.train.max_steps),
        checkpoints=saves.meta.get("checkpoints"),
        per_epoch=len(train_loader),
    )
