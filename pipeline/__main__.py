"""`python -m pipeline [-m] key=value ...`: Hydra entry point; each job goes to pipeline.runner."""

import signal
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from pipeline.config import ConfigError, check_group_overrides, validate


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


def interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


if __name__ == "__main__":
    try:
        check_group_overrides(sys.argv[1:])
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    # SIGTERM (a scheduler, `kill`) stops the sweep like Ctrl-C: the running job is killed, runs marked KILLED
    signal.signal(signal.SIGTERM, interrupted)
    try:
        main()
    except KeyboardInterrupt as err:
        from pipeline.tracking import mark_sweep_killed

        mark_sweep_killed()  # what a parallel worker, torn down with the sweep, could not mark itself
        print(f"\n[sweep] interrupted ({err or 'Ctrl-C'}): the running job and the sweep are marked KILLED")
        sys.exit(130)
    from pipeline.runner import FAILED_JOBS, SKIPPED_JOBS

    if SKIPPED_JOBS:
        print(f"[sweep] {len(SKIPPED_JOBS)} skipped (FINISHED before; force=true reruns them)")
    if FAILED_JOBS:
        print(f"[sweep] {len(FAILED_JOBS)} failed: " + "; ".join(FAILED_JOBS), file=sys.stderr)
        sys.exit(1)
