"""Adam-mini (the adam-mini package): a full first moment, and a second moment shared by blocks of parameters
(one value per attention head, per output row, or per tensor), chosen by substrings of the parameter names."""

from __future__ import annotations

from pipeline import StateSize, learning_rate
from pipeline.optimizers.spec import FP32, INT64, OptimizerSpec, size, total


def build_adam_mini(model, cfg):
    from adam_mini import Adam_mini

    dim, heads = attention_dims(model.config)
    optimizer = Adam_mini(
        named_parameters=model.named_parameters(),
        lr=learning_rate(cfg),
        betas=tuple(cfg.optim.betas),
        eps=cfg.optim.eps,
        weight_decay=cfg.train.weight_decay,
        dim=dim,
        n_heads=heads,
        verbose=False,
    )
    # Adam-mini picks each parameter's block type by substrings of its name; these sets are configurable
    # because its defaults are written for Llama-style names
    for key in ("embd_names", "output_names", "wqk_names", "wv_names", "attn_proj_names", "mlp_names"):
        setattr(optimizer, key, set(cfg.optim.names[key]))
    return optimizer


def attention_dims(config) -> tuple[int, int]:
    """Hidden size and attention heads of a transformers config (BERT-, DistilBERT- and GPT-2-style names)."""
    dim = next(getattr(config, k) for k in ("hidden_size", "dim", "n_embd") if hasattr(config, k))
    heads = next(
        getattr(config, k) for k in ("num_attention_heads", "n_heads", "n_head") if hasattr(config, k)
    )
    return dim, heads


def adam_mini_block(name: str, names) -> str:
    """Adam-mini's block type of a parameter, by the same name rules it applies (lower-cased names)."""
    name = name.lower()
    if "bias" in name:
        return "adam"
    if any(k in name for k in names.wqk_names):
        return "head"
    groups = ("embd_names", "output_names", "wv_names", "mlp_names", "attn_proj_names")
    if any(k in name for g in groups for k in names[g]):
        return "neuron"
    return "block"


def estimate_adam_mini(params, cfg, variant=None, model_config=None) -> StateSize:
    """Adam-mini: m full-size for every parameter; v full-size only for biases; one v per attention head
    for query/key, per output row for embedding/value/MLP/projection, one per tensor otherwise. Bookkeeping
    scalars: `step` (int), `head_per_gpu`/`neuron_per_gpu` (int), `reduced` (bool), `block_numel` (float)."""
    names = cfg.optim.names
    dim, n_heads = attention_dims(model_config)
    parts = []
    for p in params:
        m = (p.numel, p.itemsize)
        kind = adam_mini_block(p.name, names)
        if kind == "adam":
            parts.append(size(m, m, (1, INT64)))
        elif kind == "head":
            heads = p.numel // (dim * dim // n_heads)  # m viewed as (heads, dim * dim / n_heads)
            parts.append(size(m, (heads, p.itemsize), (1, INT64), (1, INT64)))
        elif kind == "neuron":
            parts.append(size(m, (p.shape[0], p.itemsize), (1, INT64), (1, INT64)))
        else:
            parts.append(size(m, (1, p.itemsize), (1, INT64), (1, 1), (1, FP32)))
    return total(parts)


# --- the registry's rows ----------------------------------------------------------------------------------

ENTRIES = [
    OptimizerSpec(  # no Trainer string: always the object
        name="adam_mini",
        build=build_adam_mini,
        estimate=estimate_adam_mini,
        requires=("adam_mini",),
        step_temporaries=(2, 0),
    ),
]
