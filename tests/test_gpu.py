"""CUDA checks (`make test-gpu`); skipped where torch sees no GPU."""

import pytest
import torch

from pipeline import MB
from pipeline.memory import PeakMemory
from tests.conftest import TINY, run_cli, sweep_runs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_peak_of_a_known_allocation():
    with PeakMemory("cuda") as peak:
        a = torch.empty(40 * MB, dtype=torch.uint8, device="cuda")
        b = torch.empty(10 * MB, dtype=torch.uint8, device="cuda")
        del a, b
    metrics = peak.metrics()
    assert metrics["peak_memory_mb"] == pytest.approx(50, rel=0.05)
    assert metrics["peak_memory_reserved_mb"] >= metrics["peak_memory_mb"]


def test_fp32_and_bf16_sweep_on_cuda_records_allocator_peaks(tmp_path):
    args = ["-m", "optim=adamw,adafactor", "backend=trainer,accelerator", "train.precision=fp32,bf16", *TINY]
    proc = run_cli(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, children = sweep_runs(tmp_path)
    assert len(children) == 8
    for run in children:
        assert run.info.status == "FINISHED"
        assert run.data.params["device"].startswith("cuda")
        assert run.data.metrics["peak_memory_reserved_mb"] >= run.data.metrics["peak_memory_mb"] > 0
        assert run.data.metrics["optimizer_state_mb"] == run.data.metrics["estimated_optimizer_state_mb"]
        assert run.data.tags["mfu_peak"].startswith("data sheet") and 0 < run.data.metrics["mfu"] < 1


def test_breakdown_and_prediction_on_cuda(tmp_path):
    """distilbert-base-cased (random weights): the parts of step 2's peak against the allocator's peak."""
    args = ["-m", "optim=adamw,adafactor", "backend=accelerator", "model=distilbert-base-cased"]
    args += ["model.pretrained=false", "train.padding=max_length", "train.max_steps=3", "batch_size=16"]
    args += ["data.max_train_samples=64", "data.max_eval_samples=16"]
    proc = run_cli(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {r.data.params["optim"]: r.data.metrics for r in sweep_runs(tmp_path)[1]}
    parts = ["peak_params_mb", "peak_grads_mb", "peak_optimizer_mb", "peak_activations_mb", "peak_other_mb"]
    for m in runs.values():
        assert sum(m[k] for k in parts) == pytest.approx(m["peak_memory_mb"], rel=0.02)
        assert m["peak_optimizer_mb"] >= m["optimizer_state_mb"] - 1 / 1024
        print("prediction error [%]", m["predicted_peak_error_pct"])
    gap = runs["adamw"]["peak_memory_mb"] - runs["adafactor"]["peak_memory_mb"]
    state_gap = runs["adamw"]["optimizer_state_mb"] - runs["adafactor"]["optimizer_state_mb"]
    print(f"AdamW - Adafactor: peak gap {gap:.1f} MB, state gap {state_gap:.1f} MB")
    assert gap >= 0.8 * state_gap


def test_find_batch_size_on_cuda_within_a_budget(tmp_path):
    args = ["-m", "find_batch_size=true", "memory_budget_mb=2000", "optim=adamw,adafactor"]
    args += ["model=distilbert-base-cased", "model.pretrained=false", "backend=accelerator"]
    proc = run_cli(tmp_path, *args, "data.max_train_samples=512", "data.max_eval_samples=16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {r.data.params["optim"]: r.data.metrics for r in sweep_runs(tmp_path)[1]}
    assert runs["adafactor"]["max_batch_size"] > runs["adamw"]["max_batch_size"] > 0
    assert all(m["max_batch_peak_memory_mb"] <= 2000 for m in runs.values())
