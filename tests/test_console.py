"""The console as promised, counted line by line through the real CLI: a MiniLM training sweep and a plan
sweep print their own lines and no library noise; transformers' load report for the newly initialised
classification head becomes one line per job."""

import logging
import re

import pytest

from pipeline import quiet
from tests.conftest import run_cli

NOISE = ("Failed to load", "is an Enum subclass", "Detected no triton", "LOAD REPORT", "| MISSING", "{'loss'")
# the sweep's own lines: Hydra's launch lines, ours, MLflow's creating a new store, the tables
OURS = re.compile(
    r"^(\[sweep\]|\[job\]|\[transformers\] \w+: the classification head|\[[\d\- :,]+\]\[HYDRA\]|"
    r"\d{4}/\d\d/\d\d [\d:]+ INFO mlflow\.store|train: |eval: |val: |\s*\d+%\||\(|verdict: |plan:|\s*model |"
    r"\s*(minilm|tiny|distilbert-base-cased) |[\w.-]+: [\d,]+ parameters )"
)


def stray(console: str) -> list[str]:
    return [line for line in console.splitlines() if line.strip() and not OURS.match(line)]


@pytest.mark.slow  # a MiniLM sweep: CI (make test-ci)
def test_a_minilm_sweep_prints_one_head_line_per_job_and_no_library_noise(tmp_path):
    args = ["-m", "optim=adamw,adafactor", "train.max_steps=2", "data.max_train_samples=32"]
    args += ["data.max_eval_samples=16", "data.max_val_samples=16"]
    proc = run_cli(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = proc.stdout + proc.stderr
    for noise in NOISE:
        assert noise not in console, noise
    head = (
        "BertForSequenceClassification: the classification head (classifier.bias, classifier.weight) is newly"
    )
    assert console.count(head) == 2, console
    assert stray(console) == [], console


@pytest.mark.slow  # DistilBERT planned three times: CI (make test-ci)
def test_a_plan_sweep_prints_no_library_noise_and_each_warning_once(tmp_path):
    """A plan sweep of a pretrained model whose tokenizer is not cached (a plan asks no network for it), with
    GaLore and an 8-bit optimizer: the tokenizer's fallback said once for the sweep (not once per point), and
    none of the libraries' lines (bitsandbytes' optional CPU kernel, galore-torch's deprecation of its AdamW)."""
    args = [
        "-m",
        "plan=true",
        "model=distilbert-base-cased",
        "optim=adamw,galore_adamw,adamw_8bit",
    ]
    proc = run_cli(tmp_path, *args, "device_memory=t4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = proc.stdout + proc.stderr
    for noise in (*NOISE, "gemm_4bit_forward", "FutureWarning", "is deprecated"):
        assert noise not in console, noise
    fallback = [
        line for line in console.splitlines() if "is not cached; using the packaged MiniLM tokenizer" in line
    ]
    assert len(fallback) == 1, fallback
    assert stray(console) == fallback, console


def test_another_load_report_passes_whole():
    """Only a report that lists nothing but a classification head's MISSING keys becomes the one line."""
    report = "BertModel LOAD REPORT from: x\nKey | Status |\n----+----+\nencoder.w | UNEXPECTED |\n"
    record = logging.LogRecord("transformers.modeling_utils", logging.WARNING, "", 0, report, None, None)
    assert quiet._HeadReport().filter(record) and record.msg == report
    head = "\x1b[1mBertForSequenceClassification LOAD REPORT\x1b[0m from: x\nKey | Status |\n---+---+\nclassifier.bias | MISSING |\n"
    record = logging.LogRecord("transformers.modeling_utils", logging.WARNING, "", 0, head, None, None)
    assert quiet._HeadReport().filter(record) and record.msg.startswith("BertForSequenceClassification: the ")
