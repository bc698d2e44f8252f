"""Plan before you train: the peak memory of a training step, predicted by running that very step on fake
tensors (torch's FakeTensorMode: shapes, dtypes and devices, no data and no memory), so a model of any size
is planned in seconds from its architecture alone.

What runs is what a job runs: the model class transformers builds from the config (its attention
implementation, blocks, tied or untied embeddings), autocast for bf16/fp16, bf16 weights for bf16_pure,
gradient checkpointing, and the optimizer's own step (torch's per-tensor loop on CPU, its `foreach` loop for a
CUDA target, as torch picks by default there). A storage tracker (PyTorch's MemTracker, as the step-2
breakdown of a training job) follows every tensor's lifetime, so the parts are the same as a measured
breakdown. An optimizer whose step cannot run on fake tensors (bitsandbytes' and torchao's kernels) gets its
exact analytic state and its stated step temporaries instead (tag `plan_method`).

    peak = max(forward/backward peak + optimizer state,  optimizer-step peak)

The forward/backward of step 2 is that of step 1 with the state in place; the optimizer step's peak holds
the weights, every gradient, the state and the step's temporaries. The forward/backward part is linear in the
batch size (activations), so the largest batch that fits follows from two batch sizes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math

import torch
from omegaconf import OmegaConf

from pipeline import MB

# CUDA targets: what the allocator holds that no tensor does, stated (not measured here): one cuBLAS workspace
# per handle (forward, autograd's backward thread), 32 MiB + 1 MiB (cuBLASLt) on Hopper, as torch sizes them
CUBLAS_WORKSPACES_MB = 2 * 33
CUDA_CONTEXT_MB = 512  # CUDA context + kernels: outside the allocator, stated (typically 300-600 MiB)
# Named GPUs: memory as the data sheet states it ("80GB" read as 80 GiB); usable = that - CUDA_CONTEXT_MB
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
}
PART_KEYS = ("params", "grads", "optimizer", "activations", "other")
MAX_BATCH = 2**20  # the largest batch a plan reports


def usable_mb(device: str) -> float:
    """What a named GPU leaves to the caching allocator: its memory less the CUDA context."""
    return DEVICE_MEMORY_GB[device] * 1024 - CUDA_CONTEXT_MB


def fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


@functools.lru_cache(maxsize=8)
def _fake_model(config_json: str, attn: str | None, precision: str, checkpointing: bool):
    """The model a job would train, built on fake tensors (cached: a sweep plans one model many times)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    values = json.loads(config_json)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    mode = fake_mode()
    kwargs = {"attn_implementation": attn} if attn else {}
    if precision == "bf16_pure":  # bf16 weights, no fp32 copy (built so: fake tensors cannot be cast)
        kwargs["dtype"] = torch.bfloat16
    with mode:
        model = AutoModelForSequenceClassification.from_config(config, **kwargs)
    if checkpointing:  # as both backends turn it on
        from pipeline.backends import enable_checkpointing

        enable_checkpointing(model)
    model.plan_key = (config_json, attn, precision, checkpointing)  # what the caches below are keyed by
    return mode, model.train()


def fake_model(model_config, precision: str, checkpointing: bool):
    """(fake mode, model) for a transformers config (a real model's `config`, or one built from a yaml)."""
    attn = getattr(model_config, "_attn_implementation", None)
    return _fake_model(model_config.to_json_string(use_diff=False), attn, precision, checkpointing)


def _autocast(precision: str):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    return torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()


def _parts(tracker) -> dict[str, float]:
    return {k: tracker.at_peak[k] / MB for k in PART_KEYS}


INPUT_NAMES = ("input_ids", "attention_mask")  # what a tokenizer gives at the least


@functools.cache
def _inputs(mode, batch: int, seq: int, names: tuple[str, ...]):
    """A batch as the collator makes it: the tokenizer's inputs (a BERT tokenizer adds token_type_ids, which
    GPT-2, for one, embeds with its token embedding) and the labels."""
    with mode:
        fill = {"token_type_ids": torch.zeros}
        inputs = {name: fill.get(name, torch.ones)(batch, seq, dtype=torch.long) for name in names}
        return {**inputs, "labels": torch.zeros(batch, dtype=torch.long)}


_FORWARD_BACKWARD: dict[tuple, dict[str, float]] = {}  # a sweep's plans share them: no optimizer involved
_OPTIMIZER_STEP: dict[tuple, tuple] = {}


def forward_backward(
    model, mode, batch: int, seq: int, precision: str, names=INPUT_NAMES
) -> dict[str, float]:
    """Parts (MB) at the peak of one forward and backward pass on a batch of `batch` x `seq` tokens (cached
    per model and shape: a sweep's plans share them, no optimizer is involved)."""
    from pipeline.memory import KindPeak

    key = (model.plan_key, batch, seq, names)
    if key not in _FORWARD_BACKWARD:
        inputs = _inputs(mode, batch, seq, names)
        tracker = KindPeak(model, inputs.values())
        try:
            with mode, tracker:
                with _autocast(precision):
                    loss = model(**inputs).loss
                loss.backward()
            del loss
            _FORWARD_BACKWARD[key] = _parts(tracker)
        finally:
            model.zero_grad(set_to_none=True)  # as the loops do after each step: the next one starts without
    return _FORWARD_BACKWARD[key]


def optimizer_step(model, mode, spec, cfg, cuda: bool) -> tuple[dict[str, float] | None, str]:
    """Parts (MB) at the peak of two optimizer steps (the first creates the state) with every gradient in
    place, and how they were found; None when the step cannot run on fake tensors."""
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
        with mode, tracker:
            for _ in range(2):
                if cfg.train.max_grad_norm:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm)
                optimizer.step()
                tracker.file_state(optimizer)
        return _parts(tracker), "simulated"
    except Exception as err:  # a kernel that needs real data (bitsandbytes, torchao's compiled step)
        return None, f"forward/backward simulated; optimizer step analytic ({type(err).__name__})"
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
        "other": temporaries / MB,
    }


def simulate(model_config, spec, cfg, batch: int, seq: int, cuda: bool = False, names=INPUT_NAMES) -> dict:
    """The predicted peak and its parts (MB) for one training step of `batch` x `seq` tokens, the optimizer
    step's own peak, the state, how the step was found, and the fake model (for `largest_batch`)."""
    from pipeline import optimizers

    precision = cfg.train.precision
    checkpointing = bool(cfg.train.get("gradient_checkpointing", False))
    mode, model = fake_model(model_config, precision, checkpointing)
    params = optimizers.param_infos(model)
    state = spec.estimate(params, cfg, spec.variant(cfg.backend.name), model.config).bytes / MB
    fb = forward_backward(model, mode, batch, seq, precision, names)
    # the optimizer step does not depend on the batch: a sweep over batch sizes simulates it once
    settings = json.dumps(
        [spec.name, OmegaConf.to_container(cfg.optim), cfg.train.lr, cfg.train.weight_decay]
    )
    key = (model.plan_key, settings, cfg.train.max_grad_norm, cfg.backend.name, cuda)
    if key not in _OPTIMIZER_STEP:
        _OPTIMIZER_STEP[key] = optimizer_step(model, mode, spec, cfg, cuda)
    step, method = _OPTIMIZER_STEP[key]
    if step is None:
        step = analytic_step(model, state * MB, spec)
    # step 2's forward/backward: step 1's with the state in place
    at_fb = {**fb, "optimizer": state}
    parts = at_fb if sum(at_fb.values()) >= sum(step.values()) else step
    extra = CUBLAS_WORKSPACES_MB if cuda else 0.0
    parts = {**parts, "other": parts["other"] + extra}
    return {
        "parts": parts,
        "peak": sum(parts.values()),
        "state": state,
        "step_peak": sum(step.values()) + extra,
        "method": method,
        "model": model,
        "mode": mode,
        "names": names,
    }


def largest_batch(
    prediction: dict, seq: int, precision: str, budget: float, start: int, cuda: bool = False
) -> int:
    """Largest batch whose predicted peak fits `budget` MB (0 when none does).

    Growing by 4x from `start` (the configured batch size) brackets the answer; then the secant between the
    bracket's ends, which cannot overshoot it (the forward/backward peak is convex in the batch size: the
    larger of the gradients' plateau at the end of backward and the activations' line at its start), or the
    midpoint when the secant stalls; when a third size lies on the bracket's line, the line gives the answer.
    Every size costs one simulated forward and backward (cached: a sweep's plans of one model share them).
    """
    model, mode = prediction["model"], prediction["mode"]
    fixed = prediction["state"] + (CUBLAS_WORKSPACES_MB if cuda else 0.0)
    peaks: dict[int, float] = {}

    def fits(n: int) -> bool:
        if n not in peaks:
            peaks[n] = sum(forward_backward(model, mode, n, seq, precision, prediction["names"]).values())
        return peaks[n] + fixed <= budget

    if prediction["step_peak"] > budget or not fits(1):
        return 0
    low, high = 1, None  # low fits, high does not
    n = max(1, start)
    while high is None and n <= MAX_BATCH:
        low, high = (n, None) if fits(n) else (low, n)
        n *= 4
    if high is None:
        return low
    below = [n for n in peaks if n < low]  # a third point on the same line: the bracket is on it, no search
    if below and _collinear((max(below), peaks[max(below)]), (low, peaks[low]), (high, peaks[high])):
        room = budget - fixed - peaks[low]
        return min(high - 1, low + math.floor(room * (high - low) / (peaks[high] - peaks[low])))
    while high - low > 1:
        slope = (peaks[high] - peaks[low]) / (high - low)
        guess = low + math.floor((budget - fixed - peaks[low]) / slope) if slope > 0 else low
        # the secant's crossing is a lower bound: at or below `low`, `low` is likely the answer (check the
        # next size); inside the bracket, try it; past it (rounding), bisect
        n = low + 1 if guess <= low else guess if guess < high else (low + high) // 2
        low, high = (n, high) if fits(n) else (low, n)
    return low


def _collinear(a, b, c, tolerance: float = 1e-9) -> bool:
    """Whether three (batch, MB) points lie on one line (the peak then grows linearly between them)."""
    left, right = (b[1] - a[1]) / (b[0] - a[0]), (c[1] - b[1]) / (c[0] - b[0])
    return abs(left - right) <= tolerance * max(abs(left), abs(right), 1e-12)


def budget_mb(cfg) -> float | None:
    """The memory a plan is checked against: memory_budget_mb, else what the named GPU leaves."""
    if cfg.memory_budget_mb is not None:
        return float(cfg.memory_budget_mb)
    return usable_mb(cfg.device_memory) if cfg.device_memory else None


def plan_result(cfg) -> dict:
    """The record of a plan job (`plan=true`): the predicted parts and peak of a training step at the
    configured batch size and `train.max_length`, whether it fits, and the largest batch that does."""
    import time

    from pipeline import models, optimizers, predict  # predict: the field's rules of thumb

    start = time.perf_counter()
    spec = optimizers.get(cfg.optim.name)
    config = models.model_config(cfg.model, num_labels=2)
    if config.pad_token_id is None:  # decoders classify from the last non-padding token
        config.pad_token_id = 0
    cuda = cfg.device_memory is not None or torch.cuda.is_available()
    seq = cfg.train.max_length
    names = tuple(models.load_tokenizer(cfg.model).model_input_names)  # the batch's tensors
    prediction = simulate(config, spec, cfg, cfg.batch_size, seq, cuda=cuda, names=names)
    model = prediction["model"]
    num_params = sum(p.numel() for p in model.parameters())
    metrics = {
        "model_num_params": num_params,
        "estimated_optimizer_state_mb": prediction["state"],
        "predicted_peak_mb": prediction["peak"],
        **{f"predicted_peak_{k}_mb": v for k, v in prediction["parts"].items()},
        "predicted_step_peak_mb": prediction["step_peak"],
        "accelerate_estimate_mb": predict.accelerate_estimate_mb(num_params, cfg.train.precision),
        "bytes_rule_mb": predict.bytes_rule_mb(num_params),
    }
    budget = budget_mb(cfg)
    if budget is not None:
        metrics["budget_mb"] = budget
        metrics["fits"] = float(prediction["peak"] <= budget)
        metrics["predicted_max_batch_size"] = largest_batch(
            prediction, seq, cfg.train.precision, budget, cfg.batch_size, cuda
        )
    metrics["plan_s"] = time.perf_counter() - start
    return {
        "metrics": metrics,
        "series": {},
        "params": {
            "device": f"cuda: {cfg.device_memory or 'this machine'} (planned)" if cuda else "cpu (planned)",
            "device_memory": cfg.device_memory,
        },
        "tags": {"mode": "plan", "plan_method": prediction["method"]},
    }
