"""`python -m pipeline.record FOLDER ...`: put into MLflow the outcomes that waited because the store did not
answer when their job ended (pipeline.journal), each into the store, experiment and parent run it was meant
for, and the results whose runner ended before it wrote their outcome down (a result.json with no run holding
it); then close the parent runs of the sweeps that ended meanwhile, and end the runs a process left RUNNING as it
died (pipeline.sweep.close_lost). Running it again records nothing twice."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline import journal, runner, sweep
from pipeline.job import CONFIG_FILE, RESULT_FILE
from pipeline.tracking import Tracker, store_uri


def left_results(folder: Path) -> list[Path]:
    """The job folders under `folder` (itself included) holding a result its job wrote with no journal entry
    beside it: a result whose runner ended before it wrote its outcome down (killed with its job's scheduler
    allocation, or the launching process of a single run killed outright)."""
    return sorted(
        path.parent
        for path in Path(folder).glob(f"**/{RESULT_FILE}")
        if (path.parent / CONFIG_FILE).exists() and not (path.parent / journal.UNRECORDED_FILE).exists()
    )


def record_left_results(folder: Path) -> list[tuple[str, str]]:
    """Record each left result under `folder` whose run holds no outcome (it is RUNNING, or its sweep ended it
    FAILED or KILLED without its job's outcome): (run id, status) of each recorded."""
    from omegaconf import OmegaConf

    done = []
    for job_dir in left_results(folder):
        cfg = OmegaConf.load(job_dir / CONFIG_FILE)
        ids = sweep.sweep_ids(job_dir.parent)
        if ids is None:  # a single run: its store and experiment, no parent
            tracker = Tracker.opened(store_uri(cfg.tracking.uri, cfg.outputs_dir), cfg.outputs_dir)
            ids = {
                "tracking_uri": tracker.uri,
                "experiment_id": tracker.experiment_id(cfg.tracking.experiment),
                "parent_run_id": None,
            }
        recorded = runner.record_left(cfg, ids, job_dir, [], None)
        if recorded is not None:
            done.append(recorded)
    return done


def close_ended_sweeps(folder: Path) -> list[str]:
    """Close the parent run of each sweep under `folder` that ended while its outcomes waited (and none waits
    now), as the sweep itself would have; the parent run ids closed."""
    closed = []
    for path in sorted(folder.glob(f"**/{sweep.SWEEP_FILE}")):  # (the folder itself included)
        ids = sweep.sweep_ids(path.parent)
        if not ids.get("ended") or journal.waiting(path.parent):
            continue
        tracker = Tracker(ids["tracking_uri"], ids["outputs_dir"])
        if tracker.status(ids["parent_run_id"]) == "RUNNING":
            sweep.close(tracker, ids, path.parent, Path(ids["outputs_dir"]), ids["metric"])
            closed.append(ids["parent_run_id"])
    return closed


def close_lost_runs(folder: Path) -> list[str]:
    """End the runs left RUNNING by a process that is gone (sweep.close_lost) in the experiments of the sweeps
    and single runs under `folder`; the run ids ended."""
    from omegaconf import OmegaConf

    experiments = set()
    for path in folder.glob(f"**/{sweep.SWEEP_FILE}"):
        ids = sweep.sweep_ids(path.parent)
        experiments.add((ids["tracking_uri"], ids["outputs_dir"], ids["experiment_id"]))
    singles = set()  # (store, outputs_dir, experiment name) of the single runs' job folders
    for path in folder.glob(f"**/{CONFIG_FILE}"):
        if path.parent.name == ".hydra" or sweep.sweep_ids(path.parent.parent) is not None:
            continue
        cfg = OmegaConf.load(path)
        if OmegaConf.select(cfg, "tracking.experiment") is not None:
            uri = store_uri(cfg.tracking.uri, cfg.outputs_dir)
            singles.add((uri, str(cfg.outputs_dir), cfg.tracking.experiment))
    for uri, outputs_dir, name in singles:
        experiment = Tracker.opened(uri, outputs_dir).client.get_experiment_by_name(name)
        if experiment is not None:
            experiments.add((uri, outputs_dir, experiment.experiment_id))
    closed = []
    for uri, outputs_dir, experiment_id in sorted(experiments):
        closed += sweep.close_lost(Tracker.opened(uri, outputs_dir), experiment_id)
    return closed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.record",
        description="Record the results that were trained while the MLflow store did not answer (they wait in "
        f"{journal.UNRECORDED_FILE} in their job folders), close their sweeps' parent runs, and end the runs "
        "left RUNNING by a process that is gone (KILLED, failure_reason=lost). Idempotent.",
    )
    parser.add_argument(
        "folders",
        nargs="+",
        type=Path,
        metavar="FOLDER",
        help="a sweep folder (outputs/multirun/<time>), a job folder, or outputs/ for everything under it",
    )
    args = parser.parse_args(argv)
    missing = [str(f) for f in args.folders if not f.is_dir()]
    if missing:
        print(
            f"error: not a folder: {', '.join(missing)} (give sweep or job folders, or outputs/)",
            file=sys.stderr,
        )
        return 2
    recorded, closed, lost = 0, 0, 0
    for folder in args.folders:
        done, left, why = journal.record_all(folder)
        if not left:
            try:  # results whose runner ended before it wrote their outcome down
                done += record_left_results(folder)
            except Exception as err:
                left, why = [folder], journal.first_line(err)
        recorded += len(done)
        for run_id, status in done:
            print(f"[record] run {run_id} recorded ({status})")
        if left:
            print(
                f"error: {len(left)} results still wait under {folder}: the store does not answer ({why}); "
                "nothing is lost, run this again once it is back",
                file=sys.stderr,
            )
            return 1
        try:
            closed += len(close_ended_sweeps(folder))
            ended = close_lost_runs(folder)
        except Exception as err:  # the store went away again between the two
            print(
                f"error: a run could not be closed ({journal.first_line(err)})",
                file=sys.stderr,
            )
            return 1
        lost += len(ended)
        for run_id in ended:
            print(f"[record] run {run_id} ended KILLED ({sweep.LOST}: its process is gone)")
    if not recorded and not closed and not lost:
        print(f"[record] nothing waits to be recorded under {', '.join(map(str, args.folders))}")
    else:
        print(
            f"[record] {recorded} results recorded, {closed} sweeps closed"
            + (f", {lost} runs left RUNNING by a process that is gone ended KILLED" if lost else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
