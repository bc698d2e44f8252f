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
