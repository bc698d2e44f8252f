"""The registry: every `optim=<name>` the pipeline knows, assembled from the families' own rows.

Each family file ends with `ENTRIES`, a list of `OptimizerSpec` rows written with keywords (name=, build=,
estimate=, trainer_optim=, ...), right below the builders and estimates they name; this file only says which
families there are and in what order, and answers questions about a config (`get`, `spec_for`, `choose`).
The rows live with their family rather than in one long table here so that adding an optimizer is one YAML
(conf/optim/<name>.yaml) and one row beside the code it uses (docs/optimizers.md, "Adding an optimizer"), and
a reader of a family file sees its code and its registered names together. The order below is the order
`REGISTRY` lists its names in (the choices a config error offers, the benchmarks' rows).
"""

from __future__ import annotations

import pipeline.optimizers.adam_mini_optim as adam_mini_optim
import pipeline.optimizers.adam_variants as adam_variants
import pipeline.optimizers.bitsandbytes_optim as bitsandbytes_optim
import pipeline.optimizers.custom as custom
import pipeline.optimizers.in_backward as in_backward
import pipeline.optimizers.lowrank as lowrank
import pipeline.optimizers.schedule_free as schedule_free
import pipeline.optimizers.torch_optim as torch_optim
import pipeline.optimizers.torchao_optim as torchao_optim
import pipeline.optimizers.transformers_optim as transformers_optim
from pipeline.optimizers.spec import Choice, OptimizerSpec

FAMILIES = [
    torch_optim,  # torch.optim's own: adamw, adamw_fused, adafactor_torch, sgd, adagrad, rmsprop, muon
    transformers_optim,  # transformers' Adafactor
    bitsandbytes_optim,  # 8-bit / 32-bit / paged AdamW, Lion, RMSprop, AdEMAMix
    torchao_optim,  # torchao's low-bit AdamW
    lowrank,  # GaLore and APOLLO: state for a low-rank projection of the gradient
    adam_mini_optim,  # Adam-mini
    schedule_free,  # schedule-free AdamW, RAdam, SGD
    adam_variants,  # StableAdamW, CAME, Prodigy
    in_backward,  # LOMO, AdaLomo, layer-wise GaLore and APOLLO: no separate step
    custom,  # bring your own (optim.target), estimated by the meta-device step
]


def assemble(families) -> dict[str, OptimizerSpec]:
    """name -> row, in the families' order; a name registered twice is an error at import."""
    registry: dict[str, OptimizerSpec] = {}
    for family in families:
        for spec in family.ENTRIES:
            if spec.name in registry:
                raise ValueError(f"optimizer {spec.name!r} is registered twice ({family.__name__})")
            registry[spec.name] = spec
    return registry


REGISTRY: dict[str, OptimizerSpec] = assemble(FAMILIES)

# name -> the conf/optim keys added after its first runs, at the values those runs used (OptimizerSpec.
# added_settings): pipeline.runner.config_hash leaves them out at these values
ADDED_SETTINGS: dict[str, dict] = {name: s.added_settings for name, s in REGISTRY.items() if s.added_settings}


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


def choose(cfg) -> Choice:
    """The registry's one answer for a job's config: its entry (`spec_for`), the Trainer's `optim=` string
    when the job runs on the Trainer and that string's path carries the config's settings (None: the backend
    builds `spec.build`'s object), and the variant the estimate follows (`OptimizerSpec.variant`). With
    train.optimizer_in_backward, the entry's optimizer stepped inside backward, one per parameter; with
    train.offload=optimizer, its state and step on the host (`offloaded`)."""
    spec = spec_for(cfg.optim)
    if cfg.train.get("optimizer_in_backward"):
        spec = in_backward.optimizer_in_backward(spec)
    if cfg.train.get("offload") == "optimizer":
        spec = offloaded(spec)
    string = spec.trainer_string(cfg) if cfg.backend.name == "trainer" else None
    return Choice(spec=spec, trainer_optim=string, variant=spec.trainer_variant if string else None)


def offloaded(spec: OptimizerSpec) -> OptimizerSpec:
    """train.offload=optimizer: `spec`'s optimizer with its state and step on the host
    (pipeline.offload.OffloadedOptimizer). The Trainer is handed the object; the state is `spec`'s."""
    import dataclasses

    from pipeline.offload import OffloadedOptimizer

    def build(model, cfg):
        return OffloadedOptimizer(spec.build(model, cfg))

    return dataclasses.replace(spec, build=build, trainer_optim=None)


def missing_packages(spec: OptimizerSpec) -> list[str]:
    import importlib.util

    return [pkg for pkg in spec.requires if importlib.util.find_spec(pkg) is None]
