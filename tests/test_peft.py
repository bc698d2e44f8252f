"""peft=lora / qlora: the trainable count by hand, optimizer state = estimate on the adapters, the 4-bit base's
bytes by formula, the runs' figures, the combinations rejected in one line, peft=none's points unchanged."""

import functools
from math import ceil

import pytest
import torch
from omegaconf import OmegaConf

from pipeline import MB, adapters, fake_model, models, optimizers
from pipeline.config import ConfigError, validate
from pipeline.keys import check_keys
from pipeline.runner import config_hash
from pipeline.state import optimizer_state_size
from tests.conftest import compose_cfg, run_cli, store
from tests.test_memory import BREAKDOWN, one_step


def peft_model(model_name: str, *overrides: str):
    """(cfg, model): the model as a job builds it under the overrides (random weights, two labels)."""
    cfg = compose_cfg(f"model={model_name}", "model.pretrained=false", *overrides)
    model = models.load_model(cfg.model, num_labels=2)
    model.config.pad_token_id = 0  # (a decoder's classifier reads the last non-padding token)
    return cfg, adapters.apply(model, cfg.peft, "classification", model.config.model_type)


def lora_by_hand(cfg, r: int) -> int:
    """LoRA's trainable parameters from the model's config alone: r x (in + out) for each adapted Linear (the
    attention's query, key, value and output projections of every layer), plus the head, trained in full."""
    a = cfg.model.architecture
    if a.model_type == "distilbert":
        dim, layers = a.dim, a.n_layers
        adapted = layers * 4 * r * (dim + dim)
        # peft trains every module whose name ends in `classifier`: DistilBERT's pre_classifier too
        return adapted + (dim * dim + dim) + (dim * 2 + 2)
    if a.model_type == "llama":
        hidden, layers = a.hidden_size, a.num_hidden_layers
        kv = a.num_key_value_heads * hidden // a.num_attention_heads  # grouped-query attention's k, v width
        per_layer = r * (hidden + hidden) + 2 * r * (hidden + kv) + r * (hidden + hidden)  # q, k and v, o
        return layers * per_layer + hidden * 2  # the `score` head has no bias
    assert a.model_type == "bert"
    hidden, layers = a.hidden_size, a.num_hidden_layers
    return layers * 4 * r * (hidden + hidden) + (hidden * 2 + 2)


@pytest.mark.parametrize("model_name", ["distilbert-base-cased", "llama-tiny"])
def test_trainable_parameters_by_hand_equal_peft_count(model_name):
    for peft, r in (("lora", 16), ("qlora", 8)):
        cfg, model = peft_model(model_name, f"peft={peft}", f"peft.r={r}")
        trainable, total = model.get_nb_trainable_parameters()  # what print_trainable_parameters prints
        assert trainable == lora_by_hand(cfg, r) == adapters.trainable_params(model), peft
        frozen = sum(adapters.weights(p) for p in model.parameters() if not p.requires_grad)
        assert total == trainable + frozen  # (a 4-bit weight counts the weights it packs, as peft counts)
        assert all(p.grad is None for p in model.parameters())


def test_a_language_models_head_stays_frozen():
    cfg = compose_cfg("model=llama-tiny", "peft=lora", "task=causal_lm")
    model = models.load_model(cfg.model, num_labels=2, task="causal_lm")
    model = adapters.apply(model, cfg.peft, "causal_lm", "llama")
    head = cfg.model.architecture.hidden_size * 2  # the classifier's score head lora_by_hand counts
    assert adapters.trainable_params(model) == lora_by_hand(cfg, 16) - head
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lm_head" in n)


# CI's in-process rows: one full-precision state, one block-wise 8-bit, one factored; on both bases
@pytest.mark.parametrize("optim", ["adamw", "adamw_8bit", "adafactor"])
@pytest.mark.parametrize("peft", ["lora", "qlora"])
def test_state_on_the_adapters_equals_estimate(optim, peft):
    cfg, model = peft_model("tiny", f"peft={peft}", f"optim={optim}")
    frozen = [p for p in model.parameters() if not p.requires_grad]
    spec = optimizers.get(optim)
    optimizer = spec.build(model, cfg)
    one_step(model, optimizer, models.vocab_size(model))
    assert all(p.grad is None for p in frozen)
    assert not {id(p) for p in frozen} & {id(p) for p in optimizer.state}  # no state for the frozen base
    measured = optimizer_state_size(optimizer)
    assert measured.numel > 0
    assert measured == spec.estimate(optimizers.param_infos(model), cfg, None, model.config)


def four_bit_bytes(out_features: int, in_features: int, double_quant: bool) -> int:
    """One Linear(in, out)'s 4-bit weight by hand: two weights a byte, an absmax per 64 (fp32; double
    quantization: uint8, then an fp32 absmax per 256 of those, an fp32 offset, a 256-entry fp32 code), and its
    16-entry fp32 code (NF4's values)."""
    n = out_features * in_features
    blocks = ceil(n / 64)
    absmax = blocks + ceil(blocks / 256) * 4 + 4 + 256 * 4 if double_quant else blocks * 4
    return n // 2 + absmax + 16 * 4


@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize("model_name", ["tiny", "llama-tiny"])
def test_the_4bit_base_bytes_by_hand(model_name, double_quant):
    cfg, model = peft_model(model_name, "peft=qlora", f"peft.double_quant={str(double_quant).lower()}")
    layers = [m for m in model.modules() if type(m).__name__ == "Linear4bit"]
    a = cfg.model.architecture
    linears_per_layer = {"bert": 6, "llama": 7}[a.model_type]  # q k v o + the MLP's two (Llama's three)
    assert len(layers) == a.num_hidden_layers * linears_per_layer + (
        a.model_type == "bert"
    )  # + BERT's pooler
    by_hand, packed, fp32 = 0, 0, 0
    for layer in layers:
        by_hand += four_bit_bytes(layer.out_features, layer.in_features, double_quant)
        packed += layer.weight.untyped_storage().nbytes()
        fp32 += layer.out_features * layer.in_features * 4
        # the layer's quantization constants are its buffers: what counts the model's weights counts them
        buffers = {id(b) for b in layer.buffers()}
        state = layer.weight.quant_state
        assert {id(state.absmax), id(state.code)} <= buffers
        assert state.nested == double_quant
    assert packed * 8 == fp32  # 4 bits a weight
    assert adapters.measured_quantized_bytes(model) == by_hand
    assert adapters.estimated_quantized_bytes(model, double_quant) == by_hand


def test_impossible_combinations_are_one_line():
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg("model=tiny", "peft=lora", "optim=adalomo"))
    assert str(err.value) == (
        "optim=adalomo is invalid with peft=lora: it keeps a second moment for every weight of the model, the "
        "frozen base's too (use an optimizer that keeps state for the trainable parameters only, e.g. "
        "optim=lomo or adamw; or peft=none)"
    )
    with pytest.raises(
        ConfigError, match=r"^plan=true is invalid with peft=qlora and train.sharding=zero2: "
    ):
        validate(compose_cfg("model=tiny", "peft=qlora", "plan=true", "train.sharding=zero2"))
    with pytest.raises(ConfigError, match=r"^peft.r=0 is invalid: must be a positive integer"):
        validate(compose_cfg("model=tiny", "peft=lora", "peft.r=0"))
    with pytest.raises(ConfigError, match=r"^peft.quant_type='int4' is invalid: allowed values are nf4, fp4"):
        validate(compose_cfg("model=tiny", "peft=qlora", "peft.quant_type=int4"))
    # what is only unusual runs: GaLore's projections on the adapters, LOMO's fused update of them
    for optim in ("galore_adamw", "galore_adamw_layerwise", "lomo"):
        validate(compose_cfg("model=tiny", "peft=lora", f"optim={optim}"))


def test_impossible_combination_stops_the_cli_with_exit_2(tmp_path):
    proc = run_cli(tmp_path, "model=tiny", "peft=qlora", "optim=adalomo")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: optim=adalomo is invalid with peft=qlora: it keeps a second moment for every weight of the "
        "model, the frozen base's too (use an optimizer that keeps state for the trainable parameters only, "
        "e.g. optim=lomo or adamw; or peft=none)"
    )


def test_full_fine_tuning_keeps_the_config_hash_of_earlier_points():
    cfg = compose_cfg()
    before = OmegaConf.create(OmegaConf.to_container(cfg))
    del before["peft"]  # a point recorded before the peft group existed
    assert config_hash(cfg) == config_hash(before)
    lora = compose_cfg("peft=lora")
    assert len({config_hash(cfg), config_hash(lora), config_hash(compose_cfg("peft=qlora"))}) == 3
    assert config_hash(compose_cfg("peft=lora", "peft.r=8")) != config_hash(lora)
    # a key the method does not read (set for a sweep's other points) leaves its point as it is
    assert config_hash(compose_cfg("peft.r=8")) == config_hash(cfg)
    assert config_hash(compose_cfg("peft=lora", "peft.double_quant=false")) == config_hash(lora)


def test_one_sweep_sets_the_adapters_keys_for_every_method():
    check_keys(["peft=none,lora,qlora", "peft.r=8", "peft.quant_type=fp4"])  # every option has every key
    with pytest.raises(ConfigError, match=r"^peft.rank=8 is invalid: no key rank in peft=none;"):
        check_keys(["peft=none,lora", "peft.rank=8"])


def test_all_linear_adapts_every_linear_but_the_head():
    cfg, model = peft_model("llama-tiny", "peft=qlora", "peft.target_modules=all-linear")
    a, r = cfg.model.architecture, 16
    kv = a.num_key_value_heads * a.hidden_size // a.num_attention_heads
    h, i = a.hidden_size, a.intermediate_size
    per_layer = r * (2 * h + 2 * (h + kv) + 2 * h) + r * (2 * (h + i) + (i + h))  # attention; gate, up, down
    assert adapters.trainable_params(model) == a.num_hidden_layers * per_layer + h * 2  # + the score head
    found = model.peft_config["default"].target_modules
    assert adapters.targets_text(cfg.peft, found) == (
        "all-linear: down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj"
    )


def test_the_method_names_the_run():
    assert adapters.method(compose_cfg()) == "full"
    assert adapters.method(compose_cfg("peft=lora")) == "lora r=16"
    assert adapters.method(compose_cfg("peft=qlora", "peft.r=8")) == "qlora r=8 nf4"


# fixed-length batches: every step has the same shapes, so the profiled step holds the peak
FIXED = ["train.padding=max_length", "data.max_train_samples=64", "data.max_eval_samples=16"]


@pytest.fixture(scope="module")
def peft_runs(tmp_path_factory):
    """The three methods with AdamW on tiny (the Trainer), then LoRA on the Accelerator loop saving its adapter,
    in one store."""
    tmp = tmp_path_factory.mktemp("peft")
    common = ["optim=adamw", "model=tiny", "train.max_steps=2", *FIXED]
    proc = run_cli(tmp, "-m", "peft=none,lora,qlora", *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli(tmp, "peft=lora", "backend=accelerator", "peft.save_adapter=true", *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = store(tmp)
    experiment = client.get_experiment_by_name("optimizer-sweep")
    runs = {
        (r.data.params["method"], r.data.params["backend"]): r
        for r in client.search_runs([experiment.experiment_id])
        if "method" in r.data.params
    }
    # the artifacts under adapter/ of each run: only the run that asked has its adapter saved
    saved = {
        key: [a.path for a in client.list_artifacts(r.info.run_id, "adapter")] for key, r in runs.items()
    }
    return runs, saved


@pytest.mark.slow  # why: four tiny CLI jobs, about 25 s on 2 cores
def test_every_method_runs_and_logs_its_figures(peft_runs):
    peft_runs, saved = peft_runs
    assert set(peft_runs) == {
        ("full", "trainer"),
        ("lora r=16", "trainer"),
        ("qlora r=16 nf4", "trainer"),
        ("lora r=16", "accelerator"),
    }
    cfg = compose_cfg("model=tiny")
    for (method, _), run in peft_runs.items():
        m, p = run.data.metrics, run.data.params
        assert run.info.status == "FINISHED", run.info.run_name
        assert m["estimated_optimizer_state_mb"] == m["optimizer_state_mb"]
        # the breakdown adds up to the measured peak
        assert sum(m[k] for k in BREAKDOWN) == pytest.approx(m["peak_memory_mb"], rel=0.02)
        if method == "full":
            assert "model_trainable_params" not in m and "peft_r" not in p
            continue
        trainable = lora_by_hand(cfg, 16)
        assert int(p["trainable_params"]) == m["model_trainable_params"] == trainable
        assert (
            m["optimizer_state_bytes"] == 2 * 4 * trainable + 4 * 18
        )  # AdamW: two fp32 moments, a step each
        assert p["peft_targets"] == "attention.output.dense,key,query,value"
        assert p["peft_r"] == "16"
        assert m["peak_frozen_params_mb"] == pytest.approx(m["peak_params_mb"] - trainable * 4 / MB)
        assert m["peak_frozen_params_mb"] == pytest.approx(m["frozen_weights_mb"])
        assert m["peak_grads_mb"] <= trainable * 4 / MB
        if method.startswith("qlora"):
            assert m["quantized_weights_bytes"] == m["estimated_quantized_weights_bytes"]
            assert p["peft_double_quant"] == "True"
    asked = (
        "lora r=16",
        "accelerator",
    )  # peft.save_adapter=true: peft's save_pretrained (and its model card)
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= set(saved[asked])
    assert not any(paths for key, paths in saved.items() if key != asked)
    full = peft_runs[("full", "trainer")].data.metrics
    assert (
        peft_runs[("lora r=16", "trainer")].data.metrics["optimizer_state_mb"]
        < full["optimizer_state_mb"] / 100
    )


@pytest.mark.slow  # why: (shares the four-job sweep above)
def test_both_backends_give_the_same_figures(peft_runs):
    peft_runs, _ = peft_runs
    trainer, accelerator = (peft_runs[("lora r=16", b)].data.metrics for b in ("trainer", "accelerator"))
    for key in ["optimizer_state_bytes", "model_trainable_params", "peak_memory_mb", *BREAKDOWN]:
        assert trainer[key] == pytest.approx(accelerator[key], rel=1e-6), key
    assert trainer["train_loss_final"] == pytest.approx(accelerator["train_loss_final"], rel=1e-4)


@pytest.mark.parametrize("peft", ["lora", "qlora"])
def test_bf16_pure_adapters_are_bf16_and_their_state_is_estimated(peft):
    cfg = compose_cfg("model=tiny", "model.pretrained=false", f"peft={peft}", "train.precision=bf16_pure")
    model = models.load_model(cfg.model, num_labels=2).to(torch.bfloat16)
    model = adapters.apply(model, cfg.peft, "classification", "bert")
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.bfloat16}
    spec = optimizers.get("adamw")
    optimizer = spec.build(model, cfg)
    one_step(model, optimizer, models.vocab_size(model))
    assert optimizer_state_size(optimizer) == spec.estimate(
        optimizers.param_infos(model), cfg, None, model.config
    )


def test_gpt2_conv1d_layers_become_4bit_linears_of_the_same_weights():
    """GPT-2 keeps its projections as Conv1D (weight: in x out): LoRA adapts them as they are, QLoRA's 4-bit
    copy is a Linear's (out x in) that dequantizes to the same weights."""
    import bitsandbytes.functional as bnbf
    from transformers.pytorch_utils import Conv1D

    cfg, lora = peft_model("gpt2-tiny", "peft=lora")
    a = cfg.model.architecture
    per_layer = 16 * (a.n_embd + 3 * a.n_embd) + 16 * (a.n_embd + a.n_embd)  # attn.c_attn, attn.c_proj
    assert lora.get_nb_trainable_parameters()[0] == a.n_layer * per_layer + a.n_embd * 2  # + the score head
    torch.manual_seed(0)
    model = models.load_model(cfg.model, num_labels=2)
    conv = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, Conv1D)}
    adapters.quantize(model, compose_cfg("peft=qlora").peft, "cpu")
    for name, layer in model.named_modules():
        if name in conv:
            state = layer.weight.quant_state
            weight = bnbf.dequantize_4bit(layer.weight.data, state)
            assert tuple(weight.shape) == tuple(conv[name].t().shape), name
            assert torch.nn.functional.cosine_similarity(weight.flatten(), conv[name].t().flatten(), 0) > 0.99


def test_a_qlora_jobs_largest_batch_search_records_the_plans_answer_beside_it(tmp_path):
    """find_batch_size=true with adapters: the plan of the same worst case (adapters on a 4-bit base, every
    text max_length tokens) is recorded beside the probes' answer, and agrees with it within 5%."""
    proc = run_cli(
        tmp_path, "find_batch_size=true", "memory_budget_mb=26", "optim=adamw", "model=tiny", "peft=qlora",
        "backend=accelerator", "data.max_train_samples=128", "data.max_eval_samples=16",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = [r for r in store(tmp_path).search_runs(["1"]) if "max_batch_size" in r.data.metrics]
    measured, planned = run.data.metrics["max_batch_size"], run.data.metrics["predicted_max_batch_size"]
    assert measured > 0 and abs(planned - measured) <= max(1, 0.05 * measured), (measured, planned)


@pytest.mark.parametrize(
    ("precision", "overrides", "base", "trained"),
    [
        ("fp32", [], "fp32", "fp32"),
        ("bf16", [], "bf16", "fp32"),  # the recipe: a bf16 base, fp32 adapters
        ("fp16", [], "fp16", "fp32"),
        ("bf16_pure", [], "bf16", "bf16"),
        ("bf16", ["peft.base_dtype=fp32"], "fp32", "fp32"),  # an fp32 base under mixed precision
        ("bf16", ["peft.adapter_dtype=bf16"], "bf16", "bf16"),
    ],
)
def test_the_base_and_trained_dtypes_each_precision_resolves(precision, overrides, base, trained):
    cfg = compose_cfg("peft=lora", f"train.precision={precision}", *overrides)
    assert models.dtypes(cfg) == (base, trained)
    settings = fake_model.memory_settings(cfg)  # a plan's key holds them resolved
    assert (settings["base_dtype"], settings["adapter_dtype"]) == (base, trained)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["train.precision=bf16", "peft.base_dtype=fp16"],
            "peft.base_dtype=fp16 is invalid with train.precision=bf16: under autocast to bf16 the weights are "
            "fp32 or bf16; allowed: auto, fp32, bf16",
        ),
        (
            ["peft.base_dtype=bf16"],  # fp32: no autocast to meet a bf16 weight
            "peft.base_dtype=bf16 is invalid with train.precision=fp32: without autocast every weight computes in "
            "fp32; allowed: auto, fp32",
        ),
        (
            ["train.precision=bf16_pure", "peft.adapter_dtype=fp32"],  # a bf16 input meets an fp32 head
            "peft.adapter_dtype=fp32 is invalid with train.precision=bf16_pure: without autocast every weight "
            "computes in bf16; allowed: auto, bf16",
        ),
    ],
)
def test_weight_dtypes_a_step_cannot_compute_with_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg("model=tiny", "peft=lora", *overrides))
    assert str(err.value) == message
    for fine in (
        ["train.precision=bf16", "peft.base_dtype=fp32"],
        ["train.precision=bf16", "peft.adapter_dtype=bf16"],
    ):
        validate(compose_cfg("model=tiny", "peft=lora", *fine))


def test_a_weight_dtype_not_known_is_one_line():
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg("model=tiny", "peft=lora", "peft.base_dtype=int8"))
    assert str(err.value).startswith("peft.base_dtype='int8' is invalid:")
    assert "auto" in str(err.value) and "bf16" in str(err.value)


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("backend", ["trainer", "accelerator"])
@pytest.mark.parametrize("peft", ["lora", "qlora"])
def test_under_bf16_the_trained_model_has_a_bf16_base_and_fp32_adapters_and_state(backend, peft, tmp_path):
    """The recipe peft users run, read off the model each backend trained: the frozen base bf16 (QLoRA's
    unquantized layers; its Linear layers 4-bit, computing in bf16), every trainable weight fp32, its gradient
    and AdamW state fp32; the run's params say so."""
    from pipeline import backends, data, job, measurements
    from tests.conftest import TINY

    cfg = compose_cfg(
        *TINY,
        f"peft={peft}",
        f"backend={backend}",
        "train.precision=bf16",
        "train.max_steps=2",
        f"outputs_dir={tmp_path}",
    )
    tokenizer, splits, model = job.load(cfg)
    choice = optimizers.choose(cfg)
    collate = data.PaddingCollator(tokenizer, cfg.train.padding, cfg.train.max_length)
    train = functools.partial(backends.get(backend).train, evaluate=False)
    trained_run = backends.run(cfg, choice.spec, model, splits, collate, tmp_path, train=train)
    out = trained_run.output
    trained = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad and not adapters.is_4bit(p)]
    assert trained and frozen
    assert {p.dtype for p in trained} == {torch.float32}
    assert {p.dtype for p in frozen} == {torch.bfloat16}
    assert {p.grad.dtype for p in trained if p.grad is not None} <= {torch.float32}
    state = [t for s in out.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    assert state and {t.dtype for t in state} == {torch.float32}
    if peft == "qlora":
        layers = [m for m in model.modules() if type(m).__name__ == "Linear4bit"]
        assert layers and {m.compute_dtype for m in layers} == {torch.bfloat16}
    built = models.Built(
        model, *adapters.figures(cfg, model), models.vocab_size(model), *adapters.model_size(model)
    )
    params = measurements.training_result(cfg, choice, built, splits, trained_run)["params"]
    assert (params["base_dtype"], params["trainable_dtype"]) == ("bf16", "fp32")
