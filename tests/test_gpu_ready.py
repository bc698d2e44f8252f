"""What a first GPU run would hit, checked on CPU where it can be: the device index the allocator needs,
memory the allocator holds outside tensors, paged state, steady-state throughput, steps the fp16 grad scaler
skips, more GPUs asked than visible, and the CPU tests hiding GPUs."""

import os

import pytest
import torch

from pipeline import MB, models
from pipeline.memory import StepBreakdown, TrainingMemory, indexed, optimizer_state_size, paged_state_size
from pipeline.timing import StepTimer
from tests.conftest import TINY, cli_env, compose_cfg, run_cli, selects_gpu_tests, sweep_runs


def test_an_index_less_cuda_device_gets_the_current_index(monkeypatch):
    """Accelerate names one GPU `cuda`; torch's set_per_process_memory_fraction needs an index."""
    from torch.cuda._utils import _get_device_index

    with pytest.raises(ValueError, match="specified index"):  # what the allocator call does with `cuda`
        _get_device_index(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert indexed("cuda") == torch.device("cuda", 3)
    assert _get_device_index(indexed(torch.device("cuda"))) == 3
    assert indexed("cuda:1") == torch.device("cuda", 1)
    assert indexed("cpu") == torch.device("cpu")


def tiny_model():
    return models.load_model(compose_cfg("model=tiny").model, num_labels=2).train()


def one_step(model, optimizer):
    batch = {"input_ids": torch.ones(4, 16, dtype=torch.long), "labels": torch.zeros(4, dtype=torch.long)}
    model(**batch).loss.backward()
    optimizer.step()


def test_memory_the_allocator_holds_outside_tensors_counts_as_other():
    """StepBreakdown files `allocated - tracked` at the step's start (cuBLAS workspaces on CUDA) as other."""
    figures = {}
    for extra in (0, 66 * MB):
        torch.manual_seed(0)
        model = tiny_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        weights = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()])
        allocated = None if extra == 0 else (lambda w=weights, e=extra: w + e)
        breakdown = StepBreakdown(torch.device("cpu"), allocated)
        breakdown.track_external(model)  # as TrainingMemory does: what the step starts with, then enter
        with breakdown:
            one_step(model, optimizer)
        figures[extra] = breakdown.metrics()
    without, with_ = figures[0], figures[66 * MB]
    assert "peak_untracked_mb" not in without
    assert with_["peak_untracked_mb"] == pytest.approx(66, abs=1e-6)
    assert with_["peak_other_mb"] == pytest.approx(without["peak_other_mb"] + 66, abs=1e-6)
    assert with_["peak_breakdown_mb"] == pytest.approx(without["peak_breakdown_mb"] + 66, abs=1e-6)
    parts = ["peak_params_mb", "peak_grads_mb", "peak_optimizer_mb", "peak_activations_mb", "peak_other_mb"]
    assert sum(with_[k] for k in parts) == pytest.approx(with_["peak_breakdown_mb"], rel=1e-9)


def test_paged_state_is_the_state_marked_paged():
    """bitsandbytes' get_paged returns managed memory as a CPU tensor marked `is_paged`."""
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters())
    one_step(model, optimizer)
    assert paged_state_size(optimizer).bytes == 0
    marked = 0
    for p, state in optimizer.state.items():
        if p.numel() >= 100_000:  # bitsandbytes pages the state of tensors of >= 1e5 elements
            for key in ("exp_avg", "exp_avg_sq"):
                state[key].is_paged = True
                marked += state[key].numel() * 4
    assert marked > 0
    paged = paged_state_size(optimizer)
    assert paged.bytes == marked and paged.numel == marked // 4
    assert paged.bytes < optimizer_state_size(optimizer).bytes


def skipped_steps_loop(skip: set[int], steps: int = 6):
    """A training loop under the job's trackers whose fp16-style grad scaler skips the optimizer step of the
    given steps (their gradients made non-finite, as an fp16 overflow does)."""
    torch.manual_seed(0)
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    with StepTimer(model) as timer, TrainingMemory("cpu", model, track_steps=2, breakdown_step=2) as memory:
        for step in range(1, steps + 1):
            batch = {
                "input_ids": torch.ones(4, 16, dtype=torch.long),
                "labels": torch.zeros(4, dtype=torch.long),
            }
            scaler.scale(model(**batch).loss).backward()
            if step in skip:
                next(model.parameters()).grad.view(-1)[0] = float("inf")
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    return timer, memory


def test_steps_the_grad_scaler_skips_are_still_steps():
    timer, memory = skipped_steps_loop(skip={1, 4})
    assert timer.steps == memory.step == 6  # every step counted, though two optimizer steps never ran
    assert len(timer.times_s) == memory.optimizer_steps == 4
    assert len(timer.starts_s) == 6 and timer.train_step_ms(skip=2) is not None
    # the state is in place from the end of step 2 (the first optimizer step that ran): step 3 is broken down
    assert memory.breakdown_tag == "step 3"
    assert memory.metrics()["peak_optimizer_mb"] > 0
    assert memory.tracked_steps == [
        1,
        2,
    ]  # the CPU tracker stopped at step 1's end though its step was skipped


def test_a_breakdown_step_whose_optimizer_step_is_skipped_says_so():
    _, memory = skipped_steps_loop(skip={2})
    assert memory.breakdown_tag == "step 2 (its optimizer step was skipped by the grad scaler)"


def test_a_run_whose_every_step_is_skipped_is_measured_not_crashed(tmp_path):
    from pipeline import data, measurements, optimizers
    from pipeline.backends import TrainOutput

    timer, memory = skipped_steps_loop(skip=set(range(1, 7)))
    assert timer.median_ms is None and memory.optimizer_steps == 0
    assert memory.breakdown_tag.startswith("n/a: no training step started with the optimizer state in place")
    cfg = compose_cfg(*TINY, "train.max_steps=6", f"outputs_dir={tmp_path}")
    tokenizer = models.load_tokenizer(cfg.model)
    collate = data.PaddingCollator(tokenizer, "longest", 64)
    for _ in range(6):
        collate([dict(tokenizer("a short review"), label=1), dict(tokenizer("and a longer one"), label=0)])
    out = TrainOutput(torch.optim.AdamW(tiny_model().parameters()), [0.7] * 6, {}, 1.5, memory, "cpu")
    splits = data.Splits(train=[0] * 64, eval=[0] * 32, label_names=["rotten", "fresh"])
    result = measurements.training_result(
        cfg, optimizers.choose(cfg), tiny_model(), splits, collate, out, timer, tmp_path
    )
    m = result["metrics"]
    assert m["optimizer_steps_skipped"] == 6 and "optimizer_step_ms" not in m
    assert m["optimizer_state_mb"] == 0
    assert result["tags"]["peak_breakdown"].startswith("n/a")


def test_throughput_is_taken_on_the_steady_steps(tmp_path):
    """Samples/s, tokens/s and MFU over the steps after the warm-up; the warm-up's time apart."""
    from pipeline import measurements

    cfg = compose_cfg(*TINY, "train.max_steps=8", "batch_size=4", f"outputs_dir={tmp_path}")
    timer = StepTimer(torch.nn.Linear(1, 1))
    timer.starts_s = [0.0, 5.0, 6.0, 7.0, 7.5, 8.0, 8.5, 9.0]  # a slow first steps (compilation, tracker)
    ranks = [{"tokens": 800, "window_tokens": 400, "padded_tokens": 1000, "window_padded_tokens": 480}]
    flops = (10, 3)  # N = 10 non-embedding parameters, L H Q = 3
    metrics, tags = measurements.throughput(cfg, timer, runtime_s=9.5, ranks=ranks, flops=flops, device="cpu")
    assert measurements.warmup_steps(cfg) == 3
    # steps 4-7: from the start of step 4 (7.0 s) to the start of step 8 (9.0 s)
    assert tags["throughput_steps"] == "steps 4-7 (after 3 warm-up steps)"
    assert metrics["train_samples_per_second"] == pytest.approx(4 * 4 / 2.0)
    assert metrics["train_tokens_per_second"] == pytest.approx(400 / 2.0)
    assert metrics["train_warmup_s"] == pytest.approx(7.0)
    # 6 N + 12 L H Q T per token, T = 480 padded tokens / (4 steps x 4 sequences) = 30 positions
    assert metrics["train_flops_per_token"] == 6 * 10 + 12 * 3 * 30
    flops_per_s = (6 * 10 + 12 * 3 * 30) * 400 / 2.0
    assert metrics["mfu"] == pytest.approx(flops_per_s / (metrics["device_peak_tflops"] * 1e12))
    timer.starts_s = timer.starts_s[:4]  # too few steps for a window: the whole loop
    metrics, tags = measurements.throughput(cfg, timer, runtime_s=9.5, ranks=ranks, flops=flops, device="cpu")
    assert tags["throughput_steps"].startswith("steps 1-8 (the whole loop")
    assert metrics["train_samples_per_second"] == pytest.approx(8 * 4 / 9.5)
    assert "train_warmup_s" not in metrics


def test_more_gpus_than_visible_fail_that_point_and_the_sweep_goes_on(tmp_path):
    """CUDA_VISIBLE_DEVICES names one GPU (none is there: the nproc=1 job trains on CPU)."""
    args = ["-m", "launcher.nproc_per_job=1,2", *TINY]
    proc = run_cli(tmp_path, *args, env={"CUDA_VISIBLE_DEVICES": "0"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    runs = {r.data.params["world_size"]: r for r in sweep_runs(tmp_path)[1]}
    assert runs["1"].info.status == "FINISHED"
    assert runs["2"].info.status == "FAILED" and runs["2"].data.tags["failure_reason"] == "config"
    message = (
        "launcher.nproc_per_job=2 is invalid here: it needs 2 GPUs and 1 is visible (CUDA_VISIBLE_DEVICES=0)"
    )
    assert runs["2"].data.tags["error"] == f"ConfigError: {message}"
    assert message in proc.stderr


def test_the_cpu_tests_see_no_gpu():
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert not torch.cuda.is_available()
    assert not selects_gpu_tests("not slow and not gpu") and not selects_gpu_tests("slow")
    assert selects_gpu_tests("gpu") and selects_gpu_tests("gpu or slow")


def test_the_gpu_check_always_reaches_its_report_and_summary(tmp_path):
    """`make test-gpu`'s script on a machine without a GPU, on a tiny sweep: the gpu tests skip (with their
    reason), the sweep and the report still run, and the summary lands in the docs page's section."""
    import subprocess
    import sys

    from bench.gpu_check import END, ROOT, START

    docs = tmp_path / "gpu.md"
    docs.write_text(f"# GPU\n\n{START}\nNot yet run.\n{END}\nafter\n")
    sweep = (
        "model=tiny optim=adamw,adafactor backend=accelerator train.max_steps=3 data.max_train_samples=64 "
    )
    sweep += "data.max_eval_samples=32"
    command = [sys.executable, "-m", "bench.gpu_check", "--out", str(tmp_path / "check"), "--docs", str(docs)]
    command += ["--sweep", sweep, "--pytest-args", "-k known_allocation"]
    command += ["--accuracy", "--models tiny --optims adamw --precisions fp32 --checkpointing false"]
    proc = subprocess.run(command, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (tmp_path / "check" / "summary.md").read_text()
    assert "no CUDA device" in summary and "**all steps passed**" in summary
    assert "| test_gpu::test_cuda_peak_of_a_known_allocation | skipped | " in summary
    assert "needs a CUDA device" in summary
    assert summary.count("| accelerator | ") == 2  # the two sweep jobs, with their figures
    assert "| report (`python -m pipeline.report`) | ok (exit 0) |" in summary
    assert "| plan accuracy (`bench.plan_accuracy`) | ok (exit 0) |" in summary
    assert "**1 of 1 runnable combinations within ±5%**" in summary
    assert (tmp_path / "check" / "report" / "report.md").exists()
    page = docs.read_text()
    assert "Not yet run." not in page and summary.strip() in page and page.endswith(f"{END}\nafter\n")
