"""bitsandbytes' optimizers: AdamW, Lion, RMSprop and AdEMAMix with 8-bit or 32-bit state, AdamW and Lion also
paged (in CUDA unified memory; off CUDA bitsandbytes falls back to ordinary state). An 8-bit moment is uint8
codes with an fp32 absmax per block of 256, and small tensors keep fp32 state. The Trainer's 8-bit path keeps
the state of embedding weights in fp32 (its variant, `TRAINER_EMBEDDING_FP32`)."""

from __future__ import annotations

from math import ceil

from pipeline import StateSize, learning_rate
from pipeline.optimizers.spec import (
    FP32,
    INT64,
    OptimizerSpec,
    adam_args,
    optim_args,
    param_groups,
    size,
    total,
)

BNB_MIN_8BIT_SIZE, BNB_BLOCK = 4096, 256  # bitsandbytes: smaller tensors keep 32-bit state; absmax per block
BNB_PAGED_MIN = 100_000  # a paged optimizer pages the moments of tensors of at least this many elements
BNB_QMAP = 256  # bitsandbytes' quantization map (fp32), one per state kind, shared by every parameter
TRAINER_EMBEDDING_FP32 = (
    "trainer_embedding_fp32"  # the Trainer's bnb 8-bit path keeps nn.Embedding state fp32
)


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


def eight_bit(p, cfg, bits: int, variant=None) -> bool:
    """Whether bitsandbytes keeps this parameter's moments in 8 bits: an 8-bit optimizer, a tensor of at least
    `optim.min_8bit_size` (4096) elements, and not an embedding weight in the Trainer's variant."""
    eight = bits == 8 and p.numel >= min_8bit_size(cfg)
    return eight and not (variant == TRAINER_EMBEDDING_FP32 and p.is_embedding)


def bnb_estimator(states: int, bits: int, maps: int | None = None):
    """bitsandbytes: `states` moments per parameter; 8-bit ones as uint8 codes + an fp32 absmax per block of
    256, except tensors under `optim.min_8bit_size` (4096) elements (and, in the Trainer's variant, embedding
    weights) which keep fp32 state; one shared fp32 quantization map per moment; `step` a Python int."""

    def estimate(params, cfg, variant=None, model_config=None) -> StateSize:
        parts, any_8bit = [], False
        for p in params:
            eight = eight_bit(p, cfg, bits, variant)
            any_8bit |= eight
            moment = size((p.numel, 1), (ceil(p.numel / BNB_BLOCK), FP32)) if eight else size((p.numel, FP32))
            parts += [moment] * states + [size((1, INT64))]
        if any_8bit:
            parts.append(size(((states if maps is None else maps) * BNB_QMAP, FP32)))
        return total(parts)

    return estimate


def bnb_paged(states: int, bits: int):
    """The part of `bnb_estimator`'s state a paged optimizer keeps in CUDA unified memory, outside the caching
    allocator: the moments (uint8 codes, or fp32 where they stay 32-bit) of each tensor of at least
    BNB_PAGED_MIN elements (bitsandbytes' `get_state_buffer`); absmax, maps and smaller tensors' moments stay
    on the device."""

    def estimate(params, cfg, variant=None, model_config=None) -> StateSize:
        paged = [p for p in params if p.numel >= BNB_PAGED_MIN]
        return total(size((states * p.numel, 1 if eight_bit(p, cfg, bits, variant) else FP32)) for p in paged)

    return estimate


# --- AdEMAMix ---------------------------------------------------------------------------------------------


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


# --- the registry's rows ----------------------------------------------------------------------------------

BNB = ("bitsandbytes",)
# the Trainer's 8-bit paths: they keep embedding state fp32 (its variant), and cannot be told another size
TRAINER_8BIT_PATH = {
    "trainer_variant": TRAINER_EMBEDDING_FP32,
    "trainer_fixed": {"min_8bit_size": BNB_MIN_8BIT_SIZE},
}
ADDED = {"min_8bit_size": BNB_MIN_8BIT_SIZE}  # (added_settings of the 8-bit ones registered first)

ENTRIES = [
    # AdamW
    OptimizerSpec(
        name="adamw_8bit",
        build=bnb_builder("adamw", 8),
        estimate=bnb_estimator(2, 8),
        trainer_optim="adamw_bnb_8bit",
        trainer_args=adam_args,
        **TRAINER_8BIT_PATH,
        added_settings=ADDED,
        requires=BNB,
    ),
    OptimizerSpec(
        name="paged_adamw_8bit",
        build=bnb_builder("adamw", 8, paged=True),
        estimate=bnb_estimator(2, 8),
        paged_estimate=bnb_paged(2, 8),
        trainer_optim="paged_adamw_8bit",
        trainer_args=adam_args,
        **TRAINER_8BIT_PATH,
        added_settings=ADDED,
        requires=BNB,
    ),
    OptimizerSpec(
        name="paged_adamw_32bit",
        build=bnb_builder("adamw", 32, paged=True),
        estimate=bnb_estimator(2, 32),
        paged_estimate=bnb_paged(2, 32),
        trainer_optim="paged_adamw_32bit",
        trainer_args=adam_args,
        requires=BNB,
    ),
    # Lion: one moment
    OptimizerSpec(
        name="lion_8bit",
        build=bnb_builder("lion", 8),
        estimate=bnb_estimator(1, 8),
        trainer_optim="lion_8bit",
        trainer_args=adam_args,
        **TRAINER_8BIT_PATH,
        added_settings=ADDED,
        requires=BNB,
    ),
    OptimizerSpec(
        name="lion_32bit",
        build=bnb_builder("lion", 32),
        estimate=bnb_estimator(1, 32),
        trainer_optim="lion_32bit",
        trainer_args=adam_args,
        requires=BNB,
    ),
    OptimizerSpec(
        name="paged_lion_8bit",
        build=bnb_builder("lion", 8, paged=True),
        estimate=bnb_estimator(1, 8),
        paged_estimate=bnb_paged(1, 8),
        trainer_optim="paged_lion_8bit",
        trainer_args=adam_args,
        **TRAINER_8BIT_PATH,
        requires=BNB,
    ),
    OptimizerSpec(
        name="paged_lion_32bit",
        build=bnb_builder("lion", 32, paged=True),
        estimate=bnb_estimator(1, 32),
        paged_estimate=bnb_paged(1, 32),
        trainer_optim="paged_lion_32bit",
        trainer_args=adam_args,
        requires=BNB,
    ),
    # RMSprop: its Trainer path can carry no setting (TRAINER_BNB_RMSPROP)
    OptimizerSpec(
        name="rmsprop_bnb_8bit",
        build=bnb_builder("rmsprop", 8),
        estimate=bnb_estimator(1, 8),
        trainer_optim="rmsprop_bnb_8bit",
        trainer_variant=TRAINER_EMBEDDING_FP32,
        trainer_fixed={**TRAINER_BNB_RMSPROP, "min_8bit_size": BNB_MIN_8BIT_SIZE},
        requires=BNB,
    ),
    OptimizerSpec(
        name="rmsprop_bnb_32bit",  # the Trainer's rmsprop_bnb is the same 32-bit optimizer
        build=bnb_builder("rmsprop", 32),
        estimate=bnb_estimator(1, 32),
        trainer_optim="rmsprop_bnb_32bit",
        trainer_fixed=TRAINER_BNB_RMSPROP,
        requires=BNB,
    ),
    # AdEMAMix: three moments (fast and slow EMA, second moment)
    OptimizerSpec(
        name="ademamix",
        build=build_ademamix(32),
        estimate=bnb_estimator(3, 32),
        trainer_optim="ademamix",
        trainer_args=ademamix_trainer_args,
        requires=BNB,
    ),
    OptimizerSpec(
        name="ademamix_8bit",
        build=build_ademamix(8),
        estimate=bnb_estimator(3, 8, maps=2),  # state1 holds both first moments (one map), state2 the second
        trainer_optim="ademamix_8bit",
        trainer_args=ademamix_trainer_args,
        **TRAINER_8BIT_PATH,
        requires=BNB,
    ),
]
