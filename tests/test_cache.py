"""Work done once per sweep (pipeline.cache): the data splits and the simulated step are made once per key and
made anew when what determines them changes, never reused from other inputs."""

import contextlib
import json
import os
import sqlite3

import pandas as pd
import pytest
import torch
from conftest import compose_cfg

from pipeline import data, measurements, models, optimizers, plan_step

ROWS = {"text": [f"review number {i}" for i in range(40)], "label": ["neg", "pos"] * 20}


def entries(folder) -> list:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


@pytest.fixture(autouse=True)
def own_cache(monkeypatch):
    """The cache under each test's outputs folder (not the suite's shared one)."""
    monkeypatch.delenv("PIPELINE_CACHE_DIR", raising=False)


def test_splits_are_tokenized_once_and_made_again_when_their_file_changes(tmp_path):
    train, evaluation = tmp_path / "train.csv", tmp_path / "eval.csv"
    pd.DataFrame(ROWS).to_csv(train, index=False)
    pd.DataFrame(ROWS).iloc[:6].to_csv(evaluation, index=False)
    files = (
        "data=csv",
        f"data.train_file={train}",
        f"data.eval_file={evaluation}",
        f"outputs_dir={tmp_path}",
    )
    cfg = compose_cfg(*files)
    tokenizer, vocab = models.tokenizer_and_vocabulary(cfg.model)
    fresh = data.load_splits(cfg.data)
    made = data.tokenize(fresh, tokenizer, cfg.train.max_length, vocab)
    _, first, _ = data.prepare(cfg)
    _, again, _ = data.prepare(cfg)
    cached = tmp_path / "cache" / "splits"
    assert len(entries(cached)) == 1
    for split in ("train", "eval", "val"):  # as tokenized here, from the cache or not
        assert (
            getattr(first, split).to_dict()
            == getattr(again, split).to_dict()
            == getattr(made, split).to_dict()
        )
    assert first.label_names == again.label_names == ["neg", "pos"]
    assert again.inputs == data.dataset_inputs(fresh, cfg.data)
    # an edited file (more rows) is another entry: the splits are read from it again
    pd.DataFrame({k: v * 2 for k, v in ROWS.items()}).to_csv(train, index=False)
    os.utime(train, ns=(train.stat().st_atime_ns, train.stat().st_mtime_ns + 10**9))
    _, edited, _ = data.prepare(cfg)
    assert len(entries(cached)) == 2
    assert len(edited.train) + len(edited.val) == 80
    # another config (a validation split of its own, another length) is another entry too
    data.prepare(compose_cfg(*files, "data.val_fraction=0.2"))
    data.prepare(compose_cfg(*files, "train.max_length=8"))
    assert len(entries(cached)) == 4


def test_a_cached_dataset_is_built_once_and_read_back_as_built(tmp_path):
    """cache.cached_dataset: one call, one answer; the build runs on a miss only, its None parts are left out,
    and the progress bars are as they were before."""
    import datasets

    from pipeline import cache

    built = []

    def build():
        built.append(1)
        return {"train": datasets.Dataset.from_dict(ROWS), "val": None}, {"names": ["neg", "pos"]}

    datasets.enable_progress_bars()
    first = cache.cached_dataset(tmp_path / "kept", ["inputs", 1], build)
    again = cache.cached_dataset(tmp_path / "kept", ["inputs", 1], build)
    assert built == [1] and not datasets.utils.are_progress_bars_disabled()
    assert first[1] == again[1] == {"names": ["neg", "pos"]}
    assert list(first[0]) == list(again[0]) == ["train"]
    assert again[0]["train"].to_dict() == ROWS
    assert len(list((tmp_path / "kept").iterdir())) == 1  # no half-written folder left beside it
    cache.cached_dataset(tmp_path / "kept", ["other inputs"], build)
    assert built == [1, 1] and len(entries(tmp_path / "kept")) == 2


def simulated(tmp_path, *overrides, batch=(16, 32)) -> dict:
    cfg = compose_cfg("model=tiny", f"outputs_dir={tmp_path}", *overrides)
    model = models.load_model(cfg.model, num_labels=2)
    spec = optimizers.spec_for(cfg.optim)
    return measurements.simulated_step(cfg, spec, model.config, batch, False, ("input_ids", "attention_mask"))


def test_the_seeds_of_a_point_simulate_its_step_once(tmp_path, monkeypatch):
    # this process's own memo starts empty (a test file run before this one in the same worker fills it)
    monkeypatch.setattr(plan_step, "_PROFILES", {})
    monkeypatch.setattr(plan_step, "_OPTIMIZER_STEP", {})
    torch.manual_seed(0)
    first = simulated(tmp_path, "seed=0")
    cached = tmp_path / "cache" / "plan"
    # the step's figures, its forward/backward pass (at its own batch size only), its optimizer step
    assert len(entries(cached)) == 3
    assert simulated(tmp_path, "seed=1", "train.max_steps=7") == first  # same step: the same entries
    assert len(entries(cached)) == 3
    # what the entry holds is what the plan computes for that step
    cfg = compose_cfg("model=tiny", f"outputs_dir={tmp_path}")
    model = models.load_model(cfg.model, num_labels=2)
    found = plan_step.simulate(
        model.config, optimizers.spec_for(cfg.optim), cfg, 16, 32, names=("input_ids", "attention_mask")
    )
    expected = {
        "peak": found["peak"],
        "activations": found["parts"]["activations"],
        "method": found["method"],
    }
    assert {key: first[key] for key in expected} == json.loads(json.dumps(expected))
    assert first["rank_peaks"] == [first["peak"]]  # one rank: its peak is the step's
    # another batch size of the same length, in a process that has simulated nothing: the optimizer step is
    # read back, the pass simulated once, at that batch size; together they give what simulating them gives
    traced = []
    with monkeypatch.context() as patch:
        patch.setattr(plan_step, "_PROFILES", {})
        patch.setattr(plan_step, "_OPTIMIZER_STEP", {})
        trace = plan_step._trace
        patch.setattr(plan_step, "_trace", lambda *args, **kw: traced.append(args[3]) or trace(*args, **kw))
        patch.setattr(plan_step, "optimizer_step", None)  # not simulated: a call would fail
        read_back = simulated(tmp_path, batch=(5, 32))
    assert traced == [5]
    assert len(entries(cached)) == 5  # its step's figures and its pass
    fresh = plan_step.simulate(
        model.config, optimizers.spec_for(cfg.optim), cfg, 5, 32, names=("input_ids", "attention_mask")
    )
    assert read_back["peak"] == fresh["peak"] and read_back["activations"] == fresh["parts"]["activations"]
    # (this process's pass of that length, at batch 16 only, fitted its lines for batch 5 from one more pass
    # at batch 2: both kept, for any batch size of that length)
    assert len(entries(cached)) == 7
    # another optimizer is another step and optimizer step; another precision another pass too
    adafactor = simulated(tmp_path, "optim=adafactor")
    assert len(entries(cached)) == 9
    simulated(tmp_path, "train.precision=bf16")
    assert len(entries(cached)) == 12
    assert adafactor["peak"] < first["peak"]


def test_a_class_of_ones_own_is_simulated_again_once_its_file_is_edited(tmp_path, monkeypatch):
    """optim.target names a class in a file on PYTHONPATH: the plan's entries are keyed by that file as it is,
    so an edited optimizer is never planned with its old code."""
    source = tmp_path / "mine" / "my_sgd.py"
    source.parent.mkdir()
    source.write_text("import torch\n\nclass MySGD(torch.optim.SGD):\n    pass\n")
    monkeypatch.syspath_prepend(str(source.parent))
    mine = ["optim=custom", "optim.target=my_sgd.MySGD"]
    assert optimizers.source_stamp(compose_cfg(*mine)) == [[str(source), source.stat().st_size,
                                                              source.stat().st_mtime_ns]]  # fmt: skip
    assert optimizers.source_stamp(compose_cfg("optim=adamw")) == []
    monkeypatch.setattr(plan_step, "_PROFILES", {})  # (a fresh process: nothing simulated in memory)
    monkeypatch.setattr(plan_step, "_OPTIMIZER_STEP", {})
    simulated(tmp_path, *mine)
    cached = tmp_path / "cache" / "plan"
    assert len(entries(cached)) == 3
    simulated(tmp_path, *mine)  # the same file: the same entries
    assert len(entries(cached)) == 3
    source.write_text(source.read_text() + "\n# edited\n")
    monkeypatch.setattr(plan_step, "_OPTIMIZER_STEP", {})  # (a new process: nothing simulated in memory)
    simulated(tmp_path, *mine)
    assert len(entries(cached)) == 5  # a new step and optimizer step; the pass does not depend on it


def test_an_edit_outside_the_simulations_code_leaves_the_plan_cache_valid(tmp_path, monkeypatch):
    """The plan's entries are keyed by the source of the modules the simulated step runs
    (measurements.PLAN_SOURCES), not by the whole package: after an edit to the report (the package's digest
    changes) the step is read back, not simulated; an edit to the plan's own code makes another key."""
    import shutil

    from pipeline import cache

    monkeypatch.setattr(plan_step, "_PROFILES", {})
    monkeypatch.setattr(plan_step, "_OPTIMIZER_STEP", {})
    first = simulated(tmp_path)
    cached = tmp_path / "cache" / "plan"
    assert len(entries(cached)) == 3
    # a copy of the package with the report edited, then with the plan edited
    copy = tmp_path / "pipeline"
    shutil.copytree(cache.PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(cache, "PACKAGE", copy)
    (copy / "report" / "render.py").write_text((copy / "report" / "render.py").read_text() + "\n# edited\n")
    cache.code_digest.cache_clear()
    cache.source_digest.cache_clear()
    monkeypatch.setattr(plan_step, "_PROFILES", {})  # (a new process: nothing simulated in memory)
    monkeypatch.setattr(plan_step, "_OPTIMIZER_STEP", {})
    monkeypatch.setattr(plan_step, "_trace", None)  # read back, not simulated: a call would fail
    assert simulated(tmp_path) == first
    assert len(entries(cached)) == 3
    before = cache.source_digest(*measurements.PLAN_SOURCES)
    (copy / "plan_step.py").write_text((copy / "plan_step.py").read_text() + "\n# edited\n")
    cache.source_digest.cache_clear()
    assert cache.source_digest(*measurements.PLAN_SOURCES) != before
    monkeypatch.undo()
    cache.code_digest.cache_clear()
    cache.source_digest.cache_clear()


def schema(db) -> dict:
    """Each table's and index's statement, as the set of its lines (MLflow's migrations write a table's
    constraints in no fixed order)."""
    with contextlib.closing(sqlite3.connect(db)) as c:
        found = c.execute("SELECT type, name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'")
        return {
            (kind, name): sorted(line.strip().rstrip(",") for line in (sql or "").splitlines())
            for kind, name, sql in found
        }


def rows(db, query: str) -> list:
    with contextlib.closing(sqlite3.connect(db)) as c:
        return c.execute(query).fetchall()


def test_a_new_sqlite_store_is_a_copy_of_the_schema_mlflow_makes(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from pipeline.tracking import Tracker

    own = tmp_path / "mlflow-made.db"
    MlflowClient(f"sqlite:///{own}").search_experiments()  # MLflow creates and migrates it itself
    stores = [tmp_path / name / "mlflow.db" for name in ("a", "b")]  # two outputs folders, one cache
    monkeypatch.setenv("PIPELINE_CACHE_DIR", str(tmp_path / "cache"))
    for db in stores:
        tracker = Tracker(f"sqlite:///{db}", db.parent)
        tracker.experiment_id("optimizer-sweep")
    (empty,) = (tmp_path / "cache" / "mlflow").iterdir()  # one empty store, copied twice
    assert rows(empty, "SELECT * FROM experiments") == []
    for db in stores:
        assert schema(db) == schema(own)
        assert rows(db, "SELECT * FROM alembic_version") == rows(own, "SELECT * FROM alembic_version")
        assert rows(db, "SELECT * FROM workspaces") == rows(own, "SELECT * FROM workspaces")
        # the Default experiment MLflow adds on opening, and ours with its artifacts beside the store
        assert rows(db, "SELECT experiment_id, name FROM experiments") == [
            (0, "Default"),
            (1, "optimizer-sweep"),
        ]
        (location,) = rows(db, "SELECT artifact_location FROM experiments WHERE experiment_id = 1")[0]
        assert location == (db.parent / "mlartifacts").as_uri()
