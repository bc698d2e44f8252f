"""Decoder models (Llama, Qwen2) through the pipeline, and train.gradient_checkpointing on both backends."""

import pytest
import torch
from omegaconf import OmegaConf

from pipeline import backends, data, job, optimizers
from pipeline.config import ConfigError, validate
from pipeline.runner import config_hash
from tests.conftest import TINY, compose_cfg, run_cli, store, sweep_runs

TINY_DATA = [arg for arg in TINY if not arg.startswith("model=")]  # the model is swept here
CHECKPOINTED = ("model=llama-tiny", "backend=accelerator")  # the point run again with gradient checkpointing


def test_decoder_classifies_from_the_last_real_token():
    """The job sets the pad id the classification head looks for: right padding leaves the logits unchanged."""
    cfg = compose_cfg("model=llama-tiny", *TINY_DATA)
    tokenizer, _, model = job.load(cfg)
    assert model.config.pad_token_id == tokenizer.pad_token_id is not None
    model.eval()
    texts = ["a short one", "a much longer review snippet that needs no padding at all"]
    with torch.no_grad():
        batch = model(**tokenizer(texts, padding=True, return_tensors="pt")).logits
        alone = torch.cat([model(**tokenizer([t], return_tensors="pt")).logits for t in texts])
    torch.testing.assert_close(batch, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["trainer", "accelerator"])
def test_gradient_checkpointing_reaches_the_model(backend, tmp_path):
    cfg = compose_cfg(
        "model=llama-tiny", f"backend={backend}", "train.gradient_checkpointing=true", *TINY_DATA
    )
    cfg.train.max_steps = 1
    tokenizer, splits, model = job.load(cfg)
    layers = model.model.layers  # each a GradientCheckpointingLayer: its flag says whether it recomputes
    assert not any(layer.gradient_checkpointing for layer in layers)
    collate = data.PaddingCollator(tokenizer, cfg.train.padding, cfg.train.max_length)
    spec = optimizers.get(cfg.optim.name)
    backends.get(backend).train(cfg, model, splits, spec, collate, tmp_path, evaluate=False)
    assert all(layer.gradient_checkpointing for layer in layers)


def test_gradient_checkpointing_must_be_a_boolean():
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg("train.gradient_checkpointing=yes"))
    assert str(err.value) == "train.gradient_checkpointing='yes' is invalid: must be true or false"


def test_gradient_checkpointing_off_keeps_the_config_hash_of_earlier_points():
    cfg = compose_cfg()
    before = OmegaConf.create(OmegaConf.to_container(cfg))
    del before.train["gradient_checkpointing"]  # a point recorded before the key existed
    assert config_hash(cfg) == config_hash(before)
    assert config_hash(compose_cfg("train.gradient_checkpointing=true")) != config_hash(cfg)


def finished_points(tmp):
    parent, children = sweep_runs(tmp)
    assert parent.info.status == "FINISHED"
    assert {r.info.status for r in children} == {"FINISHED"}
    return {(r.data.params["model"], r.data.params["backend"]): r for r in children}


@pytest.fixture(scope="module")
def decoder_sweeps(tmp_path_factory):
    """A sweep of both tiny decoders on both backends; then one of its points again, as a single run, with
    gradient checkpointing (the wiring of both backends is checked in-process above)."""
    plain, checkpointed = tmp_path_factory.mktemp("decoders"), tmp_path_factory.mktemp("checkpointed")
    proc = run_cli(plain, "-m", "model=llama-tiny,qwen-tiny", "backend=trainer,accelerator", *TINY_DATA)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli(checkpointed, *CHECKPOINTED, "train.gradient_checkpointing=true", *TINY_DATA)  # one run
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = store(checkpointed)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED"
    point = (run.data.params["model"], run.data.params["backend"])
    return plain, finished_points(plain), checkpointed, {point: run}


@pytest.mark.slow  # two decoder sweeps: CI (make test-ci)
def test_decoders_train_on_both_backends(decoder_sweeps):
    _, plain, _, checkpointed = decoder_sweeps
    assert sorted(plain) == [(m, b) for m in ("llama-tiny", "qwen-tiny") for b in ("accelerator", "trainer")]
    assert list(checkpointed) == [("llama-tiny", "accelerator")]
    for point, run in [*plain.items(), *checkpointed.items()]:
        m = run.data.metrics
        assert 0 <= m["eval_f1"] <= 1, point
        assert m["optimizer_state_mb"] == m["estimated_optimizer_state_mb"], point
    assert {r.data.params["gradient_checkpointing"] for r in plain.values()} == {"False"}
    assert {r.data.params["gradient_checkpointing"] for r in checkpointed.values()} == {"True"}
    # same weights, data and batches on both backends: the same model size and state
    for model in ("llama-tiny", "qwen-tiny"):
        sizes = {plain[(model, b)].data.metrics["optimizer_state_bytes"] for b in ("trainer", "accelerator")}
        assert len(sizes) == 1, model


@pytest.mark.slow  # two decoder sweeps: CI (make test-ci)
def test_gradient_checkpointing_recomputes_the_same_training(decoder_sweeps):
    """Checkpointing trades memory for compute only: the same losses, state and eval figures."""
    plain_tmp, plain, checkpointed_tmp, checkpointed = decoder_sweeps

    def losses(tmp, run):
        return [m.value for m in store(tmp).get_metric_history(run.info.run_id, "train_loss")]

    for point, run in checkpointed.items():
        reference = plain[point]
        assert len(losses(checkpointed_tmp, run)) == 3
        assert losses(checkpointed_tmp, run) == pytest.approx(losses(plain_tmp, reference), rel=1e-5), point
        for key in ("eval_loss", "eval_f1", "optimizer_state_bytes", "peak_params_mb"):
            assert run.data.metrics[key] == pytest.approx(reference.data.metrics[key], rel=1e-5), (point, key)
