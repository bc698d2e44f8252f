"""The model a plan simulates: the job's model built on fake tensors (torch's FakeTensorMode: shapes, dtypes and
devices, no data, no memory), from its architecture, in its dtypes, with its adapters where it has any, as a job
builds it (pipeline.models.build, pipeline.adapters.apply). pipeline.plan_step runs its training step."""

from __future__ import annotations

import contextlib
import copy
import functools
import json
from typing import NamedTuple

import torch
from omegaconf import OmegaConf


def fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def layer_stack(model):
    """The model's stack of layers (a torch ModuleList), or None: the module list as long as
    `config.num_hidden_layers`, all of one class."""
    depth = model.config.num_hidden_layers
    for module in model.modules():
        if (
            isinstance(module, torch.nn.ModuleList)
            and len(module) == depth
            and len({type(m) for m in module}) == 1
        ):
            return module
    return None


@functools.lru_cache(maxsize=8)
def _fake_model(
    config_json: str,
    attn: str | None,
    precision: str,
    checkpointing: bool,
    task: str,
    peft: str | None = None,
):
    """The model a job of `task` would train, built on fake tensors (cached: a sweep plans one model many
    times); with `peft` (memory_settings as JSON), wrapped in its adapters as a job wraps it."""
    from transformers import AutoConfig

    from pipeline import adapters, offload
    from pipeline.models import auto_class, chunk_the_loss

    values = json.loads(config_json)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    mode = fake_mode()
    # flash_attention_2 (CUDA and its package) is planned as SDPA fed no mask: torch's flash kernel, its saved tensors
    kwargs = {"attn_implementation": "sdpa" if attn == "flash_attention_2" else attn} if attn else {}
    # bf16 weights under bf16_pure, no fp32 copy; with adapters the base in its own dtype (adapters.dtypes,
    # resolved in `peft`): built so, as fake tensors cannot be cast
    base = (
        json.loads(peft)["base_dtype"] if peft is not None else "bf16" if precision == "bf16_pure" else "fp32"
    )
    if base != "fp32":
        kwargs["dtype"] = adapters.torch_dtype(base)
    with mode:
        model = auto_class(task).from_config(config, **kwargs)
        chunk_the_loss(model)  # config.loss_chunks, where a job sets it
        if peft is not None:
            model = _with_adapters(model, json.loads(peft), task)
        offload.install(model)  # config.offload_activations, likewise (around the adapters' forward too)
    if checkpointing:  # as both backends turn it on (on the adapters' model, as a job does)
        from pipeline.backends import enable_checkpointing

        enable_checkpointing(model)
    # what the caches below are keyed by (full fine-tuning's as before the adapters existed)
    model.plan_key = (config_json, attn, precision, checkpointing, task) + (() if peft is None else (peft,))
    return mode, model.train()


def _with_adapters(model, settings: dict, task: str):
    """A fake model as adapters.apply makes a job's (models.build): QLoRA's base Linear layers quantized to 4 bits
    by bitsandbytes' own quantization (on its fake kernels: adapters.quantize), LoRA's adapters by peft, which
    also sets what trains (the adapters, a classifier's head as a trainable copy beside the frozen one) and
    what is frozen. `alpha` is not among the settings (memory_settings): it scales the adapters'
    output by a number, whatever its value. A 4-bit layer's bias is in its compute dtype already: bitsandbytes
    converts it in place at the layer's first forward, so a job's model is in that state from its second
    forward on, and every simulated pass of this model (the cache keeps it between passes) alike."""
    from pipeline import adapters

    settings = OmegaConf.create({"alpha": settings["r"], **settings})
    with _assigned_conversions(), _cloned_copies():
        trained = adapters.torch_dtype(settings.adapter_dtype)
        model = adapters.apply(model, settings, task, model.config.model_type, trained_dtype=trained)
    for layer in model.modules():
        bias, dtype = getattr(layer, "bias", None), getattr(layer, "compute_dtype", None)
        if adapters.is_4bit(getattr(layer, "weight", None)) and bias is not None and dtype is not None:
            bias.data = bias.data.to(dtype)
    return model


@contextlib.contextmanager
def _cloned_copies():
    """Within it, a deepcopy of a fake tensor (peft's trainable copy of a classifier's head) is its clone, a
    fake tensor of its own. Torch's own deepcopy reads a tensor's data pointer, which a fake tensor lacks, and
    copies its storage by hand: the copies it made corrupted the heap, and the process crashed at exit."""
    from torch._subclasses.fake_tensor import FakeTensor

    def clone(tensor, memo):
        if id(tensor) not in memo:
            memo[id(tensor)] = tensor.clone()
        return memo[id(tensor)]

    FakeTensor.__deepcopy__ = clone
    try:
        yield
    finally:
        del FakeTensor.__deepcopy__  # torch.Tensor's again


@contextlib.contextmanager
def _assigned_conversions():
    """Within it, `Module.to` on a module of fake tensors (peft moves each new adapter to its base layer's
    device and dtype) assigns the converted parameters and buffers, as torch's `_apply` does for a real
    tensor whose type the conversion keeps; for a fake one torch swaps the tensors in place instead, which the
    fake mode's weak reference to each fake tensor forbids. Other modules convert as torch converts them."""
    from torch._subclasses.fake_tensor import FakeTensor

    original = torch.nn.Module._apply

    def _apply(module, fn, recurse=True):
        own = [*module._parameters.values(), *module._buffers.values()]
        if not any(isinstance(t, FakeTensor) for t in own):
            return original(module, fn, recurse)
        if recurse:
            for child in module.children():
                child._apply(fn)
        for key, param in module._parameters.items():
            if param is not None:
                with torch.no_grad():
                    converted = fn(param)
                if converted is not param:
                    module._parameters[key] = torch.nn.Parameter(converted, requires_grad=param.requires_grad)
        for key, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[key] = fn(buffer)
        return module

    torch.nn.Module._apply = _apply
    try:
        yield
    finally:
        torch.nn.Module._apply = original


# the keys a method reads that change nothing in a training step's memory: alpha scales the adapters' output by
# a number, whatever its value; the adapter is saved after training
NO_MEMORY = ("alpha", "save_adapter")


def memory_settings(cfg) -> dict | None:
    """The adapters' settings that change a training step's memory (what a plan's cache key holds of them):
    `name` and the keys its method reads (`used`) less NO_MEMORY; dropout among them (a nonzero one keeps a
    mask for backward). None for full fine-tuning."""
    from pipeline import adapters, models

    if OmegaConf.select(cfg, "peft.name", default="none") == "none":  # (a config from before the peft group)
        return None
    base, trained = models.dtypes(cfg)  # `auto` as the precision resolves it
    peft = adapters.used(OmegaConf.to_container(cfg.peft, resolve=True))
    return {
        **{k: v for k, v in peft.items() if k not in NO_MEMORY},
        "base_dtype": base,
        "adapter_dtype": trained,
    }


def peft_settings(cfg) -> str | None:
    """The adapters' settings that change a step's memory (memory_settings) as a key: None for full
    fine-tuning, whose keys stay as they were before the adapters existed."""
    settings = memory_settings(cfg)
    return None if settings is None else json.dumps(settings, sort_keys=True)


def fake_model(
    model_config, precision: str, checkpointing: bool, task: str = "classification", peft: str | None = None
):
    """(fake mode, model) for a transformers config (a real model's `config`, or one built from a yaml), built
    as a job of `task` builds it, with the adapters `peft` (peft_settings) where there are any."""
    attn = getattr(model_config, "_attn_implementation", None)
    config_json = model_config.to_json_string(use_diff=False)
    return _fake_model(config_json, attn, precision, checkpointing, task, peft)


class FakeJob(NamedTuple):
    """The fake model of a job (`job_model`): its adapters' settings as a key (peft_settings), its weights at
    the job's depth (`model`: what the pass alone changes left out, `weights_of`), `build(config)`: (fake mode,
    model) of another depth of it, built as the job trains it, and `weights(config)`: the same, as `model`."""

    peft: str | None
    model: object
    build: object
    weights: object
    config: object  # `model`'s config: the job's, less what changes the pass alone (`weights_of`)


# what a config carries for the forward and backward pass alone (pipeline.plan_job.planned_config): the weights
# and the optimizer's step are the same without it
PASS_ONLY = ("loss_chunks", "offload_activations")


def weights_of(model_config):
    """`model_config` without what changes the pass alone: plans that differ only there (checkpointing, a
    chunked loss, offloaded activations) share one model and one optimizer step."""
    if not any(hasattr(model_config, key) for key in PASS_ONLY):
        return model_config
    config = copy.deepcopy(model_config)
    for key in PASS_ONLY:
        if hasattr(config, key):
            delattr(config, key)
    return config


def job_model(model_config, cfg) -> FakeJob:
    """The job's model on fake tensors as `cfg` trains it: its precision, checkpointing, task and adapters."""
    config = weights_of(model_config)
    peft = peft_settings(cfg)
    checkpointing = bool(cfg.train.get("gradient_checkpointing", False))
    settings = {"precision": cfg.train.precision, "task": cfg.task.name, "peft": peft}
    build = functools.partial(fake_model, **settings, checkpointing=checkpointing)
    weights = functools.partial(fake_model, **settings, checkpointing=False)
    return FakeJob(peft, weights(config)[1], build, weights, config)
