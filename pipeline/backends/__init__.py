"""The train stage (`run`) and its backends: same inputs (config, model, tokenized splits, optimizer spec), same
`TrainOutput`.

Backends train and evaluate; they never talk to MLflow. `pipeline.measurements` turns what the stage hands on
(`Trained`) into the job's record.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field

import numpy as np

from pipeline.data import IGNORE_INDEX


@dataclass
class TrainOutput:
    optimizer: object  # the torch optimizer itself (unwrapped), after the last step
    losses: list[float]  # training loss of each optimizer step
    eval_metrics: dict[
        str, float
    ]  # the held-out test split: loss + classification_metrics (empty: not evaluated)
    train_runtime_s: float  # wall time of the training loop (no evaluation)
    peak: object  # pipeline.memory.TrainingMemory of the training loop
    device: str
    val_metrics: dict[str, float] = field(default_factory=dict)  # the validation split at the end, same keys
    # with eval.every_steps=N: each validation figure at steps N, 2N, ... before the last ({step: value})
    val_series: dict[str, dict[int, float]] = field(default_factory=dict)
    eval_runtime_s: float = 0.0  # wall time of the evaluations after training (test and validation splits)
    # a run resumed from a checkpoint: each segment's steps, peak and time (pipeline.checkpoint); what its
    # checkpoints cost (count, seconds, MB of the last); None where it wrote none
    segments: list[dict] = field(default_factory=list)
    checkpoints: dict | None = None
    per_epoch: int | None = None  # the training loader's batches an epoch (step_sizes)


class NonFiniteLoss(FloatingPointError):
    """The training loss became NaN or infinite at `step`: the run stops at the next reading of the losses
    (failure reason `nan_loss`)."""

    def __init__(self, step: int, loss: float):
        super().__init__(f"training loss is {loss} at step {step}: stopped (try a lower train.lr)")
        self.step = step


# the host reads the training losses from the device every this many steps, and at the end
LOSS_READ_STEPS = 50


class StepLosses:
    """The training loss of each step, kept on the device while the loop runs and read by the host every
    LOSS_READ_STEPS steps and at the end, all the steps since the last reading in one transfer: no step waits
    for the device to hand its loss over (as `loss.item()`, or the Trainer's logging every step, would).

    Each reading checks what it read: the first NaN or infinite loss ends the run (NonFiniteLoss, naming that
    step) at that reading, up to LOSS_READ_STEPS - 1 steps after it. `combine` turns the stacked losses of the
    steps read into the values recorded (several ranks: their mean, so all of them stop at the same reading).
    """

    def __init__(self, combine=None):
        self.values: list[float] = []  # the steps read, from step 1
        self._pending = []  # the loss tensors of the steps not read yet
        self._step = None  # this step's loss so far: its batches' (train.gradient_accumulation_steps)
        self._combine = combine

    def add(self, loss) -> None:
        """A batch's loss, scaled as its gradient is (a tensor on the device; it is not read now): a step's loss
        is the sum over its batches."""
        self._step = loss.detach() if self._step is None else self._step + loss.detach()

    def step_ended(self) -> None:
        """The end of a step: the losses are read when LOSS_READ_STEPS steps wait."""
        if self._step is not None:
            self._pending.append(self._step)
            self._step = None
        if len(self._pending) >= LOSS_READ_STEPS:
            self.read()

    def read(self) -> list[float]:
        """Every step's loss so far (the ones not read yet in one transfer); raises NonFiniteLoss at the first
        NaN or infinite one."""
        if self._pending:
            import torch

            stacked = torch.stack(self._pending)
            read = (stacked if self._combine is None else self._combine(stacked)).tolist()
            self._pending = []
            first = len(self.values) + 1
            self.values += read
            for step, loss in enumerate(read, start=first):
                if not math.isfinite(loss):
                    raise NonFiniteLoss(step, loss)
        return self.values


METRIC_KEYS = ("accuracy", "f1", "macro_f1", "top_class_share", "majority_accuracy")  # classification_metrics


def classification_metrics(logits: np.ndarray, labels: np.ndarray, num_labels: int) -> dict[str, float]:
    """What the predictions are worth, as scikit-learn computes it (zero_division=0):
    - `accuracy`; `f1`: binary F1 of the positive class for 2 labels, macro F1 otherwise (its meaning since the
      first runs); `macro_f1`: the mean F1 over the labels present in labels or predictions, for any number of
      labels (a model that predicts one class for everything gets about 0.36 on a 57/43 split, where its
      binary F1 of the majority class is 0.73);
    - `top_class_share`: the share of predictions in the most-predicted class (1.0: a collapsed model);
    - `majority_accuracy`: the accuracy of always answering the split's most frequent class.
    Written out in numpy: importing scikit-learn costs each job process about a second."""
    preds = np.asarray(logits).argmax(axis=-1)
    labels = np.asarray(labels)

    def f1(label) -> float:
        tp = np.sum((preds == label) & (labels == label))
        wrong = np.sum(preds != labels, where=(preds == label) | (labels == label))  # false pos. + false neg.
        return float(2 * tp / (2 * tp + wrong)) if tp + wrong else 0.0

    macro = float(np.mean([f1(label) for label in np.union1d(labels, preds)]))
    return {
        "accuracy": float(np.mean(preds == labels)),
        "f1": f1(1) if num_labels == 2 else macro,
        "macro_f1": macro,
        "top_class_share": float(np.bincount(preds).max() / len(preds)),
        "majority_accuracy": float(np.bincount(labels).max() / len(labels)),
    }


LM_METRIC_KEYS = ("perplexity", "next_token_accuracy")  # task=causal_lm: language_model_metrics


def metric_keys(task: str) -> tuple[str, ...]:
    """The quality figures an evaluation of `task` gives, besides the loss."""
    return LM_METRIC_KEYS if task == "causal_lm" else METRIC_KEYS


def next_token_accuracy(predictions: np.ndarray, labels: np.ndarray) -> float:
    """The share of the positions with a label whose most likely token (`predictions`: the argmax of the
    logits, batch x sequence) is the token that follows: prediction i against label i + 1, the shift
    transformers' causal-LM loss makes; labels of -100 (padding) are left out."""
    predicted, target = np.asarray(predictions)[:, :-1], np.asarray(labels)[:, 1:]
    kept = target != IGNORE_INDEX
    return float((predicted == target)[kept].mean())


def language_model_metrics(loss: float, accuracy: float) -> dict[str, float]:
    """A language model's quality beside its eval loss: perplexity, exp(loss) (the loss: the mean over
    batches of each batch's mean next-token cross-entropy, as the Trainer's eval_loss), and next-token
    accuracy."""
    return {"perplexity": math.exp(loss) if loss < 700 else math.inf, "next_token_accuracy": accuracy}


def restored(meta: dict, collate, losses: StepLosses, val_series: dict) -> None:
    """What the steps before a checkpoint recorded (its pipeline.json), back in place: their losses, their
    batches' tokens, the validation series."""
    collate.batches[: len(meta["batches"])] = [tuple(b) for b in meta["batches"]]  # (a replay made them too)
    losses.values = list(meta["losses"])
    val_series.update({k: {int(s): v for s, v in steps.items()} for k, steps in meta["val_series"].items()})


def stopped(saves, step: int, write, batches, losses: StepLosses, val_series, peak, runtime_s, first) -> None:
    """The end of `step` where a checkpoint is due (saves.due) or the job was asked to stop: the checkpoint
    (`write(folder)` the backend's state, beside it what the record needs of the steps so far: their losses,
    their `batches`' tokens), then, where asked to stop, pipeline.checkpoint.Preempted."""
    from pipeline import checkpoint

    saved = None
    if saves.due(step):
        peak_mb = peak.metrics()["peak_memory_mb"]
        meta = {"losses": losses.read(), "batches": batches, "val_series": val_series}
        saved = saves.save(step, write, {**meta, "segments": saves.segments(peak_mb, runtime_s, first, step)})
    if checkpoint.stop_asked():
        raise checkpoint.Preempted(step, saved, losses.read(), val_series)


def training_memory(cfg, spec, device, model):
    """The peak-memory tracker of a training loop, set up alike for both backends."""
    import torch

    from pipeline.memory import TrainingMemory

    na = None
    if cfg.train.sharding == "fsdp":
        na = "n/a: FSDP swaps each unit's weights between shards and gathered copies inside the pass, which the step's breakdown cannot follow"
    elif torch.device(device).type == "cuda":
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
        accumulation=cfg.train.gradient_accumulation_steps,
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


def check_device(spec, device) -> None:
    """One line, before training, when the optimizer cannot run on this device (AdaLomo off CUDA)."""
    import torch

    if spec.needs_cuda and torch.device(device).type != "cuda":
        raise ValueError(
            f"optim={spec.name} needs a CUDA device: {spec.needs_cuda}, and this job runs on {device}"
        )


def optimizer_step_mode(spec, device):
    """A context for the training loop: an optimizer whose step torch.compile would compile runs it eagerly
    where `spec.compiled_on` says it does not compile (CPU); nothing changes otherwise."""
    import contextlib

    import torch

    if spec.compiles_step and not spec.compiled_on(torch.device(device).type):
        return torch.compiler.set_stance("force_eager")
    return contextlib.nullcontext()


@dataclass
class Trained:
    """What the train stage hands the measure stage: the collator (its `input_names`: a batch's tensors), and a
    training run's output with what each rank measured, or a batch search's largest batch that fits and each
    fitting probe's figures by batch size (pipeline.batch_size)."""

    output: TrainOutput | None = None
    collate: object = None  # pipeline.data.PaddingCollator
    largest: int | None = None
    probes: dict[int, dict] | None = None
    # what this rank measured: its optimizer's state (StateSize, and its paged part), its steps' times
    # (StepTimer.figures) and the device's peak FLOP/s (timing.peak_flops); every rank's record
    # (pipeline.distributed.Ranks: the state, the peak, the batches' tokens, the largest batch)
    state: object = None
    paged: object = None
    steady: dict | None = None
    peak_flops: tuple | None = None
    ranks: object = None


def run(cfg, spec, model, splits, collate, job_dir, train=None) -> Trained:
    """The train stage: the backend (`backend.name`; or `train`, a function of the backends' `train` signature)
    trains the model `train.max_steps` steps with the optimizer `spec` on the splits as `collate` pads them
    (pipeline.data.PaddingCollator), its steps timed; then what this rank measured is read once, from what holds
    it (its optimizer's state, the peaks, its batches' tokens, its steps' times), and every rank's record is
    gathered on every rank (one collective: every rank calls it). With find_batch_size=true it searches the
    largest batch that fits instead (pipeline.batch_size)."""
    import torch

    from pipeline import batch_size, distributed
    from pipeline.state import optimizer_state_size, paged_state_size
    from pipeline.timing import StepTimer, peak_flops, step_tokens, warmup_steps

    train = train or get(cfg.backend.name).train
    if cfg.find_batch_size:
        if cfg.memory_budget_mb is None and not torch.cuda.is_available():
            raise ValueError(
                "find_batch_size=true on CPU needs memory_budget_mb=<MB>: there is no device limit"
            )

        def collate_for(probe):
            return collate.padded(probe.train.padding, probe.train.max_length)

        largest, probes = batch_size.search(cfg, model, splits, spec, collate_for, job_dir, train)
        return Trained(collate=collate, largest=largest, probes=probes)
    with StepTimer(model, cfg.train.gradient_accumulation_steps) as timer:
        output = train(cfg, model, splits, spec, collate, job_dir)
    state, paged = optimizer_state_size(output.optimizer), paged_state_size(output.optimizer)
    record = {
        "optimizer_state_bytes": state.bytes,
        "peak_memory_mb": output.peak.metrics()["peak_memory_mb"],
        # each step's (real, padded) tokens
        "batches": step_tokens(collate.batches, cfg.train.max_steps, output.per_epoch, cfg),
        "largest_batch": list(output.peak.largest_batch),
        "largest_before_state": output.peak.largest_before_state,
        "largest_with_state": list(output.peak.largest_with_state),
    }
    ranks = distributed.gather(cfg, model, record, job_dir)
    steady = timer.figures(warmup_steps(cfg))
    before = output.segments[-1]["first_step"] - 1 if output.segments else 0  # steps of earlier segments
    if before and steady["window"] is not None:  # the window's steps as the run counts them
        steady["window"] = (steady["window"][0] + before, steady["window"][1] + before, steady["window"][2])
    peak = peak_flops(output.device, cfg.train.precision, cfg.outputs_dir)
    return Trained(output, collate, state=state, paged=paged, steady=steady, peak_flops=peak, ranks=ranks)


def get(name: str):
    """The backend module (`name` is checked by pipeline.config before any job starts)."""
    return importlib.import_module(f"pipeline.backends.{name}")
