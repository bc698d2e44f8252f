"""Predicted peak memory of a training step from shapes alone: the model's parameter shapes and config, the
optimizer's state estimate, the batch shape and the precision. No tensor is allocated.

    peak = weights + state + max(activations + backward working set,  gradients + optimizer-step temporaries)

The first term is the start of the backward pass (every activation saved, the state in place); the second
the optimizer step (every gradient present, the activations freed). Activations follow what a Hugging Face
encoder layer saves for backward (counted with `torch.autograd.graph.saved_tensors_hooks`), per layer:
10 tensors of batch x seq x hidden, 2 of batch x seq x intermediate, 3 of batch x heads x seq x seq, and
one-byte dropout masks (2 of the first shape, 1 of the last).
"""

from __future__ import annotations

from typing import NamedTuple

from pipeline import MB


class Dims(NamedTuple):
    layers: int
    hidden: int
    heads: int
    intermediate: int


def transformer_dims(model_config) -> Dims:
    """Layer count and widths from a transformers config (BERT, DistilBERT, RoBERTa and GPT-2 names)."""
    hidden = model_config.hidden_size
    intermediate = next(
        (
            v
            for k in ("intermediate_size", "hidden_dim", "n_inner")
            if (v := getattr(model_config, k, None)) is not None
        ),
        4 * hidden,
    )
    return Dims(model_config.num_hidden_layers, hidden, model_config.num_attention_heads, intermediate)


def activation_bytes(dims: Dims, batch: int, seq: int, itemsize: int) -> int:
    """Bytes saved for backward by one forward pass (embeddings and every layer)."""
    tokens = batch * seq
    sbh, sbi, as2b = tokens * dims.hidden, tokens * dims.intermediate, batch * dims.heads * seq * seq
    layer = sbh * (10 * itemsize + 2) + sbi * 2 * itemsize + as2b * (3 * itemsize + 1)
    embeddings = sbh * (2 * itemsize + 1)  # their sum, its LayerNorm output, a dropout mask
    return dims.layers * layer + embeddings


def backward_working_set(dims: Dims, batch: int, seq: int, itemsize: int) -> int:
    """At the start of backward: the gradient of the largest activation and its temporary."""
    return 2 * itemsize * batch * seq * max(dims.intermediate, dims.heads * seq)


def predicted_peak(
    params,
    state_bytes: int,
    model_config,
    batch: int,
    seq: int,
    precision: str,
    step_temporaries: tuple[float, float],
) -> dict[str, float]:
    """Predicted peak (MB) and its parts. `params`: pipeline.optimizers.ParamInfo of the trainable weights;
    `step_temporaries`: (times the largest weight, times all weights) the optimizer step allocates at once."""
    weights = sum(p.numel * p.itemsize for p in params)
    largest = max(p.numel * p.itemsize for p in params)
    itemsize = 4 if precision == "fp32" else 2  # mixed or pure 16-bit: activations are mostly 16-bit
    dims = transformer_dims(model_config)
    activations = activation_bytes(dims, batch, seq, itemsize)
    at_backward = activations + backward_working_set(dims, batch, seq, itemsize)
    per_largest, per_all = step_temporaries
    at_step = weights + per_largest * largest + per_all * weights  # gradients + the step's temporaries
    return {
        "predicted_peak_mb": (weights + state_bytes + max(at_backward, at_step)) / MB,
        "predicted_activations_mb": activations / MB,
    }
