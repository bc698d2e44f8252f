"""What the job starter (pipeline.starter) imports once, so that no job process imports it again: the console's
filters first (the starter's environment carries the console's level), then the libraries, the modelling code
of the default model's family (BERT: MiniLM and tiny; a job of another family imports its own), the job's own
modules and MiniLM's tokenizer.

Nothing here may initialise CUDA (a process forked after that cannot use it). On a CUDA build two imports would:
- bitsandbytes reads every device's compute capability: it is left to the jobs that use it. transformers'
  Trainer imports peft, and peft imports bitsandbytes where it is installed: both are hidden alike (below),
  so peft imports without it and the jobs of a 4-bit base (peft=qlora) import it after the fork. What the
  starter's peft leaves out with it: its `helpers` module's 4-bit dequantising, which no job here uses;
- torchao, which transformers' model code imports (modeling_utils -> its fp8 integration -> the quantizers ->
  the torchao quantizer) when torchao is installed: its MX-format kernels read the compute capability and ask
  triton whether the current device suits it. Here transformers imports with torchao hidden
  (`sys.modules["torchao"] = None`: `importlib.util.find_spec` answers None, so transformers takes it as not
  installed and skips that import); afterwards torchao is visible again, transformers' and peft's cached
  answers are cleared, and a job that uses it (the torchao optimizers) imports it itself, after the fork. What
  the starter leaves out with it: transformers' loading of torchao-quantized checkpoints, which no job here
  uses.

One more is hidden for time alone: scipy (0.2 s of the starter's 4 s here), which transformers' loss functions
import for object detection's matching (`linear_sum_assignment`) and nothing a job runs uses. transformers asks
for it each time (`is_scipy_available` keeps no answer), so a job that uses scipy imports it itself.
tests/test_starter.py checks every import below on a simulated CUDA build."""

import gc
import sys

from pipeline import quiet

quiet.install()

# whose imports touch the device on a CUDA build, and scipy, which costs time alone (see above)
HIDDEN = ("torchao", "bitsandbytes", "scipy")

import torch  # noqa: E402, F401

_hidden = [name for name in HIDDEN if name not in sys.modules]
for name in _hidden:
    sys.modules[name] = None
try:
    import accelerate  # noqa: E402, F401
    import datasets  # noqa: E402, F401
    import transformers  # noqa: E402, F401
    import transformers.models.bert.modeling_bert  # noqa: E402, F401
    import transformers.trainer  # noqa: E402, F401

    from pipeline import backends, data, job, measurements, memory, models, plan_step  # noqa: E402, F401
    from pipeline.backends import accelerator, trainer  # noqa: E402, F401
finally:
    for name in _hidden:
        del sys.modules[name]
    from transformers.utils import import_utils

    # the libraries' cached answers "not installed", cleared: a job's import finds them
    import_utils.is_torchao_available.cache_clear()
    import_utils.is_bitsandbytes_available.cache_clear()
    if "peft" in sys.modules:
        from peft import import_utils as peft_imports

        peft_imports.is_bnb_4bit_available.cache_clear()
        peft_imports.is_torchao_available.cache_clear()

# MiniLM's tokenizer (the default model's and tiny's), read once for every job the starter forks
models.packaged_tokenizer(models.FALLBACK_TOKENIZER_PACKAGE)

# Everything imported so far stays for the starter's life: moved out of the collector's reach, a job's
# `gc.collect()` (accelerate's clear_device_cache, which the Trainer calls) no longer walks it, nor writes to
# the pages the job shares with the starter (Python's documented gc.freeze() use before fork without exec).
gc.freeze()
