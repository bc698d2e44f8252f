"""The route of a job's config: which of the pipeline's modules a job's code passes through, in what order, and
how often it climbs back into a module it already went through.

`python -m bench.route` runs a tiny job (model=tiny, 64 training and 32 eval samples, 3 steps, on CPU) twice, each
in a process of its own as the sweep runs it (`pipeline.job.run(cfg, job_dir)`, in that process, under
`sys.setprofile`), against a fresh cache folder ($PIPELINE_CACHE_DIR): cold (nothing kept yet: the splits are read
and written, the step simulated) and warm (both read back). It prints, for each: the route, its number of module
entries, of modules and of climbs back, and each climb with the call that makes it. `--json` prints the same as
JSON.

What is counted (`trace` records, `Route` counts):

- A call: a Python function of the pipeline (its code file under pipeline/) called by `job.run` or by a call
  that is itself one (our code calling our code, all the way down from `job.run`). A call that a library makes
  into our code (a Trainer callback, a torch hook, the collator, the function `datasets.map` runs) and what it
  calls is the library's loop, not the config's route: it is left out (`library_calls` counts the calls a
  library made straight into our code, import-time ones included). Module bodies run by an import are left out
  likewise (the import machinery calls them). A comprehension's,
  generator expression's or generator's frame is an expression of the code that runs it: its resumptions are
  iteration, not calls, and what it calls counts as called by the frame that runs it.
- The module of a call: its file, relative to pipeline/ (`data.py`, `optimizers/spec.py`).
- The route: the modules of the calls in the order they are made, consecutive calls in the same module collapsed
  into one stay. Module entries: the number of stays. Modules: the number of distinct modules on the route.
- A visit: a module's frames on the call stack one above the other, from the call that entered the module from
  another one (or `job.run`) up. A call into another module makes a new visit; its caller's visit is its host.
- A climb back: a stay whose first call enters a module M from another module's visit (the host) where
  (a) M still runs below the host, on the call stack (a callback into a caller module: the cache's `get`
  calling the function that computes its entry, a module handed a function of its caller's), or
  (b) the host already entered M and left it (the host goes back to M to finish what it began: read, stamp,
  look up, load, then write). A stay that resumes its own module (a call made by a frame of the same module,
  once a callback it made has returned) is an entry, not a climb back.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = str(ROOT / "pipeline") + os.sep
# the tiny job of the test suite (tests/conftest.py's TINY)
TINY = ["model=tiny", "data.max_train_samples=64", "data.max_eval_samples=32", "train.max_steps=3"]
EXPRESSIONS = {"<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>"}
LAZY = 0x20 | 0x80 | 0x200  # CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR


@dataclass
class Call:
    module: str  # file relative to pipeline/
    function: str
    caller: str | None  # the calling frame's module (None: job.run itself)
    climb: str | None = None  # why this call climbs back (see the module docstring), when it starts a stay


@dataclass
class Route:
    calls: list[Call]
    library_calls: int = 0  # calls a library made into our code (left out of the route)
    stays: list[list[Call]] = field(init=False)

    def __post_init__(self):
        self.stays = []
        for call in self.calls:
            if self.stays and self.stays[-1][0].module == call.module:
                self.stays[-1].append(call)
            else:
                self.stays.append([call])

    @property
    def modules(self) -> list[str]:
        return [stay[0].module for stay in self.stays]

    @property
    def climbs(self) -> list[Call]:
        return [stay[0] for stay in self.stays if stay[0].climb]

    def summary(self) -> dict:
        return {
            "module_entries": len(self.stays),
            "modules": len(set(self.modules)),
            "climbs_back": len(self.climbs),
            "route": [
                f"{stay[0].module}: {', '.join(dict.fromkeys(c.function for c in stay))}"
                for stay in self.stays
            ],
            "climbs": [
                {"from": c.caller, "into": c.module, "call": c.function, "why": c.climb} for c in self.climbs
            ],
            "library_calls": self.library_calls,
        }


class _Visit:
    """A module's frames one above the other on the stack: the modules it entered, the visit below it."""

    def __init__(self, module: str, below: _Visit | None):
        self.module, self.below, self.entered = module, below, set()

    def running_below(self, module: str) -> bool:
        visit = self.below
        while visit is not None:
            if visit.module == module:
                return True
            visit = visit.below
        return False


def trace(cfg, job_dir: Path) -> Route:
    """`pipeline.job.run(cfg, job_dir)` in this process under sys.setprofile: its calls (module docstring)."""
    from pipeline import job

    run_code = job.run.__code__
    frames: dict[int, _Visit] = {}  # id(frame) -> its visit, for the frames on the route still running
    calls: list[Call] = []
    library = [0]

    def profile(frame, event, arg):
        if event == "return":
            frames.pop(id(frame), None)
            return
        if event != "call":
            return
        code = frame.f_code
        if code is run_code:
            visit = _Visit("job.py", None)
            frames[id(frame)] = visit
            calls.append(Call("job.py", code.co_name, None))
            return
        if not code.co_filename.startswith(PACKAGE):
            return
        host = frames.get(id(frame.f_back))
        if host is None:  # called by a library (or an import): not on the route
            library[0] += frame.f_back is not None and not frame.f_back.f_code.co_filename.startswith(PACKAGE)
            return
        if code.co_name in EXPRESSIONS or code.co_flags & LAZY:  # iteration, run by the frame that runs it
            frames[id(frame)] = host
            return
        module = code.co_filename[len(PACKAGE) :]
        call = Call(module, code.co_name, host.module)
        if module == host.module:
            frames[id(frame)] = host
        else:
            new_stay = calls[-1].module != module
            if new_stay and host.running_below(module):
                call.climb = "a callback into a module running below"
            elif new_stay and module in host.entered:
                call.climb = f"back into a module this {host.module} visit left"
            host.entered.add(module)
            frames[id(frame)] = _Visit(module, host)
        calls.append(call)

    sys.setprofile(profile)
    try:
        job.run(cfg, job_dir)
    finally:
        sys.setprofile(None)
    return Route(calls, library[0])


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose("config", overrides=overrides)


def one(outputs_dir: Path) -> dict:
    """The tiny job traced in this process, its outputs in `outputs_dir` (the cache where the environment says)."""
    from pipeline import quiet

    quiet.install()  # as pipeline.job.main does first
    cfg = compose([*TINY, f"outputs_dir={outputs_dir}"])
    job_dir = outputs_dir / "job"
    job_dir.mkdir(parents=True, exist_ok=True)
    return trace(cfg, job_dir).summary()


def measure(work: Path) -> dict[str, dict]:
    """The tiny job traced twice, each in a process of its own (as a sweep's jobs), against one fresh cache
    folder under `work`: {"cold": summary, "warm": summary}."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env |= {"PIPELINE_CACHE_DIR": str(work / "cache"), "CUDA_VISIBLE_DEVICES": ""}
    env |= {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = {}
    for run in ("cold", "warm"):
        result = work / f"{run}.json"
        done = subprocess.run(
            [sys.executable, "-m", "bench.route", "--one", str(work / run), str(result)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        if done.returncode:
            raise RuntimeError(f"the {run} job failed:\n{done.stderr[-3000:]}")
        out[run] = json.loads(result.read_text())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the summaries as JSON")
    parser.add_argument("--one", nargs=2, metavar=("OUTPUTS_DIR", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        summary = one(Path(args.one[0]))
        Path(args.one[1]).write_text(json.dumps(summary, indent=1))
        return
    with tempfile.TemporaryDirectory(prefix="route-") as work:
        found = measure(Path(work))
    if args.json:
        print(json.dumps(found, indent=1))
        return
    for run, s in found.items():
        print(f"{run} cache: {s['module_entries']} module entries, {s['modules']} modules, "
              f"{s['climbs_back']} climbs back ({s['library_calls']} calls from libraries left out)")  # fmt: skip
        for i, stay in enumerate(s["route"], 1):
            print(f"  {i:3d} {stay}")
        for c in s["climbs"]:
            print(f"  climb back: {c['from']} -> {c['into']} ({c['call']}): {c['why']}")


if __name__ == "__main__":
    main()
