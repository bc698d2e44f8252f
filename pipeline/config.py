"""Checks of user-facing config values, run before any heavy import: one clear line per problem."""

from __future__ import annotations

import copy
import difflib
import functools
import os
import re
from collections.abc import Callable, Iterator
from functools import partial
from numbers import Real
from pathlib import Path
from urllib.parse import urlparse

from omegaconf import DictConfig, MissingMandatoryValue, OmegaConf

from pipeline import adapters, models
from pipeline.checkpoint import valid_every
from pipeline.data import AUTO, FILE_BUILDERS, PACKAGED, TEXT_ONLY, header
from pipeline.optimizers import EXTRA, REGISTRY, is_custom, missing_packages, spec_for
from pipeline.quiet import LEVELS
from pipeline.slurm import cpus_per_task as _slurm_resolvers  # noqa: F401 (registers conf/launcher/slurm.yaml's)
from pipeline.starter import MODES as START_MODES

BACKENDS = ("trainer", "accelerator")
PRECISIONS = ("fp32", "bf16", "fp16", "bf16_pure")
TASKS = ("classification", "causal_lm")  # conf/task/
QUALITY_METRICS = ("macro_f1", "f1", "accuracy")  # eval.metric: what selection uses, on the validation split
PADDINGS = ("longest", "max_length")
SHARDINGS = ("none", "zero1", "zero2", "fsdp")  # zero2: planned only (plan=true); training runs the others
TRAINED_SHARDINGS = ("none", "zero1", "fsdp")
LAUNCHERS = ("local", "parallel", "slurm", "submitit_local")
DATA_LOADERS = (*PACKAGED, "files", "hub")
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("optim", "model", "task", "peft", "data", "backend", "tracking", "launcher")
TRACKING_KEYS = ("tracking.uri", "outputs_dir")  # what the store check reads


class ConfigError(ValueError):
    """A config value that cannot work, named with what is allowed; `keys`: the keys the verdict depends on (a
    sweep that varies none of them fails as a whole: fail_fast)."""

    def __init__(self, message: str, keys: tuple[str, ...] = ()):
        super().__init__(message)
        self.keys = keys


def unused_custom_optim(cfg: DictConfig, optims: list) -> ConfigError | None:
    """`custom_optim=...` given where no run uses it (`optims`: the optimizer options the command runs, none of
    them `custom`): it would be ignored without a word."""
    target = OmegaConf.select(cfg, "custom_optim")
    if target is None or "custom" in optims:
        return None
    ran = ",".join(str(o) for o in optims)
    return ConfigError(
        f"custom_optim={target} is set, but no run uses it (optim={ran}): put the custom optimizer beside the "
        f"others, optim={ran},custom",
        keys=("custom_optim", "optim"),
    )


def did_you_mean(value, names) -> str:
    """`did you mean adamw? ` when one allowed name is close to a misspelt value, else ''."""
    close = difflib.get_close_matches(str(value), [str(n) for n in names], n=1)
    return f"did you mean {close[0]}? " if close else ""


def allowed(value, names) -> str:
    """The end of an unknown-name message: the closest choice first when one is close, then the choices."""
    return f"{did_you_mean(value, names)}allowed values are {', '.join('null' if n is None else n for n in names)}"


def search_dirs(argv: list[str]) -> tuple[list[Path], bool]:
    """conf/ and the folders a `hydra.searchpath=[file://<folder>]` override adds (one's own optim configs), and
    whether that is all of them: False when it also names another kind of source (pkg://), which only Hydra reads."""
    dirs, complete = [CONF_DIR], True
    for arg in argv:
        match = re.fullmatch(r"\+{0,2}hydra\.searchpath=\[?(.*?)\]?", arg)
        for entry in match[1].split(",") if match else []:
            entry = entry.strip().strip("'\"")
            if entry.startswith("file://"):
                dirs.append(Path(entry.removeprefix("file://")))  # (relative: to the working directory)
            elif entry:
                complete = False
    return dirs, complete


def check_group_overrides(argv: list[str]) -> None:
    """`optim=adamx` on the command line: one line naming the choices, before Hydra composes anything."""
    dirs, complete = search_dirs(argv)
    for arg in argv:
        # plain values and comma sweeps; sweep functions, globs and interpolations are left to Hydra
        match = re.fullmatch(r"(\w+)=([\w.,-]+)", arg)
        if not match or match[1] not in GROUPS:
            continue
        group, values = match[1], match[2].split(",")
        options = sorted({p.stem for folder in dirs for p in (folder / group).glob("*.yaml")})
        for value in values:
            if value not in options and complete:
                raise ConfigError(f"{group}={value} is invalid: {allowed(value, options)}", (group,))


def _value(cfg: DictConfig, key: str):
    try:
        return OmegaConf.select(cfg, key, throw_on_missing=True)
    except MissingMandatoryValue:
        raise ConfigError(f"{key} is required: set it on the command line ({key}=...)", (key,)) from None


def _check(cfg: DictConfig, key: str, ok, rule: str, also: tuple[str, ...] = ()) -> None:
    """ConfigError unless ok(value); `also`: the other keys that ok or the rule read."""
    value = _value(cfg, key)
    if isinstance(value, bool) or not ok(value):
        raise ConfigError(f"{key}={value!r} is invalid: {rule}", (key, *also))


def _check_choice(cfg: DictConfig, key: str, names) -> None:
    value = _value(cfg, key)
    if isinstance(value, bool) or value not in names:
        raise ConfigError(f"{key}={value!r} is invalid: {allowed(value, names)}", (key,))


def _positive_int(value) -> bool:
    return isinstance(value, int) and value > 0


def _positive_number(value) -> bool:
    return isinstance(value, Real) and value > 0


def _null_or(ok):
    return lambda value: value is None or ok(value)


CHOICES = {
    "task.name": TASKS,
    "peft.name": adapters.METHODS,
    "backend.name": BACKENDS,
    "data.loader": DATA_LOADERS,
    "train.precision": PRECISIONS,
    "train.padding": PADDINGS,
    "train.sharding": SHARDINGS,
    "train.offload": models.OFFLOADS,
    "launcher.name": LAUNCHERS,
    "model.attn_implementation": models.ATTENTION,
}
POSITIVE_INTS = (
    "batch_size",
    "train.max_steps",
    "train.gradient_accumulation_steps",
    "train.max_length",
    "eval.batch_size",
    "launcher.n_jobs",
    "launcher.nproc_per_job",
)
BOOLEANS = (
    "find_batch_size",
    "plan",
    "train.gradient_checkpointing",
    "train.packing",
    "train.optimizer_in_backward",
)
LOG_LEVELS = LEVELS  # log_level: pipeline.quiet


def _check_optim_name(cfg: DictConfig) -> None:
    """A registered optimizer, or a user's own (a name of its own with an optim.target: is_custom)."""
    if not is_custom(cfg.optim):
        _check_choice(cfg, "optim.name", REGISTRY)


def _check_packages(cfg: DictConfig) -> None:
    missing = missing_packages(spec_for(cfg.optim))
    if missing:
        raise ConfigError(
            f"optim={cfg.optim.name} needs the package(s) {', '.join(missing)}: "
            f"install the optional extra with pip install -e '.[{EXTRA}]' (make install does)",
            ("optim.name",),
        )


def _check_custom_optimizer(cfg: DictConfig) -> None:
    """optim=custom (or a user's own optim config): optim.target imports, is a torch.optim.Optimizer subclass
    and takes optim.kwargs (this imports the target's module, so only for a custom optimizer)."""
    if is_custom(cfg.optim):
        from pipeline.optimizers import check_custom

        try:
            check_custom(cfg)
        except ValueError as err:
            message = str(err)
            if cfg.get("custom_optim") is not None and cfg.optim.target == cfg.custom_optim:  # set there
                message = message.replace("optim.target=", "custom_optim=", 1)
            raise ConfigError(
                message, ("optim.name", "optim.target", "optim.kwargs", "custom_optim")
            ) from None


def _check_sharding_backend(cfg: DictConfig) -> None:
    if (refused := models.fsdp_refusal(cfg, spec_for(cfg.optim))) is not None:
        raise ConfigError(*refused)
    if cfg.plan:  # a plan runs no backend: it counts what each rank holds (pipeline.plan_ranks)
        name = cfg.optim.name
        if cfg.train.sharding == "zero2" and name.startswith(models.MATRIX_OPTIMIZERS):
            raise ConfigError(
                f"train.sharding=zero2 is invalid with optim={name}: it works on whole weight matrices, and "
                "ZeRO-2 hands the optimizer 1-D slices (train.sharding=none or zero1)",
                ("train.sharding", "optim.name"),
            )
        return
    if cfg.train.sharding not in TRAINED_SHARDINGS:
        raise ConfigError(
            f"train.sharding={cfg.train.sharding} is planned only (plan=true): training runs "
            f"{', '.join(TRAINED_SHARDINGS)} (ZeRO-2 would come from DeepSpeed, which is not installed)",
            ("train.sharding", "plan"),
        )
    if cfg.train.sharding != "none" and cfg.backend.name != "accelerator":
        raise ConfigError(
            f"train.sharding={cfg.train.sharding} is invalid with backend={cfg.backend.name}: "
            "sharding runs on backend=accelerator (the Trainer does plain DDP: train.sharding=none)",
            ("train.sharding", "backend.name"),
        )


def _check_flash_attention(cfg: DictConfig) -> None:
    lack = models.flash_attention_lacks(cfg)
    if lack is not None:
        raise ConfigError(lack, ("model.attn_implementation", "plan", "device_memory"))


def _check_in_backward(cfg: DictConfig) -> None:
    """Optimizers that update inside the backward pass (LOMO, layer-wise, train.optimizer_in_backward) run in
    one process without clipping; LOMO's and the layer-wise ones are measured by training (not planned);
    AdaLomo needs CUDA (checked here for jobs that run on this machine). train.offload=optimizer's limits."""
    spec = spec_for(cfg.optim)
    name, lever = cfg.optim.name, cfg.train.get("optimizer_in_backward")
    what = "train.optimizer_in_backward=true" if lever else f"optim={name}"
    if lever and (spec.in_backward or cfg.train.max_grad_norm):
        why = "clipping needs every gradient at once, and each is used and freed as it arrives (train.max_grad_norm=0)"
        why = "it updates inside the backward pass already" if spec.in_backward else why
        raise ConfigError(
            f"{what} is invalid with optim={name} / train.max_grad_norm={cfg.train.max_grad_norm}: {why}",
            ("train.optimizer_in_backward", "optim.name", "train.max_grad_norm"),
        )
    if (refused := models.offload_refusal(cfg, spec)) is not None:
        raise ConfigError(*refused)
    if (spec.in_backward or lever) and cfg.train.gradient_accumulation_steps > 1:
        raise ConfigError(
            f"{what} is invalid with train.gradient_accumulation_steps={cfg.train.gradient_accumulation_steps}: "
            "accumulating needs every gradient held until the step, and each is used and freed as it arrives",
            ("train.optimizer_in_backward", "optim.name", "train.gradient_accumulation_steps"),
        )
    if (spec.in_backward or lever) and (cfg.launcher.nproc_per_job != 1 or cfg.train.sharding != "none"):
        raise ConfigError(
            f"{what} is invalid with launcher.nproc_per_job={cfg.launcher.nproc_per_job} / "
            f"train.sharding={cfg.train.sharding}: it updates each parameter inside the backward pass, before "
            "gradients are averaged over processes (one process: launcher.nproc_per_job=1, train.sharding=none)",
            ("optim.name", "train.optimizer_in_backward", "launcher.nproc_per_job", "train.sharding"),
        )
    if spec.in_backward and cfg.plan:
        raise ConfigError(
            f"plan=true is invalid with optim={name}: the plan models a separate optimizer step over all "
            "gradients, and this optimizer updates inside the backward pass (measure it by training)",
            ("optim.name", "plan"),
        )
    if spec.needs_cuda and cfg.launcher.name != "slurm":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"optim={name} needs a CUDA device: {spec.needs_cuda}, and torch sees none here",
                ("optim.name",),
            )


def _check_frozen_base(cfg: DictConfig) -> None:
    """peft=lora / qlora: an optimizer that cannot train adapters on a frozen base (checked before whether
    it needs CUDA: no device makes it work)."""
    spec = spec_for(cfg.optim)
    kind = cfg.peft.name
    if kind != "none" and spec.frozen_base:
        raise ConfigError(
            f"optim={cfg.optim.name} is invalid with peft={kind}: {spec.frozen_base} (use an optimizer that "
            "keeps state for the trainable parameters only, e.g. optim=lomo or adamw; or peft=none)",
            ("optim.name", "peft.name"),
        )


def _check_peft(cfg: DictConfig) -> None:
    """peft=lora / qlora: the adapter's settings, the 4-bit base's (and bitsandbytes for it), the default
    target modules of the model's family; a plan of it with DDP or ZeRO-1 only."""
    import importlib.util

    kind = cfg.peft.name
    if kind == "none":
        return
    _check(cfg, "peft.r", _positive_int, "must be a positive integer (the adapters' rank)")
    _check(cfg, "peft.alpha", _positive_number, "must be a number > 0")
    _check(cfg, "peft.dropout", lambda v: isinstance(v, Real) and 0 <= v < 1, "must be in [0, 1)")
    _check_boolean(cfg, "peft.save_adapter")
    for key in ("peft.base_dtype", "peft.adapter_dtype"):
        _check_choice(cfg, key, adapters.WEIGHT_DTYPES)
    _check_weight_dtypes(cfg)
    listed = lambda v: not isinstance(v, str) and len(v) > 0 and all(isinstance(t, str) for t in v)  # noqa: E731
    rule = (
        f"must be null (the family's attention projections), {adapters.ALL_LINEAR} or a list of module names"
    )
    _check(cfg, "peft.target_modules", lambda v: v is None or v == adapters.ALL_LINEAR or listed(v), rule)
    if cfg.peft.target_modules is None:
        family = models.model_type(cfg.model)
        if family not in adapters.TARGETS:
            raise ConfigError(
                f"peft.target_modules=null is invalid with model={cfg.model.name}: no default target modules "
                f"for its family ({family}; those with one: {', '.join(adapters.TARGETS)}); name them, "
                f"peft.target_modules=[...], or peft.target_modules={adapters.ALL_LINEAR}",
                ("peft.target_modules", "model.name"),
            )
    if kind == "qlora":
        _check_choice(cfg, "peft.quant_type", adapters.QUANT_TYPES)
        _check_boolean(cfg, "peft.double_quant")
        if cfg.peft.compute_dtype is not None:
            _check_choice(cfg, "peft.compute_dtype", adapters.COMPUTE_DTYPES)
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError(
                f"peft=qlora needs the package bitsandbytes (its 4-bit layers): install the optional extra "
                f"with pip install -e '.[{EXTRA}]' (make install does)",
                ("peft.name",),
            )
    if cfg.plan and cfg.train.sharding == "zero2":
        raise ConfigError(
            f"plan=true is invalid with peft={kind} and train.sharding=zero2: the plan counts shards of whole "
            "trainable weights, not ZeRO-2's flat shards of a frozen base and its adapters (plan "
            "train.sharding=none, zero1 or fsdp)",
            ("plan", "peft.name", "train.sharding"),
        )


def _check_weight_dtypes(cfg: DictConfig) -> None:
    """Adapters' weights in dtypes the step can compute with: without autocast (fp32, bf16_pure) all in the one
    dtype; under autocast fp32 or its 16-bit dtype (another one meets it in a layer: on CPU "mixed dtype"), the
    trained weights fp32 under fp16, whose gradient scaler unscales fp32 gradients."""
    precision = cfg.train.precision
    compute = adapters.COMPUTE[precision]
    base, trained = models.dtypes(cfg)
    if precision in ("fp32", "bf16_pure"):
        why, base_ok = f"without autocast every weight computes in {compute}", (compute,)
    else:
        why, base_ok = f"under autocast to {compute} the weights are fp32 or {compute}", ("fp32", compute)
    trained_ok = base_ok
    if precision == "fp16":
        why, trained_ok = (
            why + ", the trained ones fp32 (the gradient scaler unscales fp32 gradients)",
            ("fp32",),
        )
    for key, value, allowed in (
        ("peft.base_dtype", base, base_ok),
        ("peft.adapter_dtype", trained, trained_ok),
    ):
        if value not in allowed:
            raise ConfigError(
                f"{key}={value} is invalid with train.precision={precision}: {why}; allowed: "
                f"{', '.join(('auto', *allowed))}",
                (key, "train.precision"),
            )


def _check_boolean(cfg: DictConfig, key: str) -> None:
    if not isinstance(_value(cfg, key), bool):
        raise ConfigError(f"{key}={_value(cfg, key)!r} is invalid: must be true or false", (key,))


def _check_plan_alone(cfg: DictConfig) -> None:
    if cfg.plan and cfg.find_batch_size:
        raise ConfigError(
            "plan=true is invalid with find_batch_size=true: a plan predicts the largest batch itself "
            "(with memory_budget_mb or device_memory)",
            ("plan", "find_batch_size"),
        )


def _check_device_memory(cfg: DictConfig) -> None:
    if cfg.device_memory is not None:
        from pipeline.plan_step import DEVICE_MEMORY_GB

        _check_choice(cfg, "device_memory", list(DEVICE_MEMORY_GB))


def _check_search_alone(cfg: DictConfig) -> None:
    if cfg.find_batch_size and cfg.launcher.nproc_per_job != 1:
        raise ConfigError(
            f"find_batch_size=true is invalid with launcher.nproc_per_job={cfg.launcher.nproc_per_job}: "
            "the search runs one process (launcher.nproc_per_job=1)",
            ("find_batch_size", "launcher.nproc_per_job"),
        )


def _check_positions(cfg: DictConfig) -> None:
    positions = cfg.model.max_tokens
    if positions is None:  # (a config.json that names no number of positions)
        return
    _check(
        cfg,
        "train.max_length",
        lambda v: v <= positions,
        f"model {cfg.model.name} takes at most {positions} tokens",
        also=("model.max_tokens", "model.name"),
    )


def _check_task_model(cfg: DictConfig) -> None:
    """task=causal_lm needs a decoder: an encoder (BERT, MiniLM) has a bidirectional attention and no
    next-token head to fine-tune, nor has a model of one's own (model.config) whose type transformers builds
    no causal LM of (T5); train.packing is a language model's way of batching."""
    if cfg.task.name == "causal_lm":
        kind = models.model_type(cfg.model)
        what = f"an encoder ({kind})" if kind in models.ENCODER_TYPES else None
        if what is None and cfg.model.get("config") is not None:
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

            if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
                what = f"a {kind} model, which transformers builds no causal language model of"
        if what is not None:
            raise ConfigError(
                f"task=causal_lm is invalid with model={cfg.model.name}: it is {what}, not a "
                f"decoder that predicts the next token; the decoders: {', '.join(models.decoders())}",
                ("task.name", "model.name"),
            )
    elif cfg.train.packing:
        raise ConfigError(
            f"train.packing=true is invalid with task={cfg.task.name}: packing cuts the texts into blocks for "
            "a language model (task=causal_lm); a classifier's text is one sequence with its label",
            ("train.packing", "task.name"),
        )
    elif cfg.train.get("loss_chunks", 0):
        raise ConfigError(
            f"train.loss_chunks={cfg.train.loss_chunks} is invalid with task={cfg.task.name}: it chunks a language "
            "model's loss over its LM head (task=causal_lm); a classifier's head has no vocabulary to chunk",
            ("train.loss_chunks", "task.name"),
        )


def _check_file(cfg: DictConfig, key: str) -> None:
    """A data file: its type, that it exists and is readable, and that it has the configured columns (a
    language model's, task=causal_lm: the text column alone)."""
    _check(
        cfg, key, lambda v: Path(v).suffix in FILE_BUILDERS, f"file type must be {', '.join(FILE_BUILDERS)}"
    )
    _check(cfg, key, lambda v: Path(v).is_file(), "no such file")
    _check(cfg, key, lambda v: os.access(v, os.R_OK), "file is not readable")
    path = Path(_value(cfg, key))
    classify = cfg.task.name == "classification"
    if classify and path.suffix in TEXT_ONLY:
        raise ConfigError(
            f"{key}={str(path)!r} is invalid with task=classification: a {path.suffix} file holds text alone, "
            f"no labels (task=causal_lm trains on it; a classifier reads "
            f"{', '.join(s for s in FILE_BUILDERS if s not in TEXT_ONLY)})",
            (key, "task.name"),
        )
    columns = header(path)
    needed = ("data.text_column", "data.label_column") if classify else ("data.text_column",)
    needed = () if cfg.task.get("instructions") else needed  # (task=sft's columns: as its data is read)
    for column in needed if columns is not None else ():
        if _value(cfg, column) not in columns:
            # (the label column's verdict depends on the task: a language model reads no labels)
            also = ("task.name",) if column == "data.label_column" else ()
            raise ConfigError(
                f"{column}={_value(cfg, column)!r} is invalid: {key} has the columns {', '.join(columns)}",
                (column, key, *also),
            )


def _check_file_types(cfg: DictConfig) -> None:
    """The train and eval files are read by one `datasets` loader, the train file's: the eval file's type too."""
    train, evaluation = (Path(_value(cfg, key)).suffix for key in ("data.train_file", "data.eval_file"))
    if FILE_BUILDERS[train] != FILE_BUILDERS[evaluation]:
        raise ConfigError(
            f"data.eval_file={_value(cfg, 'data.eval_file')!r} is invalid: data.train_file is a {train} file and "
            f"both are read as one type ({FILE_BUILDERS[train]}): give the eval file that type",
            ("data.eval_file", "data.train_file"),
        )


def _check_label_column(cfg: DictConfig) -> None:
    """A classifier learns the labels of a column: data.label_column null is a language model's (no labels)."""
    if cfg.task.name == "classification" and _value(cfg, "data.label_column") is None:
        raise ConfigError(
            "data.label_column=None is invalid with task=classification: a classifier learns the labels of a "
            "column (name it; task=causal_lm trains on the text alone)",
            ("data.label_column", "task.name"),
        )


def _also_on(check: Callable[[], None], *keys: str) -> Callable[[], None]:
    """The check, its ConfigError depending on `keys` too (the keys that decide whether it runs at all)."""

    def run() -> None:
        try:
            check()
        except ConfigError as err:
            raise ConfigError(str(err), (*err.keys, *keys)) from None

    return run


def _checks(cfg: DictConfig) -> Iterator[Callable[[], None]]:
    """Every check of a config, in the order validate runs them: each raises ConfigError naming its keys."""
    yield partial(_check_optim_name, cfg)
    for key, names in CHOICES.items():
        yield partial(_check_choice, cfg, key, names)
    yield partial(_check_choice, cfg, "log_level", LOG_LEVELS)
    if (
        OmegaConf.select(cfg, "launcher.start_jobs") is not None
    ):  # (a scheduler's launcher starts jobs itself)
        yield partial(_check_choice, cfg, "launcher.start_jobs", START_MODES)
    yield partial(_check_packages, cfg)
    yield partial(_check_custom_optimizer, cfg)
    for key in POSITIVE_INTS:
        yield partial(_check, cfg, key, _positive_int, "must be a positive integer")
    yield partial(_check_sharding_backend, cfg)
    yield partial(_check_frozen_base, cfg)
    yield partial(_check_in_backward, cfg)
    yield partial(_check_flash_attention, cfg)
    yield partial(_check, cfg, "seed", lambda v: isinstance(v, int) and v >= 0, "must be an integer >= 0")
    yield partial(_check, cfg, "train.checkpoint_every", valid_every, "N (steps), Nmin (minutes) or none")
    # task=causal_lm's, which train.lr reads
    if OmegaConf.select(cfg, "task.random_weights_lr_scale") is not None:
        yield partial(_check, cfg, "task.random_weights_lr_scale", _positive_number, "must be a number > 0")
    yield partial(
        _check,
        cfg,
        "optim.lr",
        _positive_number,
        "must be a number > 0 (each conf/optim/*.yaml sets its optimizer's reference rate)",
    )
    for key in ("train.lr", "train.lr_scale"):
        yield partial(_check, cfg, key, _positive_number, "must be a number > 0")
    yield partial(_check_choice, cfg, "eval.metric", QUALITY_METRICS)
    for key in ("eval.every_steps", "train.loss_chunks"):
        yield partial(
            _check, cfg, key, lambda v: isinstance(v, int) and v >= 0, "must be an integer >= 0 (0 = off)"
        )
    yield partial(
        _check, cfg, "eval.collapse_share", lambda v: isinstance(v, Real) and 0 < v <= 1, "must be in (0, 1]"
    )
    yield partial(
        _check,
        cfg,
        "eval.sample",
        lambda v: v == AUTO or _null_or(_positive_int)(v),
        f"must be {AUTO}, null (all) or a positive integer",
    )
    yield partial(
        _check,
        cfg,
        "data.val_fraction",
        lambda v: isinstance(v, Real) and 0 <= v < 1,
        "must be in [0, 1) (0 = none)",
    )
    yield partial(
        _check,
        cfg,
        "data.max_val_samples",
        _null_or(_positive_int),
        "must be null (all) or a positive integer",
    )
    yield partial(_check, cfg, "memory_budget_mb", _null_or(_positive_number), "must be null or > 0")
    yield partial(
        _check,
        cfg,
        "memory_track_steps",
        _null_or(_positive_int),
        "must be null (every step) or a positive integer",
    )
    for key in BOOLEANS:
        yield partial(_check_boolean, cfg, key)
    yield partial(_check_plan_alone, cfg)
    yield partial(_check_device_memory, cfg)
    yield partial(_check_search_alone, cfg)
    yield partial(_check_positions, cfg)
    yield partial(_check_task_model, cfg)
    yield partial(_check_peft, cfg)
    yield partial(check_tracking_uri, cfg)
    if cfg.data.loader in ("files", "hub"):
        yield _also_on(partial(_check_label_column, cfg), "data.loader")
    if cfg.data.loader == "files":
        for key in ("data.train_file", "data.eval_file"):
            yield _also_on(partial(_check_file, cfg, key), "data.loader")
        yield _also_on(partial(_check_file_types, cfg), "data.loader")


def own_model(cfg: DictConfig) -> DictConfig:
    """The config with its model the entry model.config makes (pipeline.models.own_model: its name, architecture,
    positions, weights and tokenizer); the config itself where model.config is unset. ConfigError for a bad
    path, file, or a model_type transformers does not know."""
    if OmegaConf.select(cfg, "model.config") is None:
        return cfg
    try:
        entry = models.own_model(cfg.model)
    except ValueError as err:
        raise ConfigError(str(err), ("model.config",)) from None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    kind = entry.architecture.model_type
    if kind not in CONFIG_MAPPING_NAMES:
        import transformers

        raise ConfigError(
            f"model.config={cfg.model.config!r} is invalid: model_type {kind!r} is not one transformers "
            f"{transformers.__version__} knows{did_you_mean(kind, CONFIG_MAPPING_NAMES)}",
            ("model.config",),
        )
    own = copy.deepcopy(cfg)
    own.model = entry
    return own


def _own_checks(cfg: DictConfig) -> Iterator[Callable[[], None]]:
    """The checks of a config whose model may be one's own (model.config): the first says what is wrong with it;
    the others check the model it makes, their verdicts on the model depending on model.config too."""
    try:
        own = own_model(cfg)
    except ConfigError as err:
        yield partial(_fail, err)
        return
    for check in _checks(own):
        yield check if own is cfg else _on_own_model(check)


def _fail(err: ConfigError) -> None:
    raise err


def _on_own_model(check: Callable[[], None]) -> Callable[[], None]:
    """The check, its verdict on a model key depending on model.config too (the config.json makes the model)."""

    def run() -> None:
        try:
            check()
        except ConfigError as err:
            on_model = any(key == "model" or key.startswith("model.") for key in err.keys)
            raise ConfigError(str(err), (*err.keys, "model.config") if on_model else err.keys) from None

    return run


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError for the first bad value."""
    for check in _own_checks(cfg):
        check()


def problems(cfg: DictConfig) -> Iterator[ConfigError]:
    """Every check's ConfigError (a sweep asks which no swept key can change), less a check another bad value
    stops."""
    for check in _own_checks(cfg):
        try:
            check()
        except ConfigError as err:
            yield err
        except Exception:  # noqa: BLE001 (e.g. comparing with a value another check rejects)
            continue


def check_tracking_uri(cfg: DictConfig) -> None:
    """An http(s) MLflow server must answer before any job starts; a local store's folder must be writable."""
    from pipeline.tracking import not_writable, store_uri

    uri = store_uri(cfg.tracking.uri, cfg.outputs_dir)
    parsed = urlparse(uri)
    if parsed.scheme in ("http", "https"):
        reason = _unanswered(uri)
        if reason is not None:
            raise ConfigError(
                f"tracking uri {uri} does not answer ({reason}): start the server or fix the uri",
                TRACKING_KEYS,
            )
    elif parsed.scheme == "sqlite":
        folder = Path(uri.removeprefix("sqlite:///")).parent
        while not folder.exists():
            folder = folder.parent
        if not os.access(folder, os.W_OK):
            raise ConfigError(not_writable(uri, folder), TRACKING_KEYS)


@functools.cache
def _unanswered(uri: str) -> str | None:
    """Why an MLflow server does not answer its health check, None when it does: asked once per process (a
    sweep's launching process checks the store for the sweep and again for its parent run)."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=3).close()
    except (urllib.error.URLError, OSError) as err:
        return str(getattr(err, "reason", err))
    return None
