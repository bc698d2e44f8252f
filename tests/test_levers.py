"""The levers a plan weighs where a point does not fit (pipeline.levers): each one's figures are the plan of
the point that uses it, and the verdict names only the levers that help, each with what it buys and its risk."""

import pandas as pd
import pytest

from pipeline import levers, plan_job
from pipeline.report.verdict import lever_phrase
from tests.conftest import compose_cfg, run_cli, store

# each lever as a user types it, composed by Hydra: independent of pipeline.levers' own edits of a config
TYPED = {
    "checkpointing": ["train.gradient_checkpointing=true"],
    "loss_chunks": ["train.loss_chunks=8"],
    "in_backward": ["train.optimizer_in_backward=true", "train.max_grad_norm=0"],
    "offload": ["train.offload=activations"],
    "offload_optimizer": ["train.offload=optimizer"],
    "accumulate": [
        "batch_size=1",
        "train.gradient_accumulation_steps=32",
    ],  # (LONG's batch of 32, one at a time)
    "bf16": ["train.precision=bf16"],
    "base16": ["peft.base_dtype=auto"],
    "qlora": ["peft=qlora"],
    "bf16_pure": ["train.precision=bf16_pure"],
    "adamw_8bit": ["optim=adamw_8bit"],
    "adafactor": ["optim=adafactor"],
}


# batches whose peak falls in the forward and backward pass, where checkpointing can lower it
LONG = ["batch_size=32", "train.max_length=128"]


@pytest.mark.slow  # about 10 plans each: 20 s each
@pytest.mark.parametrize(
    ("point", "expected"),
    [
        (
            ["model=tiny", *LONG],
            {"checkpointing", "offload", "offload_optimizer", "in_backward", "accumulate", "bf16", "bf16_pure", "adamw_8bit",
             "adafactor"},
        ),
        (
            ["model=llama-tiny", "peft=lora", "train.precision=bf16", "peft.base_dtype=fp32", *LONG],
            {"checkpointing", "offload", "offload_optimizer", "in_backward", "accumulate", "base16", "qlora", "adamw_8bit",
             "adafactor"},
        ),
        (
            ["task=causal_lm", "model=llama-tiny", *LONG],
            {"checkpointing", "loss_chunks", "offload", "offload_optimizer", "in_backward", "accumulate", "bf16", "bf16_pure",
             "adamw_8bit", "adafactor"},
        ),
    ],
    ids=["full-fp32", "lora-bf16-fp32-base", "lm-full-fp32"],
)  # fmt: skip
def test_each_levers_figures_are_the_plan_of_the_point_that_uses_it(point, expected):
    """A point a budget just misses: the plan weighs the levers it does not use (full fine-tuning in fp32:
    checkpointing, the activations on the host, batches of one accumulated, mixed bf16, bf16 weights, 8-bit or factored state; LoRA on an
    fp32 base under bf16: a 16-bit base, a 4-bit one, not bf16_pure; a language model: its loss in pieces
    too), and what it records of each is the peak and largest batch of the plan of the point with that lever,
    as Hydra composes it from the command line."""
    free = plan_job.plan_result(compose_cfg("plan=true", *point))["metrics"]["predicted_peak_mb"]
    budget = f"memory_budget_mb={0.9 * free}"
    cfg = compose_cfg("plan=true", *point, budget)
    metrics = plan_job.plan_result(cfg)["metrics"]
    assert metrics["fits"] == 0 and metrics["predicted_step_peak_mb"] < metrics["predicted_peak_mb"]
    assert (
        set(levers.applicable(cfg))
        == expected
        == {k.split("_", 1)[1][:-8] for k in metrics if k.endswith("_peak_mb") and k.startswith("lever_")}
    )
    for name in expected:
        other = plan_job.plan_result(compose_cfg("plan=true", *point, budget, *TYPED[name]))["metrics"]
        assert metrics[f"lever_{name}_peak_mb"] == pytest.approx(other["predicted_peak_mb"], rel=1e-9), name
        # the largest batch where the lever fits the batch asked
        assert metrics.get(f"lever_{name}_max_batch_size") == (
            other["predicted_max_batch_size"] if other["fits"] else None
        ), name
    # sharding: the smallest number of ranks whose plan fits, and the largest batch per rank there
    shard = "fsdp"  # (adapters: the frozen base sharded too)
    ranks = int(metrics.get(f"lever_{shard}_ranks", 8))  # none recorded: no number of ranks fits (8 does not)
    sharded = [budget, f"launcher.nproc_per_job={ranks}", f"train.sharding={shard}"]
    if f"lever_{shard}_ranks" not in metrics:  # LoRA's state is small: sharding it leaves the pass as it is
        assert plan_job.plan_result(compose_cfg("plan=true", *point, *sharded))["metrics"]["fits"] == 0
        return
    other = plan_job.plan_result(compose_cfg("plan=true", *point, *sharded))["metrics"]
    assert (
        other["fits"] == 1 and other["predicted_max_batch_size"] == metrics[f"lever_{shard}_max_batch_size"]
    )
    if ranks > 2:
        sharded[1] = f"launcher.nproc_per_job={ranks // 2}"
        assert plan_job.plan_result(compose_cfg("plan=true", *point, *sharded))["metrics"]["fits"] == 0


def test_a_point_that_fits_weighs_no_lever():
    metrics = plan_job.plan_result(compose_cfg("plan=true", "model=tiny", "memory_budget_mb=10000"))[
        "metrics"
    ]
    assert metrics["fits"] == 1 and not [k for k in metrics if k.startswith("lever_")]


def test_the_verdict_names_the_levers_that_help_those_that_fit_first():
    """Those that fit: a smaller batch first, then by their peak, each with its largest batch and risk,
    sharding last; then those that help but not alone, each with what it saves; never one that does not
    help (its peak no lower)."""
    row = pd.Series(
        {
            "predicted peak [MB]": 1000.0,
            "budget [MB]": 800.0,
            "largest batch [samples]": 4.0,
            "lever_checkpointing_peak_mb": 1000.0,  # the peak falls where checkpointing changes nothing
            "lever_bf16_pure_peak_mb": 700.0,
            "lever_bf16_pure_max_batch_size": 12.0,
            "lever_adafactor_peak_mb": 600.0,
            "lever_adafactor_max_batch_size": 20.0,
            "lever_adamw_8bit_peak_mb": 900.0,
            "lever_adamw_8bit_max_batch_size": 0.0,
            "lever_fsdp_ranks": 2.0,
            "lever_fsdp_max_batch_size": 9.0,
        }
    )
    said = lever_phrase(row)
    risk = {name: lever.risk for name, lever in levers.LEVERS.items()}
    assert said == (
        f"batch_size=4 ({levers.SMALLER_BATCH.risk}); "
        f"optim=adafactor (600 MB, largest batch 20; {risk['adafactor']}); "
        f"train.precision=bf16_pure (700 MB, largest batch 12; {risk['bf16_pure']}); "
        "backend=accelerator launcher.nproc_per_job=2 train.sharding=fsdp (largest batch 9/GPU; "
        f"{risk['fsdp'].format(ranks=2)}). "
        "Not enough alone: optim=adamw_8bit (saves 100 MB, short by 100 MB)"
    )
    assert "checkpointing" not in said


@pytest.mark.slow  # a 1.5B plan through the CLI, levers weighed: about 20 s
def test_full_adamw_on_qwen_1_5b_at_1024_tokens_on_a_4090_is_told_the_levers_that_fit(tmp_path):
    """Qwen2.5-1.5B (its published architecture), mixed bf16, batch 1 of 1,024 tokens, on an RTX 4090: the
    peak falls in the optimizer step, where no lever that keeps AdamW's math fits alone; the verdict names the
    recipe that does (the step inside backward moves the peak into the pass, where checkpointing then helps),
    and the run records each lever's own figures (the report's)."""
    qwen_1_5b = {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28}
    args = [f"model.architecture.{k}={v}" for k, v in qwen_1_5b.items()]
    args += ["model.architecture.num_attention_heads=12", "model.name=qwen2.5-1.5b", "model=qwen2.5-0.5b"]
    common = ["plan=true", "task=causal_lm", "train.max_length=1024", "train.precision=bf16", "batch_size=1"]
    proc = run_cli(tmp_path, *common, *args, "device_memory=rtx-4090")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("verdict: ")]
    recipe = f"{levers.LEVERS['in_backward'].command} {levers.LEVERS['checkpointing'].command}"
    assert f"does not fit: adamw (short by 7,086 MB). To fit adamw: {recipe} (keeps the math: " in line, line
    assert line.endswith("; or 2 GPUs with train.sharding=fsdp") and len(line) <= 300, line
    client = store(tmp_path)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.data.params["recipe"] == recipe
    assert run.data.metrics["recipe_peak_mb"] <= run.data.metrics["budget_mb"]
    for name in ("adafactor", "bf16_pure", "adamw_8bit", "in_backward"):  # each lever's own figures
        assert run.data.metrics[f"lever_{name}_peak_mb"] < run.data.metrics["predicted_peak_mb"], name
