"""A language model's quality wherever the report, the sweep and the MLflow views show quality: eval loss,
perplexity and next-token accuracy instead of F1, one table per task where a sweep holds both, rates picked
by the lowest validation loss, sweeps ranked by the eval loss (lowest first), and one console line about the
labels a language model ignores."""

import json
import math
import re

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from pipeline import browse, report
from pipeline.report.render import console_text, write_report
from pipeline.report.tables import plan_table
from pipeline.report.tuned import tuned_section
from pipeline.report.verdict import plan_console
from pipeline.sweep import LABELS_LINE, labels_ignored, summary_table, sweep_metric, sweep_tasks
from pipeline.tracking import VIEW_TAG
from tests.conftest import CONF, run_cli, store, sweep_runs

POINT = {"model": "llama-tiny", "batch_size": 4, "backend": "trainer", "precision": "fp32"}
F1_COLUMNS = ["eval F1 [0-1]", "eval accuracy [0-1]", "collapsed [runs]"]
LM_COLUMNS = ["eval loss [nats]", "eval perplexity", "eval next-token accuracy [0-1]"]


def lm_job(optim, seed, loss, lr=1e-3, val=None, state=None):
    """A finished task=causal_lm job as job_table gives it: no F1, no labels, no collapsed tag."""
    return {
        "run_id": f"lm-{optim}-{lr:g}-{seed}",
        "status": "FINISHED",
        "task": "causal_lm",
        **POINT,
        "optim": optim,
        "lr": lr,
        "seed": seed,
        "collapsed": None,  # (job_table: the tag as a nullable boolean, empty where a job did not say)
        "optimizer_state_mb": state or (30.0 if optim == "adamw" else 0.25),
        "peak_memory_mb": 360.0 + seed,
        "train_loss_final": loss + 0.1,
        "eval_loss": loss,
        "eval_perplexity": math.exp(loss),
        "eval_next_token_accuracy": 0.1 + seed / 100,
        "val_loss": loss - 0.05 if val is None else val,
        "val_perplexity": math.exp(loss - 0.05 if val is None else val),
        "train_samples_per_second": 10.0,
        "train_tokens_per_second": 300.0,
    }


def classifier_job(optim, seed, f1, collapsed=False):
    """A finished classification job, recorded before the task axis (no param `task`)."""
    return {
        "run_id": f"cls-{optim}-{seed}",
        "status": "FINISHED",
        "task": None,
        **POINT,
        "optim": optim,
        "lr": 1e-3,
        "seed": seed,
        "collapsed": collapsed,
        "label_names": json.dumps({"0": "rotten", "1": "fresh"}),
        "optimizer_state_mb": 15.0 if optim == "adamw" else 0.13,
        "peak_memory_mb": 45.0 + seed,
        "train_loss_final": 0.6,
        "eval_loss": 0.59,
        "eval_accuracy": 0.8,
        "eval_f1": f1,
        "eval_macro_f1": f1 - 0.4,
        "train_samples_per_second": 300.0,
        "train_tokens_per_second": 7000.0,
    }


def frame(rows) -> pd.DataFrame:
    """Jobs as job_table types them: the tag `collapsed` a nullable boolean."""
    return pd.DataFrame(rows).astype({"collapsed": "boolean"})


def lm_jobs() -> pd.DataFrame:
    return frame([lm_job(o, s, loss) for o, losses in LOSSES.items() for s, loss in enumerate(losses)])


LOSSES = {"adamw": [10.30, 10.32], "adafactor": [10.28, 10.26]}


def header(text: str, after: str) -> str:
    """The first line after the line `after` of the console text (a table's header)."""
    lines = text.splitlines()
    return lines[lines.index(after) + 1]


def test_a_language_models_report_shows_its_loss_perplexity_and_next_token_accuracy_and_no_f1(tmp_path):
    jobs = lm_jobs()
    table = report.compare(jobs)
    assert not set(F1_COLUMNS) & set(table.columns)  # no column its rows cannot fill
    assert set(LM_COLUMNS) <= set(table.columns)
    adafactor = table.set_index("optim").loc["adafactor"]
    assert adafactor["eval perplexity"] == pytest.approx((math.exp(10.28) + math.exp(10.26)) / 2)
    assert adafactor["Δ state [MB]"] == pytest.approx(0.25 - 30.0)  # against the language model's AdamW
    write_report(tmp_path, "t", ["note"], jobs, table, pd.DataFrame())

    text = console_text(tmp_path, table)
    assert text.splitlines()[0] == "language model (task=causal_lm):"
    shown = header(text, "language model (task=causal_lm):")
    assert all(column in shown for column in LM_COLUMNS), shown
    assert "F1" not in text and "collapsed" not in text and "nan" not in text
    # a perplexity in the thousands as a whole number (28,855), not 2.886e+04
    assert f"{(math.exp(10.28) + math.exp(10.26)) / 2:,.0f} ± " in text
    page, html = (tmp_path / "report.md").read_text(), (tmp_path / "report.html").read_text()
    html = re.sub(r'src="data:image/png;base64,[^"]*"', "", html)  # (base64 may spell anything)
    assert "## Comparison: language model (task=causal_lm)" in page
    assert "F1" not in page and "F1" not in html and "collapsed" not in page
    lead = page.split("## Comparison: language model (task=causal_lm)\n\n")[1].splitlines()[0]
    assert "eval perplexity" in lead
    csv = pd.read_csv(tmp_path / "comparison.csv")
    assert not set(F1_COLUMNS) & set(csv.columns) and set(LM_COLUMNS) <= set(csv.columns)
    assert set(csv.task) == {"causal_lm"}
    assert (tmp_path / "perplexity_vs_peak.png").exists() and not (tmp_path / "f1_vs_peak.png").exists()
    assert "Pareto front, language model (no other point has less peak memory and a lower perplexity)" in page


def test_a_language_model_that_hardly_learned_is_marked_in_the_report_as_a_collapsed_classifier_is(tmp_path):
    """Metric loss_vs_uniform at HARDLY_LEARNED or above (AdamW's two runs, one of Adafactor's): each row's
    optimizer carries the mark on the console and in report.md, the note under the table says what it means;
    runs recorded without the metric are marked nowhere (the other tests' jobs)."""
    share = {("adamw", 0): 0.99, ("adamw", 1): 0.99, ("adafactor", 0): 0.99, ("adafactor", 1): 0.5}
    jobs = lm_jobs()
    jobs["loss_vs_uniform"] = [share[o, s] for o, s in zip(jobs.optim, jobs.seed, strict=True)]
    table = report.compare(jobs)
    assert table.set_index("optim")["hardly learned [runs]"].to_dict() == {"adamw": 2, "adafactor": 1}
    write_report(tmp_path, "t", ["note"], jobs, table, pd.DataFrame())
    for text in (console_text(tmp_path, table), (tmp_path / "report.md").read_text()):
        assert "adamw (hardly learned)" in text and "adafactor (hardly learned 1 of 2)" in text
        assert "(hardly learned): the run's final loss is at least 80% of a uniform guess's" in text


def test_a_sweep_of_both_tasks_gives_one_table_per_task_each_against_its_own_adamw(tmp_path):
    classifiers = [classifier_job("adamw", 0, 0.9, collapsed=True), classifier_job("adafactor", 0, 0.7)]
    jobs = pd.concat([lm_jobs(), frame(classifiers)], ignore_index=True)
    table = report.compare(jobs)
    # a run without the param `task` is a classifier's; classification's rows first
    assert list(table.task) == ["classification", "classification", "causal_lm", "causal_lm"]
    delta = table.set_index(["task", "optim"])["Δ state [MB]"]
    assert delta["classification", "adafactor"] == pytest.approx(0.13 - 15.0)
    assert delta["causal_lm", "adafactor"] == pytest.approx(0.25 - 30.0)
    write_report(tmp_path, "t", ["note"], jobs, table, pd.DataFrame())

    text = console_text(tmp_path, table)
    classifier, lm = text.split("\n\nlanguage model (task=causal_lm):\n")
    assert classifier.startswith("classification (task=classification):\n")
    assert "eval F1 [0-1]" in classifier and "perplexity" not in classifier
    assert "adamw (collapsed)" in classifier and "(eval F1 is the F1 of class 1, fresh" in classifier
    assert all(column in lm.splitlines()[0] for column in LM_COLUMNS)
    assert "F1" not in lm and "collapsed" not in lm

    page = (tmp_path / "report.md").read_text()
    sections = page.split("\n## ")
    cls = next(s for s in sections if s.startswith("Comparison: classification (task=classification)"))
    lm_page = next(s for s in sections if s.startswith("Comparison: language model (task=causal_lm)"))
    assert "eval F1 [0-1]" in cls and "perplexity" not in cls
    assert "eval perplexity" in lm_page and "eval next-token accuracy [0-1]" in lm_page
    assert "F1" not in lm_page and "collapsed" not in lm_page
    assert (tmp_path / "f1_vs_peak.png").exists() and (tmp_path / "perplexity_vs_peak.png").exists()
    # the CSV: one table, the task of each row first; each task's quality columns empty on the other's rows
    csv = pd.read_csv(tmp_path / "comparison.csv").set_index("task")
    assert csv.columns[0] != "task" and list(pd.read_csv(tmp_path / "comparison.csv").columns)[0] == "task"
    assert csv.loc["causal_lm", "eval F1 [0-1]"].isna().all()
    assert csv.loc["causal_lm", "collapsed [runs]"].isna().all()  # nothing collapses in a language model
    assert csv.loc["classification", "eval perplexity"].isna().all()


# ---- the peak's breakdown: a language model's logits a part of their own, a classifier's breakdown without ----

BREAKDOWN_COLUMNS = [c for c in report.COLUMNS if c.startswith("peak: ")]


def broken_down(job: dict, logits: float | None) -> dict:
    """`job` with a step-2 breakdown that adds up to its peak (as StepBreakdown logs it): a language model's
    with its logits (`logits`), a classifier's (None) without."""
    parts = {"peak_params_mb": 15.0, "peak_grads_mb": 0.0, "peak_optimizer_mb": job["optimizer_state_mb"]}
    parts |= {"peak_activations_mb": 2.0} | ({} if logits is None else {"peak_logits_mb": logits})
    parts["peak_other_mb"] = job["peak_memory_mb"] - sum(parts.values())
    return {**job, **parts, "peak_breakdown_mb": job["peak_memory_mb"], "peak_breakdown": "step 2"}


def test_a_language_models_breakdown_columns_add_up_to_its_peak_and_a_classifiers_have_no_logits(tmp_path):
    lm = [broken_down(lm_job(o, s, 10.3), logits=300.0) for o in ("adamw", "adafactor") for s in (0, 1)]
    classifiers = [broken_down(classifier_job(o, s, 0.8), logits=None) for o in LOSSES for s in (0, 1)]

    # classifiers alone: the five parts, no logits column anywhere (table, CSV, page, legend)
    alone = report.compare(frame(classifiers))
    assert "peak: logits [MB]" not in alone and "peak: activations [MB]" in alone
    write_report(tmp_path / "cls", "t", ["note"], frame(classifiers), alone, pd.DataFrame())
    assert "logits" not in (tmp_path / "cls" / "report.md").read_text()
    assert "logits" not in pd.read_csv(tmp_path / "cls" / "comparison.csv").columns.str.cat()
    assert (tmp_path / "cls" / "peak_breakdown.png").exists()

    # both tasks: the language model's rows' six parts add up to their peak, the classifier's five to theirs
    jobs = pd.concat([frame(lm), frame(classifiers)], ignore_index=True)
    table = report.compare(jobs)
    parts = table[BREAKDOWN_COLUMNS].sum(axis=1, min_count=1)
    assert parts.to_numpy() == pytest.approx(table["peak [MB]"].to_numpy(), rel=1e-12)
    by = table.set_index("task")
    assert (by.loc["causal_lm", "peak: logits [MB]"] == 300.0).all()
    assert by.loc["classification", "peak: logits [MB]"].isna().all()
    columns = list(table.columns)  # the logits between the activations and the other temporaries
    assert columns.index("peak: activations [MB]") < columns.index("peak: logits [MB]")
    assert columns.index("peak: logits [MB]") < columns.index("peak: other [MB]")

    write_report(tmp_path / "both", "t", ["note"], jobs, table, pd.DataFrame())
    csv = pd.read_csv(tmp_path / "both" / "comparison.csv")
    assert csv[BREAKDOWN_COLUMNS].sum(axis=1).to_numpy() == pytest.approx(csv["peak [MB]"].to_numpy())
    page = (tmp_path / "both" / "report.md").read_text()
    sections = page.split("\n## ")
    cls = next(s for s in sections if s.startswith("Comparison: classification"))
    lm_page = next(s for s in sections if s.startswith("Comparison: language model"))
    assert "peak: logits [MB]" not in cls
    # its "All columns" table: each row's parts as shown (4 digits) add up to its peak as shown
    lines = lm_page.split("### All columns\n\n")[1].split("\n\n")[0].splitlines()
    cells = [c.strip() for c in lines[0].strip("|").split("|")]
    for line in lines[2:]:
        shown = dict(zip(cells, (c.strip() for c in line.strip("|").split("|")), strict=True))
        mean = {c: float(shown[c].split(" ± ")[0]) for c in [*BREAKDOWN_COLUMNS, "peak [MB]"]}
        assert sum(mean[c] for c in BREAKDOWN_COLUMNS) == pytest.approx(mean["peak [MB]"], rel=1e-3)
    legend = page.split("\n## Columns\n")[1]
    assert "| peak: logits [MB] |" in legend
    assert "a language model's logits a part of their own" in page  # peak_breakdown.png's caption
    assert (tmp_path / "both" / "peak_breakdown.png").exists()


def plan_job(optim: str, logits: float | None) -> dict:
    """A finished plan=true job: its predicted parts add up to its predicted peak."""
    parts = {"params": 1885.0, "grads": 0.0, "optimizer": 3769.0 if optim == "adamw" else 3.0}
    parts |= {"activations": 2581.0} | ({} if logits is None else {"logits": logits}) | {"other": 66.0}
    return {
        "run_id": f"plan-{optim}-{logits}",
        "status": "FINISHED",
        "task": "causal_lm" if logits is not None else None,
        "model": "qwen2.5-0.5b" if logits is not None else "tiny",
        "precision": "bf16",
        "batch_size": 16,
        "max_length": 64,
        "optim": optim,
        **{f"predicted_peak_{k}_mb": v for k, v in parts.items()},
        "predicted_peak_mb": sum(parts.values()),
        "budget_mb": 75782.0,
        "fits": 1.0,
    }


def test_a_language_models_plan_table_has_its_logits_and_its_parts_add_up_to_the_predicted_peak():
    lm = plan_table(pd.DataFrame([plan_job(o, 1780.0) for o in LOSSES]))
    parts = ["weights [MB]", "gradients [MB]", "optimizer state [MB]", "activations [MB]", "logits [MB]"]
    parts += ["other [MB]"]
    assert list(lm.columns[lm.columns.get_loc("weights [MB]") :][: len(parts)]) == parts
    assert lm[parts].sum(axis=1).to_numpy() == pytest.approx(lm["predicted peak [MB]"].to_numpy())
    assert "logits:" in plan_console(lm).splitlines()[-1]

    classifier = plan_table(pd.DataFrame([plan_job(o, None) for o in LOSSES]))
    assert "logits [MB]" not in classifier  # an all-empty column is dropped
    assert classifier[parts[:-2] + parts[-1:]].sum(axis=1).to_numpy() == pytest.approx(
        classifier["predicted peak [MB]"].to_numpy()
    )
    assert "logits" not in plan_console(classifier)


def lm_grid() -> pd.DataFrame:
    """Two optimizers on two rates, two seeds: adamw's lower validation loss at 1e-3, adafactor's at 1e-2."""
    grid = {
        ("adamw", 1e-3): [9.0, 9.2],
        ("adamw", 1e-2): [9.6, 9.8],
        ("adafactor", 1e-3): [9.9, 9.7],
        ("adafactor", 1e-2): [8.6, 8.8],
    }
    rows = [
        lm_job(optim, seed, loss + 0.1, lr=lr, val=loss)
        for (optim, lr), losses in grid.items()
        for seed, loss in enumerate(losses)
    ]
    return frame(rows).assign(lr_scale=lambda f: f.lr / 1e-3)


def test_a_language_models_rate_is_the_one_with_the_lowest_validation_loss(tmp_path):
    jobs = lm_grid()
    history = pd.DataFrame(  # validation loss falling over steps at every rate
        [
            (run, step, value + 1 - step / 10)
            for run, value in zip(jobs.run_id, jobs.val_loss, strict=True)
            for step in (5, 10)
        ],
        columns=["run_id", "step", "value"],
    )
    tuned = tuned_section(jobs, history, metric="loss")
    table = tuned.table.set_index("optim")
    assert table.loc["adamw", "best lr"] == 1e-3 and table.loc["adafactor", "best lr"] == 1e-2
    assert table.loc["adamw", "val loss [nats]"] == pytest.approx(9.1)
    assert table.loc["adafactor", "test loss [nats]"] == pytest.approx(8.8)
    assert table.loc["adafactor", "test perplexity"] == pytest.approx((math.exp(8.7) + math.exp(8.9)) / 2)
    assert table.loc["adafactor", "Δ test loss [nats]"] == pytest.approx(8.8 - 9.2)
    assert table.loc["adafactor", "edge"] == "highest" and table.loc["adamw", "edge"] == "lowest"
    # the target: the point's best final validation loss / 0.97, the value to fall to; adamw's mean series
    # (10.1 - 1, 10.1 - 0.5 at steps 5, 10) never falls to 8.7 / 0.97 = 8.97, adafactor's reaches it at 10
    assert table.loc["adamw", "target [nats]"] == pytest.approx(8.7 / 0.97)
    assert table.loc["adafactor", "steps to target [steps]"] == 10
    assert not table.loc["adamw", "target reached"]
    assert not {"collapsed [runs]", "val macro-F1 [0-1]", "test macro-F1 [0-1]"} & set(table.columns)

    # beside a classifier's tuned table: tuned.csv holds both, the console shows each with its own figures
    classifiers = frame(
        [
            {**classifier_job(o, s, f1), "lr": lr, "val_macro_f1": f1, "run_id": f"c-{o}-{lr}-{s}"}
            for o in ("adamw", "adafactor")
            for lr, f1 in ((1e-3, 0.7), (1e-2, 0.8))
            for s in (0, 1)
        ]
    )
    both = tuned_section(classifiers), tuned
    table = report.compare(pd.concat([classifiers, jobs], ignore_index=True))
    write_report(tmp_path, "t", ["note"], pd.concat([classifiers, jobs]), table, pd.DataFrame(), tuned=both)
    assert list(pd.read_csv(tmp_path / "tuned.csv").task.unique()) == ["classification", "causal_lm"]
    text = console_text(tmp_path, table).split("tuned learning rate (")[1]
    cls, lm = text.split("\n\nlanguage model (task=causal_lm):\n")
    assert "test macro-F1 [0-1]" in cls and "loss" not in cls.split("\n", 2)[2]
    assert "test loss [nats]" in lm and "Δ test loss [nats]" in lm and "F1" not in lm
    page = (tmp_path / "report.md").read_text()
    assert "## Tuned learning rate: language model (task=causal_lm)" in page
    assert "lowest mean validation loss over seeds (`val_loss`" in page
    assert (tmp_path / "val_loss_vs_lr.png").exists() and (tmp_path / "val_vs_lr.png").exists()


def hydra_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def test_a_sweep_says_labels_are_ignored_only_where_a_language_model_reads_a_label_column():
    assert labels_ignored(hydra_cfg("task=causal_lm", "model=llama-tiny"))  # the packaged reviews' labels
    assert not labels_ignored(hydra_cfg("task=causal_lm", "data=csv", "data.label_column=null"))
    assert not labels_ignored(hydra_cfg("task=causal_lm", "model=llama-tiny", "plan=true"))  # reads no data
    assert not labels_ignored(hydra_cfg())  # a classifier's labels are its own


def test_a_language_model_sweep_is_ranked_by_its_eval_loss_lowest_first():
    lm = hydra_cfg("task=causal_lm", "model=llama-tiny")
    assert sweep_tasks(lm) == ["causal_lm"] and sweep_metric(lm) == "loss"
    assert sweep_metric(hydra_cfg()) == "macro_f1"
    # both tasks swept (the launching process's config: the default task): the classifier's metric ranks
    both = hydra_cfg("model=llama-tiny")
    both.hydra.overrides.task = ["task=causal_lm,classification", "model=llama-tiny"]
    assert sweep_tasks(both) == ["causal_lm", "classification"] and sweep_metric(both) == "macro_f1"
    state = browse.view_state("tags.mlflow.parentRunId = 'abc'", "loss")
    assert state["orderByKey"] == "metrics.`eval_loss`" and state["orderByAsc"] is True
    assert "metrics.`eval_perplexity`" in state["selectedColumns"]
    assert not {"metrics.`F1`", "tags.`collapsed`", "metrics.`eval_f1`"} & set(state["selectedColumns"])
    assert browse.ranked("loss") == "lowest eval_loss first"
    assert browse.view_state("x")["orderByAsc"] is False  # a classifier's sweep: the best F1 first


@pytest.mark.slow  # why: two language-model jobs in their own processes, about a minute on 2 CPU cores
def test_a_language_model_sweep_says_once_that_labels_are_ignored_and_records_its_loss(tmp_path):
    proc = run_cli(
        tmp_path,
        "-m",
        "task=causal_lm",
        "model=llama-tiny",
        "optim=adamw,adafactor",
        "batch_size=4",
        "train.max_length=32",
        "train.max_steps=2",
        "data.max_train_samples=32",
        "data.max_eval_samples=8",
        "data.max_val_samples=8",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count(LABELS_LINE) == 1, proc.stdout  # the sweep's, not one per job
    assert proc.stdout.count("label column") == 1
    parent, children = sweep_runs(tmp_path)
    assert parent.data.tags[browse.METRIC_TAG] == "loss"
    (ids,) = tmp_path.glob("multirun/*/mlflow_sweep.json")
    assert json.loads(ids.read_text())["metric"] == "loss"
    assert "best perplexity" in parent.data.tags["mlflow.note.content"]
    assert all("collapsed" not in run.data.tags for run in children)
    tags = store(tmp_path).get_experiment(parent.info.experiment_id).tags
    view = json.loads(json.loads(tags[f"{VIEW_TAG}{browse.SWEEP_VIEW}{parent.info.run_id}"])["state"])
    assert view["orderByKey"] == "metrics.`eval_loss`" and view["orderByAsc"] is True  # lowest loss first
    printed = proc.stdout.split("[sweep] 2 jobs")[1]
    assert "language model (task=causal_lm):" in printed and "eval perplexity" in printed
    assert "F1" not in printed and "collapsed" not in printed
    # the plain summary a failed report falls back to: perplexity, no empty F1 column
    summary = summary_table(children)
    assert "perplexity" in summary and "F1" not in summary
