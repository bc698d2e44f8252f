"""torchao's low-bit AdamW (8-bit, 4-bit, fp8 state). Its step is compiled with torch.compile on CUDA and runs
eagerly on CPU (`OptimizerSpec.compiled_on`); its moments are tensor subclasses (codes, an fp32 scale per block
and their own quantization map) for large enough tensors, plain tensors otherwise."""

from __future__ import annotations

from pipeline import StateSize, learning_rate
from pipeline.optimizers.spec import FP32, OptimizerSpec, adam_args, param_groups, size, total

TORCHAO_MIN_SIZE = 4096  # torchao quantizes tensors of at least this size whose numel divides by the block

TORCHAO = {  # name -> (class, code bytes per element, quantization-map elements per state)
    "8bit": ("AdamW8bit", 1.0, 256),
    "4bit": ("AdamW4bit", 0.5, 16),
    "fp8": ("AdamWFp8", 1.0, 0),
}


def torchao_builder(kind: str):
    def build(model, cfg):
        import torchao.optim

        groups = param_groups(model, cfg.train.weight_decay)
        cls = getattr(torchao.optim, TORCHAO[kind][0])
        o = cfg.optim
        return cls(
            groups,
            lr=learning_rate(cfg),
            betas=tuple(o.betas),
            eps=o.eps,
            block_size=o.block_size,
            bf16_stochastic_round=o.get("bf16_stochastic_round", False),
        )

    return build


def torchao_estimator(kind: str):
    """torchao: exp_avg and exp_avg_sq as tensor subclasses (codes + an fp32 scale per block + own qmap) for
    tensors of >= 4096 elements divisible by the block size, plain tensors of the parameter's dtype otherwise;
    a float32 `step` tensor."""
    _, code_bytes, qmap = TORCHAO[kind]

    def estimate(params, cfg, variant=None, model_config=None) -> StateSize:
        block = cfg.optim.block_size
        parts = []
        for p in params:
            if p.numel >= TORCHAO_MIN_SIZE and p.numel % block == 0:
                codes = int(p.numel * code_bytes)
                moment = size((codes, 1), (p.numel // block, FP32), (qmap, FP32))
            else:
                moment = size((p.numel, p.itemsize))
            parts += [moment, moment, size((1, FP32))]
        return total(parts)

    return estimate


# --- the registry's rows ----------------------------------------------------------------------------------

# what the three share: its step is compiled (eager on CPU, see OptimizerSpec.compiled_on)
COMMON = {
    # its path reads block_size as text (which torchao cannot take) and bf16_stochastic_round as 0 / 1:
    # other values than these go to the Trainer as the object
    "trainer_fixed": {"block_size": 256, "bf16_stochastic_round": False},
    "added_settings": {"bf16_stochastic_round": False},
    "requires": ("torchao",),
    "compiles_step": True,
    "step_temporaries": (6, 0),  # eager (CPU); its compiled CUDA step fuses most of them
    "step_in_fp32": True,
}

ENTRIES = [
    OptimizerSpec(
        name="adamw_torchao_8bit",
        build=torchao_builder("8bit"),
        estimate=torchao_estimator("8bit"),
        trainer_optim="adamw_torch_8bit",
        trainer_args=adam_args,
        **COMMON,
    ),
    OptimizerSpec(
        name="adamw_torchao_4bit",
        build=torchao_builder("4bit"),
        estimate=torchao_estimator("4bit"),
        trainer_optim="adamw_torch_4bit",
        trainer_args=adam_args,
        **COMMON,
    ),
    OptimizerSpec(  # no Trainer string: always the object
        name="adamw_torchao_fp8",
        build=torchao_builder("fp8"),
        estimate=torchao_estimator("fp8"),
        **COMMON,
    ),
]
