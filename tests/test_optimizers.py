import functools

import pytest
import torch
from transformers import Trainer, TrainingArguments

from pipeline import models, optimizers
from pipeline.config import ConfigError, validate
from pipeline.state import optimizer_state_size
from tests.conftest import ci_sample, compose_cfg
from tests.test_memory import FAST_STEP, CudaStaysPut, build, one_step

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
    if spec.needs_cuda and not torch.cuda.is_available():  # AdaLomo's .cuda() state, counted on the CPU
        with CudaStaysPut():
            return Trainer(model=model, args=args).create_optimizer()
    return Trainer(model=model, args=args).create_optimizer()


# conf/optim files and registry rows whose names legitimately differ: none. `custom` has both (its YAML holds
# the default target and kwargs, its row builds whatever class the config names); a user's own optimizer
# (docs/examples/conf/optim/sign_sgd.yaml: a name of their own that sets optim.target) has its YAML outside
# conf/ and no row, by design (optimizers.is_custom), so neither list below names it
CONFIG_WITHOUT_ROW: set[str] = set()
ROW_WITHOUT_CONFIG: set[str] = set()


def test_every_config_file_has_a_registry_row_and_every_row_a_config_file():
    """Adding an optimizer is one conf/optim/<name>.yaml and one registry row: neither without the other."""
    from omegaconf import OmegaConf

    from tests.conftest import CONF

    files = {p.stem: p for p in (CONF / "optim").glob("*.yaml")}
    rows = set(optimizers.REGISTRY)
    assert set(files) - rows == CONFIG_WITHOUT_ROW, "conf/optim/<name>.yaml with no registry row"
    assert rows - set(files) == ROW_WITHOUT_CONFIG, "registry rows with no conf/optim/<name>.yaml"
    for stem, path in files.items():
        assert OmegaConf.load(path).name == stem, f"{path.name} names another optimizer"


@pytest.mark.parametrize("optim", WITH_TRAINER_STRING)
def test_same_optimizer_and_settings_on_both_backends(optim, tmp_path):
    """The Trainer's optim= string and the registry factory build the same class with the same settings."""
    cfg = compose_cfg("model=tiny", f"optim={optim}", "train.weight_decay=0.01")
    model = models.load_model(cfg.model, num_labels=2)
    spec = optimizers.get(optim)
    from_trainer = trainer_optimizer(model, cfg, spec, tmp_path)
    direct = build(spec, model, cfg)
    assert type(from_trainer) is type(direct)
    if spec.in_backward == optimizers.LAYERWISE:  # transformers' dummy: compare the per-parameter optimizers
        assert [id(p) for p in from_trainer.optimizer_dict] == [id(p) for p in direct.optimizer_dict]
        for a, b in zip(from_trainer.optimizer_dict.values(), direct.optimizer_dict.values(), strict=True):
            assert_same_optimizer(a, b)
        return
    assert_same_optimizer(from_trainer, direct)


def assert_same_optimizer(from_trainer, direct):
    """Same class, settings and parameter groups."""
    assert type(from_trainer) is type(direct)
    assert from_trainer.defaults == direct.defaults
    assert len(from_trainer.param_groups) == len(direct.param_groups)
    for a, b in zip(from_trainer.param_groups, direct.param_groups, strict=True):
        assert [id(p) for p in a["params"]] == [id(p) for p in b["params"]]
        assert {k: v for k, v in a.items() if k != "params"} == {k: v for k, v in b.items() if k != "params"}


@pytest.mark.parametrize("optim", ["adamw_8bit", "lion_8bit", "paged_lion_8bit", "rmsprop_bnb_8bit"])
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


# ---- the newer optimizers, bring-your-own, the meta-device estimate ---------------------------------------

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
    optimizer = build(spec, model, cfg)
    if spec.needs_train_eval_mode:  # schedule-free: steps in train mode, as both backends run it
        optimizer.train()
    one_step(model, optimizer, models.vocab_size(model))
    return model, cfg, spec, optimizer


# the rest of the Trainer's optim= strings that run here (docs/optimizers.md, "Trainer optim= strings")
TRAINER_STRINGS = [
    "paged_adamw_32bit",
    "paged_lion_8bit",
    "paged_lion_32bit",
    "rmsprop_bnb_8bit",
    "rmsprop_bnb_32bit",
    "galore_adafactor",
    "schedule_free_radam",
    "schedule_free_sgd",
]


# fp32 on tiny and distilbert: tests/test_memory.py's registry-wide test; here the 16-bit weights
@pytest.mark.parametrize("precision", ["bf16_pure"])
@pytest.mark.parametrize("optim", NEW + TRAINER_STRINGS)
def test_new_optimizers_measured_state_equals_estimate(optim, precision):
    model, cfg, spec, optimizer = stepped("tiny", optim, precision)
    measured = optimizer_state_size(optimizer)
    assert measured.numel > 0
    assert measured == spec.estimate(optimizers.param_infos(model), cfg, None, model.config)


# CI's sample of the 16-bit distilbert rows (three states, parts, factored); make test-matrix runs the rest
@pytest.mark.parametrize("precision", ["bf16_pure"])
@pytest.mark.parametrize(
    "optim", ci_sample(NEW + TRAINER_STRINGS, ["ademamix_8bit", "muon", "came"], pytest.mark.slow)
)
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
    **dict.fromkeys(["paged_adamw_32bit", "paged_lion_8bit", "paged_lion_32bit"], "cget_managed_ptr"),
    "apollo_adamw": "META device type",  # draws its projection from a torch.Generator on the weight's device
    "apollo_adamw_layerwise": "META device type",  # (the same, per parameter)
    "adalomo": r"allocates its state with \.cuda\(\)",  # on the GPU, whatever its parameters' device
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


# ---- optimizers that update inside the backward pass (LOMO, AdaLomo, layer-wise GaLore) --------------------

IN_BACKWARD = [
    "lomo",
    "adalomo",
    "galore_adamw_layerwise",
    "galore_adafactor_layerwise",
    "apollo_adamw_layerwise",
]


# fp32 on tiny and distilbert: tests/test_memory.py's registry-wide test; here both precisions on both models
@pytest.mark.parametrize("precision", ["fp32", "bf16_pure"])
@pytest.mark.parametrize("optim", IN_BACKWARD)
def test_in_backward_measured_state_equals_estimate(optim, precision):
    model, cfg, spec, optimizer = stepped("tiny", optim, precision)
    assert all(p.grad is None for p in model.parameters())  # every gradient used and freed in backward
    measured = optimizer_state_size(optimizer)
    assert measured == spec.estimate(optimizers.param_infos(model), cfg, None, model.config)
    assert (measured.numel > 0) == (optim != "lomo")  # LOMO keeps nothing


@pytest.mark.parametrize("precision", ["fp32", "bf16_pure"])
@pytest.mark.parametrize(
    "optim", ci_sample(IN_BACKWARD, ["lomo", "adalomo", "apollo_adamw_layerwise"], pytest.mark.slow)
)
def test_in_backward_on_distilbert(optim, precision):
    model, cfg, spec, optimizer = stepped("distilbert-base-cased", optim, precision)
    assert optimizer_state_size(optimizer) == spec.estimate(
        optimizers.param_infos(model), cfg, None, model.config
    )


def test_adalomo_state_is_its_factored_second_moment():
    """AdaLomo keeps, outside `optimizer.state`, one fp32 row and column statistic per matrix and a full fp32
    statistic per vector: the accounting finds them there."""
    model, cfg, spec, optimizer = stepped("tiny", "adalomo", "bf16_pure")
    expected = sum(4 * (p.shape[0] + p.shape[1] if p.ndim > 1 else p.numel()) for p in model.parameters())
    assert len(optimizer.state) == 0
    assert optimizer_state_size(optimizer).bytes == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_adalomo_on_cuda_as_it_is():
    """AdaLomo unchanged on CUDA (its state where .cuda() puts it): measured == estimated."""
    pytest.importorskip(
        "lomo_optim", reason="AdaLomo needs lomo-optim (the optim extra: pip install -e '.[optim]')"
    )
    cfg = compose_cfg("model=tiny", "model.pretrained=false", "optim=adalomo")
    model = models.load_model(cfg.model, num_labels=2).cuda()
    spec = optimizers.get("adalomo")
    optimizer = spec.build(model, cfg)
    ids = torch.randint(0, models.vocab_size(model), (2, 16), device="cuda")
    loss = model(input_ids=ids, labels=torch.tensor([0, 1], device="cuda")).loss
    optimizer.fused_backward(loss, cfg.train.lr)
    assert optimizer_state_size(optimizer) == spec.estimate(
        optimizers.param_infos(model), cfg, None, model.config
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["optim=lomo", "launcher.nproc_per_job=2"],
            "optim=lomo is invalid with launcher.nproc_per_job=2 / train.sharding=none: it updates each "
            "parameter inside the backward pass, before gradients are averaged over processes (one process: "
            "launcher.nproc_per_job=1, train.sharding=none)",
        ),
        (
            ["optim=galore_adamw_layerwise", "plan=true"],
            "plan=true is invalid with optim=galore_adamw_layerwise: the plan models a separate optimizer step "
            "over all gradients, and this optimizer updates inside the backward pass (measure it by training)",
        ),
    ],
)
def test_in_backward_limits_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(*overrides))
    assert str(err.value) == message


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_adalomo_without_cuda_is_one_line():
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg("optim=adalomo"))
    assert str(err.value) == (
        "optim=adalomo needs a CUDA device: AdaLomo (lomo-optim) allocates its state with .cuda(), "
        "and torch sees none here"
    )


@pytest.mark.slow  # sweeps of the in-backward optimizers on both backends: CI (make test-ci)
def test_in_backward_optimizers_on_both_backends(tmp_path):
    """LOMO and layer-wise GaLore through the CLI on both backends (the Trainer by its own optim= string):
    the same state on both, equal to the estimate; the breakdown describes step 2 and LOMO's gradient part
    of the peak is near zero where AdamW's is the model's size."""
    from tests.conftest import run_cli, sweep_runs

    proc = run_cli(
        tmp_path, "-m", "optim=adamw,lomo,galore_adamw_layerwise", "backend=trainer,accelerator", "model=tiny",
        "train.max_steps=3", "train.padding=max_length", "data.max_train_samples=64",
        "data.max_eval_samples=16",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {(r.data.params["optim"], r.data.params["backend"]): r for r in sweep_runs(tmp_path)[1]}
    assert len(runs) == 6
    for (optim, backend), run in runs.items():
        m = run.data.metrics
        assert run.data.tags["peak_breakdown"] == "step 2", (optim, backend)
        assert m["optimizer_state_mb"] == m["estimated_optimizer_state_mb"], (optim, backend)
        assert m["optimizer_state_mb"] == runs[optim, "trainer"].data.metrics["optimizer_state_mb"]
        # the plan's step over all gradients is not theirs: no prediction, a tag saying why
        assert ("predicted_peak_mb" in m) == (optim == "adamw"), (optim, backend)
        assert run.data.tags["prediction_method"].startswith("none:") == (optim != "adamw")
    for backend in ("trainer", "accelerator"):
        adamw, lomo = (runs[o, backend].data.metrics for o in ("adamw", "lomo"))
        assert lomo["peak_grads_mb"] < 0.1 * adamw["peak_grads_mb"], backend
    assert runs["galore_adamw_layerwise", "trainer"].data.tags["trainer_optim"] == "galore_adamw_layerwise"
    assert runs["lomo", "trainer"].data.tags["trainer_optim"] == "lomo"


# ---- the Trainer's rmsprop_bnb alias; a custom optimizer under a name of the user's own ----------------------


def test_the_trainers_rmsprop_bnb_is_rmsprop_bnb_32bit(tmp_path):
    """The Trainer's optim="rmsprop_bnb" builds what optim=rmsprop_bnb_32bit builds (32-bit state): one
    registry name reaches both strings."""
    cfg = compose_cfg("model=tiny", "optim=rmsprop_bnb_32bit", "train.weight_decay=0.01")
    model = models.load_model(cfg.model, num_labels=2)
    spec = optimizers.get("rmsprop_bnb_32bit")
    alias = optimizers.OptimizerSpec(**{**vars(spec), "trainer_optim": "rmsprop_bnb"})
    from_trainer, direct = trainer_optimizer(model, cfg, alias, tmp_path), spec.build(model, cfg)
    assert_same_optimizer(from_trainer, direct)
    assert optimizers.built_settings(from_trainer) == optimizers.built_settings(direct)
    assert from_trainer.args.optim_bits == 32


USER_CONF = EXAMPLES / "conf"  # the worked example's own optim option: conf/optim/sign_sgd.yaml
SEARCHPATH = f"hydra.searchpath=[file://{USER_CONF}]"


def test_a_custom_optimizer_under_its_own_name(monkeypatch):
    """A user's optim file found through hydra.searchpath (defaults: [custom, _self_], its own name): it is
    the custom optimizer under that name (validated, built and meta-estimated as `custom`); a name the registry
    does not hold and no target is still refused in one line."""
    from pipeline.config import check_group_overrides
    from pipeline.keys import check_keys

    monkeypatch.syspath_prepend(str(EXAMPLES))
    cfg = compose_cfg("model=tiny", "optim=sign_sgd", SEARCHPATH)
    assert cfg.optim.name == "sign_sgd"
    validate(cfg)
    assert optimizers.spec_for(cfg.optim) is optimizers.REGISTRY["custom"]
    model = models.load_model(cfg.model, num_labels=2)
    optimizer = optimizers.spec_for(cfg.optim).build(model, cfg)
    assert type(optimizer).__name__ == "SignSGD" and optimizer.defaults["momentum"] == 0.9
    check_group_overrides(["-m", "optim=adamw,sign_sgd", SEARCHPATH])
    check_keys(["optim=sign_sgd", SEARCHPATH, "optim.kwargs={momentum: 0.8}"])  # custom.yaml's key
    with pytest.raises(ConfigError, match=r"optim=sign_sgd is invalid: allowed values are adafactor"):
        check_group_overrides(["optim=sign_sgd"])  # without the folder
    with pytest.raises(ConfigError, match=r"no key kwarg in optim"):
        check_keys(["optim=sign_sgd", SEARCHPATH, "optim.kwarg=1"])
    with pytest.raises(ConfigError, match=r"optim.name='sign_sgd' is invalid: allowed values are adamw, "):
        validate(compose_cfg("model=tiny", "optim=sign_sgd", SEARCHPATH, "optim.target=null"))


@pytest.mark.slow  # two sweeps: CI (make test-ci)
def test_a_custom_optimizer_beside_adamw_leaves_adamw_the_same_point(tmp_path):
    """The worked example's sweep (docs/optimizers.md#worked-example): adamw and the user's sign_sgd in one
    sweep; adamw's config hash is the one an adamw-only run records (so a rerun skips it), and sign_sgd's runs
    carry its own name, its state measured and meta-estimated."""
    from tests.conftest import run_cli, sweep_runs

    env = {"PYTHONPATH": str(EXAMPLES)}
    alone = run_cli(tmp_path / "alone", "-m", "optim=adamw", "model=tiny", "train.max_steps=2", env=env)
    sweep = ["-m", "optim=adamw,sign_sgd", SEARCHPATH, "model=tiny", "train.max_steps=2"]
    both = run_cli(tmp_path / "both", *sweep, env=env)
    assert alone.returncode == 0 and both.returncode == 0, (alone.stderr + both.stderr)[-3000:]
    (adamw_alone,) = sweep_runs(tmp_path / "alone")[1]
    runs = {r.data.params["optim"]: r for r in sweep_runs(tmp_path / "both")[1]}
    assert sorted(runs) == ["adamw", "sign_sgd"]
    assert runs["adamw"].data.tags["config_hash"] == adamw_alone.data.tags["config_hash"]
    sign = runs["sign_sgd"].data
    assert sign.metrics["optimizer_state_mb"] == sign.metrics["estimated_optimizer_state_mb"]
    assert sign.tags["state_estimate"].startswith("meta-device step")
    assert "sign_sgd-tiny" in runs["sign_sgd"].info.run_name
