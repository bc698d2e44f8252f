"""CUDA checks (`pytest -m gpu`, apart from `make test-gpu`); skipped where torch sees no GPU."""

import pytest
import torch

from pipeline import MB
from pipeline.memory import PeakMemory
from tests.conftest import TINY, compose_cfg, run_cli, sweep_runs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_peak_of_a_known_allocation():
    """The allocator's peak over the block: what was allocated as it began (what this process's imports and
    earlier tests left on the device) and the 50 MB made in it."""
    before = torch.cuda.memory_allocated() / MB
    with PeakMemory("cuda") as peak:
        a = torch.empty(40 * MB, dtype=torch.uint8, device="cuda")
        b = torch.empty(10 * MB, dtype=torch.uint8, device="cuda")
        del a, b
    metrics = peak.metrics()
    assert metrics["peak_memory_mb"] - before == pytest.approx(50, rel=0.05), before
    assert metrics["peak_memory_reserved_mb"] >= metrics["peak_memory_mb"]


def test_fp32_bf16_and_fp16_on_both_backends_record_allocator_peaks(tmp_path):
    """fp16 runs the grad scaler, which may skip optimizer steps: every run still finishes and is measured."""
    args = ["-m", "optim=adamw", "backend=trainer,accelerator", "train.precision=fp32,bf16,fp16", *TINY]
    proc = run_cli(tmp_path, *args, "train.max_steps=8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, children = sweep_runs(tmp_path)
    assert len(children) == 6
    for run in children:
        m, tags = run.data.metrics, run.data.tags
        assert run.info.status == "FINISHED"
        assert run.data.params["device"].startswith("cuda")
        assert m["peak_memory_reserved_mb"] >= m["peak_memory_mb"] > 0
        assert m["optimizer_state_mb"] == m["estimated_optimizer_state_mb"]
        assert tags["throughput_steps"] == "steps 4-7 (after 3 warm-up steps)"
        if tags["mfu_peak"].startswith("data sheet"):
            assert 0 < m["mfu"] < 1
        print(
            run.info.run_name, "skipped optimizer steps", m["optimizer_steps_skipped"], tags["peak_breakdown"]
        )


def column_mean_buffers_mb(shape: tuple[int, int]) -> float:
    """What torch's CUDA kernel takes from the allocator, beside its output, for the column mean of an fp32 matrix
    of `shape` on this GPU (Adafactor's `update.mean(dim=-2)`): `reduction_buffers`, each rounded up to the
    allocator's 512 bytes."""
    from pipeline.cuda_reductions import reduction_buffers

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    grid = (props.multi_processor_count, props.max_threads_per_multi_processor)
    buffers = reduction_buffers(shape, (shape[1], 1), [-2], 4, grid=grid)
    return sum(-(-n // 512) * 512 for n in buffers) / MB


def test_breakdown_and_prediction_on_cuda(tmp_path):
    """distilbert-base-cased (random weights): the parts of step 2's peak against the allocator's peak; the
    paged optimizer's state outside the allocator.

    The breakdown follows tensors. AdamW's step-2 peak is the allocator's, within 2%. Adafactor's step takes a
    buffer that no tensor owns: torch's CUDA kernel for the column mean of each matrix's squared gradient
    (`update.mean(dim=-2)`, pipeline.cuda_reductions) asks the allocator for its blocks' partial results. The
    allocator's peak may hold one such buffer (the largest: the word embeddings') that the breakdown never
    sees, so Adafactor's breakdown lies below the peak by at most that buffer, within the same 2%."""
    args = [
        "-m",
        "optim=adamw,adafactor,paged_adamw_8bit",
        "backend=accelerator",
        "model=distilbert-base-cased",
    ]
    args += ["model.pretrained=false", "train.padding=max_length", "train.max_steps=3", "batch_size=16"]
    args += ["data.max_train_samples=64", "data.max_eval_samples=16"]
    proc = run_cli(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {r.data.params["optim"]: r for r in sweep_runs(tmp_path)[1]}
    architecture = compose_cfg("model=distilbert-base-cased").model.architecture
    embeddings = (architecture.vocab_size, architecture.dim)  # the model's largest matrix
    parts = ["peak_params_mb", "peak_grads_mb", "peak_optimizer_mb", "peak_activations_mb", "peak_other_mb"]
    for name in ("adamw", "adafactor"):
        m = runs[name].data.metrics
        assert runs[name].data.tags["peak_breakdown"] == "step 2"
        assert sum(m[k] for k in parts) == pytest.approx(m["peak_breakdown_mb"], rel=1e-6)
        peak, gap = m["peak_memory_mb"], m["peak_memory_mb"] - m["peak_breakdown_mb"]
        unseen = 0.0 if name == "adamw" else column_mean_buffers_mb(embeddings)
        assert -0.02 * peak <= gap <= unseen + 0.02 * peak, (gap, unseen)
        assert m["peak_untracked_mb"] > 0  # cuBLAS workspaces at least
        assert m["peak_optimizer_mb"] >= m["optimizer_state_mb"] - 1 / 1024
        print(
            name,
            "untracked [MB]",
            m["peak_untracked_mb"],
            "prediction error [%]",
            m["predicted_peak_error_pct"],
        )
    adamw, adafactor = runs["adamw"].data.metrics, runs["adafactor"].data.metrics
    gap = adamw["peak_memory_mb"] - adafactor["peak_memory_mb"]
    state_gap = adamw["optimizer_state_mb"] - adafactor["optimizer_state_mb"]
    print(f"AdamW - Adafactor: peak gap {gap:.1f} MB, state gap {state_gap:.1f} MB")
    assert gap >= 0.8 * state_gap
    paged = runs["paged_adamw_8bit"]
    assert paged.data.tags["peak_breakdown"].startswith("n/a: paged optimizer state")
    m = paged.data.metrics
    assert 0 < m["paged_state_mb"] < m["optimizer_state_mb"]
    print("paged: state", m["optimizer_state_mb"], "paged", m["paged_state_mb"], "peak", m["peak_memory_mb"])


def test_find_batch_size_on_cuda_within_a_budget(tmp_path):
    """The Accelerator names one GPU `cuda` (no index): the budget's allocator fraction must still apply."""
    args = ["-m", "find_batch_size=true", "memory_budget_mb=2000", "optim=adamw,adafactor"]
    args += ["model=distilbert-base-cased", "model.pretrained=false", "backend=accelerator"]
    proc = run_cli(tmp_path, *args, "data.max_train_samples=512", "data.max_eval_samples=16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {r.data.params["optim"]: r.data.metrics for r in sweep_runs(tmp_path)[1]}
    assert runs["adafactor"]["max_batch_size"] > runs["adamw"]["max_batch_size"] > 0
    assert all(m["max_batch_peak_memory_mb"] <= 2000 for m in runs.values())


def test_two_jobs_started_warm_on_the_gpu_finish_with_their_own_peaks(tmp_path):
    """The job starter never initialised CUDA: each job forked from it initialises its own, and each records
    the allocator's peak of its own process (a larger batch, a larger peak; neither holds the other's)."""
    proc = run_cli(tmp_path, "-m", "batch_size=8,32", "train.padding=max_length", *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {r.data.params["batch_size"]: r for r in sweep_runs(tmp_path)[1]}
    assert [runs[b].data.tags["job_start"] for b in ("8", "32")] == ["warm", "warm"]
    small, large = (runs[b].data.metrics for b in ("8", "32"))
    assert all(runs[b].data.params["device"].startswith("cuda") for b in runs)
    assert 0 < small["peak_memory_mb"] < large["peak_memory_mb"]
    assert small["optimizer_state_mb"] == large["optimizer_state_mb"] == small["estimated_optimizer_state_mb"]
