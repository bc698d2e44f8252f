"""Adam variants, each from its authors' own package: StableAdamW (torch-optimi: AdamW with update clipping
and Kahan summation), CAME (came-pytorch: factored moments with a confidence residual) and Prodigy
(prodigyopt: estimates its own step size). One builder and one estimate each."""

from __future__ import annotations

from math import ceil

from pipeline import StateSize, learning_rate
from pipeline.optimizers.spec import (
    FP32,
    INT64,
    ZERO_AT_BUILD,
    OptimizerSpec,
    adam_args,
    factored,
    optim_args,
    param_groups,
    size,
    total,
)

# --- StableAdamW ------------------------------------------------------------------------------------------


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


# --- CAME -------------------------------------------------------------------------------------------------


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


# --- Prodigy ----------------------------------------------------------------------------------------------


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


# --- the registry's rows ----------------------------------------------------------------------------------

ENTRIES = [
    OptimizerSpec(
        name="stable_adamw",
        build=build_stable_adamw,
        estimate=estimate_stable_adamw,
        trainer_optim="stable_adamw",
        trainer_args=stable_adamw_trainer_args,
        trainer_fixed={"decouple_lr": False, "kahan_sum": None},
        requires=("optimi",),
        step_temporaries=(2, 0),
    ),
    OptimizerSpec(  # no Trainer string: always the object
        name="came",
        build=build_came,
        estimate=estimate_came,
        requires=("came_pytorch",),
        step_temporaries=(3, 0),
    ),
    OptimizerSpec(  # no Trainer string: always the object
        name="prodigy",
        build=build_prodigy,
        estimate=estimate_prodigy,
        requires=("prodigyopt",),
        step_temporaries=(2, 0),
        estimates_step_size=True,
    ),
]
