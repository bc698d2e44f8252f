"""A training run's checkpoints, and its stop at a step boundary when the job is asked to stop (SIGTERM: a
scheduler preempting it, `kill`, the sweep stopped; SIGUSR2: SLURM's warning before the time limit).

A job's checkpoints live in the folder of its point (<outputs_dir>/checkpoints/<config hash>, which the runner
hands the job process in PIPELINE_CHECKPOINTS), one subfolder per checkpoint, `step-<N>`, of which the last
KEEP stay. Each is written into a hidden folder beside them and renamed into place once whole: a process
killed while writing leaves the checkpoints before it as they were, and its half-written folder is ignored
(and removed by the next save). What a backend writes into it is its own (the Trainer's checkpoint folder;
the Accelerate loop's `state.pt`); beside it `pipeline.json` holds what the job's record needs of the steps
before: their losses, their batches' tokens, the validation series, each segment's peak and time, and what
the checkpoints cost. The point's rerun resumes from the latest one; its folder goes once the run finished.

`train.checkpoint_every`: N (every N optimizer steps), `Nmin` (every N minutes of training, the default
10min: a run shorter than that writes none unless stopped), or `none`. With SIGTERM, a job writes one at the
end of the step it is in (unless `none`), then stops (Preempted).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

ENV = "PIPELINE_CHECKPOINTS"
KEEP = 2
META = "pipeline.json"
EVERY = re.compile(r"^(\d+)\s*min$")
_asked: list[int] = []  # the stop signals this process received


class Preempted(Exception):
    """Training stopped at the end of `step` because the job was asked to stop; `saved`: its checkpoint (None:
    checkpoints are off). `losses` and `val_series`: what the steps so far recorded."""

    def __init__(self, step: int, saved: Path | None, losses: list[float], val_series: dict):
        where = f"checkpoint {saved}" if saved else "no checkpoint (train.checkpoint_every=none)"
        by = signal.Signals(_asked[0]).name if _asked else "a stop signal"
        super().__init__(f"stopped by {by} at the end of step {step}: {where}")
        self.step, self.saved, self.losses, self.val_series = step, saved, losses, val_series


def listen() -> None:
    """In the job process: SIGTERM, or SLURM's warning before the time limit (SIGUSR2, submitit's), asks the
    training to stop at the end of its current step."""
    for stop in (signal.SIGTERM, signal.SIGUSR2):
        signal.signal(stop, lambda signum, frame: _asked.append(signum))


def stop_asked() -> bool:
    return bool(_asked)


def parse_every(value) -> tuple[str, float] | None:
    """train.checkpoint_every as ("steps", N) or ("minutes", N); None: off. ValueError for anything else."""
    if value in (None, "none", 0):
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return "steps", value
    found = EVERY.match(str(value))
    if found and int(found[1]) > 0:
        return "minutes", int(found[1])
    raise ValueError(value)


def valid_every(value) -> bool:
    try:
        parse_every(value)
    except ValueError:
        return False
    return True


class Checkpoints:
    """The checkpoints of one job's training (one process; a job of several ranks writes none): when one is
    due, the latest one to resume from, and writing one."""

    def __init__(self, folder: Path | None, every: tuple[str, float] | None = None):
        self.folder, self.every = folder, every
        self.since = time.monotonic()
        self.meta: dict = {}  # the latest checkpoint's pipeline.json, once read or written
        self.earlier: list[dict] = []  # the segments of training before this process's (read with `latest`)

    @classmethod
    def of_job(cls, cfg, in_backward: bool = False) -> Checkpoints:
        """The checkpoints of this job process (PIPELINE_CHECKPOINTS): none for a job of several ranks, nor for
        an optimizer that steps inside backward."""
        folder = os.environ.get(ENV)
        one = int(os.environ.get("WORLD_SIZE", "1")) == 1 and not in_backward
        return cls(Path(folder) if folder and one else None, parse_every(cfg.train.get("checkpoint_every")))

    def due(self, step: int) -> bool:
        """Whether a checkpoint is written at the end of `step`: every N steps, every N minutes, or when asked
        to stop."""
        if self.folder is None or self.every is None:
            return False
        if stop_asked():
            return True
        kind, n = self.every
        return step % n == 0 if kind == "steps" else time.monotonic() - self.since >= 60 * n

    def latest(self) -> Path | None:
        """The latest whole checkpoint (its pipeline.json read into `meta`), or None."""
        if self.folder is None or not self.folder.is_dir():
            return None
        found = sorted(self.folder.glob("step-*"))
        if not found:
            return None
        self.meta = json.loads((found[-1] / META).read_text())
        self.earlier = self.meta["segments"]
        return found[-1]

    def save(self, step: int, write, meta: dict) -> Path:
        """Checkpoint `step`: write(folder) fills a new folder, `meta` goes beside it, and the folder is renamed
        into place whole; the oldest beyond KEEP go. Its time and size add to meta's `checkpoints`."""
        start = time.perf_counter()
        self.folder.mkdir(parents=True, exist_ok=True)
        for left in self.folder.glob(".writing-*"):  # a write a killed process left half done
            shutil.rmtree(left, ignore_errors=True)
        tmp = self.folder / f".writing-{step}-{os.getpid()}"
        tmp.mkdir()
        write(tmp)
        size = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
        done = self.meta.get("checkpoints", {"count": 0, "seconds": 0.0, "mb": 0.0})
        took = time.perf_counter() - start
        meta = {**meta, "step": step, "checkpoints": {
            "count": done["count"] + 1, "seconds": done["seconds"] + took, "mb": size / 2**20,
        }}  # fmt: skip
        (tmp / META).write_text(json.dumps(meta))
        final = self.folder / f"step-{step:08d}"
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in sorted(self.folder.glob("step-*"))[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
        self.meta, self.since = meta, time.monotonic()
        return final

    def segments(self, peak_mb: float, runtime_s: float, first: int, last: int) -> list[dict]:
        """The segments of training so far: those before the latest checkpoint, and this one (steps `first` to
        `last`, its peak and its time)."""
        seg = {
            "first_step": first,
            "last_step": last,
            "peak_memory_mb": peak_mb,
            "train_runtime_s": runtime_s,
        }
        return [*self.earlier, seg]

    def finished(self) -> None:
        """The run finished: its checkpoints go."""
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def rng_states() -> dict:
    """Every random stream a training step draws from (dropout, the samplers' seeds)."""
    import random

    import numpy as np
    import torch

    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    import random

    import numpy as np
    import torch

    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
