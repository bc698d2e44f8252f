"""What a first GPU run would hit, checked on CPU where it can be: the device index the allocator needs,
memory the allocator holds outside tensors, paged state, steady-state throughput, steps the fp16 grad scaler
skips, more GPUs asked than visible, the CPU tests hiding GPUs, `make test-gpu`'s script (its steps' time-outs, a
torch that does not see the GPUs, its checks on CPU figures) and bench.plan_accuracy's clearing between cases."""

import os

import pytest
import torch

from pipeline import MB, adapters, models
from pipeline.memory import StepBreakdown, TrainingMemory, indexed
from pipeline.state import optimizer_state_size, paged_state_size
from pipeline.timing import StepTimer, peak_flops, warmup_steps
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


def skipped_steps_loop(skip: set[int], steps: int = 6, model=None):
    """A training loop under the job's trackers whose fp16-style grad scaler skips the optimizer step of the
    given steps (their gradients made non-finite, as an fp16 overflow does); (timer, memory, optimizer)."""
    torch.manual_seed(0)
    model = model or tiny_model()
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
    return timer, memory, optimizer


def test_steps_the_grad_scaler_skips_are_still_steps():
    timer, memory, _ = skipped_steps_loop(skip={1, 4})
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
    _, memory, _ = skipped_steps_loop(skip={2})
    assert memory.breakdown_tag == "step 2 (its optimizer step was skipped by the grad scaler)"


def test_a_run_whose_every_step_is_skipped_is_measured_not_crashed(tmp_path):
    from pipeline import backends, data, measurements, optimizers
    from pipeline.backends import TrainOutput

    cfg = compose_cfg(*TINY, "train.max_steps=6", f"outputs_dir={tmp_path}")
    tokenizer = models.load_tokenizer(cfg.model)
    collate = data.PaddingCollator(tokenizer, "longest", 64)
    splits = data.Splits(train=[0] * 64, eval=[0] * 32, label_names=["rotten", "fresh"])
    model = tiny_model()

    def train(
        cfg, model, splits, spec, collate, job_dir
    ) -> TrainOutput:  # a backend whose every step is skipped
        timer, memory, optimizer = skipped_steps_loop(skip=set(range(1, 7)), model=model)
        assert timer.median_ms is None and memory.optimizer_steps == 0
        assert memory.breakdown_tag.startswith(
            "n/a: no training step started with the optimizer state in place"
        )
        for _ in range(6):
            collate(
                [dict(tokenizer("a short review"), label=1), dict(tokenizer("and a longer one"), label=0)]
            )
        return TrainOutput(optimizer, [0.7] * 6, {}, 1.5, memory, "cpu")

    trained = backends.run(cfg, optimizers.choose(cfg).spec, model, splits, collate, tmp_path, train=train)
    built = models.Built(
        model, *adapters.figures(cfg, model), models.vocab_size(model), *adapters.model_size(model)
    )
    result = measurements.training_result(cfg, optimizers.choose(cfg), built, splits, trained)
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
    flops = adapters.ModelFlops(10, 3, 10)  # N = 10 non-embedding parameters, all trained; L H Q = 3
    assert warmup_steps(cfg) == 3
    peak = peak_flops("cpu", cfg.train.precision, tmp_path)
    steady = timer.figures(3)
    assert steady["window"] == (4, 7, 2.0) and steady["warmup_s"] == 7.0
    metrics, tags = measurements.throughput(cfg, steady, 9.5, ranks, flops, peak)
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
    assert timer.window(3) is None
    metrics, tags = measurements.throughput(cfg, timer.figures(3), 9.5, ranks, flops, peak)
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


def gpu_check_command(tmp_path, *args: str) -> list[str]:
    """`make test-gpu`'s script, its work folder and docs page under tmp_path."""
    import sys

    out = ["--out", str(tmp_path / "check"), "--docs", str(tmp_path / "gpu.md")]
    return [sys.executable, "-m", "bench.gpu_check", *out, *args]


def docs_page(tmp_path):
    from bench.gpu_summary import END, START

    page = tmp_path / "gpu.md"
    page.write_text(f"# GPU\n\n{START}\nNot yet run.\n{END}\nafter\n")
    return page


@pytest.mark.slow  # minutes: every step of make test-gpu's script on CPU
def test_the_gpu_check_runs_its_steps_and_checks_on_cpu(tmp_path):
    """`make test-gpu`'s script on a machine without a GPU (--allow-cpu), every step on the tiny model but the
    2-rank one (skipped, with its reason): each check passes on CPU figures, and the docs page, which only a
    passing GPU run rewrites, stays as it is."""
    import subprocess

    from bench.gpu_check import ROOT

    page = docs_page(tmp_path)
    before = page.read_text()
    tiny = ["model=tiny", "data.max_train_samples=256", "memory_budget_mb=60", "optim=adamw"]
    sets = [a for o in tiny for a in ("--set", o)]
    command = gpu_check_command(tmp_path, "--allow-cpu", "--timeout-scale", "4", *sets)
    proc = subprocess.run(command, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (tmp_path / "check" / "summary.md").read_text()
    assert "**all checks passed**" in summary
    for row in (
        "| peak of a known allocation (256 MiB) | ok | 256.00 MB | 256 MB ± 2% |",
        "| sweep: every job finished on the device | ok | 2 of 2 FINISHED on cpu | 2 FINISHED on cpu |",
        "| sweep: every job started warm | ok | warm: 2 | warm: 2 |",
        "| plan within 5%: accelerator adamw | ok | ",
        "| plan within 5%: trainer adamw | ok | ",
        "| sweep: its report | ok | ",
        "| out of memory: batch 4096 one FAILED run (oom), the sweep goes on | ok | ",
        "| warm jobs in parallel: each its own peak | ok | ",
        "| find_batch_size on the Trainer backend | ok | FINISHED on cpu: batch ",
        "| 2-rank Trainer DDP over NCCL | skipped | needs 2 GPUs, 0 visible | 2 GPUs |",
        "| budget | launcher=parallel, batch 4096, 8, 32 within 2000 MB | ok (exit 1) | ",
    ):
        assert row in summary, summary
    assert page.read_text() == before
    assert "it takes a GPU run whose every check passed" in proc.stdout


def test_the_gpu_check_fails_when_torch_does_not_see_the_gpu_nvidia_smi_lists(tmp_path):
    """A torch wheel that does not match the driver sees no GPU: the check stops at once with one line, exit
    1, no step run and the docs page untouched. The GPU is simulated: an `nvidia-smi` on PATH that lists one,
    and CUDA_VISIBLE_DEVICES naming a device no torch can see, so that the test holds on a GPU machine too."""
    import subprocess
    import time

    from bench.gpu_check import ROOT

    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(
        "#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5a8e1c2d-3b4f-4a6e-9c7d-0123456789ab)'\n"
    )
    fake.chmod(0o755)
    page = docs_page(tmp_path)
    before = page.read_text()
    env = {**cli_env(), "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    env["CUDA_VISIBLE_DEVICES"] = "GPU-5a8e1c2d-3b4f-4a6e-9c7d-0123456789ab"
    start = time.monotonic()
    proc = subprocess.run(
        gpu_check_command(tmp_path), cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert time.monotonic() - start < 60
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    failed = [line for line in proc.stdout.splitlines() if line.startswith("[gpu-check] FAILED: ")]
    assert len(failed) == 1 and "nvidia-smi lists 1" in failed[0] and "sees 0" in failed[0], proc.stdout
    if torch.version.cuda is None:
        assert "a CPU-only wheel" in failed[0]
    summary = (tmp_path / "check" / "summary.md").read_text()
    assert "| GPUs: torch sees those nvidia-smi lists | FAILED | " in summary
    assert not [p.name for p in (tmp_path / "check").iterdir() if p.is_dir()]  # no step ran
    assert page.read_text() == before


def test_a_step_that_hangs_fails_at_its_time_out_with_its_process_group_killed(tmp_path):
    """A step that prints, starts a child and hangs, holding its output open: at the 2 s deadline the step
    fails as timed out, and neither it nor its child is left running."""
    import sys
    import time

    from bench.gpu_check import run
    from tests.conftest import running

    script = (
        "import os, subprocess, time; child = subprocess.Popen(['sleep', '60']); "
        "print(os.getpid(), child.pid, flush=True); time.sleep(60)"
    )
    log = tmp_path / "hang.log"
    start = time.monotonic()
    result = run([sys.executable, "-c", script], log, timeout=2)
    assert time.monotonic() - start < 10
    assert result[0] != 0 and result[2] == "timed out after 2 s"
    pids = [int(pid) for pid in log.read_text().split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 3  # the child, re-parented, is reaped by whoever adopts it
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if running(pid)]


def test_the_gpu_check_is_budgeted_under_12_minutes_on_one_gpu():
    """Each step's time-out is 1.5 times what the first GPU run needed: a sweep's, 60 s a job (its slowest cold
    job took 40 s) and 20 s of its own; they sum under 12 minutes on one GPU."""
    from bench.gpu_check import BUDGET_S, JOB_S, STEPS, one_gpu_budget_s, step_timeout

    assert BUDGET_S == 12 * 60
    assert one_gpu_budget_s() < BUDGET_S
    timeouts = {s.name: step_timeout(s, s.overrides) for s in STEPS}
    assert timeouts["sweep"] == 20 + 6 * JOB_S and timeouts["budget"] == 20 + 2 * JOB_S  # (two at a time)
    assert timeouts["known_allocation"] >= 1.5 * 11 and timeouts["batch_search"] >= 1.5 * 46
    assert JOB_S >= 1.5 * 40
    # the 2-rank step is the one that needs 2 GPUs: it adds to the budget only there
    assert [s.name for s in STEPS if s.gpus > 1] == ["ddp"]


def test_the_docs_section_is_replaced_between_its_markers(tmp_path):
    from bench.gpu_summary import END, START, write_docs

    page = docs_page(tmp_path)
    assert write_docs(page, "the summary")
    assert page.read_text() == f"# GPU\n\n{START}\nthe summary\n{END}\nafter\n"
    other = tmp_path / "other.md"
    other.write_text("no markers\n")
    assert not write_docs(other, "the summary") and other.read_text() == "no markers\n"


def test_clearing_between_plan_accuracy_cases_frees_a_model_accelerate_prepared_for_bf16(
    fresh_accelerate_state,
):
    """Accelerate's mixed-precision forward wrapper (model.forward -> wrapper -> model) is a reference cycle:
    `del` leaves the model's tensors alive, and on CUDA in the next case's peak, until a garbage collection.
    (The automatic collector is off here so that only the clearing can free it.)"""
    import gc
    import weakref

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from bench.plan_accuracy import clear_between_cases

    gc.collect()
    gc.disable()
    try:
        accelerator = Accelerator(mixed_precision="bf16", cpu=True)
        model = accelerator.prepare(torch.nn.Linear(64, 64))
        model(torch.ones(2, 64))
        weight = weakref.ref(model.weight)
        del model, accelerator
        AcceleratorState._reset_state(reset_partial_state=True)
        assert weight() is not None  # what `del` alone leaves
        clear_between_cases("the next case")
        assert weight() is None
    finally:
        gc.enable()
        AcceleratorState._reset_state(reset_partial_state=True)
