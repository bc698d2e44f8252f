"""The kernels a CUDA GPU runs where they save for backward, or hold, other tensors than CPU's, put in place of
the CPU's while a plan simulates a step for a CUDA target (pipeline.plan_step; `cuda_kernels`): scaled dot-product
attention as its fused kernel (`cuda_attention`), dropout as its fused kernel (`cuda_dropout`: a 1-byte mask
saved, where the CPU saves a noise tensor in the input's dtype), autocast casting as CUDA's does
(`cuda_autocast`: layer norm and softmax in fp32, for one), and the autocast queries that libraries ask
without naming a device, which ask about CUDA's autocast (`is_autocast_enabled`: answered by the simulation's
CPU autocast, which stands in for CUDA's). A plan for a CPU target runs none of them: CPU's kernels are what
a CPU job runs. docs/plan.md (a CUDA target) lists every op of a step whose saved tensors differ."""

from __future__ import annotations

import contextlib
import functools
import math

import torch


def cuda_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """`F.scaled_dot_product_attention` as torch runs it on a CUDA GPU of sm80 or newer (A100, H100, H200,
    L4, L40S ...): the kernel its CUDA dispatch picks, called through that kernel's own aten op, so that
    autograd saves for backward what the kernel saves (the ops' meta kernels give the shapes):

    - flash attention, with no mask, 16-bit inputs and equal head dims up to 256: q, k and v (head dim padded
      to a multiple of 8), the output, the logsumexp (B x H x L, fp32) and dropout's philox seed and offset;
    - else memory-efficient attention, with head dims a multiple of 8 (16-bit) or 4 (fp32): q, k, v, the
      mask as an additive bias in the query's dtype (a boolean mask converted, as given, B x 1 x L x S for a
      padding mask, then expanded; padded when unaligned), the output, the logsumexp (B x H x L rounded up
      to 32, fp32), seed and offset;
    - else the math path, which keeps the B x H x L x S probabilities (and dropout's mask).

    Neither fused kernel keeps probabilities, with dropout or without. Under autocast the floating inputs are
    cast to its dtype first, as CUDA autocast does for SDPA (its lower-precision list)."""
    import torch.nn.functional as F

    if torch.is_autocast_enabled("cpu"):  # the simulation's autocast stands in for CUDA's
        dtype = torch.get_autocast_dtype("cpu")
        query, key, value = (t.to(dtype) for t in (query, key, value))
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(dtype)
    half = query.dtype in (torch.float16, torch.bfloat16)
    head, head_v = query.shape[-1], value.shape[-1]
    same = head == key.shape[-1] == head_v
    if (
        attn_mask is None
        and half
        and same
        and head <= 256
        and not (is_causal and query.shape[-2] != key.shape[-2])
    ):
        pad = -head % 8
        q, k, v = (F.pad(t, (0, pad)) if pad else t for t in (query, key, value))
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, dropout_p, is_causal, False, scale=head**-0.5 if scale is None else scale
        )[0]
        return out[..., :head] if pad else out
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # as torch converts it for every kernel
        zero = torch.zeros((), dtype=query.dtype, device=query.device)
        attn_mask = torch.where(attn_mask.logical_not(), -math.inf, zero)
    alignment = 8 if half else 4
    if head == key.shape[-1] and head % alignment == 0 and head_v % alignment == 0:
        if enable_gqa and key.shape[-3] != query.shape[-3]:  # grouped key/value heads, repeated
            repeat = query.shape[-3] // key.shape[-3]
            key, value = (t.repeat_interleave(repeat, -3) for t in (key, value))
        if attn_mask is not None:  # torch's preprocess_mask: padded when unaligned, then expanded
            strides = attn_mask.stride()
            if any(s % 8 for s in strides[:-1]) or strides[-1] != 1:
                last = attn_mask.shape[-1]
                attn_mask = F.pad(attn_mask, (0, 8 - last % 8))[..., :last]
            attn_mask = attn_mask.expand(*query.shape[:-1], key.shape[-2])
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, grad, dropout_p, is_causal, scale=scale
        )[0]
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )[0]


def cuda_dropout(input, p=0.5, training=True, inplace=False):
    """`F.dropout` as torch runs it on a CUDA tensor: in training, out of place, with 0 < p < 1 on a non-empty
    input, ATen's dropout takes the fused kernel (`native_dropout`), whose backward keeps a boolean mask (one
    byte an element); on CPU it multiplies by a noise tensor in the input's dtype and keeps that (four bytes an
    element in fp32). Otherwise (evaluation, in place, p of 0 or 1) both devices run the same path."""
    if training and not inplace and 0 < p < 1 and input.numel() > 0:
        return torch.native_dropout(input, p, True)[0]
    return _ORIGINAL["dropout"](input, p, training, inplace)


def is_autocast_enabled(device_type: str | None = None) -> bool:
    """`torch.is_autocast_enabled` as a CUDA job answers it: asked without a device, or for "cuda", it answers
    for CUDA's autocast, which the simulation's CPU autocast stands in for. (transformers' Nemotron layer norm
    asks it without a device, and so does peft's own 4-bit LoRA layer, which this pipeline's adapters do not
    use.)"""
    return _ORIGINAL["is_autocast_enabled"](_as_cpu(device_type))


def get_autocast_dtype(device_type: str) -> torch.dtype:
    """`torch.get_autocast_dtype` as a CUDA job answers it: for "cuda", the simulation's CPU autocast's."""
    return _ORIGINAL["get_autocast_dtype"](_as_cpu(device_type))


def _as_cpu(device_type: str | None) -> str:
    return "cpu" if device_type in (None, "cuda") else device_type


# CUDA's autocast policy, op by op, as torch 2.13 registers it for CUDA (ATen/autocast_mode.h's lists
# AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE and AT_FORALL_LOWER_PRECISION_FP; a test compares them with the
# installed torch's header). CPU's autocast lists fewer ops: where it has no kernel for one of these, the
# simulation of a CUDA target registers CUDA's policy for it (`cuda_autocast`).
CUDA_FP32 = (
    "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow.Tensor_Scalar "
    "pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm rms_norm group_norm frobenius_norm.dim "
    "nuclear_norm nuclear_norm.dim cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d "
    "hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss "
    "multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss "
    "binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp upsample_nearest1d "
    "_upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d upsample_nearest3d "
    "_upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa "
    "upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa"
).split()
# in fp32 unless a dtype is asked for (softmax and log_softmax of a bf16 input give fp32 on CUDA)
CUDA_FP32_SET_OPT_DTYPE = (
    "prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm linalg_matrix_norm "
    "linalg_matrix_norm.str_ord sum sum.dim_IntList"
).split()
CUDA_LOWER_PRECISION = (
    "_convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d.input "
    "conv_transpose3d.input convolution prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm "
    "baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell "
    "rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention scaled_dot_product_attention"
).split()
# what CPU's autocast upcasts and CUDA's leaves to the op's parts: cross-entropy (CUDA: a log-softmax in the
# input's dtype, then nll_loss's fp32 copy of it)
CPU_ONLY_FP32 = ("cross_entropy_loss",)

_ORIGINAL = {
    "scaled_dot_product_attention": torch.nn.functional.scaled_dot_product_attention,
    "dropout": torch.nn.functional.dropout,
    "is_autocast_enabled": torch.is_autocast_enabled,
    "get_autocast_dtype": torch.get_autocast_dtype,
}


def _op(name: str):
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _cast(tree, dtype: torch.dtype):
    """Every floating tensor of `tree` but a double one in `dtype`, as autocast's cached_cast casts them."""
    from torch.utils._pytree import tree_map

    def cast(t):
        eligible = isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
        return t.to(dtype) if eligible and t.dtype != dtype else t

    return tree_map(cast, tree)


def _below_autocast():
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU))


def _policy_kernel(name: str, policy: str):
    """A kernel for CPU's autocast key that runs `name` under CUDA's `policy`: its floating inputs cast to fp32
    ("fp32") or to the autocast dtype ("lower"), or fp32 as its dtype when none is asked ("set_opt_dtype"),
    then the op below autocast; "parts": the op's own decomposition, each part under autocast (an op without
    one: below autocast, its inputs as they are)."""
    op = _op(name)
    dtype_at = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)

    def kernel(*args, **kwargs):
        if policy == "parts":
            found = op.decompose(*args, **kwargs)
            if found is not NotImplemented:
                return found
        with _below_autocast():
            if policy == "fp32":
                args, kwargs = _cast((args, kwargs), torch.float32)
            elif policy == "lower":
                args, kwargs = _cast((args, kwargs), _ORIGINAL["get_autocast_dtype"]("cpu"))
            elif policy == "set_opt_dtype" and args[0].is_floating_point() and args[0].dtype != torch.float64:
                if dtype_at < len(args) and args[dtype_at] is None:
                    args = (*args[:dtype_at], torch.float32, *args[dtype_at + 1 :])
                elif dtype_at >= len(args) and kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)

    return kernel


@functools.cache
def _policies() -> dict[str, str]:
    """Each op whose CUDA autocast policy CPU's autocast lacks, and that policy (`_policy_kernel`): asked of
    the dispatcher once a process."""

    def cpu_has(name: str) -> bool:  # a kernel of CPU's autocast's own
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "AutocastCPU")

    return {
        **{n: "fp32" for n in CUDA_FP32 if not cpu_has(n)},
        **{n: "lower" for n in CUDA_LOWER_PRECISION if not cpu_has(n)},
        **{n: "set_opt_dtype" for n in CUDA_FP32_SET_OPT_DTYPE},
        **{n: "parts" for n in CPU_ONLY_FP32},
    }


@contextlib.contextmanager
def cuda_autocast():
    """Within it, the simulation's autocast (CPU's, on the fake CPU tensors) casts as CUDA's does: for each op
    CUDA's autocast lists and CPU's does not, a kernel with CUDA's policy on CPU's autocast key (layer norm,
    pow, rsqrt, exp and log in fp32; softmax, log-softmax and sums in fp32 unless a dtype is asked; einsum and
    the other matrix products CPU leaves alone in the autocast dtype); CPU's own upcast of cross-entropy, which
    CUDA's leaves to its parts, undone. Registered while it lasts, CPU's own policy again after."""
    import warnings

    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():  # (replacing CPU's kernel of an op both list: prod, cross-entropy)
            warnings.filterwarnings("ignore", "Warning only once for all operators")
            for name, policy in _policies().items():
                library.impl(name, _policy_kernel(name, policy), "AutocastCPU")
        yield
    finally:
        library._destroy()


@contextlib.contextmanager
def cuda_kernels():
    """Within it, what a step calls runs as on a CUDA GPU where CPU's kernels would save or hold other tensors:
    `torch.nn.functional.scaled_dot_product_attention` is `cuda_attention`, `torch.nn.functional.dropout`
    `cuda_dropout` (nn.Dropout and transformers call it by that name), and the autocast queries
    `torch.is_autocast_enabled` and `torch.get_autocast_dtype` answer for CUDA from the CPU autocast that stands
    in for it, which casts as CUDA's does (`cuda_autocast`). Replaced by name, not by a torch function mode: a
    checkpointed layer's recomputation runs inside autograd's engine, where such a mode does not reach."""
    replaced = {
        (torch.nn.functional, "scaled_dot_product_attention"): cuda_attention,
        (torch.nn.functional, "dropout"): cuda_dropout,
        (torch, "is_autocast_enabled"): is_autocast_enabled,
        (torch, "get_autocast_dtype"): get_autocast_dtype,
    }
    for (module, name), kernel in replaced.items():
        setattr(module, name, kernel)
    try:
        with cuda_autocast():
            yield
    finally:
        for module, name in replaced:
            setattr(module, name, _ORIGINAL[name])
