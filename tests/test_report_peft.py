"""The report with LoRA and QLoRA runs beside full fine-tuning, on hand-made job tables: one row per (optimizer,
method), Δ against the baseline optimizer's full fine-tuning, `--baseline "adamw lora r=16"`, the trainable
count and frozen weights, the method in the lead table and the plots' labels; a report without PEFT runs as
it was."""

import pandas as pd
import pytest

from pipeline.report.cli import main
from pipeline.report.columns import PEFT_COLUMNS
from pipeline.report.plots import _labels
from pipeline.report.render import _about, write_report
from pipeline.report.tables import (
    compare,
    decision_table,
    failed_table,
    fit_table,
    own_baseline,
    pareto_front,
    point_columns,
    split_baseline,
)
from pipeline.report.tuned import tuned_console, tuned_section

POINT = {"model": "tiny", "batch_size": 16, "backend": "trainer", "precision": "fp32"}
METHODS = ["full", "lora r=16", "qlora r=16 nf4"]
# state and peak per method (the optimizer adds its own), trainable count and frozen weights of a PEFT run
STATE = {"full": 8.0, "lora r=16": 0.06, "qlora r=16 nf4": 0.06}
PEAK = {"full": 24.0, "lora r=16": 10.5, "qlora r=16 nf4": 10.25}
TRAINABLE = {"lora r=16": 8258, "qlora r=16 nf4": 8258}
FROZEN = {"lora r=16": 3.875, "qlora r=16 nf4": 3.75}


def job(optim, method, seed=0, lr=1e-4, **extra):
    """One finished job as job_table gives it (params as columns, each metric's last value); `method` None:
    a run recorded before the param existed."""
    peft = method not in (None, "full")
    row = {
        "run_id": f"{optim}-{method}-{seed}-{lr:g}",
        "run_name": f"{optim}-{method}-s{seed}",
        "status": "FINISHED",
        **POINT,
        "optim": optim,
        "lr": lr,
        "lr_scale": 1.0,
        "seed": seed,
        "collapsed": False,
        "optimizer_state_mb": STATE[method or "full"] * (0.5 if optim == "adafactor" else 1),
        "peak_memory_mb": PEAK[method or "full"] - (1 if optim == "adafactor" else 0) + seed,
        "eval_f1": 0.5 + 0.1 * seed,
        "model_num_params": 1_011_426,
    }
    if method is not None:
        row["method"] = method
    if peft:
        row |= {
            "model_trainable_params": TRAINABLE[method],
            "frozen_weights_mb": FROZEN[method],
            "trainable_params": TRAINABLE[method],
            "peft_r": 16,
        }
    return row | extra


def jobs_of(rows) -> pd.DataFrame:
    return pd.DataFrame(rows)


def sweep(methods=METHODS, optims=("adamw", "adafactor"), seeds=(0,)) -> pd.DataFrame:
    return jobs_of(job(o, m, s) for o in optims for m in methods for s in seeds)


def at(table: pd.DataFrame, optim: str, method: str) -> pd.Series:
    rows = table[(table.optim == optim) & (table.method == method)]
    assert len(rows) == 1, (optim, method, table)
    return rows.iloc[0]


def test_each_method_is_its_own_row_not_a_seed():
    table = compare(sweep(seeds=(0, 1)))
    # today's code put the three methods of one optimizer in one row, as if they were 3 x 2 seeds
    assert len(table) == 6 and table["n [seeds]"].tolist() == [2] * 6
    assert list(zip(table.optim, table.method, strict=True)) == [
        (o, m) for o in ("adamw", "adafactor") for m in METHODS
    ]
    assert list(table.columns[: table.columns.get_loc("n [seeds]")]) == [*POINT, "optim", "method"]
    # a row's figures are its own runs' (the mean over its two seeds: peak + 0 and + 1)
    assert at(table, "adamw", "lora r=16")["peak [MB]"] == pytest.approx(PEAK["lora r=16"] + 0.5)
    assert at(table, "adamw", "lora r=16")["state [MB]"] == pytest.approx(STATE["lora r=16"])


def test_deltas_are_against_full_fine_tuning_adamw_whatever_the_method():
    table = compare(sweep())
    base = at(table, "adamw", "full")
    assert base["Δ state [MB]"] == 0 and base["Δ peak [%]"] == 0
    lora = at(table, "adamw", "lora r=16")  # AdamW on LoRA is not a baseline of its own
    assert lora["Δ state [MB]"] == pytest.approx(STATE["lora r=16"] - STATE["full"])
    assert lora["Δ peak [%]"] == pytest.approx(100 * (PEAK["lora r=16"] - PEAK["full"]) / PEAK["full"])
    qlora = at(table, "adafactor", "qlora r=16 nf4")
    assert qlora["Δ peak [MB]"] == pytest.approx(PEAK["qlora r=16 nf4"] - 1 - PEAK["full"])


def test_a_sweep_without_full_fine_tuning_has_no_delta_unless_the_baseline_names_a_method():
    jobs = sweep(methods=["lora r=16"])
    table = compare(jobs)
    assert table.method.tolist() == ["lora r=16"] * 2  # a method key: PEFT runs are there
    assert table["Δ state [MB]"].isna().all()
    named = compare(jobs, baseline="adamw lora r=16")
    assert named["Δ state [MB]"].tolist() == pytest.approx([0, STATE["lora r=16"] * 0.5 - STATE["lora r=16"]])


@pytest.mark.parametrize(
    ("name", "parsed"),
    [
        ("adamw", ("adamw", "full")),
        ("adamw full", ("adamw", "full")),
        ("adamw lora r=16", ("adamw", "lora r=16")),
        ("adamw_8bit qlora r=16 nf4", ("adamw_8bit", "qlora r=16 nf4")),
    ],
)
def test_the_baseline_names_an_optimizer_and_optionally_a_method(name, parsed):
    assert split_baseline(name) == parsed


def test_baseline_with_a_method_compares_against_that_row():
    table = compare(sweep(), baseline="adamw lora r=16")
    assert at(table, "adamw", "lora r=16")["Δ state [MB]"] == 0
    assert at(table, "adamw", "full")["Δ state [MB]"] == pytest.approx(STATE["full"] - STATE["lora r=16"])
    assert table.optim.iloc[0] == "adamw"  # the baseline's optimizer first


def test_runs_without_the_method_param_are_full_fine_tuning():
    old = [job(o, None) for o in ("adamw", "adafactor")]
    new = [job(o, m) for o in ("adamw", "adafactor") for m in METHODS[1:]]
    table = compare(jobs_of([*old, *new]))
    assert len(table) == 6 and at(table, "adamw", "full")["Δ state [MB]"] == 0
    assert at(table, "adafactor", "full")["n [seeds]"] == 1


def test_the_trainable_count_and_frozen_weights_only_with_peft_runs():
    table = compare(sweep())
    assert at(table, "adamw", "lora r=16")["trainable params"] == TRAINABLE["lora r=16"]
    assert at(table, "adamw", "full")["trainable params"] == 1_011_426  # every weight trains
    assert at(table, "adamw", "qlora r=16 nf4")["frozen weights [MB]"] == FROZEN["qlora r=16 nf4"]
    assert pd.isna(at(table, "adamw", "full")["frozen weights [MB]"])  # nothing frozen, nothing logged
    lead, shared = decision_table(table)
    assert list(lead.columns[:4]) == ["optimizer", "method", "n [seeds]", "trainable params"]
    assert lead["trainable params"].tolist()[:2] == ["1,011,426", "8,258"]
    assert "method" not in shared
    # a sweep of one method: no method column in the lead table, the method said once above it
    lead, shared = decision_table(compare(sweep(methods=["lora r=16"])))
    assert "method" not in lead and shared.endswith("method lora r=16")


@pytest.mark.parametrize("param", ["absent", "full"])
def test_a_report_without_peft_is_as_it_was(param):
    """Runs without PEFT (before the param `method`, or with `method=full`): the table of runs without the
    param, no method column, no PEFT column, Δ against adamw as before."""
    before = compare(sweep(methods=[None]))
    jobs = sweep(methods=[None if param == "absent" else "full"])
    table = compare(jobs)
    pd.testing.assert_frame_equal(table, before)
    assert "method" not in table and not set(PEFT_COLUMNS) & set(table)
    assert "method" not in point_columns(jobs)
    assert "method" not in failed_table(jobs.assign(status="FAILED"))
    assert "full fine-tuning" not in " ".join(_about("uri", None, jobs, "adamw"))


def test_plot_labels_name_the_method_where_it_varies():
    table = compare(sweep())
    labels = _labels(table, ["optim", *point_columns(table)])
    assert labels.tolist()[:3] == [
        "adamw · bs 16 · full",
        "adamw · bs 16 · lora r=16",
        "adamw · bs 16 · qlora r=16 nf4",
    ]
    one = compare(sweep(methods=["lora r=16"]))
    assert _labels(one, ["optim", *point_columns(one)]).tolist() == ["adamw · bs 16", "adafactor · bs 16"]


def test_the_tuned_section_keeps_methods_apart_and_compares_with_full_adamw():
    rows = []
    for optim in ("adamw", "adafactor"):
        for method in ("full", "lora r=16"):
            for lr in (1e-4, 1e-3):
                for seed in (0, 1):
                    good = (lr == 1e-3) == (method == "full")  # full best at 1e-3, LoRA at 1e-4
                    val = 0.8 if good else 0.6
                    val += 0.01 * seed + (0.05 if optim == "adafactor" else 0)
                    rows.append(job(optim, method, seed, lr, val_macro_f1=val, eval_macro_f1=val - 0.05))
    tuned = tuned_section(jobs_of(rows)).table
    assert list(zip(tuned.optim, tuned.method, tuned["best lr"], strict=True)) == [
        ("adamw", "full", 1e-3),
        ("adamw", "lora r=16", 1e-4),
        ("adafactor", "full", 1e-3),
        ("adafactor", "lora r=16", 1e-4),
    ]
    delta = "Δ test macro-F1 [0-1]"
    assert tuned[delta].tolist() == pytest.approx([0, 0, 0.05, 0.05])  # each against AdamW's full at its best
    assert tuned["n vs baseline [seeds]"].tolist() == ["", "2 vs 2", "2 vs 2", "2 vs 2"]


def test_a_lora_only_tuning_sweep_takes_its_own_baseline_and_its_console_reads_without_one():
    """No run of full AdamW: the report's baseline is what most runs ran (the first of a tie), against which
    the tuned table has its Δ; a tuned table read back without a Δ column (none had a baseline) still prints."""
    rows = [
        job(
            optim,
            "lora r=16",
            seed,
            lr,
            val_macro_f1=(0.8 if lr == 1e-4 else 0.6) + 0.01 * seed,
            eval_macro_f1=v,
        )
        for optim, v in (("adamw", 0.7), ("adafactor", 0.75))
        for lr in (1e-4, 1e-3)
        for seed in (0, 1)
    ]
    jobs = jobs_of(rows)
    assert own_baseline(jobs, "adamw") == "adamw lora r=16"
    assert own_baseline(jobs, "adafactor lora r=16") == "adafactor lora r=16"  # one of the runs: kept
    assert own_baseline(sweep(), "adamw") == "adamw"
    tuned = tuned_section(jobs, baseline=own_baseline(jobs, "adamw")).table
    assert tuned["Δ test macro-F1 [0-1]"].tolist() == pytest.approx([0, 0.05])
    without = tuned_section(
        jobs
    ).table  # against full AdamW, which did not run: no Δ, left out once read back
    assert without["Δ test macro-F1 [0-1]"].isna().all()
    lines = tuned_console(without.drop(columns="Δ test macro-F1 [0-1]")).splitlines()
    assert "test macro-F1 [0-1]" in lines[0] and len(lines) == 3


def test_the_page_and_comparison_csv_carry_the_method(tmp_path):
    jobs = sweep()
    table = compare(jobs)
    about = _about("uri", None, jobs, "adamw")
    assert any("`adamw` with full fine-tuning (method `full`)" in line for line in about)
    write_report(tmp_path, "t", about, jobs, table, pd.DataFrame())
    page = (tmp_path / "report.md").read_text()
    assert "| optimizer | method | n [seeds] | trainable params |" in page
    assert "| adamw | lora r=16 | 1 | 8,258 |" in page
    assert "| method | how the row trains" in page and "| frozen weights [MB] |" in page
    csv = pd.read_csv(tmp_path / "comparison.csv")
    assert list(csv.columns[5:9]) == ["method", "n [seeds]", "collapsed [runs]", "trainable params"]


def test_the_cli_takes_a_baseline_with_a_method(monkeypatch):
    seen = {}

    def build(*args, **kwargs):
        seen.update(kwargs)
        raise SystemExit(0)

    monkeypatch.setattr("pipeline.report.cli.build", build)
    monkeypatch.setattr("pipeline.report.cli.Tracker", lambda uri: None)
    with pytest.raises(SystemExit):
        main(["--tracking-uri", "http://127.0.0.1:1", "--baseline", "adamw lora r=16"])
    assert seen["baseline"] == "adamw lora r=16"


def test_the_largest_batch_and_failed_tables_carry_the_method():
    fits = jobs_of(
        job(o, m, memory_budget_mb=1000, max_length=128, max_batch_size=b)
        for o, m, b in [("adamw", "full", 8), ("adamw", "lora r=16", 64), ("adamw", None, 4)]
    )
    table = fit_table(fits)
    assert table[["optimizer", "method", "largest batch [samples]"]].values.tolist() == [
        ["adamw", "full", 4],  # the smallest found: a run without the param is full fine-tuning too
        ["adamw", "lora r=16", 64],
    ]
    assert "method" not in fit_table(fits.drop(columns="method"))
    failed = failed_table(sweep().assign(status="FAILED"))
    assert list(failed.columns[1:3]) == ["optimizer", "method"]
    assert failed.method.tolist()[:3] == METHODS


def test_adapter_settings_a_sweep_varies_are_keys_after_the_method():
    rows = [
        job("adamw", "full"),
        *(job("adamw", "lora r=16", peft_alpha=a, peft_targets="query,value") for a in (16, 32)),
    ]
    table = compare(jobs_of(rows))
    assert list(table.columns[4:7]) == ["optim", "method", "peft_alpha"]
    assert table.method.tolist() == ["full", "lora r=16", "lora r=16"]
    assert pd.isna(table.peft_alpha[0]) and table.peft_alpha[1:].tolist() == [16, 32]
    assert table["Δ state [MB]"].tolist() == pytest.approx(
        [0, STATE["lora r=16"] - STATE["full"]] + [STATE["lora r=16"] - STATE["full"]]
    )
    lead, _ = decision_table(table)
    assert list(lead.columns[:3]) == ["optimizer", "method", "lora alpha"]
    # each model's own default targets: not a key (they follow from the model)
    other = [job("adamw", "lora r=16", model="llama-tiny", peft_alpha=32, peft_targets="q_proj,v_proj")]
    assert "peft_targets" not in point_columns(jobs_of([*rows, *other]))


def test_a_full_rows_adapter_setting_is_empty_in_tables_and_labels():
    rows = [job("adamw", "full"), *(job("adamw", "lora r=16", peft_alpha=a) for a in (16, 32))]
    table = compare(jobs_of(rows).astype({"peft_alpha": "Int64"}))  # as job_table types an integer param
    lead, _ = decision_table(table)
    assert lead["lora alpha"].tolist() == ["", 16, 32]
    labels = _labels(table, ["optim", *point_columns(table)])
    assert labels.tolist() == [
        "adamw · bs 16 · full",
        "adamw · bs 16 · lora r=16 · peft_alpha=16",
        "adamw · bs 16 · lora r=16 · peft_alpha=32",
    ]


def test_the_front_passes_over_collapsed_rows_which_are_still_drawn(tmp_path):
    # LoRA's model collapsed (its F1 the class balance's, 0.77): drawn hollow, off the front
    rows = [
        job("adamw", "full", eval_f1=0.8),
        job("adamw", "lora r=16", eval_f1=0.77, collapsed=True),
        job("adamw", "qlora r=16 nf4", eval_f1=0.6),
    ]
    table = compare(jobs_of(rows))
    assert pareto_front(table).tolist() == [True, False, True]
    assert pareto_front(table.drop(columns="collapsed [runs]")).tolist() == [True, True, True]
    write_report(tmp_path, "t", [], jobs_of(rows), table, pd.DataFrame())
    page = (tmp_path / "report.md").read_text()
    front = "higher F1): adamw · bs 16 · full, adamw · bs 16 · qlora r=16 nf4. "
    assert front + "Rows with a collapsed run " in page
    assert page.count("drawn hollow and left off the front") == 1
    assert (tmp_path / "f1_vs_peak.png").exists()
    learned = [job("adamw", "full"), job("adamw", "lora r=16")]  # nothing collapsed: nothing to say
    write_report(tmp_path, "t", [], jobs_of(learned), compare(jobs_of(learned)), pd.DataFrame())
    assert "left off the front" not in (tmp_path / "report.md").read_text()
