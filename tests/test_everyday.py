"""Everyday use, replayed through the real CLI: a constant bad value fails a sweep at once (a swept one stays
a FAILED point), unknown names get a "did you mean", runs record their label names, find_batch_size's output
reads right, and every optimizer setting is shown and has the same effect on both backends."""

import inspect
import json
import re
import subprocess
import sys
import time

import pandas as pd
import pytest
from omegaconf import OmegaConf

from pipeline import MB, browse, job, models, optimizers
from pipeline.job import short_mb
from pipeline.memory import MemoryBudgetExceeded
from pipeline.report import runs as runs_of_store
from pipeline.state import optimizer_state_size
from pipeline.tracking import Tracker
from tests.conftest import CONF, ROOT, TINY, cli_env, compose_cfg, report_folder, run_cli, store, sweep_runs
from tests.test_memory import one_step
from tests.test_optimizers import trainer_optimizer

# a tiny job: the tiny model, few samples, two steps
QUICK = [
    "model=tiny",
    "train.max_steps=2",
    "data.max_train_samples=64",
    "data.max_eval_samples=16",
    "data.max_val_samples=16",
]


@pytest.fixture(scope="module")
def labelled_csv(tmp_path_factory):
    """Train and eval files with string labels and other column names than the defaults."""
    folder = tmp_path_factory.mktemp("csv")
    words = ["good", "bad", "great", "awful", "fine", "boring", "lovely", "dull"]
    rows = [(f"{words[i % 8]} film number {i}", "pos" if i % 8 in (0, 2, 4, 6) else "neg") for i in range(48)]
    frame = pd.DataFrame(rows, columns=["sentence", "sentiment"])
    frame.iloc[:40].to_csv(folder / "train.csv", index=False)
    frame.iloc[40:].to_csv(folder / "eval.csv", index=False)
    return folder


CSV = ["data=csv", "data.train_file={csv}/train.csv", "data.eval_file={csv}/eval.csv"]
LABELLED = [*CSV, "data.text_column=sentence", "data.label_column=sentiment"]


def filled(args, folder) -> list[str]:
    return [a.format(csv=folder) for a in args]


# --- 1. a constant bad value fails the whole command at once ------------------------------------------------

CONSTANT_BAD = [
    (["-m", "optim=adamw,adafactor", "train.lr=-1e-4"], "train.lr=-0.0001 is invalid: must be a number > 0"),
    (
        ["-m", "optim=adamw,sgd", "optim.lr=-1"],
        "optim.lr=-1 is invalid: must be a number > 0 (each conf/optim/*.yaml sets its optimizer's reference rate)",
    ),
    (
        ["-m", "seed=0,1", *CSV, "data.text_column=sentence"],
        "data.label_column='label' is invalid: data.train_file has the columns sentence, sentiment",
    ),
    # the command line's value beats the sweeper's own list (+protocol=tune_lr sweeps seed=0,1,2)
    (["-m", "+protocol=tune_lr", "optim=adamw", "seed=-1"], "seed=-1 is invalid: must be an integer >= 0"),
    (
        ["-m", "batch_size=4,8", "train.precision=bf61"],
        "train.precision='bf61' is invalid: did you mean bf16? allowed values are fp32, bf16, fp16, bf16_pure",
    ),
]


@pytest.mark.parametrize(("args", "message"), CONSTANT_BAD, ids=[" ".join(a) for a, _ in CONSTANT_BAD])
def test_a_constant_bad_value_fails_a_sweep_at_once(args, message, labelled_csv, tmp_path):
    start = time.perf_counter()
    proc = run_cli(tmp_path, *filled(args, labelled_csv), *QUICK)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.strip() == f"error: {message}"  # the single-run line
    assert "[sweep]" not in proc.stdout and "Launching" not in proc.stdout
    assert list(tmp_path.iterdir()) == []  # no run was opened, no report built, no folder made
    assert elapsed < 15  # about 1.5 s here; no point was composed


def test_a_constant_invalid_only_with_a_swept_value_stays_a_failed_point(tmp_path):
    """train.max_length=1000 is bad because of the model, which the sweep varies: each point is a FAILED run
    of its own (here both models take 512 tokens), as a swept bad value is."""
    proc = run_cli(tmp_path, "-m", "model=tiny,minilm", "train.max_length=1000", "train.max_steps=2")
    assert proc.returncode == 1, proc.stderr[-2000:]
    parent, children = sweep_runs(tmp_path)
    assert parent.info.status == "FAILED"
    errors = sorted(r.data.tags["error"] for r in children)
    assert errors == [
        "ConfigError: train.max_length=1000 is invalid: model minilm takes at most 512 tokens",
        "ConfigError: train.max_length=1000 is invalid: model tiny takes at most 512 tokens",
    ]
    assert {r.data.tags["failure_reason"] for r in children} == {"config"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["optim=adafactr"],
            "optim=adafactr is invalid: did you mean adafactor? allowed values are {optims}",
        ),
        (
            ["-m", "model=tiny,minilmm"],
            "model=minilmm is invalid: did you mean minilm? allowed values are {models}",
        ),
        (
            ["train.padding=longset"],
            "train.padding='longset' is invalid: did you mean longest? allowed values are longest, max_length",
        ),
        (["backend=deepspeed"], "backend=deepspeed is invalid: allowed values are accelerator, trainer"),
        # a swept value that no point could use stops the sweep before any job, as it would a single run
        (["-m", "model=tiny", "batch_size=8,-1"], "batch_size=-1 is invalid: must be a positive integer"),
        (
            ["-m", "optim=adamw,sgd", "train.padding=longest,longset"],
            "train.padding='longset' is invalid: did you mean longest? allowed values are longest, max_length",
        ),  # fmt: skip
    ],
)
def test_unknown_names_get_a_did_you_mean_when_one_is_close(args, message, tmp_path):
    names = {g: ", ".join(sorted(p.stem for p in (CONF / g).glob("*.yaml"))) for g in ("optim", "model")}
    proc = run_cli(tmp_path, *args)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: " + message.format(optims=names["optim"], models=names["model"])
    assert list(tmp_path.iterdir()) == []


# --- 4 and 6. label names; optimizer settings with the same effect on both backends --------------------------


@pytest.fixture(scope="module")
def adafactor_both_backends(labelled_csv, tmp_path_factory):
    """Adafactor with settings its Trainer optim= string cannot carry (its own relative step size, first
    moment, clipping), on both backends, on string labels."""
    tmp = tmp_path_factory.mktemp("settings")
    proc = run_cli(
        tmp,
        "-m",
        "backend=trainer,accelerator",
        "optim=adafactor",
        "optim.beta1=0.9",
        "optim.clip_threshold=0.5",
        "optim.relative_step=true",
        "optim.warmup_init=true",
        *filled(LABELLED, labelled_csv),
        *QUICK,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r.data.params["backend"]: r for r in sweep_runs(tmp)[1]}


def test_each_run_records_its_label_names_in_class_id_order(adafactor_both_backends):
    for run in adafactor_both_backends.values():
        assert json.loads(run.data.params["label_names"]) == {"0": "neg", "1": "pos"}  # sorted: neg is 0


def test_the_loaded_model_carries_id2label(labelled_csv):
    cfg = compose_cfg(*filled(LABELLED, labelled_csv), *QUICK)
    _, splits, model = job.load(cfg)
    assert model.config.id2label == {0: "neg", 1: "pos"}
    assert model.config.label2id == {"neg": 0, "pos": 1}
    assert json.loads(model.config.to_json_string())["id2label"] == {"0": "neg", "1": "pos"}


def test_a_setting_has_the_same_effect_on_both_backends(adafactor_both_backends):
    trainer, accelerator = adafactor_both_backends["trainer"], adafactor_both_backends["accelerator"]
    settings = json.loads(trainer.data.params["optim_settings"])
    assert settings == json.loads(accelerator.data.params["optim_settings"])
    assert settings["beta1"] == 0.9 and settings["clip_threshold"] == 0.5 and settings["relative_step"]
    assert {trainer.info.status, accelerator.info.status} == {"FINISHED"}
    assert trainer.data.tags["trainer_optim"] == "none: handed the registry's optimizer object"
    for run in (trainer, accelerator):  # beta1 adds a full exp_avg: the estimate follows it to the byte
        metrics = run.data.metrics
        assert metrics["optimizer_state_bytes"] == pytest.approx(metrics["estimated_optimizer_state_mb"] * MB)


def test_cfg_job_shows_every_optimizer_setting(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "--cfg", "job", "optim=adafactor"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    shown = OmegaConf.create(proc.stdout).optim
    assert OmegaConf.to_container(shown) == {
        "name": "adafactor",
        "lr": 1.58e-4,
        "lr_tuned": True,
        "eps": [1e-30, 0.001],
        "clip_threshold": 1.0,
        "decay_rate": -0.8,
        "beta1": None,
        "scale_parameter": False,
        "relative_step": False,
        "warmup_init": False,
    }


OPTIMIZER_CLASS = {
    "adamw": "torch.optim.AdamW",
    "adafactor": "transformers.optimization.Adafactor",
    "adafactor_torch": "torch.optim.Adafactor",
    "sgd": "torch.optim.SGD",
    "adamw_8bit": "bitsandbytes.optim.AdamW",
    "paged_adamw_8bit": "bitsandbytes.optim.AdamW",
    "lion_8bit": "bitsandbytes.optim.Lion",
    "lion_32bit": "bitsandbytes.optim.Lion",
    "adamw_torchao_8bit": "torchao.optim.AdamW8bit",
    "adamw_torchao_4bit": "torchao.optim.AdamW4bit",
    "adamw_torchao_fp8": "torchao.optim.AdamWFp8",
    "galore_adamw": "galore_torch.GaLoreAdamW",
    "adam_mini": "adam_mini.Adam_mini",
    "schedule_free_adamw": "schedulefree.AdamWScheduleFree",
    "adamw_fused": "torch.optim.AdamW",
    "muon": "pipeline.muon.MuonWithAdamW",
    "ademamix": "bitsandbytes.optim.AdEMAMix",
    "ademamix_8bit": "bitsandbytes.optim.AdEMAMix",
    "adagrad": "torch.optim.Adagrad",
    "rmsprop": "torch.optim.RMSprop",
    "stable_adamw": "optimi.StableAdamW",
    "came": "came_pytorch.CAME",
    "prodigy": "prodigyopt.Prodigy",
    "apollo_adamw": "apollo_torch.APOLLOAdamW",
    "paged_adamw_32bit": "bitsandbytes.optim.AdamW",
    "paged_lion_8bit": "bitsandbytes.optim.Lion",
    "paged_lion_32bit": "bitsandbytes.optim.Lion",
    "rmsprop_bnb_8bit": "bitsandbytes.optim.RMSprop",
    "rmsprop_bnb_32bit": "bitsandbytes.optim.RMSprop",
    "galore_adafactor": "galore_torch.GaLoreAdafactor",
    "schedule_free_radam": "schedulefree.RAdamScheduleFree",
    "schedule_free_sgd": "schedulefree.SGDScheduleFree",
    "lomo": "lomo_optim.Lomo",
    "adalomo": "lomo_optim.AdaLomo",
    "galore_adamw_layerwise": "galore_torch.GaLoreAdamW",
    "galore_adafactor_layerwise": "galore_torch.GaLoreAdafactor",
    "apollo_adamw_layerwise": "apollo_torch.APOLLOAdamW",
}
# where a config deliberately differs from the constructor's own default (and why)
NOT_THE_CONSTRUCTORS = {
    ("adafactor", "scale_parameter"): False,  # the Trainer's optim="adafactor" settings
    ("adafactor", "relative_step"): False,  # (an external rate: train.lr)
    ("sgd", "momentum"): 0.9,
    ("adamw_torchao_4bit", "block_size"): 256,  # what the Trainer passes
    ("galore_adafactor", "scale_parameter"): False,  # as adafactor's: the Trainer's settings
    ("galore_adafactor", "relative_step"): False,
    ("galore_adafactor_layerwise", "scale_parameter"): False,  # (galore_adafactor's settings)
    ("galore_adafactor_layerwise", "relative_step"): False,
}
NOT_CONSTRUCTOR_ARGUMENTS = {"target_modules", "rank", "update_proj_gap", "scale", "proj_type", "names"}
NOT_CONSTRUCTOR_ARGUMENTS |= {"proj", "scale_type", "adamw_names"}  # APOLLO's group settings; Muon's head
# constructor arguments that are no setting of the optimizer: where it runs and how it is implemented, what
# the pipeline sets from train.* or the model, and what selects the registry entry itself
SWITCHES = {"foreach", "fused", "capturable", "differentiable", "maximize", "verbose", "model_sharding"}
SWITCHES |= {
    "triton",
    "gradient_release",
    "fsdp_in_use",
}  # optimi's kernels and fused backward; Prodigy's FSDP
FROM_ELSEWHERE = {"weight_decay", "warmup_steps", "dim", "n_heads", "n_kv_heads", "no_deprecation_warning"}
IDENTITY = {"optim_bits", "is_paged", "args", "model"}  # (LOMO takes the model itself)
TORCHAO = ("adamw_torchao_8bit", "adamw_torchao_4bit", "adamw_torchao_fp8")
RMSPROP_BNB = ("rmsprop_bnb_8bit", "rmsprop_bnb_32bit")
LEFT_OUT = {
    ("adamw_8bit", "amsgrad"): "bitsandbytes' 8-bit AdamW has no amsgrad",
    ("paged_adamw_8bit", "amsgrad"): "bitsandbytes' 8-bit AdamW has no amsgrad",
    ("lion_32bit", "min_8bit_size"): "no effect on 32-bit state",
    ("ademamix", "min_8bit_size"): "no effect on 32-bit state",
    **{(o, "min_8bit_size"): "no effect on 32-bit state" for o in ("paged_lion_32bit", "rmsprop_bnb_32bit")},
    ("paged_adamw_32bit", "min_8bit_size"): "no effect on 32-bit state",
    ("paged_adamw_32bit", "amsgrad"): "bitsandbytes' AdamW ignores it",
    **{(o, "centered"): "bitsandbytes' RMSprop refuses it" for o in RMSPROP_BNB},
    **{(o, "amsgrad"): "torchao's low-bit states cannot take it" for o in TORCHAO},
    # the Trainer builds LOMO and AdaLomo from the model and the rate only, and clips nothing in them
    # (docs/optimizers.md, "Updating inside the backward pass"): what it cannot pass is not shown either
    **{
        (o, key): "the Trainer's lomo/adalomo path passes only the model and the rate"
        for o, keys in (("lomo", ("loss_scale_args",)), ("adalomo", ()))
        for key in ("clip_grad_norm", "clip_grad_value", *keys)
    },
    **{
        ("adalomo", key): "the Trainer's adalomo path passes only the model and the rate"
        for key in ("eps", "clip_threshold", "decay_rate", "loss_scale")
    },
}


def constructor(name: str):
    module, _, cls = OPTIMIZER_CLASS[name].rpartition(".")
    return getattr(__import__(module, fromlist=[cls]), cls)


def plain(value):
    return list(value) if isinstance(value, tuple) else value


@pytest.mark.parametrize("optim", sorted(set(optimizers.REGISTRY) - {"custom"}))  # custom: any class
def test_each_config_shows_the_constructors_settings_and_defaults(optim):
    """Every conf/optim setting is an argument of the optimizer's constructor with the constructor's default
    (or a documented exception), and the optimizer is built with it."""
    cfg = compose_cfg("model=tiny", f"optim={optim}")
    shown = optimizers.settings(cfg)
    signature = inspect.signature(constructor(optim)).parameters
    for key, value in shown.items():
        if key in NOT_CONSTRUCTOR_ARGUMENTS:
            continue
        assert key in signature, f"{optim}: {key} is not a constructor argument"
        default = NOT_THE_CONSTRUCTORS.get((optim, key), plain(signature[key].default))
        assert value == default, f"{optim}: {key}={value}, the constructor's default is {default}"
    arguments = set(signature) - {"self", "params", "named_parameters", "lr"}
    left_out = arguments - set(shown) - SWITCHES - FROM_ELSEWHERE - IDENTITY
    assert left_out == {key for o, key in LEFT_OUT if o == optim}, left_out


# a setting changed from its default: the Trainer's own path carries it, or the Trainer is handed the object
CHANGED = [
    ("adamw", ["optim.betas=[0.8,0.99]", "optim.eps=1e-6"], "adamw_torch"),
    ("adamw", ["optim.amsgrad=true"], None),
    ("adafactor", ["optim.clip_threshold=0.5", "optim.beta1=0.9"], None),
    ("adafactor", ["optim.relative_step=true", "optim.warmup_init=true", "optim.scale_parameter=true"], None),
    ("adafactor_torch", ["optim.beta2_decay=-0.5", "optim.d=2.0", "optim.eps=[1e-30,1e-2]"], None),
    ("sgd", ["optim.momentum=0.8", "optim.nesterov=true"], "sgd"),
    ("sgd", ["optim.momentum=0.5", "optim.dampening=0.1"], "sgd"),
    ("adamw_8bit", ["optim.betas=[0.8,0.99]"], "adamw_bnb_8bit"),
    ("adamw_8bit", ["optim.min_8bit_size=1024"], None),
    ("lion_8bit", ["optim.min_8bit_size=1024"], None),
    ("adamw_torchao_8bit", ["optim.betas=[0.8,0.99]"], "adamw_torch_8bit"),
    ("adamw_torchao_8bit", ["optim.bf16_stochastic_round=true"], None),
    ("adamw_torchao_4bit", ["optim.block_size=128"], None),
    ("galore_adamw", ["optim.rank=8", "optim.scale=0.5"], "galore_adamw"),
    ("galore_adamw", ["optim.correct_bias=false"], None),
    ("schedule_free_adamw", ["optim.r=0.5", "optim.weight_lr_power=1.0"], "schedule_free_adamw"),
    ("paged_adamw_32bit", ["optim.betas=[0.8,0.99]", "optim.eps=1e-6"], "paged_adamw_32bit"),
    ("rmsprop_bnb_32bit", ["optim.alpha=0.9"], None),
    ("rmsprop_bnb_8bit", ["optim.momentum=0.5"], None),
    ("galore_adafactor", ["optim.rank=8", "optim.scale=0.5"], "galore_adafactor"),
    ("galore_adafactor", ["optim.clip_threshold=0.5"], None),
    ("schedule_free_radam", ["optim.r=0.5", "optim.betas=[0.8,0.99]"], "schedule_free_radam"),
    ("schedule_free_radam", ["optim.silent_sgd_phase=false"], None),
    ("schedule_free_sgd", ["optim.r=0.5", "optim.weight_lr_power=1.0"], "schedule_free_sgd"),
    ("schedule_free_sgd", ["optim.momentum=0.8"], None),
]


@pytest.mark.parametrize(("optim", "changes", "string"), CHANGED, ids=[" ".join(c[1]) for c in CHANGED])
def test_a_changed_setting_reaches_the_trainer(optim, changes, string, tmp_path):
    """The Trainer backend keeps its own optim= string where that path carries the setting (and then builds
    what the Accelerator loop builds), and is handed the registry's object where it cannot."""
    cfg = compose_cfg("model=tiny", f"optim={optim}", "train.weight_decay=0.01", *changes)
    spec = optimizers.get(optim)
    assert spec.trainer_string(cfg) == string
    model = models.load_model(cfg.model, num_labels=2)
    direct = spec.build(model, cfg)
    if string is None:
        return  # the Trainer steps `direct` itself (Trainer(optimizers=(direct, None)))
    try:
        from_trainer = trainer_optimizer(model, cfg, spec, tmp_path)
    finally:
        if "bnb" in string:
            import bitsandbytes as bnb

            bnb.optim.GlobalOptimManager.get_instance().initialize()  # the Trainer's overrides are global
    assert type(from_trainer) is type(direct)
    assert optimizers.built_settings(from_trainer) == optimizers.built_settings(direct)
    for a, b in zip(from_trainer.param_groups, direct.param_groups, strict=True):
        assert {k: v for k, v in a.items() if k != "params"} == {k: v for k, v in b.items() if k != "params"}


STATE_CHANGES = [
    ("adamw", ["optim.amsgrad=true"]),
    ("adafactor", ["optim.beta1=0.9"]),
    ("sgd", ["optim.momentum=0", "optim.nesterov=false"]),
    ("adamw_8bit", ["optim.min_8bit_size=1024"]),
    ("adamw_torchao_4bit", ["optim.block_size=128"]),
]


@pytest.mark.parametrize(("optim", "changes"), STATE_CHANGES, ids=[" ".join(c) for _, c in STATE_CHANGES])
def test_the_estimate_follows_a_setting_that_changes_the_state(optim, changes):
    cfg = compose_cfg("model=tiny", f"optim={optim}", *changes)
    spec = optimizers.get(optim)
    model = models.load_model(cfg.model, num_labels=2)
    optimizer = spec.build(model, cfg)
    one_step(model, optimizer, models.vocab_size(model))
    default = spec.estimate(optimizers.param_infos(model), compose_cfg(f"optim={optim}"), None, model.config)
    estimated = spec.estimate(optimizers.param_infos(model), cfg, None, model.config)
    assert optimizer_state_size(optimizer) == estimated != default


# --- 5. find_batch_size ---------------------------------------------------------------------------------


def merged_cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """The real CLI with stdout and stderr in one stream, unbuffered: what a terminal shows, in order."""
    env = cli_env()
    env["PYTHONUNBUFFERED"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args, f"outputs_dir={tmp_path}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
    )


@pytest.mark.slow  # two searches (about 40 s on 2 cores): make test-slow
def test_find_batch_size_reads_right_on_both_backends(tmp_path):
    proc = merged_cli(
        tmp_path,
        "-m",
        "find_batch_size=true",
        "memory_budget_mb=50",  # batch 2 fits (43 MB), 3 and 4 do not: four short probes
        "backend=trainer,accelerator",
        "model=tiny",
        "train.max_length=512",
        "data.max_train_samples=8",
        "data.max_eval_samples=16",
        "data.max_val_samples=16",
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:]
    # the summary counts the searches as the finished jobs they are
    assert "[sweep] 2 jobs: 2 finished (2 largest-batch searches), 0 failed" in out
    # every probe line on a line of its own, never after a progress bar
    pieces = re.split(r"[\r\n]", out)
    probes = [p for p in pieces if "[find_batch_size]" in p]
    assert any("does not fit" in p for p in probes) and any(": fits" in p for p in probes)
    assert all(p.startswith("[find_batch_size] batch ") for p in probes), probes
    # a failure never reads as a tie with the budget
    for line in probes:
        found = re.search(r"budget of ([\d.]+) MB exceeded: ([\d.]+) MB of tensors live", line)
        if found:
            assert found[1] != found[2], line
    runs = sweep_runs(tmp_path)[1]
    assert {r.data.params["backend"] for r in runs} == {"trainer", "accelerator"}
    assert all(r.info.status == "FINISHED" and r.data.metrics["max_batch_size"] == 2 for r in runs)


def test_a_budget_failure_never_rounds_into_a_tie():
    err = MemoryBudgetExceeded(40 * MB, 40 * MB + 1234)
    assert str(err) == "CPU memory budget of 40.000 MB exceeded: 40.001 MB of tensors live (1,234 bytes over)"
    err = MemoryBudgetExceeded(40 * MB, int(41.3 * MB))
    assert str(err).startswith("CPU memory budget of 40.0 MB exceeded: 41.3 MB of tensors live")


def test_reruns_still_recognise_points_recorded_before_the_settings_were_shown(tmp_path):
    """conf/optim gained settings (at the values earlier runs used): a point's config hash is unchanged."""
    from pipeline.runner import config_hash

    for optim, added in optimizers.ADDED_SETTINGS.items():
        cfg = compose_cfg("model=tiny", f"optim={optim}")
        assert {k: optimizers.settings(cfg)[k] for k in added} == added, optim
        before = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
        for key in added:
            del before.optim[key]
        assert config_hash(cfg) == config_hash(before), optim


# --- 2. reruns: a rerun of recorded points, a forced point, pooled reports -----------------------------------


def report_cli(*args: str) -> subprocess.CompletedProcess:
    """The real `python -m pipeline.report`, from the repository root, with no store in the environment."""
    env = cli_env()
    return subprocess.run(
        [sys.executable, "-m", "pipeline.report", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def reruns(labelled_csv, tmp_path_factory):
    """One store, three sweeps: adamw and adamw_8bit (Trainer) on string labels; the same again (every point
    recorded: skipped); adamw again with force=true."""
    tmp = tmp_path_factory.mktemp("reruns")
    args = [*filled(LABELLED, labelled_csv), *QUICK]
    procs = [
        run_cli(tmp, "-m", "optim=adamw,adamw_8bit", *args),
        run_cli(tmp, "-m", "optim=adamw,adamw_8bit", *args),
        run_cli(tmp, "-m", "optim=adamw", "force=true", *args),
    ]
    for proc in procs:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    client = store(tmp)
    sweeps = []
    for folder in sorted(tmp.glob("multirun/*")):
        ids = json.loads((folder / "mlflow_sweep.json").read_text())
        parent = client.get_run(ids["parent_run_id"])
        children = client.search_runs(
            [ids["experiment_id"]], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
        )
        sweeps.append((parent, {r.data.params["optim"]: r for r in children}))
    return {"tmp": tmp, "procs": procs, "sweeps": sweeps, "client": client}


def test_a_rerun_of_recorded_points_prints_their_table_and_refers_to_their_runs(reruns):
    (first, runs), (rerun, none), _ = reruns["sweeps"]
    out = reruns["procs"][1].stdout
    assert "[sweep] 0 jobs: 0 finished, 0 failed, 2 skipped (FINISHED before)" in out
    # the recorded results' table (their rates differ: an lr column; a collapsed run is marked)
    assert re.search(r"^\s*tiny .* adamw(?: \(collapsed\))?\s+0\.000158\s+1 ", out, re.MULTILINE), out
    eight_bit = (
        r"^\s*tiny .* adamw_8bit \(Trainer: fp32 embedding state\)(?: \(collapsed\))?\s+0\.000050\s+1 "
    )
    assert re.search(eight_bit, out, re.MULTILINE)
    assert "eval F1 is the F1 of class 1, pos (classes 0 = neg, 1 = pos" in out
    # the parent is closed as a reference to the runs it found, with their report
    assert none == {} and rerun.info.status == "FINISHED"
    assert rerun.data.metrics["jobs"] == 0 and rerun.data.metrics["jobs_skipped"] == 2
    found = {v for k, v in rerun.data.tags.items() if k.startswith("skipped_run.")}
    assert found == {r.info.run_id for r in runs.values()}
    assert (reruns["tmp"] / "report" / report_folder(rerun) / "report.html").exists()
    # its row in MLflow reads the figures of the runs it found: the lowest peak, the best F1 of a model that
    # learned (or says none did)
    found_runs = list(runs.values())
    peak = min(found_runs, key=lambda r: r.data.metrics["peak_memory_mb"])
    assert rerun.data.metrics["peak_memory_mb"] == peak.data.metrics["peak_memory_mb"]
    description = rerun.data.tags["mlflow.note.content"]
    assert description.startswith(f"lowest peak {short_mb(peak.data.metrics['peak_memory_mb'])} MB ")
    learned = [r for r in found_runs if r.data.tags["collapsed"] == "false"]
    if learned:
        assert rerun.data.metrics["eval_f1"] == max(r.data.metrics["eval_f1"] for r in learned)
    else:
        assert "eval_f1" not in rerun.data.metrics and "no model learned (all collapsed)" in description
    # its saved view lists the runs it found, by id: the filter finds them in the store
    experiment_id = rerun.info.experiment_id
    url = browse.sweep_url(Tracker(f"sqlite:///{reruns['tmp']}/mlflow.db"), rerun)
    assert url.endswith(f"viewStateShareKey=sweep-{rerun.info.run_id}")
    view = json.loads(
        reruns["client"]
        .get_experiment(experiment_id)
        .tags[f"mlflow.sharedViewState.sweep-{rerun.info.run_id}"]
    )
    state = json.loads(view["state"])
    assert view["name"].startswith(f"{rerun.info.run_name} (")
    listed = reruns["client"].search_runs([experiment_id], filter_string=state["searchFilter"])
    assert {r.info.run_id for r in listed} == found
    assert state["orderByKey"] == "metrics.`eval_macro_f1`" and state["orderByAsc"] is False


def test_a_forced_point_marks_the_run_it_replaces(reruns):
    (_, first), _, (_, forced) = reruns["sweeps"]
    old = reruns["client"].get_run(first["adamw"].info.run_id)
    assert old.data.tags["replaced_by"] == forced["adamw"].info.run_id
    assert forced["adamw"].data.tags["replaces"] == old.info.run_id
    assert "replaced_by" not in reruns["client"].get_run(first["adamw_8bit"].info.run_id).data.tags


def test_a_pooled_report_counts_each_point_once(reruns, tmp_path):
    (first, _), _, (forced, runs) = reruns["sweeps"]
    names = [report_folder(first), forced.info.run_name]  # a sweep by its folder, one by its name
    proc = report_cli(
        f"outputs_dir={reruns['tmp']}", "--sweep", names[0], "--sweep", names[1], "--out", str(tmp_path)
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = pd.read_csv(tmp_path / "comparison.csv")
    assert dict(zip(table.optimizer, table["n [seeds]"], strict=True)) == {"adamw": 1, "adamw_8bit": 1}
    jobs = pd.read_csv(tmp_path / "runs.csv")
    assert runs["adamw"].info.run_id in set(jobs.run_id)  # the latest FINISHED run of the point
    report = (tmp_path / "report.md").read_text()
    assert "each point counted once: the latest FINISHED run per config hash" in report
    assert "1 earlier run of the same points left out" in report


# --- 3. the report follows the sweep's store, reports a single run, lists sweeps ---------------------------


def test_the_report_follows_the_outputs_dir_a_sweep_used(reruns):
    tmp = reruns["tmp"]
    _, _, (forced, _) = reruns["sweeps"]
    for args in ([f"outputs_dir={tmp}"], ["--outputs-dir", str(tmp)]):
        proc = report_cli(*args)
        assert proc.returncode == 0, proc.stderr[-2000:]
        # the latest sweep with results, and the report under that outputs_dir, not ./outputs
        assert f"report: {tmp}/report/{report_folder(forced)}/report.html" in proc.stdout
    assert not (ROOT / "outputs" / "report" / report_folder(forced)).exists()


def test_a_sweep_in_a_folder_of_its_own_reports_where_its_own_report_went(tmp_path):
    """hydra.sweep.dir puts the sweep outside outputs_dir: `make report` (no outputs_dir given) still writes
    under the sweep's outputs_dir, where the sweep's end wrote its report, not two folders above the sweep."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere" / "s"
    proc = run_cli(out, "-m", "seed=0", *TINY, "train.max_steps=1", f"hydra.sweep.dir={elsewhere}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "report" / "sweep-s" / "report.html").exists()
    again = report_cli(f"tracking.uri=sqlite:///{out}/mlflow.db")
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"report: {out}/report/sweep-s/report.html" in again.stdout
    assert not (tmp_path / "report").exists()


def test_the_report_of_a_single_run(reruns):
    (_, runs), _, _ = reruns["sweeps"]
    run = runs["adamw_8bit"]
    proc = report_cli(f"tracking.uri=sqlite:///{reruns['tmp']}/mlflow.db", "--run", run.info.run_id)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = reruns["tmp"] / "report" / run.info.run_name
    assert f"report: {out}/report.html" in proc.stdout
    assert list(pd.read_csv(out / "runs.csv").run_id) == [run.info.run_id]
    bad = report_cli(f"outputs_dir={reruns['tmp']}", "--run", "0" * 32)
    assert bad.returncode == 2 and bad.stderr.strip().endswith(
        f"no run with id '{'0' * 32}' in sqlite:///{reruns['tmp']}/mlflow.db"
    )


def test_list_shows_the_sweeps_of_a_store(reruns):
    proc = report_cli("--list", f"outputs_dir={reruns['tmp']}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == f"store: sqlite:///{reruns['tmp']}/mlflow.db"
    header = "folder experiment status jobs finished skipped started (UTC) parent run sweep"
    assert lines[1].split() == header.split()
    rows = [line.split() for line in lines[2:]]
    sweeps = reruns["sweeps"]
    assert [r[0] for r in rows] == [report_folder(parent) for parent, _ in sweeps]
    assert [r[2:6] for r in rows] == [
        ["FINISHED", "2", "2", "0"],
        ["FINISHED", "0", "0", "2"],
        ["FINISHED", "1", "1", "0"],
    ]
    assert [r[8] for r in rows] == [parent.info.run_id for parent, _ in sweeps]
    # each named by what it swept, without where its results went (outputs_dir)
    assert [" ".join(r[9:]) for r in rows] == [parent.info.run_name for parent, _ in sweeps]
    assert [r[9:11] for r in rows] == [["optim=adamw,adamw_8bit", "data=csv"]] * 2 + [
        ["optim=adamw", "force=true"]
    ]
    assert not any("outputs_dir" in " ".join(r) for r in rows)
    # a name the same command gave two sweeps selects the later one; a folder, exactly that sweep
    first, again = sweeps[0][0], sweeps[1][0]
    uri = f"sqlite:///{reruns['tmp']}/mlflow.db"
    assert runs_of_store.find_sweeps(uri, [first.info.run_name]).run_id.tolist() == [again.info.run_id]
    assert runs_of_store.find_sweeps(uri, [report_folder(first)]).run_id.tolist() == [first.info.run_id]


# --- 4 and 7. the report says what it shows ----------------------------------------------------------------


def test_the_report_says_which_class_f1_is_for_and_names_the_trainer_variant(reruns):
    (first, _), _, _ = reruns["sweeps"]
    report = (reruns["tmp"] / "report" / report_folder(first) / "report.md").read_text()
    assert "eval F1 is the F1 of class 1, `pos` (classes 0 = neg, 1 = pos; param `label_names`)" in report
    comparison = report.split("## Comparison")[1].split("###")[0]
    # (a collapsed run's row is marked so)
    assert re.search(r"\| adamw_8bit \(Trainer: fp32 embedding state\)(?: \(collapsed\))? \|", comparison)
    assert re.search(r"\| adamw(?: \(collapsed\))? \|", comparison)  # the plain one: no Trainer label
    assert (
        "`adamw_8bit (Trainer: fp32 embedding state)`: the Trainer's bitsandbytes 8-bit path keeps" in report
    )
    assert "(Trainer `optim=adamw_bnb_8bit`)" in report


def test_the_breakdown_is_titled_as_the_parts_at_the_peak_with_its_phase(reruns):
    from pipeline.report.tables import peak_phase

    (first, _), _, _ = reruns["sweeps"]
    folder = reruns["tmp"] / "report" / report_folder(first)
    report = (folder / "report.md").read_text()
    assert (
        "*Memory at the moment of the peak of the profiled step, by part (not each part's own maximum)"
        in report
    )
    assert (folder / "peak_breakdown.png").exists()
    table = pd.read_csv(folder / "comparison.csv")
    assert set(peak_phase(table)) <= {"forward", "backward", "step"} and "" not in set(peak_phase(table))


def test_f1_plot_labels_of_points_on_top_of_each_other_do_not_collide(tmp_path):
    from pipeline.report.plots import _colors, plot_f1_peak

    rows = [("adamw", 8), ("adamw", 16), ("adafactor", 8), ("adafactor", 16)]
    table = pd.DataFrame(
        {
            "model": "tiny",
            "batch_size": [bs for _, bs in rows],
            "backend": "trainer",
            "precision": "fp32",
            "optim": [o for o, _ in rows],
            "peak [MB]": [22.9, 22.9, 15.4, 15.4],  # the same peak and F1 at both batch sizes
            "peak [MB] std": float("nan"),
            "eval F1 [0-1]": 0.0,
            "eval F1 [0-1] std": float("nan"),
        }
    )
    boxes = plot_f1_peak(table, _colors(["adamw", "adafactor"]), tmp_path / "f1.png")
    assert len(boxes) == 4
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])


# --- 7. --help; an unknown key -------------------------------------------------------------------------------


def test_help_names_the_app_and_describes_each_config_group():
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("optimizer-sweep: fine-tune one model with each optimizer")
    assert "powered by Hydra" not in proc.stdout
    # (conf/hydra/ holds Hydra's own groups: its sweeper, not a choice of the app's)
    groups = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "hydra")
    section = proc.stdout.split("== Config groups (group=option) ==\n")[1].split("\n\n")[0].splitlines()
    assert [line.split()[0] for line in section] == groups
    for line, group in zip(section, groups, strict=True):
        options = ", ".join(sorted(p.stem for p in (CONF / group).glob("*.yaml")))
        assert line.endswith(f"; options: {options}") and len(line.split(";")[0].split()) > 3, line


TRAIN_KEYS = (
    "max_steps, gradient_accumulation_steps, lr, lr_scale, max_length, weight_decay, lr_scheduler, warmup_steps, max_grad_norm, precision, "
    "padding, group_by_length, packing, gradient_checkpointing, optimizer_in_backward, loss_chunks, offload, "
    "checkpoint_every, sharding"
)
UNKNOWN_KEYS = [
    (
        ["train.lrr=1"],
        f"train.lrr=1 is invalid: no key lrr in train; did you mean train.lr? its keys: {TRAIN_KEYS}",
    ),
    (
        ["-m", "optim=adamw,sgd", "train.lrr=1e-3,1e-4"],
        f"train.lrr=1e-3,1e-4 is invalid: no key lrr in train; did you mean train.lr? its keys: {TRAIN_KEYS}",
    ),
    (
        ["-m", "optim=adamw,adafactor", "optim.beta1=0.9"],
        "optim.beta1=0.9 is invalid: no key beta1 in optim=adamw; did you mean optim.betas? "
        "its keys: name, lr, lr_tuned, betas, eps, amsgrad",
    ),
]


@pytest.mark.parametrize(("args", "message"), UNKNOWN_KEYS, ids=[" ".join(a) for a, _ in UNKNOWN_KEYS])
def test_an_unknown_key_is_one_line_and_exit_2(args, message, tmp_path):
    proc = run_cli(tmp_path, *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip() == f"error: {message}"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # two tiny jobs of 60 steps (about a minute on 2 cores)
def test_tiny_on_a_two_class_csv_says_what_to_try_when_it_collapses_and_learns_with_it(tmp_path):
    """The random-weight `tiny` at the reference rates (tuned on pretrained MiniLM) collapses on a small
    two-class CSV: its line says so and what to try; at the rate it names, it learns (F1 above the collapsed
    run's)."""
    import random

    rng = random.Random(0)
    words = {1: "good great wonderful excellent love".split(), 0: "bad awful terrible boring hate".split()}
    filler = "the movie film story plot acting was really quite a bit and it is this".split()

    def text(label):
        chosen = rng.sample(filler, 5) + rng.sample(words[label], 2)
        rng.shuffle(chosen)
        return " ".join(chosen)

    for name, n in (("train.csv", 240), ("eval.csv", 80)):
        pd.DataFrame({"text": [text(i % 2) for i in range(n)], "label": [i % 2 for i in range(n)]}).to_csv(
            tmp_path / name, index=False
        )
    csv = ["data=csv", f"data.train_file={tmp_path}/train.csv", f"data.eval_file={tmp_path}/eval.csv"]
    proc = run_cli(tmp_path, "-m", "model=tiny", *csv, "train.lr_scale=1,10", "train.max_steps=60")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[job] collapsed:")]
    assert lines == [
        "[job] collapsed: 100% of the predictions in one class, the model did not learn; its weights are random "
        "(model.pretrained=false) and the optimizers' reference rates are tuned for a pretrained model: try "
        "train.lr_scale=10 or more steps (train.max_steps), or a pretrained model (model=minilm)"
    ], proc.stdout[-3000:]
    runs = {float(r.data.params["lr_scale"]): r for r in sweep_runs(tmp_path)[1]}
    assert runs[1].data.tags["collapsed"] == "true" and runs[10].data.tags["collapsed"] == "false"
    assert runs[10].data.metrics["eval_f1"] > runs[1].data.metrics["eval_f1"] + 0.5
