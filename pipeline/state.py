"""What an optimizer holds: everything it keeps (`held_state`, the optimizers that update inside the backward
pass included), its size in elements and bytes as the tensors' storages hold it, and the part bitsandbytes
pages out of the device."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from pipeline import StateSize


def storage_leaves(t: torch.Tensor):
    """The plain tensors that really hold a tensor's memory (inner tensors of a wrapper subclass)."""
    if is_traceable_wrapper_subclass(t):
        for name in t.__tensor_flatten__()[0]:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from storage_leaves(inner)
    else:
        yield t


ADALOMO_STATE = (
    "exp_avg_sq",
    "exp_avg_sq_row",
    "exp_avg_sq_col",
)  # AdaLomo's dicts: parameter name -> tensor


def held_state(optimizer) -> dict:
    """Everything an optimizer keeps, as ``optimizer.state`` lays it out ({key: {name: value}}): its ``state``,
    and where the optimizers that update inside the backward pass keep theirs instead: transformers'
    layer-wise dummy (the per-parameter optimizers of its ``optimizer_dict``) and AdaLomo (dicts of factored
    second moments by parameter name, attributes of the object)."""
    found = dict(optimizer.state)
    for inner in (getattr(optimizer, "optimizer_dict", None) or {}).values():
        found.update(held_state(inner))
    if hasattr(optimizer, "fused_backward"):  # lomo-optim
        for attr in ADALOMO_STATE:
            for name, value in (getattr(optimizer, attr, None) or {}).items():
                found.setdefault(name, {})[attr] = value
    return found


class StateHolder:
    """An object whose ``state`` is all an optimizer keeps (`held_state`): what MemTracker reads."""

    def __init__(self, optimizer):
        self.state = held_state(optimizer)


def optimizer_state_size(optimizer: torch.optim.Optimizer) -> StateSize:
    """Elements and bytes of everything an optimizer keeps (``optimizer.state``, see `held_state`).

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
                # (meta tensors have no address: their storage object itself tells them apart)
                key = (
                    str(storage.device),
                    storage._cdata if storage.device.type == "meta" else storage.data_ptr(),
                )
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

    for state in held_state(optimizer).values():
        add(state)
    for inner in getattr(optimizer, "offloaded", {}).values():  # train.offload=optimizer: the host's
        add(inner.state)
    return StateSize(numel, nbytes)


def paged_state_size(optimizer: torch.optim.Optimizer) -> StateSize:
    """The part of ``optimizer.state`` that bitsandbytes keeps in paged (CUDA unified) memory.

    bitsandbytes' paged optimizers put the state of large tensors (>= 1e5 elements) in managed memory that it
    wraps as a CPU tensor marked ``is_paged``; the CUDA caching allocator never sees it, so the allocator's
    peak leaves it out. Off CUDA bitsandbytes falls back to ordinary tensors: nothing is paged.
    """
    seen: set[int] = set()
    numel = nbytes = 0
    for state in optimizer.state.values():
        for value in tree_leaves(state):
            if isinstance(value, torch.Tensor) and getattr(value, "is_paged", False):
                storage = value.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    numel += storage.nbytes() // value.element_size()
                    nbytes += storage.nbytes()
    return StateSize(numel, nbytes)
