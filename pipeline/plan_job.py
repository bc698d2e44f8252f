"""A plan job's record (`plan=true`): the step simulated on fake tensors (pipeline.plan_step), as one process or as
each rank of `launcher.nproc_per_job` processes under `train.sharding` (pipeline.plan_ranks), whether it fits
a budget and the headroom it leaves, the largest batch that does, the smallest number of ranks that fits, and
the field's anchors."""

from __future__ import annotations

import logging
import time

import torch

from pipeline import MB, cuda_reductions, plan_ranks, plan_step

log = logging.getLogger(__name__)


def budget_mb(cfg) -> float | None:
    """The memory a plan is checked against: memory_budget_mb, else what the named GPU leaves."""
    if cfg.memory_budget_mb is not None:
        return float(cfg.memory_budget_mb)
    return plan_step.usable_mb(cfg.device_memory) if cfg.device_memory else None


def headroom(peak: float, budget: float) -> dict[str, float]:
    """What the budget leaves beside the predicted peak: in MB and in % of the budget (negative: short by)."""
    return {
        "predicted_headroom_mb": budget - peak,
        "predicted_headroom_pct": 100 * (budget - peak) / budget,
    }


def logits_metrics(prediction: dict, batch: int) -> dict[str, float]:
    """A language model's logits at their largest in the forward/backward pass of one process, and what memory
    holds at that moment (the pass's parts and what the device holds beside the pass: the state, a CUDA target's
    workspaces): where the peak falls elsewhere (the optimizer step, the end of backward) it holds none of them.
    A classifier's: none."""
    if prediction["vocab"] is None:
        return {}
    rows = prediction["profile"].values(batch)
    at = rows[rows[:, plan_step.PART_KEYS.index("logits")].argmax()]
    return {
        "predicted_logits_largest_mb": float(at[plan_step.PART_KEYS.index("logits")]),
        "predicted_logits_largest_total_mb": float(at.sum() + prediction["beside_pass"]),
    }


def rank_metrics(prediction: dict, layout, cfg, budget: float | None) -> dict[str, float]:
    """The per-rank figures of a plan for `launcher.nproc_per_job` ranks under `train.sharding`: the largest
    rank's parts and peak (what must fit), each rank's peak (ZeRO-1's differ; up to 8 named), the largest
    batch per rank, the smallest number of ranks that fits the batch and the largest batch there."""
    sharding, world, batch = cfg.train.sharding, cfg.launcher.nproc_per_job, cfg.batch_size
    extra = prediction["workspaces"]  # a CUDA target's cuBLAS workspaces
    ranks = plan_ranks.per_rank(prediction, layout, sharding, world, batch, extra)
    top = max(ranks, key=lambda r: r["peak"])
    metrics = {
        "predicted_peak_mb": top["peak"],
        **{f"predicted_peak_{k}_mb": v for k, v in top["parts"].items()},
        "predicted_step_peak_mb": top["step_peak"],
        "predicted_rank_state_mb": top["state"],
        "deepspeed_zero_mb": plan_ranks.deepspeed_zero_mb(layout, sharding, world),
    }
    if len(ranks) > 1 and world <= 8:
        metrics |= {f"predicted_peak_mb_rank{r}": x["peak"] for r, x in enumerate(ranks)}
    if budget is not None:
        metrics["fits"] = float(top["peak"] <= budget)
        metrics["predicted_max_batch_size"] = plan_ranks.largest_batch(
            prediction, layout, sharding, world, budget, extra
        )
        n = plan_ranks.smallest_world(prediction, layout, sharding, batch, budget, extra)
        if n is not None:
            metrics["predicted_min_ranks"] = n
            metrics["predicted_max_batch_at_min_ranks"] = plan_ranks.largest_batch(
                prediction, layout, sharding, n, budget, extra
            )
    return metrics


def held_mb(prediction: dict, cfg) -> float:
    """What one process's device holds through the whole step: its weights, and the optimizer's state unless
    the host holds it (train.offload=optimizer)."""
    weights = sum(p.numel() * p.element_size() for p in prediction["model"].parameters()) / MB
    return weights + (0.0 if cfg.train.get("offload") == "optimizer" else prediction["state"])


def lever_metrics(cfg, names, cuda, grid, budget, prediction, layout, point) -> tuple[dict, dict]:
    """(metrics, params): what each lever that applies to a point that does not fit (`point`: its
    recipe.Planned) makes of it (pipeline.levers): its peak, and where it fits the batch asked the largest
    batch, the point planned again with it; a sharding's smallest number of ranks that fits and the largest
    batch per rank there, from the point's own plan; then the recipe, the cheapest combination of them that
    fits (pipeline.recipe), and the seconds the search took (`plan_recipe_s`). A lever that cannot be planned
    is left out, said in one line."""
    from pipeline import levers, optimizers, recipe

    extra = prediction["workspaces"]

    def planned(overrides: dict, largest: bool = True) -> recipe.Planned:
        changed = levers.with_lever(cfg, overrides)
        spec = optimizers.spec_for(changed.optim)
        config = planned_config(changed)  # a chunked loss, offloaded activations: the model's own settings
        again = plan_step.simulate(
            config, spec, changed, changed.batch_size, changed.train.max_length, cuda, names, grid=grid
        )
        if cfg.launcher.nproc_per_job > 1 or cfg.train.sharding != "none":
            shards = plan_ranks.Layout(again["model"], spec, changed, cuda=cuda, nccl_mb=layout.nccl_mb)
            found = rank_metrics(again, shards, changed, budget)
            peak, step = found["predicted_peak_mb"], found["predicted_step_peak_mb"]
            logits = found.get("predicted_peak_logits_mb", 0.0)
            return recipe.Planned(peak, found["predicted_max_batch_size"], step, 0.0, logits)
        # the largest batch where the batch asked fits: it takes a pass at more batch sizes
        fits = largest and again["peak"] <= budget
        batch = plan_step.largest_batch(again, budget) if fits else None
        logits = again["parts"].get("logits", 0.0)
        return recipe.Planned(again["peak"], batch, again["step_peak"], held_mb(again, changed), logits)

    def together(chosen: list[str], largest: bool = False, batch: int | None = None) -> recipe.Planned:
        overrides = {k: v for name in chosen for k, v in applicable[name].items()}
        if batch:  # accumulation's batches of `batch` samples, as many as the point's samples a step
            steps = levers.effective_batch(cfg) // batch
            overrides |= {"batch_size": batch, "train.gradient_accumulation_steps": steps}
        try:
            return planned(overrides, largest)
        except Exception as err:  # noqa: BLE001 (a combination the simulation cannot run: not a recipe)
            log.warning(
                "plan: levers %s together left out: %s: %s", "+".join(chosen), type(err).__name__, err
            )
            return recipe.Planned(float("inf"), 0)

    metrics, singles = {}, {}
    # checkpointing shrinks the forward/backward pass only: where the peak falls in the optimizer step, it stays
    applicable = levers.applicable(cfg, prediction["peak"] > prediction["step_peak"])
    for name, overrides in applicable.items():
        try:
            singles[name] = planned(overrides)
        except Exception as err:  # noqa: BLE001 (a lever the simulation cannot run: the plan goes on)
            log.warning("plan: lever %s left out: %s: %s", name, type(err).__name__, err)
            continue
        metrics[f"lever_{name}_peak_mb"] = singles[name][0]
        if singles[name][1] is not None:  # (where it fits the batch asked)
            metrics[f"lever_{name}_max_batch_size"] = singles[name][1]
    shard = levers.sharding(cfg)
    ranks = shard and plan_ranks.smallest_world(prediction, layout, shard, cfg.batch_size, budget, extra)
    if ranks:
        metrics[f"lever_{shard}_ranks"] = ranks
        metrics[f"lever_{shard}_max_batch_size"] = plan_ranks.largest_batch(
            prediction, layout, shard, ranks, budget, extra
        )
    # the recipe weighs the pass's levers wherever the peak falls: the others can move it into the pass
    applicable |= levers.applicable(cfg, True)
    candidates = [n for n in applicable if n in singles or n in recipe.PASS]
    start = time.perf_counter()
    found = recipe.search(cfg, candidates, singles, together, budget, point)
    metrics["plan_recipe_s"] = time.perf_counter() - start  # (the search alone)
    return metrics | found["metrics"], found["params"]


def logits_line(metrics: dict) -> str | None:
    """A language model's plan: what its logits take of the predicted peak, in one line (None for a
    classifier's)."""
    if "predicted_peak_logits_mb" not in metrics:
        return None
    logits, peak = metrics["predicted_peak_logits_mb"], metrics["predicted_peak_mb"]
    largest, then = metrics["predicted_logits_largest_mb"], metrics["predicted_logits_largest_total_mb"]
    return (
        f"logits (the LM head's output, the loss's fp32 copy and log-softmax, their gradients): "
        f"{logits:,.0f} MB of the predicted peak's {peak:,.0f} MB ({100 * logits / peak:.1f}%); at their largest "
        f"{largest:,.0f} MB, of {then:,.0f} MB held then ({100 * largest / then:.1f}%, one process)"
    )


def planned_config(cfg):
    """The transformers config a plan builds the job's model from, as models.build would set it up: its
    architecture and attention kernel, a pad token (decoders classify from the last non-padding token and pad a
    batch with it), its loss in train.loss_chunks pieces, its saved activations on the host (train.offload)."""
    from pipeline import models

    config = models.model_config(cfg.model, num_labels=2, task=cfg.task.name)
    if config.pad_token_id is None:
        config.pad_token_id = 0
    if cfg.train.get("loss_chunks", 0):
        config.loss_chunks = cfg.train.loss_chunks
    if cfg.train.get("offload", "none") == "activations":
        config.offload_activations = True
    return config


def plan_result(cfg) -> dict:
    """The record of a plan job: the predicted parts and peak of a training step (per rank for several) at the
    configured batch size and `train.max_length`, whether it fits, and the largest batch that does."""
    from pipeline import adapters, models, optimizers, predict  # predict: the field's rules of thumb
    from pipeline.config import own_model
    from pipeline.recipe import Planned

    start = time.perf_counter()
    cfg = own_model(cfg)  # a model of one's own (model.config): the entry its config.json makes
    spec = optimizers.spec_for(cfg.optim)
    config = planned_config(cfg)
    cuda = cfg.device_memory is not None or torch.cuda.is_available()
    # the reductions' buffers: sized for the named GPU's grid, else this machine's GPU's
    grid = cuda_reductions.grid_for(cfg.device_memory) if cuda else None
    seq = cfg.train.max_length
    names = tuple(models.load_tokenizer(cfg.model, local_only=True).model_input_names)  # the batch's tensors
    prediction = plan_step.simulate(config, spec, cfg, cfg.batch_size, seq, cuda=cuda, names=names, grid=grid)
    model = prediction["model"]
    # as a job counts them (adapters.model_size): a 4-bit weight (peft=qlora) the weights it packs
    num_params = sum(adapters.weights(p) for p in model.parameters())
    metrics = {
        "model_num_params": num_params,
        # with adapters (peft=lora / qlora), what trains, as a job logs it
        **(
            {}
            if adapters.name(cfg) == "none"
            else {"model_trainable_params": adapters.trainable_params(model)}
        ),
        "estimated_optimizer_state_mb": prediction["estimate"],
        # a paged optimizer's state in CUDA unified memory: outside the allocator and the predicted peak
        **({"predicted_paged_state_mb": prediction["paged"]} if prediction["paged"] else {}),
        "predicted_peak_mb": prediction["peak"],
        **{f"predicted_peak_{k}_mb": v for k, v in prediction["parts"].items()},
        "predicted_step_peak_mb": prediction["step_peak"],
        # train.offload: what the host holds (the activations, or the optimizer's state and copies)
        **({} if prediction["host"] is None else {"predicted_host_mb": prediction["host"]}),
        **logits_metrics(prediction, cfg.batch_size),
        "accelerate_estimate_mb": predict.accelerate_estimate_mb(num_params, cfg.train.precision),
        "bytes_rule_mb": predict.bytes_rule_mb(num_params),
    }
    budget, recipe = budget_mb(cfg), {}
    if budget is not None:
        metrics["budget_mb"] = budget
        metrics["fits"] = float(prediction["peak"] <= budget)
        metrics["predicted_max_batch_size"] = plan_step.largest_batch(prediction, budget)
    if cfg.launcher.nproc_per_job > 1 or cfg.train.sharding != "none" or budget is not None:
        nccl = plan_ranks.NCCL_BUFFERS_MB if cuda else 0.0  # each rank's, when there are several
        layout = plan_ranks.Layout(model, spec, cfg, cuda=cuda, nccl_mb=nccl)
        metrics |= rank_metrics(prediction, layout, cfg, budget)
    if budget is not None:  # how close to the edge: what the budget leaves at the batch asked
        metrics |= headroom(metrics["predicted_peak_mb"], budget)
        if not metrics["fits"]:
            one = cfg.launcher.nproc_per_job == 1 and cfg.train.sharding == "none"
            point = Planned(  # (the largest rank's, of several)
                metrics["predicted_peak_mb"],
                None,
                metrics["predicted_step_peak_mb"],
                held_mb(prediction, cfg) if one else 0.0,
                metrics.get("predicted_peak_logits_mb", 0.0),
            )
            weighed = time.perf_counter()
            found, recipe = lever_metrics(cfg, names, cuda, grid, budget, prediction, layout, point)
            metrics |= found | {"plan_levers_s": time.perf_counter() - weighed}
    metrics["plan_s"] = time.perf_counter() - start
    return {
        "metrics": metrics,
        "series": {},
        "params": {
            "device": f"cuda: {cfg.device_memory or 'this machine'} (planned)" if cuda else "cpu (planned)",
            "device_memory": cfg.device_memory,
            **adapters.held_dtypes(model),  # what it planned: trainable_dtype, and a frozen base's base_dtype
            **recipe,  # where it does not fit: the cheapest combination of levers that does (pipeline.recipe)
        },
        "tags": {
            "mode": "plan",
            "plan_method": prediction["method"],
            "plan_sharding": plan_ranks.SOURCES[cfg.train.sharding]
            if cfg.launcher.nproc_per_job > 1
            else "one process",
        },
    }
