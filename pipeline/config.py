"""Checks of user-facing config values, run before any heavy import: one clear line per problem."""

from __future__ import annotations

from numbers import Real
from pathlib import Path

from omegaconf import DictConfig, MissingMandatoryValue, OmegaConf

from pipeline.data import FILE_BUILDERS, PACKAGED
from pipeline.optimizers import EXTRA, REGISTRY, missing_packages

BACKENDS = ("trainer", "accelerator")
PRECISIONS = ("fp32", "bf16", "fp16", "bf16_pure")
PADDINGS = ("longest", "max_length")
DATA_LOADERS = (*PACKAGED, "files", "hub")


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key, the value and what is allowed."""


def _value(cfg: DictConfig, key: str):
    try:
        return OmegaConf.select(cfg, key, throw_on_missing=True)
    except MissingMandatoryValue:
        raise ConfigError(f"{key} is required: set it on the command line ({key}=...)") from None


def _check(cfg: DictConfig, key: str, ok, allowed: str) -> None:
    value = _value(cfg, key)
    if isinstance(value, bool) or not ok(value):
        raise ConfigError(f"{key}={value!r} is invalid: {allowed}")


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError for the first bad value."""
    choices = {
        "optim.name": REGISTRY,
        "backend.name": BACKENDS,
        "data.loader": DATA_LOADERS,
        "train.precision": PRECISIONS,
        "train.padding": PADDINGS,
    }
    for key, names in choices.items():
        _check(cfg, key, lambda v, names=names: v in names, f"allowed values are {', '.join(names)}")
    missing = missing_packages(REGISTRY[cfg.optim.name])
    if missing:
        raise ConfigError(
            f"optim={cfg.optim.name} needs the package(s) {', '.join(missing)}: "
            f"install the optional extra with pip install -e '.[{EXTRA}]' (make install does)"
        )
    for key in ("batch_size", "train.max_steps", "train.max_length", "eval.batch_size"):
        _check(cfg, key, lambda v: isinstance(v, int) and v > 0, "must be a positive integer")
    _check(cfg, "seed", lambda v: isinstance(v, int) and v >= 0, "must be an integer >= 0")
    _check(cfg, "train.lr", lambda v: isinstance(v, Real) and v > 0, "must be a number > 0")
    positions = cfg.model.max_tokens
    _check(
        cfg,
        "train.max_length",
        lambda v: v <= positions,
        f"model {cfg.model.name} takes at most {positions} tokens",
    )
    if cfg.data.loader == "files":
        for key in ("data.train_file", "data.eval_file"):
            _check(
                cfg,
                key,
                lambda v: Path(v).suffix in FILE_BUILDERS,
                f"file type must be {', '.join(FILE_BUILDERS)}",
            )
            _check(cfg, key, lambda v: Path(v).is_file(), "no such file")
