"""The buffers torch's CUDA reductions take beside their output (pipeline.cuda_reductions), sized for the grid of
the GPU planned for: against ATen's own sizing (Reduce.cuh's setReduceConfig, rewritten below from torch 2.13's
header, torch/include/ATen/native/cuda/Reduce.cuh) on every named GPU, the named GPUs' grids, where a plan's grid
comes from, and plans for two GPUs kept apart."""

import types

import pytest
import torch

from pipeline import MB, cache, cuda_reductions, models, optimizers, plan_job, plan_step
from tests.conftest import compose_cfg

GRIDS = cuda_reductions.NAMED_GRIDS

# ---- ATen's sizing, from Reduce.cuh (struct ReduceConfig, get_output_vec_size, setReduceConfig) and the part of
# TensorIterator it reads (reorder_dimensions, coalesce_dimensions in TensorIterator.cpp), for a reduction
# `x.sum(dims)` / `x.mean(dims)` of a floating-point tensor into a new contiguous output, on CUDA (not ROCm)

WARP_SIZE = 32  # at::cuda::warp_size() on NVIDIA GPUs
MAX_NUM_THREADS = 512  # mnt_wrapper<T>::MAX_NUM_THREADS for every type but complex<double>
VT0 = INPUT_VEC_SIZE = 4  # gpu_reduce_kernel's defaults (vt0=4, input_vec_size=vt0)


def div_up(a: int, b: int) -> int:
    return (a + b - 1) // b


def last_pow2(n: int) -> int:
    for shift in (1, 2, 4, 8, 16):
        n |= n >> shift
    return max(1, n - (n >> 1))


class ReduceConfig:
    BLOCK_X, BLOCK_Y, CTA = 0, 1, 2

    def __init__(self, element_size_bytes: int, num_outputs: int, num_inputs: int):
        self.element_size_bytes, self.num_outputs, self.num_inputs = (
            element_size_bytes,
            num_outputs,
            num_inputs,
        )
        self.step_input = self.step_output = self.ctas_per_output = 1
        self.input_mult, self.output_mult = [0, 0, 0], [0, 0]
        self.vectorize_input, self.output_vec_size = False, 1

    def set_block_dimension(self, dim0: int, dim1: int) -> None:
        max_num_threads = MAX_NUM_THREADS // self.output_vec_size
        dim0_pow2 = last_pow2(dim0) if dim0 < max_num_threads else max_num_threads
        dim1_pow2 = last_pow2(dim1) if dim1 < max_num_threads else max_num_threads
        self.block_width = min(dim0_pow2, WARP_SIZE)
        self.block_height = min(dim1_pow2, max_num_threads // self.block_width)
        self.block_width = min(dim0_pow2, max_num_threads // self.block_height)
        self.num_threads = self.block_width * self.block_height

    def split_input(self, parallelism: int) -> int:
        step = self.step_input
        self.step_input *= parallelism
        return step

    def split_output(self, parallelism: int) -> int:
        step = self.step_output
        self.step_output *= parallelism
        return step

    def grid(self) -> tuple[int, int]:
        return div_up(self.num_outputs // self.output_vec_size, self.step_output), self.ctas_per_output

    def should_block_x_reduce(self) -> bool:
        return self.input_mult[self.BLOCK_X] != 0

    def should_global_reduce(self) -> bool:
        return self.input_mult[self.CTA] != 0

    def global_memory_size(self) -> int:
        if not self.should_global_reduce():
            return 0
        size = self.element_size_bytes * self.num_outputs * self.ctas_per_output
        if not self.should_block_x_reduce():
            size *= self.block_width * self.output_vec_size
        return size

    def semaphore_size(self) -> int:
        return 4 * self.grid()[0] if self.should_global_reduce() else 0  # sizeof(int) * grid().x

    def values_per_thread(self) -> int:
        return div_up(self.num_inputs, self.step_input)


class Iter:
    """TensorIterator's view of the reduction: operand 0 the output (stride 0 along the reduced dimensions), 1
    the input; strides in bytes; dimensions reordered (reduced ones first, then by stride) and coalesced."""

    def __init__(self, shape, strides, dims, element_size: int):
        ndim = len(shape)
        dims = {d % ndim for d in dims} if dims else set(range(ndim))
        kept = [i for i in range(ndim) if i not in dims]
        out = [0] * ndim  # a new contiguous output of the kept dimensions
        step = element_size
        for i in reversed(kept):
            out[i], step = step, step * shape[i]
        ops = [out, [s * element_size for s in strides]]
        shape = list(shape)

        def should_swap(d0: int, d1: int) -> int:
            for arg, stride in enumerate(ops):
                s0, s1 = stride[d0], stride[d1]
                if arg == 0 and (s0 == 0) != (s1 == 0):  # the output's: reduced dimensions to the front
                    return 1 if s1 == 0 else -1
                if s0 == 0 or s1 == 0:
                    continue
                if s0 != s1:
                    return -1 if s0 < s1 else 1
                if shape[d0] > shape[d1]:
                    return 1
            return 0

        perm = list(reversed(range(ndim)))
        for i in range(1, ndim):  # insertion sort with ambiguous comparisons, as reorder_dimensions
            dim1 = i
            for dim0 in range(i - 1, -1, -1):
                comparison = should_swap(perm[dim0], perm[dim1])
                if comparison > 0:
                    perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
                    dim1 = dim0
                elif comparison < 0:
                    break
        shape = [shape[p] for p in perm]
        ops = [[stride[p] for p in perm] for stride in ops]
        prev = 0
        for dim in range(1, ndim):  # coalesce_dimensions
            can = shape[prev] == 1 or shape[dim] == 1 or all(s[prev] * shape[prev] == s[dim] for s in ops)
            if can:
                if shape[prev] == 1:
                    for s in ops:
                        s[prev] = s[dim]
                shape[prev] *= shape[dim]
            else:
                prev += 1
                if prev != dim:
                    for s in ops:
                        s[prev] = s[dim]
                    shape[prev] = shape[dim]
        self.shape = shape[: prev + 1] if ndim else []
        self.ops = [s[: prev + 1] for s in ops] if ndim else [[], []]

    def ndim(self) -> int:
        return len(self.shape)

    def strides(self, arg: int) -> list[int]:
        return self.ops[arg]

    def num_reduce_dims(self) -> int:
        return sum(s == 0 for s in self.ops[0])

    def num_output_elements(self) -> int:
        n = 1
        for size, s in zip(self.shape, self.ops[0], strict=True):
            n *= size if s != 0 else 1
        return n

    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n


def get_output_vec_size(it: Iter, scalar_size: int) -> int:
    vec_size = 4

    def update(n: int) -> None:
        nonlocal vec_size
        while n % vec_size != 0:
            vec_size //= 2

    update(0)  # the input's address in elements: the caching allocator's blocks are 512-byte aligned
    output_index = it.num_reduce_dims()
    update(it.shape[output_index])
    for j, stride in enumerate(it.strides(1)):  # iter.strides(iter.noutputs()): the input's
        if j != output_index:
            update(stride // scalar_size)
    return vec_size


def set_reduce_config(
    it: Iter, arg_size: int, scalar_size: int, sms: int, threads_per_sm: int
) -> ReduceConfig:
    num_outputs = it.num_output_elements()
    inputs_per_output = it.numel() // num_outputs
    input_index = 1
    config = ReduceConfig(arg_size, num_outputs, inputs_per_output)
    if it.ndim() > 0:
        on_fastest = it.num_reduce_dims() == it.ndim() or (
            it.strides(input_index)[0] < it.strides(input_index)[it.num_reduce_dims()]
        )
        if on_fastest:
            dim0, dim1 = inputs_per_output, num_outputs
            fastest_moving_stride = it.strides(input_index)[0]
        else:
            dim0, dim1 = num_outputs, inputs_per_output
            fastest_moving_stride = it.strides(input_index)[it.num_reduce_dims()]
    else:
        on_fastest, fastest_moving_stride, dim0, dim1 = True, scalar_size, 1, 1
    if fastest_moving_stride == scalar_size:
        if on_fastest and dim0 >= 128 and it.num_reduce_dims() == 1:
            config.vectorize_input = True
            dim0 //= INPUT_VEC_SIZE
        elif not on_fastest:
            config.output_vec_size = get_output_vec_size(it, scalar_size)
            dim0 //= config.output_vec_size
    config.set_block_dimension(dim0, dim1)
    block_width, block_height = config.block_width, config.block_height
    if it.ndim() == 0 or on_fastest:
        config.input_mult[0] = config.split_input(block_width)
    else:
        config.output_mult[0] = config.split_output(block_width)
    min_values_per_thread, max_values_per_thread = 16, 256
    warp_split_threshold = min(block_height * 16, max_values_per_thread)
    if config.values_per_thread() >= warp_split_threshold:
        config.input_mult[1] = config.split_input(block_height)
    else:
        config.output_mult[1] = config.split_output(block_height)
    blocks_per_sm = threads_per_sm // config.num_threads
    target_grid_size = sms * blocks_per_sm
    grid = config.grid()[0]
    if (
        config.input_mult[1] != 0
        and config.values_per_thread() >= max_values_per_thread
        and grid <= target_grid_size
    ):
        ctas_per_output1 = div_up(target_grid_size, grid)
        ctas_per_output2 = div_up(config.values_per_thread(), min_values_per_thread)
        ctas_per_output3 = div_up(config.values_per_thread(), max_values_per_thread)
        config.ctas_per_output = max(min(ctas_per_output1, ctas_per_output2), ctas_per_output3)
        if config.ctas_per_output > 1:
            config.input_mult[2] = config.split_input(config.ctas_per_output)
    return config


def aten_buffers(shape, dims, grid, strides=None, element_size: int = 4, acc_size: int = 4) -> list[int]:
    """What gpu_reduce_kernel asks the caching allocator for when should_global_reduce(): global_memory_size()
    bytes, then semaphore_size()."""
    strides = torch.empty(shape).stride() if strides is None else strides
    config = set_reduce_config(Iter(shape, strides, dims, element_size), acc_size, element_size, *grid)
    if not config.should_global_reduce():
        return []
    return [config.global_memory_size(), config.semaphore_size()]


# ---- the plan's sizing against it

# (shape, reduced dims, strides or None: contiguous) of reductions an optimizer step makes: column means (dim -2,
# Adafactor's and CAME's factored statistics) of the matrices of BERT, MiniLM and Llama, row means, whole norms,
# a 3-d tensor, a transposed matrix and outputs too few for vectors of 4
CASES = [
    ((4096, 4096), (0,), None),
    ((11008, 4096), (0,), None),
    ((4096, 11008), (0,), None),
    ((30522, 384), (-2,), None),
    ((128256, 4096), (-2,), None),
    ((1536, 384), (-2,), None),
    ((30522, 384), (-1,), None),
    ((30522, 384), (), None),
    ((4096, 4096), (), None),
    ((384, 1536), (-2,), None),
    ((64, 1024, 12), (1,), None),
    ((8, 512, 384), (0, 1), None),
    ((16384, 6), (0,), None),
    ((16384, 3), (0,), None),
    ((4096, 1024), (0,), (1, 4096)),  # x.t() of a contiguous 1024 x 4096
    ((1536,), (), None),
    ((2, 384), (), None),
]


@pytest.mark.parametrize("name", sorted(GRIDS))
def test_the_plan_sizes_the_buffers_as_atens_set_reduce_config_on_each_named_gpu(name):
    for shape, dims, strides in CASES:
        strides = torch.empty(shape).stride() if strides is None else strides
        found = cuda_reductions.reduction_buffers(shape, strides, dims, 4, GRIDS[name])
        assert found == aten_buffers(shape, dims, GRIDS[name], strides), (name, shape, dims)


def test_a_column_reductions_buffer_follows_the_gpus_grid():
    """dim 0 of a contiguous fp32 matrix (Adafactor's column statistics): 4 bytes x outputs x blocks per output x
    (32 threads x 4 outputs each), the blocks per output filling the GPU (multiprocessors x 2048 or 1536 threads
    per multiprocessor / 128 per block) up to one per 16 values each thread reduces."""
    expected = {  # bytes of partial results; then 4 bytes of semaphore per 128 outputs
        ((4096, 4096), "h100-80gb"): 134_217_728,  # 128 MiB: 64 blocks per output (16 values per thread)
        ((4096, 4096), "h200"): 134_217_728,
        ((4096, 4096), "b200"): 134_217_728,
        ((4096, 4096), "a100-80gb"): 113_246_208,  # 108 MiB: 54 blocks (108 x 16 / 32 columns of blocks)
        ((4096, 4096), "l4"): 46_137_344,  # 44 MiB: 22 blocks (58 x 12 / 32)
        ((11008, 4096), "h100-80gb"): 138_412_032,  # 132 MiB: 66 blocks
        ((11008, 4096), "b200"): 155_189_248,  # 148 MiB: 74 blocks (148 x 16 / 32)
        ((11008, 4096), "a100-80gb"): 113_246_208,
        ((11008, 4096), "l4"): 46_137_344,
    }
    for (shape, name), nbytes in expected.items():
        found = cuda_reductions.reduction_buffers(shape, torch.empty(shape).stride(), (0,), 4, GRIDS[name])
        assert found == aten_buffers(shape, (0,), GRIDS[name]) == [nbytes, 128], (shape, name)
    # Adafactor's column mean of MiniLM's 30,522 x 384 word embeddings, as an H200 asked for it (tests/test_plan_step.py)
    assert aten_buffers((30522, 384), (-2,), GRIDS["h200"]) == [93_782_016, 12]
    assert aten_buffers((30522, 384), (-2,), GRIDS["l4"]) == [45_613_056, 12]


def test_the_named_gpus_grids_cover_every_named_gpu_and_the_upper_grid_bounds_them():
    assert set(GRIDS) == set(plan_step.DEVICE_MEMORY_GB)
    for sms, threads in GRIDS.values():
        assert sms > 0 and threads in (
            1024,
            1536,
            2048,
        )  # sm_75; sm_86 and sm_89; sm_70, sm_80, sm_90, sm_100
    assert cuda_reductions.UPPER_GRID == GRIDS["b200"] == (148, 2048)
    for name, grid in GRIDS.items():
        for shape, dims, strides in CASES:
            strides = torch.empty(shape).stride() if strides is None else strides
            below = cuda_reductions.reduction_buffers(shape, strides, dims, 4, grid)
            upper = cuda_reductions.reduction_buffers(shape, strides, dims, 4, cuda_reductions.UPPER_GRID)
            assert sum(below) <= sum(upper), (name, shape, dims)


def test_a_plans_grid_is_the_named_gpus_else_this_machines_else_the_upper_bound(monkeypatch):
    assert cuda_reductions.grid_for("l4") == (58, 1536)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda_reductions.grid_for(None) == cuda_reductions.UPPER_GRID  # a CUDA target, no GPU here
    # on a GPU: ATen's figures, read in this process where it has initialised CUDA (a training job's)
    device = types.SimpleNamespace(
        multi_processor_count=58, max_threads_per_multi_processor=1536, major=8, minor=9
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: device)
    assert cuda_reductions.grid_for(None) == (58, 1536)
    assert cuda_reductions.grid_for("h100-80gb") == (132, 2048)  # a named GPU wins over this machine's
    # else (a sweep's runner, which plans in its own process) in a child process, so that this one never
    # initialises CUDA
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", None)
    ran = []

    def run(args, **kwargs):
        ran.append(args)
        return types.SimpleNamespace(returncode=0, stdout="108 2048 8 0\n")

    monkeypatch.setattr(cuda_reductions.subprocess, "run", run)
    cuda_reductions._child_device.cache_clear()
    try:
        assert cuda_reductions.grid_for(None) == cuda_reductions.grid_for(None) == (108, 2048)
        assert cuda_reductions.device_capability() == (8, 0)
        assert len(ran) == 1 and "get_device_properties(0)" in ran[0][-1]  # once per process
    finally:
        cuda_reductions._child_device.cache_clear()


TINY_384 = ["model=tiny", "model.architecture.hidden_size=384", "optim=adafactor", "train.max_length=32"]


def test_plans_for_two_named_gpus_never_share_an_optimizer_step(monkeypatch, tmp_path):
    """Adafactor on a BERT of MiniLM's 30,522 x 384 embeddings: its column mean's buffer is 89.4 MB on an H100
    and 43.5 MB on an L4, so the step's peaks differ. Planned one after the other in one process (the cache of
    steps in memory), and again from a store on disk, neither GPU's plan reads the other's step."""
    monkeypatch.setattr(plan_step, "_OPTIMIZER_STEP", {})
    step = {}
    for name in ("l4", "h100-80gb"):
        cfg = compose_cfg(*TINY_384, "plan=true", f"device_memory={name}", "batch_size=1")
        step[name] = plan_job.plan_result(cfg)["metrics"]["predicted_step_peak_mb"]
    assert len(plan_step._OPTIMIZER_STEP) == 2
    difference = (93_782_016 - 45_613_056) / MB  # the H100's column-mean buffer less the L4's
    workspaces = plan_step.cublas_workspaces_mb("h100-80gb") - plan_step.cublas_workspaces_mb(
        "l4"
    )  # sm_90's larger
    assert 0.9 * difference < step["h100-80gb"] - step["l4"] - workspaces <= difference
    spec = optimizers.get("adafactor")
    store = cache.Store(tmp_path, "test", sources=("plan_step.py", "cuda_reductions.py"))
    for _ in range(2):  # simulated and kept, then read back: each GPU's own
        for name in ("l4", "h100-80gb"):
            monkeypatch.setattr(plan_step, "_OPTIMIZER_STEP", {})
            cfg = compose_cfg(*TINY_384, f"device_memory={name}")
            config = models.model_config(cfg.model, 2)
            found = plan_step.simulate(config, spec, cfg, 1, 32, cuda=True, store=store, grid=GRIDS[name])
            assert found["step_peak"] == pytest.approx(step[name], rel=1e-9), name
