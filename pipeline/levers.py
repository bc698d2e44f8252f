"""The levers a plan weighs where a point does not fit its budget: each one a change of the config that the
pipeline runs, what a user types for it, and what it risks. A plan job plans the point again with each lever
that applies to it (`applicable`; pipeline.plan_job) and records what the lever makes of it as metrics
`lever_<name>_peak_mb` and `lever_<name>_max_batch_size` (a sharding's `lever_<name>_ranks`, the smallest
number of GPUs that fits, and the largest batch per GPU there). The plan's verdict (pipeline.report) names
the levers that help, each with what it buys and its risk."""

from __future__ import annotations

from typing import NamedTuple

from omegaconf import OmegaConf, open_dict

from pipeline import adapters, models


class Lever(NamedTuple):
    command: str  # what a user adds to the command; {ranks}: the smallest number of GPUs that fits
    risk: str  # what it costs besides memory


LEVERS = {
    "checkpointing": Lever(
        "train.gradient_checkpointing=true",
        "about a third more compute a step: each layer's forward runs again in backward",
    ),
    "loss_chunks": Lever(
        "train.loss_chunks=8",
        "the same loss; backward makes each piece's logits again (one more LM-head product a step)",
    ),
    "offload": Lever(
        "train.offload=activations",
        "the same math; every saved activation copied to the host in forward and back in backward (PCIe traffic "
        "a step, host memory the size of the activations)",
    ),
    "offload_optimizer": Lever(
        "train.offload=optimizer",
        "the same update, made by the host's CPU: each step copies the gradients to the host and the weights back "
        "(PCIe traffic a step, host memory for the state and a copy of the trained weights and their gradients)",
    ),
    "in_backward": Lever(
        "train.optimizer_in_backward=true train.max_grad_norm=0",
        "the same update, without gradient clipping (each gradient is used and freed as it arrives); one process",
    ),
    "bf16": Lever(
        "train.precision=bf16",
        "no known cost to quality (the weights stay fp32); it needs a GPU with bf16 (Ampere or newer)",
    ),
    "base16": Lever(
        "peft.base_dtype=auto",
        "the frozen base computes in 16 bits, as the LoRA recipes of peft and LLaMA-Factory run it",
    ),
    "qlora": Lever(
        "peft=qlora",
        "the base's Linear weights in 4 bits (NF4): QLoRA matched 16-bit LoRA in its paper; slower steps",
    ),
    "bf16_pure": Lever(
        "train.precision=bf16_pure",
        "no fp32 master copy: bf16 weights and optimizer state round small updates away, a known risk to "
        "training quality",
    ),
    "adamw_8bit": Lever(
        "optim=adamw_8bit",
        "8-bit block-wise state: it matched 32-bit AdamW in the bitsandbytes paper; its kernels need CUDA",
    ),
    "adafactor": Lever(
        "optim=adafactor",
        "a factored second moment and no momentum: it wants its own learning rate",
    ),
    "fsdp": Lever(
        "backend=accelerator launcher.nproc_per_job={ranks} train.sharding=fsdp",
        "{ranks} GPUs, and the all-gathers and reduce-scatters of every step between them",
    ),
    "zero1": Lever(
        "backend=accelerator launcher.nproc_per_job={ranks} train.sharding=zero1",
        "{ranks} GPUs, each holding 1/{ranks} of the optimizer state, and a broadcast of the weights each step",
    ),
}
# a step of several smaller batches (recipe.search names the largest that fits: accumulated): the same update
ACCUMULATE = Lever(
    "batch_size={batch} train.gradient_accumulation_steps={steps}",
    "the same effective batch, its gradients summed over {steps} batches run one after another (slower where "
    "one batch would fill the GPU)",
)
# a smaller batch needs no second plan: the plan's largest batch says it
SMALLER_BATCH = Lever("batch_size={batch}", "fewer samples a step: a noisier gradient, more steps an epoch")
OPTIMIZER_LEVERS = ("adamw_8bit", "adafactor")  # optim groups a lever swaps in (conf/optim/<name>.yaml)


def applicable(cfg, peak_in_pass: bool = True) -> dict[str, dict]:
    """The levers a point's config does not use yet, each as the overrides (dotted keys) that apply it; an
    optimizer lever's `optim` is its whole group. Checkpointing only where the peak falls in the forward and
    backward pass (`peak_in_pass`): it changes nothing of the optimizer step. The shardings are not among them:
    they need no second plan of the step (pipeline.plan_ranks counts the ranks)."""
    from pipeline.config import CONF_DIR
    from pipeline.optimizers import spec_for

    precision, method = str(cfg.train.precision), adapters.name(cfg)
    found: dict[str, dict] = {}
    if peak_in_pass and not cfg.train.get("gradient_checkpointing", False):
        found["checkpointing"] = {"train.gradient_checkpointing": True}
    if peak_in_pass and cfg.task.name == "causal_lm" and not cfg.train.get("loss_chunks", 0):
        found["loss_chunks"] = {"train.loss_chunks": 8}
    if peak_in_pass and cfg.train.get("offload", "none") == "none":
        found["offload"] = {"train.offload": "activations"}
    one_process = cfg.launcher.nproc_per_job == 1 and cfg.train.sharding == "none"
    in_backward = cfg.train.get("optimizer_in_backward") or spec_for(cfg.optim).in_backward
    # (not where each gradient is held to the step, or stepped on the host)
    held = cfg.train.get("gradient_accumulation_steps", 1) > 1 or cfg.train.get("offload") == "optimizer"
    if one_process and not in_backward and not held:
        found["in_backward"] = {"train.optimizer_in_backward": True, "train.max_grad_norm": 0.0}
    if (
        cfg.train.get("offload", "none") == "none"
        and models.offload_refusal(with_lever(cfg, {"train.offload": "optimizer"}), spec_for(cfg.optim))
        is None
    ):
        found["offload_optimizer"] = {"train.offload": "optimizer"}
    if peak_in_pass and cfg.batch_size > 1 and not in_backward:  # (at one sample a batch: the least it holds)
        found["accumulate"] = {"batch_size": 1, "train.gradient_accumulation_steps": effective_batch(cfg)}
    if precision == "fp32":
        found["bf16"] = {"train.precision": "bf16"}
    if method != "none" and precision in ("bf16", "fp16") and models.dtypes(cfg)[0] == "fp32":
        found["base16"] = {"peft.base_dtype": "auto"}
    if method == "lora":
        found["qlora"] = {"peft.name": "qlora"}
    if method == "none" and precision != "bf16_pure":
        found["bf16_pure"] = {"train.precision": "bf16_pure"}
    if cfg.get("custom_optim") is None:
        for name in OPTIMIZER_LEVERS:
            optim = OmegaConf.load(CONF_DIR / "optim" / f"{name}.yaml")
            # (not one that train.offload=optimizer refuses)
            if cfg.optim.name != name and models.offload_refusal(cfg, spec_for(optim)) is None:
                found[name] = {"optim": optim}
    return found


def effective_batch(cfg) -> int:
    """The samples a step (per process): batch_size x train.gradient_accumulation_steps."""
    return cfg.batch_size * cfg.train.get("gradient_accumulation_steps", 1)


def with_lever(cfg, overrides: dict):
    """A copy of `cfg` with a lever's overrides applied."""
    changed = cfg.copy()
    with open_dict(changed):
        for key, value in overrides.items():
            OmegaConf.update(changed, key, value, merge=False)
    return changed


def sharding(cfg) -> str | None:
    """The sharding lever for a point: FSDP (a frozen base's weights sharded too, with adapters) for an optimizer
    that steps its shards, else ZeRO-1 (models.fsdp_refusal); None where the point shards as much already."""
    from pipeline.optimizers import spec_for

    refused = models.fsdp_refusal(with_lever(cfg, {"train.sharding": "fsdp"}), spec_for(cfg.optim))
    best = "zero1" if refused else "fsdp"
    order = ["none", "zero1", "zero2", "fsdp"]
    return None if order.index(cfg.train.sharding) >= order.index(best) else best
