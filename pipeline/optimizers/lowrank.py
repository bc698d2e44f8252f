"""Low-rank projection: GaLore (galore-torch's AdamW and Adafactor) and APOLLO (apollo-torch's AdamW). The
`nn.Linear` weights that `optim.target_modules` names keep their optimizer state for a rank-`optim.rank`
projection of the gradient, plus the projector; every other parameter is optimized as usual. The groups are
the Trainer's (everything else, then the projected weights). Their layer-wise forms are in `in_backward`."""

from __future__ import annotations

from math import prod

from pipeline import StateSize, learning_rate
from pipeline.optimizers.spec import (
    FP32,
    INT64,
    OptimizerSpec,
    ParamInfo,
    adam_args,
    optim_args,
    scalar_bytes,
    size,
    total,
)
from pipeline.optimizers.transformers_optim import TRAINER_ADAFACTOR, adafactor_built, adafactor_state

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


def galore_trainer_args(cfg) -> dict:
    """The target modules and GaLore's group settings (optim_args), as for galore_adamw."""
    return {
        "optim_target_modules": list(cfg.optim.target_modules),
        "optim_args": optim_args(**galore_kwargs(cfg)),
    }


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


# --- APOLLO -----------------------------------------------------------------------------------------------

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


# --- the registry's rows ----------------------------------------------------------------------------------

# the Trainer's GaLore paths pass no betas, eps or correct_bias: galore-torch's defaults
GALORE_TRAINER_FIXED = {"betas": [0.9, 0.999], "eps": 1e-6, "correct_bias": True}

ENTRIES = [
    OptimizerSpec(
        name="galore_adamw",
        build=build_galore_adamw,
        estimate=estimate_galore_adamw,
        trainer_optim="galore_adamw",
        trainer_args=lambda cfg: {**adam_args(cfg), **galore_trainer_args(cfg)},
        trainer_fixed=GALORE_TRAINER_FIXED,
        added_settings={"correct_bias": True},
        requires=("galore_torch",),
        step_temporaries=(2, 0),
    ),
    OptimizerSpec(
        name="galore_adafactor",
        build=build_galore_adafactor,
        estimate=estimate_galore_adafactor,
        trainer_optim="galore_adafactor",
        trainer_args=galore_trainer_args,  # (the target modules and GaLore's settings)
        # its path builds Adafactor as optim="adafactor" does: it passes no Adafactor setting
        trainer_fixed=TRAINER_ADAFACTOR,
        requires=("galore_torch",),
        step_temporaries=(2, 0),
    ),
    OptimizerSpec(
        name="apollo_adamw",
        build=build_apollo_adamw,
        estimate=estimate_apollo_adamw,
        trainer_optim="apollo_adamw",
        trainer_args=apollo_trainer_args,
        # its path puts betas and eps in the projected group only, and passes none of the others
        trainer_fixed=APOLLO_TRAINER_FIXED,
        requires=("apollo_torch",),
        step_temporaries=(2, 0),
    ),
]
