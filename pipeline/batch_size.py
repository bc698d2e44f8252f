"""The largest batch size whose training steps stay within a memory budget (`find_batch_size=true`).

Each probe trains two steps of the job's own backend (the second starts with the optimizer state in place)
with every text padded to `train.max_length`, the worst case, under the same tracker as a training run: on
CPU the tensor-level peak against `memory_budget_mb`, on CUDA the allocator against the device's real limit
(or the budget, as a per-process fraction). Batch sizes double until one does not fit, then bisect.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

PROBE_STEPS = 2


def largest_fitting(fits: Callable[[int], bool], upper: int) -> int:
    """Largest n in 1..upper with fits(n), for a fits that is true up to some n and false after; 0 if none."""
    low, n = 0, 1  # low fits, high does not
    while n <= upper and fits(n):
        low, n = n, 2 * n
    high = min(n, upper + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def is_out_of_memory(err: BaseException) -> bool:
    import torch
    from accelerate.utils.memory import should_reduce_batch_size

    return isinstance(err, torch.OutOfMemoryError) or should_reduce_batch_size(err)


def say(line: str) -> None:
    """A probe's verdict on a line of its own, never glued onto a progress bar (tqdm.write clears any bar
    still drawn, prints, and draws it again below)."""
    from tqdm.auto import tqdm

    tqdm.write(f"[find_batch_size] {line}")


def peak_text(peak_mb: float, cfg) -> str:
    """`peak 39.98 MB of 40.0`: against a budget, as many decimals as keep a fit from reading as a tie."""
    from pipeline import MB
    from pipeline.memory import distinct_mb

    if cfg.memory_budget_mb is None:
        return f"peak {peak_mb:.1f} MB"
    peak, budget = distinct_mb(peak_mb * MB, cfg.memory_budget_mb * MB)
    return f"peak {peak} MB of {budget} MB"


def search(cfg, model, splits, spec, make_collate, job_dir, train) -> tuple[int, dict[int, dict]]:
    """Probe batch sizes with `train` (a backend's train function): the largest that fits, and each fitting
    probe's figures (peak memory, optimizer state) by batch size."""
    from accelerate.utils.memory import clear_device_cache
    from omegaconf import OmegaConf

    from pipeline import MB
    from pipeline.state import optimizer_state_size

    fitting: dict[int, dict] = {}
    after_fits: list[int] = []  # CUDA: what a fitting probe left allocated (the weights)

    def fits(batch_size: int) -> bool:
        probe = OmegaConf.merge(
            cfg,
            {
                "batch_size": batch_size,
                "train": {"max_steps": PROBE_STEPS, "padding": "max_length"},
                "memory_track_steps": None,
            },
        )
        try:
            out = train(probe, model, splits, spec, make_collate(probe), job_dir, evaluate=False)
            fitting[batch_size] = {**out.peak.metrics(), "state": optimizer_state_size(out.optimizer)}
            del out
            say(f"batch {batch_size}: fits, {peak_text(fitting[batch_size]['peak_memory_mb'], cfg)}")
            return True
        except BaseException as err:
            if not is_out_of_memory(err):
                raise
            say(f"batch {batch_size}: does not fit ({str(err).splitlines()[0]})")
            return False
        finally:  # the probe's gradients, state and activations go before the next probe measures
            model.zero_grad(set_to_none=True)
            gc.collect()
            clear_device_cache()
            held_back(batch_size, batch_size in fitting)

    def held_back(batch_size: int, fitted: bool) -> None:
        """CUDA: say so when a probe that did not fit leaves more allocated than a fitting one did, which the
        later probes then lack. On an H200 every probe after the first that ran out of memory failed: the
        step-2 breakdown's backward hooks kept the failed step's activations alive. The breakdown now takes
        its hooks off when it ends (pipeline.memory._InputHooks). This check stays as the GPU run's evidence
        that nothing else holds memory past a failed probe."""
        import torch

        if not torch.cuda.is_available():
            return
        now = torch.cuda.memory_allocated()
        if fitted:
            after_fits.append(now)
        elif after_fits and now - min(after_fits) > MB:
            say(f"batch {batch_size}: {(now - min(after_fits)) / MB:.1f} MB of what it allocated are still held "
                "after it ended: the later probes have that much less room")  # fmt: skip

    return largest_fitting(fits, upper=len(splits.train)), fitting
