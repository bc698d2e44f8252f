"""Experiment-sweep pipeline that measures what each optimizer really costs."""

from dataclasses import dataclass

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
    """The peak learning rate a job trains with: `train.lr` (by default the optimizer's reference rate,
    `optim.lr`) times `train.lr_scale`, to 12 significant digits (5e-5 x 3.16 is 0.000158, not the float
    product's 0.00015800000000000002, in params, logs and the report)."""
    return float(f"{cfg.train.lr * cfg.train.get('lr_scale', 1.0):.12g}")
