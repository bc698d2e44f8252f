"""Bring your own: `optim=custom optim.target=<module.Class>` builds any torch.optim.Optimizer subclass with
the usual parameter groups, on both backends. It has no analytic model: its estimate is the meta-device step
(`meta_estimate`), which builds the optimizer over a model of meta tensors, steps it once and sizes the state
it made; `bench/optimizer_table.py` and the tests run it for the registered optimizers too."""

from __future__ import annotations

from omegaconf import OmegaConf

from pipeline import StateSize, learning_rate
from pipeline.optimizers.in_backward import step_without_backward
from pipeline.optimizers.spec import OptimizerSpec, param_groups

# --- the target class and its arguments -------------------------------------------------------------------


def custom_class(cfg):
    """The optimizer class `optim.target` names ("module.Class"); ValueError with one line when it cannot be
    imported or is no torch.optim.Optimizer subclass."""
    import importlib

    import torch

    target = cfg.optim.target
    module_name, _, class_name = str(target).rpartition(".")
    if not module_name:
        raise ValueError(f"optim.target={target!r} is invalid: give module.Class (e.g. torch.optim.AdamW)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"optim.target={target!r} is invalid: cannot import {module_name} ({err}); "
            "a local file must be on PYTHONPATH"
        ) from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ValueError(f"optim.target={target!r} is invalid: {module_name} has no {class_name}")
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"optim.target={target!r} is invalid: not a torch.optim.Optimizer subclass")
    return cls


def source_stamp(cfg) -> list:
    """What tells the file that defines `optim.target`'s class apart from an edited one (pipeline.cache's file
    stamp): in the plan cache's keys, so that a step simulated with the class's old code is never reused. []
    for an optimizer without a target, or a class without a source file."""
    import inspect

    from omegaconf import OmegaConf

    from pipeline import cache

    if not OmegaConf.select(cfg, "optim.target"):
        return []
    try:
        path = inspect.getsourcefile(custom_class(cfg))
    except (TypeError, ValueError):  # a class built in C, or a target that cannot be imported (its job says)
        return []
    return cache.file_stamp(path) if path else []


def custom_kwargs(cfg) -> dict:
    from omegaconf import OmegaConf

    kwargs = OmegaConf.to_container(cfg.optim.kwargs, resolve=True) if cfg.optim.kwargs else {}
    # YAML lists where constructors expect tuples (betas)
    return {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}


def check_custom(cfg) -> None:
    """optim=custom: the target imports, is an optimizer, and takes these kwargs (ValueError, one line)."""
    import inspect

    cls = custom_class(cfg)
    kwargs = custom_kwargs(cfg)
    if "lr" in kwargs or "params" in kwargs:
        raise ValueError(
            "optim.kwargs is invalid: the learning rate is train.lr and params come from the model"
        )
    try:
        inspect.signature(cls).bind([], lr=1.0, **kwargs)
    except TypeError as err:
        raise ValueError(f"optim.kwargs={kwargs} is invalid for {cfg.optim.target}: {err}") from None


def build_custom(model, cfg):
    cls = custom_class(cfg)
    return cls(param_groups(model, cfg.train.weight_decay), lr=learning_rate(cfg), **custom_kwargs(cfg))


# --- the meta-device estimate -----------------------------------------------------------------------------


class MetaStepFailed(RuntimeError):
    """The optimizer's step cannot run on meta tensors (it reads values or calls a device kernel)."""


def meta_copy(model):
    """The model with every parameter replaced by a meta-device tensor of its shape and dtype (no memory)."""
    import copy

    import torch

    memo = {
        id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for p in model.parameters()
    }
    return copy.deepcopy(model, memo)


def meta_model(model_config, itemsize: int, task: str = "classification"):
    """The job's model of this config (a sequence classifier, or for task=causal_lm the decoder with its LM
    head) built on the meta device, in the dtype its weights have."""
    import torch

    from pipeline.models import auto_class

    dtype = {2: torch.bfloat16, 4: torch.float32}[itemsize]
    with torch.device("meta"):
        return auto_class(task).from_config(model_config, dtype=dtype)


def meta_estimate(spec: OptimizerSpec, cfg, model) -> StateSize:
    """The state an optimizer creates in one step, found with no memory at any model size: the registry's
    `build` on a model whose parameters are meta-device tensors, one `step()` with meta gradients, and the
    state it made sized from shapes and dtypes as `pipeline.state.optimizer_state_size` counts it (each storage
    once, Python scalars as their tensor dtype). MetaStepFailed, with why, when the step cannot run on meta
    (it reads a value, e.g. `.item()`, or calls a kernel that has no meta implementation)."""
    import torch

    from pipeline.state import optimizer_state_size

    if spec.needs_cuda:  # AdaLomo puts its state on the GPU whatever its parameters' device
        raise MetaStepFailed(f"the optimizer cannot be built on meta tensors ({spec.needs_cuda})")
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.empty_like(p)
    try:
        optimizer = spec.build(model, cfg)
        if spec.needs_train_eval_mode:  # schedule-free: steps in train mode, as both backends run it
            optimizer.train()
        step_without_backward(spec, optimizer)  # (those that update in backward: what their hooks do)
    except Exception as err:  # noqa: BLE001 (reported as the reason there is no estimate)
        text = str(err).strip().splitlines()
        why = f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__
        raise MetaStepFailed(f"the optimizer step cannot run on meta tensors ({why})") from None
    finally:
        for p in model.parameters():
            p.grad = None
    return optimizer_state_size(optimizer)


def estimate_custom(params, cfg, variant=None, model_config=None) -> StateSize:
    """optim=custom: no analytic model, the meta-device step on the model its config describes (with its
    adapters under peft=lora / qlora: the trainable parameters are the same on an unquantized base)."""
    from pipeline import adapters

    task = OmegaConf.select(cfg, "task.name", default="classification")
    model = meta_model(model_config, params[0].itemsize, task)
    if adapters.name(cfg) != "none":
        model = adapters.apply(model, cfg.peft, task, model_config.model_type, "meta", quantized=False)
    return meta_estimate(CUSTOM, cfg, model)


# --- the registry's row -----------------------------------------------------------------------------------

CUSTOM = OptimizerSpec(name="custom", build=build_custom, estimate=estimate_custom)  # no Trainer string

ENTRIES = [CUSTOM]
