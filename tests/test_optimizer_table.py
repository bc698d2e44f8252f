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


@pytest.mark.slow  # why: a 2-job sweep of gpt2-tiny as a language model and the meta-device steps: 60-90 s on 2 cores
def test_the_language_model_table_counts_the_tied_head_once_in_all_three_figures(tmp_path):
    out = tmp_path / "lm.md"
    command = [
        sys.executable,
        "-m",
        "bench.optimizer_table",
        "--task",
        "causal_lm",
        "--optims",
        "adamw,adafactor",
    ]
    command += ["--out", str(out), "--outputs-dir", str(tmp_path / "outputs")]
    proc = subprocess.run(command, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert text.startswith("# Optimizer state on gpt2-tiny as a causal language model (fp32, accelerator)")
    table = pd.read_csv(out.with_suffix(".csv")).set_index("optim")
    assert list(table.index) == ["adamw", "adafactor"] and set(table.status) == {"FINISHED"}
    assert (table["measured [MB]"] == table["analytic [MB]"]).all()
    assert (table["measured [MB]"] == table["meta step [MB]"]).all()
    # the LM head is the token embedding (tied): the model has the classifier's parameters less its 64x2 score
    # layer (conf/model/gpt2-tiny.yaml: 2,086,400), and AdamW keeps 2 x 4 bytes for each, the shared weight once
    assert set(table.params) == {2_086_400 - 64 * 2}
    assert table.loc["adamw", "bytes/param"] == pytest.approx(8, abs=0.01)
    # Adafactor factors the 30522 x 64 embedding: row and column sums, far under a byte per parameter
    assert table.loc["adafactor", "bytes/param"] < 0.1
    # the logits (batch 2 x 64 tokens x 30522, fp32) are a part of the peak of their own
    assert (table["peak logits [MB]"] >= 2 * 64 * 30522 * 4 / 2**20).all()
    assert "| peak grads [MB] | peak logits [MB] | peak [MB] |" in text
