"""Optimizer step time, through torch's global optimizer hooks (any torch.optim.Optimizer, either backend)."""

from __future__ import annotations

import statistics
import time

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook


class StepTimer:
    """Wall time of every optimizer.step() inside the block (CUDA synchronised at both ends)."""

    def __init__(self):
        self.times_s: list[float] = []
        self._starts: list[float] = []  # a wrapper optimizer's step nests the real one: time the outermost

    def _now(self) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def _pre(self, optimizer, args, kwargs) -> None:
        self._starts.append(self._now())

    def _post(self, optimizer, args, kwargs) -> None:
        start = self._starts.pop()
        if not self._starts:
            self.times_s.append(self._now() - start)

    def __enter__(self):
        self._handles = [
            register_optimizer_step_pre_hook(self._pre),
            register_optimizer_step_post_hook(self._post),
        ]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        return False

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_s) * 1000
