"""Throughput figures: optimizer step time (torch's global optimizer hooks, any optimizer, either backend) and
the device peak FLOP/s that model FLOPs utilisation (MFU) is measured against."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from itertools import pairwise

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from pipeline import cache


def warmup_steps(cfg) -> int:
    """Steps left out of the steady-state figures: step 1 (first calls, torch.compile, cuBLAS set-up), step 2
    (the memory breakdown) and the steps the CPU tensor tracker slows (`memory_track_steps`)."""
    return max(2, cfg.memory_track_steps or 1)


class StepTimer:
    """When each training step starts (the model's forward in training mode; with `accumulation` batches a
    step, its first batch's), and the time of every optimizer.step() inside the block.

    The time from one step's start to the next one's is one whole training step (data, forward, backward,
    optimizer, logging), whether or not its optimizer step ran: the fp16 grad scaler skips the optimizer step
    of a step whose gradients overflowed, and torch's optimizer hooks then do not fire.

    Evaluation inside the loop (periodic validation: the model's forward in eval mode) is no step's time: from
    the end of the optimizer step before it to the next step's start, it is left out of `starts_s` (which
    count training time only) and summed in `paused_s`.

    On CPU each mark is `time.perf_counter()`. On CUDA it is a CUDA event recorded on the current stream,
    which takes its time when the device reaches it: the host never waits for the device during the block,
    and the marks are read once as it ends (one synchronisation). The figures (`starts_s`, `times_s`,
    `paused_s`) are there once the block has ended without an exception.
    """

    def __init__(self, model: torch.nn.Module, accumulation: int = 1):
        self.model = model
        self.accumulation = accumulation  # batches a step (train.gradient_accumulation_steps)
        self._batches = 0  # of the step now running
        self.starts_s: list[float] = []
        self.times_s: list[float] = []  # optimizer steps that ran
        self.paused_s = 0.0  # evaluation inside the loop
        self._cuda = torch.cuda.is_available()
        # marks (floats, or CUDA events) until the block ends
        self._step_marks: list[tuple] = []  # (step start, the start of the evaluation before it or None)
        self._optimizer_marks: list[tuple] = []  # (optimizer step start, its end)
        self._starts: list = []  # a wrapper optimizer's step nests the real one: time the outermost
        self._last_step_end = None
        self._evaluating_since = None
        self._origin = None  # the first CUDA event: the others are read as times after it

    def _mark(self):
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        if self._origin is None:
            self._origin = event
        return event

    def _step_started(self, module, args) -> None:
        if not module.training:  # an evaluation pass
            if self._evaluating_since is None:
                end = self._last_step_end
                self._evaluating_since = end if end is not None else self._mark()
            return
        if 0 < self._batches < self.accumulation:  # the step's next batch (train.gradient_accumulation_steps)
            self._batches += 1
            return
        self._batches = 1
        self._step_marks.append((self._mark(), self._evaluating_since))
        self._evaluating_since = None

    def _pre(self, optimizer, args, kwargs) -> None:
        self._starts.append(self._mark())

    def _post(self, optimizer, args, kwargs) -> None:
        start = self._starts.pop()
        if not self._starts:
            self._batches = 0  # the step ended: the next batch starts one (an epoch's last may have fewer)
            self._last_step_end = self._mark()
            self._optimizer_marks.append((start, self._last_step_end))

    def _read_marks(self) -> None:
        """The marks as seconds (CUDA events: after the first one recorded, read after one synchronisation)."""
        if self._origin is not None:
            torch.cuda.synchronize()

        def seconds(mark) -> float:
            return mark if self._origin is None else self._origin.elapsed_time(mark) / 1000

        for start, evaluating_since in self._step_marks:
            if evaluating_since is not None:
                self.paused_s += seconds(start) - seconds(evaluating_since)
            self.starts_s.append(seconds(start) - self.paused_s)
        self.times_s = [seconds(end) - seconds(start) for start, end in self._optimizer_marks]

    def __enter__(self):
        self._handles = [
            self.model.register_forward_pre_hook(self._step_started),
            register_optimizer_step_pre_hook(self._pre),
            register_optimizer_step_post_hook(self._post),
        ]
        return self

    def __exit__(self, exc_type, *exc):
        for handle in self._handles:
            handle.remove()
        # (a failed job records no times: nothing waits for a device that may have failed)
        if exc_type is None:
            self._read_marks()
        return False

    @property
    def steps(self) -> int:
        return len(self.starts_s)

    @property
    def median_ms(self) -> float | None:
        """Median optimizer.step() time; None when no optimizer step ran."""
        return statistics.median(self.times_s) * 1000 if self.times_s else None

    def train_step_ms(self, skip: int = 0) -> float | None:
        """Median time of a whole training step after the first `skip` steps (warm-up, profiled steps)."""
        gaps = [b - a for a, b in pairwise(self.starts_s[skip:])]
        return statistics.median(gaps) * 1000 if gaps else None

    def figures(self, skip: int) -> dict:
        """What the throughput is read from, after `skip` warm-up steps (`warmup`): the steady `window`, the
        warm-up's seconds, the median optimizer step and whole training step (ms), the optimizer steps that did
        not run, and the evaluation time inside the loop (`paused_s`)."""
        window = self.window(skip)
        return {
            "warmup": skip,
            "window": window,
            "warmup_s": self.starts_s[skip] - self.starts_s[0] if window else None,
            "step_ms": self.median_ms,
            "train_step_ms": self.train_step_ms(skip=skip),
            "steps_skipped": self.steps - len(self.times_s),
            "paused_s": self.paused_s,
        }

    def window(self, skip: int) -> tuple[int, int, float] | None:
        """The steady steps after `skip` warm-up steps: (first, last) step (counted from 1) and their wall
        time, from the start of step skip + 1 to the start of the last step (whose own end is not marked, so
        it is left out). None when fewer than skip + 2 steps ran."""
        if self.steps < skip + 2:
            return None
        return skip + 1, self.steps - 1, self.starts_s[-1] - self.starts_s[skip]


# Dense peak TFLOP/s of common GPUs (vendor data sheets, no sparsity): (16-bit tensor core, fp32 without TF32),
# by the exact name torch.cuda.get_device_name() gives: variants of one family differ (H100 SXM, PCIe and NVL;
# A10G and A10; L40 and L40S), so no name stands for another.
GPU_PEAK_TFLOPS = {
    "NVIDIA H200": (989.0, 67.0),
    "NVIDIA H100 80GB HBM3": (989.0, 67.0),  # H100 SXM
    "NVIDIA H100 NVL": (835.0, 60.0),
    "NVIDIA H100 PCIe": (756.0, 51.0),
    "NVIDIA A100-SXM4-80GB": (312.0, 19.5),
    "NVIDIA A100-SXM4-40GB": (312.0, 19.5),
    "NVIDIA A100 80GB PCIe": (312.0, 19.5),
    "NVIDIA A100-PCIE-40GB": (312.0, 19.5),
    "NVIDIA L40S": (362.0, 91.6),
    "NVIDIA L40": (181.0, 90.5),
    "NVIDIA L4": (121.0, 30.3),
    "NVIDIA A10": (125.0, 31.2),
    "NVIDIA A10G": (70.0, 31.2),
    "NVIDIA GeForce RTX 4090": (165.2, 82.6),
    "Tesla V100-SXM2-32GB": (125.0, 15.7),
    "Tesla V100-SXM2-16GB": (125.0, 15.7),
    "Tesla T4": (65.0, 8.1),
}


def gpu_peak_flops(name: str, dtype: torch.dtype) -> tuple[float | None, str]:
    """(peak FLOP/s of the GPU named `name` at `dtype`, where the figure comes from): its data sheet's figure
    (GPU_PEAK_TFLOPS: 16-bit for bf16 / fp16, fp32 otherwise); None for a name not in the table."""
    if name not in GPU_PEAK_TFLOPS:
        return None, f"no known peak for {name}"
    half, single = GPU_PEAK_TFLOPS[name]
    return (half if dtype != torch.float32 else single) * 1e12, f"data sheet: {name}"


def compute_dtype(precision: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "bf16_pure": torch.bfloat16, "fp16": torch.float16}.get(
        precision, torch.float32
    )


def cpu_matmul_flops(dtype: torch.dtype, n: int = 1024, seconds: float = 0.5) -> float:
    """Best FLOP/s of an n x n matmul on this CPU with torch's threads: the measured peak MFU divides by."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        a @ b
        best = max(best, 2 * n**3 / (time.perf_counter() - start))
    return best


def peak_flops(device: str, precision: str, outputs_dir) -> tuple[float | None, str]:
    """(peak FLOP/s for this device and precision, where the figure comes from); None when unknown. A CPU's
    is measured once and kept in the cache folder (pipeline.cache.root)."""
    dtype = compute_dtype(precision)
    if device.startswith("cuda"):
        return gpu_peak_flops(torch.cuda.get_device_name(torch.device(device)), dtype)
    # CPU: measured once per machine, thread count and dtype, then cached (as for torch.compile)
    # (platform.processor() would fork `uname -p`: slow from a process this big, and no more precise)
    key = f"{platform.machine()}|cores={os.cpu_count()}|threads={torch.get_num_threads()}|{dtype}"
    path = cache.root(outputs_dir) / "cpu_peak_flops.json"
    kept = json.loads(path.read_text()) if path.exists() else {}
    if key not in kept:
        kept[key] = cpu_matmul_flops(dtype)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(kept, indent=1))
    return kept[key], "measured: best 1024x1024 matmul on this CPU"


def step_sizes(steps: int, per_epoch: int | None, cfg) -> list[int]:
    """The batches each of the first `steps` steps takes: train.gradient_accumulation_steps, and at the end of
    each epoch of `per_epoch` batches those left (as the Trainer groups them; the Accelerate loop alike)."""
    n = cfg.train.gradient_accumulation_steps
    if n == 1 or not per_epoch:
        return [n] * steps
    epoch = [n] * (per_epoch // n) + [per_epoch % n] * bool(per_epoch % n)
    return (epoch * (steps // len(epoch) + 1))[:steps]


def step_tokens(batches: list, steps: int, per_epoch: int | None, cfg) -> list[tuple[int, int]]:
    """Each of the first `steps` steps' (real, padded) tokens: its batches' (step_sizes) summed."""
    out, at = [], 0
    for size in step_sizes(steps, per_epoch, cfg):
        group = batches[at : at + size]
        out.append((sum(real for real, _ in group), sum(padded for _, padded in group)))
        at += size
    return out
