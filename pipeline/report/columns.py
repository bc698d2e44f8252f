"""The report's columns: which MLflow metric fills which column, their labels and what they mean."""

BASELINE = "adamw"
# how a run trains (param `method`: `full`, `lora r=16`, `qlora r=16 nf4`; a run without it, recorded before
# peft existed, is full fine-tuning): where some run is not full, a row's own key beside the optimizer, and the
# baseline is full fine-tuning with the baseline optimizer (`--baseline "adamw lora r=16"` names another)
METHOD, FULL = "method", "full"
# the comparison group of a row: Δ is taken against the baseline optimizer of the same group
GROUP = ["model", "batch_size", "backend", "precision"]
# settings that split rows further when a sweep varies them (never the seed: seeds are the repeats)
OTHER_SETTINGS = [
    "data",
    "lr",
    "lr_scale",
    "max_steps",
    "max_length",
    "weight_decay",
    "pretrained",
    "world_size",
    "sharding",
]
# the learning rate: a setting of its own only where an optimizer ran at more than one (see point_columns)
RATES = ["lr", "lr_scale"]
# comparison-table column (unit in brackets) <- MLflow metric
COLUMNS = {
    "state [MB]": "optimizer_state_mb",
    "estimated state [MB]": "estimated_optimizer_state_mb",
    "peak [MB]": "peak_memory_mb",
    "peak reserved [MB]": "peak_memory_reserved_mb",
    "predicted peak [MB]": "predicted_peak_mb",
    "prediction error [%]": "predicted_peak_error_pct",
    "peak: weights [MB]": "peak_params_mb",
    "peak: gradients [MB]": "peak_grads_mb",
    "peak: optimizer state [MB]": "peak_optimizer_mb",
    "peak: activations [MB]": "peak_activations_mb",
    "peak: logits [MB]": "peak_logits_mb",
    "peak: other [MB]": "peak_other_mb",
    "train loss [nats]": "train_loss_final",
    "eval loss [nats]": "eval_loss",
    "eval accuracy [0-1]": "eval_accuracy",
    "eval F1 [0-1]": "eval_f1",
    "eval perplexity": "eval_perplexity",
    "eval next-token accuracy [0-1]": "eval_next_token_accuracy",
    "throughput [samples/s]": "train_samples_per_second",
    "throughput [tokens/s]": "train_tokens_per_second",
    "padding [0-1]": "padding_fraction",
    "MFU [0-1]": "mfu",
    "optimizer step [ms]": "optimizer_step_ms",
}
# the adapters' settings a method's name does not carry (params, PEFT runs only): a row's keys after the
# method where a sweep varies them within one model (a full fine-tuning row leaves them empty)
PEFT_SETTINGS = [
    "peft_alpha",
    "peft_dropout",
    "peft_targets",
    "peft_base_dtype",
    "peft_adapter_dtype",
    "peft_double_quant",
    "peft_compute_dtype",
]
# the columns of a report with PEFT runs (some method not full) only, before its state (label <- MLflow metric);
# a full fine-tuning row's trainable count is its model's (`model_num_params`: every weight trains)
PEFT_COLUMNS = {
    "trainable params": "model_trainable_params",
    "frozen weights [MB]": "frozen_weights_mb",
}
# of those, what the lead table shows (after n)
PEFT_DECISION = ["trainable params"]
DELTAS = {"state": "state [MB]", "peak": "peak [MB]"}
SEEDS = "n [seeds]"
HARDLY = (
    "hardly learned [runs]"  # of a language model's row's runs, those whose loss is near a uniform guess's
)
COLLAPSED = "collapsed [runs]"  # of a row's runs, those whose predictions fell (nearly) all in one class
KEY_LABELS = {
    "optim": "optimizer",
    "batch_size": "batch size [samples]",
    "lr_scale": "lr scale",
    "max_steps": "max steps [steps]",
    "max_length": "max length [tokens]",
    "weight_decay": "weight decay",
    "peft_alpha": "lora alpha",
    "peft_dropout": "lora dropout",
    "peft_targets": "lora targets",
    "peft_base_dtype": "base dtype",
    "peft_adapter_dtype": "adapter dtype",
    "peft_double_quant": "double quant",
    "peft_compute_dtype": "compute dtype",
}
# the tasks (conf/task/, param `task`; a run without the param is a classifier's), in the report's order, and
# how each task's table is headed where the report holds a language model
CLASSIFICATION, CAUSAL_LM = "classification", "causal_lm"
TASKS = {CLASSIFICATION: "classification", CAUSAL_LM: "language model"}
# the columns only one task logs (its quality; a language model's logits part of the peak): a table holds those
# of the tasks of its rows, never the others'
TASK_COLUMNS = {
    CLASSIFICATION: ["eval accuracy [0-1]", "eval F1 [0-1]"],
    CAUSAL_LM: ["eval perplexity", "eval next-token accuracy [0-1]", "peak: logits [MB]"],
}
# the comparison's lead table (after the optimizer and the settings that differ between rows): what the
# choice of an optimizer turns on (quality: a classifier's F1, a language model's perplexity); the other
# columns sit in the "All columns" table below it. A table holds one task's quality columns, not the other's
DECISION = ["state [MB]", "Δ state [%]", "peak [MB]", "Δ peak [%]", "eval F1 [0-1]", "eval perplexity"]
DECISION += ["throughput [samples/s]"]
CONSOLE = ["state [MB]", "Δ state [%]", "peak [MB]", "Δ peak [%]", "eval loss [nats]", "eval F1 [0-1]"]
CONSOLE += ["eval perplexity", "eval next-token accuracy [0-1]", "throughput [samples/s]"]
LEGEND = {
    "n [seeds]": "finished jobs (seeds) behind the row; with n > 1 every value is mean ± sample std (ddof=1)",
    "collapsed [runs]": "runs of the row whose predictions fell (nearly) all in one class (tag `collapsed`); "
    "such a row's optimizer reads `adamw (collapsed)` (every run) or `adamw (collapsed 1 of 3)` in every table",
    "state [MB]": "measured optimizer state after the last step (`optimizer_state_mb`, MB = 2^20 bytes)",
    "estimated state [MB]": "analytic state size from the parameter shapes (`estimated_optimizer_state_mb`)",
    "Δ state [MB], [%]": "state minus the baseline's state in the same model / batch size / backend / precision group, "
    "and that difference in % of the baseline's state (negative = saves memory)",
    "peak [MB]": "peak device memory while training (`peak_memory_mb`: CUDA allocator peak, or CPU tensor peak)",
    "Δ peak [MB], [%]": "peak minus the baseline's peak in the same group, absolute and in % of the baseline's",
    "peak reserved [MB]": "CUDA caching allocator's peak (`peak_memory_reserved_mb`); empty on CPU",
    "predicted peak [MB]": "peak predicted from shapes alone (`predicted_peak_mb`: weights + state + the larger "
    "of activations and gradients + the optimizer step's temporaries), for the largest batch",
    "prediction error [%]": "(predicted − measured) / measured peak (`predicted_peak_error_pct`)",
    "peak: weights / gradients / optimizer state / activations / other [MB]": "what memory holds at the "
    "moment of the peak of the profiled step (step 2; tag `peak_breakdown`), by PyTorch's MemTracker "
    "(`peak_params_mb`, ...): not each part's own maximum. Gradients 0 means the peak falls before the first "
    "gradient is written (forward or early backward), activations 0 that it falls after backward (the "
    "optimizer step); other = the backward pass's and the optimizer step's temporaries (on CUDA also what the "
    "allocator holds outside tensors); empty where the tracker cannot follow the optimizer",
    "peak: logits [MB]": "a language model's sixth part at the same moment (`peak_logits_mb`): every storage the "
    "forward or backward pass makes as a tensor whose last dimension is the LM head's vocabulary (the head's "
    "output, the loss's fp32 copy and log-softmax, their gradients), taken out of activations and other, so "
    "that the six parts add up to the peak",
    "train loss [nats]": "cross-entropy of the last training step (`train_loss_final`)",
    "eval loss [nats]": "mean cross-entropy on the eval split (`eval_loss`; a language model's: the mean over "
    "eval batches of each batch's mean next-token cross-entropy)",
    "eval accuracy [0-1], eval F1 [0-1]": "on the eval split; F1 of class 1 for 2 labels (its name: the "
    "preamble, param `label_names`), macro F1 otherwise",
    "eval perplexity": "a language model's exp(eval loss) (`eval_perplexity`): lower is better",
    "eval next-token accuracy [0-1]": "a language model's share of the eval split's labelled positions whose "
    "most likely token is the next one (`eval_next_token_accuracy`)",
    "optimizer (variant)": "an optimizer the Trainer runs otherwise than the plain one (param `optim_variant`, "
    "tag `trainer_optim`): the variant is named beside it and explained in the preamble",
    "throughput [samples/s]": "training samples per second over the steady steps, warm-up left out "
    "(`train_samples_per_second`; the tag `throughput_steps` names the steps)",
    "throughput [tokens/s]": "non-padding training tokens per second over the steady steps (`train_tokens_per_second`)",
    "padding [0-1]": "share of the training batches' tokens that are padding (`padding_fraction`)",
    "MFU [0-1]": "model FLOPs utilisation: (6 × non-embedding parameters + 12 × layers × attention width × "
    "sequence length) FLOPs per token × tokens/s against the device's peak for the precision (docs/metrics.md)",
    "optimizer step [ms]": "median wall time of one optimizer.step() (`optimizer_step_ms`)",
}
# the legend's entries of a report with PEFT runs only, after `n [seeds]`
PEFT_LEGEND = {
    "method": "how the row trains (param `method`): `full` fine-tuning, `lora r=16` (LoRA adapters of rank 16 on a "
    "frozen base), `qlora r=16 nf4` (the same on a 4-bit NF4 base); a run recorded without the param is `full`. "
    "Δ compares every row with the baseline: AdamW's full fine-tuning unless `--baseline` names another "
    "(the preamble says which)",
    "trainable params": "parameters that train (`model_trainable_params`: the adapters and the classifier's head); "
    "a full fine-tuning row's: all of them (`model_num_params`)",
    "frozen weights [MB]": "the frozen base's weights and buffers as held (`frozen_weights_mb`; a QLoRA base's "
    "4-bit weights with their quantization constants); empty on a full fine-tuning row, which freezes none",
}
# the legend's entries only one task's table has
TASK_LEGEND = {
    CLASSIFICATION: ["collapsed [runs]", "eval accuracy [0-1], eval F1 [0-1]"],
    CAUSAL_LM: ["peak: logits [MB]", "eval perplexity", "eval next-token accuracy [0-1]"],
}
# the tuned section: the quality metric that picks each optimizer's rate (val_<metric> on the validation
# split) and that the optimizers are compared on (eval_<metric> on the held-out test split) -> its label
QUALITY_METRICS = {"macro_f1": "macro-F1", "f1": "F1", "accuracy": "accuracy"}
QUALITY = "macro_f1"
# a language model's: the rate with the lowest mean validation loss (what its job returns), compared on the
# test split's loss and perplexity; whatever the classification metric asked for
LM_METRIC = "loss"
LOWER_IS_BETTER = {LM_METRIC}
METRIC_LABELS = {**QUALITY_METRICS, LM_METRIC: "loss"}
METRIC_UNITS = {**dict.fromkeys(QUALITY_METRICS, "[0-1]"), LM_METRIC: "[nats]"}
# the test figures a tuned row shows, by the metric that picked its rate (column label <- its eval_ metric)
TUNED_TESTS = {LM_METRIC: {"test loss [nats]": "eval_loss", "test perplexity": "eval_perplexity"}}
TARGET_FRACTION = 0.97  # steps to target: this share of the point's best final validation value
UNTUNED_NOTE = (
    "F1 is compared at untuned rates (one learning rate per optimizer); "
    "see docs/tuning.md for the tuned protocol."
)
UNTUNED_NOTE_LM = (
    "perplexity is compared at untuned rates (one learning rate per optimizer); "
    "see docs/tuning.md for the tuned protocol."
)
TUNED_LEGEND = {
    "rates tried": "the learning rates (`lr`) this optimizer finished at in this point, smallest first",
    "best lr, best lr scale": "the rate with the highest mean over seeds of the validation metric "
    "(`val_<metric>`, validation split carved from the training data); a rate with a collapsed run is never "
    "chosen while another rate has none; ties go to the smaller rate",
    "edge": "the best rate is the lowest or highest tried: the optimum may lie outside the grid, "
    "widen it there",
    "collapsed [runs]": "runs whose predictions are (nearly) all one class (tag `collapsed`): in the comparison "
    "those of the row, in the tuned table those of all rates; a rate with one is never chosen, and an optimizer "
    "whose every rate has one reads `no rate learned at this budget`",
    "val <metric> [0-1]": "the selection metric at the best rate (validation split)",
    "test macro-F1 / F1 [0-1]": "at the best rate, on the held-out test split (`eval_macro_f1`, `eval_f1`)",
    "Δ test <metric> [0-1]": "test metric minus the baseline's, each at its own best rate",
    "p (Welch), n vs baseline": "Welch's two-sided t-test (unequal variances) over seeds of the test metric "
    "against the baseline at its best rate; empty when either side has fewer than 2 seeds or neither side has "
    "any spread",
    "state / peak [MB]": "optimizer state and peak memory at the best rate",
    "steps to target [steps]": "first evaluation step at which the mean over seeds of the validation metric "
    "reaches the target (target fraction × the point's best final validation value); empty without history",
}
# the tuned legend of a language model's rows (selected by the lowest validation loss), where it differs
TUNED_LEGEND_LM = {
    "best lr, best lr scale": "the rate with the lowest mean over seeds of the validation loss (`val_loss`, "
    "validation split carved from the training data); ties go to the smaller rate",
    "val loss [nats]": "the selection metric at the best rate (validation split)",
    "test loss [nats], test perplexity": "at the best rate, on the held-out test split (`eval_loss`, "
    "`eval_perplexity`)",
    "Δ test loss [nats]": "test loss minus the baseline's, each at its own best rate (negative: lower loss)",
    "steps to target [steps]": "first evaluation step at which the mean over seeds of the validation loss "
    "falls to the target (the point's best final validation loss / target fraction); empty without history",
}

# the largest-batch table (find_batch_size=true jobs) <- MLflow metric
FIT_KEYS = ["model", "backend", "precision", "max_length", "memory_budget_mb", "optim"]
FIT_COLUMNS = {
    "largest batch [samples]": "max_batch_size",
    "predicted largest batch [samples]": "predicted_max_batch_size",
    "peak at largest batch [MB]": "max_batch_peak_memory_mb",
    "state [MB]": "optimizer_state_mb",
}

# the plan table (plan=true jobs: predicted, nothing trained) <- MLflow metric
PLAN_KEYS = [
    "model",
    "precision",
    "gradient_checkpointing",
    "max_length",
    "batch_size",
    "device_memory",
    "sharding",
    "world_size",
    "optim",
]
PLAN_DEFAULTS = {"sharding": "none", "world_size": "1"}  # keys left out of the plan table when all are so
PLAN_COLUMNS = {
    "weights [MB]": "predicted_peak_params_mb",
    "gradients [MB]": "predicted_peak_grads_mb",
    "optimizer state [MB]": "predicted_peak_optimizer_mb",
    "activations [MB]": "predicted_peak_activations_mb",
    "logits [MB]": "predicted_peak_logits_mb",  # a language model's (a classifier's plan has no such column)
    "other [MB]": "predicted_peak_other_mb",
    "predicted peak [MB]": "predicted_peak_mb",
    "budget [MB]": "budget_mb",
    "fits": "fits",
    "largest batch [samples]": "predicted_max_batch_size",
    "headroom [MB]": "predicted_headroom_mb",
    "headroom [%]": "predicted_headroom_pct",
    "ranks needed": "predicted_min_ranks",
    "largest batch there [samples]": "predicted_max_batch_at_min_ranks",
    # the field's rules of thumb: Adam's state whatever the optimizer (anchors, not this plan's figures)
    "ZeRO formula, Adam [MB]": "deepspeed_zero_mb",
    "accelerate estimate, Adam [MB]": "accelerate_estimate_mb",
    "18 bytes/param, Adam [MB]": "bytes_rule_mb",
    "parameters": "model_num_params",
}
# a plan's recipe (pipeline.recipe): the overrides, their kinds, its peak and largest batch
RECIPE = ("recipe", "recipe_kinds", "recipe_peak_mb", "recipe_max_batch_size")

# param optim_variant -> (the label beside the optimizer, what it means); `plain` gets none
VARIANTS = {
    "trainer_embedding_fp32": (
        "Trainer: fp32 embedding state",
        "the Trainer's bitsandbytes 8-bit path keeps the state of embedding weights in 32-bit (param "
        "`optim_variant=trainer_embedding_fp32`), so on a model made mostly of embeddings (`tiny`) its state is "
        "close to AdamW's; the accelerator backend (or a setting the Trainer's string cannot carry) runs the "
        "plain optimizer; docs/optimizers.md",
    ),
}
# what the parts at the moment of the peak say of when it fell (peak_phase)
PHASES = {
    "forward": "forward or early backward (no gradient yet)",
    "backward": "backward (activations and gradients both held)",
    "step": "optimizer step (activations freed, gradients held)",
}

FAILURE_LABELS = {
    "oom": "does not fit (out of memory)",
    "nan_loss": "loss became NaN/inf",
    "killed": "killed",
    "lost": "lost (its process died)",
}
