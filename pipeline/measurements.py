"""The measure stage: a finished job's figures, assembled into the record the runner logs to MLflow (metrics,
series, params, tags): the optimizer state against its estimate, the peak and its prediction, throughput and MFU
on the steady steps, the eval figures, and the per-rank figures of a multi-process job; for a batch search, the
largest batch that fits beside the plan's."""

from __future__ import annotations

import importlib.metadata
import math
import os

import torch
from omegaconf import OmegaConf

from pipeline import (
    HARDLY_LEARNED,
    LABELS_IGNORED,
    MB,
    StateSize,
    cache,
    cuda_reductions,
    optimizers,
)
from pipeline.adapters import ModelFlops
from pipeline.memory import peak_rss_mb


def library_versions() -> dict[str, str]:
    import accelerate
    import datasets
    import transformers

    return {m.__name__: m.__version__ for m in (torch, transformers, accelerate, datasets)}


def job_tags(spec, device: str) -> dict[str, str]:
    """What ran the job: library versions, the GPUs the runner's pool gave it, how the optimizer step ran."""
    tags = {f"version.{k}": v for k, v in library_versions().items()}
    if torch.cuda.is_available():
        tags["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES", "all")
    if spec.compiles_step and not spec.compiled_on(torch.device(device).type):
        tags["optim_compiled"] = "false: eager on CPU, where the tensor-level peak tracker is active"
    return tags


def state_estimate(cfg, choice, model, optimizer) -> StateSize | None:
    """The analytic state size of what this rank holds: every trainable parameter's, or under ZeRO-1 those of
    the parameters it owns, under FSDP its shards."""
    infos = optimizers.param_infos(model)
    if cfg.train.sharding == "zero1":
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        trainable = [p for p in model.parameters() if p.requires_grad]
        infos = [i for i, p in zip(infos, trainable, strict=True) if id(p) in owned]
    return choice.spec.estimate(infos, cfg, choice.variant, model.config)


def flops_per_token(flops: ModelFlops, positions: float) -> float:
    """4 N + 2 N_trained + 12 L H Q T (model_flops) at T = `positions`, the mean padded sequence length: 6 N +
    12 L H Q T in full fine-tuning."""
    return 4 * flops.non_embedding + 2 * flops.trained + 12 * flops.attention * positions


def throughput(cfg, steady: dict, runtime_s: float, ranks: list[dict], flops: ModelFlops, peak) -> tuple:
    """(metrics, tags) of speed: samples/s, tokens/s and MFU over the steady steps (`steady`: StepTimer.figures'
    window after the warm-up, and the warm-up's seconds), or the whole loop's figures when too few steps ran for a
    steady window. `ranks`: each rank's tokens (`tokens`, `padded_tokens`, and in the window `window_tokens`,
    `window_padded_tokens`); `flops`: pipeline.adapters.model_flops'; `peak`: the device's peak FLOP/s and its source
    (timing.peak_flops)."""
    world, warmup, window = len(ranks), steady["warmup"], steady["window"]
    metrics = {"train_runtime_s": runtime_s}
    if window is not None:
        first, last, seconds = window
        steps, tokens = last - first + 1, sum(r["window_tokens"] for r in ranks)
        padded = sum(r.get("window_padded_tokens", 0) for r in ranks)
        metrics["train_warmup_s"] = steady["warmup_s"]
        basis = f"steps {first}-{last} (after {warmup} warm-up steps)"
    else:
        steps, tokens, seconds = cfg.train.max_steps, sum(r["tokens"] for r in ranks), runtime_s
        padded = sum(r.get("padded_tokens", 0) for r in ranks)
        basis = f"steps 1-{steps} (the whole loop: fewer than {warmup + 2} steps, no steady window)"
    samples = (
        steps * cfg.batch_size * cfg.train.gradient_accumulation_steps * world
    )  # (an epoch's end: fewer)
    metrics["train_samples_per_second"] = samples / seconds
    metrics["train_tokens_per_second"] = tokens / seconds
    # T: the positions attention runs over, the batches' padded length
    metrics["train_flops_per_token"] = flops_per_token(flops, padded / samples)
    peak_flops_s, peak_source = peak
    if peak_flops_s:
        peak_flops_s *= world
        mfu = metrics["train_flops_per_token"] * tokens / seconds / peak_flops_s
        metrics.update(mfu=mfu, device_peak_tflops=peak_flops_s / 1e12)
    return metrics, {"mfu_peak": peak_source, "throughput_steps": basis}


def prediction(cfg, spec, built, splits, trained) -> dict:
    """What the plan predicts (pipeline.plan_step: the same step simulated on fake tensors; pipeline.plan_ranks: what
    each rank of several holds) beside what was measured. A training run's: the peak for each rank's largest
    batch; on CUDA a paged optimizer's paged state is left out of both; not for an optimizer
    that updates inside the backward pass (the plan steps once over all gradients). With adapters (peft=lora /
    qlora) the plan simulates the same adapters on the same (4-bit) base. A batch search's: the largest batch
    whose worst case (every text train.max_length tokens) fits the memory budget."""
    model, names = built.model, trained.collate.input_names
    cuda = next(model.parameters()).device.type == "cuda"
    if trained.output is None:  # a batch search's worst case, on the device it searched
        if cfg.memory_budget_mb is None:
            return {}
        ranks, shapes, budget = [], [(1, cfg.train.max_length)], cfg.memory_budget_mb
    else:
        ranks, budget = trained.ranks.records, None
        if any(len(r["largest_batch"]) != 2 for r in ranks):
            return {}
        if spec.in_backward and not cfg.train.get("optimizer_in_backward"):  # (LOMO's, the layer-wise ones)
            return {"prediction_method": "none: the optimizer updates inside the backward pass"}
        # each rank's largest batch, and where that came before the optimizer made its state (dynamic padding),
        # the largest one it measured with the state in place
        shapes = [tuple(r["largest_batch"]) for r in ranks]
        shapes += [tuple(r.get("largest_with_state", ())) for r in ranks if r.get("largest_before_state")]
    found = {
        shape: simulated_step(cfg, spec, model.config, shape, cuda, names, max(1, len(ranks)), budget)
        for shape in shapes
        if len(shape) == 2
    }
    if not ranks:
        return {"predicted_max_batch_size": min(found[shapes[0]]["largest_batch"], len(splits.train))}
    out = {}
    for rank, record in enumerate(ranks):
        figures = found[tuple(record["largest_batch"])]

        def mine(figures: dict, key: str = "rank_peaks", rank: int = rank) -> float:
            return figures[key][min(rank, len(figures[key]) - 1)]  # ZeRO-1's ranks differ, the others' alike

        peak = mine(figures)
        if record.get("largest_before_state"):
            # the largest batch came first, before the optimizer made its state: the peak is that step's (its
            # pass without the state, or its optimizer step making it) or that of the largest batch measured
            # with the state in place, whichever is higher
            peak = mine(figures, "rank_peaks_before_state")
            with_state = found.get(tuple(record.get("largest_with_state", ())))
            if with_state is not None and mine(with_state) > peak:
                figures, peak = with_state, mine(with_state)
        error = 100 * (peak / record["peak_memory_mb"] - 1)
        if rank == 0:
            out |= {
                "predicted_peak_mb": peak,
                "predicted_activations_mb": figures["activations"],
                # a language model's logits at the predicted peak (pipeline.memory.is_logits)
                **({} if figures.get("logits") is None else {"predicted_logits_mb": figures["logits"]}),
                **({} if figures.get("host") is None else {"predicted_host_mb": figures["host"]}),
                "predicted_peak_error_pct": error,
                "prediction_method": figures["method"],  # a tag
            }
        if len(ranks) > 1:
            out |= {f"predicted_peak_mb_rank{rank}": peak, f"predicted_peak_error_pct_rank{rank}": error}
    return out


# what the simulated step does not depend on: the seed, the data (their shapes are the batch's; the number of
# classes is the model config's), how many steps follow it, evaluation, and where and how the job runs
NOT_IN_PLAN = ("seed", "data", "eval", "tracking", "outputs_dir", "force", "log_level", "launcher", "hydra")
NOT_IN_PLAN += ("memory_track_steps", "memory_budget_mb", "find_batch_size", "plan", "device_memory")
NOT_IN_PLAN += ("custom_optim",)  # what it selects is in `optim`
NOT_IN_PLAN_TRAIN = ("max_steps",)
# the code the simulated step runs (the model on fake tensors, the trackers, the optimizers' steps and layouts):
# an edit elsewhere (the report, the runner) leaves the kept steps valid
PLAN_SOURCES = (
    "__init__.py",
    "plan_step.py",
    "cuda_kernels.py",
    "cuda_reductions.py",
    "plan_ranks.py",
    "memory.py",
    "state.py",
    "models.py",
    "offload.py",
    "muon.py",
    "backends/__init__.py",
)
PLAN_SOURCES += ("optimizers",)
# and with adapters (peft=lora / qlora), the code that makes them (on fake tensors too), and its libraries
PEFT_SOURCES = ("adapters.py",)
PEFT_LIBRARIES = ("peft", "bitsandbytes")


def simulated_step(
    cfg, spec, model_config, batch: tuple, cuda: bool, names, world: int = 1, budget=None
) -> dict:
    """The plan's peak, activations and method for this step (pipeline.plan_step.simulate), and each rank's peak
    (`rank_peaks`, pipeline.plan_ranks: one entry, or one per rank under ZeRO-1) for `world` ranks, simulated
    once per sweep point and batch shape and kept under <outputs_dir>/cache/plan (pipeline.cache); its two
    costly parts are kept there too, each under what it depends on: the forward/backward pass by model and
    sequence length (any batch size, seed or optimizer), the optimizer step by model and optimizer settings."""
    point = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k not in NOT_IN_PLAN}
    point["train"] = {k: v for k, v in point["train"].items() if k not in NOT_IN_PLAN_TRAIN}
    versions, sources = library_versions(), PLAN_SOURCES
    if point["peft"]["name"] == "none":  # full fine-tuning's steps as kept before the peft group existed
        point.pop("peft")
    else:
        versions |= {name: importlib.metadata.version(name) for name in PEFT_LIBRARIES}
        sources += PEFT_SOURCES
    # the grid of the GPU this job runs on sizes its reductions' buffers: steps of two GPUs are kept apart
    grid = cuda_reductions.device_grid() if cuda else None
    inputs = [point, spec.name, model_config.to_dict(), list(batch), cuda, grid, list(names), world]
    inputs += [] if budget is None else [budget]
    inputs.append(optimizers.source_stamp(cfg))  # a class of one's own (optim.target): its file as it is now
    store = cache.Store(cache.folder(cfg.outputs_dir, "plan"), versions, sources=sources)

    def figures() -> dict:
        from pipeline import plan_ranks, plan_step

        found = plan_step.simulate(
            model_config, spec, cfg, *batch, cuda=cuda, names=names, store=store, grid=grid
        )
        # the largest batch whose peak fits `budget` MB (the paged state counted against it, as the probes do)
        largest = (
            {}
            if budget is None
            else {"largest_batch": plan_step.largest_batch(found, budget - found["paged"])}
        )
        layout = plan_ranks.Layout(found["model"], spec, cfg, cuda=cuda)
        extra = found["workspaces"]
        ranks = plan_ranks.per_rank(found, layout, cfg.train.sharding, world, batch[0], extra)
        return {
            "peak": found["peak"],
            "rank_peaks": [r["peak"] for r in ranks],
            "rank_peaks_before_state": [r["before_state"] for r in ranks],
            "activations": found["parts"]["activations"],
            "logits": found["parts"].get("logits"),  # a language model's only
            "host": found["host"],  # train.offload=activations
            "method": found["method"],
            **largest,
        }

    return store.get(["step", *inputs], figures)


def measure(cfg, choice, built, splits, trained) -> dict:
    """The measure stage: the record of what the train stage did (pipeline.backends.Trained) on the model stage's
    model (pipeline.models.Built), a training run's (training_result) or a batch search's (search_result), then
    the plan's prediction beside what was measured (prediction) and the process's peak RSS, read last (the
    plan's simulation in it)."""
    if trained.output is None:
        record = search_result(cfg, choice, built, splits, trained)
    else:
        record = training_result(cfg, choice, built, splits, trained)
    try:
        predicted = prediction(cfg, choice.spec, built, splits, trained)
    except optimizers.MetaStepFailed:  # optim=custom whose step cannot run on fake tensors: no plan of it
        predicted = {}
    if "prediction_method" in predicted:  # a tag, not a metric
        record["tags"]["prediction_method"] = predicted.pop("prediction_method")
    record["metrics"] |= {**predicted, "peak_rss_mb": peak_rss_mb()}
    # train.offload: what the host held (the saved activations, or the optimizer's state and copies)
    held = getattr(built.model, "host_offload", None) or getattr(
        getattr(trained.output, "optimizer", None), "held", None
    )
    if held is not None:
        record["metrics"]["peak_host_mb"] = held.peak / MB
    return record


def search_result(cfg, choice, built, splits, trained) -> dict:
    """The record of a find_batch_size job: the largest batch that fits the memory budget (measured by the
    probes, pipeline.batch_size), beside the largest one the plan predicts for the same worst case (every text
    train.max_length tokens); `choice`: the registry's answer for the job (`pipeline.optimizers.choose`)."""
    spec, best, fitting = choice.spec, trained.largest, trained.probes
    model = built.model
    metrics = {"max_batch_size": best, "model_num_params": built.num_params}
    if best:
        at_best = fitting[best]
        state = at_best.pop("state")
        estimate = spec.estimate(optimizers.param_infos(model), cfg, choice.variant, model.config)
        metrics.update({f"max_batch_{k}": v for k, v in at_best.items()})
        metrics.update(
            optimizer_state_mb=state.mb,
            optimizer_state_numel=state.numel,
            estimated_optimizer_state_mb=estimate.mb,
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return {
        "metrics": metrics,
        "series": {"probe_peak_mb": {n: f["peak_memory_mb"] for n, f in sorted(fitting.items())}},
        "params": {
            "device": device,
            "num_labels": splits.num_labels,
            "label_names": splits.labels_param,
            "train_samples": len(splits.train),
            "probe_padding": "max_length",
        },
        "tags": {**job_tags(spec, device), "mode": "find_batch_size"},
    }


def rank_tokens(records: list[dict], window: tuple | None) -> list[dict]:
    """Each rank's tokens from its batches' (real, padded) counts: in all (`tokens`, `padded_tokens`) and in the
    steady `window` of steps (`window_tokens`, `window_padded_tokens`; none without a window)."""
    counted = []
    for record in records:
        steady = record["batches"][window[0] - 1 : window[1]] if window else []
        counted.append(
            {
                "tokens": sum(real for real, _ in record["batches"]),
                "padded_tokens": sum(padded for _, padded in record["batches"]),
                "window_tokens": sum(real for real, _ in steady),
                "window_padded_tokens": sum(padded for _, padded in steady),
            }
        )
    return counted


def segment_figures(out, tags: dict) -> dict:
    """A run resumed from a checkpoint trained in segments: how many, its peak the largest of theirs (tag
    `segments` lists each one's steps, peak and time; the throughput, the breakdown and the plan's comparison
    are the last segment's); what its checkpoints cost (count, seconds in all, MB of the last one)."""
    metrics = {}
    if len(out.segments) > 1:
        metrics["segments"] = len(out.segments)
        metrics["peak_memory_mb"] = max(s["peak_memory_mb"] for s in out.segments)
        tags["segments"] = "; ".join(
            f"steps {s['first_step']}-{s['last_step']}: peak {s['peak_memory_mb']:.1f} MB, {s['train_runtime_s']:.1f} s"
            for s in out.segments
        )
    if out.checkpoints:
        c = out.checkpoints
        metrics |= {"checkpoints": c["count"], "checkpoint_s": c["seconds"], "checkpoint_mb": c["mb"]}
    return metrics


def training_result(cfg, choice, built, splits, trained) -> dict:
    """The record of a training job (rank 0's is the one the runner logs): what the train stage measured
    (pipeline.backends.Trained) beside the plan's prediction; `choice`: the registry's answer for the job
    (`pipeline.optimizers.choose`); `built`: the model stage's (pipeline.models.Built)."""
    spec, model, out, ranks, steady = choice.spec, built.model, trained.output, trained.ranks, trained.steady
    state, paged = trained.state, trained.paged
    tags = job_tags(spec, out.device)
    try:
        estimate, estimate_na = state_estimate(cfg, choice, model, out.optimizer), None
    except optimizers.MetaStepFailed as err:  # optim=custom whose step cannot run on meta tensors
        estimate, estimate_na = None, f"n/a: {err}"
    # the whole model's size, as the model stage counted it before training (FSDP leaves the model sharded)
    num_params, flops = built.num_params, built.flops
    memory, breakdown = out.peak.metrics(), out.peak.breakdown_tag
    num_labels, labels_param = splits.num_labels, splits.labels_param
    settings = optimizers.built_settings(out.optimizer)
    counted = rank_tokens(ranks.records, steady["window"])
    # (the loop's time less the validation passes inside it: eval.every_steps)
    runtime = out.train_runtime_s - steady["paused_s"]
    speed, speed_tags = throughput(cfg, steady, runtime, counted, flops, trained.peak_flops)
    on_cuda = out.device.startswith("cuda")
    if built.metrics and "peak_params_mb" in memory:  # the weights at the peak less the trainable ones
        memory["peak_frozen_params_mb"] = memory["peak_params_mb"] - built.metrics["trainable_weights_mb"]
    tokens = sum(r["tokens"] for r in counted)
    metrics = {
        "model_num_params": num_params,
        "model_num_nonembedding_params": flops[0],
        "optimizer_state_numel": state.numel,
        "optimizer_state_bytes": state.bytes,
        "optimizer_state_mb": state.mb,
        "optimizer_state_bytes_per_param": state.bytes / num_params,
        **({} if estimate is None else {"estimated_optimizer_state_mb": estimate.mb}),
        **({"paged_state_mb": paged.mb} if spec.name.startswith("paged") else {}),
        **({} if steady["step_ms"] is None else {"optimizer_step_ms": steady["step_ms"]}),
        "optimizer_steps_skipped": steady["steps_skipped"],
        **({} if steady["train_step_ms"] is None else {"train_step_ms": steady["train_step_ms"]}),
        **memory,
        **built.metrics,
        "train_loss_final": out.losses[-1],
        **speed,
        **({"eval_runtime_s": out.eval_runtime_s} if out.eval_metrics or out.val_metrics else {}),
        "train_tokens": tokens,
        "padding_fraction": 1 - tokens / sum(r["padded_tokens"] for r in counted),
        **{f"eval_{k}": v for k, v in out.eval_metrics.items()},
        **{f"val_{k}": v for k, v in out.val_metrics.items()},
        **ranks.metrics,
    }
    tags |= {**speed_tags, "peak_breakdown": breakdown}
    metrics |= segment_figures(out, tags)
    shares = [m["top_class_share"] for m in (out.eval_metrics, out.val_metrics) if "top_class_share" in m]
    if shares:  # (nearly) every prediction in one class: binary F1 flatters such a model
        tags["collapsed"] = str(max(shares) >= cfg.eval.get("collapse_share", 0.95)).lower()
    if splits.task == "causal_lm":
        tags["labels"] = LABELS_IGNORED
        # how far the loss is from a uniform guess over the vocabulary (ln V nats): a model near it hardly learned
        loss = metrics.get("eval_loss", metrics["train_loss_final"])
        metrics["loss_vs_uniform"] = loss / math.log(built.vocab)
        tags["hardly_learned"] = str(metrics["loss_vs_uniform"] >= HARDLY_LEARNED).lower()
    if spec.name == "custom":  # how its estimate was found (there is no analytic model of it)
        tags["state_estimate"] = estimate_na or "meta-device step (pipeline.optimizers.meta_estimate)"
    if cfg.backend.name == "trainer":  # the Trainer's own optim= path, or the registry's object
        tags["trainer_optim"] = choice.trainer_optim or "none: handed the registry's optimizer object"
    if spec.name.startswith("paged") and not on_cuda:
        tags["optim_paged"] = "false: bitsandbytes falls back to non-paged state off CUDA"
    return {
        "metrics": metrics,
        # validation over steps: the periodic passes, then the final one at the last step
        "series": {
            "train_loss": out.losses,
            **{
                f"val_{k}": {**steps, cfg.train.max_steps: out.val_metrics[k]}
                for k, steps in out.val_series.items()
                if k in out.val_metrics
            },
        },
        "params": {
            "device": out.device,
            # id2label: eval_f1 is the F1 of class 1 (of two); a language model has no classes
            **(
                {"num_labels": num_labels, "label_names": labels_param}
                if splits.task == "classification"
                else {}
            ),
            "train_samples": len(splits.train),
            "eval_samples": len(splits.eval),
            "val_samples": 0 if splits.val is None else len(splits.val),
            "optim_variant": choice.variant or "plain",
            "optim_settings": settings,
            "largest_batch": "x".join(map(str, out.peak.largest_batch)),
            **built.params,  # what trained: trainable_dtype, a frozen base's base_dtype, the adapters' targets
        },
        "tags": tags,
    }
