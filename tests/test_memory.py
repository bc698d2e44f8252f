import gc
import weakref

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

from pipeline import MB, models, optimizers
from pipeline.memory import PeakMemory
from pipeline.state import optimizer_state_size
from tests.conftest import ci_sample, compose_cfg, run_cli, sweep_runs


class FakeOptimizer:
    def __init__(self, state):
        self.state = state


def test_state_counts_scalars_as_their_tensor_dtype():
    size = optimizer_state_size(FakeOptimizer({"p": {"step": 3, "RMS": 0.5, "flag": True}}))
    assert size.numel == 3
    assert size.bytes == 8 + 4 + 1  # int64, float32, bool


def test_state_counts_a_shared_tensor_once_and_views_by_storage():
    shared = torch.zeros(256, dtype=torch.float32)
    base = torch.zeros(10, 10)
    size = optimizer_state_size(
        FakeOptimizer({"a": {"qmap": shared, "m": base[:5]}, "b": {"qmap": shared, "m": torch.zeros(4)}})
    )
    assert size.bytes == 256 * 4 + 100 * 4 + 4 * 4
    assert size.numel == 256 + 100 + 4


def test_state_counts_a_tensor_subclass_by_its_inner_storage():
    sub = TwoTensor(torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8))
    size = optimizer_state_size(FakeOptimizer({"p": {"q": sub}}))
    assert size.bytes == 16
    assert size.numel == 16


def test_cpu_peak_of_a_known_allocation():
    keep = torch.zeros(1000)  # exists before the region: not counted
    with PeakMemory("cpu") as peak:
        a = torch.empty(40 * MB, dtype=torch.uint8)
        b = torch.ones(10 * MB // 4)  # float32, 10 MB
        del a, b
        c = torch.empty(20 * MB, dtype=torch.uint8)
    assert peak.metrics()["peak_memory_mb"] == pytest.approx(50, rel=0.05)
    del keep, c


def test_cpu_peak_counts_the_baseline():
    weights = torch.zeros(5 * MB // 4)
    with PeakMemory("cpu", baseline=[weights]) as peak:
        x = weights * 2
        del x
    assert peak.metrics()["peak_memory_mb"] == pytest.approx(10, rel=0.05)


def one_step(model, optimizer, vocab):
    torch.manual_seed(0)
    ids = torch.randint(0, vocab, (2, 16))
    loss = model(input_ids=ids, labels=torch.tensor([0, 1])).loss
    if hasattr(optimizer, "fused_backward"):  # LOMO, AdaLomo: the update runs inside the backward pass
        optimizer.fused_backward(loss, optimizer.defaults["lr"])
    else:  # (a layer-wise optimizer steps from its hooks; its whole-model step does nothing)
        loss.backward()
        optimizer.step()


class CudaStaysPut(torch.overrides.TorchFunctionMode):
    """`Tensor.cuda()` leaves a tensor where it is. AdaLomo allocates its state with `.cuda()` (the pipeline
    runs it on CUDA only); its state's size does not depend on the device, so on a CPU-only machine the tests
    count it on the CPU this way."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **(kwargs or {}))


def build(spec, model, cfg):
    """The registry's optimizer; one that needs CUDA on a machine without it, with its state on the CPU."""
    if spec.needs_cuda and not torch.cuda.is_available():
        with CudaStaysPut():
            return spec.build(model, cfg)
    return spec.build(model, cfg)


# settings that leave the state alone but make a CPU step affordable: torch's Muon runs its Newton-Schulz
# iterations in bf16, which on CPU takes minutes for DistilBERT (they shape the update, not the momentum buffer)
FAST_STEP = {"muon": ("optim.ns_steps=0",)}


# distilbert rows that run in CI, one per kind of accounting (full, factored, 8-bit blocks, parts, in-backward,
# a user's own); `make test-matrix` runs the other optimizers on distilbert, `make optimizer-table` tabulates them
DISTILBERT_SAMPLE = ["adamw", "adafactor", "adamw_8bit", "muon", "lomo", "galore_adamw_layerwise", "custom"]


@pytest.mark.parametrize("optim", list(optimizers.REGISTRY))
def test_measured_state_equals_estimate(optim):
    state_equals_estimate("tiny", optim)


@pytest.mark.parametrize("optim", ci_sample(list(optimizers.REGISTRY), DISTILBERT_SAMPLE))
def test_measured_state_equals_estimate_on_distilbert(optim):
    state_equals_estimate("distilbert-base-cased", optim)


def state_equals_estimate(model_name, optim):
    cfg = compose_cfg(
        f"model={model_name}", "model.pretrained=false", f"optim={optim}", *FAST_STEP.get(optim, ())
    )
    model = models.load_model(cfg.model, num_labels=2)
    if model_name == "distilbert-base-cased":
        assert sum(p.numel() for p in model.parameters()) == 65_783_042
        assert len(list(model.parameters())) == 104
    spec = optimizers.get(optim)
    optimizer = build(spec, model, cfg)
    if spec.needs_train_eval_mode:
        optimizer.train()
    one_step(model, optimizer, models.vocab_size(model))
    measured = optimizer_state_size(optimizer)
    estimated = spec.estimate(optimizers.param_infos(model), cfg, None, model.config)
    assert measured == estimated


@pytest.mark.parametrize("optim", list(optimizers.REGISTRY))
def test_measured_state_equals_estimate_through_accelerate(optim):
    """The optimizer as both backends step it, wrapped by accelerate's `prepare` (the Trainer's too), which
    reloads its state dict to place it: an optimizer made of parts must survive that (Muon's parts once went
    on filling a state dict that nothing counted: 0 MB measured)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    cfg = compose_cfg("model=tiny", f"optim={optim}", *FAST_STEP.get(optim, ()))
    model = models.load_model(cfg.model, num_labels=2)
    spec = optimizers.get(optim)
    AcceleratorState._reset_state(reset_partial_state=True)
    prepared = Accelerator(cpu=True).prepare(build(spec, model, cfg))
    if spec.needs_train_eval_mode:
        prepared.optimizer.train()
    lomo = hasattr(
        prepared.optimizer, "fused_backward"
    )  # driven by fused_backward, not by the wrapper's step
    one_step(model, prepared.optimizer if lomo else prepared, models.vocab_size(model))
    estimated = spec.estimate(optimizers.param_infos(model), cfg, None, model.config)
    assert optimizer_state_size(prepared.optimizer) == estimated


def test_distilbert_adamw_state_matches_the_quick_estimate():
    cfg = compose_cfg("model=distilbert-base-cased", "model.pretrained=false")
    model = models.load_model(cfg.model, num_labels=2)
    size = optimizers.get("adamw").estimate(optimizers.param_infos(model), cfg)
    # num_parameters * 8 bytes, plus one 4-byte step per tensor
    assert size.bytes == 65_783_042 * 8 + 104 * 4
    assert 501 < size.mb < 503


# ---- the peak's breakdown, its prediction and the largest batch that fits (real jobs through the CLI) ----

BREAKDOWN = ["peak_params_mb", "peak_grads_mb", "peak_optimizer_mb", "peak_activations_mb", "peak_other_mb"]
LOGITS = "peak_logits_mb"  # a language model's sixth part (task=causal_lm); a classifier logs none


def breakdown(metrics: dict) -> list[str]:
    """The parts of a run's breakdown: BREAKDOWN, and a language model's logits where the run has them."""
    return BREAKDOWN + [LOGITS] * (LOGITS in metrics)


PROFILED = {
    "tiny": ["model=tiny", "backend=trainer,accelerator", "train.max_steps=4"],
    "minilm": ["backend=accelerator", "train.max_steps=3"],  # the default model
    # a decoder fine-tuned as a language model: its logits (30,522-token vocabulary) most of its peak
    "lm": ["task=causal_lm", "model=llama-tiny", "train.max_steps=3", "data.max_val_samples=16"],
}


@pytest.fixture(
    scope="module",
    params=[
        "tiny",
        pytest.param("minilm", marks=pytest.mark.slow),  # why: the default model, a minute
        pytest.param("lm", marks=pytest.mark.slow),  # why: two language-model jobs, about 35 s on 2 cores
    ],
)
def profiled_jobs(request, tmp_path_factory):
    """tiny on both backends, minilm (the default model) and llama-tiny as a language model, for AdamW and
    Adafactor; fixed-length batches so that every step has the same shapes and the profiled step holds the
    peak."""
    tmp = tmp_path_factory.mktemp(f"profiled_{request.param}")
    fixed = ["train.padding=max_length", "data.max_train_samples=64", "data.max_eval_samples=16"]
    proc = run_cli(tmp, "-m", "optim=adamw,adafactor", *PROFILED[request.param], *fixed)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep_runs(tmp)[1]


def test_breakdown_adds_up_to_the_measured_peak(profiled_jobs):
    model = profiled_jobs[0].data.params["model"]
    assert len(profiled_jobs) == {"tiny": 4, "minilm": 2, "llama-tiny": 2}[model]
    for run in profiled_jobs:
        m = run.data.metrics
        assert run.data.tags["peak_breakdown"] == "step 2"
        # a language model's breakdown has its logits, a classifier's none
        assert (LOGITS in m) == (run.data.params.get("task") == "causal_lm"), m
        parts = breakdown(m)
        assert sum(m[k] for k in parts) == pytest.approx(m["peak_memory_mb"], rel=0.02)
        assert sum(m[k] for k in parts) == pytest.approx(m["peak_breakdown_mb"], rel=1e-6)
        # the stored state is all there at the peak (the step's temporaries count as "other"); Adafactor's
        # Python-int `step` counts 8 bytes in the state's size but is no tensor memory: a few hundred bytes
        assert m["peak_optimizer_mb"] >= m["optimizer_state_mb"] - 1 / 1024
        assert m["peak_params_mb"] == pytest.approx(m["model_num_params"] * 4 / MB, rel=0.01)


def test_prediction_is_within_5_percent(profiled_jobs):
    errors = {}
    for run in profiled_jobs:
        m, p = run.data.metrics, run.data.params
        errors[(p["model"], p["optim"], p["backend"])] = m["predicted_peak_error_pct"]
        assert m["predicted_peak_error_pct"] == pytest.approx(
            100 * (m["predicted_peak_mb"] / m["peak_memory_mb"] - 1)
        )
    print("prediction error [%]:", errors)
    assert all(abs(e) <= 5 for e in errors.values()), errors


def saved_for_backward(model, ids, mask) -> int:
    """Bytes of every storage autograd saves in one forward pass, the weights left out."""
    weights = {id(p.untyped_storage()) for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if id(storage) not in weights:
            saved[id(storage)] = (storage, storage.nbytes())  # (kept alive: ids stay unique)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, attention_mask=mask, labels=torch.zeros(ids.shape[0], dtype=torch.long))
    return sum(n for _, n in saved.values())


def test_the_simulated_forward_saves_what_the_real_one_saves():
    """The plan runs the model's own forward on fake tensors: autograd keeps the same bytes for backward
    (an independent count, by torch.autograd.graph.saved_tensors_hooks, on the real and the fake model).
    The real batch is padded, as the collator's batches are: transformers skips a decoder's causal mask for a
    batch without any padding (SDPA's is_causal, grouped key/value heads not repeated), which it cannot tell
    on fake tensors, so the plan counts the masked path (an upper bound for a batch without padding)."""
    from pipeline import plan_step

    for name, batch, seq in [("tiny", 16, 64), ("distilbert-base-cased", 4, 32), ("llama-tiny", 4, 32)]:
        cfg = compose_cfg(f"model={name}", "model.pretrained=false")
        model = models.load_model(cfg.model, num_labels=2).train()
        model.config.pad_token_id = 0
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[1:, seq // 2 :] = 0  # every sample but the first padded
        real = saved_for_backward(model, torch.randint(1, 1000, (batch, seq)), mask)
        mode, fake = plan_step.fake_model(model.config, "fp32", False)
        with mode:
            ones = torch.ones(batch, seq, dtype=torch.long)
            simulated = saved_for_backward(fake, ones, ones)
        assert simulated == real > 0, name


def test_training_memory_tracks_the_largest_batch_after_its_window():
    """CPU: steps after the first `track_steps` run untracked unless their batch is the largest so far."""
    from pipeline.memory import TrainingMemory

    cfg = compose_cfg("model=tiny")
    model = models.load_model(cfg.model, num_labels=2).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with TrainingMemory("cpu", model, track_steps=2, breakdown_step=2) as memory:
        for seq in [16, 16, 8, 32, 16]:
            model(
                input_ids=torch.ones(4, seq, dtype=torch.long), labels=torch.zeros(4, dtype=torch.long)
            ).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    assert memory.tracked_steps == [1, 2, 4]
    assert memory.largest_batch == (4, 32)
    assert memory.metrics()["peak_breakdown_mb"] > 0


@pytest.mark.parametrize("skipped", [2, 3])
def test_training_memory_hooks_every_module_only_during_its_breakdown(skipped):
    """A global module hook puts every submodule's call on torch's slower hooked path: TrainingMemory holds one
    only while its breakdown step runs (where it ends a step whose optimizer step was skipped, as the fp16 grad
    scaler does, before MemTracker sees the next forward). A skipped step ends at the next one's start, inside
    the breakdown (step 2) or outside it (step 3)."""
    from torch.nn.modules import module as nn_module

    from pipeline.memory import TrainingMemory

    cfg = compose_cfg("model=tiny")
    model = models.load_model(cfg.model, num_labels=2).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hooked = []
    with TrainingMemory("cpu", model, track_steps=1, breakdown_step=2) as memory:
        for step in range(1, 5):
            hooked.append(memory._before_any_forward in nn_module._global_forward_pre_hooks.values())
            model(
                input_ids=torch.ones(4, 8, dtype=torch.long), labels=torch.zeros(4, dtype=torch.long)
            ).loss.backward()
            if step != skipped:
                optimizer.step()
            optimizer.zero_grad()
    # (a step skipped inside the breakdown keeps it open until the next step's forward ends it)
    assert hooked == [False, True, skipped == 2, False]
    assert not nn_module._global_forward_pre_hooks
    assert memory.step == 4 and memory.optimizer_steps == 3
    label = "step 2" + (" (its optimizer step was skipped by the grad scaler)" if skipped == 2 else "")
    assert memory.breakdown_label == label
    assert memory.metrics()["peak_breakdown_mb"] > 0


class SavedInStep:
    """Weak references to what a model's `step`th training step saves for backward (its weights and buffers left
    out): `with SavedInStep(model, 2) as saved:` around the training, then `saved.alive_mb()`."""

    def __init__(self, model: torch.nn.Module, step: int):
        self.kept = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        self.step, self.steps, self.refs = step, 0, []
        self._count = model.register_forward_pre_hook(lambda module, args: self._started(module))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _started(self, module) -> None:
        self.steps += module.training

    def _pack(self, t):
        storage = t.untyped_storage()
        if self.steps == self.step and storage.data_ptr() not in self.kept:
            self.refs.append((weakref.ref(storage), storage.nbytes()))
        return t.detach()  # (not t: an op's output saved by its own node would be a cycle of this test's)

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._count.remove()

    def alive_mb(self) -> float:
        return sum(nbytes for ref, nbytes in self.refs if ref() is not None) / MB


class FailsInBackward(torch.autograd.Function):
    """The identity, whose backward runs out of memory when `fail` is true."""

    @staticmethod
    def forward(ctx, x, fail: bool):
        ctx.fail = fail
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.fail:
            raise torch.OutOfMemoryError("out of memory (a test's backward)")
        return grad, None


class OutOfMemoryAt(torch.nn.Module):
    """The identity, which runs out of memory in the forward or the backward pass (`where`) of its `step`th
    call in training mode."""

    def __init__(self, step: int, where: str):
        super().__init__()
        self.step, self.where, self.calls = step, where, 0

    def forward(self, x):
        self.calls += self.training
        if self.calls == self.step and self.where == "forward":
            raise torch.OutOfMemoryError("out of memory (a test's forward)")
        return FailsInBackward.apply(x, self.calls == self.step and self.where == "backward")


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_step_out_of_memory_under_the_breakdown_leaves_no_activation_alive(where):
    """find_batch_size's probe that runs out of memory in its second step, the breakdown's, in the forward or
    the backward pass: once the probe has cleaned up (gradients set to None, one gc pass), none of that step's
    saved activations is alive, so the next probe has the room this one had (on an H200 every probe after
    the first that failed did not fit, ~950 MB allocated where a fitting one had peaked at 666 MB)."""
    from torch.nn.modules import module as nn_module

    from pipeline.memory import TrainingMemory

    torch.manual_seed(0)
    mlp = [m for _ in range(4) for m in (torch.nn.Linear(256, 256), torch.nn.ReLU())]
    model = torch.nn.Sequential(*mlp[:4], OutOfMemoryAt(2, where), *mlp[4:]).train()
    optimizer = torch.optim.Adam(model.parameters())

    def train_step():
        model(torch.randn(512, 256)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    try:
        with SavedInStep(model, 2) as saved, TrainingMemory("cpu", model, breakdown_step=2) as memory:
            for _ in range(2):
                train_step()
    except torch.OutOfMemoryError:
        pass
    finally:  # the probe's clean-up (pipeline.batch_size.search)
        model.zero_grad(set_to_none=True)
        gc.collect()
    assert not nn_module._global_forward_pre_hooks  # the breakdown ended
    assert memory.breakdown_label is None and not memory.breakdown_metrics  # a step cut short has no figures
    assert saved.refs
    assert saved.alive_mb() == 0, f"{saved.alive_mb():.2f} of {sum(n for _, n in saved.refs) / MB:.2f} MB"


def test_largest_fitting_doubles_then_bisects():
    from pipeline.batch_size import largest_fitting

    for limit, upper in [(41, 1000), (1, 10), (64, 64), (100, 70)]:
        probes = []
        fits = lambda n, limit=limit, probes=probes: probes.append(n) or n <= limit  # noqa: E731
        assert largest_fitting(fits, upper) == min(limit, upper)
        assert len(probes) <= 2 * upper.bit_length() + 1
    assert largest_fitting(lambda n: False, 100) == 0


@pytest.fixture(scope="module")
def fit_sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fit")
    proc = run_cli(
        tmp, "-m", "find_batch_size=true", "memory_budget_mb=26", "optim=adamw,adafactor", "model=tiny",
        "backend=accelerator", "data.max_train_samples=128", "data.max_eval_samples=16",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, proc


def test_find_batch_size_gives_adafactor_a_larger_batch(fit_sweep):
    tmp, proc = fit_sweep
    runs = {r.data.params["optim"]: r.data.metrics for r in sweep_runs(tmp)[1]}
    assert runs["adafactor"]["max_batch_size"] > runs["adamw"]["max_batch_size"] > 0
    for m in runs.values():
        assert m["max_batch_peak_memory_mb"] <= 26
        assert m["predicted_max_batch_size"] > 0
    assert "largest batch that fits" in proc.stdout


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_probes_out_of_memory_in_their_second_step_leave_nothing_to_the_next(tmp_path):
    """find_batch_size's search (tiny, the accelerator backend, 26 MB): each probe that runs out of memory in its
    second step leaves none of what that step saved for backward alive when the next probe starts. On CPU the
    answer would be the same either way: a probe counts only the storages made under its own tracker. On CUDA
    the allocator counts everything still held."""
    from pipeline import backends, batch_size, data, job

    cfg = compose_cfg(
        "model=tiny", "find_batch_size=true", "memory_budget_mb=26", "backend=accelerator",
        "data.max_train_samples=128", "data.max_eval_samples=16", f"outputs_dir={tmp_path}",
    )  # fmt: skip
    tokenizer, splits, model = job.load(cfg)
    train = backends.get(cfg.backend.name).train
    probes = []  # (batch size, the step it ran out of memory in or None, its second step's SavedInStep)

    def left_alive(batch: int, failed_in: int | None, saved: SavedInStep) -> str:
        alive = saved.alive_mb()
        return (
            f"batch {batch} (out of memory in step {failed_in}): {alive:.2f} MB alive after it"
            if alive
            else ""
        )

    def probe(probe_cfg, *args, **kwargs):
        if probes:  # the one before has cleaned up
            assert not left_alive(*probes[-1])
        with SavedInStep(model, 2) as saved:
            probes.append((probe_cfg.batch_size, None, saved))
            try:
                return train(probe_cfg, *args, **kwargs)
            except torch.OutOfMemoryError:
                probes[-1] = (probe_cfg.batch_size, saved.steps, saved)
                raise

    best, _ = batch_size.search(
        cfg, model, splits, optimizers.choose(cfg).spec,
        lambda p: data.PaddingCollator(tokenizer, p.train.padding, p.train.max_length), tmp_path, probe,
    )  # fmt: skip
    assert not left_alive(*probes[-1])
    assert best > 0
    assert [n for n, step, _ in probes if step == 2], probes  # some did run out of memory in step 2


# ---- optimizers that update inside the backward pass ------------------------------------------------------


def breakdown_of_training(optim: str, backend_steps: int = 3) -> dict[str, float]:
    """The peak breakdown of a few CPU training steps on tiny (random weights), the update driven as the
    Accelerator loop drives it: LOMO by fused_backward, a layer-wise optimizer by its hooks, else step()."""
    from pipeline.memory import TrainingMemory

    cfg = compose_cfg("model=tiny", "model.pretrained=false", f"optim={optim}")
    model = models.load_model(cfg.model, num_labels=2).train()
    spec = optimizers.get(optim)
    optimizer = spec.build(model, cfg)
    with TrainingMemory("cpu", model, track_steps=None, breakdown_step=2) as memory:
        for step in range(backend_steps):
            torch.manual_seed(step)
            ids = torch.randint(0, models.vocab_size(model), (8, 32))
            loss = model(input_ids=ids, labels=torch.zeros(8, dtype=torch.long)).loss
            if spec.in_backward == optimizers.LOMO:
                optimizer.fused_backward(loss, cfg.train.lr)
            else:
                loss.backward()
            if spec.in_backward:
                memory.updated_in_backward(optimizer)
            else:
                optimizer.step()
                optimizer.zero_grad()
    assert memory.breakdown_tag == "step 2"
    return memory.metrics()


def test_lomo_keeps_a_small_share_of_gradients_at_the_peak():
    """LOMO updates each parameter as its gradient arrives and frees that gradient: at the step's peak almost
    no gradient is alive, where AdamW holds every gradient (the model's size) through its step."""
    adamw, lomo = breakdown_of_training("adamw"), breakdown_of_training("lomo")
    weights = adamw["peak_params_mb"]
    assert adamw["peak_grads_mb"] == pytest.approx(weights, rel=0.01)
    assert lomo["peak_grads_mb"] < 0.1 * adamw["peak_grads_mb"], (lomo, adamw)
    assert lomo["peak_optimizer_mb"] == 0
    assert lomo["peak_breakdown_mb"] < adamw["peak_breakdown_mb"] - weights  # no state, no gradients


def test_layerwise_state_is_tracked_as_optimizer_state_at_the_peak():
    """The per-parameter optimizers' state (behind transformers' layer-wise dummy) counts as optimizer state
    in the breakdown, and gradients at the peak are at most the largest weight's."""
    galore = breakdown_of_training("galore_adamw_layerwise")
    cfg = compose_cfg("model=tiny", "model.pretrained=false")
    model = models.load_model(cfg.model, num_labels=2)
    largest = max(p.numel() * p.element_size() for p in model.parameters()) / MB
    assert galore["peak_grads_mb"] <= largest * 1.001
    assert galore["peak_optimizer_mb"] > 0.9 * galore["peak_params_mb"] * 2  # Adam moments, mostly full


class SimulatedCuda:
    """torch.cuda's allocator calls as on a device of `total` bytes, whose caching allocator reserves
    `reserved` bytes: the calls PeakMemory makes are answered, and its cap (the per-process fraction)
    recorded."""

    def __init__(self, monkeypatch, total: int, reserved: int):
        self.fractions = []
        properties = type("Properties", (), {"total_memory": total})()
        for name, value in [
            ("synchronize", None),
            ("reset_peak_memory_stats", None),
            ("memory_reserved", reserved),
            ("memory_allocated", reserved),
            ("max_memory_allocated", reserved),
            ("max_memory_reserved", reserved),
            ("get_device_properties", properties),
        ]:
            monkeypatch.setattr(torch.cuda, name, lambda *a, v=value, **k: v)
        monkeypatch.setattr(
            torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: self.fractions.append(f)
        )


def test_a_paged_optimizers_state_counts_against_the_budget_on_cuda(monkeypatch):
    """Paged state lives in managed memory, outside the caching allocator that a budget caps: once it exists,
    the cap shrinks by it, and what the allocator reserves plus it past the budget is an out-of-memory."""
    from pipeline.memory import OutsideBudgetExceeded

    cuda = SimulatedCuda(monkeypatch, total=1000 * MB, reserved=60 * MB)
    with PeakMemory(torch.device("cuda", 0), budget_mb=100) as peak:
        peak.hold_outside(30 * MB)
        with pytest.raises(
            OutsideBudgetExceeded, match=r"budget of 100.0 MB exceeded: 110.0 MB = 60.0 MB reserved"
        ):
            peak.hold_outside(50 * MB)
    assert cuda.fractions == [0.1, 0.07, 1.0]  # the budget, less the paged state, lifted at the end


def test_training_memory_counts_the_paged_state_after_the_first_optimizer_step(monkeypatch):
    """The training tracker hands the paged part of the state to the CUDA peak once the first optimizer step
    has made it (bitsandbytes marks paged tensors `is_paged`)."""
    from pipeline.memory import TrainingMemory

    cuda = SimulatedCuda(monkeypatch, total=1000 * MB, reserved=10 * MB)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    paged = torch.zeros(5 * MB // 4)
    paged.is_paged = True
    with TrainingMemory(torch.device("cuda", 0), model, budget_mb=100, breakdown_na="n/a") as tracker:
        model(torch.ones(2, 4)).sum().backward()
        optimizer.state[model.weight]["paged"] = paged
        optimizer.step()
    assert tracker.cuda.outside_bytes == 5 * MB
    assert cuda.fractions == [0.1, 0.095, 1.0]
