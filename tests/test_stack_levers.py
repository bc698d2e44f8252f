"""The memory levers other fine-tuning stacks use, each a config key: what a real job measures with it, on both
backends, against its plan, and what it saves against the same job without it."""

import pytest
import torch

from pipeline import models
from pipeline.config import ConfigError, validate
from tests.conftest import compose_cfg

LM = ["task=causal_lm", "model=llama-tiny"]


def test_the_chunked_loss_and_its_gradients_are_transformers_own():
    """train.loss_chunks: the same loss (padding left out; the mean, or the sum over the Trainer's
    `num_items_in_batch`) and the same gradients as the model's own forward, in pieces that do not divide the
    sequence; evaluation keeps the model's logits."""
    cfg = compose_cfg(*LM)
    torch.manual_seed(0)
    own = models.load_model(cfg.model, 2, None, "causal_lm").train()
    chunked = models.load_model(cfg.model, 2, None, "causal_lm").train()
    chunked.load_state_dict(own.state_dict())
    models.chunk_the_loss(chunked, 4)
    ids = torch.randint(0, 30522, (3, 37))
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    for extra in ({}, {"num_items_in_batch": torch.tensor(50)}):
        for model in (own, chunked):
            model.zero_grad()
            model(input_ids=ids, attention_mask=mask, labels=labels, **extra).loss.backward()
        for a, b in zip(own.parameters(), chunked.parameters(), strict=True):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7)
        loss = own(input_ids=ids, attention_mask=mask, labels=labels, **extra).loss
        assert chunked(
            input_ids=ids, attention_mask=mask, labels=labels, **extra
        ).loss.item() == pytest.approx(loss.item(), abs=1e-5)
    assert chunked.config.loss_chunks == 4
    assert chunked.eval()(input_ids=ids, labels=labels).logits.shape == (3, 37, 30522)


def test_a_chunked_loss_needs_a_language_model_and_a_count():
    with pytest.raises(ConfigError, match="train.loss_chunks=4 is invalid with task=classification"):
        validate(compose_cfg("model=tiny", "train.loss_chunks=4"))
    with pytest.raises(ConfigError, match=r"train.loss_chunks=-1 is invalid: must be an integer >= 0"):
        validate(compose_cfg(*LM, "train.loss_chunks=-1"))


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("backend", ["accelerator", "trainer"])
def test_a_chunked_loss_holds_one_piece_of_the_logits_as_planned(backend, tmp_path):
    """A real job of llama-tiny (4 x 128 tokens, bf16 weights; its logits dominate the step) with its loss in 4
    pieces: the measured peak within 1% of the plan, its logits a quarter of the same job's without chunks, which
    measures 2.5 times the peak."""
    from bench.plan_accuracy_lm import case

    rows = [
        case("llama-tiny", 4, 128, False, False, tmp_path, "bf16_pure", backend=backend, extra=extra)[
            "metrics"
        ]
        for extra in ((), ("train.loss_chunks=4",))
    ]
    whole, chunked = rows
    assert abs(chunked["predicted_peak_error_pct"]) <= 1, chunked
    assert chunked["peak_logits_mb"] == pytest.approx(whole["peak_logits_mb"] / 4, rel=1e-9)
    assert chunked["predicted_logits_mb"] == pytest.approx(chunked["peak_logits_mb"], rel=1e-9)
    assert whole["peak_memory_mb"] > 2.5 * chunked["peak_memory_mb"]
