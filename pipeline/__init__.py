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
