import pytest
import torch
from transformers import Trainer, TrainingArguments

from pipeline import models, optimizers
from pipeline.config import ConfigError, validate
from pipeline.memory import optimizer_state_size
from tests.conftest import compose_cfg
from tests.test_memory import one_step

WITH_TRAINER_STRING = [name for name, spec in optimizers.REGISTRY.items() if spec.trainer_optim]


def trainer_optimizer(model, cfg, spec, tmp_path):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        optim=spec.trainer_optim,
        learning_rate=cfg.train.lr,
        weight_decay=cfg.train.weight_decay,
        warmup_steps=cfg.train.warmup_steps,
        report_to="none",
        use_cpu=True,
        **spec.trainer_args(cfg),
    )
    return Trainer(model=model, args=args).create_optimizer()


def test_every_optimizer_has_a_config_file():
    from tests.conftest import CONF

    assert sorted(p.stem for p in (CONF / "optim").glob("*.yaml")) == sorted(optimizers.REGISTRY)


@pytest.mark.parametrize("optim", WITH_TRAINER_STRING)
def test_same_optimizer_and_settings_on_both_backends(optim, tmp_path):
    """The Trainer's optim= string and the registry factory build the same class with the same settings."""
    cfg = compose_cfg("model=tiny", f"optim={optim}", "train.weight_decay=0.01")
    model = models.load_model(cfg.model, num_labels=2)
    spec = optimizers.get(optim)
    from_trainer = trainer_optimizer(model, cfg, spec, tmp_path)
    direct = spec.build(model, cfg)
    assert type(from_trainer) is type(direct)
    assert from_trainer.defaults == direct.defaults
    assert len(from_trainer.param_groups) == len(direct.param_groups)
    for a, b in zip(from_trainer.param_groups, direct.param_groups, strict=True):
        assert [id(p) for p in a["params"]] == [id(p) for p in b["params"]]
        assert {k: v for k, v in a.items() if k != "params"} == {k: v for k, v in b.items() if k != "params"}


@pytest.mark.parametrize("optim", ["adamw_8bit", "lion_8bit"])
def test_trainer_variant_keeps_embedding_state_fp32(optim, tmp_path):
    import bitsandbytes as bnb

    cfg = compose_cfg("model=tiny", f"optim={optim}")
    model = models.load_model(cfg.model, num_labels=2)
    spec = optimizers.get(optim)
    try:
        optimizer = trainer_optimizer(model, cfg, spec, tmp_path)
        one_step(model, optimizer, models.vocab_size(model))
        measured = optimizer_state_size(optimizer)
    finally:
        bnb.optim.GlobalOptimManager.get_instance().initialize()  # the Trainer's overrides are global
    infos = optimizers.param_infos(model)
    assert measured == spec.estimate(infos, cfg, optimizers.TRAINER_EMBEDDING_FP32, model.config)
    assert measured.bytes > spec.estimate(infos, cfg, None, model.config).bytes


def test_missing_optimizer_package_is_one_line(monkeypatch):
    spec = optimizers.get("adamw_8bit")
    monkeypatch.setitem(
        optimizers.REGISTRY,
        "adamw_8bit",
        optimizers.OptimizerSpec(**{**vars(spec), "requires": ("no_such_pkg",)}),
    )
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg("optim=adamw_8bit"))
    assert str(err.value) == (
        "optim=adamw_8bit needs the package(s) no_such_pkg: install the optional extra with "
        "pip install -e '.[optim]' (make install does)"
    )


def test_unknown_optimizer_lists_the_choices():
    with pytest.raises(KeyError, match="adafactor"):
        optimizers.get("adamx")


def test_param_infos_skip_frozen_parameters_and_mark_embeddings():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2))
    model[1].bias.requires_grad_(False)
    assert optimizers.param_infos(model) == [
        optimizers.ParamInfo("0.weight", (10, 4), 4, True),
        optimizers.ParamInfo("1.weight", (2, 4), 4, False),
    ]


@pytest.mark.parametrize("model_name", ["tiny", "distilbert-base-cased", "gpt2", "roberta-base"])
def test_weight_decay_names_follow_the_trainers_rule(model_name):
    cfg = compose_cfg(f"model={model_name}", "model.pretrained=false")
    model = models.load_model(cfg.model, num_labels=2)
    assert optimizers.decay_parameter_names(model) == Trainer.get_decay_parameter_names(None, model)
