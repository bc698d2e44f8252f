"""The plan of a language model (task=causal_lm): the decoder built with its LM head on fake tensors, trained on
labels of one token id per position, its `logits` part (measured and planned), and its predicted peak against
the one a real job measures where the logits are the largest part of the step."""

import pytest
import torch
from transformers.loss.loss_utils import LOSS_MAPPING, fixed_cross_entropy

from pipeline import MB, models, optimizers, plan_job, plan_ranks, plan_step
from pipeline.memory import KindPeak, is_logits, logits_width
from tests.conftest import compose_cfg

LM = ["task=causal_lm", "model=llama-tiny"]
NAMES = ("input_ids", "token_type_ids", "attention_mask")  # the packaged MiniLM tokenizer's, as a job's batch
PARTS = ["params", "grads", "optimizer", "activations", "logits", "other"]


def lm_config(cfg):
    config = models.model_config(cfg.model, num_labels=2, task=cfg.task.name)
    config.pad_token_id = 0 if config.pad_token_id is None else config.pad_token_id
    return config


def test_the_fake_model_is_the_tasks_class_and_the_labels_one_id_per_position():
    cfg = compose_cfg(*LM)
    mode, model = plan_step.fake_model(lm_config(cfg), "fp32", False, "causal_lm")
    assert type(model).__name__ == "LlamaForCausalLM" and logits_width(model) == 30522
    assert model.plan_key[-1] == "causal_lm"  # the optimizer step's cache key: the LM head has its own state
    _, classifier = plan_step.fake_model(models.model_config(cfg.model, 2), "fp32", False)
    assert type(classifier).__name__ == "LlamaForSequenceClassification" and logits_width(classifier) is None
    assert plan_step._inputs(mode, 3, 7, NAMES, "causal_lm")["labels"].shape == (3, 7)
    assert plan_step._inputs(mode, 3, 7, NAMES)["labels"].shape == (3,)


def test_the_logits_are_what_is_made_ending_in_the_vocabulary():
    """The rule, on a real step of a tiny decoder under bf16 autocast: the head's bf16 output, the loss's fp32
    copy and log-softmax, and their gradients are logits; the head's bf16 weight copy (saved for backward as
    its transpose, hidden x vocabulary) and its weight gradient (vocabulary x hidden) are not."""
    cfg = compose_cfg(*LM)
    torch.manual_seed(0)
    model = models.load_model(cfg.model, 2, None, "causal_lm").train()
    ids = torch.randint(0, 30522, (4, 64))
    tracker = KindPeak(model, [ids], vocab=logits_width(model))
    with tracker:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    logit_bytes = 4 * 64 * 30522
    # at the peak (log-softmax's backward): the fp32 log-softmax, its gradient and the logits' gradient
    assert tracker.at_peak["logits"] == 3 * 4 * logit_bytes
    assert tracker.at_peak["activations"] >= 30522 * 64 * 2  # the head's bf16 weight copy among them
    assert is_logits(torch.empty(4, 30522), 30522) and not is_logits(torch.empty(30522), 30522)
    assert not is_logits(torch.empty(30522, 64), 30522) and not is_logits(torch.empty(4, 30522), None)


@pytest.fixture(scope="module")
def flops_cache(tmp_path_factory):
    """One outputs_dir for the module's jobs: the CPU's peak FLOPs (MFU's denominator) measured once."""
    return tmp_path_factory.mktemp("lm_jobs")


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("seq", [32, 128])
def test_a_language_models_plan_is_its_measured_peak_where_the_logits_dominate(seq, flops_cache, monkeypatch):
    """A real job (llama-tiny as a language model, 4 sequences of `seq` tokens, bf16 weights: the head's bf16
    logits, the loss's fp32 copy, its log-softmax and their gradients) against its plan: within 5%, the logits
    to the byte, the breakdown's six parts adding up to its peak. The same plan without the LM head (the
    classifier) or without the loss's fp32 upcast misses by far more than 5%: this comparison would catch
    either."""
    from bench.plan_accuracy_lm import case

    row = case("llama-tiny", 4, seq, False, False, flops_cache, precision="bf16_pure")
    m = row["metrics"]
    assert m["peak_logits_mb"] > 10 * m["peak_activations_mb"]  # the logits: the largest activation by far
    assert abs(m["predicted_peak_error_pct"]) <= 5, m
    assert m["predicted_logits_mb"] == pytest.approx(m["peak_logits_mb"], rel=1e-9)
    # 3 logits-sized tensors at the peak: the fp32 log-softmax and its gradient, the fp32 logits' gradient
    assert m["peak_logits_mb"] * MB == 3 * 4 * 4 * seq * 30522
    total = sum(m[f"peak_{k}_mb"] for k in PARTS)
    assert total == pytest.approx(m["peak_breakdown_mb"], rel=1e-9)
    assert total == pytest.approx(m["peak_memory_mb"], rel=0.02)

    cfg = compose_cfg(*LM, "train.precision=bf16_pure")
    spec = optimizers.get("adamw")

    def error(found) -> float:
        return 100 * (found["peak"] / m["peak_memory_mb"] - 1)

    as_planned = plan_step.simulate(lm_config(cfg), spec, cfg, 4, seq, names=NAMES)
    assert as_planned["peak"] == pytest.approx(m["predicted_peak_mb"], rel=1e-9)
    cls_cfg = compose_cfg("model=llama-tiny", "train.precision=bf16_pure")
    classifier = plan_step.simulate(lm_config(cls_cfg), spec, cls_cfg, 4, seq, names=NAMES)
    assert error(classifier) < -50
    monkeypatch.setattr(plan_step, "_PROFILES", {})
    monkeypatch.setitem(LOSS_MAPPING, "ForCausalLM", loss_without_upcast)
    assert error(plan_step.simulate(lm_config(cfg), spec, cfg, 4, seq, names=NAMES)) < -20


def loss_without_upcast(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, **kwargs):
    """transformers' ForCausalLMLoss less its `logits.float()`."""
    labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()
    return fixed_cross_entropy(logits.view(-1, vocab_size), labels.view(-1), num_items_in_batch, ignore_index)


@pytest.mark.parametrize("optim", ["adamw", "adafactor", "adamw_8bit"])
def test_a_tied_language_models_state_estimate_counts_the_tied_weight_once(optim):
    """gpt2-tiny as a language model ties its head to its token embedding: the estimate counts that weight once,
    as the optimizer's real state does, to the byte."""
    from pipeline.state import optimizer_state_size

    cfg = compose_cfg("task=causal_lm", "model=gpt2-tiny", f"optim={optim}", "backend=accelerator")
    torch.manual_seed(0)
    model = models.load_model(cfg.model, 2, None, "causal_lm")
    assert model.lm_head.weight is model.get_input_embeddings().weight
    spec = optimizers.get(optim)
    optimizer = spec.build(model, cfg)
    ids = torch.randint(0, 30522, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    infos = optimizers.param_infos(model)
    assert sum(i.numel for i in infos) == sum(p.numel() for p in model.parameters())  # the tied weight once
    assert optimizer_state_size(optimizer).bytes == spec.estimate(infos, cfg, None, model.config).bytes


@pytest.mark.parametrize("sharding", ["zero1", "fsdp"])
def test_each_ranks_plan_holds_the_lm_head(sharding):
    """Per-rank plans of a language model: the LM head's weight is in every rank's weights (its own tensor
    under ZeRO-1's partition, FSDP's root unit), and the logits are a rank's own, as its activations."""
    cfg = compose_cfg(*LM, "launcher.nproc_per_job=2", f"train.sharding={sharding}", "backend=accelerator")
    prediction = plan_step.simulate(lm_config(cfg), optimizers.get("adamw"), cfg, 4, 64, names=NAMES)
    layout = plan_ranks.Layout(prediction["model"], optimizers.get("adamw"), cfg, cuda=False)
    head = 30522 * 64 * 4
    assert layout.fsdp(2).root >= 2 * head  # the embedding and the untied head, outside the stack of layers
    ranks = plan_ranks.per_rank(prediction, layout, sharding, 2, 4, 0.0)
    for rank in ranks:
        assert set(rank["parts"]) == set(PARTS)
        assert rank["parts"]["logits"] == pytest.approx(prediction["parts"]["logits"])


def test_a_language_models_plan_record_has_the_logits_and_a_classifiers_none():
    lm = plan_job.plan_result(compose_cfg(*LM, "plan=true", "memory_budget_mb=500"))["metrics"]
    assert lm["predicted_peak_logits_mb"] > lm["predicted_peak_activations_mb"]
    assert sum(lm[f"predicted_peak_{k}_mb"] for k in PARTS) == pytest.approx(lm["predicted_peak_mb"])
    # the classifier's parameters, its score (64 x 2) replaced by the head (64 x 30,522)
    assert lm["model_num_params"] == 2_027_584 - 64 * 2 + 30522 * 64
    assert lm["predicted_logits_largest_mb"] >= lm["predicted_peak_logits_mb"]
    assert plan_job.logits_line(lm).startswith("logits (the LM head's output")
    classifier = plan_job.plan_result(compose_cfg("model=llama-tiny", "plan=true", "memory_budget_mb=500"))
    assert not any("logits" in k for k in classifier["metrics"])
    assert plan_job.logits_line(classifier["metrics"]) is None


def test_a_language_models_depth_and_batch_follow_from_two_shallow_models(monkeypatch):
    """An 8-layer Llama as a language model: the plan's 2- and 3-layer passes at batch sizes 2 and 3,
    extrapolated, give the parts of simulating every layer at the batch itself, logits included (the LM head
    and the loss sit in the `head` stretch, above the stack)."""
    from tests.test_plan_step import direct

    cfg = compose_cfg(*LM, "model.architecture.num_hidden_layers=8", "train.precision=bf16")
    spec, config = optimizers.get("adamw"), lm_config(cfg)
    monkeypatch.setattr(plan_step, "_PROFILES", {})
    for batch in (1, 5, 12):
        found = plan_step.simulate(config, spec, cfg, batch, 64)
        simulated = direct(monkeypatch, config, spec, cfg, batch)
        assert found["parts"] == pytest.approx(simulated["parts"], rel=1e-6), batch
        assert found["parts"]["logits"] > 0 or batch == 1  # (one sample's peak: the optimizer step's)
        monkeypatch.setattr(plan_step, "SHALLOW", (2, 3))
        monkeypatch.setattr(plan_step, "TRACED_BATCHES", (2, 3))
        monkeypatch.setattr(plan_step, "_PROFILES", {})


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_largest_batch_that_comes_before_the_state_is_predicted_without_it(tmp_path):
    """Dynamic padding: this seed's longest batch is the first, before AdamW has made its state, so that step's
    peak holds no state (the logits dominate it), and the later steps' batches are shorter. The prediction takes
    the first step without the state, or the largest batch measured with it, whichever is higher: the plan of
    the largest batch with the state in place would be 9% high."""
    from pipeline import job, measurements

    cfg = compose_cfg(*LM, "optim=adamw", "backend=accelerator", "train.max_steps=5")
    cfg.data.max_eval_samples = cfg.data.max_val_samples = 16
    cfg.outputs_dir = str(tmp_path)
    result = job.run(cfg, tmp_path)
    m = result["metrics"]
    assert result["params"]["largest_batch"] == "16x53"
    assert abs(m["predicted_peak_error_pct"]) <= 0.1, m["predicted_peak_error_pct"]
    spec, config = optimizers.get("adamw"), models.model_config(cfg.model, 2, task="causal_lm")
    config.pad_token_id = m.get("pad_token_id", 0)
    largest = tuple(int(n) for n in result["params"]["largest_batch"].split("x"))
    with_state = measurements.simulated_step(cfg, spec, config, largest, False, NAMES)["peak"]
    assert with_state / m["peak_memory_mb"] - 1 > 0.05  # what the prediction would be without the rule
