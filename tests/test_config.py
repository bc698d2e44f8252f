import subprocess
import sys
import time

import pytest
import torch

from pipeline.config import ConfigError, validate
from pipeline.optimizers import REGISTRY
from tests.conftest import CONF, ROOT, compose_cfg

GROUPS = {
    group.name: sorted(p.stem for p in group.glob("*.yaml")) for group in CONF.iterdir() if group.is_dir()
}
OPTIONS = [(group, name) for group, names in GROUPS.items() for name in names]


@pytest.mark.parametrize(("group", "name"), OPTIONS)
def test_every_config_file_composes(group, name):
    if group == "protocol":  # presets (`+protocol=...`, global keys): not in the defaults list
        validate(compose_cfg(f"+protocol={name}"))
        return
    # (a language model is a decoder: the default model is an encoder)
    lm = (group, name) in (("task", "causal_lm"), ("task", "sft"))
    cfg = compose_cfg(f"{group}={name}", *(["model=llama-tiny"] if lm else []))
    # (task=sft is a causal LM's job on chats: its own point by task.instructions)
    assert cfg[group].name == ("causal_lm" if (group, name) == ("task", "sft") else name)
    if group == "data" and name == "csv":
        with pytest.raises(ConfigError, match="data.train_file is required"):
            validate(cfg)
    elif group == "optim" and REGISTRY[name].needs_cuda and not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=f"optim={name} needs a CUDA device"):  # (adalomo)
            validate(cfg)
    elif group == "tracking" and name == "server":  # a server the check cannot reach must be named
        cfg.tracking.uri = "http://127.0.0.1:9"
        with pytest.raises(ConfigError, match="tracking uri http://127.0.0.1:9 does not answer"):
            validate(cfg)
    else:
        validate(cfg)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("batch_size=0", "batch_size=0 is invalid: must be a positive integer"),
        ("train.max_steps=-3", "train.max_steps=-3 is invalid: must be a positive integer"),
        ("train.lr=0", "train.lr=0 is invalid: must be a number > 0"),
        ("train.max_length=1000", "train.max_length=1000 is invalid: model minilm takes at most 512 tokens"),
        (
            "optim.name=adamx",
            f"optim.name='adamx' is invalid: did you mean adamw? allowed values are {', '.join(REGISTRY)}",
        ),
        (
            "backend.name=deepspeed",
            "backend.name='deepspeed' is invalid: allowed values are trainer, accelerator",
        ),
        ("seed=-1", "seed=-1 is invalid: must be an integer >= 0"),
        ("eval.sample=some", "eval.sample='some' is invalid: must be auto, null (all) or a positive integer"),
        (
            "task=causal_lm model=llama-tiny task.random_weights_lr_scale=abc",
            "task.random_weights_lr_scale='abc' is invalid: must be a number > 0",
        ),
    ],
)
def test_bad_values_are_named(override, message):
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(*override.split()))
    assert str(err.value) == message


def test_missing_data_file_is_named(tmp_path):
    cfg = compose_cfg("data=csv", f"data.train_file={tmp_path}/no.csv", f"data.eval_file={tmp_path}/no.csv")
    with pytest.raises(ConfigError, match=r"data.train_file='.*no.csv' is invalid: no such file"):
        validate(cfg)


def test_cli_bad_value_is_one_line_and_fast(tmp_path):
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "batch_size=-1", f"outputs_dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    elapsed = time.perf_counter() - start
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: batch_size=-1 is invalid: must be a positive integer"
    assert list(tmp_path.iterdir()) == []  # no store, no run folder
    print(f"bad override answered in {elapsed:.2f} s")


def test_cli_help_and_cfg_job():
    help_out = subprocess.run(
        [sys.executable, "-m", "pipeline", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert help_out.returncode == 0 and help_out.stdout.startswith("optimizer-sweep: ")
    assert "options: adafactor, adafactor_torch, adagrad, adalomo, adam_mini, adamw," in help_out.stdout
    cfg_out = subprocess.run(
        [sys.executable, "-m", "pipeline", "--cfg", "job", "optim=adafactor"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert cfg_out.returncode == 0 and "name: adafactor" in cfg_out.stdout
