"""Precision as a sweep axis, dynamic padding, tokens/s and MFU (real CLI sweeps on the tiny model)."""

import pytest
import torch

from pipeline import data, models
from tests.conftest import TINY, compose_cfg, run_cli, sweep_runs

NO_DROPOUT = [
    "+model.architecture.hidden_dropout_prob=0",
    "+model.architecture.attention_probs_dropout_prob=0",
]


def test_fp32_and_bf16_in_one_sweep(tmp_path):
    proc = run_cli(tmp_path, "-m", "optim=adamw,adafactor", "train.precision=fp32,bf16", *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, children = sweep_runs(tmp_path)
    assert sorted((r.data.params["optim"], r.data.params["precision"]) for r in children) == [
        ("adafactor", "bf16"), ("adafactor", "fp32"), ("adamw", "bf16"), ("adamw", "fp32"),
    ]  # fmt: skip
    for run in children:
        m = run.data.metrics
        assert run.info.status == "FINISHED"
        # mixed precision keeps fp32 weights: the estimate from their dtype is the measured state
        assert m["optimizer_state_mb"] == m["estimated_optimizer_state_mb"]
        assert 0 <= m["padding_fraction"] < 1
        assert m["train_tokens_per_second"] == pytest.approx(m["train_tokens"] / m["train_runtime_s"])
        # 6 x non-embedding parameters + the attention term (tests/test_metrics.py counts both by hand)
        per_token = m["train_flops_per_token"]
        assert 6 * m["model_num_nonembedding_params"] < per_token < 6 * m["model_num_params"]
        assert m["mfu"] == pytest.approx(
            per_token * m["train_tokens_per_second"] / (m["device_peak_tflops"] * 1e12)
        )
        assert run.data.tags["mfu_peak"].startswith("measured")


def test_bf16_pure_halves_adamw_state(tmp_path):
    proc = run_cli(tmp_path, "-m", "optim=adamw", "train.precision=fp32,bf16_pure", *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = {r.data.params["precision"]: r.data.metrics for r in sweep_runs(tmp_path)[1]}
    assert state["bf16_pure"]["optimizer_state_mb"] == state["bf16_pure"]["estimated_optimizer_state_mb"]
    # two bf16 moments instead of two fp32 ones; the fp32 `step` per tensor stays
    assert state["bf16_pure"]["optimizer_state_mb"] == pytest.approx(
        state["fp32"]["optimizer_state_mb"] / 2, rel=1e-3
    )


def test_dynamic_padding_cuts_padding_and_keeps_the_metrics(tmp_path):
    args = ["-m", "train.padding=longest,max_length", "model=tiny", "data.max_train_samples=256"]
    args += ["data.max_eval_samples=128", "train.max_steps=8", *NO_DROPOUT]
    proc = run_cli(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {r.data.params["padding"]: r.data.metrics for r in sweep_runs(tmp_path)[1]}
    dynamic, fixed = runs["longest"], runs["max_length"]
    assert dynamic["padding_fraction"] < fixed["padding_fraction"]
    assert dynamic["train_tokens"] == fixed["train_tokens"]  # the same texts, only less padding
    for key in ("eval_loss", "eval_accuracy", "eval_f1", "train_loss_final"):
        assert dynamic[key] == pytest.approx(fixed[key], rel=1e-3, abs=1e-4), key


def test_padding_collator_counts_real_and_padded_tokens():
    tokenizer = models.load_tokenizer(compose_cfg("model=tiny").model)
    features = [
        {"input_ids": [101, 7, 102], "labels": 0},
        {"input_ids": [101, 7, 8, 9, 10, 102], "labels": 1},
    ]
    collate = data.PaddingCollator(tokenizer, "longest", max_length=16)
    batch = collate(features)
    assert batch["input_ids"].shape == (2, 6)
    assert collate.token_counts(1) == (9, 12)
    fixed = data.PaddingCollator(tokenizer, "max_length", max_length=16)
    fixed(features)
    assert fixed.token_counts(1) == (9, 32)


def test_fp16_without_cuda_fails_with_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = run_cli(tmp_path, "-m", "train.precision=fp16", *TINY)
    assert proc.returncode == 1
    (run,) = sweep_runs(tmp_path)[1]
    assert run.info.status == "FAILED"
    assert run.data.tags["error"] == (
        "ValueError: train.precision=fp16 needs a CUDA device and torch sees none: use bf16 or fp32 here"
    )
