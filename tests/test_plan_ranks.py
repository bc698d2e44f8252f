"""Plans for several ranks (pipeline.plan_ranks): what each rank holds under DDP, ZeRO-1, ZeRO-2 and FSDP,
checked against hand counts of the shards and against torch's own ZeroRedundancyOptimizer partition; the
smallest number of ranks that fits; the config's checks; the plan sweep's table and verdict."""

import math

import pandas as pd
import pytest
import torch

from pipeline import MB, models, optimizers, plan_job, plan_ranks, plan_step
from pipeline.config import ConfigError, validate
from pipeline.report.verdict import ranks_verdict
from tests.conftest import compose_cfg, run_cli, sweep_runs


@pytest.fixture(scope="module")
def tiny_plan():
    cfg = compose_cfg("model=tiny", "optim=adamw", "plan=true", "batch_size=16")
    spec = optimizers.get("adamw")
    config = models.model_config(cfg.model, num_labels=2)
    prediction = plan_step.simulate(config, spec, cfg, 16, 64)
    layout = plan_ranks.Layout(prediction["model"], spec, cfg, cuda=False)
    return cfg, spec, prediction, layout


def test_zero1_partition_by_hand():
    """Largest first, to the rank with the fewest elements so far, counted across groups; ties to rank 0."""
    owned = plan_ranks.zero1_partition([[10, 3, 7], [5, 5]], 2)
    # 10 -> r0 (10); 7 -> r1 (7); 3 -> r1 (10); 5 -> r0 (15, the tie goes to rank 0); 5 -> r1 (15)
    assert owned == [[[0], [0]], [[2, 1], [1]]]


def test_zero1_partition_is_torchs(tmp_path):
    """The same owners as torch's ZeroRedundancyOptimizer (its own `_partition_parameters`, run for 3 ranks
    in a one-process gloo group by telling it the world is 3)."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        shapes = [(30, 4), (7,), (16, 16), (5, 5), (100,), (3,), (12, 2)]
        params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        groups = [{"params": params[:4]}, {"params": params[4:], "weight_decay": 0.0}]
        zero = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=1e-3)
        zero.world_size, zero._partition_parameters_cache = 3, []
        torch_owned = [[[id(p) for p in g["params"]] for g in rank] for rank in zero._partition_parameters()]
    finally:
        dist.destroy_process_group()
    sizes = [[p.numel() for p in g["params"]] for g in groups]
    ours = plan_ranks.zero1_partition(sizes, 3)
    ids = [[id(p) for p in g["params"]] for g in groups]
    assert [[sorted(ids[g][i] for i in idx) for g, idx in enumerate(r)] for r in ours] == [
        [sorted(g) for g in rank] for rank in torch_owned
    ]


def test_ddp_adds_one_copy_of_the_gradients(tiny_plan):
    """DDP's buckets: every trainable parameter's bytes once more, on every rank, at the peak."""
    cfg, spec, prediction, layout = tiny_plan
    grads = sum(p.numel() * p.element_size() for p in prediction["model"].parameters() if p.requires_grad)
    (rank,) = plan_ranks.per_rank(prediction, layout, "none", 2, 16, 0.0)
    assert rank["peak"] == pytest.approx(prediction["peak"] + grads / MB, rel=1e-9)
    (one,) = plan_ranks.per_rank(prediction, layout, "none", 1, 16, 0.0)  # one process: no DDP
    assert one["peak"] == pytest.approx(prediction["peak"], rel=1e-12)


def test_each_gpu_of_several_holds_nccls_buffers(tiny_plan):
    """A CUDA target's plan over several ranks adds NCCL's buffers (NCCL_BUFFERS_MB, stated) to each rank's
    other memory, its peak and its optimizer step's peak, under every sharding; one rank has none, nor a layout
    without them (a training job's prediction, compared with torch's allocator, which they lie outside)."""
    cfg, spec, prediction, layout = tiny_plan
    nccl = plan_ranks.NCCL_BUFFERS_MB
    assert nccl == 512
    with_nccl = plan_ranks.Layout(prediction["model"], spec, cfg, cuda=False, nccl_mb=nccl)
    for sharding in plan_ranks.SOURCES:
        plain = plan_ranks.per_rank(prediction, layout, sharding, 4, 16, 0.0)
        ranks = plan_ranks.per_rank(prediction, with_nccl, sharding, 4, 16, 0.0)
        for rank, without in zip(ranks, plain, strict=True):
            assert rank["parts"]["other"] == pytest.approx(without["parts"]["other"] + nccl, rel=1e-12)
            assert rank["peak"] == pytest.approx(without["peak"] + nccl, rel=1e-12)
            assert rank["step_peak"] == pytest.approx(without["step_peak"] + nccl, rel=1e-12)
        (one,) = plan_ranks.per_rank(prediction, with_nccl, sharding, 1, 16, 0.0)
        assert one["peak"] == pytest.approx(prediction["peak"], rel=1e-12)
    # a plan job for a named GPU (a CUDA target) over 2 ranks counts them
    cfg2 = compose_cfg(
        "model=tiny", "optim=adamw", "plan=true", "device_memory=t4", "launcher.nproc_per_job=2"
    )
    m = plan_job.plan_result(cfg2)["metrics"]
    cuda = plan_step.simulate(
        prediction["model"].config, spec, cfg2, 16, 64, cuda=True, names=("input_ids", "attention_mask")
    )
    cuda_layout = plan_ranks.Layout(cuda["model"], spec, cfg2, cuda=True, nccl_mb=nccl)
    top = max(
        plan_ranks.per_rank(cuda, cuda_layout, "none", 2, 16, cuda["workspaces"]),
        key=lambda r: r["peak"],
    )
    assert m["predicted_peak_mb"] == pytest.approx(top["peak"], rel=1e-12)


def test_zero1_ranks_hold_the_state_of_what_they_own(tiny_plan):
    cfg, spec, prediction, layout = tiny_plan
    ranks = plan_ranks.per_rank(prediction, layout, "zero1", 2, 16, 0.0)
    # AdamW: exp_avg and exp_avg_sq (4 bytes each) and a 4-byte step per parameter it owns
    infos = layout.infos
    for rank, owned in zip(ranks, layout.zero1_owned(2), strict=True):
        by_hand = sum(8 * infos[i].numel + 4 for i in owned) / MB
        assert rank["state"] == pytest.approx(by_hand, rel=1e-9)
    assert sum(r["state"] for r in ranks) == pytest.approx(prediction["state"], rel=1e-9)


@pytest.mark.parametrize("world", [2, 3, 8])
def test_zero2_and_fsdp_shards_by_hand(tiny_plan, world):
    """ZeRO-2: weights whole, gradients and AdamW's state 1/N (1-D slices, rounded up); FSDP2: every parameter
    cut by rows (padded to a multiple of N), the root (embeddings, pooler, head) and a layer gathered."""
    cfg, spec, prediction, layout = tiny_plan
    model = prediction["model"]
    trainable = [p for p in model.parameters() if p.requires_grad]
    state = sum(8 * math.ceil(p.numel() / world) + 4 for p in trainable) / MB
    grads = sum(p.numel() * 4 for p in trainable) / MB
    (zero2,) = plan_ranks.per_rank(prediction, layout, "zero2", world, 16, 0.0)
    assert zero2["state"] == pytest.approx(state, rel=1e-9)
    assert zero2["step"]["grads"] == pytest.approx(grads / world, rel=1e-9)
    assert zero2["step"]["params"] == pytest.approx(prediction["step"]["params"], rel=1e-9)
    (fsdp,) = plan_ranks.per_rank(prediction, layout, "fsdp", world, 16, 0.0)

    def rows(p) -> int:  # the rows of a rank's shard: its first dimension over N, rounded up
        return math.ceil((p.shape[0] if p.dim() else 1) / world)

    def row(p) -> int:  # elements a row
        return p.numel() // max(p.shape[0] if p.dim() else 1, 1)

    def gathered(params) -> float:
        return sum(world * rows(p) * row(p) * 4 for p in params)

    shard = sum(rows(p) * row(p) * 4 for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers()) / MB
    assert fsdp["step"]["params"] == pytest.approx(shard / MB + buffers, rel=1e-9)
    assert fsdp["state"] == pytest.approx(sum(8 * rows(p) * row(p) + 4 for p in trainable) / MB)
    layers = model.bert.encoder.layer
    in_layers = {id(p) for p in layers.parameters()}
    sizes = layout.fsdp(world)
    assert sizes.unit == max(gathered(m.parameters()) for m in layers)
    assert sizes.root == gathered(p for p in model.parameters() if id(p) not in in_layers)
    assert sizes.sharded == shard


def test_the_anchors_are_the_published_formulas(tiny_plan):
    cfg, spec, prediction, layout = tiny_plan
    psi = sum(p.numel() for p in prediction["model"].parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in prediction["model"].modules())
    assert plan_ranks.deepspeed_zero_mb(layout, "none", 4) == pytest.approx(16 * psi / MB)
    assert plan_ranks.deepspeed_zero_mb(layout, "zero1", 4) == pytest.approx((4 * psi + 3 * psi) / MB)
    assert plan_ranks.deepspeed_zero_mb(layout, "zero2", 4) == pytest.approx((4 * psi + 4 * psi) / MB)
    assert plan_ranks.deepspeed_zero_mb(layout, "fsdp", 4) == pytest.approx((4 * largest + 4.5 * psi) / MB)


@pytest.mark.parametrize("sharding", ["zero1", "zero2", "fsdp"])
def test_the_smallest_number_of_ranks_is_the_first_that_fits(tiny_plan, sharding):
    cfg, spec, prediction, layout = tiny_plan
    full = plan_ranks.peak(prediction, layout, sharding, 1, 16, 0.0)
    budget = full * 0.8 if sharding == "fsdp" else full * 0.99
    n = plan_ranks.smallest_world(prediction, layout, sharding, 16, budget, 0.0)
    if n is None:  # ZeRO-1 cannot shard weights, gradients or buckets
        assert plan_ranks.peak(prediction, layout, sharding, plan_ranks.MAX_RANKS, 16, 0.0) > budget
        return
    assert plan_ranks.peak(prediction, layout, sharding, n, 16, 0.0) <= budget
    before = plan_ranks.CANDIDATE_RANKS[plan_ranks.CANDIDATE_RANKS.index(n) - 1]
    assert plan_ranks.peak(prediction, layout, sharding, before, 16, 0.0) > budget
    b = plan_ranks.largest_batch(prediction, layout, sharding, n, budget, 0.0)
    assert plan_ranks.peak(prediction, layout, sharding, n, b, 0.0) <= budget
    assert plan_ranks.peak(prediction, layout, sharding, n, b + 1, 0.0) > budget


def test_one_rank_plans_as_before():
    """A plan of one process with a budget: the per-rank figures are the one-process ones."""
    cfg = compose_cfg("model=tiny", "optim=adamw", "plan=true", "memory_budget_mb=40")
    m = plan_job.plan_result(cfg)["metrics"]
    config = models.model_config(cfg.model, num_labels=2)
    found = plan_step.simulate(config, optimizers.get("adamw"), cfg, cfg.batch_size, cfg.train.max_length)
    assert m["predicted_peak_mb"] == pytest.approx(found["peak"], rel=1e-12)
    assert m["predicted_max_batch_size"] == plan_step.largest_batch(found, 40.0)
    assert m["predicted_min_ranks"] == 1 and m["predicted_max_batch_at_min_ranks"] == plan_step.largest_batch(
        found, 40
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["train.sharding=zero2", "backend=accelerator", "launcher.nproc_per_job=2"],
            "train.sharding=zero2 is planned only (plan=true): training runs none, zero1, fsdp",
        ),
        (["plan=true", "find_batch_size=true"], "plan=true is invalid with find_batch_size=true"),
        (
            ["optim=adafactor", "train.sharding=fsdp", "backend=accelerator", "launcher.nproc_per_job=2"],
            "train.sharding=fsdp is invalid with optim=adafactor: it works on whole weight matrices, and FSDP "
            "hands it shards of their rows (train.sharding=zero1 or none)",
        ),
        (
            ["plan=true", "optim=adamw_8bit", "train.sharding=fsdp", "launcher.nproc_per_job=2"],
            "train.sharding=fsdp is invalid with optim=adamw_8bit: its step runs bitsandbytes' kernels",
        ),
        (
            ["plan=true", "train.sharding=zero4"],
            "train.sharding='zero4' is invalid: did you mean zero2? allowed",
        ),
    ],
)
def test_bad_plan_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(*overrides))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_plan_takes_any_ranks_and_sharding_on_either_backend():
    for sharding in plan_ranks.SOURCES:
        validate(compose_cfg("plan=true", f"train.sharding={sharding}", "launcher.nproc_per_job=64"))


def test_a_ranks_verdict_states_the_precision_each_answer_holds_for():
    """A plan over shardings at two precisions where FSDP fits only under bf16_pure: one line per precision,
    each saying its own, never one answer for both."""
    rows = [
        ("bf16", "fsdp", 4, None, None),
        ("bf16", "fsdp", 8, None, None),
        ("bf16_pure", "fsdp", 4, 4.0, 3.0),
        ("bf16_pure", "fsdp", 8, 4.0, 3.0),
    ]
    table = pd.DataFrame(
        [
            {"model": "llama-3.1-8b", "precision": p, "batch size [samples]": 1, "device_memory": "h100-80gb",
             "sharding": s, "ranks": n, "optimizer": "adamw", "budget [MB]": 81_559.0, "ranks needed": need,
             "largest batch there [samples]": largest}
            for p, s, n, need, largest in rows
        ]
    )  # fmt: skip
    assert ranks_verdict(table) == [
        "llama-3.1-8b on h100-80gb, batch 1/rank (precision bf16): adamw fits on no number of ranks tried "
        "(up to 4096)",
        "llama-3.1-8b on h100-80gb, batch 1/rank (precision bf16_pure): adamw needs 4 with fsdp (3/rank)",
    ]
    one = table[table.precision == "bf16_pure"]  # one precision: nothing to state
    assert ranks_verdict(one) == ["llama-3.1-8b on h100-80gb, batch 1/rank: adamw needs 4 with fsdp (3/rank)"]


@pytest.mark.slow  # ~40 s: 8 plan jobs through the CLI
def test_a_plan_sweep_over_ranks_prints_the_table_and_the_verdict(tmp_path):
    args = ["-m", "plan=true", "model=tiny", "optim=adamw,adafactor", "train.sharding=none,zero2"]
    proc = run_cli(tmp_path, *args, "launcher.nproc_per_job=1,2", "memory_budget_mb=20")
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sweep_runs(tmp_path)[1]
    assert len(runs) == 8 and all(r.info.status == "FINISHED" for r in runs)
    assert "ranks needed" in proc.stdout
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("verdict: ")]
    assert line.startswith("verdict: tiny on 20 MB, batch 16/rank: adamw ")


@pytest.mark.slow  # plans through the CLI: CI (make test-ci)
def test_a_plan_over_several_ranks_only_gives_a_verdict_with_the_levers(tmp_path):
    """Ranks 2 and 4 without 1 among them, DDP (no sharding: every rank holds it all), a budget nothing fits:
    one verdict line per number of ranks, each naming by how much each optimizer falls short and the levers
    that lower its peak."""
    args = ["-m", "plan=true", "model=tiny", "optim=adamw,adafactor", "launcher.nproc_per_job=2,4"]
    proc = run_cli(tmp_path, *args, "memory_budget_mb=5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("verdict: ")]
    assert [line.split(":")[1] for line in lines] == [
        " fits 5 MB at batch 16 (ranks 2)",
        " fits 5 MB at batch 16 (ranks 4)",
    ]
    for line in lines:
        assert ": none; does not fit: adamw (short by " in line and "), adafactor (short by " in line
        # the levers each was planned with: bf16 weights, 8-bit state lower adamw's peak, not enough even
        # together; none lowers adafactor's
        assert ". To fit adamw: no combination of the levers fits (the smallest peak found, " in line, line
        assert line.endswith(
            ". To fit adafactor: no combination of the levers fits (none lowers its peak)"
        ), line
