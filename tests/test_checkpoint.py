"""Checkpoints and resuming: a job stopped by SIGTERM at a step boundary resumes from its checkpoint to the
figures of a run that was never stopped (pipeline.checkpoint)."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from pipeline import checkpoint
from tests.conftest import ROOT, TINY, cli_env, compose_cfg, run_cli, store


@pytest.fixture
def stop_signal():
    """The job process's SIGTERM handler, as pipeline.job.main installs it, for this test only."""
    before = signal.getsignal(signal.SIGTERM)
    checkpoint.listen()
    yield
    signal.signal(signal.SIGTERM, before)
    checkpoint._asked.clear()


def sigterm_at(step: int):
    """SIGTERM to this process during the forward pass of training step `step` (a real signal, as a scheduler
    sends it)."""
    seen = []

    def hook(module, args):
        name = type(module).__name__  # the model itself (under peft's wrapper with adapters)
        if module.training and name.endswith("ForSequenceClassification") and not name.startswith("Peft"):
            seen.append(1)
            if len(seen) == step:
                os.kill(os.getpid(), signal.SIGTERM)

    return torch.nn.modules.module.register_module_forward_pre_hook(hook)


def job_result(cfg, job_dir):
    from pipeline import job

    job_dir.mkdir(parents=True, exist_ok=True)
    return job.run(cfg, job_dir)


@pytest.mark.usefixtures("fresh_accelerate_state", "stop_signal")
@pytest.mark.parametrize(
    "backend,peft,killed",
    [
        ("accelerator", "none", False),
        ("trainer", "none", False),
        ("accelerator", "lora", False),
        ("trainer", "lora", False),
        ("trainer", "none", True),
    ],
)
def test_a_job_stopped_by_sigterm_resumes_to_the_figures_of_one_never_stopped(
    backend, peft, killed, tmp_path, monkeypatch
):
    """Its losses step by step and its evaluation equal those of the run never stopped, exactly (CPU). `killed`:
    the process was killed while it wrote its last checkpoint (left as a half-written folder): the rerun
    resumes from the one before."""
    cfg = compose_cfg(
        *TINY,
        f"backend={backend}",
        f"peft={peft}",
        "train.max_steps=24",
        "train.checkpoint_every=5",
        "seed=3",
        f"outputs_dir={tmp_path}",
    )
    whole = job_result(cfg, tmp_path / "whole")
    folder = tmp_path / "checkpoints"
    monkeypatch.setenv(checkpoint.ENV, str(folder))
    hook = sigterm_at(13)
    try:
        with pytest.raises(checkpoint.Preempted) as stopped:
            job_result(cfg, tmp_path / "first")
    finally:
        hook.remove()
    assert stopped.value.step == 13 and len(stopped.value.losses) == 13
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-00000010", "step-00000013"]
    checkpoint._asked.clear()
    if killed:
        (folder / "step-00000013").rename(folder / ".writing-13-1")
    resumed = job_result(cfg, tmp_path / "second")
    assert not folder.exists()  # the run finished: its checkpoints went
    assert resumed["series"]["train_loss"] == whole["series"]["train_loss"]
    for key, value in whole["metrics"].items():
        if key.startswith(("eval_", "val_", "train_loss")) and not key.endswith("_s"):
            assert resumed["metrics"][key] == value, key
    # steps 5, 10 and 13 (the stop), then 15 and 20
    assert resumed["metrics"]["segments"] == 2 and resumed["metrics"]["checkpoints"] == 5 - killed
    assert resumed["tags"]["segments"].startswith(f"steps 1-{10 if killed else 13}: peak ")


def test_a_process_killed_while_it_writes_a_checkpoint_leaves_the_one_before(tmp_path):
    code = """
import os, signal, sys
from pathlib import Path
from pipeline.checkpoint import Checkpoints

saves = Checkpoints(Path(sys.argv[1]), ("steps", 1))
saves.save(1, lambda folder: (folder / "state.pt").write_bytes(b"1" * 1000), {"segments": []})

def half(folder):
    (folder / "state.pt").write_bytes(b"2" * 500)
    os.kill(os.getpid(), signal.SIGKILL)

saves.save(2, half, {"segments": []})
"""
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT)
    assert done.returncode == -signal.SIGKILL
    saves = checkpoint.Checkpoints(tmp_path, ("steps", 1))
    assert saves.latest() == tmp_path / "step-00000001" and saves.meta["step"] == 1
    assert (tmp_path / "step-00000001" / "state.pt").read_bytes() == b"1" * 1000
    assert len(list(tmp_path.glob(".writing-2-*"))) == 1  # the half-written one, ignored
    saves.save(3, lambda folder: None, {"segments": []})
    assert not list(tmp_path.glob(".writing-*"))
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000001", "step-00000003"]
    assert saves.meta["checkpoints"]["count"] == 2


@pytest.mark.parametrize("value", ["10s", "often", "0.5min", -3, True])
def test_a_bad_checkpoint_every_is_one_line_naming_what_is_allowed(value):
    from pipeline.config import ConfigError, validate

    with pytest.raises(ConfigError, match=r"train.checkpoint_every=.* is invalid: N \(steps\), Nmin"):
        validate(compose_cfg(*TINY, f"train.checkpoint_every={value}"))


@pytest.mark.slow  # about 25 s: two commands of a 600-step job
def test_a_command_stopped_by_sigterm_resumes_into_the_same_run_when_run_again(tmp_path):
    """SIGTERM to the command's process group (as SLURM sends it) mid-run: the run ends KILLED, failure reason
    `preempted`, with the losses so far; the same command again resumes from the checkpoint into that run,
    which ends FINISHED with every step's loss once."""
    args = [*TINY, "train.max_steps=600", "train.checkpoint_every=100", f"outputs_dir={tmp_path}"]
    cmd = [sys.executable, "-m", "pipeline", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=cli_env(), start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip

    def waits_on_a_checkpointing_job() -> bool:  # (a single run's job starts before its run opens)
        if not list(tmp_path.glob("checkpoints/*/step-*")) or not (tmp_path / "mlflow.db").exists():
            return False
        client = store(tmp_path)
        found = client.get_experiment_by_name("optimizer-sweep")
        return found is not None and bool(client.search_runs([found.experiment_id]))

    deadline = time.monotonic() + 120
    while not waits_on_a_checkpointing_job() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # (from its run's opening to waiting on the job: its params logged, its config saved)
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "KILLED (preempted" in out and "the same command resumes it" in out, out
    client = store(tmp_path)
    (run,) = client.search_runs([client.get_experiment_by_name("optimizer-sweep").experiment_id])
    stopped_at = len(client.get_metric_history(run.info.run_id, "train_loss"))
    assert run.info.status == "KILLED" and run.data.tags["failure_reason"] == "preempted"
    assert 100 <= stopped_at < 600
    again = run_cli(tmp_path, *args[:-1])
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming run {run.info.run_id} from its checkpoint at step {stopped_at}" in again.stdout
    (run,) = client.search_runs([run.info.experiment_id])
    assert run.info.status == "FINISHED" and "failure_reason" not in run.data.tags
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")]
    assert sorted(steps) == list(range(1, 601))
    assert run.data.metrics["segments"] == 2 and run.data.tags["segments"].startswith(
        f"steps 1-{stopped_at}:"
    )
