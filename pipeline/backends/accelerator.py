"""Accelerate backend: a plain loop, the optimizer object built directly from the registry."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, RandomSampler
from tqdm.auto import tqdm
from transformers import get_scheduler
from transformers.trainer_pt_utils import LengthGroupedSampler

from pipeline.backends import NonFiniteLoss, TrainOutput, classification_metrics, training_memory


def batches(loader, steps: int):
    """`steps` batches, starting a new (reshuffled) epoch whenever the loader runs out."""
    done = 0
    while True:
        for batch in loader:
            if done == steps:
                return
            done += 1
            yield batch


def evaluation(accelerator, model, optimizer, eval_loader, spec, splits) -> dict[str, float]:
    model.eval()
    if spec.needs_train_eval_mode:
        optimizer.optimizer.eval()
    logits, labels, loss_sum = [], [], 0.0
    with torch.no_grad():
        for batch in tqdm(eval_loader, desc="eval", disable=not accelerator.is_main_process):
            out = model(**batch)
            loss_sum += out.loss.item() * len(batch["labels"])
            logits.append(accelerator.gather_for_metrics(out.logits).float().cpu().numpy())
            labels.append(accelerator.gather_for_metrics(batch["labels"]).cpu().numpy())
    labels = np.concatenate(labels)
    metrics = classification_metrics(np.concatenate(logits), labels, splits.num_labels)
    return {"loss": loss_sum / len(labels), **metrics}


def train(cfg, model, splits, spec, collate, job_dir: Path, evaluate: bool = True) -> TrainOutput:
    # cpu=True off CUDA: under torchrun on CPU, Accelerator() otherwise runs unsynchronised copies
    mixed = {"bf16": "bf16", "fp16": "fp16"}.get(cfg.train.precision, "no")  # bf16_pure: the weights are bf16
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=mixed)
    generator = torch.Generator().manual_seed(cfg.seed)
    if cfg.train.group_by_length:
        lengths = [len(ids) for ids in splits.train["input_ids"]]
        sampler = LengthGroupedSampler(cfg.batch_size, lengths=lengths, generator=generator)
    else:
        sampler = RandomSampler(splits.train, generator=generator)
    train_loader = DataLoader(splits.train, batch_size=cfg.batch_size, sampler=sampler, collate_fn=collate)
    eval_loader = DataLoader(splits.eval, batch_size=cfg.eval.batch_size, collate_fn=collate)
    optimizer = spec.build(model, cfg)
    scheduler = get_scheduler(cfg.train.lr_scheduler, optimizer, cfg.train.warmup_steps, cfg.train.max_steps)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )

    losses = []
    model.train()
    if spec.needs_train_eval_mode:
        optimizer.optimizer.train()
    with training_memory(cfg, spec, accelerator.device, model) as peak:
        start = time.perf_counter()
        progress = tqdm(total=cfg.train.max_steps, desc="train", disable=not accelerator.is_main_process)
        for step, batch in enumerate(batches(train_loader, cfg.train.max_steps), start=1):
            loss = model(**batch).loss
            losses.append(
                loss.item()
            )  # a sync per step, as the Trainer's logging: a NaN stops the run at once
            if not math.isfinite(losses[-1]):
                raise NonFiniteLoss(step, losses[-1])
            accelerator.backward(loss)
            if cfg.train.max_grad_norm:
                accelerator.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            progress.update()
        progress.close()
        runtime = time.perf_counter() - start

    return TrainOutput(
        optimizer=optimizer.optimizer,  # unwrap AcceleratedOptimizer
        losses=losses,
        eval_metrics=evaluation(accelerator, model, optimizer, eval_loader, spec, splits) if evaluate else {},
        train_runtime_s=runtime,
        peak=peak,
        device=str(accelerator.device),
    )
