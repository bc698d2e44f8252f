"""A training step's peak memory on each rank of a job of N processes, from the one-process step that
pipeline.plan_step simulates on fake tensors: what each rank holds of the weights, gradients and optimizer state is
a count of shards, and what grows with the batch (activations, the pass's temporaries) is the simulated pass at
the rank's own batch (`batch_size` is per rank). No N processes are started; any N costs the same.

Shardings (`train.sharding`), and where each comes from in our stack:

- `none`: DDP (torch DistributedDataParallel, as accelerate's `prepare` wraps the model): a full replica on
  every rank, plus DDP's gradient buckets, one flat copy of every gradient, alive from the wrap on.
- `zero1`: torch's ZeroRedundancyOptimizer over DDP: the state of the parameters a rank owns (its greedy
  partition of whole tensors, largest first, to the rank with the fewest elements so far), the step's
  temporaries of those parameters; weights, gradients and buckets as DDP.
- `zero2`: planned only (training runs none, zero1 and fsdp; DeepSpeed is not installed): ZeRO stage 2 as the
  ZeRO paper defines it: weights replicated, gradients and state partitioned 1/N (flat partitions: each
  parameter's state as a 1-D slice of 1/N of its elements), one unit's gradients in flight in backward.
- `fsdp`: FSDP2 (torch's `fully_shard`, pipeline.distributed.fully_sharded): every weight, gradient and state
  1/N, each parameter cut by rows (its first dimension padded to a multiple of N: the optimizer steps a
  rows-shard; models.fsdp_refusal names the optimizers that cannot), plus the gathered units: the root
  (embeddings, head, final norm) from the forward to the end of the backward, one layer in the forward and two
  in the stack's backward (the one computing, the one prefetched). A unit's all-gather lands in one flat buffer that
  is copied out to its weights, so gathering holds the unit twice for a moment (the root's at the forward's
  start); a unit's unsharded gradients are copied into a flat buffer for their reduce-scatter (the root's at the
  backward's end, beside every other shard's gradients).

At N = 1 every sharding is the one-process step. On a CUDA target each rank of several also holds NCCL's own
buffers (NCCL_BUFFERS_MB, stated), counted with the rank's other memory. The anchors beside it (`deepspeed_zero_mb`) are the field's
model-state formulas for the same N (ZeRO paper; DeepSpeed's estimators): no activations, no temporaries.
"""

from __future__ import annotations

import heapq
import math
from typing import NamedTuple

import numpy as np

from pipeline import MB, adapters
from pipeline.fake_model import fake_mode, layer_stack
from pipeline.memory import KINDS

MAX_BATCH = 2**20  # the largest batch a plan reports

SOURCES = {
    "none": "DDP: torch DistributedDataParallel (accelerate)",
    "zero1": "torch ZeroRedundancyOptimizer over DDP",
    "zero2": "ZeRO stage 2 (planned only: DeepSpeed's, not installed here)",
    "fsdp": "FSDP2: torch fully_shard, a unit per layer, the root gathered through the pass",
}
# the numbers of ranks the smallest-N search tries: one 8-GPU node's 1..8, then whole nodes
MAX_RANKS = 4096
CANDIDATE_RANKS = (*range(1, 9), *range(16, MAX_RANKS + 1, 8))
PARTS = KINDS  # a language model's `logits` among them: a rank's own, as its activations
# NCCL's buffers on each GPU of a job over several ranks, allocated by NCCL itself (outside torch's caching
# allocator): stated, not measured here. NCCL_BUFFSIZE is 4 MiB per channel, per peer and per protocol (NCCL's
# default); with the channels and peers of a node's rings and trees a total of 0.5-1 GB per GPU is commonly
# observed. The plan takes 512 MiB per GPU, on a CUDA target with more than one rank.
NCCL_BUFFERS_MB = 512


def zero1_partition(group_sizes: list[list[int]], world: int) -> list[list[list[int]]]:
    """ZeroRedundancyOptimizer's partition (torch.distributed.optim, `_partition_parameters`): per parameter
    group, its parameters largest first, each to the rank with the fewest elements so far (counted over all
    groups; ties to the lowest rank). Returns, per rank and group, the indices of the parameters it owns."""
    heap = [(0, rank) for rank in range(world)]
    owned: list[list[list[int]]] = [[[] for _ in group_sizes] for _ in range(world)]
    for g, sizes in enumerate(group_sizes):
        for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):  # stable: equal sizes keep their order
            total, rank = heapq.heappop(heap)
            owned[rank][g].append(i)
            heapq.heappush(heap, (total + sizes[i], rank))
    return owned


class Layout:
    """What the count of shards needs of a (fake) model and its optimizer: bytes of weights, buffers and
    trainable gradients, the units FSDP gathers, the optimizer's parameter groups and state estimate, and what
    each rank of several holds for communication (`nccl_mb`: NCCL_BUFFERS_MB for a CUDA target's plan; 0 where
    the figures are compared with torch's allocator, which NCCL's buffers lie outside). `cuda`: a CUDA
    target's (torch's multi-tensor `foreach` step; a paged optimizer's paged state not held)."""

    def __init__(self, model, spec, cfg, cuda: bool, nccl_mb: float = 0.0):
        from pipeline import optimizers

        self.spec, self.cfg, self.cuda, self.nccl_mb = spec, cfg, cuda, nccl_mb
        self.config = model.config
        params = list(model.parameters())
        self.num_params = sum(adapters.weights(p) for p in params)  # a 4-bit weight's: the weights it packs
        self.weights = sum(p.numel() * p.element_size() for p in params)  # bytes
        self.buffers = sum(b.numel() * b.element_size() for b in model.buffers())
        trainable = [p for p in params if p.requires_grad]
        self.infos = optimizers.param_infos(model)  # the trainable parameters, in order
        self.sizes = [p.numel() * p.element_size() for p in trainable]
        self.grads = sum(self.sizes)
        self.variant = spec.variant(cfg.backend.name, cfg)
        index = {id(p): i for i, p in enumerate(trainable)}
        self.groups = [[index[id(p)] for p in group] for group in _param_groups(model, spec, cfg, trainable)]
        # the stack of layers: ZeRO-2's gradients in flight (the largest layer's and the root's), FSDP's units
        stack = layer_stack(model)
        layers = [] if stack is None else list(stack)

        def nbytes(module, grads: bool) -> int:
            return sum(
                p.numel() * p.element_size() for p in module.parameters() if p.requires_grad or not grads
            )

        self.layer_grads = max((nbytes(m, True) for m in layers), default=0)
        self.root_grads = self.grads - sum(nbytes(m, True) for m in layers)
        units = layers  # FSDP's too (pipeline.distributed.fully_sharded): a unit per layer
        in_units = {id(p) for unit in units for p in unit.parameters()}
        self._fsdp_root = _rows([p for p in params if id(p) not in in_units])
        # the root's weights whose gradients backward makes before the stack's: those after it (final norm,
        # head) and an output embedding tied to the input one
        last = max((i for i, p in enumerate(params) if id(p) in in_units), default=len(params))
        head = (
            getattr(model.get_output_embeddings(), "weight", None)
            if hasattr(model, "get_output_embeddings")
            else None
        )
        self._fsdp_head = _rows(
            [p for i, p in enumerate(params) if id(p) not in in_units and (i > last or p is head)]
        )
        self._fsdp_units = [_rows(list(unit.parameters())) for unit in units]
        self._fsdp: dict[int, FsdpSizes] = {}
        self.largest_module_params = max(
            sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()
        )
        self._state: dict[tuple, float] = {}
        self._owned: dict[int, list[list[int]]] = {}

    def fsdp(self, world: int) -> FsdpSizes:
        """What FSDP2 holds on each of `world` ranks, in bytes (FsdpSizes)."""
        if world not in self._fsdp:
            shard = lambda ps, grads: sum(-(-rows // world) * row for rows, row, t in ps if t or not grads)  # noqa: E731
            whole = lambda ps, grads: world * shard(ps, grads)  # noqa: E731
            every = [self._fsdp_root, *self._fsdp_units]
            self._fsdp[world] = FsdpSizes(
                sharded=sum(shard(ps, False) for ps in every),
                sharded_grads=sum(shard(ps, True) for ps in every),
                root=whole(self._fsdp_root, False),
                root_grads=whole(self._fsdp_root, True),
                head_grads=whole(self._fsdp_head, True),
                unit=max((whole(ps, False) for ps in self._fsdp_units), default=0),
                unit_grads=max((whole(ps, True) for ps in self._fsdp_units), default=0),
            )
        return self._fsdp[world]

    def state_mb(self, indices: list[int] | None = None, world: int = 1, rows: bool = False) -> float:
        """The state estimate (MB) of these parameters (all when None) that the device's allocator holds, each
        as 1/world of it when world > 1: a 1-D slice of its elements (ZeRO-2's flat partitions), or with `rows`
        its first dimension's share (FSDP2's shards)."""
        key = (None if indices is None else tuple(indices), world, rows)
        if key not in self._state:
            infos = self.infos if indices is None else [self.infos[i] for i in indices]
            if world > 1 and rows:
                infos = [
                    i._replace(shape=(-(-i.shape[0] // world), *i.shape[1:])) if i.shape else i for i in infos
                ]
            elif world > 1:
                infos = [i._replace(shape=(math.ceil(i.numel / world),)) for i in infos]
            whole, outside = self.spec.held_estimate(infos, self.cfg, self.variant, self.config, self.cuda)
            self._state[key] = (whole.bytes - outside.bytes) / MB
        return self._state[key]

    def zero1_owned(self, world: int) -> list[list[int]]:
        """Per rank, the indices (into the trainable parameters) whose state it holds under ZeRO-1."""
        if world not in self._owned:
            sizes = [[self.infos[i].numel for i in group] for group in self.groups]
            parts = zero1_partition(sizes, world)
            self._owned[world] = [
                sorted(self.groups[g][i] for g, idx in enumerate(rank) for i in idx) for rank in parts
            ]
        return self._owned[world]


class FsdpSizes(NamedTuple):
    """Bytes FSDP2 holds on a rank of N: every parameter's shard and the trainable ones' (`sharded`,
    `sharded_grads`: rows padded to a multiple of N), the root gathered and its trainable part (`root`,
    `root_grads`; `head_grads`: the part backward makes before the stack's), and the largest unit gathered and its
    trainable part (`unit`, `unit_grads`)."""

    sharded: int
    sharded_grads: int
    root: int
    root_grads: int
    head_grads: int
    unit: int
    unit_grads: int


def _rows(params) -> list[tuple[int, int, bool]]:
    """Each parameter as FSDP2 shards it: (rows, bytes a row, trainable)."""
    out = []
    for p in params:
        rows = p.shape[0] if p.dim() else 1
        out.append((rows, p.numel() * p.element_size() // max(rows, 1), p.requires_grad))
    return out


def _param_groups(model, spec, cfg, trainable) -> list[list]:
    """The optimizer's parameter groups as a job builds them (weight decay off for biases and norms ...); one
    group of every trainable parameter when the optimizer cannot be built on fake tensors."""
    try:
        with fake_mode():
            optimizer = spec.build(model, cfg)
        groups = [list(g["params"]) for g in optimizer.param_groups]
        if sorted(id(p) for g in groups for p in g) == sorted(id(p) for p in trainable):
            return groups
    except Exception:  # noqa: BLE001 (a kernel that needs real data: the groups are then the model's)
        pass
    return [trainable]


def deepspeed_zero_mb(layout: Layout, sharding: str, world: int) -> float:
    """The field's model-state formula (MB) for this sharding on `world` ranks, Adam with mixed precision,
    Ψ parameters (no activations, no temporaries):

    - none: (2 + 2 + 12) Ψ (ZeRO paper, Rajbhandari et al. 2020, baseline with K = 12);
    - zero1: 2Ψ + 2Ψ + 12Ψ/N (ZeRO paper, P_os);
    - zero2: 4Ψ + 16Ψ/N (DeepSpeed `estimate_zero2_model_states_mem_needs`, cpu_offload=False);
    - fsdp: 4 L + 18Ψ/N, L the largest module's own parameters (DeepSpeed
      `estimate_zero3_model_states_mem_needs`, cpu_offload=False, as `..._all_live` finds L)."""
    psi, n = layout.num_params, world
    figure = {
        "none": 16 * psi,
        "zero1": 4 * psi + 12 * psi / n,
        "zero2": 4 * psi + 16 * psi / n,
        "fsdp": 4 * layout.largest_module_params + 18 * psi / n,
    }[sharding]
    return figure / MB


def _fb_rows(values: np.ndarray, layout: Layout, sharding: str, world: int) -> np.ndarray:
    """The pass's parts (MB) after every allocation, as one rank of `world` holds them (state not included)."""
    rows = values.copy()
    if world == 1:
        return rows
    g = PARTS.index("grads")
    if sharding in ("none", "zero1"):  # DDP's buckets: one flat copy of every gradient
        rows[:, g] += layout.grads / MB
    elif sharding == "zero2":  # the rank's 1/N of the gradients, and one unit's unsharded gradients in flight
        in_flight = (layout.root_grads + layout.layer_grads) / MB
        rows[:, g] = layout.grads / world / MB + np.minimum(rows[:, g], in_flight)
    else:
        rows = _fsdp_rows(rows, layout, world)
    return rows


def _fsdp_rows(rows: np.ndarray, layout: Layout, world: int) -> np.ndarray:
    """FSDP2's rank of `world`, from the one-process pass's rows (MB): the shards and the root gathered; one
    layer in the forward, two through the stack's backward, none after it. Gradients made: the root's unsharded
    (held to the backward's end: the head's from the start, the embeddings' after the stack) and, in the stack,
    one layer's and its copy for its reduce-scatter; the layers' others as shards. Two rows more, with nothing of
    the pass alive: the root's gathering at the forward's start, and its reduce-scatter at the backward's end
    (its gradients, their copy, beside every shard's gradients)."""
    f, p, g = layout.fsdp(world), PARTS.index("params"), PARTS.index("grads")
    made, layers = rows[:, g] * MB, layout.grads - f.root_grads  # (bytes)
    stack = (made > 0) & (made < f.head_grads + layers)  # the layers' backward, before it ends
    units = np.where(made == 0, 1, np.where(stack, 2, 0))
    rows[:, p] += (f.sharded + f.root + units * f.unit - layout.weights) / MB
    unsharded = np.where(stack, np.minimum(made, f.head_grads + f.unit_grads), np.maximum(made - layers, 0))
    rows[:, g] = (unsharded + (made - unsharded) / world + np.where(stack, f.unit_grads, 0)) / MB
    start, end = np.zeros((2, rows.shape[1]))
    start[p], end[p] = (f.sharded + 2 * f.root + layout.buffers) / MB, (f.sharded + layout.buffers) / MB
    end[g] = (f.sharded_grads + 2 * f.root_grads) / MB
    return np.vstack([rows, start, end])


def _step_parts(step: dict, layout: Layout, sharding: str, world: int, owned: list[int] | None) -> dict:
    """The optimizer step's parts (MB) on one rank; `owned`: the ZeRO-1 rank's parameters."""
    if world == 1:
        return dict(step)
    grads = layout.grads / MB
    if sharding in ("none", "zero1"):
        out = {**step, "grads": step["grads"] + grads}  # DDP's buckets
        if sharding == "zero1":
            sizes = [layout.sizes[i] for i in owned]
            share = sum(sizes) / layout.grads if layout.cuda else max(sizes, default=0) / max(layout.sizes)
            out["optimizer"] = layout.state_mb(owned)
            out["other"] = step["other"] * share
        return out
    out = {
        **step,
        "grads": grads / world,
        "optimizer": layout.state_mb(world=world),
        "other": step["other"] / world,
    }
    if sharding == "fsdp":
        f = layout.fsdp(world)
        out["params"] = step["params"] + (f.sharded - layout.weights) / MB
        out["grads"] = f.sharded_grads / MB
        out["optimizer"] = layout.state_mb(world=world, rows=True)
    return out


def rank_states(layout: Layout, sharding: str, world: int) -> tuple[list[float], list[list[int]] | None]:
    """The state (MB) each rank holds (one figure for every rank when they hold the same), and ZeRO-1's owners."""
    if world == 1 or sharding == "none":
        return [layout.state_mb()], None
    if sharding == "zero1":
        owned = layout.zero1_owned(world)
        return [layout.state_mb(o) for o in owned], owned
    return [layout.state_mb(world=world, rows=sharding == "fsdp")], None


def per_rank(prediction: dict, layout: Layout, sharding: str, world: int, batch: int, extra_mb: float):
    """Each rank's predicted parts and peak (MB) at `batch` samples per rank, and its optimizer step's peak: a
    list, one entry per distinct rank (ZeRO-1's ranks own different parameters; the other shardings' ranks are
    alike). `prediction`: pipeline.plan_step.simulate's; `extra_mb`: what a CUDA target adds (cuBLAS workspaces);
    with more than one rank, the layout's NCCL buffers are added too (in `other`)."""
    extra_mb += layout.nccl_mb if world > 1 else 0.0
    states, owned = rank_states(layout, sharding, world)
    fb = _fb_rows(prediction["profile"].values(batch), layout, sharding, world)
    at = dict(zip(PARTS, fb[fb.sum(axis=1).argmax()].tolist(), strict=True))
    at = {k: v for k, v in at.items() if k in prediction["parts"]}  # (a classifier's: no logits)
    out, alike = (
        [],
        {},
    )  # ranks that own the same parameters are alike (beyond the parameters' count, many own none)
    for r, state in enumerate(states):
        mine = None if owned is None else owned[r]
        key = None if mine is None else tuple(mine)
        if key not in alike:
            fb_parts = {**at, "optimizer": state}
            step = _step_parts(prediction["step"], layout, sharding, world, mine)
            parts = fb_parts if sum(fb_parts.values()) >= sum(step.values()) else step
            parts = {**parts, "other": parts["other"] + extra_mb}
            alike[key] = {
                "parts": parts,
                "peak": sum(parts.values()),
                "state": state,
                "step": step,
                "step_peak": sum(step.values()) + extra_mb,
                # step 1's peak: its pass with no state yet, or its optimizer step, which makes the state
                "before_state": max(sum(at.values()), sum(step.values())) + extra_mb,
            }
        out.append(alike[key])
    return out


def peak(prediction, layout, sharding, world, batch, extra_mb) -> float:
    """The largest rank's predicted peak (MB): what must fit."""
    return max(r["peak"] for r in per_rank(prediction, layout, sharding, world, batch, extra_mb))


def largest_batch(prediction, layout, sharding: str, world: int, budget: float, extra_mb: float) -> int:
    """The largest batch per rank whose largest rank's peak fits `budget` MB (0 when none does, at most
    MAX_BATCH): doubling, then bisection, on the profile (no further simulation)."""

    def fits(b: int) -> bool:
        return peak(prediction, layout, sharding, world, b, extra_mb) <= budget

    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= MAX_BATCH and fits(high):
        low, high = high, high * 2
    if high > MAX_BATCH:
        return MAX_BATCH
    while high - low > 1:  # fits(low), not fits(high)
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def smallest_world(prediction, layout, sharding, batch, budget, extra_mb) -> int | None:
    """The smallest number of ranks (CANDIDATE_RANKS) at which `batch` per rank fits; None when none does. DDP
    never fits on more ranks what does not fit on one (every rank holds everything, plus the buckets), nor
    ZeRO-1 what does not fit with no state at all (weights, gradients and buckets are not sharded): the search
    stops there."""
    if sharding == "none":
        return 1 if peak(prediction, layout, sharding, 1, batch, extra_mb) <= budget else None
    for world in CANDIDATE_RANKS:
        if peak(prediction, layout, sharding, world, batch, extra_mb) <= budget:
            return world
        if (
            sharding == "zero1"
            and world > 1
            and _stateless_zero1(prediction, layout, batch, extra_mb) > budget
        ):
            return None
    return None


def _stateless_zero1(prediction, layout, batch, extra_mb) -> float:
    """A ZeRO-1 rank's peak on any number of ranks above one, less its state and step temporaries: a lower
    bound."""
    fb = _fb_rows(prediction["profile"].values(batch), layout, "zero1", 2)
    step = {**prediction["step"], "grads": prediction["step"]["grads"] + layout.grads / MB}
    fixed = extra_mb + layout.nccl_mb
    return max(fb.sum(axis=1).max(), sum(step.values()) - step["optimizer"] - step["other"]) + fixed
