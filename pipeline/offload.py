"""train.offload: what a job keeps in host memory instead of the device's. `activations`: what the forward pass
saves for backward, kept there until backward uses it, so that the device holds the pass's working set instead
of every layer's saved activations. `optimizer`: the optimizer's state and its step (`OffloadedOptimizer`).

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
from torch.utils._pytree import tree_leaves
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


class OffloadedOptimizer(torch.optim.Optimizer):
    """train.offload=optimizer: the optimizer's state and its step in host memory, as torchao's
    CPUOffloadOptimizer keeps them (which runs on CUDA only), for any optimizer of `whole`'s class: a host copy of
    each trained weight and of its gradient, and on it an optimizer of that class and that weight's group
    settings (`offloaded`). Its step copies each gradient to the host, steps there and copies the weight back:
    the device holds the weights and their gradients, no state. The host copies are counted in `held`; on a
    CPU device they are made and stepped outside the memory trackers, as a GPU's trackers do not see the host.
    Its `param_groups` are the host optimizers' (a schedule sets their rates); `state` is the device's (none)."""

    def __init__(self, whole: torch.optim.Optimizer):
        self.held, self.offloaded, self._host, self._counted = HostBytes(), {}, {}, False
        with _disable_current_modes():
            for group in whole.param_groups:
                settings = {k: v for k, v in group.items() if k != "params"}
                for p in group["params"]:
                    pinned = p.device.type == "cuda"
                    host = torch.empty_like(p, device="cpu", pin_memory=pinned).copy_(p.detach())
                    host.grad = torch.zeros_like(host, pin_memory=pinned)
                    for copy in (host, host.grad):
                        self.held.add(copy.untyped_storage())
                    self.offloaded[p], self._host[p] = type(whole)([{**settings, "params": [host]}]), host
        super().__init__(list(self.offloaded), whole.defaults)
        self.param_groups = [group for inner in self.offloaded.values() for group in inner.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        for p, inner in self.offloaded.items():
            if p.grad is None:
                continue
            host = self._host[p]
            with _disable_current_modes():
                host.grad.copy_(p.grad, non_blocking=True)
                if p.device.type == "cuda":
                    torch.cuda.current_stream().synchronize()
                # the host step without the optimizer hooks (torch's wrapper): the trackers see one step, this one
                step = type(inner).step
                getattr(step, "__wrapped__", step)(inner)
            p.copy_(host, non_blocking=True)
        if not self._counted:  # the state, made by the first step: counted once
            self._counted = True
            for inner in self.offloaded.values():
                for value in tree_leaves(inner.state):
                    if isinstance(value, torch.Tensor):
                        self.held.add(value.untyped_storage())

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.offloaded:
            p.grad = None

    def state_dict(self) -> dict:
        return {"offloaded": [inner.state_dict() for inner in self.offloaded.values()]}

    def load_state_dict(self, state_dict: dict) -> None:
        for inner, state in zip(self.offloaded.values(), state_dict["offloaded"], strict=True):
            inner.load_state_dict(state)
        with _disable_current_modes():  # the weights as they are now (a resumed job's, loaded before this)
            for p, host in self._host.items():
                host.copy_(p.detach())
        # (torch's load makes new groups: the schedule sets the rates of those)
        self.param_groups = [group for inner in self.offloaded.values() for group in inner.param_groups]
