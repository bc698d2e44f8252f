"""`python -m bench [--full]`: the pipeline's own cost, measured side by side, written to bench/RESULTS.md.

(a) steady-state step time of a pipeline job (both backends) against a bare PyTorch loop (bench/bare_loop.py)
(b) fixed overhead of one job (all but its training and evaluation) against the import floor
    `python -c "import torch, transformers, mlflow"`, also with the job starter kept from the command before, and
    of a job inside a sweep (seconds)
(c) time in MLflow calls as a share of the job's wall time
(d) time from command to error for bad input
(e) throughput of 4 tiny jobs, 2 at a time against one at a time
(f) optimizer.step() time of every registered optimizer (bench/optim_steps.py)
(g) wall time per job of an 8-job tiny sweep of one step each, jobs started warm and cold, against the import floor:
    the whole command, its job starter's start included, with no job starter of the bench's alive before it
(h) host-device synchronisations per training step of a job (both backends) and of the bare loop (bench/bare_loop.py)

Every figure is a ratio of things measured in the same run, interleaved, so machine drift cancels; each is a
median over repeats with min and max. Work files and logs go to outputs/bench/<time>/. `--only g` measures (g)
alone (its import floors, its first run and its repeats) and prints it, leaving RESULTS.md as it is. `--smoke` runs
every row's code once, on the tiny model at the fewest steps and jobs that give each figure (rows.SMOKE), and
writes the page into its work folder (or --out): a check of the bench itself, whose figures mean little.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

from bench.results import sweep_lines, work_s, write_results
from bench.rows import (
    BAD_INPUTS,
    FULL,
    QUICK,
    ROOT,
    SMOKE,
    Settings,
    bad_input,
    bare_config,
    bare_loop,
    host_syncs,
    import_floor,
    optimizer_steps,
    parallel_sweeps,
    pipeline_job,
    step_repeat,
    steps_settled,
    sweep_first,
    sweep_overheads,
    sweep_repeat,
)

MEASUREMENTS = "measurements.json"  # in the work folder: everything the page is written from


def main() -> None:
    parser = argparse.ArgumentParser(description="The pipeline's own cost (make bench / make bench-full).")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_true", help="more repeats, bigger batch, more steps")
    size.add_argument(
        "--smoke",
        action="store_true",
        help="every row once, tiny and short: a check of the bench's code (the page goes to the work folder)",
    )
    parser.add_argument(
        "--out", type=Path, help="the page (default: bench/RESULTS.md; --smoke: the work folder's)"
    )
    parser.add_argument("--work", type=Path, help="work files and logs (default: outputs/bench/<time>/)")
    parser.add_argument(
        "--render",
        type=Path,
        metavar="WORK",
        help="write --out again from a run's work folder, measuring nothing",
    )
    parser.add_argument(
        "--only",
        choices=["g"],
        help="measure this row alone (its import floors, first run and repeats) and print it; RESULTS.md is "
        "left as it is",
    )
    args = parser.parse_args()
    out = args.out or ROOT / "bench" / "RESULTS.md"
    if args.render:
        kept = json.loads((args.render / MEASUREMENTS).read_text())
        started, s = datetime.fromisoformat(kept["started"]), Settings(**kept["settings"])
        write_results(out, s, kept["command"], kept["r"], started, kept["took"], args.render.resolve())
        print(out.read_text())
        return
    s = FULL if args.full else SMOKE if args.smoke else QUICK
    started = datetime.now()
    work = (args.work or ROOT / "outputs" / "bench" / f"{started:%Y-%m-%d_%H-%M-%S}").resolve()
    work.mkdir(parents=True)
    if args.smoke and not args.out:
        out = work / "RESULTS.md"

    def say(text: str) -> None:
        print(f"[bench {(datetime.now() - started).total_seconds():4.0f} s] {text}", flush=True)

    say(f"work files in {work}")
    if args.only == "g":
        r = {"floors": [], "floor_readings": s.floor_readings, "sweep8": {"warm": [], "cold": []}}
        r["sweep8_first"], r["sweep8_starters"] = sweep_first(s, work, say), {}
        for rep in range(s.repeats):
            say(f"repeat {rep + 1}/{s.repeats}: import floor, the {s.sweep_jobs}-job sweeps")
            r["floors"].append(import_floor(work, s.floor_readings))
            sweep_repeat(s, r, rep, work, say)
        (work / MEASUREMENTS).write_text(
            json.dumps({"r": r, "settings": asdict(s), "only": "g"}, default=str)
        )
        print("\n".join(sweep_lines(s, r)))
        return
    # not measured: creates the MLflow store and the CPU peak-FLOP/s cache, warms the file cache
    pipeline_job(Settings(**{**asdict(s), "steps": 3}), "trainer", 10_000, work)
    r = {"floors": [], "jobs": {"trainer": [], "accelerator": []}, "bare": [], "tracked": []}
    r["floor_readings"] = s.floor_readings
    r["sweep8"] = {"warm": [], "cold": []}
    r["sweep8_first"], r["sweep8_starters"] = sweep_first(s, work, say), {}
    r["in_sweep"] = {"trainer": [], "accelerator": []}
    r["kept"] = {"trainer": [], "accelerator": []}
    r["kept_train"] = {"trainer": [], "accelerator": []}
    # (a)'s step times (ms), one per repeat: the bare loop before the jobs, the jobs, the bare loop after them
    r["steps"] = steps = {"bare_before": [], "trainer": [], "accelerator": [], "bare": []}
    config = bare_config(s, work)
    for rep in range(s.repeats):
        say(f"repeat {rep + 1}/{s.repeats}: import floor, pipeline jobs, bare loops")
        r["floors"].append(import_floor(work, s.floor_readings))
        steps["bare_before"].append(bare_loop(config, work, f"bare-before-{rep}")["train_step_ms"])
        # not measured: starts the starter that the kept rows of (b) find running (it ends KEEP_S after the last,
        # or as (g) begins: each (g) command starts with none of the bench's alive)
        pipeline_job(Settings(**{**asdict(s), "steps": 3}), "trainer", 10_001 + rep, work, kept=True)
        for backend in ("trainer", "accelerator")[:: 1 if rep % 2 == 0 else -1]:
            r["jobs"][backend].append(pipeline_job(s, backend, rep, work))
            kept = pipeline_job(s, backend, 100 + rep, work, kept=True)
            # less the training loop of the job before (the same shapes), not its own: its own trains beside the
            # CLI's MLflow import, slower where cores are few (counting that as training would flatter the row)
            r["kept"][backend].append(kept["wall"] - work_s(r["jobs"][backend][-1]))
            r["kept_train"][backend].append(kept["train_runtime_s"])
            r["in_sweep"][backend].append(statistics.median(sweep_overheads(s, backend, rep, work)))
        r["bare"].append(bare_loop(config, work, f"bare-{rep}"))
        for key, found in (
            *((b, r["jobs"][b][-1]) for b in ("trainer", "accelerator")),
            ("bare", r["bare"][-1]),
        ):
            steps[key].append(found["train_step_ms"])
        r["tracked"].append(bare_loop(config, work, f"bare-tracked-{rep}", peak_tracker=True))
        sweep_repeat(s, r, rep, work, say)
        say(
            f"  step ms: trainer {r['jobs']['trainer'][-1]['train_step_ms']:.1f}, accelerator "
            f"{r['jobs']['accelerator'][-1]['train_step_ms']:.1f}, bare {r['bare'][-1]['train_step_ms']:.1f}"
        )
    started_steps = time.monotonic()
    while len(steps["bare"]) < s.step_repeats and not steps_settled(steps, s.step_noise_pct):
        if time.monotonic() - started_steps > s.step_cap_s:
            say(
                f"(a): {len(steps['bare'])} repeats, {s.step_cap_s:.0f} s of more repeats: stopped short of ±{s.step_noise_pct:g}%"
            )
            break
        say(
            f"(a) repeat {len(steps['bare']) + 1}: a ratio's 95% interval is wider than ±{s.step_noise_pct:g}%"
        )
        for key, ms in step_repeat(s, config, len(steps["bare"]), work).items():
            steps[key].append(ms)
    say("bad input")
    r["bad"] = {
        case: [bad_input(a, work) for _ in range(s.bad_input_repeats)] for case, a in BAD_INPUTS.items()
    }
    say("4 tiny jobs, one at a time, then 2 at a time")
    r["sweep"] = parallel_sweeps(s, work)
    say("optimizer step times")
    r["optim"] = optimizer_steps(s, work)
    say("host-device syncs per training step")
    r["syncs"] = host_syncs(work)
    command = "make bench-full" if args.full else "python -m bench --smoke" if args.smoke else "make bench"
    took = (datetime.now() - started).total_seconds()
    # kept before the page is written: `--render WORK` writes it again without measuring
    kept = {"r": r, "settings": asdict(s), "command": command, "started": started.isoformat(), "took": took}
    (work / MEASUREMENTS).write_text(json.dumps(kept, default=str))
    write_results(out, s, command, r, started, took, work)
    say(f"wrote {out}")
    print(out.read_text())


if __name__ == "__main__":
    main()
