"""Schedule-free optimizers (the schedulefree package): AdamW, RAdam and SGD without a learning-rate
schedule. Both backends switch them between `train()` and `eval()` (`OptimizerSpec.needs_train_eval_mode`);
their state is `z` (+ `exp_avg_sq`) per parameter, their step count per group."""

from __future__ import annotations

from pipeline import StateSize, learning_rate
from pipeline.optimizers.spec import OptimizerSpec, adam_args, optim_args, param_groups, size, total


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


# --- the registry's rows ----------------------------------------------------------------------------------

ENTRIES = [
    OptimizerSpec(
        name="schedule_free_adamw",
        build=schedule_free_builder("adamw"),
        estimate=schedule_free_estimator(2),
        trainer_optim="schedule_free_adamw",
        trainer_args=schedule_free_trainer_args,
        added_settings={"r": 0.0, "weight_lr_power": 2.0},
        requires=("schedulefree",),
        needs_train_eval_mode=True,
        step_temporaries=(0, 1),
    ),
    OptimizerSpec(
        name="schedule_free_radam",
        build=schedule_free_builder("radam"),
        estimate=schedule_free_estimator(2),
        trainer_optim="schedule_free_radam",
        trainer_args=schedule_free_trainer_args,
        trainer_fixed={"silent_sgd_phase": True},
        requires=("schedulefree",),
        needs_train_eval_mode=True,
        step_temporaries=(0, 1),
    ),
    OptimizerSpec(
        name="schedule_free_sgd",
        build=schedule_free_builder("sgd"),
        estimate=schedule_free_estimator(1),
        trainer_optim="schedule_free_sgd",
        trainer_args=schedule_free_trainer_args,
        trainer_fixed={"momentum": 0.9},  # its path passes no momentum: schedulefree's default
        requires=("schedulefree",),
        needs_train_eval_mode=True,
        step_temporaries=(0, 1),
    ),
]
