"""Optimizer registry: one name -> one implementation and settings, on both backends.

Each entry gives the Trainer's ``optim=`` string (the Trainer backend uses it), a factory that builds the
same optimizer directly (the Accelerator backend), and an analytic model of its state from parameter
shapes alone (``estimated_optimizer_state_mb``). Torch and transformers are imported inside the functions
so that the config can be validated before heavy imports.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from math import prod

from pipeline import StateSize

# (shape, bytes per element) of each trainable parameter
ParamLayout = list[tuple[tuple[int, ...], int]]

FP32, INT64 = 4, 8


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    trainer_optim: str
    build: Callable  # (param_groups, cfg) -> torch.optim.Optimizer
    estimate_state: Callable[[ParamLayout], StateSize]


def _adamw(param_groups, cfg):
    import torch

    return torch.optim.AdamW(param_groups, lr=cfg.train.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps)


def _adamw_state(layout: ParamLayout) -> StateSize:
    # exp_avg and exp_avg_sq in the parameter's dtype, plus a float32 `step` tensor per parameter
    numel = sum(2 * prod(shape) + 1 for shape, _ in layout)
    nbytes = sum(2 * prod(shape) * size + FP32 for shape, size in layout)
    return StateSize(numel, nbytes)


def _adafactor(param_groups, cfg):
    from transformers.optimization import Adafactor

    # what TrainingArguments(optim="adafactor") builds
    return Adafactor(param_groups, lr=cfg.train.lr, scale_parameter=False, relative_step=False)


def _adafactor_state(layout: ParamLayout) -> StateSize:
    # fp32 statistics: row + column means for matrices (n + m), the full square for vectors; beta1 is None
    # so no exp_avg; `RMS` is a float32 0-d tensor and `step` a Python int (int64).
    numel = nbytes = 0
    for shape, _ in layout:
        stats = prod(shape[:-1]) + prod(shape[:-2]) * shape[-1] if len(shape) >= 2 else prod(shape)
        numel += stats + 2
        nbytes += stats * FP32 + FP32 + INT64
    return StateSize(numel, nbytes)


REGISTRY: dict[str, OptimizerSpec] = {
    spec.name: spec
    for spec in [
        OptimizerSpec("adamw", "adamw_torch", _adamw, _adamw_state),
        OptimizerSpec("adafactor", "adafactor", _adafactor, _adafactor_state),
    ]
}


def get(name: str) -> OptimizerSpec:
    if name not in REGISTRY:
        raise KeyError(f"optim.name={name!r} is not registered; choose one of: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def param_layout(params: Iterable) -> ParamLayout:
    return [(tuple(p.shape), p.element_size()) for p in params if p.requires_grad]


def param_groups(model, weight_decay: float) -> list[dict]:
    """The Trainer's grouping: weight decay on all weights but biases and LayerNorm."""
    from transformers import Trainer

    # get_decay_parameter_names does not use `self`; calling it keeps the rule identical to the Trainer's
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
