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
        collapsed = " (collapsed)" if run.data.tags["collapsed"] == "true" else ""
        assert description == (
            f"state {m['optimizer_state_mb']:.3g} MB, peak {peak:.3g} MB, F1 {f1:.3f}{collapsed}"
        )
        assert len(description) <= 50
        # beside the exact figures (not rounded: a float32 byte count / 2**20), their display copies, rounded
        assert {k: m[k] for k in browse.DISPLAY} == browse.display_metrics(m)
        assert m["optimizer_state_mb"] == run.data.metrics["optimizer_state_bytes"] / 2**20


def test_the_display_copies_round_the_figures_and_come_first_in_a_sweeps_view():
    exact = {"eval_f1": 0.7269255251, "optimizer_state_mb": 7.716724395751953, "peak_memory_mb": 22.8962059}
    exact["train_samples_per_second"] = 5.762712
    assert browse.display_metrics(exact) == {
        "F1": 0.727,
        "Peak MB": 22.9,
        "Samples/s": 5.76,
        "State MB": 7.72,
    }
    assert exact["eval_f1"] == 0.7269255251  # the exact metrics stay as they are
    assert browse.display_metrics({"peak_memory_mb": 1234.56, "eval_f1": 1.0}) == {
        "Peak MB": 1235.0,
        "F1": 1.0,
    }
    assert browse.display_metrics({"peak_memory_mb": 0.012345}) == {"Peak MB": 0.0123}
    assert browse.display_metrics({"train_loss": 0.5}) == {}
    # the UI orders a group's metrics by code unit before it applies a view's order: the copies sort first
    assert sorted([*browse.DISPLAY, *browse.METRICS]) == [*browse.DISPLAY, *browse.METRICS]
    copies = [f"metrics.`{key}`" for key in browse.DISPLAY]
    state = browse.view_state("tags.mlflow.parentRunId = 'abc'")
    # what the job is (its method and optimizer, params it records), its figures, the tag collapsed (the
    # description's marker), then the description
    first = ["params.`method`", "params.`optim`", *copies, "tags.`collapsed`", "attributes.`Description`"]
    assert state["selectedColumns"][:8] == first
    assert state["columnOrder"][:10] == ["attributes.`Run Name`", "runDateAndNestInfo", *first]
    assert len(state["selectedColumns"]) == len(set(state["selectedColumns"]))  # method and optim once
    assert state["orderByKey"] == "metrics.`eval_macro_f1`"  # ranked by the exact figure
    assert not set(copies) & set(browse.view_state()["selectedColumns"])  # a sweep's row has no copies


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
    view = f"{LOCAL_UI}/#/experiments/3/runs?workflowType=machine_learning&viewStateShareKey=sweep-abc"
    line = browse.sweep_line("sqlite:///x.db", view)
    assert line == f"[sweep] its runs in the MLflow UI: {view} (make ui serves it)"
    served = "http://mlflow.internal:5000/#/experiments/3/runs?viewStateShareKey=sweep-abc"
    assert (
        browse.sweep_line("http://mlflow.internal:5000", served)
        == f"[sweep] its runs in the MLflow UI: {served}"
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
    """`make ui` on the sweep's store: (the two addresses it printed: every run, the latest sweep's runs; its two
    lines; its process); the whole process group is stopped
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
        first, second = proc.stdout.readline(), proc.stdout.readline()
        urls = [line.rsplit(": ", 1)[1].strip() for line in (first, second)]
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
        yield urls, (first, second), proc
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


HEADER = "[...document.querySelectorAll('.ag-header-cell[col-id]')].map(c => c.getAttribute('col-id'))"
ROWS = "[...document.querySelectorAll('.ag-row')].map(r => r.innerText).join('\\n')"


def edges(page, columns: list[str]) -> dict:
    """Where each of `columns` (header ids) starts and ends across the page, and the runs table's own right
    edge (`table`), in pixels; None for a column the grid has not drawn."""
    return page.js(
        "(() => { const at = e => [Math.round(e.getBoundingClientRect().left),"
        " Math.round(e.getBoundingClientRect().right)];"
        " const cells = [...document.querySelectorAll('.ag-header-cell[col-id]')];"
        f" const found = {json.dumps(columns)}.map(k => [k, cells.find(c => c.getAttribute('col-id') === k)]);"
        " return Object.fromEntries([['table', at(document.querySelector('.ag-root-wrapper'))[1]],"
        " ...found.map(([k, c]) => [k, c ? at(c) : null])]); })()"
    )


def shown_figures(page, run_id: str, columns: list[str]) -> dict:
    """The text of one run's cells in `columns` (header ids), as the runs table shows them (once drawn)."""
    row = f"document.querySelector(\".ag-center-cols-container .ag-row[row-id='{run_id}']\")"
    cell = "(r, k) => r.querySelector(`[col-id='${k}']`)"
    return page.wait_for(
        f"((r, cell) => Object.fromEntries({json.dumps(columns)}.map(k => [k, cell(r, k).innerText.trim()])))"
        f"({row}, {cell})"
    )


@pytest.mark.slow  # mlflow ui and headless Chromium: CI (make test-ci)
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_make_ui_opens_the_latest_sweeps_figures_on_the_first_screen(sweep, ui, tmp_path):
    _, proc, parent, children = sweep
    (every_run, latest), lines, _ = ui
    # the sweep is named by what it swept; make ui prints every run's view, then opens the latest sweep's
    assert parent.info.run_name == " ".join(SWEEP[1:])
    assert every_run.endswith("/runs?workflowType=machine_learning&viewStateShareKey=optimizer-figures")
    assert latest.endswith(
        f"/runs?workflowType=machine_learning&viewStateShareKey=sweep-{parent.info.run_id}"
    )
    assert lines[1].startswith(f"latest sweep, {parent.info.run_name} (its runs, best eval_macro_f1 first): ")
    assert f"[sweep] its runs in the MLflow UI: {LOCAL_UI}{latest[latest.index('/#/') :]}" in proc.stdout
    # a fresh browser (new profile: MLflow's Assistant panel opens on the right), 1600 px wide, no scrolling
    with Chromium(tmp_path / "profile", width=1600, height=900) as page:
        page.open(latest)
        names = [run.info.run_name for run in children]
        rows = page.wait_for(f"(t => {json.dumps(names)}.every(n => t.includes(n)) ? t : null)({ROWS})")
        for run in children:  # each job's figures, with units, in its description
            assert run.data.tags["mlflow.note.content"] in rows
        assert parent.info.run_name not in rows  # the jobs as a flat list, not folded under their sweep
        assert "workflowType=machine_learning" in page.js("location.hash") and "Traces 0" not in page.js(
            "document.body.innerText"
        )
        # the name, the method and optimizer, F1, peak, samples/s, state and whether the model collapsed whole
        # on the first screen, beside the Assistant panel a fresh browser opens
        copies = [f"metrics.`{key}`" for key in browse.DISPLAY]
        job = ["params.`method`", "params.`optim`"]
        shown = ["attributes.`Run Name`", *job, *copies, "tags.`collapsed`"]
        where = edges(page, shown)
        assert all(where[k] is not None and where[k][1] <= where["table"] for k in shown), where
        assert page.js("document.body.innerText.includes('MLflow Assistant')")
        page.screenshot(tmp_path / "sweep.png")
        # each job's method and optimizer as it recorded them; its F1, peak, samples/s and state read rounded
        # (as its description reads them), not the exact floats
        for run in children:
            m, cells = run.data.metrics, shown_figures(page, run.info.run_id, shown[1:])
            assert [cells[c] for c in job] == [run.data.params["method"], run.data.params["optim"]]
            assert cells["tags.`collapsed`"] == run.data.tags["collapsed"]
            assert {k: float(cells[f"metrics.`{k}`"]) for k in browse.DISPLAY} == browse.display_metrics(m)
            assert re.fullmatch(r"[01](\.\d{1,3})?", cells[copies[0]]), cells
            assert cells[copies[3]] != str(m["optimizer_state_mb"]), cells  # 7.72, not 7.716724395751953
            assert cells[copies[2]] != str(m["train_samples_per_second"]), cells  # 288, not 287.6127...
            for figure, c in (("peak", copies[1]), ("state", copies[3])):
                assert f"{figure} {cells[c]} MB" in run.data.tags["mlflow.note.content"].replace(",", "")
        # sortable as numbers: its header sorts the jobs by peak, largest first
        page.js("document.querySelector('[data-testid=\"sort-header-Peak MB\"]').parentElement.click()")
        page.wait_for("location.hash.includes('orderByKey=metrics.%60Peak+MB%60')")
        peaks = {r.info.run_id: browse.display_metrics(r.data.metrics)["Peak MB"] for r in children}
        assert len(set(peaks.values())) == len(peaks), peaks  # (adafactor's factored state: far less)
        order = json.dumps(sorted(peaks, key=lambda run_id: -peaks[run_id]), separators=(",", ":"))
        ids = (  # in the order shown (the grid keeps a row's element and moves it: its row-index)
            "[...document.querySelectorAll('.ag-center-cols-container .ag-row')].sort((a, b) =>"
            " a.getAttribute('row-index') - b.getAttribute('row-index')).map(r => r.getAttribute('row-id'))"
        )
        page.wait_for(f"JSON.stringify({ids}) === {json.dumps(order)}")
        # every sweep, a row each: its name, and its best figures in the key columns (not "-")
        page.open(every_run)
        # (the grid draws a row in parts: the pinned name and start, then the scrolling cells)
        row = f"[...document.querySelectorAll(\".ag-row[row-id='{parent.info.run_id}']\")]"
        text = page.wait_for(
            f"(t => t.includes('lowest peak') ? t : null)({row}.map(r => r.innerText).join(' '))"
        )
        assert parent.info.run_name[:30] in text and parent.data.tags["mlflow.note.content"][:40] in text
        f1 = page.js(
            f"{row}.map(r => r.querySelector(\"[col-id='metrics.`eval_f1`']\")).find(c => c).innerText"
        )
        learned = [r for r in children if r.data.tags["collapsed"] == "false"]
        assert (f1 != "-") == bool(learned), f1
        # the key columns, right after the run's name and start: the description, the key metrics, the key
        # params; no Source, no Models (the page widened to draw them all: the table draws only those in view)
        page.js("document.querySelectorAll('button[aria-label=Close]').forEach(b => b.click())")  # assistant
        page.size(3600, 700)
        key = [f"metrics.`{m}`" for m in browse.METRICS] + [f"params.`{p}`" for p in browse.PARAMS]
        expected = ["attributes.`Run Name`", "attributes.`Description`", *key]
        columns = page.wait_for(f"(c => c.length >= {len(expected) + 2} ? c : null)({HEADER})")
        columns = [c for c in columns if ".`" in c]
        assert columns[: len(expected)] == expected, columns
        assert not {"attributes.`Source`", "attributes.`Models`"} & set(columns)
        # closed once, the Assistant panel stays closed (the browser keeps it: docs/mlflow.md): the table
        # spans the page
        page.size(1600, 900)
        page.js("window.before_reload = true; location.reload()")
        page.wait_for(
            f"!window.before_reload && {row}.length > 0 && !!document.querySelector('.ag-root-wrapper')"
        )
        assert page.js("localStorage.getItem('mlflow.assistant.panelOpen_v1')") == "false"
        assert edges(page, [])["table"] > 1400
    assert (tmp_path / "sweep.png").stat().st_size > 20_000
    if os.environ.get("DOCS_SCREENSHOTS"):
        DOCS_SHOT.write_bytes((tmp_path / "sweep.png").read_bytes())


def test_a_server_ends_when_the_process_that_supervises_it_is_killed(tmp_path):
    """SIGKILL to the process serving a store (make ui's) leaves it no time to end the server's group: the
    server, started with PR_SET_PDEATHSIG, gets SIGTERM from the kernel and ends too."""
    server = tmp_path / "server.pid"
    # a stand-in for the server: it writes its pid and sleeps until told to stop
    command = [
        sys.executable,
        "-c",
        f"import os, time; open({str(server)!r}, 'w').write(str(os.getpid())); time.sleep(60)",
    ]
    script = f"from pipeline import browse; browse.supervise({command!r}, {{}}, 'http://127.0.0.1:9', lambda: None)"
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (server.exists() and server.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        pid = int(server.read_text())
        proc.kill()
        proc.wait()
        while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{pid}"), "the server outlived its supervisor"
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if os.path.exists(f"/proc/{proc.pid}") else None
