"""`python -m pipeline [-m] key=value ...`: Hydra entry point; each job goes to pipeline.runner, the sweep's
summary and exit code come from pipeline.sweep."""

import signal
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from pipeline import runner, sweep
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
    outcome = runner.run(cfg, sweep.current_ids())
    sweep.RESULT.add(outcome)
    return outcome.score  # the validation metric (val_<eval.metric>): what a Hydra sweeper optimises


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
        sweep.mark_killed()  # what a parallel worker, torn down with the sweep, could not mark itself
        print(f"\n[sweep] interrupted ({err or 'Ctrl-C'}): the running job and the sweep are marked KILLED")
        sys.exit(130)
    sys.exit(sweep.RESULT.finish())
