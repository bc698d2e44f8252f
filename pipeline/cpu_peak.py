"""Live bytes of tensors on CPU, where no allocator can be asked: what a job's ops make, at its peak, against a
memory budget (pipeline.memory's trackers use it)."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from pipeline import MB
from pipeline.state import storage_leaves


def distinct_mb(value_bytes: float, reference_bytes: float) -> tuple[str, str]:
    """Both figures in MB with the fewest decimals (1 to 6) at which they read differently: a figure just
    past a budget never reads as equal to it ("40.0 MB" against "40.0 MB")."""
    for decimals in range(1, 7):
        value, reference = f"{value_bytes / MB:.{decimals}f}", f"{reference_bytes / MB:.{decimals}f}"
        if value != reference:
            break
    return value, reference


class MemoryBudgetExceeded(torch.OutOfMemoryError):
    """Live tensors past `memory_budget_mb` on CPU: the same failure a GPU of that size would give."""

    def __init__(self, budget_bytes: int, live_bytes: int):
        live, budget = distinct_mb(live_bytes, budget_bytes)
        super().__init__(
            f"CPU memory budget of {budget} MB exceeded: {live} MB of tensors live "
            f"({live_bytes - budget_bytes:,} byte{'s' if live_bytes - budget_bytes != 1 else ''} over)"
        )
        self.figures_mb = {"memory_allocated_mb": live_bytes / MB}


class CpuTensorPeak(TorchDispatchMode):
    """Live bytes of tensor storages created by ops inside the mode, plus a baseline of existing tensors. A
    storage resized in place while the mode is on (FSDP2 frees a unit's gathered weights so, and allocates them
    again) counts at its new size, as an allocator would see it; entering the mode again reads every counted
    storage's size anew."""

    def __init__(self, baseline: list[torch.Tensor], budget_bytes: int | None = None):
        super().__init__()
        self.budget_bytes = budget_bytes
        self.current = self.peak = 0
        self._live = WeakIdKeyDictionary()  # storage -> [bytes counted]
        self.track(baseline)

    def track(self, tensors) -> None:
        """Count these tensors' storages from now on (those already counted are skipped)."""
        for t in tensors:
            for leaf in storage_leaves(t):
                if leaf.device.type == "cpu":
                    self._track(leaf.untyped_storage())

    def _track(self, storage) -> None:
        if storage not in self._live:
            self._live[storage] = counted = [0]
            weakref.finalize(storage, self._add, counted, None)
            self._add(counted, storage.nbytes())

    def _add(self, counted: list[int], size: int | None) -> None:
        """`counted` (a storage's bytes as counted) now `size` bytes (None: freed)."""
        size, grew = size or 0, (size or 0) > counted[0]
        self.current += size - counted[0]
        counted[0] = size
        self.peak = max(self.peak, self.current)
        if grew and self.budget_bytes is not None and self.current > self.budget_bytes:
            raise MemoryBudgetExceeded(self.budget_bytes, self.current)

    def __enter__(self):
        for storage, counted in list(self._live.items()):
            self._add(counted, storage.nbytes())
        resize = self._resize_before = torch.UntypedStorage.resize_  # (a tracker entered before this one's)

        def resized(storage, size):
            out = resize(storage, size)
            if storage in self._live:
                self._add(self._live[storage], storage.nbytes())
            return out

        torch.UntypedStorage.resize_ = resized
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize_before
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(t for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out
