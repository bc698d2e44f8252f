"""train.offload=activations: what the forward pass saves for backward kept in host memory until backward uses
it, so that the device holds the pass's working set instead of every layer's saved activations.

The pattern of torch.autograd.graph.save_on_cpu (on CUDA a pinned host copy, made without waiting, and a copy
back to the device when backward needs it), with the model's own weights and buffers left where they are, as
torchtune's activation offloading leaves them (a saved weight is not copied at every step). On a CPU device,
host and device are the same memory: the host copy is made outside the memory trackers (pipeline.memory, the
plan's KindPeak), the saved tensor then freed as on a GPU, and made again in backward, so that a CPU job and
a plan count what a GPU would hold on the device. The host bytes are counted apart (`HostBytes`).
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary


class HostBytes:
    """The bytes the offloaded activations hold in host memory: now, and at most (the end of a forward pass)."""

    def __init__(self):
        self.live = self.peak = 0

    def add(self, storage) -> None:
        size = storage.nbytes()
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, size)

    def _free(self, size: int) -> None:
        self.live -= size


class OffloadedActivations(torch.autograd.graph.saved_tensors_hooks):
    """Within it, each tensor autograd saves, other than `model`'s weights and buffers, is kept as a host copy
    (counted in `held`) and copied back to its device when backward needs it."""

    def __init__(self, model: torch.nn.Module, held: HostBytes):
        own = WeakIdKeyDictionary(
            {t.untyped_storage(): None for t in (*model.parameters(), *model.buffers())}
        )

        def pack(tensor: torch.Tensor):
            if tensor.untyped_storage() in own:
                return tensor
            if tensor.device.type == "cuda":
                host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
                host.copy_(tensor, non_blocking=True)
            else:  # the same memory: a copy the trackers do not see, as a GPU's trackers do not see the host's
                with _disable_current_modes():
                    host = tensor.detach().clone()
            held.add(host.untyped_storage())
            return tensor.device, host

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            device, host = packed
            return host.to(device, non_blocking=True) if device.type == "cuda" else host.clone()

        super().__init__(pack, unpack)


def install(model, on: bool | None = None) -> None:
    """train.offload=activations: the model's forward (its adapters' included) run within OffloadedActivations,
    the host bytes in `model.host_offload`. Kept as config.offload_activations (in the plan's keys); None: the
    config's own (a plan's fake model)."""
    if not (getattr(model.config, "offload_activations", False) if on is None else on):
        return
    model.config.offload_activations = True
    held, forward = HostBytes(), model.forward

    @functools.wraps(forward)
    def offloaded(*args, **kwargs):
        with OffloadedActivations(model, held):
            return forward(*args, **kwargs)

    model.forward, model.host_offload = offloaded, held
