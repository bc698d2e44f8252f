"""A bare PyTorch training loop: the yardstick a pipeline job's step time is measured against.

`python -m bench.bare_loop CONFIG_YAML [--peak-tracker]` reads a job's resolved config.yaml and trains the
same model on the same data (same tokenization length, padding, batch size, seed, optimizer settings and
LR schedule, same torch threads) with nothing between the reader and the loop: forward, backward,
clip_grad_norm_, optimizer.step, scheduler.step, zero_grad. Model, tokenizer and data are loaded through
pipeline.models / pipeline.data (loading is not timed); the optimizer through the registry's direct
factory (the same class, parameter groups and settings the Trainer's `optim=` string builds).

It prints one JSON line: the median wall time between the starts of consecutive steps (the model's
forward), leaving out the first SKIP_STEPS steps, i.e. exactly the definition of the job's `train_step_ms`
(pipeline.timing).
`--peak-tracker` runs the same loop inside the pipeline's CPU peak-memory tracker, to show its share.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

SKIP_STEPS = 3  # as the job's train_step_ms: it leaves out the first memory_track_steps (3) steps


def step_times_ms(starts: list[float], skip: int) -> list[float]:
    return [(b - a) * 1000 for a, b in itertools.pairwise(starts[skip:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a job's resolved config.yaml")
    parser.add_argument("--peak-tracker", action="store_true", help="train inside pipeline.memory.PeakMemory")
    args = parser.parse_args()

    import contextlib

    import torch
    import transformers
    from omegaconf import OmegaConf
    from torch.utils.data import DataLoader, RandomSampler
    from transformers import DataCollatorWithPadding, get_scheduler

    from pipeline import data, models, optimizers

    cfg = OmegaConf.load(args.config)
    transformers.set_seed(cfg.seed)
    tokenizer = models.load_tokenizer(cfg.model)
    splits = data.load_splits(cfg.data)
    model = models.load_model(cfg.model, splits.num_labels)
    model.config.pad_token_id = tokenizer.pad_token_id
    splits = data.tokenize(splits, tokenizer, cfg.train.max_length, models.vocab_size(model))
    collate = DataCollatorWithPadding(tokenizer, padding=cfg.train.padding, max_length=cfg.train.max_length)
    sampler = RandomSampler(splits.train, generator=torch.Generator().manual_seed(cfg.seed))
    loader = DataLoader(splits.train, batch_size=cfg.batch_size, sampler=sampler, collate_fn=collate)
    assert cfg.train.max_steps <= len(loader), "one epoch is enough for a benchmark"
    optimizer = optimizers.get(cfg.optim.name).build(model, cfg)
    scheduler = get_scheduler(cfg.train.lr_scheduler, optimizer, cfg.train.warmup_steps, cfg.train.max_steps)

    tracker = contextlib.nullcontext()
    if args.peak_tracker:
        from pipeline.memory import PeakMemory

        tracker = PeakMemory("cpu", [*model.parameters(), *model.buffers()])
    model.train()
    starts, losses = [], []
    with tracker:
        for batch in itertools.islice(loader, cfg.train.max_steps):
            starts.append(time.perf_counter())
            loss = model(**batch).loss
            loss.backward()
            if cfg.train.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    times = step_times_ms(starts, SKIP_STEPS)
    print(
        json.dumps(
            {
                "train_step_ms": statistics.median(times),
                "steps": len(starts),
                "threads": torch.get_num_threads(),
                "loss_final": losses[-1],
            }
        )
    )


if __name__ == "__main__":
    main()
