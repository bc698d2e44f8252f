"""The real CLI: Hydra multirun -> one process per job -> MLflow, on the tiny model."""

import json
import subprocess
import sys

import pandas as pd
import pytest

from tests.conftest import ROOT, TINY, cli_env, run_cli, store, sweep_runs

METRICS = {
    "optimizer_state_numel",
    "optimizer_state_bytes",
    "optimizer_state_mb",
    "estimated_optimizer_state_mb",
    "model_num_params",
    "peak_memory_mb",
    "peak_rss_mb",
    "train_loss",
    "train_loss_final",
    "eval_loss",
    "eval_accuracy",
    "eval_f1",
    "train_samples_per_second",
    "train_runtime_s",
}
PARAMS = {"optim", "model", "data", "backend", "batch_size", "seed", "lr", "max_steps", "device"}


@pytest.fixture(scope="module")
def four_jobs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    proc = run_cli(tmp, "-m", "optim=adamw,adafactor", "backend=trainer,accelerator", *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, proc


def by_point(children):
    return {(r.data.params["optim"], r.data.params["backend"]): r for r in children}


def test_one_parent_and_four_finished_children(four_jobs):
    tmp, proc = four_jobs
    parent, children = sweep_runs(tmp)
    assert parent.info.status == "FINISHED"
    assert sorted(by_point(children)) == [
        ("adafactor", "accelerator"),
        ("adafactor", "trainer"),
        ("adamw", "accelerator"),
        ("adamw", "trainer"),
    ]
    assert {r.info.status for r in children} == {"FINISHED"}
    # exactly one run per job (the Trainer's own MLflow callback made none), none misfiled into Default
    client = store(tmp)
    all_runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(all_runs) == 5
    assert {r.info.experiment_id for r in all_runs} == {parent.info.experiment_id}
    assert "eval F1" in proc.stdout  # the summary table


def test_every_metric_param_and_artifact_is_recorded(four_jobs):
    tmp, _ = four_jobs
    client = store(tmp)
    for run in sweep_runs(tmp)[1]:
        assert METRICS <= set(run.data.metrics), METRICS - set(run.data.metrics)
        assert PARAMS <= set(run.data.params)
        assert run.data.params["device"] == "cpu"
        assert run.data.tags["version.torch"]
        losses = client.get_metric_history(run.info.run_id, "train_loss")
        assert [m.step for m in losses] == [1, 2, 3]
        assert "config.yaml" in {a.path for a in client.list_artifacts(run.info.run_id)}


def test_state_sizes_across_optimizers_and_backends(four_jobs):
    runs = by_point(sweep_runs(four_jobs[0])[1])
    m = {point: run.data.metrics for point, run in runs.items()}
    for backend in ("trainer", "accelerator"):
        adamw, adafactor = m[("adamw", backend)], m[("adafactor", backend)]
        assert adafactor["optimizer_state_mb"] < adamw["optimizer_state_mb"] / 50
        for point in (adamw, adafactor):
            assert point["optimizer_state_mb"] == point["estimated_optimizer_state_mb"]
            assert point["optimizer_state_mb"] == point["optimizer_state_bytes"] / 2**20
        # on CPU the state AdamW keeps shows in the peak: >= 80% of the state difference
        state_gap = adamw["optimizer_state_mb"] - adafactor["optimizer_state_mb"]
        assert adamw["peak_memory_mb"] - adafactor["peak_memory_mb"] >= 0.8 * state_gap
    for optim in ("adamw", "adafactor"):
        assert (
            m[(optim, "trainer")]["optimizer_state_numel"]
            == m[(optim, "accelerator")]["optimizer_state_numel"]
        )


def test_a_failing_job_is_recorded_and_the_sweep_goes_on(tmp_path):
    pd.DataFrame({"text": ["good", "bad"] * 20, "label": [1, 0] * 20}).to_csv(tmp_path / "d.csv", index=False)
    pd.DataFrame({"text": ["meh"], "label": [7]}).to_csv(tmp_path / "odd.csv", index=False)
    data = ["data=csv", f"data.train_file={tmp_path}/d.csv"]
    # point 0's eval file has a label the training data lacks (fails inside the job); point 1 is fine
    proc = run_cli(
        tmp_path,
        "-m",
        *data,
        f"data.eval_file={tmp_path}/odd.csv,{tmp_path}/d.csv",
        *TINY[:1],
        "train.max_steps=2",
    )
    assert proc.returncode == 1
    parent, children = sweep_runs(tmp_path)
    assert sorted(r.info.status for r in children) == ["FAILED", "FINISHED"]
    (failed,) = [r for r in children if r.info.status == "FAILED"]
    assert failed.data.tags["error"].startswith("ValueError: eval labels must be among the training labels")
    assert failed.data.tags["failure_reason"] == "exception"
    assert "error.txt" in {a.path for a in store(tmp_path).list_artifacts(failed.info.run_id)}
    assert parent.info.status == "FAILED"
    assert "1 failed: adamw-tiny-csv-trainer-bs16-s0 (exception: ValueError: eval labels" in proc.stderr


def test_a_bad_point_in_a_sweep_fails_alone(tmp_path):
    """data=csv without its files is bad only at the points of that option: those fail, the others train."""
    proc = run_cli(tmp_path, "-m", "data=rotten_tomatoes,csv", *TINY, "train.max_steps=1")
    assert proc.returncode == 1
    _, children = sweep_runs(tmp_path)
    status = {r.data.params["data"]: r for r in children}
    assert status["rotten_tomatoes"].info.status == "FINISHED"
    assert status["csv"].info.status == "FAILED"
    assert status["csv"].data.tags["error"] == (
        "ConfigError: data.train_file is required: set it on the command line (data.train_file=...)"
    )


def test_peak_memory_does_not_depend_on_job_order(four_jobs, tmp_path):
    """The Trainer's points of the four-job sweep (adamw first) run again in the reverse order."""
    assert run_cli(tmp_path, "-m", "optim=adafactor,adamw", "backend=trainer", *TINY).returncode == 0
    forward = {
        optim: run.data.metrics["peak_memory_mb"]
        for (optim, backend), run in by_point(sweep_runs(four_jobs[0])[1]).items()
        if backend == "trainer"
    }
    reverse = {r.data.params["optim"]: r.data.metrics["peak_memory_mb"] for r in sweep_runs(tmp_path)[1]}
    for optim in ("adamw", "adafactor"):
        assert reverse[optim] == pytest.approx(forward[optim], rel=0.05)


# `python -m pipeline ARGS` with Hydra's compositions counted: every config Hydra composes goes through its
# loader's load_configuration (a point's through load_sweep_config too); the counts are written to sys.argv[1]
COUNTED_CLI = """
import atexit, collections, json, runpy, sys
from hydra._internal.config_loader_impl import ConfigLoaderImpl

counts, out = collections.Counter(), sys.argv.pop(1)
for name in ("load_configuration", "load_sweep_config"):
    def counted(*args, _name=name, _original=getattr(ConfigLoaderImpl, name), **kwargs):
        counts[_name] += 1
        return _original(*args, **kwargs)
    setattr(ConfigLoaderImpl, name, counted)
atexit.register(lambda: open(out, "w").write(json.dumps(counts)))
sys.argv[0] = "pipeline"
runpy.run_module("pipeline", run_name="__main__", alter_sys=True)
"""


def test_each_point_of_a_sweep_is_composed_once(tmp_path):
    """A 2-point sweep composes each point's config once (the sweeper's check before the batch runs; the
    launcher runs that config, hydra_plugins/compose_once_sweeper.py), and the launching config twice: Hydra
    composes it once to read `hydra.mode` (hydra.main's run, which nothing of ours can spare) and once for the
    sweep."""
    counts = tmp_path / "counts.json"
    args = ["-m", "optim=adamw,adafactor", *TINY, f"outputs_dir={tmp_path}"]
    proc = subprocess.run(
        [sys.executable, "-c", COUNTED_CLI, str(counts), *args],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 jobs: 2 finished" in proc.stdout
    assert json.loads(counts.read_text()) == {"load_sweep_config": 2, "load_configuration": 2 + 2}
