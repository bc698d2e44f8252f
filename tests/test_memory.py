import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

from pipeline import MB, models, optimizers
from pipeline.memory import PeakMemory, optimizer_state_size
from tests.conftest import compose_cfg


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
    loss.backward()
    optimizer.step()


@pytest.mark.parametrize("model_name", ["tiny", "distilbert-base-cased"])
@pytest.mark.parametrize("optim", list(optimizers.REGISTRY))
def test_measured_state_equals_estimate(model_name, optim):
    cfg = compose_cfg(f"model={model_name}", "model.pretrained=false", f"optim={optim}")
    model = models.load_model(cfg.model, num_labels=2)
    if model_name == "distilbert-base-cased":
        assert sum(p.numel() for p in model.parameters()) == 65_783_042
        assert len(list(model.parameters())) == 104
    spec = optimizers.get(optim)
    optimizer = spec.build(model, cfg)
    if spec.needs_train_eval_mode:
        optimizer.train()
    one_step(model, optimizer, models.vocab_size(model))
    measured = optimizer_state_size(optimizer)
    estimated = spec.estimate(optimizers.param_infos(model), cfg, None, model.config)
    assert measured == estimated


def test_distilbert_adamw_state_matches_the_quick_estimate():
    cfg = compose_cfg("model=distilbert-base-cased", "model.pretrained=false")
    model = models.load_model(cfg.model, num_labels=2)
    size = optimizers.get("adamw").estimate(optimizers.param_infos(model), cfg)
    # num_parameters * 8 bytes, plus one 4-byte step per tensor
    assert size.bytes == 65_783_042 * 8 + 104 * 4
    assert 501 < size.mb < 503
