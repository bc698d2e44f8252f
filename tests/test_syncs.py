"""The training step makes the host wait for the device no more often than a bare loop does: counted on CPU
(bench.bare_loop.HostSyncs: the host's reads of tensor values), and the step timer's marks on a simulated
CUDA device, read once at the end."""

import itertools
import time

import pytest
import torch

from bench.bare_loop import HostSyncs, host_syncs
from pipeline.timing import StepTimer
from tests.conftest import TINY

# 6 steps of the tiny model: the counts cover steps 2-5 (8 batches of 16 for the bare loop's one epoch)
SYNC_JOB = [*TINY[:-1], "data.max_train_samples=128", "train.max_steps=6"]


@pytest.fixture(scope="module")
def syncs(tmp_path_factory):
    return host_syncs([*SYNC_JOB, f"outputs_dir={tmp_path_factory.mktemp('syncs')}"])


def test_the_count_sees_a_loops_reads(syncs):
    bare = syncs["bare"]
    assert bare["steps"] == 4
    assert bare["loop"] == 1  # its loss.item()
    assert bare["model"] >= 1  # the model's own forward reads too (transformers' attention-mask check)


@pytest.mark.parametrize("backend", ["trainer", "accelerator"])
def test_the_pipelines_step_waits_for_the_device_no_more_than_a_bare_loops(syncs, backend):
    assert syncs[backend]["total"] <= syncs["bare"]["total"], syncs
    # what is left is the model's own: the loop itself reads nothing during a step (losses are read in chunks)
    assert syncs[backend]["model"] == syncs["bare"]["model"], syncs
    assert syncs[backend]["loop"] == 0, syncs


@pytest.mark.parametrize("backend", ["trainer", "accelerator"])
def test_no_step_waits_for_its_batch_copy(syncs, backend):
    """Each step's batch goes to the device from pinned memory without blocking (accelerate's prepared loader,
    non_blocking): no step's copy waits, where accelerate's default copy would, once a step."""
    assert syncs[backend]["blocking_copies"] == 0, syncs


def test_reads_of_the_data_loader_and_the_optimizer_are_left_out():
    """A collate function reading host tensors and an optimizer reading its step count: no wait for the loop."""
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())  # (on CPU its step reads `step.item()`)

    def collate(rows):
        batch = torch.stack(rows)
        int(batch.sum())  # the pipeline's collator counts tokens so
        return batch

    loader = torch.utils.data.DataLoader([torch.ones(4)] * 12, batch_size=3, collate_fn=collate)
    with HostSyncs(model) as syncs:
        for batch in loader:
            loss = model(batch).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if loss > 0:  # a read of the loop's own
                pass
    assert syncs.per_step() == {"steps": 2, "total": 1, "model": 0, "loop": 1, "blocking_copies": 0}


class RecordedEvent:
    """torch.cuda.Event on the host's clock: `record` notes the time, `elapsed_time` is in ms."""

    def __init__(self, enable_timing: bool = False):
        self.at = None

    def record(self, stream=None) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, end: "RecordedEvent") -> float:
        return (end.at - self.at) * 1000


def test_the_step_timer_reads_cuda_events_once_at_the_end(monkeypatch):
    """On CUDA the timer records events at its marks and synchronises once, as its block ends; its figures
    keep their meaning: step starts with evaluation left out, optimizer step times, the pause."""
    synchronised = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", RecordedEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synchronised.append(device))
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # 20 ms inside each optimizer step (the optimizer's own hooks run after the timer's global ones)
    optimizer.register_step_pre_hook(lambda *args: time.sleep(0.02))
    with StepTimer(model) as timer:
        for step in range(1, 6):
            model.train()
            model(torch.ones(3, 4)).sum().backward()
            time.sleep(0.01)
            optimizer.step()
            optimizer.zero_grad()
            if step == 3:  # a validation pass between steps 3 and 4
                model.eval()
                with torch.no_grad():
                    model(torch.ones(3, 4))
                time.sleep(0.2)
        assert synchronised == [] and timer.starts_s == []  # nothing read while training
    assert len(synchronised) == 1
    assert timer.steps == 5 and len(timer.times_s) == 5
    assert all(0.02 <= t < 0.15 for t in timer.times_s), timer.times_s
    assert 0.2 <= timer.paused_s < 0.35
    gaps = [b - a for a, b in itertools.pairwise(timer.starts_s)]
    assert all(0.03 <= gap < 0.15 for gap in gaps), gaps  # the validation pass is in no step
    assert timer.window(1)[:2] == (2, 4)
