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
