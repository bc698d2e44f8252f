"""Plan before you train: the peak memory of a training step, predicted by running that very step on fake
tensors (torch's FakeTensorMode: shapes, dtypes and devices, no data and no memory), so a model of any size
is planned in seconds from its architecture alone.

What runs is what a job runs: the model class the job's task builds from the config (`models.auto_class`: a
classifier, or a decoder with its LM head for task=causal_lm, trained on labels of one token id per position),
its attention implementation, blocks, tied or untied embeddings, autocast for bf16/fp16, bf16 weights for bf16_pure,
gradient checkpointing, and the optimizer's own step (torch's per-tensor loop on CPU, its `foreach` loop for a
CUDA target, as torch picks by default there). For a CUDA target, the kernels whose saved tensors differ from
CPU's run as on CUDA (pipeline.cuda_kernels): attention the fused kernel torch's CUDA dispatch picks (the output
and the logsumexp saved, not the probabilities the CPU's math path keeps), dropout its fused kernel (a 1-byte
mask, not a noise tensor), autocast casts as CUDA's does, and the autocast query answers for it. A storage tracker
(PyTorch's MemTracker, as the step-2 breakdown of a training job) follows every tensor's lifetime, so the
parts are the same as a measured breakdown, a language model's `logits` part included (pipeline.memory.is_logits). An optimizer whose step cannot run on fake tensors (bitsandbytes' and torchao's kernels) gets its
exact analytic state and its stated step temporaries instead (tag `plan_method`).

    peak = max(forward/backward peak + optimizer state,  optimizer-step peak)

The forward/backward of step 2 is that of step 1 with the state in place; the optimizer step's peak holds
the weights, every gradient, the state and the step's temporaries. A step of several batches
(train.gradient_accumulation_steps) runs its later ones with every gradient held: its pass is simulated so. With
train.offload=optimizer the state is the host's: the device's step holds the weights and gradients alone.

A plan costs four simulated passes of a small model, whatever the model's size and the batch: the pass is
simulated at two batch sizes (each allocation's parts are affine in the batch: `Profile`) and, for a deep stack
of identical layers, at two shallow depths (affine in the depth too: `_stretches`); every other batch size,
the model's own depth and the largest batch that fits a budget follow exactly. A training job's simulated step
(`predicted_peak_mb`) needs its own batch size only: its pass is simulated at that size alone.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math

import numpy as np
import torch
from omegaconf import OmegaConf

from pipeline import MB, cuda_reductions
from pipeline.cuda_kernels import cuda_kernels
from pipeline.cuda_reductions import UPPER_GRID, CudaReductionBuffers

# the fake model the step runs on (and the names callers reach it by here)
from pipeline.fake_model import (  # noqa: F401
    _fake_model,
    fake_mode,
    fake_model,
    job_model,
    layer_stack,
    peft_settings,
)
from pipeline.memory import KINDS
from pipeline.plan_ranks import MAX_BATCH

# CUDA targets: what the allocator holds that no tensor does: one cuBLAS workspace per handle (forward, autograd's
# backward thread; measured on an H200: 2 x 33 MiB), as torch's CublasHandlePool.cpp sizes them: 32 MiB on sm_90,
# else 8 MiB + 128 KiB (its ":4096:2:16:8"), each with a cuBLASLt workspace of 1 MiB
CUBLAS_WORKSPACES_MB = 2 * 33
CUBLAS_WORKSPACES_OTHER_MB = 2 * (8 + 1 / 8 + 1)
SM90 = ("h100-80gb", "h200")  # the named GPUs of compute capability 9.0 (the B200 is 10.0)
CUDA_CONTEXT_MB = 512  # CUDA context + kernels: outside the allocator, stated (typically 300-600 MiB)
# Named GPUs: memory as the data sheet states it, in the vendor's units ("80GB": 80 * 10^9 bytes);
# usable = that in MB (2^20 bytes) - CUDA_CONTEXT_MB
DEVICE_MEMORY_GB = {
    "t4": 16,
    "v100-32gb": 32,
    "a10": 24,
    "l4": 24,
    "rtx-3090": 24,
    "rtx-4090": 24,
    "l40s": 48,
    "a100-40gb": 40,
    "a100-80gb": 80,
    "h100-80gb": 80,
    "h200": 141,
    "b200": 180,  # DGX B200 data sheet: 1,440 GB over 8 GPUs
}
# the parts of a peak, in the order of the plan's traces (pipeline.memory.KINDS): `logits` is a language model's
# (a classifier's is always 0 and never reported)
PART_KEYS = KINDS  # a step's parts, in KindPeak's order


def cublas_workspaces_mb(device_memory: str | None) -> float:
    """The cuBLAS workspaces (MB) a training step's allocator holds on the GPU planned for: the named GPU's
    (`device_memory`), else this machine's (pipeline.cuda_reductions.device_capability), else Hopper's."""
    if device_memory is not None:
        return CUBLAS_WORKSPACES_MB if device_memory in SM90 else CUBLAS_WORKSPACES_OTHER_MB
    found = cuda_reductions.device_capability() if torch.cuda.is_available() else None
    return CUBLAS_WORKSPACES_OTHER_MB if found not in (None, (9, 0)) else CUBLAS_WORKSPACES_MB


def usable_mb(device: str) -> float:
    """What a named GPU leaves to the caching allocator (MB): its data sheet's GB (10^9 bytes) less the CUDA
    context."""
    return DEVICE_MEMORY_GB[device] * 10**9 / MB - CUDA_CONTEXT_MB


def _autocast(precision: str):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    return torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()


INPUT_NAMES = ("input_ids", "attention_mask")  # what a tokenizer gives at the least


@functools.cache
def _inputs(mode, batch: int, seq: int, names: tuple[str, ...], task: str = "classification"):
    """A batch as the collator makes it: the tokenizer's inputs (a BERT tokenizer adds token_type_ids, which
    GPT-2, for one, embeds with its token embedding) and the labels of `task` (`models.labels_shape`: one
    class per text, or one token id per position)."""
    from pipeline.models import labels_shape

    with mode:
        fill = {"token_type_ids": torch.zeros}
        inputs = {name: fill.get(name, torch.ones)(batch, seq, dtype=torch.long) for name in names}
        return {**inputs, "labels": torch.zeros(labels_shape(task, batch, seq), dtype=torch.long)}


_PROFILES: dict[tuple, Profile] = {}  # a sweep's plans of one model share them: no optimizer is involved
_OPTIMIZER_STEP: dict[tuple, tuple] = {}
# a stack of identical layers deeper than twice the larger is simulated with this many layers and extrapolated
# (shallower, simulating every layer costs less)
SHALLOW = (2, 3)
TRACED_BATCHES = (2, 3)  # the batch sizes a forward and backward pass is simulated at; any other follows


class Profile:
    """The parts (MB) after every allocation of one forward and backward pass, as a function of the batch size.

    From TRACED_BATCHES on, the same operations run in the same order at any batch size and each allocation's
    parts are affine in it, `base + batch * per_sample` (activations and what is made from them grow with the
    batch, weights and gradients do not): two simulated batch sizes give every other one, and the largest
    batch that fits a budget, without simulating. A smaller batch (one sample) is simulated itself: its
    size-1 dimensions make some copies views.

    Simulated as late as possible: the first batch size asked is simulated itself (a training job's simulated
    step needs its own batch only: one pass, not two); a second one fits the lines from that pass and one more
    at a TRACED_BATCHES size."""

    def __init__(self, trace_at, lines: tuple | None = None, fitted=None):
        """`trace_at(batch)`: the parts (bytes) after every allocation of a pass of that batch size; `lines`:
        (base, per_sample) as `lines()` gave them for the same pass, else fitted here when needed, and then
        handed to `fitted` (to keep them)."""
        self._trace_at, self._fitted, self._traces = trace_at, fitted, {}
        self._lines = None if lines is None else tuple(np.asarray(a, dtype=float) for a in lines)

    def _trace(self, batch: int) -> np.ndarray:
        if batch not in self._traces:
            self._traces[batch] = np.asarray(self._trace_at(batch))
        return self._traces[batch]

    def _fit(self) -> tuple[np.ndarray, np.ndarray]:
        """(base, per_sample): from two passes of batch sizes from TRACED_BATCHES[0] on (one simulated already,
        where there is one)."""
        if self._lines is None:
            traced = sorted(b for b in self._traces if b >= TRACED_BATCHES[0])
            b1, b2 = (traced + [b for b in TRACED_BATCHES if b not in traced])[:2]
            x, y = self._trace(b1), self._trace(b2)
            _check_aligned({"pass": x}, {"pass": y}, f"batch sizes {b1} and {b2}")
            per_sample = (y - x) / (b2 - b1) / MB  # allocations x PART_KEYS
            self._lines = (x / MB - b1 * per_sample, per_sample)
            if self._fitted is not None:
                self._fitted(self.lines())
        return self._lines

    def lines(self) -> list:
        """(base, per_sample) as lists (JSON)."""
        return [a.tolist() for a in self._fit()]

    def values(self, batch: int) -> np.ndarray:
        """The parts (MB) after every allocation for `batch` samples."""
        first = self._lines is None and not any(b >= TRACED_BATCHES[0] for b in self._traces)
        if batch in self._traces or batch < TRACED_BATCHES[0] or first:
            return self._trace(batch) / MB
        base, per_sample = self._fit()
        return base + batch * per_sample

    def parts(self, batch: int) -> dict[str, float]:
        """The parts at the peak for `batch` samples (every key of PART_KEYS)."""
        values = self.values(batch)
        return dict(zip(PART_KEYS, values[values.sum(axis=1).argmax()].tolist(), strict=True))

    def largest_batch(self, room: float) -> int:
        """The largest batch whose peak is within `room` MB (0 when none is, MAX_BATCH at most)."""
        for n in range(1, TRACED_BATCHES[0] + 1):  # up to the first traced batch size, one by one
            if self.values(n).sum(axis=1).max() > room:
                return n - 1
        base, slope = (a.sum(axis=1) for a in self._fit())
        grows = slope > 0
        if not grows.any():
            return MAX_BATCH
        return min(MAX_BATCH, math.floor(((room - base[grows]) / slope[grows]).min() + 1e-9))


def _shallow(model_config, layers: int):
    """The same model with only `layers` layers; None when its layers differ (per-layer `layer_types`)."""
    import copy

    config = copy.deepcopy(model_config)
    types = getattr(config, "layer_types", None)
    if types is not None:
        if len(set(types)) > 1:
            return None
        config.layer_types = types[:layers]
    config.num_hidden_layers = layers
    return config


def _shallow_pair(model_config, task: str = "classification") -> list | None:
    """The model at SHALLOW's two depths, when it is deep enough to be extrapolated from them (else None)."""
    if model_config.num_hidden_layers <= 2 * SHALLOW[-1]:
        return None
    configs = [_shallow(model_config, n) for n in SHALLOW]
    if None in configs or any(layer_stack(fake_model(c, "fp32", False, task)[1]) is None for c in configs):
        return None
    return configs


def _to_depth(a: np.ndarray, b: np.ndarray, depth: int) -> np.ndarray:
    """Values at SHALLOW's two depths, extrapolated along their line to `depth`."""
    (n1, n2) = SHALLOW
    return a + (depth - n1) / (n2 - n1) * (b - a)


@contextlib.contextmanager
def _stretches(model, tracker):
    """File the tracker's trace by stretch of a forward and backward pass, relative to the stack of layers:
    `before` it, the `bottom` and `top` layer's forward, the `head` (the layers above the stack, the loss and
    the start of backward), the `top` and `bottom` layer's backward, and `after` (what comes below the stack).
    A stretch runs the same operations at any depth, and what is alive in it grows by a fixed amount per
    layer. A layer in between never holds the peak: at any moment of its pass, what is alive is a fixed part
    plus the activations of the layers below it and the gradients of those above, largest at one end of the
    stack; it is filed as `middle` and left out."""
    from torch.utils._pytree import tree_leaves

    layers = layer_stack(model)
    last = len(layers) - 1
    backward = []  # set once backward reaches the stack: a checkpointed layer's recomputed forward moves nothing

    def stretch(phase: str, i: int) -> str:
        return f"{phase} bottom" if i == 0 else f"{phase} top" if i == last else "middle"

    def backward_from(i: int):
        def hook(grad):
            backward.append(i)
            tracker.enter(stretch("backward", i))

        return hook

    def before(module, args, kwargs):
        if not backward:
            i = module.plan_index
            tracker.enter(stretch("forward", i))
            hidden = args[0] if args else kwargs["hidden_states"]
            if i == 0 and hidden.requires_grad:  # its gradient: the bottom layer's backward is done
                hidden.register_hook(lambda grad: tracker.enter("after"))

    def after(module, args, output):
        if not backward:
            i = module.plan_index
            tree_leaves(output)[0].register_hook(backward_from(i))  # its gradient: layer i's backward starts
            if i == last:
                tracker.enter("head")

    handles = []
    for i, layer in enumerate(layers):
        layer.plan_index = i
        handles += [
            layer.register_forward_pre_hook(before, with_kwargs=True),
            layer.register_forward_hook(after),
        ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def profile(
    model_config,
    precision: str,
    checkpointing: bool,
    seq: int,
    names=INPUT_NAMES,
    store=None,
    cuda: bool = False,
    task: str = "classification",
    peft: str | None = None,
    unmasked: str = "none",
    stepped: tuple | None = None,
    held: bool = False,
) -> Profile:
    """The forward and backward pass's Profile for sequences of `seq` tokens of a job of `task` with the
    adapters `peft` (peft_settings; None: full fine-tuning) (cached: a sweep's plans of one model share it; in
    `store` too, a pipeline.cache.Store, where other processes find it), on a CUDA target when `cuda` (its
    attention kernels). Simulated at the batch sizes the Profile asks for (one, or two for its
    lines), and, for a deep model, at SHALLOW's depths, each trace then extrapolated to the model's depth: four
    passes of a 2- or 3-layer model plan an 8B one. `unmasked` (`unmasked_rows`): the batches whose model is
    fed no attention mask, none, one text's or all. `stepped`: (spec, cfg, their settings as a key) of an
    optimizer stepped inside backward (train.optimizer_in_backward): its state and steps in the pass, or, where
    its step cannot run on fake tensors, each gradient freed as it arrives. `held`: every gradient there from
    the start, summed into (a step's later batch, train.gradient_accumulation_steps > 1)."""
    key = (model_config.to_json_string(use_diff=False), precision, checkpointing, seq, names, cuda, task)
    key += () if peft is None else (peft,)  # (full fine-tuning's as before the adapters existed)
    key += (getattr(model_config, "_attn_implementation", None), unmasked)
    key += () if stepped is None else (stepped[2],)
    key += ("gradients held",) if held else ()
    if key not in _PROFILES:
        shallow = _shallow_pair(model_config, task)

        def trace_at(batch: int) -> np.ndarray:
            masked = unmasked == "none" or (unmasked == "one" and batch > 1)
            step = None if stepped is None else stepped[:2]
            run = functools.partial(
                _trace, cuda=cuda, task=task, peft=peft, masked=masked, stepped=step, held=held
            )
            if shallow is None:
                return run(model_config, precision, checkpointing, batch, seq, names, stretches=False)["pass"]
            a, b = (run(c, precision, checkpointing, batch, seq, names, stretches=True) for c in shallow)
            a.pop("middle", None), b.pop("middle", None)
            _check_aligned(a, b, f"depths {SHALLOW[0]} and {SHALLOW[1]}")
            depth = model_config.num_hidden_layers
            return np.concatenate([_to_depth(a[w], b[w], depth) for w in sorted(a)])

        if store is None:
            _PROFILES[key] = Profile(trace_at)
        else:  # the lines where another process fitted them; else each pass and the lines, once made, kept

            def kept(batch: int) -> list:
                return store.get(["pass", *key, batch], lambda: trace_at(batch).tolist())

            fitted = functools.partial(store.put, ["pass", *key])
            _PROFILES[key] = Profile(kept, store.find(["pass", *key]), fitted)
    return _PROFILES[key]


def _check_aligned(a: dict, b: dict, between: str) -> None:
    if a.keys() != b.keys() or any(len(a[w]) != len(b[w]) for w in a):
        raise RuntimeError(f"plan: the model's forward and backward run different operations at {between}")


def _trace(
    model_config,
    precision,
    checkpointing,
    batch,
    seq,
    names,
    stretches: bool,
    cuda: bool = False,
    task: str = "classification",
    peft: str | None = None,
    masked: bool = True,
    stepped: tuple | None = None,
    held: bool = False,
) -> dict[str, np.ndarray]:
    """One simulated forward and backward pass: the parts (bytes) after each allocation, by stretch; with
    `cuda`, attention, dropout and the autocast query as a CUDA GPU runs them (pipeline.cuda_kernels). A language model's logits are a part
    of their own (pipeline.memory.is_logits), as in a measured breakdown. Not `masked`: every row full, so that
    transformers drops the attention mask (`full_rows`). `stepped` (spec, cfg): each weight's
    optimizer stepped from its gradient's hook, the gradient freed there (`_stepped_in_backward`), with its
    state in place (step 2's pass); where its step does not run on fake tensors, the gradient freed alone.
    `held`: each trained weight's gradient there before the pass, which sums its gradient into it."""
    from pipeline.memory import KindPeak, logits_width

    mode, model = fake_model(model_config, precision, checkpointing, task, peft)
    inputs = _inputs(mode, batch, seq, names, task)
    hooks, inner = _stepped_in_backward(mode, model, *stepped, cuda) if stepped else ([], {})
    with mode:
        for p in model.parameters() if held else ():
            p.grad = torch.zeros_like(p) if p.requires_grad else None
    tracker = KindPeak(model, inputs.values(), vocab=logits_width(model))
    for optimizer in inner.values():
        tracker.file_state(optimizer)
    tracker.enter("before" if stretches else "pass")
    filed = _stretches(model, tracker) if stretches else contextlib.nullcontext()
    try:
        with mode, tracker, filed, cuda_kernels() if cuda else contextlib.nullcontext():
            with _autocast(precision), contextlib.nullcontext() if masked else full_rows():
                loss = model(**inputs).loss
            loss.backward()
        del loss
        return {
            w: np.array([[parts[k] for k in PART_KEYS] for parts in trace])
            for w, trace in tracker.trace.items()
        }
    finally:
        model.zero_grad(set_to_none=True)  # as the loops do after each step: the next one starts without
        for handle in hooks:
            handle.remove()


def offloaded_mb(build, model_config, task, batch, seq, names, cuda, precision, masked) -> float:
    """train.offload=activations: the host memory (MB) the saved activations of a pass take at their most, the
    end of its forward pass (pipeline.offload.HostBytes), on the fake model `build(config)` makes: at its own
    depth, or at SHALLOW's two depths and extrapolated to its own (each layer saves the same)."""
    held = []
    for config in _shallow_pair(model_config, task) or [model_config]:
        mode, model = build(config)
        inputs, counter = _inputs(mode, batch, seq, names, task), model.host_offload
        before = counter.peak = counter.live
        with mode, cuda_kernels() if cuda else contextlib.nullcontext(), _autocast(precision):
            with contextlib.nullcontext() if masked else full_rows():
                model(**inputs)
        held.append((counter.peak - before) / MB)
    return held[0] if len(held) == 1 else float(_to_depth(*held, model_config.num_hidden_layers))


def _stepped_in_backward(mode, model, spec, cfg, cuda: bool) -> tuple[list, dict]:
    """A job's optimizer stepped inside backward (pipeline.optimizers.in_backward), on the fake model: one per
    trainable weight, its state made by a first step (torch's `foreach` loop on a CUDA target, as torch picks
    there), then each stepped from its weight's post-accumulate-grad hook and the gradient freed; where its
    step does not run on fake tensors (bitsandbytes' kernels need real data; a compiled step is not tried),
    each gradient freed alone. The hooks' handles (to remove: the fake model is cached) and the optimizers."""
    from pipeline.optimizers.in_backward import per_parameter, step_and_free

    trained = [p for p in model.parameters() if p.requires_grad]
    try:
        if spec.compiles_step:
            raise NotImplementedError
        with mode:
            inner = per_parameter(spec, model, cfg)
            for p, optimizer in inner.items():
                for group in optimizer.param_groups:
                    if cuda and "foreach" in group and group["foreach"] is None:
                        group["foreach"] = True
                p.grad = torch.zeros_like(p)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    except Exception:  # noqa: BLE001 (a kernel that needs real data)
        model.zero_grad(set_to_none=True)
        return [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None)) for p in trained], {}
    hook = step_and_free(inner)
    return [p.register_post_accumulate_grad_hook(hook) for p in inner], inner


def optimizer_step(
    model_config,
    build,
    spec,
    cfg,
    cuda: bool,
    task: str = "classification",
    grid: tuple[int, int] = UPPER_GRID,
) -> tuple[dict | None, str]:
    """Parts (MB) at the peak of two optimizer steps (the first creates the state) with every gradient in
    place, of the fake model `build(config)` makes (pipeline.fake_model.FakeJob's), and how they were found;
    None when the step cannot run on fake tensors. For a CUDA target, its
    reductions' buffers are those of a GPU of `grid` (pipeline.cuda_reductions). A deep model's is
    extrapolated from SHALLOW's depths: weights, gradients and state grow by a fixed amount per layer, and the
    step's temporaries, those of the largest tensor or of all of them at once (`foreach`), by none or by that
    amount too."""
    # torchao's step is compiled: run under the tracker (a dispatch mode), dynamo would skip its function and
    # mark it never to be compiled again in this process, where find_batch_size=true then trains
    if spec.compiles_step:
        return None, "forward/backward simulated; optimizer step analytic (compiled step)"
    try:
        shallow = _shallow_pair(model_config, task)
        if shallow is None:
            at_peak = _optimizer_step(*build(model_config), spec, cfg, cuda, grid)
        else:
            a, b = (_optimizer_step(*build(c), spec, cfg, cuda, grid) for c in shallow)
            at_peak = _to_depth(a, b, model_config.num_hidden_layers)
        return dict(zip(PART_KEYS, (at_peak / MB).tolist(), strict=True)), "simulated"
    except Exception as err:  # a kernel that needs real data (bitsandbytes)
        return None, f"forward/backward simulated; optimizer step analytic ({type(err).__name__})"


def _optimizer_step(mode, model, spec, cfg, cuda: bool, grid) -> np.ndarray:
    from pipeline.memory import KindPeak

    with mode:
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    try:
        with mode:
            optimizer = spec.build(model, cfg)
        if cuda:  # torch's default on CUDA: the multi-tensor loop (temporaries for all weights at once)
            for group in optimizer.param_groups:
                if "foreach" in group and group["foreach"] is None:
                    group["foreach"] = True
        tracker = KindPeak(model)
        buffers = CudaReductionBuffers(grid) if cuda else contextlib.nullcontext()
        with mode, tracker, buffers:
            for _ in range(2):
                if cfg.train.max_grad_norm:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm)
                optimizer.step()
                tracker.file_state(optimizer)
        return np.array([tracker.at_peak[k] for k in PART_KEYS], dtype=float)
    finally:
        model.zero_grad(set_to_none=True)


def analytic_step(model, state_bytes: int, spec) -> dict[str, float]:
    """The optimizer step's parts from the exact state estimate and the spec's stated temporaries."""
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    sizes = [(p.numel(), p.element_size()) for p in model.parameters() if p.requires_grad]
    trainable = [n * size for n, size in sizes]
    per_largest, per_all = spec.step_temporaries
    if spec.step_in_fp32:  # torchao: fp32 temporaries, and one more (the fp32 copy of a 16-bit weight)
        largest = max(4 * n * (per_largest + (size < 4)) for n, size in sizes)
        temporaries = largest + per_all * 4 * sum(n for n, _ in sizes)
    else:
        temporaries = per_largest * max(trainable) + per_all * sum(trainable)
    return {
        "params": weights / MB,
        "grads": sum(trainable) / MB,
        "optimizer": state_bytes / MB,
        "activations": 0.0,
        "logits": 0.0,
        "other": temporaries / MB,
    }


def simulate(
    model_config,
    spec,
    cfg,
    batch: int,
    seq: int,
    cuda: bool = False,
    names=INPUT_NAMES,
    store=None,
    grid: tuple[int, int] | None = None,
) -> dict:
    """The predicted peak and its parts (MB) for one training step of `batch` x `seq` tokens of the job's task
    (`cfg.task.name`), the optimizer step's own peak, the state, how the step was found, the fake model, the
    pass's Profile and the vocabulary of its LM head (`vocab`, None for a classifier, whose parts have no
    `logits`). `state` is the state the device's allocator holds, `paged` the rest (MB). `cuda`: for a CUDA
    target (pipeline.cuda_kernels' kernels, the `foreach` step, cuBLAS's workspaces, its reductions' buffers,
    a paged optimizer's paged state held outside the allocator); `grid`: that GPU's multiprocessors and threads per multiprocessor, which size the
    reductions' buffers (pipeline.cuda_reductions.grid_for; None: UPPER_GRID, an upper bound on the named
    GPUs'); `store` (a pipeline.cache.Store): where the pass and the optimizer step are kept for other
    processes."""
    from pipeline import optimizers
    from pipeline.memory import logits_width

    precision, task = cfg.train.precision, cfg.task.name
    checkpointing = bool(cfg.train.get("gradient_checkpointing", False))
    unmasked = unmasked_rows(cfg, model_config)
    in_backward = bool(cfg.train.get("optimizer_in_backward"))  # its step inside the pass, one per weight
    base = optimizers.spec_for(cfg.optim) if in_backward else None  # (`spec` then steps inside backward)
    # the optimizer step does not depend on the batch: a sweep over batch sizes simulates it once
    rate = [cfg.train.lr, cfg.train.get("lr_scale", 1.0)]  # (the peak learning rate they make)
    settings = json.dumps(
        [spec.name, OmegaConf.to_container(cfg.optim), *rate, cfg.train.weight_decay]
        + [optimizers.source_stamp(cfg)]  # a class of one's own: its file as it is now
    )
    job = job_model(
        model_config, cfg
    )  # with its adapters' settings (peft=lora / qlora; None: full fine-tuning)
    peft, model = job.peft, job.model
    vocab = logits_width(model)
    params = optimizers.param_infos(model)
    whole, outside = spec.held_estimate(params, cfg, spec.variant(cfg.backend.name, cfg), model.config, cuda)
    state, paged = (whole.bytes - outside.bytes) / MB, outside.bytes / MB  # on CUDA paged state is not held
    on_host = cfg.train.get("offload") == "optimizer"  # the state and its step on the host (in `host`)
    paged = 0.0 if on_host else paged  # (held outside the device as a paged one's is, but not paged)
    args = (store, cuda, task, peft, unmasked, (base, cfg, settings) if in_backward else None)
    # a step of several batches: the later ones run with every gradient held (the first without: less)
    held = cfg.train.get("gradient_accumulation_steps", 1) > 1
    steps = profile(model_config, precision, checkpointing, seq, names, *args, held)
    host = None  # train.offload=activations: what the pass holds on the host
    if getattr(model_config, "offload_activations", False):
        masked = unmasked == "none" or (unmasked == "one" and batch > 1)
        host = offloaded_mb(job.build, model_config, task, batch, seq, names, cuda, precision, masked)
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    if on_host:  # the state, and a host copy of each trained weight and its gradient (pipeline.offload)
        host = (whole.bytes + 2 * trained) / MB
    fb = reported(steps.parts(batch), vocab)
    # step 2's pass holds the state and makes each step: no step over all gradients (a step that cannot run on
    # fake tensors leaves the pass without state: below)
    if in_backward and fb["optimizer"] > 0:
        step, method, at_fb = fb, "simulated (each weight's step inside backward)", fb
    elif in_backward:  # each gradient freed in the pass; the state, and one weight's step, beside it
        largest = max(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        one_step = sum(base.step_temporaries) * largest / MB
        at_fb = {**fb, "optimizer": state, "other": fb["other"] + one_step}
        step, method = at_fb, "forward/backward simulated; each weight's step inside backward analytic"
    elif on_host:  # the device's step: each gradient copied out, each weight copied back in place
        weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        step = {**dict.fromkeys(fb, 0.0), "params": weights / MB, "grads": trained / MB}
        at_fb, method = fb, "forward/backward simulated; the optimizer's step on the host"
    else:
        grid = tuple(grid or UPPER_GRID) if cuda else None  # the reductions' buffers: a GPU's step only
        key = (model.plan_key, settings, cfg.train.max_grad_norm, cfg.backend.name, cuda, grid)
        if key not in _OPTIMIZER_STEP:

            def step() -> list:
                return list(optimizer_step(job.config, job.weights, spec, cfg, cuda, task, grid))

            _OPTIMIZER_STEP[key] = step() if store is None else store.get(["optimizer step", *key], step)
        step, method = _OPTIMIZER_STEP[key]
        step = reported(analytic_step(model, whole.bytes, spec) if step is None else step, vocab)
        step = {**step, "optimizer": step["optimizer"] - paged}
        at_fb = {**fb, "optimizer": state}  # step 2's forward/backward: step 1's with the state in place
    parts = at_fb if sum(at_fb.values()) >= sum(step.values()) else step
    extra = cublas_workspaces_mb(cfg.get("device_memory")) if cuda else 0.0
    parts = {**parts, "other": parts["other"] + extra}
    return {
        "parts": parts,
        "peak": sum(parts.values()),
        "state": state,
        "paged": paged,
        "estimate": whole.bytes / MB,  # the whole state, wherever it is held
        "step_peak": sum(step.values()) + extra,
        "method": method,
        "step": step,
        "model": model,
        "profile": steps,
        "vocab": vocab,
        "workspaces": extra,
        "host": host,  # (MB; None where nothing is offloaded)
        # what the pass's Profile leaves out and the device holds beside it (largest_batch)
        "beside_pass": sum(at_fb.values()) - sum(fb.values()) + extra,
    }


@contextlib.contextmanager
def full_rows():
    """Within it, transformers decides on SDPA's mask as for a batch whose attention mask is all ones: none
    where it needs no other pattern (a sliding window shorter than the sequence does), SDPA then causal (or
    bidirectional) without one. It reads a real mask's values to decide; a fake tensor's it cannot, and keeps
    the mask."""
    from transformers import masking_utils

    causal, bidirectional = (
        masking_utils._ignore_causal_mask_sdpa,
        masking_utils._ignore_bidirectional_mask_sdpa,
    )

    def ones_causal(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        # (a training step's queries start at position 0: no cache)
        return causal(None, q_length, kv_length, 0, kv_offset, local_attention_size)

    def ones_bidirectional(padding_mask, kv_length, local_attention_size=None):
        return bidirectional(None, kv_length, local_attention_size)

    masking_utils._ignore_causal_mask_sdpa = ones_causal
    masking_utils._ignore_bidirectional_mask_sdpa = ones_bidirectional
    try:
        yield
    finally:
        masking_utils._ignore_causal_mask_sdpa = causal
        masking_utils._ignore_bidirectional_mask_sdpa = bidirectional


def unmasked_rows(cfg, model_config) -> str:
    """Which batches' attention masks are all ones, so that transformers gives SDPA none (`full_rows`: torch's
    flash kernel on CUDA): `all` (packing's full blocks; flash_attention_2, planned as that kernel), `one` (a
    batch of one text padded to its own length: train.padding=longest) or `none` (padded rows assumed)."""
    if cfg.train.get("packing") or getattr(model_config, "_attn_implementation", None) == "flash_attention_2":
        return "all"
    return "one" if cfg.train.get("padding", "longest") == "longest" else "none"


def reported(parts: dict[str, float], vocab: int | None) -> dict[str, float]:
    """The parts a plan reports: a language model's (`vocab`: its LM head's) all of them, a classifier's all
    but `logits`, which it has none of."""
    return parts if vocab is not None else {k: v for k, v in parts.items() if k != "logits"}


def largest_batch(prediction: dict, budget: float) -> int:
    """Largest batch whose predicted peak fits `budget` MB (0 when none does): the forward/backward pass's
    Profile, with the state (and a CUDA target's workspaces) beside it, at the largest batch that keeps every
    allocation's total within the budget; the optimizer step does not depend on the batch."""
    if prediction["step_peak"] > budget:
        return 0
    fixed = prediction["beside_pass"]
    return prediction["profile"].largest_batch(budget - fixed)
