"""Training backends: same inputs (config, model, tokenized splits, optimizer spec), same `TrainOutput`.

Backends train and evaluate; they never talk to MLflow. `pipeline.job` turns their output into measurements.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import numpy as np


@dataclass
class TrainOutput:
    optimizer: object  # the torch optimizer itself (unwrapped), after the last step
    losses: list[float]  # training loss of each optimizer step
    eval_metrics: dict[str, float]  # eval_loss, eval_accuracy, eval_f1 (empty when not evaluated)
    train_runtime_s: float  # wall time of the training loop (no evaluation)
    peak: object  # pipeline.memory.TrainingMemory of the training loop
    device: str


class NonFiniteLoss(FloatingPointError):
    """The training loss became NaN or infinite: the run stops there (failure reason `nan_loss`)."""

    def __init__(self, step: int, loss: float):
        super().__init__(f"training loss is {loss} at step {step}: stopped (try a lower train.lr)")
        self.step = step


def classification_metrics(logits: np.ndarray, labels: np.ndarray, num_labels: int) -> dict[str, float]:
    """Accuracy and F1 (binary F1 of the positive class for 2 labels, macro F1 otherwise), as scikit-learn's
    `f1_score` computes them (zero_division=0; macro over the labels present in labels or predictions).
    Written out in numpy: importing scikit-learn costs each job process about a second."""
    preds = np.asarray(logits).argmax(axis=-1)
    labels = np.asarray(labels)

    def f1(label) -> float:
        tp = np.sum((preds == label) & (labels == label))
        wrong = np.sum(preds != labels, where=(preds == label) | (labels == label))  # false pos. + false neg.
        return float(2 * tp / (2 * tp + wrong)) if tp + wrong else 0.0

    present = np.union1d(labels, preds)
    return {
        "accuracy": float(np.mean(preds == labels)),
        "f1": f1(1) if num_labels == 2 else float(np.mean([f1(label) for label in present])),
    }


def training_memory(cfg, spec, device, model):
    """The peak-memory tracker of a training loop, set up alike for both backends."""
    import torch

    from pipeline.memory import TrainingMemory

    na = None
    if torch.device(device).type == "cuda":
        if spec.compiles_step:
            na = "n/a: the optimizer step is compiled (torch.compile), which the tensor tracker cannot follow"
        elif "paged" in spec.name:
            na = "n/a: paged optimizer state lives in CUDA unified memory, outside the tensor tracker's view"
    return TrainingMemory(
        device,
        model,
        budget_mb=cfg.memory_budget_mb,
        track_steps=cfg.memory_track_steps,
        breakdown_step=min(2, cfg.train.max_steps),  # the first step that starts with the state in place
        breakdown_na=na,
    )


# train.gradient_checkpointing, alike on both backends: transformers' activation checkpointing of every layer
# (each layer's activations recomputed in backward) with non-reentrant torch.utils.checkpoint. use_reentrant=False
# is transformers' own default in 5.x; it is passed explicitly so that both backends run the same whatever the
# version (torch recommends it: the reentrant variant needs an input that requires grad).
CHECKPOINTING_KWARGS = {"use_reentrant": False}


def checkpointing_name(training_args_cls) -> str:
    """transformers' name of the option: `activation_checkpointing` (newer 5.x releases, where
    `gradient_checkpointing` is its deprecated alias) or `gradient_checkpointing` (older ones)."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(training_args_cls)}
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


def enable_checkpointing(model) -> None:
    """Turn on activation checkpointing as the Trainer does with TrainingArguments(<name>=True)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=dict(CHECKPOINTING_KWARGS))
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(CHECKPOINTING_KWARGS))


def optimizer_step_mode(spec, device):
    """A context for the training loop: an optimizer whose step torch.compile would compile runs it eagerly
    where `spec.compiled_on` says it does not compile (CPU); nothing changes otherwise."""
    import contextlib

    import torch

    if spec.compiles_step and not spec.compiled_on(torch.device(device).type):
        return torch.compiler.set_stance("force_eager")
    return contextlib.nullcontext()


def get(name: str):
    """The backend module (`name` is checked by pipeline.config before any job starts)."""
    return importlib.import_module(f"pipeline.backends.{name}")
