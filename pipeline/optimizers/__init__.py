"""The optimizer catalog: one name -> one implementation and settings, on both backends, with the analytic
state estimate that must equal the measured state to the byte.

Read it in this order:
- `spec.py`: the row type (`OptimizerSpec`) and what every family shares: parameter infos and sizes, the
  Trainer's parameter groups, the settings plumbing;
- one file per family, each its builders, estimates and, last, its registry rows (`ENTRIES`):
  `torch_optim.py` (torch.optim's own, Muon with AdamW), `transformers_optim.py` (Adafactor),
  `bitsandbytes_optim.py`, `torchao_optim.py`, `lowrank.py` (GaLore, APOLLO), `adam_mini_optim.py`,
  `schedule_free.py`, `adam_variants.py` (StableAdamW, CAME, Prodigy), `in_backward.py` (LOMO, AdaLomo,
  layer-wise), `custom.py` (bring your own, the meta-device estimate);
- `registry.py`: the families in order -> `REGISTRY`, and the questions a config asks of it (`get`,
  `spec_for`, `choose`).
A file named after the package it wraps ends in `_optim`, so that the file is never mistaken for the package.

Torch and the optimizer packages are imported inside the functions, so the config can be validated before
any heavy import (importing this package imports neither). This file re-exports the names used outside the
package: `from pipeline.optimizers import get, spec_for, REGISTRY`.
"""

from pipeline.optimizers.bitsandbytes_optim import TRAINER_EMBEDDING_FP32
from pipeline.optimizers.custom import (
    MetaStepFailed,
    check_custom,
    meta_copy,
    meta_estimate,
    meta_model,
    source_stamp,
)
from pipeline.optimizers.registry import (
    ADDED_SETTINGS,
    REGISTRY,
    choose,
    get,
    is_custom,
    missing_packages,
    spec_for,
)
from pipeline.optimizers.spec import (
    EXTRA,
    LAYERWISE,
    LOMO,
    Choice,
    OptimizerSpec,
    ParamInfo,
    built_settings,
    decay_parameter_names,
    param_infos,
    settings,
)

__all__ = [
    "ADDED_SETTINGS",
    "EXTRA",
    "LAYERWISE",
    "LOMO",
    "REGISTRY",
    "TRAINER_EMBEDDING_FP32",
    "Choice",
    "MetaStepFailed",
    "OptimizerSpec",
    "ParamInfo",
    "built_settings",
    "check_custom",
    "choose",
    "decay_parameter_names",
    "get",
    "is_custom",
    "meta_copy",
    "meta_estimate",
    "meta_model",
    "missing_packages",
    "param_infos",
    "settings",
    "source_stamp",
    "spec_for",
]
