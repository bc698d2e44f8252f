"""The recipe of a point that does not fit (pipeline.recipe): the levers that keep the training math first, then
those that approximate it, another optimizer last; each joins where it lowers the peak, and the first combination
that fits is cut to the levers it needs. Against the plans of the 8B and 7B points a new user asked about."""

import pytest

import pipeline
from pipeline import plan_job, recipe
from pipeline.recipe import Planned
from tests.conftest import compose_cfg
from tests.test_own_model import write_json

# Qwen2.5-7B's config.json as published on the hub (Qwen/Qwen2.5-7B)
QWEN_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 131072,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 152064,
}


def fake_plans(peaks: dict[tuple, float]):
    """plan_with for the search: each combination's peak (sorted names), every other combination at 100."""
    asked = []

    def plan_with(names, largest=False):
        asked.append(list(names))
        return recipe.Planned(peaks.get(tuple(sorted(names)), 100.0), 1)

    return plan_with, asked


def test_the_levers_that_keep_the_math_come_first_and_the_recipe_keeps_only_what_it_needs():
    cfg = compose_cfg("task=causal_lm", "model=llama-tiny")
    singles = {
        "in_backward": Planned(90.0, 0, logits=20.0),
        "bf16_pure": Planned(80.0, 0),
        "adamw_8bit": Planned(85.0, 0),
        "adafactor": Planned(50.0, 1),
    }
    # bf16 weights lower the peak beside the step inside backward, but it takes 8-bit state to fit, and with it
    # the bf16 weights are not needed
    peaks = {("bf16_pure", "in_backward"): 65.0, ("adamw_8bit", "bf16_pure", "in_backward"): 55.0}
    plan_with, asked = fake_plans({**peaks, ("adamw_8bit", "in_backward"): 58.0})
    found = recipe.search(cfg, [*singles, "loss_chunks"], singles, plan_with, 60.0, Planned(120.0, 0))
    assert found["params"] == {
        "recipe": "train.optimizer_in_backward=true train.max_grad_norm=0 optim=adamw_8bit",
        "recipe_kinds": "keeps the math: in_backward; approximates it: adamw_8bit",
    }
    assert found["metrics"] == {"recipe_peak_mb": 58.0, "recipe_max_batch_size": 1}
    # tried in order: the other lever that keeps the math, then the approximations; adafactor never
    assert asked[:3] == [
        ["in_backward", "loss_chunks"],
        ["in_backward", "bf16_pure"],
        ["in_backward", "bf16_pure", "adamw_8bit"],
    ]
    assert not any("adafactor" in a for a in asked)


def test_an_optimizer_lever_replaces_the_other_and_nothing_fitting_says_the_smallest_peak():
    cfg = compose_cfg()
    singles = {"adamw_8bit": Planned(80.0, 0), "adafactor": Planned(70.0, 0)}
    plan_with, asked = fake_plans({})
    found = recipe.search(cfg, list(singles), singles, plan_with, 10.0, Planned(90.0, 0))
    assert found == {"params": {"recipe": "none"}, "metrics": {"recipe_peak_mb": 70.0}}
    assert not any({"adamw_8bit", "adafactor"} <= set(a) for a in asked)  # never both
    nothing = recipe.search(
        cfg, list(singles), singles, plan_with, 10.0, Planned(60.0, 0)
    )  # neither lowers a peak of 60
    assert nothing == {"params": {"recipe": "none"}, "metrics": {}}
    assert recipe.kind_of("adamw_8bit", compose_cfg("optim=adafactor")) == recipe.OTHER


def test_the_second_round_plans_no_combination_it_planned_already():
    """Levers that lowered nothing beside the step inside backward, and nothing moved since: the second round
    asks of them again, and nothing is planned twice."""
    cfg = compose_cfg("task=causal_lm", "model=llama-tiny")
    plan_with, asked = fake_plans({})
    found = recipe.search(
        cfg,
        ["in_backward", "loss_chunks", "checkpointing"],
        {"in_backward": Planned(90.0, 0, logits=20.0)},
        plan_with,
        10.0,
        Planned(120.0, 0),
    )
    assert found == {"params": {"recipe": "none"}, "metrics": {"recipe_peak_mb": 90.0}}
    assert asked == [["in_backward", "loss_chunks"], ["in_backward", "checkpointing"]]


def test_what_the_pass_levers_cannot_lower_is_not_planned():
    """The optimizer step's peak, which no lever of the pass lowers, and a peak without logits, which the loss in
    pieces cannot lower: a combination whose floor is no lower than the peak reached is turned down unplanned."""
    cfg = compose_cfg("task=causal_lm", "model=llama-tiny")
    point = Planned(120.0, None, step=110.0, held=60.0)  # no logits at its peak
    singles = {"adafactor": Planned(70.0, 0, step=68.0, held=40.0)}
    plan_with, asked = fake_plans({("checkpointing",): 100.0, ("adafactor", "checkpointing"): 69.0})
    found = recipe.search(cfg, ["loss_chunks", "checkpointing", "adafactor"], singles, plan_with, 10.0, point)
    assert found == {"params": {"recipe": "none"}, "metrics": {"recipe_peak_mb": 69.0}}
    # the loss in pieces, twice: beside nothing (the point's 120, no logits) and beside the two chosen (69, none)
    assert asked == [["checkpointing"], ["checkpointing", "adafactor"]]
    assert recipe.floor(["checkpointing", "adafactor"], {(frozenset(["adafactor"]), False): 68.0}, {}) == 68.0
    # with the step inside backward what the device holds throughout: the weights and the state
    known = {}
    recipe.learn(["checkpointing", "adafactor"], Planned(69.0, 1, step=68.0, held=40.0), known)
    assert recipe.floor(["in_backward", "offload", "adafactor"], known, {}) == 40.0


BASE_8B = [
    "model=llama-3.1-8b",
    "task=causal_lm",
    "train.precision=bf16",
    "batch_size=1",
    "train.max_length=2048",
]


@pytest.mark.slow  # an 8B model's plan, its levers and its recipe, then the recipe planned: about 15 s
def test_an_8b_adamw_point_on_one_h100_gets_a_recipe_that_keeps_adamw_and_fits():
    point = [*BASE_8B, "device_memory=h100-80gb"]
    first = plan_job.plan_result(compose_cfg("plan=true", *point))
    assert not first["metrics"]["fits"]
    overrides = first["params"]["recipe"].split()
    assert overrides and not any(o.startswith("optim=") for o in overrides)  # AdamW kept
    again = plan_job.plan_result(compose_cfg("plan=true", *point, *overrides))
    assert again["metrics"]["fits"] == 1.0
    assert again["metrics"]["predicted_peak_mb"] == pytest.approx(first["metrics"]["recipe_peak_mb"])


@pytest.mark.slow  # three plans of a 7B model, their levers and recipes: about 30 s
def test_a_7b_config_json_on_a_4090_says_full_fine_tuning_fits_no_combination_and_names_lora_s_recipe(
    tmp_path,
):
    file = write_json(tmp_path / "qwen2.5-7b" / "config.json", QWEN_7B)
    table = pipeline.plan(
        [
            "task=causal_lm",
            f"model.config={file}",
            "peft=none,lora,qlora",
            "train.precision=bf16",
            "batch_size=4",
        ]
        + ["train.max_length=512", "device_memory=rtx-4090"]
    )
    rows = table.set_index("method")
    assert (
        rows.loc["full", "recipe"] == "none"
        and rows.loc["full", "recipe_peak_mb"] > rows.loc["full", "budget [MB]"]
    )
    # batches of 2, two a step: the batch of 4 kept, no recomputation
    recipe_ = "batch_size=2 train.gradient_accumulation_steps=2"
    assert rows.loc["lora r=16", "recipe"] == recipe_
    assert rows.loc["qlora r=16 nf4", "fits"] == "yes"
    (line,) = table.attrs["verdict"]
    assert "To fit adamw: no combination of the levers fits (the smallest peak found, " in line
    assert f"To fit adamw lora r=16: {recipe_} (keeps the math: accumulate; " in line
    again = pipeline.plan([f"model.config={file}", "task=causal_lm", "peft=lora", "train.precision=bf16",
                           "train.max_length=512", "device_memory=rtx-4090", *recipe_.split()])  # fmt: skip
    assert again["fits"].tolist() == ["yes"]
    assert again["predicted peak [MB]"].iloc[0] == pytest.approx(rows.loc["lora r=16", "recipe_peak_mb"])
    assert len(line) <= 300 * len(table)  # at most about 300 characters a point
