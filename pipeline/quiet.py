"""A quiet console: per job, the training loop's progress bar and the result line; the rest only on request.

What is left out by default, each at its source (never by hiding a stream, so errors and real warnings show):
- the Trainer's per-step log dicts (`{'loss': ..., 'grad_norm': ...}`): backends.trainer's QuietProgress
  draws the bar without them (the losses are still recorded from the Trainer's log history);
- progress bars that finish within TQDM_DELAY_S (dataset casting, tokenizing, evaluation): tqdm's own
  `delay`, set for the job process through tqdm's TQDM_DELAY environment default;
- torchao's "Failed to load .../torchao/_C*.so" warnings where torch sees no CUDA device (its CUDA kernels,
  loaded at import: `transformers.trainer` imports torchao for every job), logger `torchao`;
- torch's "<enum ...> is an Enum subclass and is now natively supported" deprecation warnings, which torchao's
  import triggers (logger `torch.utils._pytree`);
- bitsandbytes' "Failed to load CPU gemm_4bit_forward" and the `kernels` package's "Skipping publisher trust
  check" for that kernel (an optional CPU kernel bitsandbytes asks the Hub for, which offline it does not get)
  and galore-torch's FutureWarning that its own AdamW is deprecated;
- transformers' LOAD REPORT table (logger `transformers.modeling_utils`) when all it lists is the
  classification head missing from a pretrained checkpoint, which fine-tuning a classifier expects: one line
  naming the head instead (any other load report stays whole).

These filters sit in the job processes and in the launching one (plan=true jobs run there).

`log_level=info` (or `debug`), or `hydra.verbose=true`, brings all of it back. The launching process decides
(job_env) and the job process follows (install, is_quiet).
"""

from __future__ import annotations

import logging
import os
import re
import sys

LEVEL_ENV = "PIPELINE_LOG_LEVEL"  # the job process's console level, set by the runner
LEVELS = ("warning", "info", "debug")  # `log_level`: warning = the quiet console (default)
DEFAULT = "warning"
TQDM_DELAY_S = 2  # a progress bar shows only once its work has taken this long


def log_level(cfg) -> str:
    """The console level a job runs at: `debug` under `hydra.verbose`, else the config's `log_level`
    (default `warning`). An unknown value is one line: ValueError."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if HydraConfig.initialized() and HydraConfig.get().verbose:
        return "debug"
    level = str(OmegaConf.select(cfg, "log_level", default=DEFAULT)).lower()
    if level not in LEVELS:
        raise ValueError(f"log_level={level!r} is invalid: allowed: {', '.join(LEVELS)}")
    return level


def job_env(level: str) -> dict[str, str]:
    """Environment for a job process at `level`: the level itself and, when quiet, tqdm's default delay (read
    when tqdm is imported, so it must be set before the process starts)."""
    return {LEVEL_ENV: level, **({"TQDM_DELAY": str(TQDM_DELAY_S)} if level == DEFAULT else {})}


def is_quiet(level: str | None = None) -> bool:
    """Whether `level`, else this (job) process's level (the runner's; unset: the default), is the quiet
    console."""
    return (level or os.environ.get(LEVEL_ENV, DEFAULT)) == DEFAULT


class _Drop(logging.Filter):
    """Drops the records of one logger whose message template starts with `prefix` (and, where given, only
    while `applies()` holds); everything else the logger says passes."""

    def __init__(self, prefix: str, applies=lambda: True):
        super().__init__()
        self.prefix, self.applies = prefix, applies

    def filter(self, record: logging.LogRecord) -> bool:
        return not (str(record.msg).startswith(self.prefix) and self.applies())


def _no_cuda() -> bool:
    """torch (already imported by whoever logs) sees no CUDA device: CUDA kernels cannot load, by design."""
    torch = sys.modules.get("torch")
    return torch is not None and not torch.cuda.is_available()


# the classification heads AutoModelForSequenceClassification adds on top of a pretrained body
HEADS = ("classifier.", "score.", "pre_classifier.")


class _HeadReport(logging.Filter):
    """transformers' LOAD REPORT whose every row is a classification head's key, MISSING (newly initialised):
    one line instead of the table; any other report passes whole."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(record.msg))  # less its terminal colours
        if "LOAD REPORT" not in text:
            return True
        rows = [[c.strip() for c in line.split("|")] for line in text.splitlines() if "|" in line]
        rows = [r for r in rows[1:] if r and not set(r[0]) <= {"-", "+"}]  # less the header and the rule
        if not rows or any(r[1] != "MISSING" or not r[0].startswith(HEADS) for r in rows):
            return True
        found = re.search(r"(\w+) LOAD REPORT", text)
        model = found[1] if found else "the model"
        keys = ", ".join(sorted(r[0] for r in rows))  # (transformers lists them in a set's order)
        record.msg = (
            f"{model}: the classification head ({keys}) is newly initialised, as fine-tuning a pretrained model "
            "for classification expects (log_level=info shows transformers' load report)"
        )
        record.args = None
        return True


# logger -> the message it loses on a quiet console (and when)
NOISE = {
    "torchao": ("Failed to load ", _no_cuda),
    "torch.utils._pytree": ("%s is an Enum subclass and is now natively supported", lambda: True),
    "torchao.kernel.intmm": ("Warning: Detected no triton", _no_cuda),  # triton's kernels are CUDA's
    # bitsandbytes' optional fast CPU 4-bit kernel, which it asks the `kernels` package (a dependency of
    # transformers) to fetch from the Hub when bitsandbytes is imported; offline, the plain kernel runs
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward", lambda: True),
    # the Trainer copies batches without blocking (pipeline.backends.trainer), from pinned memory on CUDA; off CUDA
    # it pins nothing (use_cpu) and no batch is copied to a device
    "transformers.trainer": ("`non_blocking` is enabled but `dataloader_pin_memory` is not", _no_cuda),
    "kernels._internals.hf_hub": (
        "Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes'",
        lambda: True,
    ),
}
# Python warnings a quiet console leaves out: (message start, category)
WARNINGS = [
    # galore-torch's own AdamW says it is deprecated in favour of torch's (it is the one GaLore's step needs)
    ("This implementation of AdamW is deprecated", FutureWarning),
]


def install(level: str | None = None) -> None:
    """Before torch & co. are imported: the filters for the library noise above, unless the console's level
    (`level`, else the runner's for this job process) asks for more than the quiet console. Idempotent."""
    if not is_quiet(level):
        return
    for name, (prefix, applies) in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(prefix, applies))
    import warnings

    for message, category in WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
    logger = logging.getLogger("transformers.modeling_utils")
    if not any(isinstance(f, _HeadReport) for f in logger.filters):
        logger.addFilter(_HeadReport())
