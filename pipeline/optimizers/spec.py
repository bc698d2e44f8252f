"""The registry's row type and what every optimizer family shares.

- `OptimizerSpec`: one registered optimizer (how it is built on each backend, its analytic state estimate,
  what it needs); `Choice`: the registry's one answer for a job's config (`pipeline.optimizers.choose`);
- `ParamInfo` / `param_infos`: the parameter names, shapes and dtypes an estimate reads, and `size` / `total`
  / `factored` / `scalar_bytes` to add their state up to the byte;
- the Trainer's parameter groups (`param_groups`) that every builder uses;
- the settings plumbing: a config's settings (`settings`), the Trainer's `optim_args` string and Adam
  arguments, and what a built optimizer really holds (`built_settings`, the param `optim_settings`).

Torch and the optimizer packages are imported inside the functions, so the config can be validated before
any heavy import.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from math import prod
from typing import NamedTuple

from pipeline import StateSize

FP32, INT64 = 4, 8
EXTRA = "optim"  # the pyproject extra holding the optional optimizer packages
ZERO_AT_BUILD = "zero_at_build"  # attribute a Prodigy build sets on each parameter (see ParamInfo)
LOMO, LAYERWISE = "lomo", "layerwise"  # OptimizerSpec.in_backward


# --- parameters and sizes: all an estimate may look at ----------------------------------------------------


class ParamInfo(NamedTuple):
    name: str
    shape: tuple[int, ...]
    itemsize: int
    is_embedding: bool  # the weight of an nn.Embedding
    # all zero when the optimizer was built (Prodigy keeps a 0-d `p0` for such a parameter): recorded by the
    # build on the parameter itself (ZERO_AT_BUILD), False where no build recorded it
    zero_at_build: bool = False

    @property
    def numel(self) -> int:
        return prod(self.shape)


def param_infos(model) -> list[ParamInfo]:
    """Name, shape, element size and role of every trainable parameter (all an estimate may look at); of an
    FSDP shard (a DTensor), its local shape: the shard the optimizer steps."""
    from torch import nn

    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return [
        ParamInfo(
            n,
            tuple((p.to_local() if hasattr(p, "to_local") else p).shape),
            p.element_size(),
            id(p) in embedding_weights,
            getattr(p, ZERO_AT_BUILD, False),
        )
        for n, p in model.named_parameters()
        if p.requires_grad
    ]


def size(*parts: tuple[int, int]) -> StateSize:
    """StateSize from (numel, itemsize) parts."""
    return StateSize(sum(n for n, _ in parts), sum(n * s for n, s in parts))


def scalar_bytes(value) -> int:
    """Bytes of a Python scalar counted as the dtype torch.tensor gives it (bool 1, int 8, float 4)."""
    return 1 if isinstance(value, bool) else INT64 if isinstance(value, int) else FP32


def total(sizes) -> StateSize:
    sizes = list(sizes)
    return StateSize(sum(s.numel for s in sizes), sum(s.bytes for s in sizes))


def factored(shape) -> int:
    """Elements of the row + column statistics of a factored second moment (n + m for an n x m matrix)."""
    return prod(shape[:-1]) + prod(shape[:-2]) * shape[-1]


# --- the registry's row -----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """One name -> one implementation and settings, on both backends. Each entry gives
    - `build(model, cfg)`: the optimizer built directly (the Accelerator backend; and the Trainer backend when
      the Trainer has no `optim=` string for it, through `Trainer(optimizers=...)`);
    - `trainer_optim`: the Trainer's `optim=` string for the same optimizer, with `trainer_args(cfg)` for its
      extra TrainingArguments (a test checks both paths build the same class with the same settings); the
      settings that string's path cannot carry are in `trainer_fixed`: when a config changes one of them, the
      Trainer is handed `build`'s object instead (`trainer_string`), so a setting has the same effect on both
      backends;
    - `estimate(params, cfg, variant, model_config)`: the analytic state size from parameter names and shapes
      alone, which must equal the measured state to the byte;
    - `requires`: import names of the optional packages it needs (`pip install -e '.[optim]'`)."""

    name: str
    build: Callable  # (model, cfg) -> torch.optim.Optimizer
    estimate: Callable  # (list[ParamInfo], cfg, variant, model_config) -> StateSize
    trainer_optim: str | None = None
    trainer_args: Callable = lambda cfg: {}  # extra TrainingArguments for trainer_optim
    trainer_variant: str | None = None  # how the Trainer's version differs from `build`'s, if it does
    # settings (conf/optim keys) the Trainer's optim= path fixes at these values: it cannot be told others
    trainer_fixed: dict = field(default_factory=dict)
    # conf/optim keys added after its first runs, at the values every run before them used: a config hash
    # leaves them out at these values, so that a rerun still recognises the points recorded earlier
    # (pipeline.runner.config_hash; collected as ADDED_SETTINGS)
    added_settings: dict = field(default_factory=dict)
    requires: tuple[str, ...] = ()
    # on CUDA, the part of `estimate` the optimizer pages (unified memory the caching allocator never sees):
    # same arguments; None where it pages nothing
    paged_estimate: Callable | None = None
    needs_train_eval_mode: bool = False  # schedule-free: optimizer.train() / optimizer.eval()
    compiles_step: bool = False  # torchao: torch.compile'd step (incompatible with the CPU peak tracker)
    # what its step allocates at once, as (times the largest weight, times all weights): e.g. AdamW's
    # per-tensor step makes sqrt(exp_avg_sq) and its quotient for one weight at a time (pipeline.plan_step, where
    # the step cannot be simulated)
    step_temporaries: tuple[float, float] = (0.0, 0.0)
    step_in_fp32: bool = False  # its temporaries are fp32 whatever the weights' dtype (torchao upcasts)
    # updates inside the backward pass, no separate step: LOMO ("lomo": `fused_backward(loss, lr)`, driven by
    # accelerate's `backward(loss, learning_rate=...)`) or LAYERWISE (one optimizer per parameter, stepped from
    # a post-accumulate-grad hook); None: an ordinary `optimizer.step()` after backward
    in_backward: str | None = None
    needs_cuda: str | None = None  # why it cannot run without a CUDA device (one line), None when it can
    # why it cannot train adapters on a frozen base (peft=lora / qlora: one line), None when it can
    frozen_base: str | None = None
    # its rate multiplies a step size it estimates itself (Prodigy's D): a model with random weights keeps it
    # (pipeline.reference_lr)
    estimates_step_size: bool = False

    def held_estimate(self, params, cfg, variant, model_config, cuda: bool) -> tuple[StateSize, StateSize]:
        """(the whole state estimate, its part held outside the device's caching allocator): on CUDA what a
        paged optimizer pages, with train.offload=optimizer all of it (on the host), else nothing."""
        whole = self.estimate(params, cfg, variant, model_config)
        if cfg.train.get("offload") == "optimizer":
            return whole, whole
        outside = self.paged_estimate if cuda and self.paged_estimate is not None else None
        return whole, StateSize(0, 0) if outside is None else outside(params, cfg, variant, model_config)

    def trainer_string(self, cfg) -> str | None:
        """The Trainer's `optim=` string when its path builds this optimizer with the config's settings; None
        when it has none, or when a setting differs from what that path fixes (then the Trainer is handed
        `build`'s object, the one the Accelerator loop steps)."""
        if self.trainer_optim is None:
            return None
        chosen = settings(cfg)
        if any(chosen.get(key, value) != value for key, value in self.trainer_fixed.items()):
            return None
        return self.trainer_optim

    def variant(self, backend: str, cfg) -> str | None:
        """How the optimizer a backend builds differs from `build`'s (the Trainer's own `optim=` path)."""
        return self.trainer_variant if backend == "trainer" and self.trainer_string(cfg) else None

    def compiled_on(self, device_type: str) -> bool:
        """Whether its step runs compiled on this device type. torchao compiles its step (fullgraph); on CPU
        it runs eagerly instead (same math, same state): torch.compile cannot trace through the CPU peak
        tracker, a TorchDispatchMode. The backends apply this around their training loop."""
        return self.compiles_step and device_type == "cuda"


class Choice(NamedTuple):
    """The registry's answer for one job's config, asked once (`pipeline.optimizers.choose`) and handed on."""

    spec: OptimizerSpec
    # the Trainer's optim= string the job's Trainer backend uses; None: it is handed `spec.build`'s object
    # (and always None on the Accelerator backend, which builds that object itself)
    trainer_optim: str | None
    variant: str | None  # how the optimizer the job's backend builds differs from `build`'s (the estimate's)


# --- parameter groups -------------------------------------------------------------------------------------

# Trainer.get_decay_parameter_names' rule (a test checks it is the same): importing the Trainer for it would
# cost an Accelerator job about 3 s (transformers.trainer pulls torchao and more)
NO_DECAY_PATTERNS = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


def decay_parameter_names(model) -> list[str]:
    from torch import nn
    from transformers.trainer_pt_utils import get_parameter_names

    return get_parameter_names(model, [nn.LayerNorm], NO_DECAY_PATTERNS)


def param_groups(model, weight_decay: float) -> list[dict]:
    """The Trainer's grouping: weight decay on all weights but biases and LayerNorm."""
    decay = set(decay_parameter_names(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]


# --- settings: from the config to each backend, and back from the built object ----------------------------


def settings(cfg) -> dict:
    """The optimizer's settings from its conf/optim file (and overrides): every key but `name`, `lr` and
    `lr_tuned` (whether a tuning sweep picked that rate)."""
    from omegaconf import OmegaConf

    chosen = OmegaConf.to_container(cfg.optim, resolve=True)
    return {k: v for k, v in chosen.items() if k not in ("name", "lr", "lr_tuned")}


def optim_args(**values) -> str:
    """The Trainer's `optim_args` string: `key=value,...` (booleans as True / False, as it parses them)."""
    return ",".join(f"{k}={v}" for k, v in values.items())


# settings some optimizers keep outside `defaults`: torchao as attributes (the Trainer's path sets the flag to
# 0 / 1), bitsandbytes in `args`
ATTRIBUTE_SETTINGS = {"block_size": int, "bf16_stochastic_round": bool}
ARGS_SETTINGS = ("min_8bit_size", "optim_bits")


def built_settings(optimizer) -> str:
    """What an optimizer object was built with (its `defaults` and the settings kept beside them, plain values
    only) as JSON: the run's param `optim_settings`, to compare what each backend really ran."""
    inner = getattr(optimizer, "optimizer_dict", None)
    if inner:  # transformers' layer-wise dummy: the per-parameter optimizers hold the settings
        optimizer = next(iter(inner.values()))
    found = dict(optimizer.defaults)
    found.update(
        {k: kind(getattr(optimizer, k)) for k, kind in ATTRIBUTE_SETTINGS.items() if hasattr(optimizer, k)}
    )
    args = getattr(optimizer, "args", None)
    found.update({k: getattr(args, k) for k in ARGS_SETTINGS if hasattr(args, k)})
    plain = {}
    for key, value in sorted(found.items()):
        if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
            value = value.item()  # a tensor learning rate (torchao)
        if isinstance(value, (bool, int, float, str, type(None), tuple, list)):
            plain[key] = value
    return json.dumps(plain)


def adam_args(cfg) -> dict:
    """The TrainingArguments that carry betas and eps to the Trainer's optimizer."""
    betas = cfg.optim.betas
    return {"adam_beta1": betas[0], "adam_beta2": betas[1], "adam_epsilon": cfg.optim.get("eps", 1e-8)}
