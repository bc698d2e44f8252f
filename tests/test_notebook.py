"""The pipeline from Python (pipeline.notebook): `pipeline.plan(overrides)` answers the plan's table as the
command line's plan records it, a config.json of one's own included; `runs()` reads a sweep from any folder and
leaves no store behind where there is none."""

import os

import pandas as pd
import pytest

import pipeline
from pipeline import notebook, plan_job
from pipeline.report.runs import ReportError
from tests.conftest import compose_cfg, run_cli
from tests.test_own_model import TINY, write_json


def test_a_sweeps_overrides_make_its_points_in_hydras_order():
    assert notebook.points(["optim=adamw,adafactor", "batch_size=8,16", "model=tiny"]) == [
        ["optim=adamw", "batch_size=8", "model=tiny"],
        ["optim=adamw", "batch_size=16", "model=tiny"],
        ["optim=adafactor", "batch_size=8", "model=tiny"],
        ["optim=adafactor", "batch_size=16", "model=tiny"],
    ]
    assert notebook.points("model=tiny") == [["model=tiny"]]


def test_a_plan_job_of_a_config_json_builds_the_model_it_makes(tmp_path):
    """plan_result on a config whose model is one's own (model.config): the model its config.json makes (its
    parameters counted here by transformers on the meta device), not the group's default whose hidden size it
    would have broadcast against."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    file = write_json(tmp_path / "config.json", TINY)
    cfg = compose_cfg("plan=true", "task=causal_lm", f"model.config={file}", "train.max_length=32")
    metrics = plan_job.plan_result(cfg)["metrics"]
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY))
    assert metrics["model_num_params"] == sum(p.numel() for p in built.parameters())


@pytest.mark.slow  # one plan sweep through the command (about 15 s)
def test_a_notebooks_plan_answers_the_table_the_command_records(tmp_path, monkeypatch):
    """pipeline.plan(overrides) in this process, nothing recorded, against the same sweep through the command
    line and read back from its store with pipeline.runs from another folder."""
    file = write_json(tmp_path / "qwen-tiny" / "config.json", TINY)
    overrides = ["task=causal_lm", f"model.config={file}", "peft=lora", "optim=adamw,adafactor"]
    overrides += ["device_memory=rtx-4090", "train.max_length=128"]
    table = pipeline.plan(overrides)
    assert isinstance(table, pd.DataFrame) and len(table) == 2
    assert set(table["optimizer"]) == {"adamw", "adafactor"} and set(table["fits"]) == {"yes"}
    assert table.attrs["verdict"][0].startswith("fits rtx-4090 at batch 16")
    assert not (tmp_path / "outputs").exists() and not list(tmp_path.glob("**/mlflow.db"))

    out = tmp_path / "out"
    proc = run_cli(out, "-m", "plan=true", *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    recorded = pipeline.runs(uri=f"sqlite:///{out / 'mlflow.db'}").set_index("optim")
    for _, row in table.iterrows():
        assert row["predicted peak [MB]"] == pytest.approx(
            recorded.loc[row["optimizer"], "predicted_peak_mb"]
        )
    assert list(elsewhere.iterdir()) == []


def test_runs_opens_no_store_where_there_is_none(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(notebook, "PROJECT_OUTPUTS", tmp_path / "outputs")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ReportError, match="no store at sqlite:///"):
        pipeline.runs()
    assert os.listdir(tmp_path) == []
