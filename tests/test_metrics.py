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
