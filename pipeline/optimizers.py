"""Optimizer registry: one name -> one implementation and settings, on both backends.

Each entry gives
- `build(model, cfg)`: the optimizer built directly (the Accelerator backend; and the Trainer backend when the
  Trainer has no `optim=` string for it, through `Trainer(optimizers=...)`);
- `trainer_optim`: the Trainer's `optim=` string for the same optimizer, with `trainer_args(cfg)` for its
  extra TrainingArguments (a test checks both paths build the same class with the same settings); the
  settings that string's path cannot carry are in `trainer_fixed`: when a config changes one of them, the
  Trainer is handed `build`'s object instead (`trainer_string`), so a setting has the same effect on both
  backends;
- `estimate(params, cfg, variant, model_config)`: the analytic state size from parameter names and shapes alone, which must
  equal the measured state to the byte;
- `requires`: import names of the optional packages it needs (`pip install -e '.[optim]'`).

Torch and the optimizer packages are imported inside the functions, so the config can be validated before
any heavy import.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from math import ceil, prod
from typing import NamedTuple

from pipeline import StateSize, learning_rate

FP32, INT64 = 4, 8
EXTRA = "optim"  # the pyproject extra holding the optional optimizer packages
BNB_MIN_8BIT_SIZE, BNB_BLOCK = 4096, 256  # bitsandbytes: smaller tensors keep 32-bit state; absmax per block
BNB_QMAP = 256  # bitsandbytes' quantization map (fp32), one per state kind, shared by every parameter
TORCHAO_MIN_SIZE = 4096  # torchao quantizes tensors of at least this size whose numel divides by the block
ZERO_AT_BUILD = "zero_at_build"  # attribute a Prodigy build sets on each parameter (see ParamInfo)
TRAINER_EMBEDDING_FP32 = (
    "trainer_embedding_fp32"  # the Trainer's bnb 8-bit path keeps nn.Embedding state fp32
)


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
    """Name, shape, element size and role of every trainable parameter (all an estimate may look at)."""
    from torch import nn

    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return [
        ParamInfo(
            n, tuple(p.shape), p.element_size(), id(p) in embedding_weights, getattr(p, ZERO_AT_BUILD, False)
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


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    build: Callable  # (model, cfg) -> torch.optim.Optimizer
    estimate: Callable  # (list[ParamInfo], cfg, variant, model_config) -> StateSize
    trainer_optim: str | None = None
    trainer_args: Callable = lambda cfg: {}  # extra TrainingArguments for trainer_optim
    trainer_variant: str | None = None  # how the Trainer's version differs from `build`'s, if it does
    # settings (conf/optim keys) the Trainer's optim= path fixes at these values: it cannot be told others
    trainer_fixed: dict = field(default_factory=dict)
    requires: tuple[str, ...] = ()
    needs_train_eval_mode: bool = False  # schedule-free: optimizer.train() / optimizer.eval()
    compiles_step: bool = False  # torchao: torch.compile'd step (incompatible with the CPU peak tracker)
    # what its step allocates at once, as (times the largest weight, times all weights): e.g. AdamW's
    # per-tensor step makes sqrt(exp_avg_sq) and its quotient for one weight at a time (pipeline.plan, where
    # the step cannot be simulated)
    step_temporaries: tuple[float, float] = (0.0, 0.0)
    step_in_fp32: bool = False  # its temporaries are fp32 whatever the weights' dtype (torchao upcasts)
    # updates inside the backward pass, no separate step: LOMO ("lomo": `fused_backward(loss, lr)`, driven by
    # accelerate's `backward(loss, learning_rate=...)`) or LAYERWISE (one optimizer per parameter, stepped from
    # a post-accumulate-grad hook); None: an ordinary `optimizer.step()` after backward
    in_backward: str | None = None
    needs_cuda: str | None = None  # why it cannot run without a CUDA device (one line), None when it can

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


def settings(cfg) -> dict:
    """The optimizer's settings from its conf/optim file (and overrides): every key but `name` and `lr`."""
    from omegaconf import OmegaConf

    chosen = OmegaConf.to_container(cfg.optim, resolve=True)
    return {k: v for k, v in chosen.items() if k not in ("name", "lr")}


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


# --- torch ------------------------------------------------------------------------------------------------


def build_adamw(model, cfg):
    import torch

    groups = param_groups(model, cfg.train.weight_decay)
    o = cfg.optim
    return torch.optim.AdamW(
        groups, lr=learning_rate(cfg), betas=tuple(o.betas), eps=o.eps, amsgrad=o.get("amsgrad", False)
    )


def adam_moments(cfg) -> int:
    """exp_avg and exp_avg_sq, and max_exp_avg_sq with amsgrad."""
    return 3 if cfg.optim.get("amsgrad", False) else 2


def estimate_adamw(params, cfg, variant=None, model_config=None) -> StateSize:
    # exp_avg and exp_avg_sq (and max_exp_avg_sq) in the parameter's dtype, plus a float32 `step` tensor
    moments = adam_moments(cfg)
    return total(size((moments * p.numel, p.itemsize), (1, FP32)) for p in params)


def build_adafactor_torch(model, cfg):
    import torch

    groups = param_groups(model, cfg.train.weight_decay)
    o = cfg.optim
    return torch.optim.Adafactor(
        groups, lr=learning_rate(cfg), beta2_decay=o.beta2_decay, eps=tuple(o.eps), d=o.d
    )


def factored(shape) -> int:
    """Elements of the row + column statistics of a factored second moment (n + m for an n x m matrix)."""
    return prod(shape[:-1]) + prod(shape[:-2]) * shape[-1]


def estimate_adafactor_torch(params, cfg, variant=None, model_config=None) -> StateSize:
    # row_var + col_var for matrices, variance for vectors (parameter dtype), a float32 `step` tensor
    return total(
        size((factored(p.shape) if len(p.shape) >= 2 else p.numel, p.itemsize), (1, FP32)) for p in params
    )


def build_sgd(model, cfg):
    import torch

    groups = param_groups(model, cfg.train.weight_decay)
    o = cfg.optim
    return torch.optim.SGD(
        groups,
        lr=learning_rate(cfg),
        momentum=o.momentum,
        dampening=o.get("dampening", 0.0),
        nesterov=o.get("nesterov", False),
    )


def sgd_trainer_args(cfg) -> dict:
    """The Trainer's sgd path reads momentum, dampening and nesterov from optim_args."""
    o = cfg.optim
    return {
        "optim_args": optim_args(
            momentum=o.momentum, dampening=o.get("dampening", 0.0), nesterov=o.get("nesterov", False)
        )
    }


def estimate_sgd(params, cfg, variant=None, model_config=None) -> StateSize:
    if not cfg.optim.momentum:  # plain SGD keeps no state
        return StateSize(0, 0)
    return total(size((p.numel, p.itemsize)) for p in params)  # momentum_buffer


# --- transformers -----------------------------------------------------------------------------------------


def build_adafactor(model, cfg):
    from transformers.optimization import Adafactor

    # with the defaults of conf/optim/adafactor.yaml, what TrainingArguments(optim="adafactor") builds
    return adafactor_built(Adafactor, param_groups(model, cfg.train.weight_decay), cfg)


def adafactor_built(cls, groups, cfg):
    """An Adafactor class (transformers' or galore-torch's, the same constructor) with conf/optim's settings."""
    o = cfg.optim
    relative = o.relative_step
    optimizer = cls(
        groups,
        lr=None if relative else learning_rate(cfg),  # Adafactor refuses a rate beside its relative step
        eps=tuple(o.eps),
        clip_threshold=o.clip_threshold,
        decay_rate=o.decay_rate,
        beta1=o.beta1,
        scale_parameter=o.scale_parameter,
        relative_step=relative,
        warmup_init=o.warmup_init,
    )
    if relative:  # the step size is Adafactor's own; the schedule gets a number to scale (and is ignored)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg)
    return optimizer


# the values TrainingArguments(optim="adafactor") builds Adafactor with: it passes no other setting
TRAINER_ADAFACTOR = {
    "eps": [1e-30, 1e-3],
    "clip_threshold": 1.0,
    "decay_rate": -0.8,
    "beta1": None,
    "scale_parameter": False,
    "relative_step": False,
    "warmup_init": False,
}


def estimate_adafactor(params, cfg, variant=None, model_config=None) -> StateSize:
    return total(adafactor_state(p.shape, cfg) for p in params)


def adafactor_state(shape, cfg) -> StateSize:
    """Adafactor's state for a gradient of this shape: fp32 statistics, row + column for matrices, full for
    vectors; exp_avg (fp32) only with beta1; `RMS` a float32 0-d tensor, `step` a Python int (int64)."""
    first = cfg.optim.get("beta1") is not None
    return size(
        (factored(shape) if len(shape) >= 2 else prod(shape), FP32),
        (prod(shape) if first else 0, FP32),
        (1, FP32),
        (1, INT64),
    )


# --- bitsandbytes -----------------------------------------------------------------------------------------


def bnb_builder(kind: str, bits: int, paged: bool = False):
    """bitsandbytes' AdamW, Lion or RMSprop with `bits`-bit state (paged: in CUDA unified memory)."""

    def build(model, cfg):
        import bitsandbytes as bnb

        groups = param_groups(model, cfg.train.weight_decay)
        o = cfg.optim
        if kind == "rmsprop":  # no betas, and no paged variant
            cls, extra = bnb.optim.RMSprop, {"alpha": o.alpha, "eps": o.eps, "momentum": o.momentum}
        else:
            cls = {"adamw": bnb.optim.AdamW, "lion": bnb.optim.Lion}[kind]
            extra = {"betas": tuple(o.betas), "is_paged": paged}
            if kind == "adamw":
                extra["eps"] = o.eps
        return cls(groups, lr=learning_rate(cfg), optim_bits=bits, min_8bit_size=min_8bit_size(cfg), **extra)

    return build


# the values the Trainer's rmsprop_bnb* path builds bitsandbytes' RMSprop with (bitsandbytes' defaults): it
# hands its optim_args over as text, which the optimizer cannot compute with, so it can carry no setting
TRAINER_BNB_RMSPROP = {"alpha": 0.99, "eps": 1e-8, "momentum": 0}


def min_8bit_size(cfg) -> int:
    """bitsandbytes keeps 32-bit state for tensors under this many elements (`optim.min_8bit_size`)."""
    return cfg.optim.get("min_8bit_size", BNB_MIN_8BIT_SIZE)


def bnb_estimator(states: int, bits: int, maps: int | None = None):
    """bitsandbytes: `states` moments per parameter; 8-bit ones as uint8 codes + an fp32 absmax per block of
    256, except tensors under `optim.min_8bit_size` (4096) elements (and, in the Trainer's variant, embedding
    weights) which keep fp32 state; one shared fp32 quantization map per moment; `step` a Python int."""

    def estimate(params, cfg, variant=None, model_config=None) -> StateSize:
        parts, any_8bit = [], False
        for p in params:
            eight = bits == 8 and p.numel >= min_8bit_size(cfg)
            eight = eight and not (variant == TRAINER_EMBEDDING_FP32 and p.is_embedding)
            any_8bit |= eight
            moment = size((p.numel, 1), (ceil(p.numel / BNB_BLOCK), FP32)) if eight else size((p.numel, FP32))
            parts += [moment] * states + [size((1, INT64))]
        if any_8bit:
            parts.append(size(((states if maps is None else maps) * BNB_QMAP, FP32)))
        return total(parts)

    return estimate


# --- torchao ----------------------------------------------------------------------------------------------

TORCHAO = {  # name -> (class, code bytes per element, quantization-map elements per state)
    "8bit": ("AdamW8bit", 1.0, 256),
    "4bit": ("AdamW4bit", 0.5, 16),
    "fp8": ("AdamWFp8", 1.0, 0),
}


def torchao_builder(kind: str):
    def build(model, cfg):
        import torchao.optim

        groups = param_groups(model, cfg.train.weight_decay)
        cls = getattr(torchao.optim, TORCHAO[kind][0])
        o = cfg.optim
        return cls(
            groups,
            lr=learning_rate(cfg),
            betas=tuple(o.betas),
            eps=o.eps,
            block_size=o.block_size,
            bf16_stochastic_round=o.get("bf16_stochastic_round", False),
        )

    return build


def torchao_estimator(kind: str):
    """torchao: exp_avg and exp_avg_sq as tensor subclasses (codes + an fp32 scale per block + own qmap) for
    tensors of >= 4096 elements divisible by the block size, plain tensors of the parameter's dtype otherwise;
    a float32 `step` tensor."""
    _, code_bytes, qmap = TORCHAO[kind]

    def estimate(params, cfg, variant=None, model_config=None) -> StateSize:
        block = cfg.optim.block_size
        parts = []
        for p in params:
            if p.numel >= TORCHAO_MIN_SIZE and p.numel % block == 0:
                codes = int(p.numel * code_bytes)
                moment = size((codes, 1), (p.numel // block, FP32), (qmap, FP32))
            else:
                moment = size((p.numel, p.itemsize))
            parts += [moment, moment, size((1, FP32))]
        return total(parts)

    return estimate


# --- GaLore -----------------------------------------------------------------------------------------------


def galore_targets(model, cfg) -> set[str]:
    """Weights of the nn.Linear modules that match optim.target_modules, as the Trainer selects them."""
    from torch import nn
    from transformers.trainer_utils import check_target_module_exists

    targets = list(cfg.optim.target_modules)
    return {
        f"{name}.weight"
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and check_target_module_exists(targets, name)
    }


def galore_kwargs(cfg) -> dict:
    o = cfg.optim
    return {"rank": o.rank, "update_proj_gap": o.update_proj_gap, "scale": o.scale, "proj_type": o.proj_type}


def galore_groups(model, cfg) -> list[dict]:
    """The Trainer's GaLore groups: everything else, then the projected weights (no weight-decay split)."""
    targets = galore_targets(model, cfg)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if n not in targets]},
        {"params": [p for n, p in named if n in targets], **galore_kwargs(cfg)},
    ]


def build_galore_adamw(model, cfg):
    from galore_torch import GaLoreAdamW

    o = cfg.optim
    return GaLoreAdamW(
        galore_groups(model, cfg),
        lr=learning_rate(cfg),
        betas=tuple(o.betas),
        eps=o.eps,
        correct_bias=o.get("correct_bias", True),
    )


def build_galore_adafactor(model, cfg):
    """galore-torch's Adafactor: transformers' Adafactor on the projected gradients (the Trainer's
    optim="galore_adafactor" builds it with Adafactor's settings as optim="adafactor" does)."""
    from galore_torch import GaLoreAdafactor

    return adafactor_built(GaLoreAdafactor, galore_groups(model, cfg), cfg)


def galore_projection(p: ParamInfo, cfg, svd_itemsize: int) -> tuple[tuple[int, int], StateSize] | None:
    """A projected weight's low-rank gradient shape and its projector's size; None for a weight GaLore leaves
    alone. std projection of an m x n weight: (m x r) when m >= n else (r x n), r = min(rank, m, n); the
    projector keeps its slice of the SVD factor (Vh's r x n rows when m >= n, else U's m x r columns). The
    SVD runs in fp32: of an fp32 gradient (`svd_itemsize` 4) the slice is a view that keeps the whole factor,
    min(m, n)^2 fp32 values; of a 16-bit one it is a 16-bit copy of the slice alone."""
    if cfg.optim.proj_type != "std":
        raise NotImplementedError("the GaLore estimate models proj_type=std")
    # names alone do not tell module types; targets are 2-D weights whose name matches, as galore_targets
    from transformers.trainer_utils import check_target_module_exists

    module = p.name.removesuffix(".weight")
    if not (p.name.endswith(".weight") and len(p.shape) == 2):
        return None
    if not check_target_module_exists(list(cfg.optim.target_modules), module):
        return None
    m, n = p.shape
    r = min(cfg.optim.rank, m, n)
    # the projector object also keeps rank, verbose, update_proj_gap and scale as Python scalars
    knobs = [cfg.optim.rank, False, cfg.optim.update_proj_gap, cfg.optim.scale]
    sliced = r * n if m >= n else m * r
    kept = (min(m, n) ** 2, FP32) if svd_itemsize == FP32 else (sliced, svd_itemsize)
    return ((m, r) if m >= n else (r, n)), size(kept, *[(1, scalar_bytes(v)) for v in knobs])


def estimate_galore_adamw(params, cfg, variant=None, model_config=None) -> StateSize:
    """Projected weights: Adam moments of the low-rank gradient in the weight's dtype, and the projector of a
    gradient in the weight's dtype (`galore_projection`). Other parameters: plain Adam. `step` a Python int."""
    parts = []
    for p in params:
        projected = galore_projection(p, cfg, p.itemsize)
        if projected:
            low_rank, projector = projected
            parts += [size((2 * prod(low_rank), p.itemsize), (1, INT64)), projector]
        else:
            parts += [size((2 * p.numel, p.itemsize), (1, INT64))]
    return total(parts)


def estimate_galore_adafactor(params, cfg, variant=None, model_config=None) -> StateSize:
    """Adafactor's state (`adafactor_state`) of the low-rank gradient for projected weights, of the whole one
    elsewhere; it upcasts 16-bit gradients before projecting them, so every projector is of an fp32 one."""
    parts = []
    for p in params:
        projected = galore_projection(p, cfg, FP32)
        if projected:
            low_rank, projector = projected
            parts += [adafactor_state(low_rank, cfg), projector]
        else:
            parts.append(adafactor_state(p.shape, cfg))
    return total(parts)


# --- Adam-mini --------------------------------------------------------------------------------------------


def build_adam_mini(model, cfg):
    from adam_mini import Adam_mini

    dim, heads = attention_dims(model.config)
    optimizer = Adam_mini(
        named_parameters=model.named_parameters(),
        lr=learning_rate(cfg),
        betas=tuple(cfg.optim.betas),
        eps=cfg.optim.eps,
        weight_decay=cfg.train.weight_decay,
        dim=dim,
        n_heads=heads,
        verbose=False,
    )
    # Adam-mini picks each parameter's block type by substrings of its name; these sets are configurable
    # because its defaults are written for Llama-style names
    for key in ("embd_names", "output_names", "wqk_names", "wv_names", "attn_proj_names", "mlp_names"):
        setattr(optimizer, key, set(cfg.optim.names[key]))
    return optimizer


def attention_dims(config) -> tuple[int, int]:
    """Hidden size and attention heads of a transformers config (BERT-, DistilBERT- and GPT-2-style names)."""
    dim = next(getattr(config, k) for k in ("hidden_size", "dim", "n_embd") if hasattr(config, k))
    heads = next(
        getattr(config, k) for k in ("num_attention_heads", "n_heads", "n_head") if hasattr(config, k)
    )
    return dim, heads


def adam_mini_block(name: str, names) -> str:
    """Adam-mini's block type of a parameter, by the same name rules it applies (lower-cased names)."""
    name = name.lower()
    if "bias" in name:
        return "adam"
    if any(k in name for k in names.wqk_names):
        return "head"
    groups = ("embd_names", "output_names", "wv_names", "mlp_names", "attn_proj_names")
    if any(k in name for g in groups for k in names[g]):
        return "neuron"
    return "block"


def estimate_adam_mini(params, cfg, variant=None, model_config=None) -> StateSize:
    """Adam-mini: m full-size for every parameter; v full-size only for biases; one v per attention head
    for query/key, per output row for embedding/value/MLP/projection, one per tensor otherwise. Bookkeeping
    scalars: `step` (int), `head_per_gpu`/`neuron_per_gpu` (int), `reduced` (bool), `block_numel` (float)."""
    names = cfg.optim.names
    dim, n_heads = attention_dims(model_config)
    parts = []
    for p in params:
        m = (p.numel, p.itemsize)
        kind = adam_mini_block(p.name, names)
        if kind == "adam":
            parts.append(size(m, m, (1, INT64)))
        elif kind == "head":
            heads = p.numel // (dim * dim // n_heads)  # m viewed as (heads, dim * dim / n_heads)
            parts.append(size(m, (heads, p.itemsize), (1, INT64), (1, INT64)))
        elif kind == "neuron":
            parts.append(size(m, (p.shape[0], p.itemsize), (1, INT64), (1, INT64)))
        else:
            parts.append(size(m, (1, p.itemsize), (1, INT64), (1, 1), (1, FP32)))
    return total(parts)


# --- schedule-free ----------------------------------------------------------------------------------------


def schedule_free_builder(kind: str):
    """schedulefree's AdamW, RAdam or SGD, as the Trainer's schedule_free_<kind> path builds it."""

    def build(model, cfg):
        import schedulefree

        o = cfg.optim
        if kind == "sgd":
            cls, extra = schedulefree.SGDScheduleFree, {"momentum": o.momentum}
        else:
            cls = {"adamw": schedulefree.AdamWScheduleFree, "radam": schedulefree.RAdamScheduleFree}[kind]
            extra = {"betas": tuple(o.betas), "eps": o.eps}
        if kind == "radam":  # RAdam needs no warmup: a plain SGD phase (or none) stands in for it
            extra["silent_sgd_phase"] = o.silent_sgd_phase
        else:
            extra["warmup_steps"] = cfg.train.warmup_steps
        return cls(
            param_groups(model, cfg.train.weight_decay),
            lr=learning_rate(cfg),
            weight_decay=cfg.train.weight_decay,
            r=o.get("r", 0.0),
            weight_lr_power=o.get("weight_lr_power", 2.0),
            **extra,
        )

    return build


def schedule_free_trainer_args(cfg) -> dict:
    """betas and eps as TrainingArguments; r and weight_lr_power through optim_args, which its path reads."""
    o = cfg.optim
    return {
        **(adam_args(cfg) if "betas" in o else {}),  # (SGD has none)
        "optim_args": optim_args(r=o.get("r", 0.0), weight_lr_power=o.get("weight_lr_power", 2.0)),
    }


def schedule_free_estimator(states: int):
    """`states` parameter-size tensors per parameter (AdamW and RAdam: z and exp_avg_sq; SGD: z); the step
    count is per group."""

    def estimate(params, cfg, variant=None, model_config=None) -> StateSize:
        return total(size((states * p.numel, p.itemsize)) for p in params)

    return estimate


def torchao_spec(name: str, kind: str, trainer_optim: str | None = None) -> OptimizerSpec:
    """torchao's low-bit AdamW: its step is compiled (eager on CPU, see OptimizerSpec.compiled_on)."""
    return OptimizerSpec(
        name,
        torchao_builder(kind),
        torchao_estimator(kind),
        trainer_optim,
        adam_args if trainer_optim else (lambda cfg: {}),
        # its path reads block_size as text (which torchao cannot take) and bf16_stochastic_round as 0 / 1:
        # other values than these go to the Trainer as the object
        trainer_fixed={"block_size": 256, "bf16_stochastic_round": False},
        requires=("torchao",),
        compiles_step=True,
        step_temporaries=(6, 0),  # eager (CPU); its compiled CUDA step fuses most of them
        step_in_fp32=True,
    )


# --- issue 17: newer optimizers ---------------------------------------------------------------------------


def build_adamw_fused(model, cfg):
    """torch.optim.AdamW(fused=True): one fused kernel for all tensors (CPU and CUDA), the same state."""
    import torch

    groups = param_groups(model, cfg.train.weight_decay)
    o = cfg.optim
    return torch.optim.AdamW(
        groups, lr=learning_rate(cfg), betas=tuple(o.betas), eps=o.eps, amsgrad=o.amsgrad, fused=True
    )


def is_muon_weight(p: ParamInfo, head_names) -> bool:
    """Muon takes the 2-D hidden weights: not embeddings, not the classification head (`optim.adamw_names`)."""
    return len(p.shape) == 2 and not p.is_embedding and not any(k in p.name for k in head_names)


def build_muon(model, cfg):
    from pipeline.muon import MuonWithAdamW

    infos = {info.name: info for info in param_infos(model)}
    names = list(cfg.optim.adamw_names)
    decay = set(decay_parameter_names(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    muon = [p for n, p in named if is_muon_weight(infos[n], names)]
    rest = [(n, p) for n, p in named if not is_muon_weight(infos[n], names)]
    wd = cfg.train.weight_decay
    o = cfg.optim
    return MuonWithAdamW(
        [
            {"params": muon, "weight_decay": wd, "use_muon": True},
            {"params": [p for n, p in rest if n in decay], "weight_decay": wd, "use_muon": False},
            {"params": [p for n, p in rest if n not in decay], "weight_decay": 0.0, "use_muon": False},
        ],
        lr=learning_rate(cfg),
        weight_decay=wd,
        momentum=o.momentum,
        nesterov=o.nesterov,
        ns_coefficients=tuple(o.ns_coefficients),
        eps=o.eps,
        ns_steps=o.ns_steps,
        adjust_lr_fn=o.adjust_lr_fn,
        adamw_betas=tuple(o.adamw_betas),
        adamw_eps=o.adamw_eps,
    )


def estimate_muon(params, cfg, variant=None, model_config=None) -> StateSize:
    """Muon's part: a `momentum_buffer` (parameter dtype), no step; AdamW's part: as `adamw`."""
    names = list(cfg.optim.adamw_names)
    return total(
        size((p.numel, p.itemsize))
        if is_muon_weight(p, names)
        else size((2 * p.numel, p.itemsize), (1, FP32))
        for p in params
    )


def build_ademamix(bits: int):
    def build(model, cfg):
        import bitsandbytes as bnb

        o = cfg.optim
        return bnb.optim.AdEMAMix(
            param_groups(model, cfg.train.weight_decay),
            lr=learning_rate(cfg),
            betas=tuple(o.betas),
            alpha=o.alpha,
            t_alpha=o.t_alpha,
            t_beta3=o.t_beta3,
            eps=o.eps,
            optim_bits=bits,
            min_8bit_size=o.get("min_8bit_size", BNB_MIN_8BIT_SIZE),
        )

    return build


def ademamix_trainer_args(cfg) -> dict:
    """The Trainer's ademamix path: beta1, beta2 and eps as TrainingArguments; beta3, alpha, t_alpha, t_beta3
    from optim_args."""
    o = cfg.optim
    extra = {k: o[k] for k in ("t_alpha", "t_beta3") if o[k] is not None}
    return {**adam_args(cfg), "optim_args": optim_args(beta3=o.betas[2], alpha=o.alpha, **extra)}


def build_adagrad(model, cfg):
    import torch

    o = cfg.optim
    return torch.optim.Adagrad(
        param_groups(model, cfg.train.weight_decay),
        lr=learning_rate(cfg),
        lr_decay=o.lr_decay,
        initial_accumulator_value=o.initial_accumulator_value,
        eps=o.eps,
    )


def estimate_adagrad(params, cfg, variant=None, model_config=None) -> StateSize:
    return total(size((p.numel, p.itemsize), (1, FP32)) for p in params)  # `sum` + a float32 `step` tensor


def build_rmsprop(model, cfg):
    import torch

    o = cfg.optim
    return torch.optim.RMSprop(
        param_groups(model, cfg.train.weight_decay),
        lr=learning_rate(cfg),
        alpha=o.alpha,
        eps=o.eps,
        momentum=o.momentum,
        centered=o.centered,
    )


def estimate_rmsprop(params, cfg, variant=None, model_config=None) -> StateSize:
    # square_avg, + momentum_buffer with momentum, + grad_avg when centered; a float32 `step` tensor
    full = 1 + (cfg.optim.momentum > 0) + bool(cfg.optim.centered)
    return total(size((full * p.numel, p.itemsize), (1, FP32)) for p in params)


def build_stable_adamw(model, cfg):
    from optimi import StableAdamW

    o = cfg.optim
    return StableAdamW(
        param_groups(model, cfg.train.weight_decay),
        lr=learning_rate(cfg),
        betas=tuple(o.betas),
        weight_decay=cfg.train.weight_decay,
        eps=o.eps,
        decouple_lr=o.decouple_lr,
        max_lr=o.max_lr,
        kahan_sum=o.kahan_sum,
    )


def stable_adamw_trainer_args(cfg) -> dict:
    """betas and eps as TrainingArguments; max_lr through optim_args (its path reads decouple_lr and kahan_sum
    with bool(text), so that "False" is true: those two stay at their defaults, `trainer_fixed`)."""
    max_lr = cfg.optim.max_lr
    return {**adam_args(cfg), **({"optim_args": optim_args(max_lr=max_lr)} if max_lr is not None else {})}


def estimate_stable_adamw(params, cfg, variant=None, model_config=None) -> StateSize:
    """exp_avg, exp_avg_sq and a 0-d `eps_sq` in the parameter's dtype; a Kahan compensation buffer (parameter
    size) for 16-bit parameters unless kahan_sum=false; the step count is per group. (CPU, or CUDA without
    Triton: optimi's Triton kernel adds a uint8 flag and an fp32 mean square per tensor.)"""
    kahan = cfg.optim.kahan_sum is not False
    return total(
        size(((2 + (kahan and p.itemsize == 2)) * p.numel, p.itemsize), (1, p.itemsize)) for p in params
    )


def build_came(model, cfg):
    from came_pytorch import CAME

    o = cfg.optim
    return CAME(
        param_groups(model, cfg.train.weight_decay),
        lr=learning_rate(cfg),
        eps=tuple(o.eps),
        clip_threshold=o.clip_threshold,
        betas=tuple(o.betas),
    )


def estimate_came(params, cfg, variant=None, model_config=None) -> StateSize:
    """exp_avg (full) and, for matrices, row + column statistics of the second moment and of the confidence
    residual (2 x (n + m)), for vectors a full exp_avg_sq, all fp32 (CAME upcasts 16-bit gradients); `RMS` a
    0-d tensor in the parameter's dtype; `step` a Python int."""
    return total(
        size(
            (p.numel + (2 * factored(p.shape) if len(p.shape) >= 2 else p.numel), FP32),
            (1, p.itemsize),
            (1, INT64),
        )
        for p in params
    )


def build_prodigy(model, cfg):
    import torch
    from prodigyopt import Prodigy

    with torch.no_grad():  # Prodigy keeps a 0-d `p0` for a parameter that is all zero at its first step
        for p in model.parameters():
            setattr(p, ZERO_AT_BUILD, not bool(p.any()))
    o = cfg.optim
    return Prodigy(
        param_groups(model, cfg.train.weight_decay),
        lr=learning_rate(cfg),
        betas=tuple(o.betas),
        beta3=o.beta3,
        eps=o.eps,
        decouple=o.decouple,
        use_bias_correction=o.use_bias_correction,
        safeguard_warmup=o.safeguard_warmup,
        d0=o.d0,
        d_coef=o.d_coef,
        growth_rate=o.growth_rate,
        slice_p=o.slice_p,
    )


def estimate_prodigy(params, cfg, variant=None, model_config=None) -> StateSize:
    """`s` and `p0`: every slice_p-th element of the parameter (p0 a 0-d tensor when the parameter is all zero
    at the first step), exp_avg (when beta1 > 0) and exp_avg_sq, all in the parameter's dtype; int `step`."""
    every = cfg.optim.slice_p
    first = cfg.optim.betas[0] > 0
    parts = []
    for p in params:
        sliced = ceil(p.numel / every)
        p0 = 1 if p.zero_at_build else sliced
        parts.append(size((sliced + p0 + (1 + first) * p.numel, p.itemsize), (1, INT64)))
    return total(parts)


APOLLO_GROUP_KEYS = ("rank", "proj", "scale_type", "update_proj_gap", "scale", "proj_type")


def build_apollo_adamw(model, cfg):
    from apollo_torch import APOLLOAdamW

    targets = galore_targets(model, cfg)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    o = cfg.optim
    # the Trainer's low-rank groups (as GaLore's): everything else, then the projected weights
    groups = [
        {"params": [p for n, p in named if n not in targets]},
        {"params": [p for n, p in named if n in targets], **{k: o[k] for k in APOLLO_GROUP_KEYS}},
    ]
    return APOLLOAdamW(
        groups,
        lr=learning_rate(cfg),
        betas=tuple(o.betas),
        eps=o.eps,
        correct_bias=o.correct_bias,
        scale_front=o.scale_front,
        disable_nl=o.disable_nl,
    )


def apollo_trainer_args(cfg) -> dict:
    """Betas and eps (the projected group's), the target modules and APOLLO's group settings (optim_args)."""
    return {
        **adam_args(cfg),
        "optim_target_modules": list(cfg.optim.target_modules),
        "optim_args": optim_args(**{k: cfg.optim[k] for k in APOLLO_GROUP_KEYS}),
    }


# the Trainer's apollo paths pass betas and eps to the projected group only, and none of the others
APOLLO_TRAINER_FIXED = {
    "betas": [0.9, 0.999],
    "eps": 1e-6,
    "correct_bias": True,
    "scale_front": False,
    "disable_nl": False,
}


def estimate_apollo_adamw(params, cfg, variant=None, model_config=None) -> StateSize:
    """Every parameter: an int `seed` (set at construction) and `step`. Projected weights (m x n, random
    projection, proj_type std, r = optim.rank, not capped): the projector's (r x n) matrix when m >= n else
    (m x r), Adam moments of the projected gradient (m x r, or r x n), a 0-d `scaled_grad` norm (with the
    norm-growth limiter), all in the parameter's dtype, and the projector's Python scalars. Others: Adam."""
    o = cfg.optim
    if o.proj != "random" or o.proj_type != "std":
        raise NotImplementedError("the APOLLO estimate models proj=random, proj_type=std")
    from transformers.trainer_utils import check_target_module_exists

    targets = list(o.target_modules)
    parts = []
    for p in params:
        module = p.name.removesuffix(".weight")
        if p.name.endswith(".weight") and len(p.shape) == 2 and check_target_module_exists(targets, module):
            m, n = p.shape
            r = o.rank
            low, ortho = (m * r, r * n) if m >= n else (r * n, m * r)
            # the projector: rank, verbose, update_proj_gap, scale, seed, svd_count (proj_type is a string)
            knobs = [o.rank, False, o.update_proj_gap, float(o.scale), 0, 0]
            parts.append(
                size(
                    (2 * low + ortho + (not o.disable_nl), p.itemsize),
                    (2, INT64),
                    *[(1, scalar_bytes(v)) for v in knobs],
                )
            )
        else:
            parts.append(size((2 * p.numel, p.itemsize), (2, INT64)))
    return total(parts)


# --- issue 17: updating inside the backward pass (LOMO, AdaLomo, layer-wise GaLore) -----------------------

LOMO, LAYERWISE = "lomo", "layerwise"  # OptimizerSpec.in_backward
ADALOMO_NEEDS_CUDA = "AdaLomo (lomo-optim) allocates its state with .cuda()"


def build_lomo(model, cfg):
    """lomo-optim's Lomo as the Trainer's optim="lomo" builds it: the model and the rate alone (no weight
    decay, no clipping). It registers a gradient hook on every parameter that updates the parameters whose
    gradient is complete and frees those gradients; `fused_backward(loss, lr)` runs the backward pass."""
    from lomo_optim import Lomo

    return Lomo(model, lr=learning_rate(cfg))


def build_adalomo(model, cfg):
    """lomo-optim's AdaLomo as the Trainer's optim="adalomo" builds it (model and rate alone)."""
    from lomo_optim import AdaLomo

    return AdaLomo(model, lr=learning_rate(cfg))


def estimate_lomo(params, cfg, variant=None, model_config=None) -> StateSize:
    return StateSize(0, 0)  # plain SGD applied in the gradient hooks: no state


def estimate_adalomo(params, cfg, variant=None, model_config=None) -> StateSize:
    """Adafactor's factored second moment, fp32 whatever the weights' dtype: rows + columns (shape[0] +
    shape[1]) for a matrix, a full vector for a vector. Its step count is one Python int for the whole
    optimizer (not per parameter; not counted, as a group's step count is not)."""
    return total(size((p.shape[0] + p.shape[1] if len(p.shape) > 1 else p.numel, FP32)) for p in params)


def build_layerwise(model, cfg, make, projected: dict):
    """The Trainer's layer-wise optimizers (its `_setup_low_rank_optimizer`): one optimizer per parameter,
    `make(groups)`, in its order (the other parameters, then the projected weights, whose group adds
    `projected`), each stepped and its gradient freed from that parameter's post-accumulate-grad hook, behind
    transformers' LayerWiseDummyOptimizer (whose step and zero_grad do nothing)."""
    from transformers.trainer_pt_utils import LayerWiseDummyOptimizer

    targets = galore_targets(model, cfg)
    named = list(model.named_parameters())
    optimizer_dict = {p: make([{"params": [p]}]) for n, p in named if n not in targets}
    for n, p in named:
        if n in targets:
            optimizer_dict[p] = make([{"params": [p], **projected}])

    def optimizer_hook(p):
        if p.grad is not None:
            optimizer_dict[p].step()
            optimizer_dict[p].zero_grad()

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(optimizer_hook)
    return LayerWiseDummyOptimizer(optimizer_dict=optimizer_dict, lr=learning_rate(cfg))


def build_galore_adamw_layerwise(model, cfg):
    """optim="galore_adamw_layerwise": a GaLoreAdamW per parameter; the Trainer's get the rate alone
    (galore-torch's betas, eps, bias correction: trainer_fixed)."""
    from galore_torch import GaLoreAdamW

    o = cfg.optim
    kwargs = {"lr": learning_rate(cfg), "betas": tuple(o.betas), "eps": o.eps, "correct_bias": o.correct_bias}
    return build_layerwise(model, cfg, lambda groups: GaLoreAdamW(groups, **kwargs), galore_kwargs(cfg))


def build_galore_adafactor_layerwise(model, cfg):
    """A GaLoreAdafactor per parameter with galore_adafactor's settings. The Trainer's own
    optim="galore_adafactor_layerwise" cannot build it (transformers 5.24 passes the rate alone, which
    GaLoreAdafactor's default relative_step=True refuses): the Trainer is handed this object."""
    from galore_torch import GaLoreAdafactor

    return build_layerwise(
        model, cfg, lambda groups: adafactor_built(GaLoreAdafactor, groups, cfg), galore_kwargs(cfg)
    )


def build_apollo_adamw_layerwise(model, cfg):
    """optim="apollo_adamw_layerwise": an APOLLOAdamW per parameter; the Trainer's get the rate alone
    (apollo-torch's defaults: trainer_fixed), the projected weights' group APOLLO's settings, betas and eps."""
    from apollo_torch import APOLLOAdamW

    o = cfg.optim
    kwargs = {k: o[k] for k in ("eps", "correct_bias", "scale_front", "disable_nl")}
    projected = {**{k: o[k] for k in APOLLO_GROUP_KEYS}, "betas": tuple(o.betas), "eps": o.eps}
    return build_layerwise(
        model,
        cfg,
        lambda groups: APOLLOAdamW(groups, lr=learning_rate(cfg), betas=tuple(o.betas), **kwargs),
        projected,
    )


def galore_layerwise_trainer_args(cfg) -> dict:
    """The target modules and GaLore's group settings (optim_args), as for galore_adamw."""
    return {
        "optim_target_modules": list(cfg.optim.target_modules),
        "optim_args": optim_args(**galore_kwargs(cfg)),
    }


def step_without_backward(spec: OptimizerSpec, optimizer) -> None:
    """With the gradients in place, the update the way its backend drives it, without a backward pass (the
    meta-device estimate): LOMO's hook body (as `fused_backward` runs it for the last parameter), each
    layer-wise optimizer's step (as its hook does), else `step()`."""
    if spec.in_backward == LOMO:
        optimizer.grad_func(0)
    elif spec.in_backward == LAYERWISE:
        for inner in optimizer.optimizer_dict.values():
            inner.step()
    else:
        optimizer.step()


# --- bring your own: optim=custom optim.target=<module.Class> ----------------------------------------------


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


def meta_model(model_config, itemsize: int):
    """A sequence classifier of this config built on the meta device, in the dtype its weights have."""
    import torch
    from transformers import AutoModelForSequenceClassification

    dtype = {2: torch.bfloat16, 4: torch.float32}[itemsize]
    with torch.device("meta"):
        return AutoModelForSequenceClassification.from_config(model_config, dtype=dtype)


def meta_estimate(spec: OptimizerSpec, cfg, model) -> StateSize:
    """The state an optimizer creates in one step, found with no memory at any model size: the registry's
    `build` on a model whose parameters are meta-device tensors, one `step()` with meta gradients, and the
    state it made sized from shapes and dtypes as `pipeline.memory.optimizer_state_size` counts it (each storage
    once, Python scalars as their tensor dtype). MetaStepFailed, with why, when the step cannot run on meta
    (it reads a value, e.g. `.item()`, or calls a kernel that has no meta implementation)."""
    import torch

    from pipeline.memory import optimizer_state_size

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
    """optim=custom: no analytic model, the meta-device step on the model its config describes."""
    return meta_estimate(REGISTRY["custom"], cfg, meta_model(model_config, params[0].itemsize))


# --- the registry -----------------------------------------------------------------------------------------

REGISTRY: dict[str, OptimizerSpec] = {
    spec.name: spec
    for spec in [
        OptimizerSpec(
            "adamw",
            build_adamw,
            estimate_adamw,
            "adamw_torch",
            adam_args,
            trainer_fixed={"amsgrad": False},
            step_temporaries=(2, 0),
        ),
        OptimizerSpec(
            "adafactor",
            build_adafactor,
            estimate_adafactor,
            "adafactor",
            trainer_fixed=TRAINER_ADAFACTOR,
            step_temporaries=(2, 0),
        ),
        OptimizerSpec(
            "adafactor_torch", build_adafactor_torch, estimate_adafactor_torch, step_temporaries=(1, 0)
        ),
        OptimizerSpec("sgd", build_sgd, estimate_sgd, "sgd", sgd_trainer_args),
        OptimizerSpec(
            "adamw_8bit",
            bnb_builder("adamw", 8),
            bnb_estimator(2, 8),
            "adamw_bnb_8bit",
            adam_args,
            TRAINER_EMBEDDING_FP32,
            {"min_8bit_size": BNB_MIN_8BIT_SIZE},
            ("bitsandbytes",),
        ),
        OptimizerSpec(
            "paged_adamw_8bit",
            bnb_builder("adamw", 8, paged=True),
            bnb_estimator(2, 8),
            "paged_adamw_8bit",
            adam_args,
            TRAINER_EMBEDDING_FP32,
            {"min_8bit_size": BNB_MIN_8BIT_SIZE},
            ("bitsandbytes",),
        ),
        OptimizerSpec(
            "lion_8bit",
            bnb_builder("lion", 8),
            bnb_estimator(1, 8),
            "lion_8bit",
            adam_args,
            TRAINER_EMBEDDING_FP32,
            {"min_8bit_size": BNB_MIN_8BIT_SIZE},
            ("bitsandbytes",),
        ),
        OptimizerSpec(
            "lion_32bit",
            bnb_builder("lion", 32),
            bnb_estimator(1, 32),
            "lion_32bit",
            adam_args,
            requires=("bitsandbytes",),
        ),
        torchao_spec("adamw_torchao_8bit", "8bit", "adamw_torch_8bit"),
        torchao_spec("adamw_torchao_4bit", "4bit", "adamw_torch_4bit"),
        torchao_spec("adamw_torchao_fp8", "fp8"),
        OptimizerSpec(
            "galore_adamw",
            build_galore_adamw,
            estimate_galore_adamw,
            "galore_adamw",
            lambda cfg: {
                **adam_args(cfg),
                "optim_target_modules": list(cfg.optim.target_modules),
                "optim_args": optim_args(**galore_kwargs(cfg)),
            },
            # the Trainer's GaLore path passes no betas, eps or correct_bias: galore-torch's defaults
            trainer_fixed={"betas": [0.9, 0.999], "eps": 1e-6, "correct_bias": True},
            requires=("galore_torch",),
            step_temporaries=(2, 0),
        ),
        OptimizerSpec(
            "adam_mini",
            build_adam_mini,
            estimate_adam_mini,
            requires=("adam_mini",),
            step_temporaries=(2, 0),
        ),
        OptimizerSpec(
            "schedule_free_adamw",
            schedule_free_builder("adamw"),
            schedule_free_estimator(2),
            "schedule_free_adamw",
            schedule_free_trainer_args,
            requires=("schedulefree",),
            needs_train_eval_mode=True,
            step_temporaries=(0, 1),
        ),
        # issue 17
        OptimizerSpec(
            "adamw_fused",
            build_adamw_fused,
            estimate_adamw,
            "adamw_torch_fused",
            adam_args,
            trainer_fixed={"amsgrad": False},
            step_temporaries=(0, 2),
        ),
        OptimizerSpec("muon", build_muon, estimate_muon, step_temporaries=(2, 0)),
        OptimizerSpec(
            "ademamix",
            build_ademamix(32),
            bnb_estimator(3, 32),
            "ademamix",
            ademamix_trainer_args,
            requires=("bitsandbytes",),
        ),
        OptimizerSpec(
            "ademamix_8bit",
            build_ademamix(8),
            bnb_estimator(3, 8, maps=2),  # state1 holds both first moments (one map), state2 the second
            "ademamix_8bit",
            ademamix_trainer_args,
            TRAINER_EMBEDDING_FP32,
            {"min_8bit_size": BNB_MIN_8BIT_SIZE},
            ("bitsandbytes",),
        ),
        OptimizerSpec(
            "adagrad",
            build_adagrad,
            estimate_adagrad,
            "adagrad",
            lambda cfg: {"optim_args": optim_args(lr_decay=cfg.optim.lr_decay, eps=cfg.optim.eps)},
            trainer_fixed={"initial_accumulator_value": 0.0},
            step_temporaries=(2, 0),
        ),
        OptimizerSpec(
            "rmsprop",
            build_rmsprop,
            estimate_rmsprop,
            "rmsprop",
            lambda cfg: {
                "optim_args": optim_args(
                    momentum=cfg.optim.momentum,
                    alpha=cfg.optim.alpha,
                    eps=cfg.optim.eps,
                    centered=cfg.optim.centered,
                )
            },
            step_temporaries=(1, 0),
        ),
        OptimizerSpec(
            "stable_adamw",
            build_stable_adamw,
            estimate_stable_adamw,
            "stable_adamw",
            stable_adamw_trainer_args,
            trainer_fixed={"decouple_lr": False, "kahan_sum": None},
            requires=("optimi",),
            step_temporaries=(2, 0),
        ),
        OptimizerSpec("came", build_came, estimate_came, requires=("came_pytorch",), step_temporaries=(3, 0)),
        OptimizerSpec(
            "prodigy", build_prodigy, estimate_prodigy, requires=("prodigyopt",), step_temporaries=(2, 0)
        ),
        OptimizerSpec(
            "apollo_adamw",
            build_apollo_adamw,
            estimate_apollo_adamw,
            "apollo_adamw",
            apollo_trainer_args,
            # its path puts betas and eps in the projected group only, and passes none of the others
            trainer_fixed=APOLLO_TRAINER_FIXED,
            requires=("apollo_torch",),
            step_temporaries=(2, 0),
        ),
        OptimizerSpec("lomo", build_lomo, estimate_lomo, "lomo", requires=("lomo_optim",), in_backward=LOMO),
        OptimizerSpec(
            "adalomo",
            build_adalomo,
            estimate_adalomo,
            "adalomo",
            requires=("lomo_optim",),
            in_backward=LOMO,
            needs_cuda=ADALOMO_NEEDS_CUDA,
        ),
        OptimizerSpec(
            "galore_adamw_layerwise",
            build_galore_adamw_layerwise,
            estimate_galore_adamw,  # per parameter the same state as galore_adamw's
            "galore_adamw_layerwise",
            galore_layerwise_trainer_args,
            # its path gives each per-parameter optimizer the rate alone: galore-torch's defaults
            trainer_fixed={"betas": [0.9, 0.999], "eps": 1e-6, "correct_bias": True},
            requires=("galore_torch",),
            in_backward=LAYERWISE,
        ),
        OptimizerSpec(
            "galore_adafactor_layerwise",
            build_galore_adafactor_layerwise,
            estimate_galore_adafactor,  # per parameter the same state as galore_adafactor's
            # no Trainer string: its own path raises (GaLoreAdafactor refuses the rate it is given beside
            # relative_step=True, its default); the Trainer is handed the object
            requires=("galore_torch",),
            in_backward=LAYERWISE,
        ),
        OptimizerSpec(
            "apollo_adamw_layerwise",
            build_apollo_adamw_layerwise,
            estimate_apollo_adamw,  # per parameter the same state as apollo_adamw's
            "apollo_adamw_layerwise",
            apollo_trainer_args,
            # its path gives each per-parameter optimizer the rate alone: apollo-torch's defaults, and betas
            # and eps in the projected weights' group (as apollo_adamw's)
            trainer_fixed=APOLLO_TRAINER_FIXED,
            requires=("apollo_torch",),
            in_backward=LAYERWISE,
        ),
        # issue 17: the rest of the Trainer's optim= strings that run here (paging needs CUDA: on CPU
        # bitsandbytes falls back to ordinary state, as for paged_adamw_8bit)
        OptimizerSpec(
            "paged_adamw_32bit",
            bnb_builder("adamw", 32, paged=True),
            bnb_estimator(2, 32),
            "paged_adamw_32bit",
            adam_args,
            requires=("bitsandbytes",),
        ),
        OptimizerSpec(
            "paged_lion_8bit",
            bnb_builder("lion", 8, paged=True),
            bnb_estimator(1, 8),
            "paged_lion_8bit",
            adam_args,
            TRAINER_EMBEDDING_FP32,
            {"min_8bit_size": BNB_MIN_8BIT_SIZE},
            ("bitsandbytes",),
        ),
        OptimizerSpec(
            "paged_lion_32bit",
            bnb_builder("lion", 32, paged=True),
            bnb_estimator(1, 32),
            "paged_lion_32bit",
            adam_args,
            requires=("bitsandbytes",),
        ),
        OptimizerSpec(
            "rmsprop_bnb_8bit",
            bnb_builder("rmsprop", 8),
            bnb_estimator(1, 8),
            "rmsprop_bnb_8bit",
            trainer_variant=TRAINER_EMBEDDING_FP32,
            trainer_fixed={**TRAINER_BNB_RMSPROP, "min_8bit_size": BNB_MIN_8BIT_SIZE},
            requires=("bitsandbytes",),
        ),
        OptimizerSpec(
            "rmsprop_bnb_32bit",  # the Trainer's rmsprop_bnb is the same 32-bit optimizer
            bnb_builder("rmsprop", 32),
            bnb_estimator(1, 32),
            "rmsprop_bnb_32bit",
            trainer_fixed=TRAINER_BNB_RMSPROP,
            requires=("bitsandbytes",),
        ),
        OptimizerSpec(
            "galore_adafactor",
            build_galore_adafactor,
            estimate_galore_adafactor,
            "galore_adafactor",
            galore_layerwise_trainer_args,  # (the target modules and GaLore's settings, as for galore_adamw)
            # its path builds Adafactor as optim="adafactor" does: it passes no Adafactor setting
            trainer_fixed=TRAINER_ADAFACTOR,
            requires=("galore_torch",),
            step_temporaries=(2, 0),
        ),
        OptimizerSpec(
            "schedule_free_radam",
            schedule_free_builder("radam"),
            schedule_free_estimator(2),
            "schedule_free_radam",
            schedule_free_trainer_args,
            trainer_fixed={"silent_sgd_phase": True},
            requires=("schedulefree",),
            needs_train_eval_mode=True,
            step_temporaries=(0, 1),
        ),
        OptimizerSpec(
            "schedule_free_sgd",
            schedule_free_builder("sgd"),
            schedule_free_estimator(1),
            "schedule_free_sgd",
            schedule_free_trainer_args,
            trainer_fixed={"momentum": 0.9},  # its path passes no momentum: schedulefree's default
            requires=("schedulefree",),
            needs_train_eval_mode=True,
            step_temporaries=(0, 1),
        ),
        OptimizerSpec("custom", build_custom, estimate_custom),
    ]
}


# conf/optim keys added with issue 20, at the values every run before them used: a config hash leaves them out
# at these values, so that a rerun still recognises the points recorded earlier (pipeline.runner.config_hash)
_BNB_ADDED = {"min_8bit_size": BNB_MIN_8BIT_SIZE}
_TORCHAO_ADDED = {"bf16_stochastic_round": False}
ADDED_SETTINGS: dict[str, dict] = {
    "adamw": {"amsgrad": False},
    "adafactor": TRAINER_ADAFACTOR,
    "adafactor_torch": {"beta2_decay": -0.8, "eps": [None, 1e-3], "d": 1.0},
    "sgd": {"dampening": 0.0, "nesterov": False},
    "adamw_8bit": _BNB_ADDED,
    "paged_adamw_8bit": _BNB_ADDED,
    "lion_8bit": _BNB_ADDED,
    "adamw_torchao_8bit": _TORCHAO_ADDED,
    "adamw_torchao_4bit": _TORCHAO_ADDED,
    "adamw_torchao_fp8": _TORCHAO_ADDED,
    "galore_adamw": {"correct_bias": True},
    "schedule_free_adamw": {"r": 0.0, "weight_lr_power": 2.0},
}


def get(name: str) -> OptimizerSpec:
    if name not in REGISTRY:
        raise KeyError(f"optim.name={name!r} is not registered; choose one of: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def is_custom(optim) -> bool:
    """A user's own optimizer: optim=custom, or an optim config of the user's own naming (a name the registry
    does not hold) that sets `target`, e.g. a file in a folder added with hydra.searchpath whose defaults
    list starts from `custom` (docs/optimizers.md#bring-your-own). Its runs carry the user's name."""
    return optim.name == "custom" or (optim.name not in REGISTRY and optim.get("target") is not None)


def spec_for(optim) -> OptimizerSpec:
    """The registry entry that builds and estimates the optimizer a config's `optim` node describes."""
    return REGISTRY["custom"] if is_custom(optim) else get(optim.name)


def missing_packages(spec: OptimizerSpec) -> list[str]:
    import importlib.util

    return [pkg for pkg in spec.requires if importlib.util.find_spec(pkg) is None]
