"""Peak-memory tracking (CUDA allocator stats, or tensor-level on CPU), and the breakdown of one training step's
peak into parameters, gradients, optimizer state, activations, a language model's logits and the rest (the
state's own accounting: pipeline.state)."""

from __future__ import annotations

import math
import resource
import warnings
import weakref
from collections.abc import Callable
from copy import deepcopy

import torch
from torch.distributed._tools import mod_tracker as _mod_tracker
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType
from torch.distributed._tools.mod_tracker import ModTracker
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from pipeline import MB
from pipeline.cpu_peak import CpuTensorPeak, MemoryBudgetExceeded, distinct_mb  # noqa: F401 (callers' names)
from pipeline.state import StateHolder, held_state, paged_state_size, storage_leaves


def in_backward() -> bool:
    """Whether autograd is running a backward pass now (this runs inside one of its hooks)."""
    return torch._C._current_graph_task_id() != -1


def indexed(device) -> torch.device:
    """The device with its index: `cuda` becomes `cuda:<current device>`.

    Accelerate names a single GPU `cuda` (no index); torch's per-device allocator calls that do not take an
    optional device (`torch.cuda.set_per_process_memory_fraction`) raise on it."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class OutsideBudgetExceeded(torch.OutOfMemoryError):
    """On CUDA, what the caching allocator reserves plus what the job holds outside it (a paged optimizer's
    state in managed memory) past `memory_budget_mb`."""

    def __init__(self, budget_bytes: int, reserved_bytes: int, outside_bytes: int):
        total, budget = distinct_mb(reserved_bytes + outside_bytes, budget_bytes)
        super().__init__(
            f"memory budget of {budget} MB exceeded: {total} MB = {reserved_bytes / MB:.1f} MB reserved by the "
            f"caching allocator + {outside_bytes / MB:.1f} MB of paged optimizer state (managed memory)"
        )
        self.figures_mb = {
            "memory_allocated_mb": torch.cuda.memory_allocated() / MB,
            "memory_reserved_mb": reserved_bytes / MB,
            "paged_state_mb": outside_bytes / MB,
        }


def allocator_fraction(budget_bytes: int, outside_bytes: int, total_bytes: int) -> float:
    """The share of the device the caching allocator may reserve under a budget of which `outside_bytes` are
    held outside it (a paged optimizer's state): (budget - outside) / device memory, within 0 and 1."""
    return min(1.0, max(0.0, (budget_bytes - outside_bytes) / total_bytes))


def logits_width(model) -> int | None:
    """The vocabulary size of a language model's head (its output embeddings: the LM head, whose output is the
    logits, batch x sequence x vocabulary); None for a model without one (a classifier's head is no output
    embedding)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    weight = getattr(head, "weight", None)
    return None if weight is None else int(weight.shape[0])


def is_logits(t: torch.Tensor, width: int | None) -> bool:
    """Whether a tensor made in the forward or backward pass belongs to the `logits` part of the breakdown: a
    tensor of two or more dimensions whose last one is the vocabulary (`width`, logits_width's). That is the LM
    head's output (batch x sequence x vocabulary), its fp32 copy (transformers' causal-LM loss calls
    `logits.float()`: a copy under bf16/fp16, the same tensor in fp32), the loss's log-softmax (saved for
    backward) and, in backward, the gradients of these, down to the LM head's input. Nothing else a decoder
    makes ends in the vocabulary: the head's weight gradient is vocabulary x hidden (torch's matmul backward
    writes it in the weight's own layout), an Adafactor row statistic or a bias is one-dimensional. A storage
    is filed by the tensor an operation makes it as, never by a later view (autocast's bf16 copy of the head's
    weight, vocabulary x hidden, is saved for backward as its transpose and stays an activation); weights,
    gradients and optimizer state are never logits."""
    return width is not None and t.dim() >= 2 and t.shape[-1] == width


KINDS = ("params", "grads", "optimizer", "activations", "logits", "other")  # KindPeak's, in this order


class KindPeak(TorchDispatchMode):
    """Live tensor storages by kind (KINDS: params, grads, optimizer, activations, logits, other), and the kinds
    at the peak.

    A lighter MemTracker for simulated steps (pipeline.plan_step): its cost does not grow with the number of
    modules. Weights and buffers count as params; a storage saved for backward becomes an activation; one
    that lands in a parameter's `.grad` a gradient; one kept in `optimizer.state` optimizer state (see
    `file_state`); with `vocab` (a language model's, `logits_width`), one made as logits (`is_logits`) counts
    as logits, saved for backward or not; everything else torch makes is other (temporaries).
    """

    def __init__(self, model: torch.nn.Module, inputs=(), vocab: int | None = None):
        super().__init__()
        self.vocab = vocab
        self.current = dict.fromkeys(KINDS, 0)
        self.at_peak = dict(self.current)
        self.peak = 0
        self.where = None  # a label for the stretch of the step now running (set by `enter`)
        self.trace: dict[str, list[dict]] = {}  # label -> the kinds after each allocation in that stretch
        self._kind = WeakIdKeyDictionary()  # storage -> [kind, bytes]
        self.model = model
        self.track([*model.parameters(), *model.buffers()], "params")
        self.track([p.grad for p in model.parameters() if p.grad is not None], "grads")
        self.track(inputs, "other")

    def track(self, tensors, kind: str) -> None:
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            # logits or not by the tensor a storage is made as (a weight's copy saved as its transpose is none)
            made_as = "logits" if kind in ("activations", "other") and is_logits(t, self.vocab) else kind
            for leaf in storage_leaves(t):
                storage = leaf.untyped_storage()
                entry = self._kind.get(storage)
                if entry is None:
                    entry = self._kind[storage] = [made_as, storage.nbytes()]
                    weakref.finalize(storage, self._release, entry)
                    self.current[made_as] += entry[1]
                elif entry[0] != kind and (
                    entry[0] == "other" or kind == "optimizer" or (entry[0] == "logits" and kind == "grads")
                ):
                    self.current[entry[0]] -= entry[1]
                    entry[0] = kind
                    self.current[kind] += entry[1]
        self._note(sum(self.current.values()))

    def _note(self, total: int) -> None:
        if total > self.peak:
            self.peak, self.at_peak = total, dict(self.current)
        if self.where is not None:
            self.trace[self.where].append(dict(self.current))

    def enter(self, where: str) -> None:
        """From now on, trace the kinds after each allocation under `where`, starting with what is alive now."""
        self.where = where
        self.trace.setdefault(where, [])
        self._note(sum(self.current.values()))

    def _release(self, entry) -> None:
        self.current[entry[0]] -= entry[1]

    def file_state(self, optimizer) -> None:
        self.track([v for state in held_state(optimizer).values() for v in tree_leaves(state)], "optimizer")

    def __enter__(self):
        self._saved = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._saved.__enter__()
        self._grad_hooks = [
            p.register_post_accumulate_grad_hook(lambda p: self.track([p.grad], "grads"))
            for p in self.model.parameters()
            if p.requires_grad
        ]
        return super().__enter__()

    def __exit__(self, *exc):
        for handle in self._grad_hooks:
            handle.remove()
        self._saved.__exit__(*exc)
        return super().__exit__(*exc)

    def _pack(self, t):
        self.track([t], "activations")
        return t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(tree_leaves(out), "other")
        return out


class PeakMemory:
    """Peak device memory over a ``with`` block.

    CUDA: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` after a reset, synchronised at both ends.
    CPU: tensor-level accounting of every storage alive in the block (``baseline`` tensors such as the model's
    parameters count from the start); there is no caching allocator, so nothing is "reserved".
    """

    def __init__(self, device: torch.device, baseline=(), budget_mb: float | None = None):
        self.device = indexed(device)
        self.baseline = list(baseline)
        self.budget_bytes = None if budget_mb is None else int(budget_mb * MB)
        self.peak_bytes: int | None = None
        self.peak_reserved_bytes: int | None = None
        self.outside_bytes = 0  # held outside the caching allocator, counted against the budget (CUDA)

    def hold_outside(self, nbytes: int) -> None:
        """CUDA: `nbytes` are held outside the caching allocator from now on (a paged optimizer's state, in
        managed memory): under a budget the allocator's cap shrinks by them, and what it reserves already plus
        them past the budget is an out-of-memory now (OutsideBudgetExceeded)."""
        self.outside_bytes = nbytes
        if self.budget_bytes is None or self.device.type != "cuda" or not nbytes:
            return
        reserved = torch.cuda.memory_reserved(self.device)
        if reserved + nbytes > self.budget_bytes:
            raise OutsideBudgetExceeded(self.budget_bytes, reserved, nbytes)
        total = torch.cuda.get_device_properties(self.device).total_memory
        torch.cuda.set_per_process_memory_fraction(
            allocator_fraction(self.budget_bytes, nbytes, total), self.device
        )

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            if self.budget_bytes is not None:  # the caching allocator then raises OutOfMemoryError past it
                # (it caps what the allocator reserves: live tensors, fragmentation and workspaces together)
                total = torch.cuda.get_device_properties(self.device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, self.budget_bytes / total), self.device)
        else:
            self._mode = CpuTensorPeak(self.baseline, self.budget_bytes)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
            self.peak_reserved_bytes = torch.cuda.max_memory_reserved(self.device)
            if self.budget_bytes is not None:  # the budget is for the block: evaluation runs without it
                torch.cuda.set_per_process_memory_fraction(1.0, self.device)
        else:
            self._mode.__exit__(*exc)
            self.peak_bytes = self._mode.peak
        return False

    def metrics(self) -> dict[str, float]:
        out = {"peak_memory_mb": self.peak_bytes / MB}
        if self.peak_reserved_bytes is not None:
            out["peak_memory_reserved_mb"] = self.peak_reserved_bytes / MB
        return out


# StepBreakdown's reference type of a language model's logits (is_logits), beside MemTracker's own
LOGITS = "Logits"


class _NoHook:
    """The handle of a hook that was never registered (StepBreakdown.track_external)."""

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


class _InputHooks(ModTracker):
    """torch's ModTracker, keeping the handles of the backward hooks it registers on each module's inputs, which
    `remove_input_hooks` takes off.

    Before each module's forward, ModTracker registers a multi-grad hook (mode "all") on the module's inputs
    and drops its handle. The hook's closure holds the inputs' autograd nodes, and those nodes hold the hook.
    That cycle runs through C++ objects, which Python's garbage collector cannot see. A backward pass that
    runs to its end frees each node's saved tensors all the same. A step cut short by an error (an
    out-of-memory error in its forward or its backward pass) leaves the nodes that had not run alive, with
    the activations they saved. Taking the hooks off breaks the cycles: those nodes and activations go with
    the step's last reference (find_batch_size's next probe would otherwise start with them held).
    """

    def __init__(self):
        super().__init__()
        self._input_hooks = []

    def _fw_pre_hook(self, mod, input):
        # ModTracker's own, with the multi-grad hook it registers (by its module's name for the function) kept
        register = _mod_tracker.register_multi_grad_hook

        def kept(*args, **kwargs):
            handle = register(*args, **kwargs)
            self._input_hooks.append(handle)
            return handle

        _mod_tracker.register_multi_grad_hook = kept
        try:
            return super()._fw_pre_hook(mod, input)
        finally:
            _mod_tracker.register_multi_grad_hook = register

    def remove_input_hooks(self) -> None:
        for handle in self._input_hooks:
            handle.remove()
        self._input_hooks.clear()


class StepBreakdown(MemTracker):
    """PyTorch's MemTracker, with the optimizer step's temporaries kept apart from its state, a language model's
    logits apart from the other activations and temporaries, and what the allocator holds that no tensor
    accounts for filed as "other".

    MemTracker files every tensor created inside `optimizer.step()` as optimizer state; here they are
    temporaries until its post-step hook files the tensors that stay in `optimizer.state` as state.
    MemTracker sees tensors only. `allocated` (on CUDA: `torch.cuda.memory_allocated`) is read when the step
    starts; what it holds beyond the tensors MemTracker tracks then (cuBLAS workspaces, 32 MiB per handle on
    Hopper, one for forward and one for autograd's backward thread; the batch; small tensors of the loop) is
    `untracked` and counts as "other" for the whole step.

    With `vocab` (a language model's, `logits_width`), every storage the forward or backward pass makes as
    logits (`is_logits`) is filed as LOGITS (`peak_logits_mb`) rather than as an activation or a temporary.

    Leaving it, normally or by an error, takes off the backward hooks its module tracker put on the step's
    autograd graph (`_InputHooks`): a step that ran out of memory leaves none of its activations behind.
    """

    def __init__(
        self, device: torch.device, allocated: Callable[[], int] | None = None, vocab: int | None = None
    ):
        super().__init__()
        self._mod_tracker = _InputHooks()
        self.device = torch.device(device)
        self._allocated = allocated
        self.untracked = 0
        self.vocab = vocab
        if vocab is not None:  # the snapshot's keys: MemTracker's reference types and LOGITS
            self._ref_class = (*_MemRefType, LOGITS)

    def _on_device(self, snapshot) -> dict:
        return next((v for d, v in snapshot.items() if d.type == self.device.type), {})

    def track_external(self, *external) -> None:
        # MemTracker registers a gradient hook on every parameter a module's forward sees, which torch refuses
        # for a frozen one (peft=lora / qlora's base): a frozen parameter, which never has a gradient, gets none
        for module in external:
            if isinstance(module, torch.nn.Module):
                for p in module.parameters():
                    if not p.requires_grad:
                        self._param_to_grad_hook_handles[p] = (_NO_HOOK, _NO_HOOK)
        super().track_external(*external)

    def __enter__(self):
        super().__enter__()
        if self._allocated is not None:
            tracked = self._on_device(self.get_tracker_snapshot("current")).get("Total", 0)
            self.untracked = max(0, self._allocated() - tracked)
        return self

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._mod_tracker.remove_input_hooks()

    def _track(self, reftype, t: torch.Tensor) -> None:
        if self._in_opt:
            reftype = _MemRefType.TEMP
        elif reftype in (_MemRefType.ACT, _MemRefType.TEMP) and is_logits(t, self.vocab):
            reftype = LOGITS
        super()._track(reftype, t)

    def _register_global_optimizer_hook(self) -> None:
        # TrainingMemory's optimizer hooks call the two methods below: it enters this tracker from inside its
        # own post-step hook, where registering another global hook would mutate the hooks being run
        pass

    def optimizer_step_started(self) -> None:
        self._in_opt = True

    def optimizer_step_ended(self, optimizer) -> None:
        self._track_optimizer_states(_MemRefType.OPT, StateHolder(optimizer))
        self._in_opt = False

    def track_state(self, optimizer) -> None:
        """File what the optimizer keeps (wherever it keeps it, `held_state`) as optimizer state."""
        self._track_optimizer_states(_MemRefType.OPT, StateHolder(optimizer))

    def _update_peak_stats(self, peak_state) -> None:
        # the device's peak only, as MemTracker keeps it: MemTracker also keeps each active module's own peak,
        # walking every module it has seen at every op (most of a deep model's tracked step: 20 layers, 2 ranks,
        # 56 of 117 s), and `metrics` reads none of them
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                self._peak_mem[device] = snapshot[_TOTAL_KEY]
                self._peak_mem_snap[device] = deepcopy(snapshot)

    def _update_and_maybe_create_winfos(self, t, reftype, update_existing=False):
        if t is None:  # a layer-wise optimizer's hook, which ran first, freed the gradient already
            return set()
        return super()._update_and_maybe_create_winfos(t, reftype, update_existing)

    def metrics(self) -> dict[str, float]:
        peak = self._on_device(self.get_tracker_snapshot("peak"))
        part = lambda *kinds: sum(peak.get(k, 0) for k in kinds) / MB  # noqa: E731
        untracked = self.untracked / MB
        return {
            "peak_params_mb": part(_MemRefType.PARAM, _MemRefType.BUFFER),
            "peak_grads_mb": part(_MemRefType.GRAD),
            "peak_optimizer_mb": part(_MemRefType.OPT),
            "peak_activations_mb": part(_MemRefType.ACT),
            **({} if self.vocab is None else {"peak_logits_mb": part(LOGITS)}),
            "peak_other_mb": part(_MemRefType.TEMP, _MemRefType.OTH) + untracked,
            **({} if self._allocated is None else {"peak_untracked_mb": untracked}),
            "peak_breakdown_mb": part("Total") + untracked,
        }


class TrainingMemory:
    """Peak memory of a training loop (either backend), and the breakdown of one step.

    CUDA: the allocator's peak over every step. CPU: the tensor-level tracker, which slows each op, runs on
    the first `track_steps` steps and on any later step whose batch has more tokens than every tracked one
    (activations grow with tokens), so the peak is that of the largest batch; None tracks every step.

    The breakdown runs one step under `StepBreakdown`: the first step (`breakdown_step=1`) or the first one
    that starts with the optimizer state in place (`breakdown_step=2`: the step after the first optimizer
    step that ran), entered at the end of the step before it so that the model's forward hooks see the whole
    step; `breakdown_na` says why it cannot run, when it cannot. A language model's breakdown (one whose head is
    an LM head: `logits_width`) has a `logits` part as well; a classifier's has none.

    A step (its `accumulation` batches) starts with the model's forward in training mode and ends with its
    optimizer step, or, when that never runs (the fp16 grad scaler skips a step whose gradients overflowed, and
    torch's optimizer hooks then do not fire), when the next step starts or the loop ends.
    """

    def __init__(
        self,
        device,
        model: torch.nn.Module,
        budget_mb: float | None = None,
        track_steps: int | None = 3,
        breakdown_step: int | None = 2,
        breakdown_na: str | None = None,
        accumulation: int = 1,
    ):
        self.device = indexed(device)
        self.accumulation, self._batches = accumulation, 0  # batches a step, and of the step now running
        self.model, self.budget_mb, self.track_steps = model, budget_mb, track_steps
        self.breakdown_step = None if breakdown_na else breakdown_step
        self.breakdown_na = breakdown_na
        self.breakdown: StepBreakdown | None = None
        self.breakdown_metrics: dict[str, float] = {}
        self.breakdown_label: str | None = None  # the step the breakdown describes, once it has run
        self.step = 0
        self.optimizer_steps = 0  # optimizer steps that ran (the grad scaler may skip some)
        self.tracked_steps: list[int] = []
        self.largest_batch: tuple[int, ...] = (0,)  # the shape of the token ids of the largest batch
        self.largest_before_state = (
            False  # whether that batch's step began before any optimizer step (no state)
        )
        # the largest batch of a measured step that began with the state in place (CPU: a tracked one)
        self.largest_with_state: tuple[int, ...] = (0,)
        self._most_tokens = 0
        self._optimizer = None
        self._depth = 0  # a wrapper optimizer's step (accelerate's) nests the real one
        self._tracking = False
        self._step_open = False

    @property
    def on_cpu(self) -> bool:
        return self.device.type != "cuda"

    @property
    def breakdown_tag(self) -> str:
        """The `peak_breakdown` tag: which step the breakdown describes, or why there is none."""
        if self.breakdown_na:
            return self.breakdown_na
        if self.breakdown_label:
            return self.breakdown_label
        return (
            "n/a: no training step started with the optimizer state in place "
            f"({self.optimizer_steps} of {self.step} optimizer steps ran; the fp16 grad scaler skips steps)"
        )

    def __enter__(self):
        if self.on_cpu:
            budget = None if self.budget_mb is None else int(self.budget_mb * MB)
            self.cpu = CpuTensorPeak([*self.model.parameters(), *self.model.buffers()], budget)
        else:
            self.cuda = PeakMemory(self.device, budget_mb=self.budget_mb).__enter__()
        self._handles = [
            self.model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            register_optimizer_step_pre_hook(self._before_optimizer_step),
            register_optimizer_step_post_hook(self._after_optimizer_step),
        ]
        if self.breakdown_step == 1:
            self._start_breakdown()
        return self

    def _live_tensors(self, inputs) -> list[torch.Tensor]:
        """What a step starts with: weights, gradients, optimizer state, the batch."""
        live = [*self.model.parameters(), *self.model.buffers(), *inputs]
        live += [p.grad for p in self.model.parameters() if p.grad is not None]
        if self._optimizer is not None:
            live += [v for state in held_state(self._optimizer).values() for v in tree_leaves(state)]
        return [t for t in live if isinstance(t, torch.Tensor)]

    def _before_any_forward(self, module, args) -> None:
        if module is self.model and module.training and self._step_open:
            if self._batches < self.accumulation:  # the step's next batch: MemTracker sees a forward again
                self.breakdown.reset_mod_stats()
            else:  # the step before ended without an optimizer step (the grad scaler skipped it): end it
                self._end_step(stepped=False)  # before MemTracker's hooks see the model's forward again

    def _before_forward(self, module, args, kwargs) -> None:
        if not module.training:
            return
        if not self._step_open or self._batches == self.accumulation:  # (else: the step's next batch)
            if (
                self._step_open
            ):  # the step before ended without its optimizer step (the grad scaler skipped it)
                self._end_step(stepped=False)
            self._step_open, self._batches = True, 0
            self.step += 1
        self._batches += 1
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        ids = max((t for t in inputs if not t.is_floating_point()), key=torch.numel, default=None)
        tokens = 0 if ids is None else ids.numel()
        before_state = self.optimizer_steps == 0
        if tokens > math.prod(self.largest_batch):
            self.largest_batch, self.largest_before_state = tuple(ids.shape), before_state
        tracked = self.track_steps is None or self.step <= self.track_steps or tokens > self._most_tokens
        measured = tracked or not self.on_cpu  # (CUDA's allocator sees every step)
        if measured and not before_state and tokens > math.prod(self.largest_with_state):
            self.largest_with_state = tuple(ids.shape)
        if self.on_cpu and tracked:
            self._most_tokens = max(self._most_tokens, tokens)
        if self.on_cpu and tracked and not self._tracking:  # (a step's later batch: tracked since its first)
            self.tracked_steps.append(self.step)
            self.cpu.track(self._live_tensors(inputs))  # what was made while untracked
            self.cpu.__enter__()
            self._tracking = True

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        if in_backward():
            return  # a per-parameter optimizer stepped from a gradient hook: part of the backward pass
        self._depth += 1
        self._optimizer = optimizer  # the innermost: the one holding the state
        if self.breakdown is not None:
            self.breakdown.optimizer_step_started()

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        if in_backward():
            return
        self._depth -= 1
        if self._depth:
            return
        self.optimizer_steps += 1
        if not self.on_cpu and self.optimizer_steps == 1:  # the state exists now: its paged part, once
            self.cuda.hold_outside(paged_state_size(self._optimizer).bytes)
        if self.breakdown is not None:
            self.breakdown.optimizer_step_ended(self._optimizer)
        self._end_step(stepped=True)

    def updated_in_backward(self, optimizer) -> None:
        """The loop's step ended with the update made inside the backward pass (LOMO, a layer-wise
        optimizer), where no whole-model optimizer step runs whose hook would end it: end it as that hook
        would, unless one did (the Trainer calls a no-op step on the layer-wise dummy)."""
        if self._step_open:
            self._optimizer = optimizer
            self.optimizer_steps += 1
            if self.breakdown is not None:
                self.breakdown.track_state(optimizer)
            self._end_step(stepped=True)

    def _end_step(self, stepped: bool) -> None:
        self._step_open = False
        self._stop_tracking()
        if self.breakdown is not None:
            self._stop_breakdown(stepped)
        elif stepped and self.breakdown_step == 2 and not self.breakdown_label:
            self._start_breakdown()  # the next step starts with the optimizer state in place

    def _stop_tracking(self) -> None:
        if self._tracking:
            self._tracking = False
            self.cpu.__exit__(None, None, None)

    def _start_breakdown(self) -> None:
        allocated = None if self.on_cpu else (lambda: torch.cuda.memory_allocated(self.device))
        self.breakdown = StepBreakdown(self.device, allocated, logits_width(self.model))
        self.breakdown.track_external(self.model)
        if self._optimizer is not None:
            self.breakdown.track_state(self._optimizer)
        # MemTracker warns at every backward hook of a module it sees freed, and (its ModTracker) where a module
        # is entered inside another of the same name: transformers' decoders call modules made on the fly inside
        # attention, each named by its class alone (`Func`). Nothing to act on: the breakdown is by kind of
        # storage, not by module
        self._quiet = warnings.catch_warnings()
        self._quiet.__enter__()
        warnings.filterwarnings("ignore", message="Module is None")
        warnings.filterwarnings("ignore", message="The module hierarchy tracking maybe be messed up")
        self._breakdown_from = self.step + 1  # the step it sees whole
        # a global hook, only while the breakdown runs (it puts every module's call on torch's hooked path):
        # global hooks run before a module's own, and this one before MemTracker's (registered next), so a step
        # whose optimizer step the grad scaler skipped ends before MemTracker sees the model's forward again
        self._any_forward = register_module_forward_pre_hook(self._before_any_forward)
        self.breakdown.__enter__()

    def _stop_breakdown(self, stepped: bool, whole: bool = True) -> None:
        """End the breakdown; with `whole` (its step ended rather than an error cutting it short), keep its
        figures if its step ran whole under it."""
        try:
            self.breakdown.__exit__(None, None, None)
        finally:
            self._any_forward.remove()
            self._quiet.__exit__(None, None, None)
        if whole and self.step == self._breakdown_from:  # the whole step ran under it
            self.breakdown_metrics = self.breakdown.metrics()
            skipped = "" if stepped else " (its optimizer step was skipped by the grad scaler)"
            self.breakdown_label = f"step {self.step}{skipped}"
        self.breakdown = None

    def __exit__(self, *exc):
        if self._step_open and exc[0] is None:  # the last step's optimizer step was skipped
            self._end_step(stepped=False)
        self._stop_tracking()  # modes leave in the reverse order they came: the step's tracker first
        if self.breakdown is not None:  # an error cut its step short, or it began after the last step ended
            self._stop_breakdown(stepped=False, whole=exc[0] is None)
        for handle in self._handles:
            handle.remove()
        if not self.on_cpu:
            self.cuda.__exit__(*exc)
        return False

    def metrics(self) -> dict[str, float]:
        if self.on_cpu:
            out = {"peak_memory_mb": self.cpu.peak / MB, "peak_memory_tracked_steps": len(self.tracked_steps)}
        else:
            out = self.cuda.metrics()
        return {**out, **self.breakdown_metrics}


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB
