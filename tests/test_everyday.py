"""Issue 20, replayed through the real CLI: a constant bad value fails a sweep at once (a swept one stays a
FAILED point), unknown names get a "did you mean", runs record their label names, find_batch_size's output
reads right, and every optimizer setting is shown and has the same effect on both backends."""

import inspect
import json
import os
import re
import subprocess
import sys
import time

import pandas as pd
import pytest
from omegaconf import OmegaConf

from pipeline import MB, job, models, optimizers
from pipeline.memory import MemoryBudgetExceeded, optimizer_state_size
from tests.conftest import CONF, ROOT, compose_cfg, run_cli, sweep_runs
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
        "train.precision='bf61' is invalid: allowed values are fp32, bf16, fp16, bf16_pure; did you mean bf16?",
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
    assert not (tmp_path / "mlflow.db").exists()  # no run was opened, no report built
    assert not (tmp_path / "multirun").exists()
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
            "optim=adafactr is invalid: allowed values are {optims}; did you mean adafactor?",
        ),
        (
            ["-m", "model=tiny,minilmm"],
            "model=minilmm is invalid: allowed values are {models}; did you mean minilm?",
        ),
        (
            ["train.padding=longset"],
            "train.padding='longset' is invalid: allowed values are longest, max_length; "
            "did you mean longest?",
        ),
        (["backend=deepspeed"], "backend=deepspeed is invalid: allowed values are accelerator, trainer"),
    ],
)
def test_unknown_names_get_a_did_you_mean_when_one_is_close(args, message, tmp_path):
    names = {g: ", ".join(sorted(p.stem for p in (CONF / g).glob("*.yaml"))) for g in ("optim", "model")}
    proc = run_cli(tmp_path, *args)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: " + message.format(optims=names["optim"], models=names["model"])


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
        "lr": 5e-05,
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
}
# where a config deliberately differs from the constructor's own default (and why)
NOT_THE_CONSTRUCTORS = {
    ("adafactor", "scale_parameter"): False,  # the Trainer's optim="adafactor" settings
    ("adafactor", "relative_step"): False,  # (an external rate: train.lr)
    ("sgd", "momentum"): 0.9,
    ("adamw_torchao_4bit", "block_size"): 256,  # what the Trainer passes
}
NOT_CONSTRUCTOR_ARGUMENTS = {"target_modules", "rank", "update_proj_gap", "scale", "proj_type", "names"}
# constructor arguments that are no setting of the optimizer: where it runs and how it is implemented, what
# the pipeline sets from train.* or the model, and what selects the registry entry itself
SWITCHES = {"foreach", "fused", "capturable", "differentiable", "maximize", "verbose", "model_sharding"}
FROM_ELSEWHERE = {"weight_decay", "warmup_steps", "dim", "n_heads", "n_kv_heads", "no_deprecation_warning"}
IDENTITY = {"optim_bits", "is_paged", "args"}
TORCHAO = ("adamw_torchao_8bit", "adamw_torchao_4bit", "adamw_torchao_fp8")
LEFT_OUT = {
    ("adamw_8bit", "amsgrad"): "bitsandbytes' 8-bit AdamW has no amsgrad",
    ("paged_adamw_8bit", "amsgrad"): "bitsandbytes' 8-bit AdamW has no amsgrad",
    ("lion_32bit", "min_8bit_size"): "no effect on 32-bit state",
    **{(o, "amsgrad"): "torchao's low-bit states cannot take it" for o in TORCHAO},
}


def constructor(name: str):
    module, _, cls = OPTIMIZER_CLASS[name].rpartition(".")
    return getattr(__import__(module, fromlist=[cls]), cls)


def plain(value):
    return list(value) if isinstance(value, tuple) else value


@pytest.mark.parametrize("optim", sorted(optimizers.REGISTRY))
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
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
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
