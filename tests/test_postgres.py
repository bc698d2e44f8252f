"""The team server on a real PostgreSQL (tests/services.py): a sweep through a `make server` whose store is a
PostgreSQL database loses nothing when the server restarts mid-sweep, and 8 clients logging at once lose no run
and no metric row (the sample of `make bench-server`). The auth checks on PostgreSQL are tests/test_store.py's
`team_server` tests, parametrized over both stores."""

import os
import sys
import time

import pytest
from mlflow import MlflowClient

from bench import server_load
from tests import services
from tests.conftest import ROOT, TINY, cli_env
from tests.test_store import SHORT_RETRIES

ADMIN = {"MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": services.ADMIN_PASSWORD}


@pytest.mark.slow  # two tiny jobs and two server starts (131 s on 2 cores)
def test_a_sweep_into_postgres_loses_nothing_when_the_server_restarts_mid_sweep(postgres, tmp_path):
    import subprocess

    stores = (postgres.create_database("restart_runs"), postgres.create_database("restart_auth"))
    server = services.start_team_server(tmp_path / "server", *stores, workers=1)
    out = tmp_path / "sweep"
    try:
        env = {
            **cli_env(),
            **SHORT_RETRIES,
            **ADMIN,
        }
        cmd = [sys.executable, "-m", "pipeline", "-m", "seed=1,2", *TINY, "tracking=server"]
        cmd += [f"tracking.uri={server.uri}", f"outputs_dir={out}"]
        with open(tmp_path / "sweep.out", "w") as stdout, open(tmp_path / "sweep.err", "w") as stderr:
            sweep = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=stdout, stderr=stderr)
            deadline = time.time() + 600
            while not list(out.glob("multirun/*/0/config.yaml")):  # the first job's run is open: it trains
                assert sweep.poll() is None and time.time() < deadline, (tmp_path / "sweep.err").read_text()
                time.sleep(0.2)
            server.stop()  # down while the first job ends: its result waits in its journal entry
            while not list(out.glob("multirun/*/0/unrecorded.json")):
                assert sweep.poll() is None and time.time() < deadline, (tmp_path / "sweep.err").read_text()
                time.sleep(0.2)
            server = services.start_team_server(  # as before it stopped: one worker, the same port
                tmp_path / "server", *stores, port=int(server.uri.split(":")[-1]), workers=1
            )
            code = sweep.wait(timeout=900)
        err = (tmp_path / "sweep.err").read_text()
        assert "not recorded: the store does not answer" in err, err[-3000:]  # the outage was real
        assert "Traceback" not in err
        # back before the sweep's end: its end recorded what waited (exit 0); else what waits is recorded by
        # `python -m pipeline.record`, as the sweep's last line says
        assert code in (0, 1), err[-3000:]
        if code == 1:
            (sweep_dir,) = out.glob("multirun/*")
            assert f"`python -m pipeline.record {sweep_dir}` records them" in err, err[-3000:]
            record = [sys.executable, "-m", "pipeline.record", str(sweep_dir)]
            done = subprocess.run(record, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stderr[-3000:]
        assert not list(out.glob("multirun/*/*/unrecorded.json"))  # nothing waits
        os.environ.update(ADMIN)
        client = MlflowClient(server.uri)
        (experiment,) = [e for e in client.search_experiments() if e.name == "optimizer-sweep"]
        runs = client.search_runs([experiment.experiment_id])
        parents = [r for r in runs if r.data.tags.get("kind") == "sweep"]
        children = [r for r in runs if r not in parents]
        assert len(parents) == 1 and parents[0].info.status == "FINISHED"
        assert sorted(r.data.params["seed"] for r in children) == ["1", "2"]  # each once
        assert {r.info.status for r in children} == {"FINISHED"}
        for run in children:
            assert run.data.tags["mlflow.parentRunId"] == parents[0].info.run_id
            assert [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")] == [1, 2, 3]
            assert "eval_f1" in run.data.metrics
        assert not client.search_runs(["0"])  # nothing in Default
    finally:
        for key in ADMIN:
            os.environ.pop(key, None)
        server.stop()


@pytest.mark.slow
@pytest.mark.cluster  # two servers and 8 client processes each (~2 min on 2 idle cores)
@pytest.mark.timeout(1800)  # over 15 min on this 2-core machine at load average 30
def test_eight_clients_at_once_lose_nothing_on_sqlite_and_postgres(postgres, tmp_path):
    loads = server_load.run(["sqlite", "postgres"], 8, tmp_path, pg=postgres)
    for load in loads:
        assert load.runs_found == load.runs_finished == 8, load
        assert load.metric_rows_lost == 0 and load.client_errors == 0, load
        assert load.params_lost == load.tags_lost == load.artifacts_lost == 0, load
