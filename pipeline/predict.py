"""The field's rules of thumb, as anchors beside our own prediction (pipeline.plan_step): what `accelerate
estimate-memory` says for training, and the bytes-per-parameter rule of DeepSpeed's ZeRO estimators.

Neither sees the optimizer's real state layout, the batch or the activations; the accuracy table
(`make plan-accuracy`) sets their errors next to ours.
"""

from __future__ import annotations

from pipeline import MB

ADAM_BYTES_PER_PARAM = (
    18  # DeepSpeed: Adam with mixed precision, 16-18 bytes per parameter, activations left out
)


def accelerate_estimate_mb(num_params: int, precision: str) -> float:
    """`accelerate estimate-memory`'s training figure (batch size 1, Adam, no activations): the largest of its
    stages (model, gradients, optimizer, step) for fp32 weights, by accelerate's own function."""
    from accelerate.commands.estimate import estimate_training_usage

    mixed = "float32" if precision == "fp32" else "bfloat16"
    return max(estimate_training_usage(4 * num_params, mixed).values()) / MB


def bytes_rule_mb(num_params: int) -> float:
    return ADAM_BYTES_PER_PARAM * num_params / MB
