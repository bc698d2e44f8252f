"""`make report`: one real tiny sweep through the CLI, its report checked against what MLflow holds."""

import base64
import io
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib import image
from omegaconf import OmegaConf

from pipeline import report
from pipeline.report.columns import KEY_LABELS, TASK_COLUMNS
from pipeline.sweep import SweepCallback
from tests.conftest import ROOT, TINY, cli_env, report_folder, run_cli, store, sweep_runs

# 2 optimizers x 2 batch sizes x 2 seeds; data=csv without its files adds 8 points that fail at validation,
# before any job process starts (no cost), for the failed-jobs table
DATA = "data=rotten_tomatoes,csv"
SWEEP = ["-m", "optim=adamw,adafactor", "batch_size=2,4", "seed=0,1", DATA, *TINY[:3], "train.max_steps=2"]
PLOTS = ["state_mb.png", "peak_memory.png", "f1_vs_peak.png", "train_loss.png"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """The module's only sweep: (tmp, CLI process, parent run, child runs); the sweep's end wrote the report."""
    tmp = tmp_path_factory.mktemp("report")
    proc = run_cli(tmp, *SWEEP)
    assert proc.returncode == 1, proc.stderr[-3000:]  # 1: the data=csv points failed
    parent, children = sweep_runs(tmp)
    assert sorted(r.info.status for r in children) == ["FAILED"] * 8 + ["FINISHED"] * 8
    return tmp, proc, parent, children


@pytest.fixture(scope="module")
def out(sweep):
    tmp, _, parent, _ = sweep
    return tmp / "report" / report_folder(parent)


@pytest.fixture(scope="module")
def table(out):
    """comparison.csv, its key columns by the names the code uses (the file has the console's labels)."""
    read = pd.read_csv(out / "comparison.csv", float_precision="round_trip")
    return read.rename(columns={label: key for key, label in KEY_LABELS.items()})


def finished(children):
    return [r for r in children if r.info.status == "FINISHED"]


def by_point(children) -> dict:
    """(batch size, optimizer) -> the finished runs of that point (one per seed)."""
    points = {}
    for run in finished(children):
        points.setdefault((int(run.data.params["batch_size"]), run.data.params["optim"]), []).append(run)
    return points


def test_the_sweep_prints_the_table_and_logs_the_report_to_its_parent_run(sweep, out, table):
    tmp, proc, parent, _ = sweep
    assert "report not built" not in proc.stdout
    for header in ("state [MB]", "Δ state [%]", "peak [MB]", "Δ peak [%]", "eval F1 [0-1]", "samples/s"):
        assert header in proc.stdout
    for row in table.to_dict("records"):
        assert f"{row['peak [MB]']:.4g} ± {row['peak [MB] std']:.2g}" in proc.stdout
        assert f"{row['Δ state [%]']:+.2f}" in proc.stdout
    assert f"[sweep] report: {out.resolve() / 'report.html'}" in proc.stdout
    artifacts = {Path(a.path).name for a in store(tmp).list_artifacts(parent.info.run_id, "report")}
    assert {"report.md", "report.html", "runs.csv", "comparison.csv", *PLOTS} <= artifacts


def test_runs_csv_holds_every_param_and_metric_exactly(sweep, out):
    _, _, _, children = sweep
    text = pd.read_csv(out / "runs.csv", dtype=str, keep_default_na=False).set_index("run_id")
    numbers = pd.read_csv(out / "runs.csv", float_precision="round_trip").set_index("run_id")
    assert sorted(text.index) == sorted(r.info.run_id for r in children)  # one row per job, no parent
    for run in children:
        row, values = text.loc[run.info.run_id], numbers.loc[run.info.run_id]
        assert row["status"] == run.info.status
        assert row["run_name"] == run.info.run_name
        assert row["error"] == run.data.tags.get("error", "")
        assert row["failure_reason"] == run.data.tags.get("failure_reason", "")
        for key, value in run.data.params.items():
            try:
                assert float(row[key]) == float(value), key
            except ValueError:
                assert row[key] == value, key
        for key, value in run.data.metrics.items():
            assert values[key] == value, key  # float for float: nothing rounded on the way
        for key in set(numbers.columns) - set(run.data.metrics) - set(run.data.params):
            tags = (
                "run_name",
                "sweep",
                "sweep_run_id",
                "status",
                "failure_reason",
                "error",
                "collapsed",
                "config_hash",
                "replaced_by",
                "trainer_optim",
                "peak_breakdown",
                "start_time",
                "end_time",
            )
            if key not in tags:
                assert row[key] == "", f"{key}: not measured, so empty (never 0)"
    assert "peak_memory_reserved_mb" not in numbers  # CPU: no CUDA figure at all


def test_the_table_is_mean_and_sample_std_of_what_mlflow_holds(sweep, table):
    points = by_point(sweep[3])
    assert len(table) == 4
    assert (table[["model", "backend"]] == ["tiny", "trainer"]).all().all()
    assert list(zip(table.batch_size, table.optim, strict=True)) == [
        (2, "adamw"),
        (2, "adafactor"),
        (4, "adamw"),
        (4, "adafactor"),
    ]  # baseline first in each group
    for _, row in table.iterrows():
        runs = points[(row.batch_size, row.optim)]
        assert row["n [seeds]"] == len(runs) == 2
        for column, metric in report.COLUMNS.items():
            if column in TASK_COLUMNS["causal_lm"]:  # a language model's: no column in a classifiers' table
                assert column not in table, column
                continue
            values = [r.data.metrics[metric] for r in runs if metric in r.data.metrics]
            mean, std = row[column], row[f"{column} std"]
            if not values:  # peak_memory_reserved_mb on CPU
                assert math.isnan(mean) and math.isnan(std), column
                continue
            assert mean == pytest.approx(statistics.mean(values), rel=1e-12, abs=1e-15), column
            assert std == pytest.approx(statistics.stdev(values), rel=1e-9, abs=1e-12), column
            assert std == pytest.approx(np.std(values, ddof=1), rel=1e-9, abs=1e-12), column


def test_deltas_are_against_adamw_of_the_same_batch_size(sweep, table):
    points = by_point(sweep[3])
    mean = lambda bs, optim, metric: statistics.mean(r.data.metrics[metric] for r in points[(bs, optim)])  # noqa: E731
    for bs in (2, 4):
        rows = table[table.batch_size == bs].set_index("optim")
        for name, metric in (("state", "optimizer_state_mb"), ("peak", "peak_memory_mb")):
            assert rows.loc["adamw", f"Δ {name} [MB]"] == 0 and rows.loc["adamw", f"Δ {name} [%]"] == 0
            delta = mean(bs, "adafactor", metric) - mean(bs, "adamw", metric)
            assert rows.loc["adafactor", f"Δ {name} [MB]"] == pytest.approx(delta, rel=1e-9)
            percent = 100 * delta / mean(bs, "adamw", metric)
            assert rows.loc["adafactor", f"Δ {name} [%]"] == pytest.approx(percent, rel=1e-9)
        assert rows.loc["adafactor", "Δ state [%]"] < -90  # adafactor keeps a few % of adamw's state


def test_the_markdown_and_html_tables_show_mean_std_and_units(sweep, out, table):
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| model"))
    cells = [c.strip() for c in header.strip("|").split("|")]
    assert all("[" in c for c in cells if c not in ("model", "backend", "precision", "optimizer")), cells
    rows = [line for line in md.splitlines() if line.startswith("| tiny")]
    assert len(rows) == 4
    for line, row in zip(rows, table.to_dict("records"), strict=True):
        values = dict(zip(cells, (c.strip() for c in line.strip("|").split("|")), strict=True))
        assert values["state [MB]"] == f"{row['state [MB]']:.4g} ± {row['state [MB] std']:.2g}"
        assert (
            values["eval loss [nats]"] == f"{row['eval loss [nats]']:.4g} ± {row['eval loss [nats] std']:.2g}"
        )
        assert values["Δ peak [%]"] == f"{row['Δ peak [%]']:+.2f}"
        assert values["n [seeds]"] == "2"
        assert values["peak reserved [MB]"] == ""  # not measured on CPU: empty, never 0
        f1 = f"{row['eval F1 [0-1]']:.4g} ± {row['eval F1 [0-1] std']:.2g}"
        assert f1 in page
    assert "<th>Δ state [%]</th>" in page


def test_failed_jobs_have_their_own_table_with_their_error(sweep, out, table):
    assert len(table) == 4  # the finished points only: 2 optimizers x 2 batch sizes
    failed = [r for r in sweep[3] if r.info.status == "FAILED"]
    md = (out / "report.md").read_text()
    section = md.split("## Failed jobs")[1].split("## Plots")[0]
    for run in failed:
        line = next(line for line in section.splitlines() if run.info.run_name in line)
        assert "ConfigError: data.train_file is required" in line
    assert section.count("| FAILED |") == 8
    assert "| csv |" not in md.split("## Failed jobs")[0]  # not in the comparison


def test_the_plots_are_real_images_embedded_in_the_html(out):
    page = (out / "report.html").read_text()
    for name in PLOTS:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000, name
        pixels = image.imread(io.BytesIO(data), format="png")
        assert pixels.shape[0] >= 400 and pixels.shape[1] >= 700, (name, pixels.shape)
        colours = np.unique((pixels[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
        assert len(colours) > 20, name  # drawn, not blank
        assert base64.b64encode(data).decode() in page, name
    assert 'src="http' not in page and "href=" not in page  # self-contained


def test_pareto_front():
    table = pd.DataFrame(
        {"peak [MB]": [10, 10, 20, 30, 5, np.nan, 25], "eval F1 [0-1]": [0.5, 0.5, 0.7, 0.6, 0.1, 0.9, 0.7]}
    )
    # 10/0.5 twice (neither beats the other), 20/0.7 and 5/0.1; 30/0.6 and 25/0.7 are beaten by 20/0.7
    assert report.pareto_front(table).tolist() == [True, True, True, False, True, False, False]


def test_selecting_by_name_or_whole_experiment_gives_the_same_table(sweep, table, tmp_path):
    tmp, _, parent, _ = sweep
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    had_uri = "MLFLOW_TRACKING_URI" in os.environ
    # its name (what it swept), its id and its folder select the same sweep
    assert parent.info.run_name == " ".join(SWEEP[1:])
    selectors = [parent.info.run_name, parent.info.run_id, report_folder(parent)]
    folder, by_name = report.build(uri, selectors, out=tmp_path / "named")
    _, whole = report.build(uri, whole_experiment=True, out=tmp_path / "whole")
    assert folder == tmp_path / "named" and (folder / "report.html").exists()
    pd.testing.assert_frame_equal(by_name, whole)
    pd.testing.assert_frame_equal(by_name.reset_index(drop=True), table, check_dtype=False)
    assert ("MLFLOW_TRACKING_URI" in os.environ) == had_uri  # mlflow's global URI was set only for the search
    with pytest.raises(report.ReportError, match="no sweep with run id, name or folder 'sweep-nope'"):
        report.build(uri, ["sweep-nope"], out=tmp_path / "nope")


def _report_cli(*args, cwd=ROOT, env=None):
    env = cli_env() | (env or {})
    return subprocess.run(
        [sys.executable, "-m", "pipeline.report", *args], cwd=cwd, env=env, capture_output=True, text=True
    )


def test_cli_defaults_to_the_latest_sweep_of_the_tracking_uri(sweep, out, tmp_path):
    tmp, _, parent, _ = sweep
    help_text = _report_cli("--help").stdout
    for option in ("--sweep", "--experiment", "--whole-experiment", "--tracking-uri", "--out", "--baseline"):
        assert option in help_text
    # $MLFLOW_TRACKING_URI picks the store; the latest sweep is the default
    proc = _report_cli(
        "--out", str(tmp_path / "cli"), env={"MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Δ state [%]" in proc.stdout
    assert (tmp_path / "cli" / "runs.csv").read_text() == (out / "runs.csv").read_text()
    # without either, the store is outputs/mlflow.db under the working directory, resolved to an absolute path
    proc = _report_cli(cwd=tmp_path)
    assert proc.returncode == 2
    assert f"error: no MLflow store at sqlite:///{tmp_path.resolve()}/outputs/mlflow.db" in proc.stderr
    proc = _report_cli("--tracking-uri", f"sqlite:///{tmp}/mlflow.db", "--sweep", "sweep-nope")
    # the error names the known sweeps, by folder and name
    assert proc.returncode == 2 and f"{report_folder(parent)} ({parent.info.run_name})" in proc.stderr


def test_a_failing_report_does_not_hide_the_sweep_results(sweep, monkeypatch, capsys):
    tmp, _, parent, _ = sweep
    (sweep_dir,) = tmp.glob("multirun/*")

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(report, "build", broken)
    config = OmegaConf.create(
        {
            "hydra": {"sweep": {"dir": str(sweep_dir)}},
            "tracking": {"uri": f"sqlite:///{tmp}/mlflow.db", "experiment": "optimizer-sweep"},
            "outputs_dir": str(tmp),
        }
    )
    SweepCallback().on_multirun_end(config)
    printed = capsys.readouterr().out
    assert "[sweep] report not built: RuntimeError: disk full" in printed
    assert "eval F1" in printed and printed.count("FINISHED") == 8  # the plain summary table instead
    assert store(tmp).get_run(parent.info.run_id).info.status == "FAILED"


CHROMIUM = shutil.which("chromium")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
@pytest.mark.slow  # headless Chromium: CI (make test-ci)
def test_report_html_renders_in_headless_chromium(out, tmp_path):
    shot = tmp_path / "report.png"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"]
    flags += ["--disable-background-networking", "--disable-component-update", "--disable-sync"]
    flags += [f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1400,3000"]
    proc = subprocess.run(
        [CHROMIUM, *flags, (out / "report.html").resolve().as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shot.exists(), proc.stderr[-3000:]
    pixels = (image.imread(shot)[..., :3] * 255).round().astype(np.uint8)
    assert pixels.shape[:2] == (3000, 1400)
    colours = {tuple(c) for c in np.unique(pixels.reshape(-1, 3), axis=0)}
    assert len(colours) > 100  # text, table, plots: far from blank
    # the table's header background and the plots' bars (adamw blue, adafactor orange) are on the page
    for css_colour in ((0xEE, 0xF2, 0xF7), (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)):
        assert css_colour in colours, css_colour


def test_the_page_leads_with_the_sweeps_status_and_the_decision_columns(out):
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    # written before the sweep closes its parent run, the header still gives the status it closes it with
    assert re.search(r"^- sweep `optim=.*`: FAILED", md, re.M)  # (the data=csv points failed)
    assert "RUNNING" not in md
    lead = md.split("## Comparison\n\n")[1].splitlines()[0]
    assert lead == (
        "| optimizer | batch size [samples] | n [seeds] | state [MB] | Δ state [%] | peak [MB] | Δ peak [%] "
        "| eval F1 [0-1] | throughput [samples/s] |"
    )
    assert "(every row: model tiny, backend trainer, precision fp32)" in md
    assert "### All columns" in md and re.search(r"<details><summary>All columns \(\d+\)</summary>", page)
    assert "exponential moving average, weight 0.9" in page  # the loss plot's caption: its smoothing
