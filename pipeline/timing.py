"""Throughput figures: optimizer step time (torch's global optimizer hooks, any optimizer, either backend) and
the device peak FLOP/s that model FLOPs utilisation (MFU) is measured against."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from itertools import pairwise
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook


class StepTimer:
    """When each training step starts (the model's forward in training mode), and the wall time of every
    optimizer.step() inside the block (CUDA synchronised at each mark).

    The time from one step's start to the next one's is one whole training step (data, forward, backward,
    optimizer, logging), whether or not its optimizer step ran: the fp16 grad scaler skips the optimizer step
    of a step whose gradients overflowed, and torch's optimizer hooks then do not fire.

    Evaluation inside the loop (periodic validation: the model's forward in eval mode) is no step's time: from
    the end of the optimizer step before it to the next step's start, it is left out of `starts_s` (which
    count training time only) and summed in `paused_s`.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.starts_s: list[float] = []
        self.times_s: list[float] = []  # optimizer steps that ran
        self._starts: list[float] = []  # a wrapper optimizer's step nests the real one: time the outermost
        self.paused_s = 0.0  # evaluation inside the loop
        self._last_step_end: float | None = None
        self._evaluating_since: float | None = None

    def _now(self) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def _step_started(self, module, args) -> None:
        if not module.training:  # an evaluation pass
            if self._evaluating_since is None:
                self._evaluating_since = self._last_step_end or self._now()
            return
        now = self._now()
        if self._evaluating_since is not None:
            self.paused_s += now - self._evaluating_since
            self._evaluating_since = None
        self.starts_s.append(now - self.paused_s)

    def _pre(self, optimizer, args, kwargs) -> None:
        self._starts.append(self._now())

    def _post(self, optimizer, args, kwargs) -> None:
        start = self._starts.pop()
        if not self._starts:
            self._last_step_end = self._now()
            self.times_s.append(self._last_step_end - start)

    def __enter__(self):
        self._handles = [
            self.model.register_forward_pre_hook(self._step_started),
            register_optimizer_step_pre_hook(self._pre),
            register_optimizer_step_post_hook(self._post),
        ]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
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

    def window(self, skip: int) -> tuple[int, int, float] | None:
        """The steady steps after `skip` warm-up steps: (first, last) step (counted from 1) and their wall
        time, from the start of step skip + 1 to the start of the last step (whose own end is not marked, so
        it is left out). None when fewer than skip + 2 steps ran."""
        if self.steps < skip + 2:
            return None
        return skip + 1, self.steps - 1, self.starts_s[-1] - self.starts_s[skip]


# Dense peak TFLOP/s of common GPUs (vendor data sheets, no sparsity): (16-bit tensor core, fp32 without TF32).
# Matched by substring of torch.cuda.get_device_name(), first match wins.
GPU_PEAK_TFLOPS = {
    "H200": (989.0, 67.0),
    "H100": (989.0, 67.0),
    "A100": (312.0, 19.5),
    "L40S": (362.0, 91.6),
    "L4": (121.0, 30.3),
    "A10": (125.0, 31.2),
    "RTX 4090": (165.2, 82.6),
    "V100": (125.0, 15.7),
    "T4": (65.0, 8.1),
}


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


def peak_flops(device: str, precision: str, cache_dir: Path) -> tuple[float | None, str]:
    """(peak FLOP/s for this device and precision, where the figure comes from); None when unknown."""
    dtype = compute_dtype(precision)
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
        for key, (half, single) in GPU_PEAK_TFLOPS.items():
            if key in name:
                return (half if dtype != torch.float32 else single) * 1e12, f"data sheet: {key}"
        return None, f"no known peak for {name}"
    # CPU: measured once per machine, thread count and dtype, then cached (as for torch.compile)
    # (platform.processor() would fork `uname -p`: slow from a process this big, and no more precise)
    key = f"{platform.machine()}|cores={os.cpu_count()}|threads={torch.get_num_threads()}|{dtype}"
    path = cache_dir / "cpu_peak_flops.json"
    cache = json.loads(path.read_text()) if path.exists() else {}
    if key not in cache:
        cache[key] = cpu_matmul_flops(dtype)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cache, indent=1))
    return cache[key], "measured: best 1024x1024 matmul on this CPU"
