"""transformers' Adafactor, with the settings the Trainer's `optim="adafactor"` builds it with by default.
`adafactor_built` and `adafactor_state` serve galore-torch's Adafactor too (`lowrank`, `in_backward`), which
has the same constructor and the same state."""

from __future__ import annotations

from math import prod

from pipeline import StateSize, learning_rate
from pipeline.optimizers.spec import FP32, INT64, OptimizerSpec, factored, param_groups, size, total


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


# --- the registry's rows ----------------------------------------------------------------------------------

ENTRIES = [
    OptimizerSpec(
        name="adafactor",
        build=build_adafactor,
        estimate=estimate_adafactor,
        trainer_optim="adafactor",
        trainer_fixed=TRAINER_ADAFACTOR,
        added_settings=TRAINER_ADAFACTOR,
        step_temporaries=(2, 0),
    ),
]
