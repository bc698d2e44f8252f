"""`make run`'s sweep as it ships: packaged MiniLM on the packaged reviews, adamw and adafactor (minutes)."""

import pytest

from tests.conftest import run_cli, sweep_runs
from tests.test_sweep import METRICS


@pytest.mark.slow
def test_default_sweep_reaches_f1_and_records_everything(tmp_path):
    proc = run_cli(tmp_path, "-m", "optim=adamw,adafactor", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parent, children = sweep_runs(tmp_path)
    assert parent.info.status == "FINISHED"
    runs = {r.data.params["optim"]: r for r in children}
    assert sorted(runs) == ["adafactor", "adamw"]
    for run in runs.values():
        assert run.info.status == "FINISHED"
        assert METRICS <= set(run.data.metrics)
        assert run.data.params["model"] == "minilm" and run.data.params["data"] == "rotten_tomatoes"
    assert runs["adamw"].data.metrics["eval_f1"] >= 0.65
