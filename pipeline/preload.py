"""What the job starter (pipeline.starter) imports once, so that no job process imports it again: the console's
filters first (the starter's environment carries the console's level), then the libraries, the modelling code
of the default model's family (BERT: MiniLM and tiny; a job of another family imports its own) and the job's own
modules. Nothing here may initialise CUDA: bitsandbytes, whose import does, is left to the jobs that use it
(tests/test_starter.py checks every import below)."""

import gc

from pipeline import quiet

quiet.install()

import accelerate  # noqa: E402, F401
import datasets  # noqa: E402, F401
import torch  # noqa: E402, F401
import transformers  # noqa: E402, F401
import transformers.models.bert.modeling_bert  # noqa: E402, F401
import transformers.trainer  # noqa: E402, F401

from pipeline import backends, data, job, measurements, memory, models, plan  # noqa: E402, F401
from pipeline.backends import accelerator, trainer  # noqa: E402, F401

# Everything imported so far stays for the starter's life: moved out of the collector's reach, a job's
# `gc.collect()` (accelerate's clear_device_cache, which the Trainer calls) no longer walks it, nor writes to
# the pages the job shares with the starter (Python's documented gc.freeze() use before fork without exec).
gc.freeze()
