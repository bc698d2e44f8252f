import numpy as np
import pytest

from pipeline.backends import classification_metrics


def logits_for(preds, num_labels):
    return np.eye(num_labels)[preds]


def test_binary_f1_hand_computed():
    labels = np.array([1, 1, 0, 0, 1, 0])
    preds = np.array([1, 0, 0, 1, 1, 0])
    # positive class 1: TP=2, FP=1, FN=1 -> precision 2/3, recall 2/3, F1 2/3; 4 of 6 right
    m = classification_metrics(logits_for(preds, 2), labels, 2)
    assert m["f1"] == pytest.approx(2 / 3)
    assert m["accuracy"] == pytest.approx(4 / 6)


def test_macro_f1_hand_computed():
    labels = np.array([0, 0, 1, 1, 2, 2])
    preds = np.array([0, 1, 1, 1, 2, 0])
    # class 0: TP1 FP1 FN1 -> 1/2; class 1: TP2 FP1 FN0 -> 4/5; class 2: TP1 FP0 FN1 -> 2/3
    m = classification_metrics(logits_for(preds, 3), labels, 3)
    assert m["f1"] == pytest.approx((1 / 2 + 4 / 5 + 2 / 3) / 3)
    assert m["accuracy"] == pytest.approx(4 / 6)


@pytest.mark.parametrize("num_labels", [2, 3, 5])
def test_f1_and_accuracy_equal_scikit_learn(num_labels):
    from sklearn.metrics import accuracy_score, f1_score

    rng = np.random.default_rng(num_labels)
    for _ in range(50):
        labels = rng.integers(0, num_labels, rng.integers(1, 40))
        logits = rng.normal(size=(len(labels), num_labels))
        m = classification_metrics(logits, labels, num_labels)
        preds = logits.argmax(-1)
        average = "binary" if num_labels == 2 else "macro"
        assert m["f1"] == pytest.approx(f1_score(labels, preds, average=average, zero_division=0))
        assert m["accuracy"] == pytest.approx(accuracy_score(labels, preds))


# --- FLOPs per token: 6 x non-embedding parameters + 12 L H Q T, against a count by hand ----------------------


def bert_non_embedding(d: int, layers: int, ff: int, labels: int = 2) -> int:
    """A BERT classifier's parameters outside its embedding tables, counted from its shapes: per layer Q, K,
    V, O (d x d + d each), two LayerNorms (2d each), the FFN (d x ff + ff, ff x d + d); the embeddings'
    LayerNorm, the pooler (d x d + d) and the classifier (d x labels + labels)."""
    layer = 4 * (d * d + d) + 2 * 2 * d + (d * ff + ff) + (ff * d + d)
    return layers * layer + 2 * d + (d * d + d) + (d * labels + labels)


@pytest.mark.parametrize(
    ("model", "non_embedding", "attention"),
    [
        # tiny: d 32, 2 layers, FFN 64 (its 30522 x 32 word embeddings are 97% of its parameters)
        ("tiny", bert_non_embedding(32, 2, 64), 2 * 32),
        # MiniLM: d 384, 6 layers, 12 heads of 32, FFN 1536
        ("minilm", bert_non_embedding(384, 6, 1536), 6 * 384),
        # llama-tiny: d 64, 2 layers, 4 query heads of 16 (2 key/value heads: k, v 64 x 32), FFN 128, no
        # biases; per layer q, k, v, o, gate, up, down and two RMSNorms; the final norm; `score` 64 x 2
        ("llama-tiny", 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64 + 64 * 2, 2 * 64),
    ],
)
def test_flops_per_token_is_6_non_embedding_params_plus_attention(model, non_embedding, attention):
    from pipeline import models
    from pipeline.measurements import flops_per_token, model_flops
    from tests.conftest import compose_cfg

    cfg = compose_cfg(f"model={model}", "model.pretrained=false")
    built = models.load_model(cfg.model, 2)
    assert model_flops(built) == (non_embedding, attention)
    # 6 N + 12 L H Q T at T = 40 positions
    assert flops_per_token(model_flops(built), 40) == 6 * non_embedding + 12 * attention * 40
    if model == "tiny":  # far below 6 x all parameters: the embeddings are looked up, not multiplied
        total = sum(p.numel() for p in built.parameters())
        assert flops_per_token(model_flops(built), 64) < 0.1 * 6 * total
