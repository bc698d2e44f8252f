"""What torch's CUDA reduction kernels take from the caching allocator beside their output, for a plan of a
CUDA target (pipeline.plan): the buffers of a reduction split across thread blocks, sized as ATen's Reduce.cuh
sizes them (`reduction_buffers`), and a dispatch mode that holds them while each reduction of a simulated step
runs (`CudaReductionBuffers`)."""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# How many blocks share an output depends on the GPU's multiprocessors: planned for the largest grid of the named
# GPUs (H100 and H200: 132 multiprocessors x 2048 threads), an upper bound on the others
REDUCTION_GRID = (132, 2048)


def reduction_buffers(
    shape, strides, dims, element_size: int, acc_size: int = 4, grid: tuple[int, int] = REDUCTION_GRID
) -> list[int]:
    """The bytes torch's CUDA reduction kernel takes from the caching allocator beside its output, as ATen's
    Reduce.cuh sizes them (setReduceConfig, global_memory_size, semaphore_size), for a reduction over `dims`
    (none: all) of a tensor of `shape` and `strides` (in elements) with elements of `element_size` bytes,
    accumulated in `acc_size` bytes, on a GPU of `grid` (multiprocessors, threads per multiprocessor): none
    when one block reduces each output; else the blocks' partial results and their semaphores, as the kernel
    asks for them (the allocator rounds each up to 512 bytes). Large only where the reduced dimension is not
    the contiguous one and many blocks share an output: Adafactor's column mean of a 30,522 x 384 matrix
    takes 93,782,016 bytes on an H200, twice the matrix. (An input past 2^31 elements, which torch splits,
    is sized as one.)"""
    if not shape:
        return []
    dims = {d % len(shape) for d in dims} if dims else set(range(len(shape)))
    sizes = [(st, n, i in dims) for i, (n, st) in enumerate(zip(shape, strides, strict=True)) if n > 1]
    # TensorIterator's dimensions: the reduced ones first, each kind by stride, adjacent ones coalesced
    reduced = _coalesced(sorted((st, n) for st, n, r in sizes if r))
    out = _coalesced(sorted((st, n) for st, n, r in sizes if not r))
    if not reduced:
        return []
    inputs, outputs = math.prod(n for _, n in reduced), math.prod(n for _, n in out)
    on_fastest = not out or reduced[0][0] < out[0][0]  # block_x_reduce: threads of a row share an output
    dim0, dim1 = (inputs, outputs) if on_fastest else (outputs, inputs)
    vec = 1  # outputs per thread ("vectorize along output")
    if not on_fastest and out[0][0] == 1:
        vec = 4
        for n in [out[0][1], *(st for st, _ in reduced + out[1:])]:
            while n % vec:
                vec //= 2
        dim0 //= vec
    elif on_fastest and reduced[0][0] == 1 and dim0 > 128 and len(reduced) == 1:
        dim0 //= 4  # "vectorize along input"

    def pow2(n: int, cap: int) -> int:
        return cap if n >= cap else 1 << (max(n, 1).bit_length() - 1)

    threads = 512 // vec
    width = min(pow2(dim0, threads), 32)
    height = min(pow2(dim1, threads), threads // width)
    width = min(pow2(dim0, threads), threads // height)
    step_input, step_output = (width, 1) if on_fastest else (1, width)
    per_thread = -(-inputs // step_input)
    if per_thread < height * 16 and per_thread < 256:
        return []  # each warp its own outputs: no reduction across warps, so none across blocks
    step_input *= height
    per_thread = -(-inputs // step_input)
    sms, threads_per_sm = grid
    target = sms * (threads_per_sm // (width * height))
    blocks = -(-(outputs // vec) // step_output)
    if per_thread < 256 or blocks > target:
        return []
    ctas = max(min(-(-target // blocks), -(-per_thread // 16)), -(-per_thread // 256))
    if ctas <= 1:
        return []
    return [acc_size * outputs * ctas * (1 if on_fastest else width * vec), 4 * blocks]


def _coalesced(dims: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(stride, size) pairs sorted by stride, as TensorIterator keeps them: adjacent ones whose strides chain
    (stride x size = the next stride) merge into one."""
    merged: list[tuple[int, int]] = []
    for st, n in dims:
        if merged and merged[-1][0] * merged[-1][1] == st:
            merged[-1] = (merged[-1][0], merged[-1][1] * n)
        else:
            merged.append((st, n))
    return merged


# the aten reductions a step makes through torch's CUDA reduction kernel, and where each takes its dimensions
REDUCTION_DIMS = {
    "aten.mean.dim": 1,
    "aten.sum.dim_IntList": 1,
    "aten.amax.default": 1,
    "aten.amin.default": 1,
    "aten.linalg_vector_norm.default": 2,
    "aten.norm.ScalarOpt_dim": 2,
}


class CudaReductionBuffers(TorchDispatchMode):
    """For a CUDA target: each reduction's buffers (`reduction_buffers`) made before it runs and freed after, as
    torch's CUDA kernel holds them, so a tracker below this mode counts them beside the reduction's input and
    output."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        where = REDUCTION_DIMS.get(str(func))
        held = []
        x = args[0] if args else None
        if where is not None and isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel():
            dims = args[where] if len(args) > where else kwargs.get("dim")
            dims = [dims] if isinstance(dims, int) else list(dims or [])
            acc = 8 if x.dtype == torch.float64 else 4
            for nbytes in reduction_buffers(x.shape, x.stride(), dims, x.element_size(), acc):
                held.append(torch.empty(-(-nbytes // 512) * 512, dtype=torch.uint8, device=x.device))
        out = func(*args, **kwargs)
        del held
        return out
