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
    from pipeline.adapters import model_flops
    from pipeline.measurements import flops_per_token
    from tests.conftest import compose_cfg

    cfg = compose_cfg(f"model={model}", "model.pretrained=false")
    built = models.load_model(cfg.model, 2)
    assert model_flops(built) == (
        non_embedding,
        attention,
        non_embedding,
    )  # full fine-tuning: all of N trains
    # 6 N + 12 L H Q T at T = 40 positions
    assert flops_per_token(model_flops(built), 40) == 6 * non_embedding + 12 * attention * 40
    if model == "tiny":  # far below 6 x all parameters: the embeddings are looked up, not multiplied
        total = sum(p.numel() for p in built.parameters())
        assert flops_per_token(model_flops(built), 64) < 0.1 * 6 * total


# --- the device's peak FLOP/s: a data-sheet figure for the exact GPU model ------------------------------------


@pytest.mark.parametrize(
    ("name", "bf16", "fp32"),
    [
        ("NVIDIA H100 80GB HBM3", 989, 67),  # SXM
        ("NVIDIA H100 PCIe", 756, 51),
        ("NVIDIA H100 NVL", 835, 60),
        ("NVIDIA H200", 989, 67),
        ("NVIDIA A100-SXM4-80GB", 312, 19.5),
        ("NVIDIA A100 80GB PCIe", 312, 19.5),
        ("NVIDIA A10G", 70, 31.2),
        ("NVIDIA A10", 125, 31.2),
        ("NVIDIA L40", 181, 90.5),
        ("NVIDIA L40S", 362, 91.6),
        ("NVIDIA L4", 121, 30.3),
        ("NVIDIA GeForce RTX 4090", 165.2, 82.6),
        ("Tesla V100-SXM2-32GB", 125, 15.7),
        ("Tesla T4", 65, 8.1),
    ],
)
def test_each_gpu_model_gets_its_own_data_sheet_peak(name, bf16, fp32):
    import torch

    from pipeline.timing import gpu_peak_flops

    assert gpu_peak_flops(name, torch.bfloat16) == (pytest.approx(bf16 * 1e12), f"data sheet: {name}")
    assert gpu_peak_flops(name, torch.float16)[0] == pytest.approx(bf16 * 1e12)
    assert gpu_peak_flops(name, torch.float32)[0] == pytest.approx(fp32 * 1e12)


@pytest.mark.parametrize(
    "name", ["NVIDIA B200", "NVIDIA GeForce RTX 3090", "NVIDIA H100", "Tesla V100-PCIE-16GB"]
)
def test_a_gpu_not_in_the_table_has_no_peak(name):
    import torch

    from pipeline.timing import gpu_peak_flops

    assert gpu_peak_flops(name, torch.bfloat16) == (None, f"no known peak for {name}")


# --- the model's size: counted on the whole model, before any wrapper shards it -------------------------------


def test_model_size_is_the_whole_models_though_training_left_each_rank_a_shard(
    tmp_path, fresh_accelerate_state
):
    """FSDP (use_orig_params=True) leaves each rank's parameters holding its shard after `prepare()`: the job's
    parameter count and FLOPs per token are those the model stage counted before training."""
    import torch

    from pipeline import adapters, backends, data, measurements, models, optimizers
    from tests.conftest import TINY, compose_cfg

    # every batch padded to 64 positions: T of FLOPs per token
    overrides = [
        "backend=accelerator",
        "train.max_steps=5",
        "train.padding=max_length",
        f"outputs_dir={tmp_path}",
    ]
    cfg = compose_cfg(*TINY, *overrides)
    tokenizer, splits, collate = data.prepare(cfg)
    built = models.build(cfg, splits.label_names, tokenizer.pad_token_id)
    model = built.model
    whole, flops = sum(p.numel() for p in model.parameters()), adapters.model_flops(model)
    choice = optimizers.choose(cfg)
    trained = backends.run(cfg, choice.spec, model, splits, collate, tmp_path)
    # what FSDP leaves rank 0 of 2 holding: the first half of each parameter, flattened
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.flatten()[: (p.numel() + 1) // 2].clone()
    cfg.train.sharding = "fsdp"
    m = measurements.training_result(cfg, choice, built, splits, trained)["metrics"]
    assert m["model_num_params"] == whole
    assert m["model_num_nonembedding_params"] == flops[0]
    assert m["train_flops_per_token"] == measurements.flops_per_token(flops, 64)


@pytest.mark.parametrize("peft", ["none", "lora", "qlora"])
def test_flops_per_token_counts_a_step_as_flop_counter_mode_does(peft):
    """The FLOPs per token a run records (4 N + 2 N_trained + 12 L H Q T) against torch's FlopCounterMode count
    of a real training step of the same model, forward and backward, within 2%: full fine-tuning's 6 N, and
    over a frozen base (LoRA, QLoRA's 4-bit one) no weight gradients for it, the adapters' own FLOPs counted.
    A decoder of 16 layers as a language model, eager attention (whose matmuls the counter sees), every
    position counted."""
    import math

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from pipeline import adapters, models
    from pipeline.adapters import model_flops
    from pipeline.measurements import flops_per_token
    from tests.conftest import compose_cfg

    cfg = compose_cfg(
        "model=llama-tiny", "task=causal_lm", f"peft={peft}", "model.architecture.num_hidden_layers=16"
    )
    torch.manual_seed(0)
    model = models.load_model(cfg.model, 2, None, "causal_lm")
    model = adapters.apply(model, cfg.peft, "causal_lm", "llama", trained_dtype=torch.float32)
    model.set_attn_implementation("eager")
    batch, positions = 2, 48
    ids = torch.randint(0, models.vocab_size(model), (batch, positions))
    # bitsandbytes' 4-bit matmul (QLoRA's forward) is an op of its own, whose FLOPs the counter does not know:
    # those of the matmul it stands for, A (..., in) times the dequantized weight (out, in) transposed
    gemm_4bit = {}
    if peft == "qlora":  # (registered as bitsandbytes is imported)
        gemm_4bit[torch.ops.bitsandbytes.gemm_4bit] = lambda a, b, shape, *_, out_shape=None, **__: (
            2 * math.prod(a[:-1]) * shape[0] * shape[1]
        )
    with FlopCounterMode(display=False, custom_mapping=gemm_4bit) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    counted = counter.get_total_flops() / (batch * positions)
    flops = model_flops(model)
    if peft == "none":
        assert flops.trained == flops.non_embedding
    else:
        assert flops.trained < flops.non_embedding / 10
    assert flops_per_token(flops, positions) == pytest.approx(counted, rel=0.02)
