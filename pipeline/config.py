"""Checks of user-facing config values, run before any heavy import: one clear line per problem."""

from __future__ import annotations

import csv
import json
import os
import re
from numbers import Real
from pathlib import Path
from urllib.parse import urlparse

from omegaconf import DictConfig, MissingMandatoryValue, OmegaConf

from pipeline.data import FILE_BUILDERS, PACKAGED
from pipeline.optimizers import EXTRA, REGISTRY, missing_packages

BACKENDS = ("trainer", "accelerator")
PRECISIONS = ("fp32", "bf16", "fp16", "bf16_pure")
QUALITY_METRICS = ("macro_f1", "f1", "accuracy")  # eval.metric: what selection uses, on the validation split
PADDINGS = ("longest", "max_length")
SHARDINGS = ("none", "zero1", "fsdp")
LAUNCHERS = ("local", "parallel", "slurm", "submitit_local")
DATA_LOADERS = (*PACKAGED, "files", "hub")
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("optim", "model", "data", "backend", "tracking", "launcher")


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key, the value and what is allowed."""


def check_group_overrides(argv: list[str]) -> None:
    """`optim=adamx` on the command line: one line naming the choices, before Hydra composes anything."""
    for arg in argv:
        # plain values and comma sweeps; sweep functions, globs and interpolations are left to Hydra
        match = re.fullmatch(r"(\w+)=([\w.,-]+)", arg)
        if not match or match[1] not in GROUPS:
            continue
        group, values = match[1], match[2].split(",")
        options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        for value in values:
            if value not in options:
                raise ConfigError(f"{group}={value} is invalid: allowed values are {', '.join(options)}")


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
        "train.sharding": SHARDINGS,
        "launcher.name": LAUNCHERS,
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
    for key in ("launcher.n_jobs", "launcher.nproc_per_job"):
        _check(cfg, key, lambda v: isinstance(v, int) and v > 0, "must be a positive integer")
    if cfg.train.sharding != "none" and cfg.backend.name != "accelerator":
        raise ConfigError(
            f"train.sharding={cfg.train.sharding} is invalid with backend={cfg.backend.name}: "
            "sharding runs on backend=accelerator (the Trainer does plain DDP: train.sharding=none)"
        )
    _check(cfg, "seed", lambda v: isinstance(v, int) and v >= 0, "must be an integer >= 0")
    _check(
        cfg,
        "optim.lr",
        lambda v: isinstance(v, Real) and v > 0,
        "must be a number > 0 (each conf/optim/*.yaml sets its optimizer's reference rate)",
    )
    for key in ("train.lr", "train.lr_scale"):
        _check(cfg, key, lambda v: isinstance(v, Real) and v > 0, "must be a number > 0")
    _check(
        cfg, "eval.metric", lambda v: v in QUALITY_METRICS, f"allowed values are {', '.join(QUALITY_METRICS)}"
    )
    _check(
        cfg, "eval.every_steps", lambda v: isinstance(v, int) and v >= 0, "must be an integer >= 0 (0 = off)"
    )
    _check(cfg, "eval.collapse_share", lambda v: isinstance(v, Real) and 0 < v <= 1, "must be in (0, 1]")
    _check(
        cfg, "data.val_fraction", lambda v: isinstance(v, Real) and 0 <= v < 1, "must be in [0, 1) (0 = none)"
    )
    _check(
        cfg,
        "data.max_val_samples",
        lambda v: v is None or (isinstance(v, int) and v > 0),
        "must be null (all) or a positive integer",
    )
    _check(
        cfg, "memory_budget_mb", lambda v: v is None or (isinstance(v, Real) and v > 0), "must be null or > 0"
    )
    _check(
        cfg,
        "memory_track_steps",
        lambda v: v is None or (isinstance(v, int) and v > 0),
        "must be null (every step) or a positive integer",
    )
    for key in ("find_batch_size", "plan", "train.gradient_checkpointing"):
        if not isinstance(_value(cfg, key), bool):
            raise ConfigError(f"{key}={_value(cfg, key)!r} is invalid: must be true or false")
    if cfg.plan and (cfg.find_batch_size or cfg.launcher.nproc_per_job != 1 or cfg.train.sharding != "none"):
        raise ConfigError(
            "plan=true is invalid with find_batch_size=true, launcher.nproc_per_job > 1 or train.sharding: "
            "a plan predicts one process's training step"
        )
    if cfg.device_memory is not None:
        from pipeline.plan import DEVICE_MEMORY_GB

        _check(
            cfg,
            "device_memory",
            lambda v: v in DEVICE_MEMORY_GB,
            f"allowed values are {', '.join(DEVICE_MEMORY_GB)}",
        )
    if cfg.find_batch_size and cfg.launcher.nproc_per_job != 1:
        raise ConfigError(
            f"find_batch_size=true is invalid with launcher.nproc_per_job={cfg.launcher.nproc_per_job}: "
            "the search runs one process (launcher.nproc_per_job=1)"
        )
    positions = cfg.model.max_tokens
    _check(
        cfg,
        "train.max_length",
        lambda v: v <= positions,
        f"model {cfg.model.name} takes at most {positions} tokens",
    )
    check_tracking_uri(cfg)
    if cfg.data.loader == "files":
        for key in ("data.train_file", "data.eval_file"):
            _check(
                cfg,
                key,
                lambda v: Path(v).suffix in FILE_BUILDERS,
                f"file type must be {', '.join(FILE_BUILDERS)}",
            )
            _check(cfg, key, lambda v: Path(v).is_file(), "no such file")
            _check(cfg, key, lambda v: os.access(v, os.R_OK), "file is not readable")
            columns = header(Path(_value(cfg, key)))
            for column in ("data.text_column", "data.label_column"):
                if columns is not None and _value(cfg, column) not in columns:
                    raise ConfigError(
                        f"{column}={_value(cfg, column)!r} is invalid: {key} has the columns {', '.join(columns)}"
                    )


def header(path: Path) -> list[str] | None:
    """Column names of a csv or json-lines file from its first line (None for other formats)."""
    with path.open(newline="") as file:
        first = file.readline()
    if path.suffix == ".csv":
        return next(csv.reader([first]), [])
    if path.suffix in (".json", ".jsonl") and first.lstrip().startswith("{"):
        try:
            return list(json.loads(first))
        except json.JSONDecodeError:
            return None  # a JSON array file: left to `datasets`
    return None


def check_tracking_uri(cfg: DictConfig) -> None:
    """An http(s) MLflow server must answer before any job starts; a local store's folder must be writable."""
    from pipeline.tracking import store_uri

    uri = store_uri(cfg.tracking.uri, cfg.outputs_dir)
    parsed = urlparse(uri)
    if parsed.scheme in ("http", "https"):
        import urllib.error
        import urllib.request

        try:
            urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=3).close()
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise ConfigError(
                f"tracking uri {uri} does not answer ({reason}): start the server or fix the uri"
            ) from None
    elif parsed.scheme == "sqlite":
        folder = Path(uri.removeprefix("sqlite:///")).parent
        while not folder.exists():
            folder = folder.parent
        if not os.access(folder, os.W_OK):
            raise ConfigError(f"tracking uri {uri} is invalid: {folder} is not writable")
