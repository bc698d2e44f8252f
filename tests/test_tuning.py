"""A fair quality comparison: each optimizer's reference rate and `train.lr_scale`, three splits (train,
validation carved out of it, held-out test), quality figures a collapsed model cannot game, periodic
validation on both backends, the task function's value, and the `+protocol=tune_lr` preset."""

import re

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from sklearn.metrics import f1_score

from pipeline import learning_rate
from pipeline.backends import classification_metrics
from pipeline.runner import config_hash
from tests.conftest import CONF, TINY, compose_cfg, run_cli, store, sweep_runs


def test_validation_and_test_splits_never_overlap_each_other_or_train():
    from pipeline import data

    splits = data.load_splits(compose_cfg().data)
    train, val, test = (set(ds["text"]) for ds in (splits.train, splits.val, splits.eval))
    assert len(val) == 500 and len(test) == 1000  # data.max_val_samples, data.max_eval_samples
    assert not train & val and not train & test and not val & test
    # stratified: the validation split keeps the training data's class shares
    share = lambda ds: np.mean(ds["label"])  # noqa: E731
    assert share(splits.val) == pytest.approx(share(splits.train), abs=0.03)
    again = data.load_splits(compose_cfg().data)  # fixed by data.split_seed
    assert again.val["text"] == splits.val["text"]


def test_quality_figures_do_not_flatter_a_collapsed_model():
    """A model that answers "fresh" for every review of a 57/43 split: binary F1 0.73, macro-F1 0.36."""
    labels = np.array([1] * 57 + [0] * 43)
    collapsed = classification_metrics(np.tile([0.0, 1.0], (100, 1)), labels, 2)
    assert collapsed["f1"] == pytest.approx(f1_score(labels, np.ones(100)), abs=1e-12)
    assert collapsed["f1"] == pytest.approx(0.726, abs=1e-3)
    assert collapsed["macro_f1"] == pytest.approx(f1_score(labels, np.ones(100), average="macro"), abs=1e-12)
    assert collapsed["macro_f1"] == pytest.approx(0.363, abs=1e-3)
    assert collapsed["top_class_share"] == 1.0 and collapsed["majority_accuracy"] == 0.57
    rng = np.random.default_rng(0)  # any predictions, three classes: macro-F1 as scikit-learn computes it
    logits, labels = rng.normal(size=(200, 3)), rng.integers(0, 3, 200)
    figures = classification_metrics(logits, labels, 3)
    assert figures["macro_f1"] == pytest.approx(
        f1_score(labels, logits.argmax(1), average="macro"), abs=1e-12
    )
    assert figures["top_class_share"] == np.bincount(logits.argmax(1)).max() / 200


def test_each_optimizer_trains_at_its_reference_rate_times_lr_scale():
    sgd = compose_cfg("optim=sgd")
    assert sgd.train.lr == sgd.optim.lr and learning_rate(sgd) == sgd.optim.lr
    scaled = compose_cfg("optim=sgd", "train.lr_scale=3")
    assert learning_rate(scaled) == pytest.approx(3 * sgd.optim.lr)
    assert learning_rate(compose_cfg("optim=sgd", "train.lr=1e-3", "train.lr_scale=0.1")) == pytest.approx(
        1e-4
    )
    # the rate as a user writes it, not the float product (5e-5 * 3.16 = 0.00015800000000000002)
    assert str(learning_rate(compose_cfg("train.lr=5e-5", "train.lr_scale=3.16"))) == "0.000158"
    # a point is its resolved config: another rate is another point; lr_scale=1 is the point without it
    assert config_hash(scaled) != config_hash(sgd)
    assert config_hash(compose_cfg("optim=sgd", "train.lr_scale=1")) == config_hash(sgd)


def test_the_tune_lr_preset_declares_its_grid_seeds_and_budget():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["+protocol=tune_lr"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    scales = [float(v) for v in params["train.lr_scale"].split(",")]
    assert len(scales) == 5 and scales[0] == 0.1 and scales[-1] == 10  # log-spaced over two decades
    assert np.allclose(np.diff(np.log10(scales)), 0.5, atol=0.01)
    assert params.seed.split(",") == ["0", "1", "2"]
    assert cfg.train.max_steps == 100 and cfg.eval.every_steps == 20


@pytest.fixture(scope="module")
def tuning_sweep(tmp_path_factory):
    """A small real tuning sweep: two rates x two seeds, validation every 2 of 4 steps."""
    tmp = tmp_path_factory.mktemp("tuning")
    args = ["-m", "model=tiny", "optim=sgd", "train.lr_scale=1,30", "seed=0,1", "backend=accelerator"]
    args += ["train.max_steps=4", "eval.every_steps=2", "data.max_train_samples=128"]
    args += ["data.max_val_samples=64", "data.max_eval_samples=64"]
    proc = run_cli(tmp, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, proc


@pytest.mark.slow  # the 8-point tuning sweep: CI (make test-ci)
def test_the_task_function_returns_the_validation_metric(tuning_sweep):
    tmp, proc = tuning_sweep
    returned = sorted(float(v) for v in re.findall(r"returns val_macro_f1=([\d.]+)", proc.stdout))
    runs = sweep_runs(tmp)[1]
    assert len(returned) == len(runs) == 4
    assert returned == pytest.approx(sorted(r.data.metrics["val_macro_f1"] for r in runs), abs=1e-6)


@pytest.mark.slow  # the 8-point tuning sweep: CI (make test-ci)
def test_validation_series_rates_and_collapse_are_recorded(tuning_sweep):
    tmp, _ = tuning_sweep
    client = store(tmp)
    for run in sweep_runs(tmp)[1]:
        params, metrics = run.data.params, run.data.metrics
        reference = compose_cfg(f"optim={params['optim']}").optim.lr
        assert float(params["lr"]) == pytest.approx(reference * float(params["lr_scale"]))
        history = client.get_metric_history(run.info.run_id, "val_macro_f1")
        assert sorted(m.step for m in history) == [2, 4]  # the periodic pass, then the final one
        assert max(history, key=lambda m: m.step).value == metrics["val_macro_f1"]
        assert "eval_macro_f1" in metrics and 0.5 <= metrics["val_majority_accuracy"] <= 1
        collapsed = max(metrics["val_top_class_share"], metrics["eval_top_class_share"]) >= 0.95
        assert run.data.tags["collapsed"] == str(collapsed).lower()


@pytest.mark.slow  # the 8-point tuning sweep: CI (make test-ci)
def test_the_report_picks_each_optimizers_best_validation_rate_and_reports_its_test_runs(tuning_sweep):
    """The tuned table against the sweep's MLflow runs, computed here independently: per optimizer, the rate
    with the best mean val_macro_f1 over seeds among rates without a collapsed run (none where all collapsed), and
    the test macro-F1 of that rate's runs."""
    import pandas as pd

    tmp, _ = tuning_sweep
    parent, runs = sweep_runs(tmp)
    from pipeline import report

    out, _ = report.build(f"sqlite:///{tmp / 'mlflow.db'}", [parent.info.run_id], root=tmp / "report")
    tuned = pd.read_csv(out / "tuned.csv").set_index("optim")
    frame = pd.DataFrame(
        {
            "optim": r.data.params["optim"],
            "lr": float(r.data.params["lr"]),
            "val": r.data.metrics["val_macro_f1"],
            "test": r.data.metrics["eval_macro_f1"],
            "collapsed": r.data.tags["collapsed"] == "true",
        }
        for r in runs
    )
    for optim, by_optim in frame.groupby("optim"):
        per_rate = by_optim.groupby("lr").agg(val=("val", "mean"), collapsed=("collapsed", "any"))
        eligible = per_rate[~per_rate.collapsed]
        if eligible.empty:  # every rate collapsed: no best is named
            assert pd.isna(tuned.loc[optim, "best lr"]) and not tuned.loc[optim, "learned"]
            continue
        best = eligible.val.idxmax()
        assert tuned.loc[optim, "best lr"] == pytest.approx(best)
        at_best = by_optim[by_optim.lr == best]
        assert tuned.loc[optim, "test macro-F1 [0-1]"] == pytest.approx(at_best.test.mean())
        assert tuned.loc[optim, "n [seeds]"] == len(at_best) == 2
    assert (out / "val_vs_lr.png").exists()
    # the curves of the best rates: none where no rate learned
    assert (out / "val_curves.png").exists() == bool(tuned["learned"].any())


@pytest.mark.slow  # the 8-point tuning sweep: CI (make test-ci)
def test_collapsed_runs_are_marked_in_the_console_and_never_chosen(tuning_sweep):
    """The sweep's own console: a comparison row whose runs collapsed reads `sgd (collapsed ...)`, and where
    every rate collapsed the tuned table names no best rate; both against the runs' tags."""
    tmp, proc = tuning_sweep
    by_rate = {}
    for r in sweep_runs(tmp)[1]:
        by_rate.setdefault(float(r.data.params["lr"]), []).append(r.data.tags["collapsed"] == "true")
    expected = sorted(
        "sgd (collapsed)" if all(flags) else f"sgd (collapsed {sum(flags)} of {len(flags)})"
        for flags in by_rate.values()
        if any(flags)
    )
    out = proc.stdout
    assert sorted(re.findall(r"sgd \(collapsed(?: \d+ of \d+)?\)", out)) == expected, out[-3000:]
    nothing = all(all(flags) for flags in by_rate.values())
    assert ("no rate learned at this budget" in out) == nothing, out[-3000:]
    note = "(collapsed): the run's predictions fell (nearly) all in one class"
    assert (note in out) == bool(expected)


@pytest.mark.slow  # a 3-trial Optuna sweep of the tiny model: about 15 s
def test_an_optuna_learning_rate_search_of_lora_runs_finishes_warm_and_builds_its_report(tmp_path):
    """Hydra's Optuna sweeper (the `optuna` extra make install installs) over a log-uniform learning rate, LoRA
    runs only: 3 trials, each the validation figure the task function returns, jobs started warm, and the
    sweep's report built with its own baseline (no full-AdamW run to compare against)."""
    proc = run_cli(
        tmp_path,
        "-m",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.direction=maximize",
        "train.lr=tag(log,interval(1e-4,1e-1))",
        "peft=lora",
        *TINY,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(re.findall(r"returns val_macro_f1=([\d.]+)", proc.stdout)) == 3
    runs = sweep_runs(tmp_path)[1]
    assert len(runs) == 3 and {r.info.status for r in runs} == {"FINISHED"}
    assert len({r.data.params["lr"] for r in runs}) == 3
    assert [r.data.tags["job_start"] for r in runs] == ["warm"] * 3
    assert "[sweep] report: " in proc.stdout and "report not built" not in proc.stdout + proc.stderr
