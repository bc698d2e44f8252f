"""A model of one's own: its config.json (model.config, a file or a folder with its weights and tokenizer) planned
and trained as a catalog model is; a model YAML of one's own beside the catalog; a language model's text without
labels (csv, json lines, plain text)."""

import json
import re

import pandas as pd
import pytest
import torch

from pipeline import models, plan_job
from pipeline.config import ConfigError, own_model, validate
from tests.conftest import compose_cfg, run_cli, store, sweep_runs

# Qwen2.5-1.5B's config.json as published on the hub (Qwen/Qwen2.5-1.5B)
QWEN_1_5B = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 1536,
    "initializer_range": 0.02,
    "intermediate_size": 8960,
    "max_position_embeddings": 131072,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 12,
    "num_hidden_layers": 28,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1",
    "use_cache": True,
    "use_mrope": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
# the same architecture as a conf/model yaml of one's own, as docs/config.md says to write one
QWEN_1_5B_YAML = """\
name: my-qwen2.5-1.5b
config: null
package: null
hub_id: Qwen/Qwen2.5-1.5B
pretrained: false
max_tokens: 131072
architecture:
  model_type: qwen2
  vocab_size: 151936
  hidden_size: 1536
  intermediate_size: 8960
  num_hidden_layers: 28
  num_attention_heads: 12
  num_key_value_heads: 2
  max_position_embeddings: 131072
  rope_theta: 1000000.0
  rms_norm_eps: 1.0e-6
  tie_word_embeddings: true
  bos_token_id: 151643
  eos_token_id: 151643
"""
# a 2-layer Qwen2 decoder whose vocabulary is MiniLM's (the tokenizer it falls back to)
TINY = {
    "model_type": "qwen2",
    "vocab_size": 30522,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}
PLAN = ["plan=true", "task=causal_lm", "device_memory=rtx-4090", "train.max_length=1024"]
STEPS = ["train.max_steps=2", "batch_size=4", "eval.batch_size=8", "data.max_val_samples=8"]


def write_json(path, values: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(values, indent=2))
    return path


def user_conf(tmp_path) -> str:
    """A config folder of one's own holding model/my-qwen2.5-1.5b.yaml: its searchpath override (a name of its
    own: conf/ comes first, and a user may have put a qwen2.5-1.5b there)."""
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "my-qwen2.5-1.5b.yaml").write_text(QWEN_1_5B_YAML)
    return f"hydra.searchpath=[file://{tmp_path / 'conf'}]"


@pytest.mark.slow  # a 1.5B model planned by the command and here: CI (make test-ci)
def test_a_config_json_plans_as_the_yaml_of_the_same_architecture(tmp_path):
    folder = write_json(tmp_path / "Qwen2.5-1.5B" / "config.json", QWEN_1_5B).parent
    proc = run_cli(tmp_path / "out", *PLAN, f"model.config={folder}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Qwen2.5-1.5B: 1,543,714,304 parameters" in proc.stdout, proc.stdout[-3000:]
    (run,) = store(tmp_path / "out").search_runs(["1"])
    params = run.data.params
    assert (params["model"], params["model_source"], params["pretrained"]) == (
        "Qwen2.5-1.5B",
        str(folder),
        "False",
    )
    yaml = plan_job.plan_result(compose_cfg(*PLAN, "model=my-qwen2.5-1.5b", user_conf(tmp_path)))["metrics"]
    # what the plan took, in seconds: every other figure the same
    seconds = ("plan_s", "plan_levers_s", "plan_recipe_s")
    figures = {k: v for k, v in run.data.metrics.items() if k not in seconds}
    assert figures == pytest.approx({k: v for k, v in yaml.items() if k not in seconds}, rel=1e-12)
    assert figures["fits"] == 0 and figures["predicted_peak_logits_mb"] > 0


def test_a_config_json_is_the_catalog_entry_its_yaml_would_be(tmp_path):
    """Its architecture (less what is not one), its positions, random weights, no tokenizer beside it (MiniLM's),
    named by its folder or file; the same model built from it as from the yaml, on any catalog model as base."""
    file = write_json(tmp_path / "Qwen2.5-1.5B" / "config.json", QWEN_1_5B)
    for base in ("minilm", "tiny", "qwen2.5-0.5b"):
        cfg = own_model(compose_cfg(f"model={base}", f"model.config={file}"))
        assert (cfg.model.name, cfg.model.max_tokens, cfg.model.pretrained) == ("Qwen2.5-1.5B", 131072, False)
        assert cfg.model.package is None and cfg.model.hub_id is None
    # (its dtype, bf16, left out: train.precision decides the weights' dtype, as for the yaml)
    left_out = {"architectures", "torch_dtype", "transformers_version", "use_cache"}
    assert set(QWEN_1_5B) - set(cfg.model.architecture) == left_out
    assert own_model(cfg) == cfg  # a job reads its own config: the same entry
    named = own_model(compose_cfg(f"model.config={file}", "model.name=my-qwen"))
    assert named.model.name == "my-qwen"
    other = write_json(tmp_path / "qwen-1.5b.json", {**QWEN_1_5B, "_name_or_path": "Qwen/Qwen2.5-1.5B"})
    entry = own_model(compose_cfg(f"model.config={other}")).model
    assert (entry.name, entry.hub_id) == ("qwen-1.5b", "Qwen/Qwen2.5-1.5B")  # its tokenizer, where cached
    yaml = compose_cfg("model=my-qwen2.5-1.5b", user_conf(tmp_path))
    for task in ("causal_lm", "classification"):  # (use_mrope: a key Qwen2's config does not read)
        own = models.model_config(cfg.model, 2, task=task).to_dict()
        assert own == {**models.model_config(yaml.model, 2, task=task).to_dict(), "use_mrope": False}, task


def test_the_catalogs_checks_read_a_config_json(tmp_path):
    """Its positions bound train.max_length, a decoder is a language model, an encoder or a model type with no
    causal LM is not: each in one line naming the model."""
    decoder = write_json(tmp_path / "tiny-decoder" / "config.json", TINY).parent
    encoder = write_json(tmp_path / "tiny-bert" / "config.json", {"model_type": "bert", "hidden_size": 32})
    t5 = write_json(tmp_path / "t5.json", {"model_type": "t5", "d_model": 32})
    validate(compose_cfg("task=causal_lm", f"model.config={decoder}", "train.max_length=256"))
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(f"model.config={decoder}", "train.max_length=512"))
    assert str(err.value) == "train.max_length=512 is invalid: model tiny-decoder takes at most 256 tokens"
    assert "model.config" in err.value.keys  # a sweep of model.config values: a point's verdict
    for path, name, what in (
        (encoder, "tiny-bert", "an encoder (bert)"),
        (t5, "t5", "a t5 model, which transformers builds no causal language model of"),
    ):
        with pytest.raises(
            ConfigError,
            match="^" + re.escape(f"task=causal_lm is invalid with model={name}: it is {what}, not a"),
        ):
            validate(compose_cfg("task=causal_lm", f"model.config={path}"))
    validate(compose_cfg(f"model.config={encoder}"))  # a classifier


def test_catalog_points_keep_their_config_hash_and_a_config_json_has_its_own(tmp_path):
    from omegaconf import OmegaConf

    from pipeline.runner import config_hash

    cfg = compose_cfg("model=qwen-tiny")
    before = OmegaConf.create(OmegaConf.to_container(cfg))
    del before.model["config"]  # a point recorded before model.config existed
    assert config_hash(cfg) == config_hash(before)
    file = write_json(tmp_path / "qwen-tiny" / "config.json", TINY)
    own = own_model(compose_cfg("model=qwen-tiny", f"model.config={file}"))
    assert config_hash(own) != config_hash(cfg)
    write_json(file, {**TINY, "hidden_size": 32})  # an edited config.json: another point
    assert config_hash(own_model(compose_cfg(f"model.config={file}"))) != config_hash(own)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda p: p / "nowhere",
            "no such file or folder; allowed: a model's config.json, or a folder holding one",
        ),
        (lambda p: p, "has no config.json; allowed: a model's config.json"),
        (lambda p: write_json(p / "c.json", {"hidden_size": 8}), "c.json names no model_type; allowed: "),
        (
            lambda p: write_json(p / "c.json", {"model_type": "qwen3x"}),
            "model_type 'qwen3x' is not one transformers",
        ),
    ],
    ids=["missing", "folder without one", "no model_type", "unknown model_type"],
)
def test_a_bad_config_json_is_one_line_naming_it(make, message, tmp_path):
    path = make(tmp_path)
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(f"model.config={path}"))
    assert str(err.value).startswith(f"model.config='{path}' is invalid: "), str(err.value)
    assert message in str(err.value) and err.value.keys == ("model.config",)


def test_a_folder_with_weights_and_a_tokenizer_is_loaded_from_them(tmp_path):
    """A folder holding the config.json, the weights (safetensors) and a tokenizer: pretrained from there; its
    config.json alone (the file): the same architecture with random weights."""
    folder = tmp_path / "my-decoder"
    file = write_json(folder / "config.json", TINY)
    saved = models.load_model(own_model(compose_cfg(f"model.config={file}")).model, 2, task="causal_lm")
    saved.save_pretrained(folder)
    models.packaged_tokenizer(models.FALLBACK_TOKENIZER_PACKAGE).save_pretrained(folder)
    entry = own_model(compose_cfg("task=causal_lm", f"model.config={folder}")).model
    assert (entry.name, entry.pretrained, entry.hub_id) == ("my-decoder", True, str(folder))
    loaded = models.load_model(entry, 2, task="causal_lm")
    for (name, a), b in zip(saved.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert models.load_tokenizer(entry).name_or_path == str(folder)
    random = own_model(compose_cfg(f"model.config={folder / 'config.json'}")).model
    assert (random.pretrained, random.hub_id) == (False, None)


@pytest.mark.slow  # a command that trains: CI (make test-ci)
def test_a_tiny_config_json_trains_a_few_steps_with_random_weights(tmp_path):
    folder = write_json(tmp_path / "tiny-decoder" / "config.json", TINY).parent
    texts = pd.DataFrame({"text": [f"the film number {i} was fine and long enough" for i in range(40)]})
    texts.to_csv(tmp_path / "train.csv", index=False)
    data = ["data=csv", f"data.train_file={tmp_path}/train.csv", f"data.eval_file={tmp_path}/train.csv"]
    proc = run_cli(tmp_path, "-m", "task=causal_lm", f"model.config={folder}", *data, *STEPS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = sweep_runs(tmp_path)[1]
    assert run.data.params["model"] == "tiny-decoder" and run.data.params["model_source"] == str(folder)
    assert run.data.params["pretrained"] == "False" and run.data.metrics["model_num_params"] == 2_027_712
    assert "tiny-decoder" in run.info.run_name and run.data.metrics["eval_perplexity"] > 1


# ---- a model yaml of one's own beside the catalog ------------------------------------------------------------


def test_a_model_yaml_of_ones_own_is_a_catalog_model(tmp_path):
    """A user's conf/model yaml, found through hydra.searchpath: the checks that read the catalog take it (a
    decoder as a language model, its positions), and it plans."""
    from pipeline.config import check_group_overrides

    searchpath = user_conf(tmp_path)
    check_group_overrides(["model=my-qwen2.5-1.5b", searchpath])
    cfg = compose_cfg(
        "model=my-qwen2.5-1.5b", searchpath, "task=causal_lm", "plan=true", "train.max_length=32"
    )
    validate(cfg)
    assert models.model_type(cfg.model) == "qwen2"
    with pytest.raises(ConfigError, match=r"model my-qwen2.5-1.5b takes at most 131072 tokens"):
        validate(compose_cfg("model=my-qwen2.5-1.5b", searchpath, "train.max_length=200000"))
    assert plan_job.plan_result(cfg)["metrics"]["model_num_params"] == 1_543_714_304


# ---- a language model's text without labels ------------------------------------------------------------------


def text_files(folder) -> dict[str, str]:
    """The same 40 texts as a text-only csv, json lines and a plain text file (a blank line in it)."""
    texts = [f"the film number {i} was fine and long enough" for i in range(40)]
    frame = pd.DataFrame({"text": texts})
    frame.to_csv(folder / "texts.csv", index=False)
    frame.to_json(folder / "texts.jsonl", orient="records", lines=True)
    (folder / "texts.txt").write_text("\n".join(texts[:20] + [""] + texts[20:]) + "\n")
    return {suffix: str(folder / f"texts{suffix}") for suffix in (".csv", ".jsonl", ".txt")}


def test_a_language_model_reads_text_without_labels(tmp_path):
    from pipeline import data

    files = text_files(tmp_path)
    both = {suffix: [f"data.train_file={path}", f"data.eval_file={path}"] for suffix, path in files.items()}
    for suffix, paths in both.items():
        cfg = compose_cfg("task=causal_lm", "model=qwen-tiny", "data=csv", *paths)
        validate(cfg)
        validate(
            compose_cfg("task=causal_lm", "model=qwen-tiny", "data=csv", *paths, "data.label_column=null")
        )
        splits = data.load_splits(cfg.data, "causal_lm")
        assert splits.label_names == [] and splits.train.column_names == ["text"], suffix
        assert len(splits.train) + len(splits.val) == len(splits.eval) == 40, suffix  # (no blank line)
    # a classifier's data: its labels
    columns = r"^data.label_column='label' is invalid: data.train_file has the columns text$"
    with pytest.raises(ConfigError, match=columns):
        validate(compose_cfg("data=csv", *both[".csv"]))
    with pytest.raises(
        ConfigError, match=r"is invalid with task=classification: a .txt file holds text alone"
    ):
        validate(compose_cfg("data=csv", *both[".txt"]))
    with pytest.raises(ConfigError, match=r"^data.label_column=None is invalid with task=classification: "):
        validate(compose_cfg("data=csv", *both[".csv"], "data.label_column=null"))
    mixed = [f"data.train_file={files['.txt']}", f"data.eval_file={files['.csv']}"]
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg("task=causal_lm", "model=qwen-tiny", "data=csv", *mixed))
    assert str(err.value) == (
        f"data.eval_file={files['.csv']!r} is invalid: data.train_file is a .txt file and both are read as one "
        "type (text): give the eval file that type"
    )


@pytest.mark.slow  # three commands that train: CI (make test-ci)
def test_text_without_labels_trains_a_language_model(tmp_path):
    """Through the command: a text-only csv, json lines and a plain text file, each trained a few steps."""
    for suffix, path in text_files(tmp_path).items():
        out = tmp_path / suffix.lstrip(".")
        data = ["data=csv", f"data.train_file={path}", f"data.eval_file={path}"]
        proc = run_cli(out, "task=causal_lm", "model=qwen-tiny", *data, *STEPS)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (run,) = store(out).search_runs(["1"])
        assert run.info.status == "FINISHED" and run.data.metrics["eval_loss"] > 0, suffix
        assert (run.data.params["train_samples"], run.data.params["eval_samples"]) == ("36", "40"), suffix
        assert run.data.tags["labels"].startswith("ignored: task=causal_lm trains on the text column alone")
