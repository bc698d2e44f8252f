"""How many texts of each evaluation split a job evaluates on (`eval.sample`): a short run evaluates on a sample,
so that its evaluation does not cost many times its training."""

from __future__ import annotations

from dataclasses import replace

from omegaconf import OmegaConf

AUTO = "auto"
SHORT_RUN_STEPS = 50  # eval.sample=auto: a run of fewer optimizer steps is short
SHORT_RUN_SAMPLE = 200  # and evaluates on the first this many texts of each split


def eval_sample(cfg) -> int | None:
    """The most texts of the test and the validation split a job evaluates on; None: all the data keeps
    (data.max_eval_samples, data.max_val_samples). `auto` is SHORT_RUN_SAMPLE below SHORT_RUN_STEPS steps."""
    sample = OmegaConf.select(cfg, "eval.sample", default=None)
    if sample == AUTO:
        steps = OmegaConf.select(cfg, "train.max_steps")
        return SHORT_RUN_SAMPLE if isinstance(steps, int) and steps < SHORT_RUN_STEPS else None
    return sample


def cut(cfg, splits) -> tuple[object, str | None]:
    """The splits (pipeline.data.Splits, as read) with their test and validation splits cut to eval_sample's
    first texts, and the line that says so (None when nothing was cut)."""
    from pipeline import data

    n = eval_sample(cfg)
    kept = {
        name: ds
        for name, ds in (("eval", splits.eval), ("val", splits.val))
        if n is not None and ds is not None and len(ds) > n
    }
    if not kept:
        return splits, None
    names = {"eval": "test", "val": "validation"}
    said = " and ".join(f"{n:,} of {len(ds):,} {names[name]} texts" for name, ds in kept.items())
    cut_splits = replace(splits, **{name: ds.select(range(n)) for name, ds in kept.items()})
    cut_splits.inputs = data.dataset_inputs(cut_splits, cfg.data)
    why = (
        f"a short run ({cfg.train.max_steps} steps, eval.sample=auto below {SHORT_RUN_STEPS})"
        if OmegaConf.select(cfg, "eval.sample") == AUTO
        else f"eval.sample={n}"
    )
    return cut_splits, f"{why}: evaluating on {said}; eval.sample=null for all of them"
