"""train.gradient_accumulation_steps: a step of several batches, their gradients summed, on both backends; its
loss scaled as the Trainer scales it; its peak planned with every gradient held from the step's second batch; a
job stopped inside a step resumes from that step's end."""

import pytest

from pipeline import checkpoint
from pipeline.config import ConfigError, validate
from tests.conftest import TINY, compose_cfg
from tests.test_checkpoint import sigterm_at, stop_signal  # noqa: F401 (a fixture)

LM = ["task=causal_lm", "model=llama-tiny"]


def job_result(cfg, job_dir):
    from pipeline import job

    job_dir.mkdir(parents=True, exist_ok=True)
    return job.run(cfg, job_dir)


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("task", [[], LM], ids=["classifier", "lm"])
def test_both_backends_accumulate_alike_and_the_plan_holds_the_gradients(task, tmp_path):
    """3 batches of 4 a step; 64 texts are 16 batches an epoch, so its sixth step takes the one left (as the
    Trainer groups them) and the seventh starts the next epoch, reshuffled alike. Each step's loss and the
    evaluation are the same on both backends; the peak is the plan's within 1%, with the gradients held through
    the step's later batches."""
    found = {}
    for backend in ("trainer", "accelerator"):
        cfg = compose_cfg(*TINY, *task, f"backend={backend}", "batch_size=4", "train.max_steps=7",
                          "train.gradient_accumulation_steps=3", f"outputs_dir={tmp_path}")  # fmt: skip
        found[backend] = job_result(cfg, tmp_path / backend)
    trainer, accelerator = found["trainer"], found["accelerator"]
    assert len(trainer["series"]["train_loss"]) == 7
    assert accelerator["series"]["train_loss"] == pytest.approx(trainer["series"]["train_loss"], rel=1e-5)
    assert accelerator["metrics"]["eval_loss"] == pytest.approx(trainer["metrics"]["eval_loss"], rel=1e-5)
    for result in found.values():
        m = result["metrics"]
        assert m["peak_memory_mb"] == pytest.approx(m["predicted_peak_mb"], rel=0.01)
        assert (
            m["peak_grads_mb"] > 0
        )  # (a language model's step 2 holds them at its peak; one batch a step not)


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_language_models_accumulated_step_is_its_big_batchs_step_with_less_memory(tmp_path):
    """2 batches of 4 a step against 1 of 8 (the Accelerate loop; no dropout in the tiny Llama): the same loss
    each step (the sum over the step's label tokens over their count), a smaller peak, each peak the plan's."""
    runs = {}
    for batch, accumulate in ((8, 1), (4, 2)):
        cfg = compose_cfg(*TINY, *LM, "backend=accelerator", f"batch_size={batch}", "train.max_steps=4",
                          f"train.gradient_accumulation_steps={accumulate}", f"outputs_dir={tmp_path}")  # fmt: skip
        runs[accumulate] = job_result(cfg, tmp_path / str(accumulate))
    assert runs[2]["series"]["train_loss"] == pytest.approx(runs[1]["series"]["train_loss"], rel=1e-5)
    big, small = runs[1]["metrics"], runs[2]["metrics"]
    assert small["peak_memory_mb"] < big["peak_memory_mb"]
    for m in (big, small):
        assert m["peak_memory_mb"] == pytest.approx(m["predicted_peak_mb"], rel=0.01)


@pytest.mark.usefixtures("fresh_accelerate_state", "stop_signal")
@pytest.mark.parametrize("backend", ["accelerator", "trainer"])
def test_a_job_stopped_between_a_steps_batches_resumes_to_the_figures_of_one_never_stopped(
    backend, tmp_path, monkeypatch
):
    """SIGTERM in step 5's second batch (of 3): the job stops at that step's end, checkpointed; run again it
    resumes there, to the losses and evaluation of the run never stopped."""
    cfg = compose_cfg(*TINY, f"backend={backend}", "train.max_steps=8", "batch_size=4",
                      "train.gradient_accumulation_steps=3", "train.checkpoint_every=2", f"outputs_dir={tmp_path}")  # fmt: skip
    whole = job_result(cfg, tmp_path / "whole")
    monkeypatch.setenv(checkpoint.ENV, str(tmp_path / "checkpoints"))
    hook = sigterm_at(3 * 4 + 2)
    try:
        with pytest.raises(checkpoint.Preempted) as stopped:
            job_result(cfg, tmp_path / "first")
    finally:
        hook.remove()
    assert stopped.value.step == 5
    checkpoint._asked.clear()
    resumed = job_result(cfg, tmp_path / "second")
    assert resumed["series"]["train_loss"] == whole["series"]["train_loss"]
    assert resumed["metrics"]["eval_loss"] == whole["metrics"]["eval_loss"]


@pytest.mark.parametrize(
    "overrides,named",
    [
        (["train.gradient_accumulation_steps=0"], "train.gradient_accumulation_steps=0"),
        (["train.gradient_accumulation_steps=2", "train.optimizer_in_backward=true", "train.max_grad_norm=0"],
         "train.optimizer_in_backward=true is invalid with train.gradient_accumulation_steps=2"),
        (["train.gradient_accumulation_steps=2", "optim=lomo"],
         "optim=lomo is invalid with train.gradient_accumulation_steps=2"),
    ],
)  # fmt: skip
def test_bad_accumulation_is_one_line(overrides, named):
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(*overrides))
    assert named in str(err.value) and "\n" not in str(err.value)
