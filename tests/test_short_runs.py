"""Short runs that stay short (a run of few steps evaluates on a sample, eval.sample=auto, and says so), and a
language model with random weights that starts at a rate it learns at, or says that it hardly learned."""

import math

import pandas as pd
import pytest
from omegaconf import OmegaConf

from pipeline import data, learning_rate
from pipeline.data import eval_sample, sample
from pipeline.report.render import sample_note
from pipeline.runner import config_hash, job_params
from tests.conftest import compose_cfg, run_cli, sweep_runs


def without_sample(cfg):
    """The config as a point recorded before eval.sample existed."""
    before = OmegaConf.create(OmegaConf.to_container(cfg))
    del before.eval["sample"]
    return before


def test_a_short_run_evaluates_on_a_sample_and_is_a_point_of_its_own():
    long, short = compose_cfg(), compose_cfg("train.max_steps=5")
    assert eval_sample(long) is None and eval_sample(short) == 200
    assert eval_sample(compose_cfg("train.max_steps=5", "eval.sample=null")) is None
    assert eval_sample(compose_cfg("eval.sample=50")) == 50  # any run
    # a run that evaluates on all the data keeps is the point it was; a sampled one is another
    assert config_hash(long) == config_hash(without_sample(long))
    assert config_hash(short) != config_hash(without_sample(short))
    assert config_hash(short) == config_hash(compose_cfg("train.max_steps=5", "eval.sample=200"))
    assert job_params(short)["eval_sample"] == 200 and job_params(long)["eval_sample"] is None


def test_the_sample_is_each_splits_first_texts_and_its_line_names_it():
    cfg = compose_cfg("train.max_steps=5")
    splits = data.load_splits(cfg.data)
    sampled, cut = sample(cfg, splits)
    assert data.SAMPLE_LINE.format(why=data.sample_reason(cfg), cut=cut) == (
        "a short run (5 steps, eval.sample=auto below 50): evaluating on 200 of 1,000 test texts and 200 of 500 "
        "validation texts; eval.sample=null for all of them"
    )
    assert (
        sampled.eval["text"] == splits.eval["text"][:200] and sampled.val["text"] == splits.val["text"][:200]
    )
    assert sampled.train is splits.train
    assert {i["context"]: i["rows"] for i in sampled.inputs} == {
        "train": len(splits.train),
        "val": 200,
        "eval": 200,
    }
    # a sample as large as a split leaves it whole
    whole, cut = sample(compose_cfg("eval.sample=500"), splits)
    assert data.sample_reason(compose_cfg("eval.sample=500")) == "eval.sample=500"
    assert cut == "500 of 1,000 test texts" and len(whole.val) == 500
    assert sample(compose_cfg(), splits) == (splits, None)


def test_the_report_names_the_runs_a_sample_cut():
    """A run counts as sampled where a split it evaluated reached its eval_sample: not where the data's own
    limits kept fewer texts (16 of a cap of 200), nor where it evaluated on all."""
    jobs = pd.DataFrame(
        {
            "status": ["FINISHED"] * 4,
            "eval_sample": ["200", "200", "None", None],
            "eval_samples": [200, 16, 1000, 1000],
            "val_samples": [200, 16, 500, 500],
        }
    )
    assert sample_note(jobs).startswith(
        "sampled evaluation: 1 of 4 runs evaluated on at most 200 texts of the test and the validation split"
    )
    assert sample_note(jobs.iloc[1:]) is None


def test_a_language_model_with_random_weights_starts_at_a_rate_that_learns():
    """train.lr's default for a decoder with random weights as a language model: the optimizer's reference rate
    times task.random_weights_lr_scale; a pretrained model, a classifier, Prodigy and a rate set on the command
    line keep theirs."""
    lm = compose_cfg("task=causal_lm", "model=llama-tiny")
    assert learning_rate(lm) == pytest.approx(30 * lm.optim.lr)
    params = job_params(lm)
    assert params["lr_reference"] == learning_rate(lm) and params["lr_tuned"] is False
    # Prodigy's rate multiplies the step size it estimates: it keeps its 1.0
    others = [("task=causal_lm", "model=gpt2"), ("model=llama-tiny",), ("model=tiny",)]
    for other in [*others, ("task=causal_lm", "model=llama-tiny", "optim=prodigy")]:
        cfg = compose_cfg(*other)
        assert learning_rate(cfg) == cfg.optim.lr
    assert learning_rate(compose_cfg("task=causal_lm", "model=llama-tiny", "train.lr=1e-3")) == 1e-3
    # the point is the rate it trains at, not the key that made it
    same = compose_cfg("task=causal_lm", "model=llama-tiny", f"train.lr={learning_rate(lm)}")
    assert config_hash(same) == config_hash(lm)


@pytest.mark.slow  # two language-model jobs of 5 and 30 steps (about a minute on 2 cores)
def test_a_short_language_model_run_names_its_sample_and_says_whether_it_learned(tmp_path):
    """5 steps at the default rate hardly move a random decoder (its line says what to try); 30 steps learn (no
    line). Both are short: each evaluates on the first 200 test and validation texts, says so, records it, and
    the report says so too."""
    args = ["-m", "task=causal_lm", "model=llama-tiny", "train.max_steps=5,30", "train.max_length=32"]
    proc = run_cli(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for steps in (5, 30):
        assert (
            f"[job] a short run ({steps} steps, eval.sample=auto below 50): evaluating on 200 of 1,000 test texts "
            "and 200 of 500 validation texts; eval.sample=null for all of them"
        ) in proc.stdout.splitlines(), proc.stdout[-3000:]
    hardly = [line for line in proc.stdout.splitlines() if line.startswith("[job] hardly learned:")]
    assert len(hardly) == 1, proc.stdout[-3000:]
    assert hardly[0].endswith(
        "of a uniform guess's over the vocabulary, ln(30,522) = 10.33; try more steps (train.max_steps) or a "
        "larger rate (train.lr_scale=3,10 in a sweep)"
    )
    assert "sampled evaluation: every run evaluated on at most 200 texts of the test and the validation" in (
        proc.stdout
    )
    runs = {int(r.data.params["max_steps"]): r for r in sweep_runs(tmp_path)[1]}
    for steps, learned in ((5, False), (30, True)):
        run = runs[steps].data
        assert run.params["eval_sample"] == "200"
        assert run.params["eval_samples"] == "200" and run.params["val_samples"] == "200"
        uniform = run.metrics["eval_loss"] / math.log(30522)
        assert run.metrics["loss_vs_uniform"] == pytest.approx(uniform)
        assert run.tags["hardly_learned"] == str(not learned).lower()
        assert (uniform < 0.8) == learned, uniform
