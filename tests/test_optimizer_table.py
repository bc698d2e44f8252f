"""`make optimizer-table` on a sample CI can afford: the real sweep, the table, the three state figures."""

import subprocess
import sys

import pandas as pd
import pytest

from tests.conftest import ROOT, cli_env


@pytest.mark.slow  # a 2-job sweep and the meta-device steps: about 40 s on 2 cores
def test_the_optimizer_table_puts_measured_analytic_and_meta_state_side_by_side(tmp_path):
    out = tmp_path / "table.md"
    command = [sys.executable, "-m", "bench.optimizer_table", "--model", "tiny", "--optims", "adamw,sgd"]
    command += ["--out", str(out), "--outputs-dir", str(tmp_path / "outputs")]
    proc = subprocess.run(command, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = pd.read_csv(out.with_suffix(".csv")).set_index("optim")
    assert list(table.index) == ["adamw", "sgd"] and set(table.status) == {"FINISHED"}
    # three independent figures: what the object holds, the registry's formula, the meta-device step
    assert (table["measured [MB]"] == table["analytic [MB]"]).all()
    assert (table["measured [MB]"] == table["meta step [MB]"]).all()
    # AdamW keeps two fp32 moments per parameter, SGD with momentum one
    assert table.loc["adamw", "bytes/param"] == pytest.approx(8, abs=0.01)
    assert table.loc["sgd", "bytes/param"] == pytest.approx(4, abs=0.01)
    assert "| `adamw` | FINISHED | 7.717 | 7.717 (=) | 7.717 (=) | 8.00 |" in out.read_text()
