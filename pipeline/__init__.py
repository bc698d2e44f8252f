"""Experiment-sweep pipeline that measures what each optimizer really costs."""

from dataclasses import dataclass

from omegaconf import OmegaConf

MB = 1024**2  # every "MB" the pipeline records is 2^20 bytes


@dataclass(frozen=True)
class StateSize:
    """Size of an optimizer's state: elements and bytes."""

    numel: int
    bytes: int

    @property
    def mb(self) -> float:
        return self.bytes / MB


def learning_rate(cfg) -> float:
    """The peak learning rate a job trains with: `train.lr` (by default the job's reference rate,
    reference_lr) times `train.lr_scale`, to 12 significant digits (5e-5 x 3.16 is 0.000158, not the float
    product's 0.00015800000000000002, in params, logs and the report)."""
    return float(f"{cfg.train.lr * cfg.train.get('lr_scale', 1.0):.12g}")


def reference_lr(lr: float, *, _root_) -> float:
    """train.lr's default: the optimizer's reference rate `lr` (optim.lr, tuned on the pretrained MiniLM); for a
    language model with random weights (task=causal_lm, model.pretrained=false) that times
    task.random_weights_lr_scale, at which such a model learns within a short run. An optimizer that estimates
    its own step size (Prodigy) keeps its rate."""
    from pipeline.optimizers import REGISTRY

    spec = REGISTRY.get(OmegaConf.select(_root_, "optim.name", default=""))
    scale = 1.0
    if not OmegaConf.select(_root_, "model.pretrained", default=True) and not (
        spec and spec.estimates_step_size
    ):
        scale = OmegaConf.select(_root_, "task.random_weights_lr_scale", default=1.0)
    return float(f"{lr * scale:.12g}")


# task=causal_lm: what becomes of the data's label column (each run's tag `labels`, and a sweep's console once)
LABELS_IGNORED = "ignored: task=causal_lm trains on the text column alone, the next tokens its labels"

# a language model whose final loss (eval, else training) is at least this share of a uniform guess's, ln(vocabulary
# size), hardly learned: its run is tagged hardly_learned=true (metric loss_vs_uniform), the report marks its row
HARDLY_LEARNED = 0.8

# what optim=custom builds when neither custom_optim nor optim.target is set
CUSTOM_DEFAULT = "torch.optim.AdamW"


def custom_optim(part: str, *, _root_) -> str:
    """conf/optim/custom.yaml's `name` and `target` from the top-level key `custom_optim` (module.Class, so
    that `-m optim=adamw,custom custom_optim=torch.optim.NAdam` puts any class beside registered optimizers in
    one command): its name is the class's (its runs, rows and lines carry it) and its target the class; unset
    (null), `custom` and torch.optim.AdamW."""
    path = _root_.get("custom_optim")
    if part == "name":
        return "custom" if path is None else str(path).rsplit(".", 1)[-1]
    return CUSTOM_DEFAULT if path is None else str(path)


OmegaConf.register_new_resolver("custom_optim", custom_optim, replace=True)
OmegaConf.register_new_resolver("reference_lr", reference_lr, replace=True)


def __getattr__(name: str):
    """`pipeline.plan(overrides)` and `pipeline.runs(sweep)`, the pipeline from Python (pipeline.notebook),
    imported when first asked for."""
    if name in ("plan", "runs"):
        from pipeline import notebook

        return getattr(notebook, name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
