"""Browsing results as a user does: one real tiny sweep, its console, its runs in MLflow (descriptions,
dataset inputs, the experiment's kind) and the page `make ui` prints, served by `mlflow ui`, in headless
Chromium."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from omegaconf import OmegaConf

from pipeline import browse, quiet
from pipeline.tracking import EXPERIMENT_KIND, LOCAL_UI, ui_url
from tests.chromium import CHROMIUM, Chromium
from tests.conftest import ROOT, TINY, free_port, run_cli, store, sweep_runs

SWEEP = ["-m", "optim=adamw,adafactor", *TINY, "data.max_val_samples=16"]
DOCS_SHOT = ROOT / "docs" / "img" / "mlflow-runs.png"  # rewritten when DOCS_SCREENSHOTS=1
NOISE = ("{'loss'", "Failed to load", "is an Enum subclass", "Casting the dataset", "tokenizing", "View run")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """(tmp, CLI process, parent run, child runs) of a 2-job tiny sweep."""
    tmp = tmp_path_factory.mktemp("browse")
    proc = run_cli(tmp, *SWEEP)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parent, children = sweep_runs(tmp)
    return tmp, proc, parent, children


def test_the_console_shows_a_bar_and_a_result_line_per_job(sweep):
    tmp, proc, parent, children = sweep
    console = proc.stdout + proc.stderr
    for noise in NOISE:
        assert noise not in console, noise
    results = re.findall(r"^\[job\] state [\d.]+ MB \(estimated [\d.]+\), peak [\d.]+ MB", proc.stdout, re.M)
    assert len(results) == 2
    for run in children:  # each job's link opens its run in the model-training view
        assert ui_url(f"sqlite:///{tmp}/mlflow.db", run.info.experiment_id, run.info.run_id) in proc.stdout
    lines = console.splitlines()
    assert len(lines) <= 15 * 2 + 10, console  # the sweep's own lines and report table besides
    # the per-step losses are still recorded, though no longer printed
    for run in children:
        assert len(store(tmp).get_metric_history(run.info.run_id, "train_loss")) == 3


def test_library_noise_is_filtered_at_its_logger_unless_asked_for(monkeypatch):
    import logging

    import torch  # noqa: F401  (imported before torchao, as in a job: the filter asks it about CUDA)

    class Seen(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    seen, handler = [], Seen()
    monkeypatch.setenv(quiet.LEVEL_ENV, "warning")
    quiet.install()
    torchao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    try:
        for logger in (torchao, pytree):
            logger.addHandler(handler)
        torchao.warning("Failed to load /x/torchao/_C_mxfp8.so: no CUDA")  # (torch sees no CUDA here)
        torchao.warning("something else")
        pytree.warning("%s is an Enum subclass and is now natively supported by torch.compile", "<enum 'K'>")
        pytree.warning("a real warning")
    finally:
        for logger in (torchao, pytree):
            logger.filters.clear()
            logger.removeHandler(handler)
    assert seen == ["something else", "a real warning"]
    monkeypatch.setenv(quiet.LEVEL_ENV, "info")  # log_level=info or hydra.verbose=true: everything shows
    assert not quiet.is_quiet()
    assert quiet.job_env("info") == {quiet.LEVEL_ENV: "info"}
    assert quiet.job_env("warning") == {quiet.LEVEL_ENV: "warning", "TQDM_DELAY": str(quiet.TQDM_DELAY_S)}
    assert quiet.log_level(OmegaConf.create({})) == "warning"
    assert quiet.log_level(OmegaConf.create({"log_level": "INFO"})) == "info"
    with pytest.raises(ValueError, match=r"^log_level='loud' is invalid: allowed: warning, info, debug$"):
        quiet.log_level(OmegaConf.create({"log_level": "loud"}))


def test_runs_describe_their_result_and_the_experiment_is_model_training(sweep):
    tmp, proc, parent, children = sweep
    experiment = store(tmp).get_experiment(parent.info.experiment_id)
    assert experiment.tags[EXPERIMENT_KIND[0]] == EXPERIMENT_KIND[1]
    for run in children:  # the figures that decide, within the 50 characters the runs table shows
        description, m = run.data.tags["mlflow.note.content"], run.data.metrics
        peak, f1 = m["peak_memory_mb"], m["eval_f1"]
        assert description == f"state {m['optimizer_state_mb']:.3g} MB, peak {peak:.3g} MB, F1 {f1:.3f}"
        assert len(description) <= 50


def test_each_job_logs_its_splits_as_dataset_inputs(sweep):
    _, _, _, children = sweep
    digests = set()
    for run in children:
        inputs = {i.tags[0].value: i.dataset for i in run.inputs.dataset_inputs}
        assert sorted(inputs) == ["eval", "train", "val"]  # mlflow.data.context, as the metrics' prefixes
        for context, rows in (("train", 64), ("val", 16), ("eval", 32)):
            dataset = inputs[context]
            assert dataset.name == f"rotten_tomatoes-{context}"
            assert json.loads(dataset.profile) == {"num_rows": rows}
            assert dataset.source_type == "local"
            assert json.loads(dataset.source)["uri"].endswith("rotten_tomatoes_corpus_full.csv.bz2")
            columns = json.loads(dataset.schema)["mlflow_colspec"]
            assert [(c["name"], c["type"]) for c in columns] == [("text", "string"), ("label", "long")]
        digests.add(tuple(inputs[c].digest for c in ("train", "val", "eval")))
    assert len(digests) == 1 and len(set(next(iter(digests)))) == 3  # same data for both jobs, 3 splits


def test_the_links_open_the_model_training_view():
    assert ui_url("sqlite:///x.db", "3") == f"{LOCAL_UI}/#/experiments/3/runs?workflowType=machine_learning"
    assert ui_url("http://mlflow.internal:5000/", "3", "abc", view="v") == (
        "http://mlflow.internal:5000/#/experiments/3/runs/abc?workflowType=machine_learning"
    )
    line = browse.sweep_line("sqlite:///x.db", {"experiment_id": "3", "parent_run_id": "abc"})
    run = f"{LOCAL_UI}/#/experiments/3/runs/abc?workflowType=machine_learning"
    assert line == f"[sweep] parent run in the MLflow UI: {run} (make ui serves it)"
    assert browse.sweep_line(
        "http://mlflow.internal:5000", {"experiment_id": "3", "parent_run_id": "abc"}
    ) == (
        "[sweep] parent run in the MLflow UI: "
        "http://mlflow.internal:5000/#/experiments/3/runs/abc?workflowType=machine_learning"
    )


def browse_cli(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.browse", *args], cwd=ROOT, capture_output=True, text=True, **kwargs
    )


def test_browse_says_in_one_line_what_it_cannot_open(sweep):
    tmp = sweep[0]
    proc = browse_cli("--tracking-uri", f"sqlite:///{tmp}/mlflow.db", "--experiment", "nope", "--no-serve")
    assert proc.returncode == 0
    assert proc.stdout.startswith(
        f"no experiment 'nope' in sqlite:///{tmp}/mlflow.db yet (make run creates it)"
    )
    port = free_port()
    proc = browse_cli("--tracking-uri", f"http://127.0.0.1:{port}", timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"error: MLflow server http://127.0.0.1:{port} does not answer: start it (make server) or fix the uri"
    )


@pytest.fixture(scope="module")
def ui(sweep):
    """`make ui` on the sweep's store: (the URL it printed, its process); the whole process group is stopped
    at the end (`mlflow ui` and its server)."""
    tmp = sweep[0]
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.browse", "--tracking-uri", f"sqlite:///{tmp}/mlflow.db"]
        + ["--port", str(port), "--no-browser"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        first = proc.stdout.readline()
        url = first.split(": ", 1)[1].strip()
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (
                    f"mlflow ui did not start: {first}"
                )
                time.sleep(1)
        yield url, proc
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM to the process group this test started (`make ui` and its `mlflow ui`), SIGKILL to what is
    left after `grace_s` (mlflow ui takes a few seconds to shut its server down)."""
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=grace_s)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_make_ui_opens_the_sweeps_runs_with_the_figures_first(sweep, ui, tmp_path):
    _, _, parent, children = sweep
    url, _ = ui
    assert url.endswith("/runs?workflowType=machine_learning&viewStateShareKey=optimizer-figures")
    with Chromium(tmp_path / "profile", width=1600, height=700) as page:
        page.open(url)
        page.wait_for("document.body.innerText.includes('matching runs')")
        # the runs view of the model-training mode, not the GenAI overview
        assert "/runs?" in page.js("location.hash") and "workflowType=machine_learning" in page.js(
            "location.hash"
        )
        text = page.js("document.body.innerText")
        assert "Optimizer figures" in text and "Traces 0" not in text and "No data available" not in text
        # the key columns, right after the run's name and start: the description, the key metrics, the key
        # params; no Source, no Models. Once the view is laid out (the runs and their metrics in), the page is
        # widened to see them all (the table draws only the columns in view)
        header = (
            "[...document.querySelectorAll('.ag-header-cell[col-id]')].map(c => c.getAttribute('col-id'))"
            ".filter(c => c.includes('.`'))"
        )
        first = ["attributes.`Run Name`", "attributes.`Description`", f"metrics.`{browse.METRICS[0]}`"]
        try:
            page.wait_for(f"(c => {json.dumps(first)}.every((k, i) => c[i] === k) ? c : null)({header})", 60)
        except TimeoutError:
            raise AssertionError(f"the view's columns did not come first: {page.js(header)}") from None
        page.js("document.querySelectorAll('button[aria-label=Close]').forEach(b => b.click())")  # assistant
        page.size(3600, 700)
        key = [f"metrics.`{m}`" for m in browse.METRICS] + [f"params.`{p}`" for p in browse.PARAMS]
        expected = ["attributes.`Run Name`", "attributes.`Description`", *key]
        columns = page.wait_for(f"(c => c.length >= {len(expected)} ? c : null)({header})")
        assert columns[: len(expected)] == expected, columns
        assert not {"attributes.`Source`", "attributes.`Models`"} & set(columns)
        page.size(1600, 700)
        # the parent run, collapsed, expands to its jobs with their result lines
        row = f".ag-row[row-id='{parent.info.run_id}']"
        assert parent.info.run_name in page.wait_for(f'document.querySelector("{row}").innerText')
        page.js(f"document.querySelector(\"{row} [col-id='attributes.`Run Name`'] button\").click()")
        names = [run.info.run_name for run in children]
        rows = page.wait_for(
            "(() => { const t = [...document.querySelectorAll('.ag-row')].map(r => r.innerText).join('\\n');"
            f" return {json.dumps(names)}.every(n => t.includes(n)) ? t : null; }})()"
        )
        for run in children:  # the descriptions, with units
            assert run.data.tags["mlflow.note.content"] in rows
        page.screenshot(tmp_path / "runs.png")
    assert (tmp_path / "runs.png").stat().st_size > 20_000
    if os.environ.get("DOCS_SCREENSHOTS"):
        DOCS_SHOT.write_bytes((tmp_path / "runs.png").read_bytes())
