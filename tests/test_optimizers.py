import functools

import pytest
import torch
from transformers import Trainer, TrainingArguments

from pipeline import models, optimizers
from pipeline.config import ConfigError, validate
from pipeline.memory import optimizer_state_size
from tests.conftest import compose_cfg
from tests.test_memory import FAST_STEP, one_step

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


# ---- issue 17: the newer optimizers, bring-your-own, the meta-device estimate -----------------------------

NEW = [
    "adamw_fused",
    "muon",
    "ademamix",
    "ademamix_8bit",
    "adagrad",
    "rmsprop",
    "stable_adamw",
    "came",
    "prodigy",
    "apollo_adamw",
    "custom",
]


def stepped(model_name: str, optim: str, precision: str, *overrides: str):
    """(model, cfg, spec, optimizer) after one real step, the model in the job's dtype."""
    cfg = compose_cfg(
        f"model={model_name}",
        "model.pretrained=false",
        f"optim={optim}",
        *FAST_STEP.get(optim, ()),
        *overrides,
    )
    model = models.load_model(cfg.model, num_labels=2)
    if precision == "bf16_pure":
        model.to(torch.bfloat16)
    spec = optimizers.get(optim)
    optimizer = spec.build(model, cfg)
    one_step(model, optimizer, models.vocab_size(model))
    return model, cfg, spec, optimizer


# fp32 on tiny and distilbert: tests/test_memory.py's registry-wide test; here the 16-bit weights
@pytest.mark.parametrize("precision", ["bf16_pure"])
@pytest.mark.parametrize("optim", NEW)
def test_new_optimizers_measured_state_equals_estimate(optim, precision):
    model, cfg, spec, optimizer = stepped("tiny", optim, precision)
    measured = optimizer_state_size(optimizer)
    assert measured.numel > 0
    assert measured == spec.estimate(optimizers.param_infos(model), cfg, None, model.config)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16_pure"])
@pytest.mark.parametrize("optim", NEW)
def test_new_optimizers_on_distilbert(optim, precision):
    model, cfg, spec, optimizer = stepped("distilbert-base-cased", optim, precision)
    assert optimizer_state_size(optimizer) == spec.estimate(
        optimizers.param_infos(model), cfg, None, model.config
    )


# the registered optimizers whose step cannot run on meta tensors, and why (docs/optimizers.md): every other
# one's meta-device estimate equals its analytic estimate to the byte
META_FAILS = {
    "adafactor_torch": "Tensor.item",  # reads the step count as a number
    "stable_adamw": "Tensor.item",
    "prodigy": "Tensor.item",  # and `if p.any()`
    "adamw_fused": "fused=True",  # no fused kernel for meta tensors
    "paged_adamw_8bit": "cget_managed_ptr",  # allocates paged memory (CUDA)
    "apollo_adamw": "META device type",  # draws its projection from a torch.Generator on the weight's device
}


@functools.cache
def tiny_model():
    return models.load_model(compose_cfg("model=tiny").model, num_labels=2)


@pytest.mark.parametrize("optim", sorted(set(optimizers.REGISTRY) - {"custom"}))
def test_meta_estimate_against_the_analytic_one(optim):
    cfg = compose_cfg("model=tiny", f"optim={optim}")
    model, spec = tiny_model(), optimizers.get(optim)
    if optim in META_FAILS:
        with pytest.raises(optimizers.MetaStepFailed, match=META_FAILS[optim]):
            optimizers.meta_estimate(spec, cfg, optimizers.meta_copy(model))
    else:
        analytic = spec.estimate(optimizers.param_infos(model), cfg, None, model.config)
        assert optimizers.meta_estimate(spec, cfg, optimizers.meta_copy(model)) == analytic


EXAMPLES = __import__("pathlib").Path(__file__).resolve().parent.parent / "docs" / "examples"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["optim.target=no_such_module.Opt"],
            "optim.target='no_such_module.Opt' is invalid: cannot import no_such_module (No module named "
            "'no_such_module'); a local file must be on PYTHONPATH",
        ),
        (
            ["optim.target=torch.optim.NoSuch"],
            "optim.target='torch.optim.NoSuch' is invalid: torch.optim has no NoSuch",
        ),
        (
            ["optim.target=torch.nn.Linear"],
            "optim.target='torch.nn.Linear' is invalid: not a torch.optim.Optimizer subclass",
        ),
        (
            ["optim.target=AdamW"],
            "optim.target='AdamW' is invalid: give module.Class (e.g. torch.optim.AdamW)",
        ),
        (
            ["optim.target=torch.optim.SGD", "optim.kwargs={nesterov_typo: true}"],
            "optim.kwargs={'nesterov_typo': True} is invalid for torch.optim.SGD: "
            "got an unexpected keyword argument 'nesterov_typo'",
        ),
    ],
)
def test_bad_custom_target_is_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg("optim=custom", *overrides))
    assert str(err.value) == message


def test_custom_optimizer_from_a_file_is_measured_and_meta_estimated(monkeypatch):
    """The worked example (docs/examples/my_optim.py): built by import path with kwargs, its state measured
    and its meta-device estimate equal to it; validate accepts it."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    overrides = ["optim.target=my_optim.SignSGD", "optim.kwargs={momentum: 0.8}", "train.weight_decay=0.01"]
    validate(compose_cfg("optim=custom", *overrides))
    model, cfg, spec, optimizer = stepped("tiny", "custom", "fp32", *overrides)
    assert type(optimizer).__name__ == "SignSGD"
    assert optimizer.defaults["momentum"] == 0.8
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0.0]
    measured = optimizer_state_size(optimizer)
    assert measured.bytes == sum(p.numel() * 4 for p in model.parameters())  # one fp32 buffer each
    assert measured == spec.estimate(optimizers.param_infos(model), cfg, None, model.config)


def test_custom_whose_step_cannot_run_on_meta_has_no_estimate():
    cfg = compose_cfg("model=tiny", "optim=custom", "optim.target=torch.optim.Adafactor")
    model = tiny_model()
    with pytest.raises(optimizers.MetaStepFailed, match="cannot run on meta tensors .*Tensor.item"):
        optimizers.get("custom").estimate(optimizers.param_infos(model), cfg, None, model.config)


def test_galore_state_with_16_bit_weights():
    """GaLore's SVD runs in fp32: an fp32 weight's projector keeps the whole SVD factor (a view), a 16-bit
    weight's a 16-bit copy of its slice, and the low-rank moments take the weight's dtype."""
    for precision in ("fp32", "bf16_pure"):
        model, cfg, spec, optimizer = stepped("tiny", "galore_adamw", precision)
        estimated = spec.estimate(optimizers.param_infos(model), cfg, None, model.config)
        assert optimizer_state_size(optimizer) == estimated, precision
