"""The report's tuned section on constructed job tables: the rate chosen on the validation split, the test
figures at that rate, collapsed runs, the edge flag, steps to target and Welch's test against the baseline."""

import math
import statistics

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from pipeline import report
from pipeline.report.columns import UNTUNED_NOTE
from pipeline.report.render import console_text, write_report
from pipeline.report.runs import job_table
from pipeline.report.tuned import (
    mean_curves,
    rate_note,
    rate_table,
    select_best,
    steps_to_target,
    tuned_section,
    welch,
)

POINT = {"model": "tiny", "batch_size": 8, "backend": "trainer", "precision": "fp32"}
KEYS = [*POINT, "optim"]


def job(optim, lr, seed, val, test=None, collapsed=False, **metrics):
    """One finished job as job_table gives it; the test figures default to the validation one less 0.05."""
    test = val - 0.05 if test is None else test
    return {
        "run_id": f"{optim}-{lr:g}-{seed}",
        "status": "FINISHED",
        **POINT,
        "optim": optim,
        "lr": lr,
        "seed": seed,
        "collapsed": collapsed,
        "val_macro_f1": val,
        "val_f1": val,
        "eval_macro_f1": test,
        "eval_f1": test + 0.01,
        "optimizer_state_mb": 100.0 if optim == "adamw" else 2.0,
        "peak_memory_mb": 500.0 + seed,
        **metrics,
    }


def jobs_of(grid: dict) -> pd.DataFrame:
    """{(optim, lr): [validation value per seed]} -> jobs, test = validation - 0.05."""
    return pd.DataFrame(
        [job(optim, lr, seed, val) for (optim, lr), vals in grid.items() for seed, val in enumerate(vals)]
    )


def row(table: pd.DataFrame, optim: str) -> pd.Series:
    return table.set_index("optim").loc[optim]


def test_the_best_rate_has_the_highest_mean_validation_value_and_the_test_figures_are_its_runs():
    # 1e-4 has the single highest seed (0.95), 3e-4 the highest mean: the mean decides
    jobs = jobs_of(
        {
            ("adamw", 1e-5): [0.60, 0.62, 0.61],
            ("adamw", 3e-5): [0.80, 0.82, 0.78],
            ("adamw", 1e-4): [0.95, 0.50, 0.55],
            ("lion", 1e-5): [0.70, 0.71, 0.69],
            ("lion", 3e-5): [0.65, 0.66, 0.64],
        }
    )
    jobs.loc[jobs.run_id == "adamw-3e-05-2", "eval_macro_f1"] = 0.5  # a test figure unlike its validation one
    table = tuned_section(jobs).table
    assert list(table.optim) == ["adamw", "lion"]  # baseline first
    adamw = row(table, "adamw")
    assert adamw["best lr"] == 3e-5 and adamw["rates tried"] == "1e-05, 3e-05, 0.0001"
    assert adamw["n [seeds]"] == 3
    assert adamw["val macro-F1 [0-1]"] == pytest.approx(statistics.mean([0.80, 0.82, 0.78]))
    at_best = jobs[(jobs.optim == "adamw") & (jobs.lr == 3e-5)]
    for column, metric in (("test macro-F1 [0-1]", "eval_macro_f1"), ("test F1 [0-1]", "eval_f1")):
        assert adamw[column] == pytest.approx(statistics.mean(at_best[metric]))
        assert adamw[f"{column} std"] == pytest.approx(statistics.stdev(at_best[metric]))
    assert adamw["peak [MB]"] == pytest.approx(501.0) and adamw["state [MB]"] == 100.0
    assert row(table, "lion")["best lr"] == 1e-5


def test_another_quality_metric_picks_the_rate_and_is_compared():
    jobs = jobs_of({("adamw", 1e-5): [0.6, 0.6], ("adamw", 1e-4): [0.7, 0.7]})
    jobs["val_accuracy"] = np.where(jobs.lr == 1e-5, 0.9, 0.8)  # accuracy prefers the other rate
    jobs["eval_accuracy"] = 0.85
    table = tuned_section(jobs, metric="accuracy").table
    assert row(table, "adamw")["best lr"] == 1e-5
    assert {"val accuracy [0-1]", "test accuracy [0-1]", "Δ test accuracy [0-1]"} <= set(table.columns)
    assert {"test macro-F1 [0-1]", "test F1 [0-1]"} <= set(table.columns)  # always reported


def test_a_rate_with_a_collapsed_run_is_not_chosen_while_another_has_none():
    jobs = jobs_of(
        {("adamw", 1e-5): [0.60, 0.62], ("adamw", 1e-4): [0.90, 0.91], ("adamw", 1e-3): [0.5, 0.5]}
    )
    jobs.loc[jobs.run_id == "adamw-0.0001-1", "collapsed"] = True
    adamw = row(tuned_section(jobs).table, "adamw")
    assert adamw["best lr"] == 1e-5  # not 1e-4, the higher mean, where one run collapsed
    assert adamw["collapsed [runs]"] == 1
    # every rate with a collapsed run: no best, no figures, no target taken from it
    jobs["collapsed"] = True
    jobs = pd.concat([jobs, jobs_of({("adafactor", 1e-3): [0.7, 0.72]})], ignore_index=True)
    jobs["collapsed"] = jobs.collapsed.astype(bool)
    tuned = tuned_section(jobs)
    adamw = row(tuned.table, "adamw")
    assert pd.isna(adamw["best lr"]) and adamw["collapsed [runs]"] == 6 and not adamw["learned"]
    assert pd.isna(adamw["test macro-F1 [0-1]"]) and adamw["n [seeds]"] == 0
    # the target: 0.97 x the best mean of the rates that learned (adafactor's 0.71), not adamw's 0.905
    assert row(tuned.table, "adafactor")["target [0-1]"] == pytest.approx(0.97 * 0.71)
    shown = report.format_tuned(tuned.table).set_index("optimizer")
    assert shown.loc["adamw", "best lr"] == "no rate learned at this budget"
    assert shown.loc["adamw", "steps to target [steps]"] == ""


def test_collapsed_is_read_from_the_tag_as_a_bool_and_empty_where_not_logged():
    raw = pd.DataFrame(
        {
            "run_id": ["a", "b", "c"],
            "status": "FINISHED",
            "start_time": pd.Timestamp("2026-01-01"),
            "end_time": pd.Timestamp("2026-01-01"),
            "tags.mlflow.runName": ["a", "b", "c"],
            "tags.collapsed": ["true", "false", None],
            "params.lr": ["1e-05", "0.0001", "0.001"],
            "metrics.val_macro_f1": [0.5, 0.6, 0.7],
        }
    )
    jobs = job_table(raw)
    assert jobs.collapsed.tolist()[:2] == [True, False] and pd.isna(jobs.collapsed[2])
    assert jobs.lr.tolist() == [1e-5, 1e-4, 1e-3]
    assert rate_table(jobs.assign(optim="adamw", **POINT)).collapsed.tolist() == [1, 0, 0]


@pytest.mark.parametrize(
    ("values", "edge"),
    [
        ([0.9, 0.5, 0.4], "lowest"),  # widen the grid below
        ([0.4, 0.9, 0.5], ""),
        ([0.4, 0.5, 0.9], "highest"),  # widen the grid above
    ],
)
def test_the_edge_flag_says_when_the_best_rate_is_the_lowest_or_highest_tried(values, edge):
    jobs = jobs_of(
        {("adamw", lr): [value, value] for lr, value in zip([1e-5, 1e-4, 1e-3], values, strict=True)}
    )
    assert row(tuned_section(jobs).table, "adamw")["edge"] == edge


def test_one_rate_is_never_at_an_edge():
    jobs = jobs_of({("adamw", 1e-5): [0.5, 0.6], ("adamw", 1e-4): [0.7, 0.7], ("lion", 1e-4): [0.8, 0.8]})
    table = tuned_section(jobs).table
    assert row(table, "adamw")["edge"] == "highest"
    assert row(table, "lion")["edge"] == "" and row(table, "lion")["rates tried"] == "0.0001"
    best = select_best(rate_table(jobs), KEYS)
    assert best.set_index("optim").loc["lion", "edge"] == ""


def history_of(series: dict) -> pd.DataFrame:
    """{run_id: [value at steps 10, 20, ...]} -> run_id, step, value."""
    rows = [(run, 10 * (i + 1), v) for run, values in series.items() for i, v in enumerate(values)]
    return pd.DataFrame(rows, columns=["run_id", "step", "value"])


def test_steps_to_target_is_the_first_step_where_the_mean_over_seeds_reaches_it():
    jobs = jobs_of({("adamw", 1e-5): [0.5, 0.5], ("adamw", 1e-4): [0.8, 0.8], ("lion", 1e-4): [0.6, 0.6]})
    history = history_of(
        {
            # adamw at its best rate (1e-4): mean 0.5, 0.785, 0.8 -> 0.97 x 0.8 = 0.776 reached at step 20
            "adamw-0.0001-0": [0.4, 0.78, 0.8],
            "adamw-0.0001-1": [0.6, 0.79, 0.8],
            "adamw-1e-05-0": [0.9, 0.9, 0.5],  # not the best rate: its series is left out
            # lion: one seed reaches 0.776 at step 10, their mean never does
            "lion-0.0001-0": [0.9, 0.5, 0.6],
            "lion-0.0001-1": [0.1, 0.5, 0.6],
        }
    )
    tuned = tuned_section(jobs, history)
    adamw, lion = row(tuned.table, "adamw"), row(tuned.table, "lion")
    assert adamw["target [0-1]"] == pytest.approx(0.97 * 0.8)
    assert adamw["steps to target [steps]"] == 20 and adamw["target reached"]
    assert math.isnan(lion["steps to target [steps]"]) and not lion["target reached"]
    shown = report.format_tuned(tuned.table).set_index("optimizer")["steps to target [steps]"]
    assert shown.to_dict() == {"adamw": "20", "lion": "not reached"}
    assert sorted(tuned.curves.query("optim == 'adamw'")["mean"]) == pytest.approx([0.5, 0.785, 0.8])
    # a lower fraction: lion reaches 0.5 x 0.8 at step 10
    lion = row(tuned_section(jobs, history, target_fraction=0.5).table, "lion")
    assert lion["steps to target [steps]"] == 10
    # no history, or each run's final value alone (validated at its end only): empty, neither reached nor not
    final = history_of({run: [value] for run, value in zip(jobs.run_id, jobs.val_macro_f1, strict=True)})
    for table in (tuned_section(jobs).table, tuned_section(jobs, final).table):
        assert table["steps to target [steps]"].isna().all() and table["target reached"].isna().all()
        assert (report.format_tuned(table)["steps to target [steps]"] == "").all()


def test_steps_to_target_on_a_constructed_series():
    runs = pd.DataFrame({"run_id": ["a", "b", "c"], "optim": ["x", "x", "y"]})
    curves = mean_curves(
        history_of({"a": [0.1, 0.5, 0.9], "b": [0.3, 0.7, 0.9], "c": [0.1, 0.2, 0.3]}), runs, ["optim"]
    )
    assert curves.query("optim == 'x'")["mean"].tolist() == pytest.approx([0.2, 0.6, 0.9])
    steps = steps_to_target(curves.assign(target=0.6), ["optim"]).set_index("optim")
    assert steps.loc["x", "steps"] == 20 and steps.loc["x", "reached"]  # 0.6 reached exactly
    assert math.isnan(steps.loc["y", "steps"]) and not steps.loc["y", "reached"]


def test_significance_is_welchs_test_against_the_baseline_at_its_own_best_rate():
    jobs = pd.DataFrame(
        [
            # adamw's best rate is 1e-5 (validation), its test values there 0.70, 0.72, 0.75
            *(job("adamw", 1e-5, s, 0.8, t) for s, t in enumerate([0.70, 0.72, 0.75])),
            *(job("adamw", 1e-4, s, 0.7, t) for s, t in enumerate([0.90, 0.91, 0.92])),
            # lion's best rate is 1e-4, the rate adamw did worse at
            *(job("lion", 1e-5, s, 0.6, 0.5) for s in range(4)),
            *(job("lion", 1e-4, s, 0.85, t) for s, t in enumerate([0.78, 0.80, 0.79, 0.83])),
            # sgd: one seed, no test
            job("sgd", 1e-3, 0, 0.5, 0.6),
            job("sgd", 1e-2, 0, 0.4, 0.6),
        ]
    )
    table = tuned_section(jobs).table
    adamw, lion, sgd = (row(table, o) for o in ("adamw", "lion", "sgd"))
    assert lion["Δ test macro-F1 [0-1]"] == pytest.approx(
        statistics.mean([0.78, 0.80, 0.79, 0.83]) - 0.7233333333
    )
    expected = stats.ttest_ind([0.78, 0.80, 0.79, 0.83], [0.70, 0.72, 0.75], equal_var=False).pvalue
    assert lion["p (Welch)"] == pytest.approx(expected, rel=1e-12)
    assert lion["n vs baseline [seeds]"] == "4 vs 3"
    assert adamw["Δ test macro-F1 [0-1]"] == 0 and math.isnan(adamw["p (Welch)"])  # not against itself
    assert sgd["Δ test macro-F1 [0-1]"] == pytest.approx(0.6 - 0.7233333333)
    assert math.isnan(sgd["p (Welch)"]) and sgd["n vs baseline [seeds]"] == "1 vs 3"  # < 2 seeds: no test
    assert welch([1.0, 2.0, 4.0], [3.0, 5.0]) == stats.ttest_ind([1, 2, 4], [3, 5], equal_var=False).pvalue
    assert math.isnan(welch([1.0], [2.0, 3.0]))
    # no spread on either side: undefined (scipy answers p = 0 for these, through rounding)
    assert math.isnan(welch([0.5, 0.5], [0.6, 0.6])) and welch([0.5, 0.5], [0.6, 0.7]) > 0


def test_a_point_without_the_baseline_has_no_delta():
    jobs = jobs_of({("lion", 1e-5): [0.5, 0.6], ("lion", 1e-4): [0.7, 0.7]})
    lion = row(tuned_section(jobs).table, "lion")
    assert math.isnan(lion["Δ test macro-F1 [0-1]"]) and math.isnan(lion["p (Welch)"])


def test_points_are_tuned_apart():
    jobs = pd.concat(
        [
            jobs_of({("adamw", 1e-5): [0.9, 0.9], ("adamw", 1e-4): [0.5, 0.5]}),
            jobs_of({("adamw", 1e-5): [0.5, 0.5], ("adamw", 1e-4): [0.8, 0.8]}).assign(batch_size=16),
        ],
        ignore_index=True,
    )
    jobs["run_id"] += "-bs" + jobs.batch_size.astype(str)
    table = tuned_section(jobs).table
    assert table.set_index("batch_size")["best lr"].to_dict() == {8: 1e-5, 16: 1e-4}
    assert table.set_index("batch_size")["target [0-1]"].to_dict() == pytest.approx({8: 0.873, 16: 0.776})


def test_an_untuned_sweep_has_no_tuned_table_and_says_so():
    # each optimizer at its own reference rate, one rate each: one comparison row per optimizer, its rate a
    # column (the rows ran at different rates)
    jobs = jobs_of({("adamw", 5e-5): [0.8, 0.8], ("adafactor", 1e-3): [0.7, 0.7]}).assign(lr_scale=1.0)
    assert tuned_section(jobs) is None
    assert rate_note(jobs) == UNTUNED_NOTE
    table = report.compare(jobs)
    assert table.optim.tolist() == ["adamw", "adafactor"] and table.lr.tolist() == [5e-5, 1e-3]
    # at one rate, no rate column
    assert "lr" not in report.compare(jobs_of({("adamw", 5e-5): [0.8], ("adafactor", 5e-5): [0.7]}))
    assert row(table, "adafactor")["Δ state [MB]"] == -98
    # no finished job: nothing to say
    assert rate_note(jobs.assign(status="FAILED")) is None


def test_several_rates_without_a_validation_metric_choose_nothing():
    jobs = jobs_of({("adamw", 1e-5): [0.5], ("adamw", 1e-4): [0.6]}).drop(columns=["val_macro_f1", "val_f1"])
    assert tuned_section(jobs) is None
    assert "no validation metric (`val_macro_f1`)" in rate_note(jobs)


def test_the_comparison_of_a_tuned_grid_compares_at_the_same_lr_scale():
    grid = {("adamw", 1e-5): [0.5], ("adamw", 1e-4): [0.6], ("lion", 1e-6): [0.5], ("lion", 1e-5): [0.6]}
    jobs = jobs_of(grid)
    jobs["lr_scale"] = jobs.lr.map({1e-6: 0.1, 1e-5: 1.0, 1e-4: 10.0}).where(jobs.optim == "lion", 0)
    jobs.loc[jobs.optim == "adamw", "lr_scale"] = jobs.lr.map({1e-5: 0.1, 1e-4: 1.0})
    table = report.compare(jobs)
    assert list(zip(table.lr_scale, table.optim, table.lr, strict=True)) == [
        (0.1, "adamw", 1e-5),
        (0.1, "lion", 1e-6),
        (1.0, "adamw", 1e-4),
        (1.0, "lion", 1e-5),
    ]
    assert table["Δ state [MB]"].tolist() == [0, -98, 0, -98]


def test_the_report_files_hold_the_tuned_table_and_plots(tmp_path):
    jobs = jobs_of({("adamw", 1e-5): [0.5, 0.6], ("adamw", 1e-4): [0.7, 0.8], ("lion", 1e-4): [0.8, 0.8]})
    history = history_of(
        {run: [0.3, value] for run, value in zip(jobs.run_id, jobs.val_macro_f1, strict=True)}
    )
    tuned, table = tuned_section(jobs, history), report.compare(jobs)
    write_report(tmp_path, "t", ["note"], jobs, table, pd.DataFrame(), tuned=tuned)
    for name in ("tuned.csv", "val_vs_lr.png", "val_curves.png", "f1_vs_peak.png"):
        assert (tmp_path / name).exists(), name
    md = (tmp_path / "report.md").read_text()
    assert "## Tuned learning rate" in md and "Welch's two-sided t-test" in md
    # lion: the same peak, a higher test macro-F1 at its best rate than adamw at its own: the front
    assert "higher test macro-F1): lion · bs 8." in md
    assert "<h2>Tuned learning rate</h2>" in (tmp_path / "report.html").read_text()
    text = console_text(tmp_path, table)
    assert "tuned learning rate" in text and "Δ test macro-F1 [0-1]" in text
    # rebuilt untuned: the tuned files go
    write_report(tmp_path, "t", ["note"], jobs, table, pd.DataFrame())
    assert not (tmp_path / "tuned.csv").exists() and not (tmp_path / "val_vs_lr.png").exists()
    assert "tuned learning rate" not in console_text(tmp_path, table)


def test_the_tuned_front_counts_an_optimizer_whose_collapsed_run_was_at_another_rate(tmp_path):
    jobs = jobs_of({("adamw", 1e-5): [0.6, 0.6], ("adamw", 1e-4): [0.9, 0.9], ("lion", 1e-4): [0.8, 0.8]})
    jobs.loc[jobs.run_id == "adamw-1e-05-0", "collapsed"] = True
    tuned = tuned_section(jobs)
    assert row(tuned.table, "adamw")["collapsed [runs]"] == 1  # at 1e-5; its best rate, 1e-4, learned
    write_report(tmp_path, "t", [], jobs, report.compare(jobs), pd.DataFrame(), tuned=tuned)
    md = (tmp_path / "report.md").read_text()
    assert "higher test macro-F1): adamw · bs 8." in md and "left off the front" not in md


def test_the_cli_checks_the_tuned_options(capsys):
    with pytest.raises(SystemExit):
        report.main(["--target-fraction", "1.5"])
    assert "--target-fraction must be in (0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        report.main(["--quality-metric", "loss"])
    assert "invalid choice: 'loss'" in capsys.readouterr().err
