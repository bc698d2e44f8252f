"""The memory levers other fine-tuning stacks use, each a config key: what a real job measures with it, on both
backends, against its plan, and what it saves against the same job without it."""

import pytest
import torch

from pipeline import MB, levers, models, optimizers, plan_job, plan_step
from pipeline.config import ConfigError, validate
from tests.conftest import ROOT, compose_cfg
from tests.test_checkpoint import stop_signal  # noqa: F401 (a fixture)

LM = ["task=causal_lm", "model=llama-tiny"]


def test_the_chunked_loss_and_its_gradients_are_transformers_own():
    """train.loss_chunks: the same loss (padding left out; the mean, or the sum over the Trainer's
    `num_items_in_batch`) and the same gradients as the model's own forward, in pieces that do not divide the
    sequence; evaluation keeps the model's logits."""
    cfg = compose_cfg(*LM)
    torch.manual_seed(0)
    own = models.load_model(cfg.model, 2, None, "causal_lm").train()
    chunked = models.load_model(cfg.model, 2, None, "causal_lm").train()
    chunked.load_state_dict(own.state_dict())
    models.chunk_the_loss(chunked, 4)
    ids = torch.randint(0, 30522, (3, 37))
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    for extra in ({}, {"num_items_in_batch": torch.tensor(50)}):
        for model in (own, chunked):
            model.zero_grad()
            model(input_ids=ids, attention_mask=mask, labels=labels, **extra).loss.backward()
        for a, b in zip(own.parameters(), chunked.parameters(), strict=True):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7)
        loss = own(input_ids=ids, attention_mask=mask, labels=labels, **extra).loss
        assert chunked(
            input_ids=ids, attention_mask=mask, labels=labels, **extra
        ).loss.item() == pytest.approx(loss.item(), abs=1e-5)
    assert chunked.config.loss_chunks == 4
    assert chunked.eval()(input_ids=ids, labels=labels).logits.shape == (3, 37, 30522)


def test_a_chunked_loss_needs_a_language_model_and_a_count():
    with pytest.raises(ConfigError, match="train.loss_chunks=4 is invalid with task=classification"):
        validate(compose_cfg("model=tiny", "train.loss_chunks=4"))
    with pytest.raises(ConfigError, match=r"train.loss_chunks=-1 is invalid: must be an integer >= 0"):
        validate(compose_cfg(*LM, "train.loss_chunks=-1"))


@pytest.mark.slow  # two real jobs each (4 steps, llama-tiny): about 8 s
@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("backend", ["accelerator", "trainer"])
def test_a_chunked_loss_holds_one_piece_of_the_logits_as_planned(backend, tmp_path):
    """A real job of llama-tiny (4 x 128 tokens, bf16 weights; its logits dominate the step) with its loss in 4
    pieces: the measured peak within 1% of the plan, its logits a quarter of the same job's without chunks, which
    measures 2.5 times the peak."""
    from bench.plan_accuracy_lm import case

    rows = [
        case("llama-tiny", 4, 128, False, False, tmp_path, "bf16_pure", backend=backend, extra=extra)[
            "metrics"
        ]
        for extra in ((), ("train.loss_chunks=4",))
    ]
    whole, chunked = rows
    assert abs(chunked["predicted_peak_error_pct"]) <= 1, chunked
    assert chunked["peak_logits_mb"] == pytest.approx(whole["peak_logits_mb"] / 4, rel=1e-9)
    assert chunked["predicted_logits_mb"] == pytest.approx(chunked["peak_logits_mb"], rel=1e-9)
    assert whole["peak_memory_mb"] > 2.5 * chunked["peak_memory_mb"]


@pytest.mark.slow  # two real jobs each (4 steps, llama-tiny): about 8 s
@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("backend", ["accelerator", "trainer"])
def test_each_attention_kernel_is_measured_as_planned(backend, tmp_path):
    """model.attn_implementation: llama-tiny (2 x 256 tokens, its loss in 4 pieces) with eager attention, which
    keeps each layer's softmax probabilities, and with SDPA (CPU's flash kernel), which does not: each job's
    peak within 1% of its plan, and eager's at least one layer's probabilities (2 x 4 heads x 256^2 fp32) above."""
    from bench.plan_accuracy_lm import case

    found = {
        attn: case(
            "llama-tiny",
            2,
            256,
            False,
            False,
            tmp_path,
            backend=backend,
            extra=("train.loss_chunks=4", f"model.attn_implementation={attn}"),
        )["metrics"]
        for attn in ("eager", "sdpa")
    }
    for m in found.values():
        assert abs(m["predicted_peak_error_pct"]) <= 1, m
    probabilities = 2 * 4 * 256**2 * 4 / MB
    assert found["eager"]["peak_memory_mb"] - found["sdpa"]["peak_memory_mb"] >= probabilities


def test_a_plans_attention_kernel_and_mask_are_its_own():
    """Two plans in one process that differ only in the attention kernel share no pass; on a CUDA target a batch
    whose rows are all full (packing; one text padded to its own length) is given no mask, as transformers
    drops a mask of ones: no B x 1 x S x S bias a layer; flash_attention_2 is planned as that kernel. A classifier (llama-tiny
    with its 2-label head), whose step attention dominates."""
    spec = optimizers.get("adamw")

    def peak(*overrides, batch=4, seq=256, cuda=False):
        cfg = compose_cfg("model=llama-tiny", "train.precision=bf16", "train.padding=max_length", *overrides)
        config = plan_job.planned_config(cfg)
        found = plan_step.simulate(config, spec, cfg, batch, seq, cuda=cuda)
        return sum(
            found["profile"].parts(batch).values()
        )  # the pass's peak (the step's may be the optimizer's)

    assert (
        peak("model.attn_implementation=eager") > peak("model.attn_implementation=sdpa") + 4 * 4 * 256**2 / MB
    )
    # (one text: long enough that the mask outweighs the embeddings' gradient, the peak without it)
    for batch, seq, full_rows in ((4, 256, "train.packing=true"), (1, 1024, "train.padding=longest")):
        padded, full = peak(batch=batch, seq=seq, cuda=True), peak(full_rows, batch=batch, seq=seq, cuda=True)
        assert padded - full >= batch * seq**2 * 2 / MB  # at least a layer's bf16 mask bias
    flash = "model.attn_implementation=flash_attention_2", "device_memory=h100-80gb"
    assert peak(*flash, batch=1, seq=1024, cuda=True) == full


def test_flash_attention_2_needs_a_cuda_gpu_and_its_package():
    with pytest.raises(
        ConfigError, match="flash_attention_2 needs a CUDA GPU .* torch sees no CUDA GPU here"
    ):
        validate(compose_cfg(*LM, "model.attn_implementation=flash_attention_2"))
    with pytest.raises(ConfigError, match="plan for one with device_memory=<gpu>"):
        validate(compose_cfg(*LM, "plan=true", "model.attn_implementation=flash_attention_2"))
    validate(
        compose_cfg(*LM, "plan=true", "model.attn_implementation=flash_attention_2", "device_memory=h200")
    )
    with pytest.raises(ConfigError, match="model.attn_implementation='flash' is invalid"):
        validate(compose_cfg(*LM, "model.attn_implementation=flash"))


@pytest.mark.slow  # two real jobs each (4 steps, llama-tiny): about 8 s
@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("backend", ["accelerator", "trainer"])
def test_the_step_inside_backward_holds_no_gradients_as_planned(backend, tmp_path):
    """train.optimizer_in_backward: llama-tiny's AdamW, one per weight, stepped from each gradient's hook and the
    gradient freed: the measured peak within 1% of the plan (which runs the same steps in its pass), no
    gradient at the peak, below the same job's with the ordinary step, and the same optimizer state."""
    from bench.plan_accuracy_lm import case

    common = ("train.max_grad_norm=0", "train.loss_chunks=4")
    off, on = (
        case("llama-tiny", 2, 64, False, False, tmp_path, backend=backend, extra=common + extra)["metrics"]
        for extra in ((), ("train.optimizer_in_backward=true",))
    )
    assert abs(on["predicted_peak_error_pct"]) <= 1, on
    assert on["peak_grads_mb"] == 0 < off["peak_grads_mb"]
    assert on["peak_memory_mb"] < off["peak_memory_mb"] - 5
    assert on["optimizer_state_mb"] == pytest.approx(off["optimizer_state_mb"], rel=1e-9)


def test_the_step_inside_backward_refuses_clipping_and_an_optimizer_that_is_there_already():
    with pytest.raises(ConfigError, match=r"train.optimizer_in_backward=true is invalid .* clipping needs"):
        validate(compose_cfg(*LM, "train.optimizer_in_backward=true"))
    with pytest.raises(ConfigError, match="it updates inside the backward pass already"):
        validate(compose_cfg(*LM, "train.optimizer_in_backward=true", "optim=lomo", "train.max_grad_norm=0"))
    with pytest.raises(ConfigError, match="launcher.nproc_per_job=2"):
        args = ("train.optimizer_in_backward=true", "train.max_grad_norm=0", "launcher.nproc_per_job=2")
        validate(compose_cfg(*LM, *args))
    validate(compose_cfg(*LM, "plan=true", "train.optimizer_in_backward=true", "train.max_grad_norm=0"))


@pytest.mark.slow  # two real jobs each (4 steps, llama-tiny): about 10 s
@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("backend", ["accelerator", "trainer"])
def test_offloaded_activations_leave_the_device_and_take_the_host_as_planned(backend, tmp_path):
    """train.offload=activations: llama-tiny (8 x 256 tokens, bf16 weights, its loss in 8 pieces) with what its
    forward pass saves held on the host: the measured device peak within 1% of the plan, below the same job's
    without it by its activations, to 2% (the saved tensors a GPU would no longer hold), the host memory they
    take as planned, and the same training loss."""
    from bench.plan_accuracy_lm import case

    off, on = (
        case("llama-tiny", 8, 256, False, False, tmp_path, "bf16_pure", backend=backend, extra=extra)[
            "metrics"
        ]
        for extra in (("train.loss_chunks=8",), ("train.loss_chunks=8", "train.offload=activations"))
    )
    assert abs(on["predicted_peak_error_pct"]) <= 1, on
    saved = off["peak_activations_mb"] - on["peak_activations_mb"]
    # (to 2%: each piece of the loss is copied whole before it is saved, which moves 0.2 MB between parts)
    assert off["peak_memory_mb"] - on["peak_memory_mb"] == pytest.approx(saved, rel=0.02)
    assert on["peak_activations_mb"] < 0.01 * off["peak_activations_mb"]
    # (to a few bytes: the Trainer's token count, a scalar the loss is divided by, is saved too)
    assert on["peak_host_mb"] == pytest.approx(on["predicted_host_mb"], abs=100 / MB)
    assert on["peak_host_mb"] >= off["peak_activations_mb"] and "peak_host_mb" not in off
    assert on["train_loss_final"] == off["train_loss_final"]


def test_a_deep_models_offloaded_activations_are_planned_from_two_shallow_depths(monkeypatch):
    """The host memory of a deep model's offloaded activations, planned from SHALLOW's two depths, is what the
    forward pass at its own depth holds; a bad value of the key is one line; adapters on a language model have
    the lever too."""
    cfg = compose_cfg(*LM, "train.offload=activations")
    config = plan_job.planned_config(cfg)
    config.num_hidden_layers = 8
    build = plan_step.job_model(config, cfg).build
    args = (build, config, "causal_lm", 2, 64, plan_step.INPUT_NAMES, False, "fp32", True)
    extrapolated = plan_step.offloaded_mb(*args)
    monkeypatch.setattr(plan_step, "_shallow_pair", lambda *a, **k: None)
    assert extrapolated == pytest.approx(plan_step.offloaded_mb(*args), rel=1e-9) and extrapolated > 0
    with pytest.raises(ConfigError, match="train.offload='weights' is invalid"):
        validate(compose_cfg(*LM, "train.offload=weights"))
    assert "offload" in levers.applicable(compose_cfg(*LM, "peft=lora"))


@pytest.mark.slow  # one real job (4 steps, llama-tiny): about 5 s
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_offloaded_activations_beside_adapters_and_the_loss_in_pieces_train_as_planned(tmp_path):
    """LoRA, the loss in 8 pieces and the activations on the host together: each piece's recomputation in
    backward runs what its forward ran (checkpoint checks it), and the peak is as planned."""
    from bench.plan_accuracy_lm import case

    extra = ("peft=lora", "train.loss_chunks=8", "train.offload=activations")
    on = case("llama-tiny", 8, 256, False, False, tmp_path, "bf16", backend="trainer", extra=extra)["metrics"]
    assert abs(on["predicted_peak_error_pct"]) <= 1, on
    assert on["peak_host_mb"] == pytest.approx(on["predicted_host_mb"], abs=100 / MB)


@pytest.mark.slow  # four tiny jobs: about 10 s
@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("backend", ["accelerator", "trainer"])
def test_the_optimizer_on_the_host_takes_its_state_off_the_device_as_planned(backend, tmp_path):
    """train.offload=optimizer (llama-tiny, AdamW): each weight's optimizer steps a host copy, which a CPU job
    keeps outside its trackers as a GPU's trackers do not see the host: the device peak the plan's within 1%,
    below the same job's without it by the state; the host holding the state and a copy of the trained weights
    and of their gradients, as planned; the same losses."""
    from pipeline import job

    runs = {}
    for where in ("none", "optimizer"):
        cfg = compose_cfg(*LM, "data.max_train_samples=64", "data.max_eval_samples=32", "train.max_steps=4",
                          f"backend={backend}", f"train.offload={where}", f"outputs_dir={tmp_path}")  # fmt: skip
        (tmp_path / where).mkdir()
        runs[where] = job.run(cfg, tmp_path / where)
    off, on = runs["none"]["metrics"], runs["optimizer"]["metrics"]
    assert on["peak_memory_mb"] == pytest.approx(on["predicted_peak_mb"], rel=0.01)
    assert off["peak_memory_mb"] - on["peak_memory_mb"] == pytest.approx(on["optimizer_state_mb"], rel=0.01)
    copies = 2 * on["model_num_params"] * 4 / MB  # fp32 weights and gradients, each once on the host
    assert on["peak_host_mb"] == pytest.approx(on["optimizer_state_mb"] + copies, rel=1e-6)
    assert on["predicted_host_mb"] == pytest.approx(on["peak_host_mb"], rel=1e-6)
    assert runs["optimizer"]["series"]["train_loss"] == runs["none"]["series"]["train_loss"]


@pytest.mark.slow  # three tiny jobs each: about 8 s
@pytest.mark.usefixtures("fresh_accelerate_state", "stop_signal")
@pytest.mark.parametrize("backend", ["accelerator", "trainer"])
def test_a_job_with_the_optimizer_on_the_host_resumes_to_the_figures_of_one_never_stopped(
    backend, tmp_path, monkeypatch
):
    """Stopped by SIGTERM in step 5 and run again: the host's state and weights come back from the checkpoint
    (the weights as the device's, loaded first), to the losses and evaluation of the run never stopped."""
    from pipeline import checkpoint
    from tests.test_checkpoint import job_result, sigterm_at

    cfg = compose_cfg("model=tiny", "data.max_train_samples=64", "data.max_eval_samples=32", f"backend={backend}",
                      "train.max_steps=8", "train.offload=optimizer", "train.checkpoint_every=2",
                      f"outputs_dir={tmp_path}")  # fmt: skip
    whole = job_result(cfg, tmp_path / "whole")
    monkeypatch.setenv(checkpoint.ENV, str(tmp_path / "checkpoints"))
    hook = sigterm_at(5)
    try:
        with pytest.raises(checkpoint.Preempted):
            job_result(cfg, tmp_path / "first")
    finally:
        hook.remove()
    checkpoint._asked.clear()
    resumed = job_result(cfg, tmp_path / "second")
    assert resumed["series"]["train_loss"] == whole["series"]["train_loss"]
    assert resumed["metrics"]["eval_loss"] == whole["metrics"]["eval_loss"]


def test_the_optimizer_on_the_host_refuses_what_steps_elsewhere_in_one_line():
    for extra, said in (
        (["optim=adamw_8bit"], "its step runs kernels of its own on the device"),
        (["train.optimizer_in_backward=true", "train.max_grad_norm=0"], "inside the backward pass"),
        (["backend=accelerator", "launcher.nproc_per_job=2"], "one process's"),
    ):
        with pytest.raises(ConfigError, match="train.offload=optimizer is invalid") as err:
            validate(compose_cfg(*LM, "train.offload=optimizer", *extra))
        assert said in str(err.value) and "\n" not in str(err.value)
    assert "offload_optimizer" in levers.applicable(compose_cfg(*LM))
    assert "offload_optimizer" not in levers.applicable(compose_cfg(*LM, "optim=adamw_8bit"))


TORCHTUNE_LORA_4090_MIB = 16.2 * 1024  # torchtune's README: Llama 3.1 8B, LoRA, 1x 4090, peak memory per GPU


@pytest.mark.slow  # plans of an 8B and a 70B: about 10 s
def test_torchtunes_lora_recipe_fits_a_4090_and_a_70b_lora_fits_four_h100s_under_fsdp():
    """torchtune's Llama-3.1-8B LoRA recipe on an RTX 4090 (r=8 on q and v, bf16 weights, fused AdamW, 2 x 2,048
    tokens, checkpointing, the loss in 8 pieces) within 5% of its published 16.2 GiB, and said to fit; a
    Llama-3.1-70B LoRA under FSDP on four H100s: each rank a quarter of the bf16 base and the units it gathers,
    and it fits."""
    from pipeline.config import own_model

    recipe = ["plan=true", "task=causal_lm", "model=llama-3.1-8b", "peft=lora", "peft.r=8", "peft.alpha=16"]
    recipe += ["peft.dropout=0", "peft.target_modules=[q_proj,v_proj]", "optim=adamw_fused", "batch_size=2"]
    recipe += ["train.precision=bf16_pure", "train.max_length=2048", "train.gradient_checkpointing=true"]
    m = plan_job.plan_result(compose_cfg(*recipe, "train.loss_chunks=8", "device_memory=rtx-4090"))["metrics"]
    assert abs(m["predicted_peak_mb"] / TORCHTUNE_LORA_4090_MIB - 1) <= 0.05, m["predicted_peak_mb"]
    assert m["fits"] == 1

    cfg = compose_cfg(
        "plan=true",
        "task=causal_lm",
        f"model.config={ROOT / 'docs/examples/models/llama-3.1-70b.json'}",
        "peft=lora",
        "peft.r=16",
        "batch_size=1",
        "train.max_length=2048",
        "train.gradient_checkpointing=true",
        "train.precision=bf16",
        "backend=accelerator",
        "launcher.nproc_per_job=4",
        "train.sharding=fsdp",
        "device_memory=h100-80gb",
    )
    m = plan_job.plan_result(own_model(cfg))["metrics"]
    base = 2 * m["model_num_params"] / MB  # bf16
    # a quarter of the base, and the units FSDP gathers (embeddings and head, two layers): under a third of it
    assert m["fits"] == 1 and base / 4 < m["predicted_peak_params_mb"] < base / 3


LITGPT_LORA_A10G_MIB = 19.73e9 / MB  # litgpt's config hub: llama-3.1-8b/lora.yaml, max_memory_allocated / 1e9


@pytest.mark.slow  # an 8B plan: about 5 s
def test_litgpts_llama_lora_config_is_planned_within_5_percent_of_its_published_peak():
    """litgpt's Llama-3.1-8B LoRA config (r=32, alpha 16 on q and v, bf16-true, AdamW, 1 x 512 tokens)."""
    keys = ["plan=true", "task=causal_lm", "model=llama-3.1-8b", "peft=lora", "peft.r=32", "peft.alpha=16"]
    keys += ["peft.dropout=0.05", "peft.target_modules=[q_proj,v_proj]", "optim=adamw", "batch_size=1"]
    m = plan_job.plan_result(compose_cfg(*keys, "train.precision=bf16_pure", "train.max_length=512"))[
        "metrics"
    ]
    assert abs(m["predicted_peak_mb"] / LITGPT_LORA_A10G_MIB - 1) <= 0.05, m["predicted_peak_mb"]
