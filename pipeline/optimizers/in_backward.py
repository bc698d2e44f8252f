"""Optimizers that update inside the backward pass, with no separate step: LOMO and AdaLomo (lomo-optim: a
gradient hook updates each parameter and frees its gradient; `OptimizerSpec.in_backward` LOMO), and the
Trainer's layer-wise GaLore and APOLLO (one optimizer per parameter, stepped from its post-accumulate-grad
hook; LAYERWISE). `step_without_backward` runs the update the way a backend drives it, without a backward
pass (the meta-device estimate)."""

from __future__ import annotations

from pipeline import StateSize, learning_rate
from pipeline.optimizers.lowrank import (
    APOLLO_GROUP_KEYS,
    APOLLO_TRAINER_FIXED,
    GALORE_TRAINER_FIXED,
    apollo_trainer_args,
    estimate_apollo_adamw,
    estimate_galore_adafactor,
    estimate_galore_adamw,
    galore_kwargs,
    galore_targets,
    galore_trainer_args,
)
from pipeline.optimizers.spec import FP32, LAYERWISE, LOMO, OptimizerSpec, size, total
from pipeline.optimizers.transformers_optim import adafactor_built

ADALOMO_NEEDS_CUDA = "AdaLomo (lomo-optim) allocates its state with .cuda()"
# lomo-optim's AdaLomo allocates its second moment for every parameter of the model, trainable or not
ADALOMO_FROZEN_BASE = "it keeps a second moment for every weight of the model, the frozen base's too"

# --- LOMO and AdaLomo -------------------------------------------------------------------------------------


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


# --- layer-wise: one optimizer per parameter --------------------------------------------------------------


def build_layerwise(model, cfg, make, projected: dict):
    """The Trainer's layer-wise optimizers (its `_setup_low_rank_optimizer`): one optimizer per parameter,
    `make(groups)`, in its order (the other parameters, then the projected weights, whose group adds
    `projected`), each stepped and its gradient freed from that parameter's post-accumulate-grad hook, behind
    transformers' LayerWiseDummyOptimizer (whose step and zero_grad do nothing)."""
    targets = galore_targets(model, cfg)
    named = list(model.named_parameters())
    optimizer_dict = {p: make([{"params": [p]}]) for n, p in named if n not in targets}
    for n, p in named:
        if n in targets:
            optimizer_dict[p] = make([{"params": [p], **projected}])
    return stepped_in_backward(optimizer_dict, cfg)


def stepped_in_backward(optimizer_dict: dict, cfg):
    """Each parameter's optimizer stepped, and the gradient freed, from the parameter's post-accumulate-grad
    hook, behind transformers' LayerWiseDummyOptimizer (its step and zero_grad do nothing)."""
    from transformers.trainer_pt_utils import LayerWiseDummyOptimizer

    hook = step_and_free(optimizer_dict)
    for p in optimizer_dict:
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(hook)
    return LayerWiseDummyOptimizer(optimizer_dict=optimizer_dict, lr=learning_rate(cfg))


def step_and_free(optimizer_dict: dict):
    """The post-accumulate-grad hook that steps a parameter's own optimizer and frees its gradient (a plan's
    simulated step inside backward runs the same one)."""

    def hook(p):
        if p.grad is not None:
            optimizer_dict[p].step()
            optimizer_dict[p].zero_grad()

    return hook


def per_parameter(spec: OptimizerSpec, model, cfg) -> dict:
    """One optimizer for each parameter `spec.build` trains, of its class and with its parameter group's
    settings (the weight decay or none, the rate, the betas)."""
    whole = spec.build(model, cfg)
    return {
        p: type(whole)([{**{k: v for k, v in group.items() if k != "params"}, "params": [p]}])
        for group in whole.param_groups
        for p in group["params"]
    }


def optimizer_in_backward(spec: OptimizerSpec) -> OptimizerSpec:
    """train.optimizer_in_backward: `spec`'s optimizer one per parameter (`per_parameter`), each stepped from
    its parameter's post-accumulate-grad hook and the gradient freed there, as torch's tutorial on fusing the
    optimizer step into the backward pass does and the layer-wise optimizers are run: no gradient of the
    whole model is ever held. The Trainer is handed the object; the state is `spec`'s."""
    import dataclasses

    def build(model, cfg):
        return stepped_in_backward(per_parameter(spec, model, cfg), cfg)

    return dataclasses.replace(spec, build=build, trainer_optim=None, in_backward=LAYERWISE)


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


# --- the registry's rows ----------------------------------------------------------------------------------

ENTRIES = [
    OptimizerSpec(
        name="lomo",
        build=build_lomo,
        estimate=estimate_lomo,
        trainer_optim="lomo",
        requires=("lomo_optim",),
        in_backward=LOMO,
    ),
    OptimizerSpec(
        name="adalomo",
        build=build_adalomo,
        estimate=estimate_adalomo,
        trainer_optim="adalomo",
        requires=("lomo_optim",),
        in_backward=LOMO,
        needs_cuda=ADALOMO_NEEDS_CUDA,
        frozen_base=ADALOMO_FROZEN_BASE,
    ),
    OptimizerSpec(
        name="galore_adamw_layerwise",
        build=build_galore_adamw_layerwise,
        estimate=estimate_galore_adamw,  # per parameter the same state as galore_adamw's
        trainer_optim="galore_adamw_layerwise",
        trainer_args=galore_trainer_args,
        # its path gives each per-parameter optimizer the rate alone: galore-torch's defaults
        trainer_fixed=GALORE_TRAINER_FIXED,
        requires=("galore_torch",),
        in_backward=LAYERWISE,
    ),
    OptimizerSpec(
        name="galore_adafactor_layerwise",
        build=build_galore_adafactor_layerwise,
        estimate=estimate_galore_adafactor,  # per parameter the same state as galore_adafactor's
        # no Trainer string: its own path raises (GaLoreAdafactor refuses the rate it is given beside
        # relative_step=True, its default); the Trainer is handed the object
        requires=("galore_torch",),
        in_backward=LAYERWISE,
    ),
    OptimizerSpec(
        name="apollo_adamw_layerwise",
        build=build_apollo_adamw_layerwise,
        estimate=estimate_apollo_adamw,  # per parameter the same state as apollo_adamw's
        trainer_optim="apollo_adamw_layerwise",
        trainer_args=apollo_trainer_args,
        # its path gives each per-parameter optimizer the rate alone: apollo-torch's defaults, and betas
        # and eps in the projected weights' group (as apollo_adamw's)
        trainer_fixed=APOLLO_TRAINER_FIXED,
        requires=("apollo_torch",),
        in_backward=LAYERWISE,
    ),
]
