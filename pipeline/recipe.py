"""The recipe of a point that does not fit its budget: the cheapest combination of the levers (pipeline.levers)
that fits it on its own GPUs, searched in the order of what each lever changes: first those that keep the
training math (the step inside backward, the loss in pieces, smaller batches accumulated into the same step,
checkpointing, the activations on the host, the optimizer on the host: cheapest step first), then those that
approximate it (mixed bf16, bf16 weights without a master copy, a 16-bit frozen base, 8-bit AdamW state, a
4-bit frozen base), another optimizer last. Each lever joins the combination where it lowers the peak (in two
rounds: one that lowered nothing may, once the others have moved the peak); the first combination that fits,
less each lever it still fits without (the latest first), is the recipe (param `recipe`: the overrides as one
types them; `recipe_kinds`: each lever's kind; metrics `recipe_peak_mb`, `recipe_max_batch_size`). Where none
fits: `recipe` none and the smallest peak the search reached (`recipe_peak_mb`). More GPUs (sharding over
more ranks) are not in it: the plan's `lever_<sharding>_ranks` says how many would fit."""

from __future__ import annotations

import math
from typing import NamedTuple

from pipeline.levers import ACCUMULATE, LEVERS, effective_batch
from pipeline.levers import OPTIMIZER_LEVERS as OPTIMIZERS

KEEPS = "keeps the math"
APPROXIMATES = "approximates it"
OTHER = "another optimizer"
# the order the search tries them in: by kind, then by what a step costs (recomputation, slower kernels)
ORDER = (
    (KEEPS, ("in_backward", "loss_chunks", "accumulate", "checkpointing", "offload", "offload_optimizer")),
    (APPROXIMATES, ("bf16", "bf16_pure", "base16", "adamw_8bit", "qlora")),
    (OTHER, ("adafactor",)),
)
# the levers of the forward and backward pass
PASS = ("loss_chunks", "accumulate", "checkpointing", "offload")
# levers that replace one another: the optimizers; the step inside backward, which frees each gradient as it
# arrives, and accumulating, which holds them to the step, or the step on the host; the two things offloaded
# (one train.offload)
EXCLUSIVE = (
    set(OPTIMIZERS),
    {"in_backward", "accumulate"},
    {"in_backward", "offload_optimizer"},
    {"offload", "offload_optimizer"},
)


class Planned(NamedTuple):
    """A combination's plan: its peak and largest batch (None unless asked), and what no lever of the pass
    lowers (0: unknown): the optimizer step's peak (`step`), and the weights and state the device holds (`held`,
    through a step inside backward)."""

    peak: float
    batch: int | None
    step: float = 0.0
    held: float = 0.0
    logits: float = 0.0  # the logits' part of the peak (a language model's)


def floor(names, known: dict, seen: dict) -> float:
    """The least peak the combination `names` can have, from the plans of those that differ from it only in
    the pass's levers (`known`: filled by `learn`): their optimizer step's peak, or with the step inside
    backward their weights and state; and from the plan of the same levers without the loss in pieces (in
    `seen`), its peak less its logits (what the pieces shrink). 0 where none was planned."""
    inside, chunked = "in_backward" in names, "loss_chunks" in names
    unchunked = seen.get(frozenset(names) - {"loss_chunks"}) if chunked else None
    planned = unchunked is not None and math.isfinite(unchunked.peak)  # (not one the simulation failed)
    least = unchunked.peak - unchunked.logits if planned else 0.0
    return max(least, known.get((frozenset(names) - set(PASS) - {"in_backward"}, inside), 0.0))


def learn(names, found: Planned, known: dict) -> None:
    """What the plan `found` of `names` says of every combination that differs from it in the pass alone."""
    rest = frozenset(names) - set(PASS) - {"in_backward"}
    if "in_backward" not in names:
        known[rest, False] = max(known.get((rest, False), 0.0), found.step)
    known[rest, True] = max(known.get((rest, True), 0.0), found.held)


def kind_of(name: str, cfg) -> str:
    """A lever's kind for a point: 8-bit state approximates AdamW, and is another optimizer for any other."""
    if name == "adamw_8bit" and cfg.optim.name != "adamw":
        return OTHER
    return next(kind for kind, names in ORDER if name in names)


def search(cfg, candidates, singles: dict[str, Planned], plan_with, budget: float, point: Planned) -> dict:
    """The recipe's params and metrics among the levers `candidates` (names) that apply to the point, planned
    as `point`. `singles`: the Planned of those the plan weighed alone (its lever_<name>_* figures);
    `plan_with(names, largest)`: the Planned of the point with those levers together, the batch None unless
    `largest` (asked of the recipe alone: it takes a pass at more batch sizes); with `batch`, accumulation's
    batches of that size. Optimizer levers replace one another, and the step inside backward and accumulation
    do (EXCLUSIVE). Accumulation is planned at one sample a batch, then named with the largest batch that fits
    and divides the point's samples a step. A combination whose floor (`floor`) is no lower than the peak
    already reached is not planned: the pass's levers cannot lower what the step holds."""
    ordered = sorted(
        candidates, key=lambda name: ([k for k, _ in ORDER].index(kind_of(name, cfg)), _rank(name))
    )
    chosen: list[str] = []
    best = (point.peak, 0)
    # each combination planned once (the point: none)
    seen = {frozenset(): point} | {frozenset([name]): found for name, found in singles.items()}
    known: dict = {}
    for names, found in [([], point), *(([name], found) for name, found in singles.items())]:
        learn(names, found, known)

    def planned(names: list[str], refused: float) -> Planned:
        """The plan of `names`, or where its floor is `refused` or more (a peak the search turns down) the
        floor alone, unplanned."""
        key = frozenset(names)
        if key not in seen:  # (the second round asks again of a lever tried beside the same levers)
            least = floor(names, known, seen)
            if least >= refused:
                return Planned(least, None)  # (not kept: asked again, it may be rejected no longer)
            seen[key] = plan_with(names)
            learn(names, seen[key], known)
        return seen[key]

    # a second round: a lever that lowered nothing alone (the loss in pieces where the optimizer's step held the
    # peak) may lower the peak once the others have moved it
    for name in [*ordered, *ordered]:
        if name in chosen:
            continue
        trying = [n for n in chosen if not any({n, name} <= pair for pair in EXCLUSIVE)] + [name]
        peak, batch = planned(trying, best[0])[:2]
        if peak >= best[0]:
            continue  # it lowers nothing beside the levers already chosen
        chosen, best = trying, (peak, batch)
        if peak <= budget:
            for lever in reversed(chosen[:-1]):  # what it fits without
                fewer = [n for n in chosen if n != lever]
                again = planned(fewer, math.nextafter(budget, math.inf))  # (more than the budget)
                if again.peak <= budget:
                    chosen, (peak, batch) = fewer, again[:2]
            if batch is None:
                batch = plan_with(chosen, largest=True)[1]
            samples = effective_batch(cfg)
            micro = max(b for b in range(1, min(batch, samples) + 1) if samples % b == 0) if batch else 1
            if "accumulate" in chosen and micro > 1:  # the largest batch that fits, the same samples a step
                peak = plan_with(chosen, batch=micro)[0]
            commands = {"accumulate": ACCUMULATE.command.format(batch=micro, steps=samples // micro)}
            kinds = {}
            for lever in chosen:
                kinds.setdefault(kind_of(lever, cfg), []).append(lever)
            return {
                "params": {
                    "recipe": " ".join(commands.get(lever) or LEVERS[lever].command for lever in chosen),
                    "recipe_kinds": "; ".join(f"{kind}: {', '.join(names)}" for kind, names in kinds.items()),
                },
                "metrics": {"recipe_peak_mb": peak, "recipe_max_batch_size": batch},
            }
    smallest = {"recipe_peak_mb": best[0]} if chosen else {}  # none: no lever lowers its peak
    return {"params": {"recipe": "none"}, "metrics": smallest}


def _rank(name: str) -> int:
    return next(names.index(name) for _, names in ORDER if name in names)
