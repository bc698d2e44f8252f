"""torch.optim's own optimizers: AdamW (and its fused kernel), Adafactor, SGD, Adagrad, RMSprop, and Muon for
the hidden weights with AdamW beside it (`pipeline.muon`). Their state is plain tensors of the parameter's
dtype, with a float32 `step` tensor where torch keeps one."""

from __future__ import annotations

from pipeline import StateSize, learning_rate
from pipeline.optimizers.spec import (
    FP32,
    OptimizerSpec,
    ParamInfo,
    adam_args,
    decay_parameter_names,
    factored,
    optim_args,
    param_groups,
    param_infos,
    size,
    total,
)

# --- AdamW ------------------------------------------------------------------------------------------------


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


def build_adamw_fused(model, cfg):
    """torch.optim.AdamW(fused=True): one fused kernel for all tensors (CPU and CUDA), the same state."""
    import torch

    groups = param_groups(model, cfg.train.weight_decay)
    o = cfg.optim
    return torch.optim.AdamW(
        groups, lr=learning_rate(cfg), betas=tuple(o.betas), eps=o.eps, amsgrad=o.amsgrad, fused=True
    )


# --- Adafactor --------------------------------------------------------------------------------------------


def build_adafactor_torch(model, cfg):
    import torch

    groups = param_groups(model, cfg.train.weight_decay)
    o = cfg.optim
    return torch.optim.Adafactor(
        groups, lr=learning_rate(cfg), beta2_decay=o.beta2_decay, eps=tuple(o.eps), d=o.d
    )


def estimate_adafactor_torch(params, cfg, variant=None, model_config=None) -> StateSize:
    # row_var + col_var for matrices, variance for vectors (parameter dtype), a float32 `step` tensor
    return total(
        size((factored(p.shape) if len(p.shape) >= 2 else p.numel, p.itemsize), (1, FP32)) for p in params
    )


# --- SGD --------------------------------------------------------------------------------------------------


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


# --- Adagrad and RMSprop ----------------------------------------------------------------------------------


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


# --- Muon (hidden weights) with AdamW (the rest), one object ----------------------------------------------


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


# --- the registry's rows ----------------------------------------------------------------------------------

ENTRIES = [
    OptimizerSpec(
        name="adamw",
        build=build_adamw,
        estimate=estimate_adamw,
        trainer_optim="adamw_torch",
        trainer_args=adam_args,
        trainer_fixed={"amsgrad": False},
        added_settings={"amsgrad": False},
        step_temporaries=(2, 0),
    ),
    OptimizerSpec(
        name="adamw_fused",
        build=build_adamw_fused,
        estimate=estimate_adamw,
        trainer_optim="adamw_torch_fused",
        trainer_args=adam_args,
        trainer_fixed={"amsgrad": False},
        step_temporaries=(0, 2),
    ),
    OptimizerSpec(  # no Trainer string: always the object
        name="adafactor_torch",
        build=build_adafactor_torch,
        estimate=estimate_adafactor_torch,
        added_settings={"beta2_decay": -0.8, "eps": [None, 1e-3], "d": 1.0},
        step_temporaries=(1, 0),
    ),
    OptimizerSpec(
        name="sgd",
        build=build_sgd,
        estimate=estimate_sgd,
        trainer_optim="sgd",
        trainer_args=sgd_trainer_args,
        added_settings={"dampening": 0.0, "nesterov": False},
    ),
    OptimizerSpec(
        name="adagrad",
        build=build_adagrad,
        estimate=estimate_adagrad,
        trainer_optim="adagrad",
        trainer_args=lambda cfg: {"optim_args": optim_args(lr_decay=cfg.optim.lr_decay, eps=cfg.optim.eps)},
        trainer_fixed={"initial_accumulator_value": 0.0},
        step_temporaries=(2, 0),
    ),
    OptimizerSpec(
        name="rmsprop",
        build=build_rmsprop,
        estimate=estimate_rmsprop,
        trainer_optim="rmsprop",
        trainer_args=lambda cfg: {
            "optim_args": optim_args(
                momentum=cfg.optim.momentum,
                alpha=cfg.optim.alpha,
                eps=cfg.optim.eps,
                centered=cfg.optim.centered,
            )
        },
        step_temporaries=(1, 0),
    ),
    OptimizerSpec(name="muon", build=build_muon, estimate=estimate_muon, step_temporaries=(2, 0)),
]
