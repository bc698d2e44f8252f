"""task=causal_lm: decoders fine-tuned as language models (the text as corpus, next-token labels, packing,
perplexity and next-token accuracy), and classification left as it was."""

import math

import numpy as np
import pytest
import torch
import transformers
from omegaconf import OmegaConf

from pipeline import backends, data, job, models, optimizers
from pipeline.backends import next_token_accuracy
from pipeline.config import ConfigError, validate
from pipeline.runner import config_hash, selection_metric
from pipeline.state import optimizer_state_size
from tests.conftest import compose_cfg
from tests.test_memory import FAST_STEP, build

LM = ["task=causal_lm", "data.max_train_samples=64", "data.max_eval_samples=16", "data.max_val_samples=16"]
LM += ["train.max_steps=3", "batch_size=8", "train.max_length=32"]


def test_an_encoder_as_a_language_model_is_one_line_naming_the_decoders():
    """The line names the catalog's decoders (whatever models it holds, a user's own among them): each of them
    is a language model, no encoder is among them."""
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg("task=causal_lm", "model=minilm"))
    head = (
        "task=causal_lm is invalid with model=minilm: it is an encoder (bert), not a decoder that predicts the "
        "next token; the decoders: "
    )
    assert str(err.value).startswith(head)
    named = str(err.value).removeprefix(head).split(", ")
    assert {"gpt2-tiny", "llama-tiny", "qwen-tiny", "qwen2.5-0.5b"} <= set(named)
    assert not {"minilm", "tiny", "bert-base-uncased", "roberta-base"} & set(named)
    for name in named:  # a decoder is fine
        validate(compose_cfg("task=causal_lm", f"model={name}"))


def test_packing_is_for_a_language_model():
    with pytest.raises(ConfigError, match=r"^train.packing=true is invalid with task=classification: "):
        validate(compose_cfg("train.packing=true"))
    validate(compose_cfg("train.packing=true", "task=causal_lm", "model=llama-tiny"))


def test_classification_points_keep_the_config_hash_they_were_recorded_with():
    cfg = compose_cfg()
    before = OmegaConf.create(OmegaConf.to_container(cfg))
    del before["task"], before.train["packing"]  # a point recorded before the task axis existed
    assert config_hash(cfg) == config_hash(before)
    lm = compose_cfg("task=causal_lm", "model=llama-tiny")
    assert config_hash(lm) != config_hash(compose_cfg("model=llama-tiny"))
    assert config_hash(
        compose_cfg("task=causal_lm", "model=llama-tiny", "train.packing=true")
    ) != config_hash(lm)


def test_a_language_model_is_selected_by_its_validation_loss():
    assert selection_metric(compose_cfg()) == "val_macro_f1"
    assert selection_metric(compose_cfg("task=causal_lm", "model=llama-tiny")) == "val_loss"


def test_the_labels_are_the_input_ids_with_padding_left_out():
    cfg = compose_cfg("model=llama-tiny", *LM)
    tokenizer, _, _ = job.load(cfg)
    collate = data.PaddingCollator(tokenizer, "longest", 64, "causal_lm")
    batch = collate([tokenizer("a short one"), tokenizer("a much longer review snippet than that")])
    mask = batch["attention_mask"]
    assert mask[0].sum() < mask[1].sum()  # the first text is padded
    expected = torch.where(mask == 1, batch["input_ids"], torch.full_like(batch["input_ids"], -100))
    assert torch.equal(batch["labels"], expected)


def test_packing_cuts_the_concatenated_texts_into_full_blocks():
    assert data._blocks([[1, 2, 3], [4, 5], [6, 7, 8, 9]], 4) == [[1, 2, 3, 4], [5, 6, 7, 8]]  # 9: a tail
    cfg = compose_cfg("model=llama-tiny", *LM, "train.packing=true", "train.max_length=32")
    tokenizer, splits, _ = job.load(cfg)
    assert splits.task == "causal_lm" and set(splits.train.column_names) >= {"input_ids", "attention_mask"}
    assert "labels" not in splits.train.column_names  # the collator makes them
    lengths = {len(ids) for ids in splits.train["input_ids"]}
    assert lengths == {32}
    # every token of the texts, in order, but the tail shorter than a block
    raw = data.load_splits(cfg.data).train
    ids = [i for text in raw["text"] for i in tokenizer(text)["input_ids"]]
    assert [i for block in splits.train["input_ids"] for i in block] == ids[: len(ids) // 32 * 32]


def test_next_token_accuracy_counts_each_prediction_against_the_token_after_it():
    predictions = np.array([[5, 6, 7, 0], [1, 2, 9, 9]])
    labels = np.array([[4, 5, 6, 8], [0, 1, 3, -100]])  # position i predicts label i + 1
    # row 0: 5=5, 6=6, 7!=8; row 1: 1=1, 2!=3 (the last position's label is padding)
    assert next_token_accuracy(predictions, labels) == 3 / 5


def _trained(model: str, backend: str, tmp_path):
    cfg = compose_cfg(f"model={model}", f"backend={backend}", *LM)
    transformers.set_seed(cfg.seed)  # as a job: the same random weights on both backends
    tokenizer, splits, model = job.load(cfg)
    collate = data.PaddingCollator(tokenizer, cfg.train.padding, cfg.train.max_length, "causal_lm")
    spec = optimizers.get(cfg.optim.name)
    return backends.get(backend).train(cfg, model, splits, spec, collate, tmp_path)


# GPT-2's class name names no loss (GPT2LMHeadModel): the Trainer once averaged its loss over a token more per text
@pytest.mark.parametrize("model", ["llama-tiny", "gpt2-tiny"])
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_both_backends_train_the_language_model_to_the_same_figures(model, tmp_path, recwarn):
    trainer, loop = _trained(model, "trainer", tmp_path / "t"), _trained(model, "accelerator", tmp_path / "a")
    # the step's breakdown says nothing on the console (torch's module tracker's misnamed re-entries included)
    assert not [str(w.message) for w in recwarn if "module hierarchy" in str(w.message)]
    assert set(trainer.eval_metrics) == {"loss", "perplexity", "next_token_accuracy"}
    for out in (trainer, loop):
        assert out.eval_metrics["perplexity"] == pytest.approx(math.exp(out.eval_metrics["loss"]))
        assert 0 <= out.eval_metrics["next_token_accuracy"] <= 1
        # random weights over a 30,522-token vocabulary: the loss starts near ln(30522)
        assert out.losses[0] == pytest.approx(math.log(30522), rel=0.02)
    assert loop.losses == pytest.approx(trainer.losses, rel=1e-5)
    for key, value in trainer.eval_metrics.items():
        assert loop.eval_metrics[key] == pytest.approx(value, rel=1e-5), key


# the optimizers whose LM rows run in make test, one per kind of accounting (full, factored, 8-bit blocks, parts,
# low-rank projections, in-backward); `make test-matrix` runs the others
LM_SAMPLE = ["adamw", "adafactor", "adamw_8bit", "muon", "galore_adamw", "lomo"]


def lm_rows():
    """Every optimizer on GPT-2's tied head and on Llama's untied one: make test runs LM_SAMPLE on GPT-2 and AdamW
    on Llama, make test-matrix the others."""
    for optim in optimizers.REGISTRY:
        for model_name, sample in (("gpt2-tiny", LM_SAMPLE), ("llama-tiny", ["adamw"])):
            yield pytest.param(optim, model_name, marks=() if optim in sample else pytest.mark.matrix)


@pytest.mark.parametrize(("optim", "model_name"), list(lm_rows()))
def test_every_optimizer_holds_the_state_it_estimates_for_a_language_model(optim, model_name):
    """Each registered optimizer's state after one next-token step equals its estimate to the byte; a tied
    LM head (GPT-2's, the embeddings' own matrix) is one parameter, counted once."""
    cfg = compose_cfg(f"model={model_name}", "task=causal_lm", f"optim={optim}", *FAST_STEP.get(optim, ()))
    torch.manual_seed(0)
    model = models.load_model(cfg.model, 2, None, "causal_lm")
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied == (model_name == "gpt2-tiny")
    distinct = {id(p) for p in model.parameters()}
    assert len(distinct) == len(list(model.parameters()))  # (torch lists a tied weight once)
    spec = optimizers.get(optim)
    optimizer = build(spec, model, cfg)
    if spec.needs_train_eval_mode:
        optimizer.train()
    ids = torch.randint(0, models.vocab_size(model), (2, 16))
    loss = model(input_ids=ids, labels=ids).loss
    if hasattr(optimizer, "fused_backward"):  # LOMO, AdaLomo: the update runs inside the backward pass
        optimizer.fused_backward(loss, optimizer.defaults["lr"])
    else:
        loss.backward()
        optimizer.step()
    measured = optimizer_state_size(optimizer)
    assert measured == spec.estimate(optimizers.param_infos(model), cfg, None, model.config)


def test_a_split_too_short_for_one_packed_block_is_one_line():
    cfg = compose_cfg("model=llama-tiny", *LM, "train.packing=true", "data.max_eval_samples=1")
    with pytest.raises(ValueError) as err:
        job.load(cfg)
    assert str(err.value) == (
        "train.packing=true: the eval split's texts fill no block of train.max_length=32 tokens; lower "
        "train.max_length or raise data.max_eval_samples"
    )
