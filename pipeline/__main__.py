"""`python -m pipeline [-m] key=value ...`: Hydra entry point; each job goes to pipeline.runner."""

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from pipeline.config import ConfigError, validate


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    if HydraConfig.get().mode == RunMode.RUN:
        # a single run fails fast on bad input; in a sweep, a bad point becomes a FAILED run and the rest go on
        try:
            validate(cfg)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
    from pipeline import runner

    return runner.run(cfg)


if __name__ == "__main__":
    main()
    from pipeline.runner import FAILED_JOBS

    if FAILED_JOBS:
        sys.exit(1)
