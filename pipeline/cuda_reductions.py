"""What torch's CUDA reduction kernels take from the caching allocator beside their output, for a plan of a
CUDA target (pipeline.plan_step): the buffers of a reduction split across thread blocks, sized as ATen's Reduce.cuh
sizes them (`reduction_buffers`) for the grid of the GPU planned for (`grid_for`), and a dispatch mode that holds
them while each reduction of a simulated step runs (`CudaReductionBuffers`)."""

from __future__ import annotations

import functools
import math
import subprocess
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# How many blocks share an output depends on the GPU's grid, which ATen's setReduceConfig reads from the device:
# (multiprocessors, most resident threads per multiprocessor) = cudaDeviceProp's multiProcessorCount and
# maxThreadsPerMultiProcessor. The named GPUs' (pipeline.plan_step.DEVICE_MEMORY_GB's names, and the B200's):
# - threads per multiprocessor follow the compute capability (the CUDA C++ Programming Guide's table of
#   technical specifications per compute capability, "maximum number of resident threads per SM", as the CUDA
#   occupancy calculator takes it): 2048 on sm_70, sm_80, sm_90 and sm_100; 1536 on sm_86 and sm_89; 1024 on
#   sm_75.
# - multiprocessors: the vendor's architecture whitepaper, or its data sheet's CUDA cores divided by the cores
#   per multiprocessor of the architecture (64 on sm_70 and sm_75, 128 on sm_86 and sm_89).
NAMED_GRIDS = {
    "t4": (40, 1024),  # sm_75; Turing whitepaper: Tesla T4, 40 SMs (2,560 CUDA cores / 64)
    "v100-32gb": (80, 2048),  # sm_70; Volta whitepaper: Tesla V100, 80 SMs (5,120 CUDA cores / 64)
    "a10": (72, 1536),  # sm_86; A10 data sheet: 9,216 CUDA cores / 128
    "l4": (58, 1536),  # sm_89; L4 data sheet: 7,424 CUDA cores / 128
    "rtx-3090": (82, 1536),  # sm_86; Ampere GA102 whitepaper: RTX 3090, 82 SMs (10,496 CUDA cores / 128)
    "rtx-4090": (128, 1536),  # sm_89; Ada whitepaper: RTX 4090, 128 SMs (16,384 CUDA cores / 128)
    "l40s": (142, 1536),  # sm_89; L40S data sheet: 18,176 CUDA cores / 128
    "a100-40gb": (108, 2048),  # sm_80; A100 whitepaper: 108 SMs (SXM4 and PCIe alike)
    "a100-80gb": (108, 2048),  # sm_80; the same GA100 part
    # sm_90; H100 whitepaper: 132 SMs on the SXM5 board, 114 on the PCIe card (whose grid this bounds from above)
    "h100-80gb": (132, 2048),
    "h200": (132, 2048),  # sm_90; the H100 SXM5's GH100 (132 SMs) with 141 GB of HBM3e
    # sm_100; 148 SMs, two dies of 74 enabled each, as published analyses of the B200 give it (NVIDIA's data sheet
    # states no SM count)
    "b200": (148, 2048),
}
# A CUDA target with no GPU named or present: the most multiprocessors and threads of the named GPUs (the B200's),
# an upper bound on each of them (more of either never means fewer blocks per output, nor smaller buffers)
UPPER_GRID = (max(s for s, _ in NAMED_GRIDS.values()), max(t for _, t in NAMED_GRIDS.values()))


def grid_for(device_memory: str | None) -> tuple[int, int]:
    """The grid (multiprocessors, threads per multiprocessor) of the GPU a plan is for: the named GPU's
    (`device_memory`, NAMED_GRIDS); else this machine's, as ATen reads it (`device_grid`); else, with no GPU
    here, UPPER_GRID."""
    if device_memory is not None:
        return NAMED_GRIDS[device_memory]
    return device_grid() if torch.cuda.is_available() else UPPER_GRID


def device_grid() -> tuple[int, int]:
    """The grid of this process's current CUDA device, as ATen's setReduceConfig reads it. Where this process
    has not initialised CUDA (a sweep's runner plans in its own process and leaves CUDA to the jobs' processes:
    pipeline.starter), a child process reads the first visible device's, once, and this one stays without."""
    return _device()[:2]


def device_capability() -> tuple[int, int] | None:
    """The compute capability (major, minor) of this process's current CUDA device, read as `device_grid`
    reads its grid; None where it cannot be read."""
    return _device()[2:] or None


def _device() -> tuple[int, ...]:
    if torch.cuda.is_initialized():
        device = torch.cuda.get_device_properties(torch.cuda.current_device())
        return (
            device.multi_processor_count,
            device.max_threads_per_multi_processor,
            device.major,
            device.minor,
        )
    return _child_device()


@functools.cache
def _child_device() -> tuple[int, ...]:
    """The first visible CUDA device's grid and compute capability, read by a child process; UPPER_GRID alone
    where it cannot read them."""
    code = (
        "import torch; d = torch.cuda.get_device_properties(0); "
        "print(d.multi_processor_count, d.max_threads_per_multi_processor, d.major, d.minor)"
    )
    try:
        found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return UPPER_GRID
    if found.returncode != 0:
        return UPPER_GRID
    return tuple(int(n) for n in found.stdout.split()[-4:])


def reduction_buffers(
    shape, strides, dims, element_size: int, grid: tuple[int, int], acc_size: int = 4
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
    elif on_fastest and reduced[0][0] == 1 and dim0 >= 128 and len(reduced) == 1:
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
    """For a CUDA target: each reduction's buffers (`reduction_buffers`, on a GPU of `grid`: multiprocessors,
    threads per multiprocessor) made before it runs and freed after, as torch's CUDA kernel holds them, so a
    tracker below this mode counts them beside the reduction's input and output."""

    def __init__(self, grid: tuple[int, int]):
        super().__init__()
        self.grid = tuple(grid)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        where = REDUCTION_DIMS.get(str(func))
        held = []
        x = args[0] if args else None
        if where is not None and isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel():
            dims = args[where] if len(args) > where else kwargs.get("dim")
            dims = [dims] if isinstance(dims, int) else list(dims or [])
            acc = 8 if x.dtype == torch.float64 else 4
            for nbytes in reduction_buffers(x.shape, x.stride(), dims, x.element_size(), self.grid, acc):
                held.append(torch.empty(-(-nbytes // 512) * 512, dtype=torch.uint8, device=x.device))
        out = func(*args, **kwargs)
        del held
        return out
