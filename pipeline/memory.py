"""Optimizer-state accounting and peak-memory tracking (CUDA allocator stats, or tensor-level on CPU)."""

from __future__ import annotations

import resource
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from pipeline import MB, StateSize


def storage_leaves(t: torch.Tensor):
    """The plain tensors that really hold a tensor's memory (inner tensors of a wrapper subclass)."""
    if is_traceable_wrapper_subclass(t):
        for name in t.__tensor_flatten__()[0]:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from storage_leaves(inner)
    else:
        yield t


def optimizer_state_size(optimizer: torch.optim.Optimizer) -> StateSize:
    """Elements and bytes of everything in ``optimizer.state``.

    Every entry of every parameter's state counts; a Python scalar (``step``, ``RMS``) is one element of the
    dtype ``torch.tensor`` gives it; tensors are counted by the storage they hold (a view keeps its whole
    storage alive), each storage once even when several parameters share it (bitsandbytes' quantization
    maps); an object in the state (GaLore's projector) is counted by its attributes.
    """
    seen: set[tuple[str, int]] = set()
    visited: set[int] = set()
    numel = nbytes = 0

    def add(value) -> None:
        nonlocal numel, nbytes
        if isinstance(value, torch.Tensor):
            for leaf in storage_leaves(value):
                storage = leaf.untyped_storage()
                key = (str(storage.device), storage.data_ptr())
                if key in seen:
                    continue
                seen.add(key)
                numel += storage.nbytes() // leaf.element_size()
                nbytes += storage.nbytes()
        elif isinstance(value, (bool, int, float)):
            numel += 1
            nbytes += torch.tensor(value).element_size()
        elif isinstance(value, (list, tuple)):
            for item in value:
                add(item)
        elif isinstance(value, dict):
            for item in value.values():
                add(item)
        elif hasattr(value, "__dict__") and id(value) not in visited:
            # an object kept in the state (GaLore's projector) holds tensors in its attributes
            visited.add(id(value))
            add(vars(value))

    for state in optimizer.state.values():
        add(state)
    return StateSize(numel, nbytes)


class MemoryBudgetExceeded(torch.OutOfMemoryError):
    """Live tensors past `memory_budget_mb` on CPU: the same failure a GPU of that size would give."""

    def __init__(self, budget_bytes: int, live_bytes: int):
        super().__init__(
            f"CPU memory budget of {budget_bytes / MB:.1f} MB exceeded: {live_bytes / MB:.1f} MB of tensors live"
        )
        self.figures_mb = {"memory_allocated_mb": live_bytes / MB}


class _CpuTensorPeak(TorchDispatchMode):
    """Live bytes of tensor storages created by ops inside the mode, plus a baseline of existing tensors."""

    def __init__(self, baseline: list[torch.Tensor], budget_bytes: int | None = None):
        super().__init__()
        self.budget_bytes = budget_bytes
        self.current = self.peak = 0
        self._live = WeakIdKeyDictionary()
        for t in baseline:
            self._track(t)

    def _track(self, t: torch.Tensor) -> None:
        for leaf in storage_leaves(t):
            if leaf.device.type != "cpu":
                continue
            storage = leaf.untyped_storage()
            if storage in self._live:
                continue
            size = storage.nbytes()
            self._live[storage] = size
            weakref.finalize(storage, self._release, size)
            self.current += size
            self.peak = max(self.peak, self.current)
            if self.budget_bytes is not None and self.current > self.budget_bytes:
                raise MemoryBudgetExceeded(self.budget_bytes, self.current)

    def _release(self, size: int) -> None:
        self.current -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


class PeakMemory:
    """Peak device memory over a ``with`` block.

    CUDA: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` after a reset, synchronised at both ends.
    CPU: tensor-level accounting of every storage alive in the block (``baseline`` tensors such as the model's
    parameters count from the start); there is no caching allocator, so nothing is "reserved".
    """

    def __init__(self, device: torch.device, baseline=(), budget_mb: float | None = None):
        self.device = torch.device(device)
        self.baseline = list(baseline)
        self.budget_bytes = None if budget_mb is None else int(budget_mb * MB)
        self.peak_bytes: int | None = None
        self.peak_reserved_bytes: int | None = None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            if self.budget_bytes is not None:  # the caching allocator then raises OutOfMemoryError past it
                total = torch.cuda.get_device_properties(self.device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, self.budget_bytes / total), self.device)
        else:
            self._mode = _CpuTensorPeak(self.baseline, self.budget_bytes)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
            self.peak_reserved_bytes = torch.cuda.max_memory_reserved(self.device)
        else:
            self._mode.__exit__(*exc)
            self.peak_bytes = self._mode.peak
        return False

    def metrics(self) -> dict[str, float]:
        out = {"peak_memory_mb": self.peak_bytes / MB}
        if self.peak_reserved_bytes is not None:
            out["peak_memory_reserved_mb"] = self.peak_reserved_bytes / MB
        return out


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB
