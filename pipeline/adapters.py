"""Parameter-efficient fine-tuning (peft=lora / qlora) of a job's model: LoRA adapters (Hugging Face peft) on a
frozen base, for QLoRA the base's Linear layers in 4 bits (bitsandbytes Linear4bit); the method's name, the
trainable count, the frozen weights, and the 4-bit base's bytes measured and by formula; any model's size and
FLOPs per token's counts as a job records them (a 4-bit weight counted as the weights it packs).

peft=none leaves the model as it is (full fine-tuning). Torch, peft and bitsandbytes are imported inside the
functions, so the config can be checked (and the method named) before any heavy import.
"""

from __future__ import annotations

import warnings
from math import ceil, prod
from typing import NamedTuple

from pipeline import MB

METHODS = ("none", "lora", "qlora")
# the keys each method reads (every option of conf/peft has all of them, so that one sweep sets them for all)
LORA_KEYS = ("r", "alpha", "dropout", "target_modules", "save_adapter", "base_dtype", "adapter_dtype")
KEYS = {"none": (), "lora": LORA_KEYS, "qlora": (*LORA_KEYS, "quant_type", "double_quant", "compute_dtype")}
ALL_LINEAR = "all-linear"  # peft's own: every Linear but the output layer
QUANT_TYPES = ("nf4", "fp4")
COMPUTE_DTYPES = ("fp32", "bf16", "fp16")

# the Linear layers LoRA adapts when peft.target_modules is null, by model type: each family's attention
# projections, query, key, value and output (names as peft matches them: a module's name or its last parts)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
TARGETS = {
    "bert": ("query", "key", "value", "attention.output.dense"),  # BERT, MiniLM, model=tiny
    "roberta": ("query", "key", "value", "attention.output.dense"),
    "distilbert": ("q_lin", "k_lin", "v_lin", "out_lin"),
    "llama": ATTENTION,
    "qwen2": ATTENTION,
    "mistral": ATTENTION,
    "gpt2": ("attn.c_attn", "attn.c_proj"),  # GPT-2's Conv1D layers (weights stored transposed)
}
# the head: trained in full by a classifier (peft's sequence-classification task type keeps a trainable copy of
# every module whose name ends in `classifier` / `score`, DistilBERT's pre_classifier too, the original frozen
# beside it), frozen in a language model; never quantized
HEADS = ("classifier", "score", "lm_head")

# bitsandbytes' 4-bit layout: two weights a byte, one absmax per block of 64 weights (fp32; with double
# quantization uint8, with an fp32 absmax per 256 of them, an fp32 offset and a 256-entry fp32 code of their
# own), and each layer's 16-entry fp32 code (the quantization map: NF4's or FP4's values)
BLOCK, NESTED_BLOCK, CODE, NESTED_CODE, FP32 = 64, 256, 16, 256, 4
TASK_TYPES = {"classification": "SEQ_CLS", "causal_lm": "CAUSAL_LM"}
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
NAMES = {f"torch.{torch_name}": name for name, torch_name in DTYPES.items()}  # str(torch dtype) -> its name
# peft.base_dtype, peft.adapter_dtype: `auto` or a dtype
WEIGHT_DTYPES = ("auto", *DTYPES)
# base_dtype=auto: the frozen base in the dtype each train.precision computes in (the 16-bit one under mixed
# precision, as `from_pretrained(..., dtype=torch.bfloat16)` loads it)
COMPUTE = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "bf16_pure": "bf16"}


def name(cfg) -> str:
    """peft.name of a config, `none` where the config has no peft group (a config from before it)."""
    peft = cfg.get("peft") if hasattr(cfg, "get") else None
    return "none" if peft is None else str(peft.get("name", "none"))


def used(peft: dict) -> dict:
    """The peft group's keys that its method reads (a config hash, the params): `name` and KEYS[name]."""
    return {k: v for k, v in peft.items() if k == "name" or k in KEYS.get(peft.get("name"), ())}


def torch_dtype(name: str):
    import torch

    return getattr(torch, DTYPES[name])


def method(cfg) -> str:
    """The method a run trains with, as tables name it: `full`, `lora r=16`, `qlora r=16 nf4`."""
    kind = name(cfg)
    if kind == "none":
        return "full"
    text = f"{kind} r={cfg.peft.r}"
    return f"{text} {cfg.peft.quant_type}" if kind == "qlora" else text


def targets(peft_cfg, model_type: str) -> list[str] | str:
    """The modules LoRA adapts: peft.target_modules, or the family's default (TARGETS)."""
    chosen = peft_cfg.target_modules
    if chosen is None:
        if model_type not in TARGETS:
            raise ValueError(
                f"peft.target_modules=null: no default target modules for model type {model_type} (the families "
                f"with one: {', '.join(TARGETS)}); name them (peft.target_modules=[...]) or use all-linear"
            )
        return list(TARGETS[model_type])
    return chosen if isinstance(chosen, str) else [str(t) for t in chosen]


def targets_text(peft_cfg, found) -> str:
    """The adapted modules (`found`: as peft resolved them) as one param: the names asked for, in order
    (`attention.output.dense,key,query,value`); for all-linear the layers' own names, not every module's path
    (`all-linear: down_proj,gate_proj,...`)."""
    if peft_cfg.target_modules == ALL_LINEAR:
        return f"{ALL_LINEAR}: " + ",".join(sorted({t.split(".")[-1] for t in found}))
    return ",".join(sorted(found))


def apply(
    model,
    peft_cfg,
    task: str,
    model_type: str,
    device: str = "cpu",
    quantized: bool = True,
    trained_dtype=None,
):
    """The model a job trains under `peft_cfg`: itself (peft=none), or peft's model with LoRA adapters on the
    target modules and the rest frozen, for qlora over a base whose Linear layers (all but the head) are 4-bit,
    quantized on `device` (where the job trains: bitsandbytes quantizes as a weight moves to its device).
    `quantized=False`: qlora's adapters on a base left as it is (the same trainable parameters, e.g. on the meta
    device, where nothing can be quantized). `trained_dtype` (a torch dtype): every trainable parameter's, the
    adapters' and a classifier's head's (pipeline.models.dtypes); None: the base's."""
    if peft_cfg.name == "none":
        return model
    from peft import LoraConfig, get_peft_model

    quantized = quantized and peft_cfg.name == "qlora"
    if quantized:
        quantize(model, peft_cfg, device)
    config = LoraConfig(
        task_type=TASK_TYPES[task],
        r=peft_cfg.r,
        lora_alpha=peft_cfg.alpha,
        lora_dropout=peft_cfg.dropout,
        target_modules=targets(peft_cfg, model_type),
        # GPT-2's Conv1D keeps its weight as (in, out); a 4-bit copy of it is a Linear's (out, in)
        fan_in_fan_out=model_type == "gpt2" and not quantized,
    )
    # the adapters made in the base's dtype, then every trainable weight cast to `trained_dtype` (peft's own
    # autocast_adapter_dtype casts the adapters, not the head's trainable copy). peft reads transformers'
    # deprecated `is_gradient_checkpointing`, whose FutureWarning is peft's to act on, not the user's
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        model = get_peft_model(model, config, autocast_adapter_dtype=False)
    if trained_dtype is not None:
        cast_trained(model, trained_dtype)
    return model


def cast_trained(model, dtype) -> None:
    """Every trainable parameter in `dtype`, module by module (`Module._apply`, as `Module.to` converts, which a
    plan's fake tensors take too): the modules whose own parameters all train (the adapters' Linear layers, a
    classifier's trainable head)."""
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if own and all(p.requires_grad for p in own) and any(p.dtype != dtype for p in own):
            module._apply(lambda t: t.to(dtype) if t.is_floating_point() else t, recurse=False)
    mixed = [n for n, p in model.named_parameters() if p.requires_grad and p.dtype != dtype]
    if mixed:  # a module holding trainable and frozen weights of its own: none of the methods here makes one
        raise ValueError(f"trainable parameters left out of {dtype}: {', '.join(mixed[:3])}")


def compute_dtype(peft_cfg, weights_dtype):
    chosen = peft_cfg.get("compute_dtype")
    return weights_dtype if chosen is None else torch_dtype(chosen)


def quantize(model, peft_cfg, device: str) -> None:
    """Every Linear (and GPT-2's Conv1D) of the model but the head, in place, as a frozen bitsandbytes
    Linear4bit quantized on `device`. Its quantization constants (absmax, codes, offset) become non-persistent
    buffers of the layer, so that whatever counts a model's weights (the peak trackers, the breakdown) counts
    them too; they are the same tensors the layer computes with.

    On fake tensors (a plan: pipeline.plan_step) the same layers come from the same quantization, bitsandbytes'
    quantize_4bit, which its fake kernels answer with the packed weight and the constants in their shapes and
    dtypes (`_fake_4bit`)."""
    import contextlib

    import bitsandbytes as bnb
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
    from transformers.pytorch_utils import Conv1D

    double = bool(peft_cfg.double_quant)
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if child_name.endswith(HEADS) or not isinstance(child, (torch.nn.Linear, Conv1D)):
                continue
            weight = child.weight.data if isinstance(child, torch.nn.Linear) else child.weight.data.t()
            out_features, in_features = weight.shape
            fake = isinstance(weight, FakeTensor)
            with unset_fake_temporarily() if fake else contextlib.nullcontext():  # its meta weight: not fake
                layer = bnb.nn.Linear4bit(
                    in_features,
                    out_features,
                    bias=child.bias is not None,
                    compute_dtype=compute_dtype(peft_cfg, weight.dtype),
                    compress_statistics=double,
                    quant_type=peft_cfg.quant_type,
                    device="meta",
                )
            if fake:
                layer.weight = _fake_4bit(weight, layer)
            else:
                layer.weight = bnb.nn.Params4bit(
                    weight.contiguous(),
                    requires_grad=False,
                    compress_statistics=double,
                    quant_type=peft_cfg.quant_type,
                    module=layer,
                )
            if child.bias is not None:
                layer.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
            if not fake:
                layer = layer.to(device)  # quantizes the weight
            # bitsandbytes' CPU inference path (eval mode, no grad, an AVX512-BF16 CPU) repacks the weight and
            # its absmax in place, for good, in another layout (and fails for inputs under 64 features): the
            # layer keeps the layout it trains with
            layer.support_avx512bf16_for_cpu = False
            for key, tensor in quant_constants(layer.weight.quant_state).items():
                layer.register_buffer(key, tensor, persistent=False)
            setattr(parent, child_name, layer)


# the attributes a Params4bit carries besides its data and quantization state (bitsandbytes.nn.Params4bit)
PARAMS4BIT_SETTINGS = ("blocksize", "compress_statistics", "quant_type", "quant_storage")


def _fake_4bit(weight, layer):
    """A fake weight quantized as Params4bit quantizes a real one as it moves to its device (`_quantize`: the
    same quantize_4bit call with the layer's settings), held as a frozen Parameter that carries Params4bit's
    attributes (a Params4bit cannot wrap a fake tensor), which Linear4bit's forward and peft read as they read
    a Params4bit's."""
    import bitsandbytes as bnb
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    settings = {key: getattr(layer.weight, key) for key in PARAMS4BIT_SETTINGS}
    if settings["compress_statistics"]:
        # double quantization's 8-bit map, which bitsandbytes makes at its first quantization and keeps for
        # the process: made from a real tensor, so that it never keeps a fake one
        with unset_fake_temporarily():
            bnb.functional.quantize_blockwise(torch.zeros(NESTED_BLOCK))
    packed, state = bnb.functional.quantize_4bit(weight.contiguous(), **settings)
    param = torch.nn.Parameter(packed, requires_grad=False)
    for key, value in {**settings, "quant_state": state, "bnb_quantized": True, "module": None}.items():
        setattr(param, key, value)
    layer.quant_state = state
    return param


def quant_constants(state) -> dict:
    """The tensors of a 4-bit weight's quantization state besides the packed weight, by buffer name."""
    found = {"weight_absmax": state.absmax, "weight_code": state.code}
    if state.nested:
        found |= {
            "weight_nested_absmax": state.state2.absmax,
            "weight_nested_code": state.state2.code,
            "weight_offset": state.offset,
        }
    return found


def is_4bit(p) -> bool:
    """A bitsandbytes 4-bit weight (Params4bit): two weights packed in each byte, its shape the quantized one."""
    return getattr(p, "quant_state", None) is not None


def weights(p) -> int:
    """The weights a parameter holds: a 4-bit one's are those of its original shape."""
    return prod(p.quant_state.shape) if is_4bit(p) else p.numel()


def quantized_bytes(shape, double_quant: bool) -> int:
    """The bytes of one weight of `shape` in 4 bits, by formula: the packed weights, the absmax per block of 64
    (fp32, or uint8 with double quantization's fp32 absmax per 256 of them, fp32 offset and 256-entry code), the
    16-entry fp32 code."""
    n = prod(shape)
    blocks = ceil(n / BLOCK)
    constants = blocks * FP32
    if double_quant:
        constants = blocks + ceil(blocks / NESTED_BLOCK) * FP32 + FP32 + NESTED_CODE * FP32
    return ceil(n / 2) + constants + CODE * FP32


def measured_quantized_bytes(model) -> int:
    """The 4-bit base's bytes as held: every 4-bit weight's storage and its quantization constants."""
    total = 0
    for p in model.parameters():
        if is_4bit(p):
            state = p.quant_state
            total += p.untyped_storage().nbytes()
            total += sum(t.untyped_storage().nbytes() for t in quant_constants(state).values())
    return total


def estimated_quantized_bytes(model, double_quant: bool) -> int:
    return sum(quantized_bytes(p.quant_state.shape, double_quant) for p in model.parameters() if is_4bit(p))


def trainable_params(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


class ModelFlops(NamedTuple):
    """What a training token costs (flops_per_token): N, L x H x Q, and the trained part of N."""

    non_embedding: int  # N: every parameter but the embedding tables' (looked up, not multiplied)
    attention: int  # L x H x Q: layers x query heads x head size
    trained: int  # the part of N that trains: all of it in full fine-tuning, adapters (and a head) with peft


def model_flops(model) -> ModelFlops:
    """What a training token costs, by the usual definition (Kaplan et al. 2020, eq. 2.2; PaLM, Chowdhery et
    al. 2022, appendix B; nanoGPT's `estimate_mfu`), counted as the step does it: (N, L x H x Q, N trained) for
    FLOPs per token = 4 N + 2 N_trained + 12 L H Q T (flops_per_token). N: the non-embedding parameters (every
    parameter but those of the embedding tables, which a token looks up rather than multiplies: word, position
    and token-type embeddings); 2 FLOPs per parameter forward, 2 backward for the activations' gradients, 2 more
    for the weights' gradients of those that train, so 6 N in full fine-tuning and 4 N + 2 N_trained over a
    frozen base (adapters); L H Q: layers x query heads x head size, 12 L H Q T: the attention scores and their
    weighted sum (QK^T and AV, 2 x 2 x T x H Q FLOPs a token and layer forward, x3 with backward) over T
    positions."""
    import torch

    embeddings = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    distinct = [p for p in {id(p): p for p in model.parameters()}.values() if id(p) not in embeddings]
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelFlops(
        sum(weights(p) for p in distinct),
        config.num_hidden_layers * heads * head_dim,
        sum(weights(p) for p in distinct if p.requires_grad),
    )


def model_size(model) -> tuple[int, ModelFlops]:
    """(parameters, model_flops) of the whole model; the model stage counts them (Built), before any wrapper
    (FSDP) shards it, after which each rank's parameters hold its shard only. A 4-bit weight (peft=qlora) counts
    the weights it holds, two a byte."""
    return sum(weights(p) for p in model.parameters()), model_flops(model)


def figures(cfg, model) -> tuple[dict, dict]:
    """A model's (metrics, params) as a job records them: the dtypes it holds (held_dtypes); with adapters also
    the trainable count, the trainable and frozen weights' bytes (the frozen ones with the buffers and a 4-bit
    base's constants), the 4-bit base's bytes measured and by formula, its targets as peft resolved them."""
    if name(cfg) == "none":
        return {}, held_dtypes(model)
    held = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
    trainable = sum(t.untyped_storage().nbytes() for t in held if t.requires_grad)
    frozen = sum(t.untyped_storage().nbytes() for t in held if not t.requires_grad)
    count = trainable_params(model)
    metrics = {
        "model_trainable_params": count,
        "trainable_weights_mb": trainable / MB,
        "frozen_weights_mb": frozen / MB,
    }
    if name(cfg) == "qlora":
        measured = measured_quantized_bytes(model)
        metrics |= {
            "quantized_weights_bytes": measured,
            "quantized_weights_mb": measured / MB,
            "estimated_quantized_weights_bytes": estimated_quantized_bytes(model, cfg.peft.double_quant),
        }
    params = {
        "peft_targets": targets_text(cfg.peft, model.peft_config["default"].target_modules),
        "trainable_params": count,
        **held_dtypes(model),
    }
    return metrics, params


def held_dtypes(model) -> dict[str, str]:
    """What a model trained in, read off its parameters: `trainable_dtype`, and for a frozen base (adapters)
    `base_dtype`, its floating weights' (not a 4-bit base's packed bytes); several dtypes comma-separated."""

    def names(params) -> str:
        return ",".join(sorted({NAMES.get(str(p.dtype), str(p.dtype)) for p in params}))

    held = {id(p): p for p in model.parameters()}.values()
    found = {"trainable_dtype": names(p for p in held if p.requires_grad)}
    frozen = [p for p in held if not p.requires_grad and p.is_floating_point() and not is_4bit(p)]
    if frozen:
        found["base_dtype"] = names(frozen)
    return found
