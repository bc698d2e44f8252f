"""Scale-out through the real engines: jobs side by side (joblib launcher), one job as 2 ranks (torchrun,
submitit), a real `mlflow server`, and the GPU pool that keeps running jobs off each other's devices."""

import json
import multiprocessing
import os
import signal
import subprocess
import time

import pytest
import torch
from mlflow import MlflowClient

from pipeline import distributed
from pipeline.config import ConfigError, check_group_overrides, validate
from pipeline.placement import GpuPool, cpu_threads
from tests.conftest import (
    TINY,
    compose_cfg,
    free_port,
    run_cli,
    start_mlflow_server,
    stop_mlflow_server,
    store,
    sweep_runs,
)
from tests.pool_holder import hold_a_gpu
from tests.test_failures import job_processes, running, start_sweep
from tests.test_sweep import METRICS

# a tiny BERT whose embedding is no bigger than its layers, so ZeRO-1 can split the state about evenly
BALANCED = ["model.architecture.hidden_size=128", "model.architecture.num_hidden_layers=20"]
BALANCED += ["model.architecture.intermediate_size=512"]
FOUR_POINTS = ["-m", "optim=adamw,adafactor", "backend=trainer,accelerator", *TINY]


# ---- GPU pool and CPU split ------------------------------------------------------------------------------


def test_gpu_pool_never_shares_a_device_and_reuses_a_finished_ones(tmp_path):
    """Five runner processes, two devices: at most one holder per device at any time, every device reused."""
    log = tmp_path / "held.jsonl"
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=hold_a_gpu, args=(tmp_path, ["0", "1"], log, 0.5)) for _ in range(5)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
        assert w.exitcode == 0
    held = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(held) == 5
    for device in ("0", "1"):
        spans = sorted((start, end) for d, start, end in held if d == device)
        assert len(spans) >= 2  # a finished job's device went to a later job
        assert all(prev_end <= start for (_, prev_end), (start, _) in zip(spans, spans[1:], strict=False))


def test_gpu_pool_takes_whole_sets_and_frees_them_on_exit(tmp_path):
    pool, other = GpuPool(tmp_path, ["0", "1", "2"]), GpuPool(tmp_path, ["0", "1", "2"])
    with pool.take(2) as first:
        assert len(set(first)) == 2
        assert other._try_take(2) is None  # only one left: a 2-device job waits, holding nothing
        (rest,) = other._try_take(1)
        assert rest[0] not in first
        rest[1].close()
    with other.take(3) as everything:
        assert sorted(everything) == ["0", "1", "2"]
    with pytest.raises(RuntimeError, match="it needs 4 GPUs and 3 are visible"):
        with pool.take(4):
            pass


def test_the_gpus_are_counted_by_nvml_without_torch(monkeypatch):
    """The launching process counts the GPUs it hands out through the driver's NVML (no torch import, no CUDA),
    as nvmlInit_v2 / nvmlDeviceGetCount_v2 / nvmlShutdown answer; None where the library cannot be loaded."""
    import ctypes

    from pipeline import placement

    calls = []

    class Nvml:
        def nvmlInit_v2(self):
            calls.append("init")
            return 0

        def nvmlDeviceGetCount_v2(self, count):
            calls.append("count")
            ctypes.cast(count, ctypes.POINTER(ctypes.c_uint)).contents.value = 3
            return 0

        def nvmlShutdown(self):
            calls.append("shutdown")
            return 0

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Nvml())
    assert placement.nvml_device_count() == 3 and calls == ["init", "count", "shutdown"]
    monkeypatch.undo()
    assert placement.nvml_device_count("libnvidia-ml-absent.so.1") is None


def test_cpu_cores_are_split_between_parallel_jobs_and_their_ranks():
    cores = len(os.sched_getaffinity(0))
    assert cpu_threads(1, 1) == cores
    assert cpu_threads(2, 1) == max(1, cores // 2)
    assert cpu_threads(2, 2) == max(1, cores // 4)


# ---- config ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["launcher.n_jobs=0"], "launcher.n_jobs=0 is invalid: must be a positive integer"),
        (["launcher.nproc_per_job=-2"], "launcher.nproc_per_job=-2 is invalid: must be a positive integer"),
        (
            ["train.sharding=zero3"],
            "train.sharding='zero3' is invalid: did you mean zero2? allowed values are none, zero1, zero2, fsdp",
        ),
        (
            ["train.sharding=zero1"],
            "train.sharding=zero1 is invalid with backend=trainer: sharding runs on backend=accelerator "
            "(the Trainer does plain DDP: train.sharding=none)",
        ),
    ],
)
def test_bad_scale_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(*overrides))
    assert str(err.value) == message


def test_every_launcher_preset_composes_and_validates():
    for name in ("local", "parallel", "slurm", "submitit_local"):
        validate(compose_cfg(f"launcher={name}", "launcher.nproc_per_job=2", "backend=accelerator"))
    assert compose_cfg("tracking=server").tracking.uri.startswith("http://")  # validated when a sweep starts
    with pytest.raises(
        ConfigError, match="launcher=ray is invalid: allowed values are local, parallel, slurm"
    ):
        check_group_overrides(["launcher=ray"])


def test_a_job_refuses_to_run_as_fewer_processes_than_asked(monkeypatch):
    cfg = compose_cfg("launcher.nproc_per_job=2")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    message = "launcher.nproc_per_job=2 but the job runs as 1 process(es) (environment)"
    with pytest.raises(RuntimeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        distributed.check_world_size(cfg, "environment")
    with pytest.raises(RuntimeError, match="runs as 1 process"):
        distributed.check_world_size(cfg, "process group")


# ---- parallel jobs against a real MLflow server ----------------------------------------------------------


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on 127.0.0.1, sqlite backend and proxied artifacts in a temporary folder."""
    port = free_port()
    server = start_mlflow_server(tmp_path_factory.mktemp("mlflow_server"), port)
    yield f"http://127.0.0.1:{port}"
    stop_mlflow_server(server)


@pytest.fixture(scope="module")
def parallel_on_server(mlflow_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parallel")
    start = time.perf_counter()
    proc = run_cli(tmp, *FOUR_POINTS, "launcher=parallel", "launcher.n_jobs=2", "tracking=server",
                   f"tracking.uri={mlflow_server}")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, proc, time.perf_counter() - start


def server_sweep(uri: str, tmp):
    client = MlflowClient(uri)
    (sweep_file,) = tmp.glob("multirun/*/mlflow_sweep.json")
    ids = json.loads(sweep_file.read_text())
    children = client.search_runs(
        [ids["experiment_id"]], filter_string=f"tags.mlflow.parentRunId = '{ids['parent_run_id']}'"
    )
    return client, ids, children


@pytest.mark.slow  # an mlflow server and a parallel sweep: CI (make test-ci)
def test_four_jobs_two_at_a_time_on_a_server_are_all_recorded(mlflow_server, parallel_on_server):
    tmp, proc, _ = parallel_on_server
    assert not (tmp / "mlflow.db").exists()  # everything went to the server
    client, ids, children = server_sweep(mlflow_server, tmp)
    assert client.get_run(ids["parent_run_id"]).info.status == "FINISHED"
    assert len(children) == 4 and {r.info.status for r in children} == {"FINISHED"}
    assert not client.search_runs(["0"])  # nothing misfiled into Default
    for run in children:
        assert METRICS <= set(run.data.metrics), METRICS - set(run.data.metrics)
        history = client.get_metric_history(run.info.run_id, "train_loss")
        assert [m.step for m in history] == [1, 2, 3]
        assert "config.yaml" in {a.path for a in client.list_artifacts(run.info.run_id)}
    # two at a time: some jobs overlapped in time
    spans = sorted((r.info.start_time, r.info.end_time) for r in children)
    assert any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:], strict=False))
    assert "eval F1" in proc.stdout


@pytest.mark.slow  # a second sweep of 4 jobs (~50 s); make bench times the same two sweeps
def test_parallel_jobs_give_the_numbers_of_a_sequential_sweep(mlflow_server, parallel_on_server, tmp_path):
    assert run_cli(tmp_path, *FOUR_POINTS).returncode == 0
    client, _, parallel = server_sweep(mlflow_server, parallel_on_server[0])
    sequential = sweep_runs(tmp_path)[1]

    def numbers(client, runs):
        out = {}
        for r in runs:
            losses = [m.value for m in client.get_metric_history(r.info.run_id, "train_loss")]
            out[r.info.run_name] = (losses, r.data.metrics)
        return out

    par, seq = numbers(client, parallel), numbers(store(tmp_path), sequential)
    assert sorted(par) == sorted(seq)
    for name, (losses, metrics) in seq.items():
        # a job of a parallel sweep has half the threads: float sums may round differently in the last bits
        assert par[name][0] == pytest.approx(losses, rel=1e-5), name
        for key in ("optimizer_state_numel", "optimizer_state_bytes", "model_num_params", "train_tokens"):
            assert par[name][1][key] == metrics[key], (name, key)
        assert par[name][1]["eval_loss"] == pytest.approx(metrics["eval_loss"], rel=1e-5)


@pytest.mark.slow  # a parallel sweep: CI (make test-ci)
def test_a_failing_job_in_a_worker_fails_alone(tmp_path):
    proc = run_cli(
        tmp_path, "-m", "data=rotten_tomatoes,csv", *TINY, "train.max_steps=1", "launcher=parallel"
    )
    assert proc.returncode == 1
    parent, children = sweep_runs(tmp_path)
    assert parent.info.status == "FAILED"
    status = {r.data.params["data"]: r.info.status for r in children}
    assert status == {"csv": "FAILED", "rotten_tomatoes": "FINISHED"}
    assert (
        "[sweep] 1 failed: adamw-tiny-csv-trainer-bs16-s0 (config: ConfigError: data.train_file is required: "
        "set it on the command line (data.train_file=...))" in proc.stderr
    )


@pytest.mark.slow  # a parallel sweep interrupted: CI (make test-ci)
def test_interrupting_a_parallel_sweep_marks_everything_killed(tmp_path):
    sweep = start_sweep(tmp_path, "seed=0,1", *TINY, "train.max_steps=200", "launcher=parallel")
    deadline, jobs = time.time() + 120, []
    while not jobs and time.time() < deadline:
        jobs = job_processes(sweep)
        time.sleep(0.2)
    assert jobs, "no job process appeared"
    time.sleep(1)
    sweep.send_signal(signal.SIGINT)
    out, err = sweep.communicate(timeout=120)
    assert sweep.returncode == 130, err[-2000:]
    parent, children = sweep_runs(tmp_path)
    assert parent.info.status == "KILLED"
    assert children and {r.info.status for r in children} == {"KILLED"}
    time.sleep(1)
    assert not [pid for pid in jobs if running(pid)]


# ---- one job, two processes ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_rank_jobs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ranks")
    args = [
        "-m",
        "backend=accelerator",
        "train.sharding=none,zero1,fsdp",
        "launcher.nproc_per_job=2",
        *TINY,
        *BALANCED,
    ]
    proc = run_cli(tmp, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp


def checksums(run) -> set[str]:
    job_dir = run.data.tags["job_dir"]
    return {json.loads(open(f"{job_dir}/rank{r}.json").read())["param_checksum"] for r in (0, 1)}


@pytest.mark.slow  # the 2-rank jobs: a minute of 4 processes
def test_a_two_process_job_trains_in_sync_and_logs_once(two_rank_jobs):
    client = store(two_rank_jobs)
    _, children = sweep_runs(two_rank_jobs)
    all_runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(all_runs) == 1 + len(children) == 4  # the parent and one run per job: rank 1 logged nothing
    for run in children:
        assert run.info.status == "FINISHED"
        assert run.data.params["world_size"] == "2"
        if run.data.params["sharding"] != "fsdp":  # (FSDP's ranks hold different shards)
            assert len(checksums(run)) == 1  # both ranks ended with the same parameters
            assert run.data.metrics["params_in_sync"] == 1
        assert len(client.get_metric_history(run.info.run_id, "train_loss")) == 3
        m = run.data.metrics
        assert m["optimizer_state_mb"] == m["optimizer_state_mb_rank0"] == m["estimated_optimizer_state_mb"]
        assert m["peak_memory_mb_rank0"] > 0 and m["peak_memory_mb_rank1"] > 0
        assert m["train_samples_per_second"] * m["train_runtime_s"] == pytest.approx(3 * 16 * 2)


@pytest.mark.slow  # the 2-rank jobs: a minute of 4 processes
def test_zero1_halves_the_state_each_rank_holds(two_rank_jobs):
    runs = {r.data.params["sharding"]: r for r in sweep_runs(two_rank_jobs)[1]}
    ddp, zero = runs["none"].data.metrics, runs["zero1"].data.metrics
    full = ddp["optimizer_state_mb"]
    assert ddp["optimizer_state_mb_rank1"] == full and ddp["optimizer_state_mb_total"] == 2 * full
    # ZeRO-1: the shards add up to one full state (AdamW's `step` is per parameter, so nothing is repeated)
    assert zero["optimizer_state_mb_rank0"] + zero["optimizer_state_mb_rank1"] == pytest.approx(full)
    for rank in (0, 1):
        assert zero[f"optimizer_state_mb_rank{rank}"] == pytest.approx(full / 2, rel=0.1)
    # the same updates as DDP: sharding the state changes where it lives, not the math
    client = store(two_rank_jobs)
    losses = {
        k: [m.value for m in client.get_metric_history(r.info.run_id, "train_loss")] for k, r in runs.items()
    }
    assert losses["zero1"] == pytest.approx(losses["none"], rel=1e-5)


@pytest.mark.slow  # the 2-rank jobs: a minute of 4 processes
def test_each_ranks_peak_is_predicted_within_5_percent(two_rank_jobs):
    """The plan for several ranks (pipeline.plan_ranks: DDP's buckets, ZeRO-1's owned state) against the peak
    each rank measured, at the largest batch that rank saw."""
    for run in sweep_runs(two_rank_jobs)[1]:
        m = run.data.metrics
        for rank in (0, 1):
            assert abs(m[f"predicted_peak_error_pct_rank{rank}"]) <= 5, (run.data.params["sharding"], rank)
            predicted, measured = m[f"predicted_peak_mb_rank{rank}"], m[f"peak_memory_mb_rank{rank}"]
            assert predicted == pytest.approx(
                measured * (1 + m[f"predicted_peak_error_pct_rank{rank}"] / 100)
            )


@pytest.mark.slow  # the 2-rank jobs: a minute of 4 processes
def test_fsdp_shards_weights_gradients_and_state_and_is_planned_within_1_percent(two_rank_jobs):
    """FSDP2 on two CPU ranks (gloo): each rank holds half of every weight, gradient and state at rest; the
    plan (pipeline.plan_ranks: the root and a layer gathered, the all-gather's and reduce-scatter's buffers)
    within 1% of each rank's peak, and the same updates as DDP."""
    runs = {r.data.params["sharding"]: r for r in sweep_runs(two_rank_jobs)[1]}
    ddp, fsdp = runs["none"].data.metrics, runs["fsdp"].data.metrics
    for rank in (0, 1):
        assert abs(fsdp[f"predicted_peak_error_pct_rank{rank}"]) <= 1, rank
        assert fsdp[f"optimizer_state_mb_rank{rank}"] == pytest.approx(
            ddp["optimizer_state_mb"] / 2, rel=0.02
        )
        # what it saved: more than half the state (DDP's buckets and half the weights and gradients too)
        saved = ddp[f"peak_memory_mb_rank{rank}"] - fsdp[f"peak_memory_mb_rank{rank}"]
        assert saved > ddp["optimizer_state_mb"] / 2, saved
    assert fsdp["estimated_optimizer_state_mb"] == pytest.approx(fsdp["optimizer_state_mb_rank0"])
    client = store(two_rank_jobs)
    losses = {
        k: [m.value for m in client.get_metric_history(r.info.run_id, "train_loss")] for k, r in runs.items()
    }
    assert losses["fsdp"] == pytest.approx(losses["none"], rel=1e-5)


@pytest.fixture(scope="module")
def fsdp_lora_job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_lora")
    args = ["backend=accelerator", "model=llama-tiny", "peft=lora", "train.sharding=fsdp"]
    proc = run_cli(tmp, "-m", *args, "launcher.nproc_per_job=2", *TINY[1:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp


@pytest.mark.slow  # a 2-rank job: ~25 s
def test_fsdp_with_adapters_shards_the_frozen_base_as_planned(fsdp_lora_job):
    """LoRA under FSDP2 on two CPU ranks: the frozen base sharded with the adapters, each rank's peak within 1% of
    its plan. At llama-tiny's size the root (the 30,522 x 64 embedding, 96% of the weights) is gathered whole
    through the pass, and its gathering holds it twice for a moment: the plan puts FSDP above DDP here (where
    the layers outweigh the root, as in an 8B or a 70B, below it)."""
    from pipeline import plan_job

    (run,) = sweep_runs(fsdp_lora_job)[1]
    m = run.data.metrics
    for rank in (0, 1):
        assert abs(m[f"predicted_peak_error_pct_rank{rank}"]) <= 1, rank
    assert m["optimizer_state_mb_rank0"] == pytest.approx(m["estimated_optimizer_state_mb"])
    plans = {}
    for sharding in ("none", "fsdp"):
        cfg = compose_cfg("model=llama-tiny", "peft=lora", "plan=true", "launcher.nproc_per_job=2",
                          "backend=accelerator", f"train.sharding={sharding}", "train.max_length=52")  # fmt: skip
        plans[sharding] = plan_job.plan_result(cfg)["metrics"]["predicted_peak_mb"]
    assert plans["fsdp"] > plans["none"]


@pytest.mark.slow  # ~50 s: 4 processes on the CPU at once
def test_submitit_local_runs_each_job_as_two_tasks(tmp_path):
    proc = run_cli(tmp_path, "-m", "backend=trainer,accelerator", *TINY, "launcher=submitit_local",
                   "launcher.nproc_per_job=2")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    parent, children = sweep_runs(tmp_path)
    assert parent.info.status == "FINISHED"
    assert sorted(r.data.params["backend"] for r in children) == ["accelerator", "trainer"]
    client = store(tmp_path)
    assert len(client.search_runs([parent.info.experiment_id])) == 3  # task 1 of each job logged nothing
    for run in children:
        assert run.info.status == "FINISHED" and run.data.params["world_size"] == "2"
        assert len(checksums(run)) == 1 and run.data.metrics["params_in_sync"] == 1
    assert list(tmp_path.glob("multirun/*/.submitit/*"))  # submitit ran them


@pytest.mark.slow  # ~40 s: two submitit jobs started and stopped
def test_stopping_a_submitit_sweep_cancels_its_jobs(tmp_path):
    sweep = start_sweep(tmp_path, "seed=0,1", *TINY, "train.max_steps=100000", "launcher=submitit_local")
    deadline, jobs = time.time() + 300, []
    while len(jobs) < 2:  # the local executor starts both jobs at once; each runs its `pipeline.job`
        assert sweep.poll() is None and time.time() < deadline, sweep.stderr.read()[-3000:]
        found = subprocess.run(["pgrep", "-f", f"pipeline.job {tmp_path}"], capture_output=True, text=True)
        jobs = [int(pid) for pid in found.stdout.split()]
        time.sleep(0.2)
    controllers = [int(p.name) for p in tmp_path.glob("multirun/*/.submitit/[0-9]*")]  # submitit's job ids
    assert len(controllers) == 2
    sweep.send_signal(signal.SIGTERM)  # a scheduler or `kill` stops the sweep's own process only
    out, err = sweep.communicate(timeout=120)
    assert sweep.returncode == 130, err[-2000:]
    assert f"[sweep] cancelled 2 submitit_local jobs: {' '.join(map(str, sorted(controllers)))}" in out
    assert not [pid for pid in jobs + controllers if running(pid)]  # nothing keeps training
    parent, children = sweep_runs(tmp_path)
    assert parent.info.status == "KILLED"
    assert len(children) == 2 and {r.info.status for r in children} == {"KILLED"}


# ---- GPUs (make test-gpu) --------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_parallel_sweep_on_gpus_gives_each_running_job_its_own_device(tmp_path):
    proc = run_cli(tmp_path, "-m", "seed=0,1", *TINY, "launcher=parallel", "launcher.n_jobs=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, children = sweep_runs(tmp_path)
    assert len(children) == 2
    devices = []
    for run in children:
        assert run.info.status == "FINISHED" and run.data.params["device"].startswith("cuda")
        devices.append(run.data.tags["cuda_visible_devices"])
    # both jobs started at once: with two GPUs or more each had its own; with one they took turns on it
    assert len(set(devices)) == min(2, torch.cuda.device_count())


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_rank_jobs_on_gpus_with_nccl_zero1_and_fsdp(tmp_path):
    args = ["-m", "backend=accelerator", "train.sharding=none,zero1,fsdp", "launcher.nproc_per_job=2"]
    proc = run_cli(tmp_path, *args, *TINY, *BALANCED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {r.data.params["sharding"]: r.data.metrics for r in sweep_runs(tmp_path)[1]}
    full = runs["none"]["optimizer_state_mb"]
    assert runs["none"]["params_in_sync"] == runs["zero1"]["params_in_sync"] == 1
    for sharded in ("zero1", "fsdp"):  # each rank holds about half the state
        for rank in (0, 1):
            assert runs[sharded][f"optimizer_state_mb_rank{rank}"] == pytest.approx(full / 2, rel=0.15)
