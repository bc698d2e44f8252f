"""A plan for a CUDA target runs CUDA's kernels where their saved tensors differ from CPU's (pipeline.cuda_kernels:
attention, dropout, the autocast query) and leaves a paged optimizer's paged state out of the peak; checked
against what the one GPU run measured (docs/gpu.md) and against the kernels' own saved tensors."""

import contextlib
import copy
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pipeline import MB, cuda_kernels, cuda_reductions, models, optimizers, plan_job, plan_step
from tests.conftest import compose_cfg

# The H200's sweep (docs/gpu.md, the first run on a GPU): MiniLM with random weights, fp32, batch 16, batches
# padded to 57 tokens, 20 steps; peak_memory_mb as torch's allocator measured it, and the CPU plans of the same
# points before CUDA's kernels were simulated (a CPU target keeps CPU's kernels: they must not move)
H200_PEAKS_MB = {"adamw": 502.9, "adafactor": 378.8, "adamw_8bit": 409.5}
CPU_PLANS_MB = {
    "adamw": 458.00532150268555,
    "adafactor": 285.11621475219727,
    "adamw_8bit": 396.73472595214844,
}
H200_GOAL = 0.015


def minilm_point(optim: str, *overrides: str):
    cfg = compose_cfg("model=minilm", "model.pretrained=false", f"optim={optim}", "batch_size=16", *overrides)
    names = tuple(models.load_tokenizer(cfg.model, local_only=True).model_input_names)
    return cfg, optimizers.get(optim), models.model_config(cfg.model, 2), names


@pytest.mark.parametrize("optim", sorted(H200_PEAKS_MB))
def test_the_h200s_points_are_planned_within_1_5_percent_and_their_cpu_plans_stay(optim):
    cfg, spec, config, names = minilm_point(optim)
    h200 = cuda_reductions.NAMED_GRIDS["h200"]
    cuda = plan_step.simulate(config, spec, cfg, 16, 57, cuda=True, names=names, grid=h200)
    assert cuda["peak"] == pytest.approx(H200_PEAKS_MB[optim], rel=H200_GOAL)
    assert plan_step.simulate(config, spec, cfg, 16, 57, names=names)["peak"] == pytest.approx(
        CPU_PLANS_MB[optim], rel=1e-12
    )


def saved_in_forward(model, inputs, mode, cuda: bool) -> tuple[list, list]:
    """(the input sizes of each dropout call, (dtype, bytes) of each storage saved for backward) of a forward
    pass, for a CUDA target or not."""
    saved, calls = {}, []
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    hooks = [m.register_forward_hook(lambda m, args, out: calls.append(args[0].numel())) for m in dropouts]

    def pack(t):
        saved[id(t.untyped_storage())] = (t.dtype, t.untyped_storage().nbytes())
        return t

    kernels = cuda_kernels.cuda_kernels() if cuda else contextlib.nullcontext()
    try:
        with mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), kernels:
            model(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return calls, list(saved.values())


def test_a_cuda_targets_dropout_keeps_a_one_byte_mask_where_the_cpus_keeps_its_input_dtype():
    """MiniLM in fp32 (hidden dropout 0.1): in a CUDA target's forward pass every dropout call saves one boolean
    mask of its input's size, as torch's fused kernel does; in a CPU target's none does, and each keeps a noise
    tensor of 4 bytes an element instead."""
    cfg, _, config, names = minilm_point("adamw")
    mode, model = plan_step.fake_model(config, "fp32", False)
    inputs = plan_step._inputs(mode, 4, 32, names)
    for cuda in (False, True):
        calls, saved = saved_in_forward(model, inputs, mode, cuda)
        masks = sorted(n for dtype, n in saved if dtype == torch.bool)
        floats = Counter(n for dtype, n in saved if dtype == torch.float32)
        assert len(calls) == 2 * config.num_hidden_layers + 2  # embeddings, two a layer, the classifier's
        if cuda:
            assert masks == sorted(calls)
        else:
            assert masks == [] and not Counter(4 * n for n in calls) - floats


def test_dropout_runs_cudas_fused_kernel_only_where_cuda_would():
    """Within cuda_kernels, dropout in training saves one boolean mask; in evaluation, in place or at p=0 it
    runs as before."""
    saved = []
    with plan_step.fake_mode():
        x = torch.empty(8, 16, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
            with cuda_kernels.cuda_kernels():
                torch.nn.functional.dropout(x * 1, 0.1, training=True)
                assert torch.nn.functional.dropout(x, 0.1, training=False) is x
                assert torch.nn.functional.dropout(x, 0.0, training=True) is x
            torch.nn.functional.dropout(x * 1, 0.1, training=True)
    assert saved == [torch.bool, torch.float32]
    assert torch.nn.functional.dropout is cuda_kernels._ORIGINAL["dropout"]


def test_the_autocast_query_answers_for_cuda_from_the_simulations_autocast():
    """transformers' Nemotron layer norm asks `torch.is_autocast_enabled()` (CUDA's) and casts its input to the
    autocast dtype when told yes: under the simulation's bf16 autocast it computes in bf16 for a CUDA target,
    in fp32 otherwise, as the same code on each device does."""
    from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P

    with plan_step.fake_mode():
        norm, x = NemotronLayerNorm1P(64), torch.empty(2, 8, 64)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with cuda_kernels.cuda_kernels():
                assert torch.is_autocast_enabled() and torch.get_autocast_dtype("cuda") == torch.bfloat16
                on_cuda = norm(x).dtype
            on_cpu = norm(x).dtype
    assert (on_cuda, on_cpu) == (torch.bfloat16, torch.float32)
    assert not torch.is_autocast_enabled()


def test_a_cuda_plan_leaves_a_paged_optimizers_paged_state_out_wherever_it_runs():
    """paged_adamw_8bit planned for an RTX 4090 on this CPU machine: the state bitsandbytes pages (the moments of
    every tensor of at least 1e5 elements, as a real optimizer's state1 and state2 here have them) is out of the
    peak and its optimizer part, and still in the state estimate; planned for CPU, nothing is paged."""
    overrides = ("model=tiny", "optim=paged_adamw_8bit", "plan=true", "backend=accelerator")
    cuda = plan_job.plan_result(compose_cfg(*overrides, "device_memory=rtx-4090"))["metrics"]
    cpu = plan_job.plan_result(compose_cfg(*overrides))["metrics"]
    cfg = compose_cfg(*overrides)
    model = models.load_model(cfg.model, num_labels=2)
    optimizer = optimizers.get("paged_adamw_8bit").build(model, cfg)
    model(
        input_ids=torch.ones(2, 8, dtype=torch.long), labels=torch.zeros(2, dtype=torch.long)
    ).loss.backward()
    optimizer.step()
    paged = sum(
        state[key].nbytes
        for p, state in optimizer.state.items()
        if p.numel() >= 1e5
        for key in ("state1", "state2")
    )
    assert paged > 0 and cuda["predicted_paged_state_mb"] == pytest.approx(paged / MB, rel=1e-12)
    assert cuda["estimated_optimizer_state_mb"] == cpu["estimated_optimizer_state_mb"]
    held = cuda["estimated_optimizer_state_mb"] - cuda["predicted_paged_state_mb"]
    assert cuda["predicted_peak_optimizer_mb"] == pytest.approx(held, rel=1e-12)
    assert cpu["predicted_peak_optimizer_mb"] == pytest.approx(cpu["estimated_optimizer_state_mb"], rel=1e-12)
    assert "predicted_paged_state_mb" not in cpu


@pytest.mark.parametrize(
    ("dtype", "masked"), [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)]
)
def test_a_cuda_targets_attention_saves_what_torchs_fused_kernel_saves(dtype, masked):
    """For a CUDA target, SDPA with dropout saves for backward what torch's fused kernel saves on a GPU: q, k
    and v, the mask as a bias in the query's dtype (memory-efficient attention, the kernel for a masked call;
    flash attention takes none), and the kernel's outputs as its fake kernel makes them on a fake CUDA device:
    the output, the logsumexp (rounded up to 32 rows by memory-efficient attention) and dropout's philox seed
    and offset. Never the B x H x L x L probabilities or dropout's mask, which the CPU's math path keeps."""
    b, h, length, d = 2, 4, 40, 16
    saved = {}

    def pack(t):
        saved[id(t.untyped_storage())] = t.untyped_storage()
        return t

    with plan_step.fake_mode():
        q, k, v = (torch.empty(b, h, length, d, dtype=dtype, requires_grad=True) for _ in range(3))
        mask = torch.ones(b, 1, length, length, dtype=torch.bool) if masked else None
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cuda_kernels.cuda_kernels():
            torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1)
        with torch.no_grad():  # the kernel torch's CUDA dispatch runs, on a fake CUDA device
            cuda = [torch.empty(b, h, length, d, dtype=dtype, device="cuda") for _ in range(3)]
            if masked:
                bias = torch.empty(b, 1, length, length, dtype=dtype, device="cuda")
                expanded = bias.expand(b, h, length, length)
                kernel = torch.ops.aten._scaled_dot_product_efficient_attention(*cuda, expanded, True, 0.1)
                assert kernel[1].shape == (b, h, 64)  # the logsumexp's rows rounded up to 32
                kept = [*cuda, bias, *kernel]  # output, logsumexp, philox seed, offset
            else:
                kernel = torch.ops.aten._scaled_dot_product_flash_attention(*cuda, 0.1)
                assert kernel[1].shape == (b, h, length)
                kept = [*cuda, kernel[0], kernel[1], kernel[6], kernel[7]]  # output, logsumexp, rng state
    assert sum(storage.nbytes() for storage in saved.values()) == sum(
        t.untyped_storage().nbytes() for t in kept
    )
    assert max(storage.nbytes() for storage in saved.values()) < b * h * length * length * q.element_size()


@pytest.mark.slow  # BERT-base simulated at 512 tokens: CI (make test-ci)
def test_a_bert_base_plan_for_a_cuda_target_keeps_no_attention_probabilities():
    """BERT-base (attention dropout 0.1), 16 x 512 tokens. Planned for CPU, SDPA takes the math path, which
    keeps per layer the probabilities, dropout's mask and the dropped probabilities (3 x B x H x S^2 fp32);
    planned for a CUDA target, memory-efficient attention keeps the mask as a bias (B x S^2) and the
    logsumexp (B x H x S) instead, and attention dropout changes nothing it keeps."""
    cfg = compose_cfg("model=bert-base-uncased", "model.pretrained=false", "optim=adamw")
    spec, config = optimizers.get("adamw"), models.model_config(cfg.model, num_labels=2)
    names = ("input_ids", "token_type_ids", "attention_mask")
    b, s, h, layers = 16, 512, config.num_attention_heads, config.num_hidden_layers
    cpu = plan_step.simulate(config, spec, cfg, b, s, names=names)
    cuda = plan_step.simulate(config, spec, cfg, b, s, cuda=True, names=names)
    undropped = copy.deepcopy(config)
    undropped.attention_probs_dropout_prob = 0.0
    no_dropout = plan_step.simulate(undropped, spec, cfg, b, s, cuda=True, names=names)
    per_layer = (3 * b * h * s * s - b * s * s - b * h * s) * 4 / MB
    # the hidden dropouts' part apart (a mask of a quarter of CPU's noise on CUDA: the test above)
    hidden = copy.deepcopy(config)
    hidden.hidden_dropout_prob = 0.0
    cpu_no_hidden = plan_step.simulate(hidden, spec, cfg, b, s, names=names)
    cuda_no_hidden = plan_step.simulate(hidden, spec, cfg, b, s, cuda=True, names=names)
    drop = cpu_no_hidden["parts"]["activations"] - cuda_no_hidden["parts"]["activations"]
    assert drop == pytest.approx(layers * per_layer, rel=1e-6)
    assert cuda["parts"]["activations"] == pytest.approx(no_dropout["parts"]["activations"], rel=1e-9)
    assert cuda["peak"] < cpu["peak"] / 1.9


def test_cudas_autocast_lists_are_those_of_the_installed_torch():
    """The policy the simulation copies is the one the installed torch registers for CUDA (its header's lists)."""
    header = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
    if not header.exists():
        pytest.skip(f"{header} is not installed")
    text = header.read_text()

    def listed(macro: str) -> list[str]:
        body = re.search(rf"#define {macro}\(_\)(.*?)\n\n", text, re.S).group(1)
        return [".".join(p.strip() for p in m.split(",")) for m in re.findall(r"_\(([^()]*)\)", body)]

    assert listed("AT_FORALL_FP32") == cuda_kernels.CUDA_FP32
    assert listed("AT_FORALL_FP32_SET_OPT_DTYPE") == cuda_kernels.CUDA_FP32_SET_OPT_DTYPE
    assert listed("AT_FORALL_LOWER_PRECISION_FP") == cuda_kernels.CUDA_LOWER_PRECISION


F = torch.nn.functional
AUTOCAST_OPS = {  # what a step of the shipped models runs under autocast, on a bf16 input x and an fp32 weight w
    "layer_norm": lambda x, w: F.layer_norm(x, (8,)),
    "rms_norm": lambda x, w: F.rms_norm(x, (8,)),
    "softmax": lambda x, w: F.softmax(x, -1),
    "softmax, dtype asked": lambda x, w: torch.softmax(x, -1, dtype=torch.float16),
    "log_softmax": lambda x, w: torch.log_softmax(x, -1),
    "pow (GPT-2's gelu_new)": lambda x, w: torch.pow(x, 3.0),
    "rsqrt": lambda x, w: torch.rsqrt(x),
    "exp": lambda x, w: torch.exp(x),
    "sum": lambda x, w: x.sum(),
    "sum over a dim": lambda x, w: x.sum(-1),
    "mean": lambda x, w: x.mean(-1),
    "einsum": lambda x, w: torch.einsum("bsh,oh->bso", x.float(), w),
    "linear": lambda x, w: F.linear(x.float(), w),
    "cross_entropy": lambda x, w: F.cross_entropy(
        x.view(-1, 8), torch.zeros(16, dtype=torch.long, device=x.device)
    ),
    "gelu": lambda x, w: F.gelu(x),
    "silu": lambda x, w: F.silu(x),
}


class OpLog(TorchDispatchMode):
    """Every op below autograd with its outputs' dtypes and shapes (device queries left out)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ != "device":
            leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            self.ops.append((func.overloadpacket.__name__, [(t.dtype, tuple(t.shape)) for t in leaves]))
        return out


def autocast_ops(device: str) -> dict[str, list]:
    """What each of AUTOCAST_OPS runs under bf16 autocast: on fake CUDA tensors, by torch's own CUDA autocast
    (its flag set, as it can be without a GPU; no autograd there); on fake CPU tensors, by the simulation's CPU
    autocast within cuda_kernels."""
    found = {}
    with plan_step.fake_mode(), torch.no_grad():
        x = torch.empty(2, 8, 8, dtype=torch.bfloat16, device=device)
        w = torch.empty(4, 8, device=device)
        for name, op in AUTOCAST_OPS.items():
            log = OpLog()
            if device == "cuda":
                torch.set_autocast_enabled("cuda", True)
                torch.set_autocast_dtype("cuda", torch.bfloat16)
                try:
                    with log:
                        op(x, w)
                finally:
                    torch.set_autocast_enabled("cuda", False)
            else:
                with cuda_kernels.cuda_kernels(), torch.autocast("cpu", dtype=torch.bfloat16), log:
                    op(x, w)
            found[name] = log.ops
    return found


def test_a_cuda_targets_autocast_runs_what_cudas_autocast_runs():
    """Each op a step runs under bf16 autocast makes, for a CUDA target, the same casts and outputs, in the same
    dtypes, as torch's CUDA autocast makes on CUDA tensors (layer norm, softmax, pow in fp32; einsum in bf16;
    cross-entropy's log-softmax in bf16, then nll_loss's fp32 copy), where CPU's autocast alone differs; after
    it, CPU's own policy is back."""
    simulated, cuda = autocast_ops("cpu"), autocast_ops("cuda")
    assert simulated == cuda
    with plan_step.fake_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        x = torch.empty(2, 8, 8, dtype=torch.bfloat16)
        assert F.layer_norm(x, (8,)).dtype == F.softmax(x, -1).dtype == torch.bfloat16  # CPU's own policy
