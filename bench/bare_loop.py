"""A bare PyTorch training loop: the yardstick a pipeline job's step is measured against.

`python -m bench.bare_loop CONFIG_YAML [--peak-tracker]` reads a job's resolved config.yaml and trains the
same model on the same data (same tokenization length, padding, batch size, seed, optimizer settings and
LR schedule, same torch threads) on the device the job would use (CUDA when torch sees one, else CPU), with
nothing between the reader and the loop: forward, backward, clip_grad_norm_, optimizer.step,
scheduler.step, zero_grad, and the loss read (`loss.item()`) as a loop that logs its loss does. Model,
tokenizer and data are loaded through pipeline.models / pipeline.data (loading is not timed); the optimizer
through the registry's direct factory (the same class, parameter groups and settings the Trainer's `optim=`
string builds).

It prints one JSON line: the median wall time between the starts of consecutive steps (the model's
forward), leaving out the first SKIP_STEPS steps, i.e. exactly the definition of the job's `train_step_ms`
(pipeline.timing).
`--peak-tracker` runs the same loop inside the pipeline's peak-memory tracker, to show its share.

`python -m bench.bare_loop --syncs OVERRIDE...` counts instead how often a training step makes the host wait
for the device (HostSyncs), for the job those Hydra overrides compose, on either backend (in this process,
as pipeline.job trains), and for the bare loop of the same config, and prints one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

SKIP_STEPS = 3  # as the job's train_step_ms: it leaves out the first memory_track_steps (3) steps
ROOT = Path(__file__).resolve().parent.parent


def step_times_ms(starts: list[float], skip: int) -> list[float]:
    return [(b - a) * 1000 for a, b in itertools.pairwise(starts[skip:])]


def training_device() -> torch.device:
    """The device a job trains on: CUDA when torch sees one (as both backends choose), else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def bare_loop(cfg, peak_tracker: bool = False):
    """(model, train): the bare loop's model, and the loop itself, which trains it on the job's device and
    returns (each step's start, each step's loss)."""
    import contextlib

    import transformers
    from torch.utils.data import DataLoader, RandomSampler
    from transformers import DataCollatorWithPadding, get_scheduler

    from pipeline import data, models, optimizers

    transformers.set_seed(cfg.seed)
    device = training_device()
    tokenizer = models.load_tokenizer(cfg.model)
    splits = data.load_splits(cfg.data)
    model = models.load_model(cfg.model, splits.num_labels)
    model.config.pad_token_id = tokenizer.pad_token_id
    splits = data.tokenize(splits, tokenizer, cfg.train.max_length, models.vocab_size(model))
    collate = DataCollatorWithPadding(tokenizer, padding=cfg.train.padding, max_length=cfg.train.max_length)
    sampler = RandomSampler(splits.train, generator=torch.Generator().manual_seed(cfg.seed))
    loader = DataLoader(splits.train, batch_size=cfg.batch_size, sampler=sampler, collate_fn=collate)
    assert cfg.train.max_steps <= len(loader), "one epoch is enough for a benchmark"
    model.to(device)
    optimizer = optimizers.get(cfg.optim.name).build(model, cfg)
    scheduler = get_scheduler(cfg.train.lr_scheduler, optimizer, cfg.train.warmup_steps, cfg.train.max_steps)

    tracker = contextlib.nullcontext()
    if peak_tracker:
        from pipeline.memory import PeakMemory

        tracker = PeakMemory(device, [*model.parameters(), *model.buffers()])

    def train() -> tuple[list[float], list[float]]:
        model.train()
        starts, losses = [], []
        with tracker:
            for batch in itertools.islice(loader, cfg.train.max_steps):
                batch = {k: v.to(device) for k, v in batch.items()}
                starts.append(time.perf_counter())
                loss = model(**batch).loss
                loss.backward()
                if cfg.train.max_grad_norm:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                losses.append(loss.item())
        return starts, losses

    return model, train


def pipeline_job(cfg, job_dir: Path):
    """(model, train): a pipeline job's model, and its training as pipeline.job runs it (the job's StepTimer
    around the backend `cfg.backend.name`), without evaluation."""
    import transformers

    from pipeline import backends, data, job, optimizers
    from pipeline.timing import StepTimer

    transformers.set_seed(cfg.seed)
    tokenizer, splits, model = job.load(cfg)
    collate = data.PaddingCollator(tokenizer, cfg.train.padding, cfg.train.max_length)
    spec = optimizers.choose(cfg).spec

    def train() -> None:
        with StepTimer(model):
            backends.get(cfg.backend.name).train(cfg, model, splits, spec, collate, job_dir, evaluate=False)

    return model, train


class HostSyncs(TorchDispatchMode):
    """How often each training step makes the host wait for the device, counted on any device (on CPU, as a
    proxy for a GPU): every read of a tensor's value by the host (`aten._local_scalar_dense`: what `.item()`,
    `float(t)`, `bool(t)` and `if t:` call), which on a GPU waits until the device's queue has reached it.

    A step runs from the model's forward in training mode to the next one's. Its reads are split in two:
    `model`, those of the model's own forward (transformers' attention-mask check reads `mask.all()`), the
    same in every loop that trains the model; and `loop`, the rest of the step (backward, clipping, logging,
    what the loop reads). Left out: the optimizer's step (the same optimizer in every loop compared) and the
    data loader (it collates host tensors before they reach the device). Copies to the host (`.cpu()`,
    `.tolist()`) wait too, but on CPU they copy nothing and dispatch nothing: the count cannot see them.

    `blocking_copies`: the batches accelerate's prepared data loaders move to the device with a blocking copy
    (`send_to_device(..., non_blocking=False)`, its default), which on a GPU waits for the copy to end; counted
    from the call on any device, as the loaders of both backends make it.
    """

    DATA_LOADER = str(Path(torch.utils.data.__file__).parent)

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model_reads: list[int] = []  # per step
        self.loop_reads: list[int] = []
        self.blocking_copies: list[int] = []
        self._in_forward = self._in_optimizer = 0
        self._model = model

    def _forward_started(self, module, args) -> None:
        if module.training:
            self.model_reads.append(0)
            self.loop_reads.append(0)
            self.blocking_copies.append(0)
        self._in_forward += 1

    def _forward_ended(self, module, args, output) -> None:
        self._in_forward -= 1

    def _optimizer_step(self, change: int):
        def hook(optimizer, args, kwargs) -> None:
            self._in_optimizer += change

        return hook

    def _in_data_loader(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename.startswith(self.DATA_LOADER):
                return True
            frame = frame.f_back
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (
            func is torch.ops.aten._local_scalar_dense.default
            and self.loop_reads
            and not self._in_optimizer
            and not self._in_data_loader()
        ):
            (self.model_reads if self._in_forward else self.loop_reads)[-1] += 1
        return func(*args, **(kwargs or {}))

    def _send_to_device(self, send):
        def counted(batch, device, non_blocking=False, **kwargs):
            if self.blocking_copies and not non_blocking:
                self.blocking_copies[-1] += 1
            return send(batch, device, non_blocking=non_blocking, **kwargs)

        return counted

    def __enter__(self):
        import accelerate.data_loader

        self._send = accelerate.data_loader.send_to_device
        accelerate.data_loader.send_to_device = self._send_to_device(self._send)
        self._handles = [
            self._model.register_forward_pre_hook(self._forward_started),
            self._model.register_forward_hook(self._forward_ended),
            register_optimizer_step_pre_hook(self._optimizer_step(1)),
            register_optimizer_step_post_hook(self._optimizer_step(-1)),
        ]
        return super().__enter__()

    def __exit__(self, *exc):
        import accelerate.data_loader

        accelerate.data_loader.send_to_device = self._send
        for handle in self._handles:
            handle.remove()
        return super().__exit__(*exc)

    def per_step(self) -> dict:
        """Reads per step over steps 2 to the last but one (step 1 does first-time work; the last one's end
        is not marked, and what follows the loop would count in it): their mean, in all, the model's own,
        the loop's."""
        model, loop = self.model_reads[1:-1], self.loop_reads[1:-1]
        assert model, "too few steps: at least 3"
        mean = statistics.fmean
        return {
            "steps": len(model),
            "total": mean(m + lo for m, lo in zip(model, loop, strict=True)),
            "model": mean(model),
            "loop": mean(loop),
            "blocking_copies": mean(self.blocking_copies[1:-1]),
        }


def count_syncs(model: torch.nn.Module, train) -> dict:
    with HostSyncs(model) as syncs:
        train()
    return syncs.per_step()


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose("config", overrides=overrides)


def host_syncs(overrides: list[str]) -> dict[str, dict]:
    """HostSyncs.per_step of the job `overrides` compose, on each backend, and of the bare loop."""
    counts = {}
    with tempfile.TemporaryDirectory() as job_dir:
        for backend in ("trainer", "accelerator"):
            cfg = compose([*overrides, f"backend={backend}"])
            counts[backend] = count_syncs(*pipeline_job(cfg, Path(job_dir)))
    counts["bare"] = count_syncs(*bare_loop(compose(overrides)))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", help="a job's resolved config.yaml")
    parser.add_argument("--peak-tracker", action="store_true", help="train inside pipeline.memory.PeakMemory")
    parser.add_argument(
        "--syncs", nargs="+", metavar="OVERRIDE", help="count host-device syncs per step of this job instead"
    )
    args = parser.parse_args()
    if args.syncs:
        print(json.dumps(host_syncs(args.syncs)))
        return
    if not args.config:
        parser.error("a config.yaml, or --syncs OVERRIDE...")

    from omegaconf import OmegaConf

    model, train = bare_loop(OmegaConf.load(args.config), args.peak_tracker)
    starts, losses = train()
    print(
        json.dumps(
            {
                "train_step_ms": statistics.median(step_times_ms(starts, SKIP_STEPS)),
                "steps": len(starts),
                "threads": torch.get_num_threads(),
                "loss_final": losses[-1],
            }
        )
    )


if __name__ == "__main__":
    main()
