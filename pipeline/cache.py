"""Work done once per sweep, not once per job: results kept on disk under `<outputs_dir>/cache/<kind>/`, each
under a key made of everything that determines it: the inputs, the library versions and the pipeline's own
source, so that an entry made by other code or from other inputs is never found, and is computed anew.

What is kept (docs/sweeps.md): `splits/` the data splits tokenized (datasets' Arrow files), `plan/` the simulated
step behind a job's `predicted_peak_mb`; beside them `torchinductor/` (compiled optimizer steps) and
`cpu_peak_flops.json`. $PIPELINE_CACHE_DIR puts them elsewhere (keys never collide).
`rm -rf outputs/cache` clears it all; nothing is lost but time.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


@functools.cache
def code_digest() -> str:
    """A digest of the pipeline's own source: an entry made by other code is never reused."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        digest.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


@functools.cache
def source_digest(*parts: str) -> str:
    """A digest of some of the pipeline's source: the modules and folders `parts` (relative to the package,
    `plan.py`, `optimizers`), for an entry that only that code can change."""
    digest = hashlib.sha256()
    for part in parts:
        found = PACKAGE / part
        for path in sorted(found.rglob("*.py")) if found.is_dir() else [found]:
            digest.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def key(*inputs, code: str | None = None) -> str:
    """The name of the entry for these inputs (anything JSON can write) under this code: `code`, a digest of
    the source the entry depends on (source_digest), else the whole package's."""
    text = json.dumps([code or code_digest(), *inputs], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


ROOT_ENV = "PIPELINE_CACHE_DIR"  # one cache for several outputs folders (the test suite's sweeps share one)


def root(outputs_dir) -> Path:
    """Where the caches live: <outputs_dir>/cache, or $PIPELINE_CACHE_DIR when it is set."""
    return Path(os.environ.get(ROOT_ENV) or Path(outputs_dir) / "cache").resolve()


def folder(outputs_dir, kind: str) -> Path:
    return root(outputs_dir) / kind


def file_stamp(path) -> list:
    """What tells a file (or every file of a folder) apart from an edited one: path, size, modification time."""
    path = Path(path).resolve()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [[str(p), (s := p.stat()).st_size, s.st_mtime_ns] for p in files]


def read_json(path: Path):
    """The entry at `path`, or None when there is none (or it cannot be read: it is made again)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path, value) -> None:
    """Write an entry whole or not at all (parallel jobs may write the same one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def cached_dataset(
    folder: Path, inputs: list, build, manifest: str = "manifest.json", files=()
) -> tuple[dict, dict]:
    """Datasets made once and memory-mapped from then on: `build()` returns ({name: datasets.Dataset or None},
    a JSON value said of them), kept as datasets' Arrow files in `folder`/<key> beside that value (the file
    `manifest`), the key made of `inputs`, the `files` read (file_stamp: an edited file is read again), the
    datasets version and the pipeline's code. The answer, read from
    there whether just made or found: ({name: Dataset}, the value). A folder appears whole or not at all
    (written aside, then renamed: a parallel job that kept the same datasets first wins) and its writing draws
    no progress bar of its own on the console. `files` None: nothing to stamp, so nothing is kept (`build()`'s
    answer as it is)."""
    import datasets

    if files is None:
        return build()

    where = Path(folder) / key(*inputs, [file_stamp(f) for f in files], datasets.__version__)
    if not (where / manifest).exists():
        parts, said = build()
        tmp = where.with_name(f".{where.name}.{os.getpid()}")
        shown = not datasets.utils.are_progress_bars_disabled()
        datasets.disable_progress_bars()
        try:
            datasets.DatasetDict({k: v for k, v in parts.items() if v is not None}).save_to_disk(str(tmp))
        finally:
            if shown:
                datasets.enable_progress_bars()
        write_json(tmp / manifest, said)
        try:
            tmp.rename(where)
        except OSError:  # another job kept the same datasets first
            shutil.rmtree(tmp, ignore_errors=True)
    return datasets.load_from_disk(str(where)), read_json(where / manifest)


class Store:
    """Entries of one kind in `folder`, each a JSON value keyed by its inputs and `context` (what every entry
    depends on besides: library versions), under the code `sources` names (source_digest; None: the whole
    package)."""

    def __init__(self, folder: Path, *context, sources: tuple[str, ...] | None = None):
        self.folder, self.context = Path(folder), context
        self.code = source_digest(*sources) if sources else None

    def _path(self, inputs: list) -> Path:
        return self.folder / f"{key(*self.context, *inputs, code=self.code)}.json"

    def find(self, inputs: list):
        """The entry for `inputs`, or None where there is none."""
        return read_json(self._path(inputs))

    def put(self, inputs: list, value) -> None:
        write_json(self._path(inputs), value)

    def get(self, inputs: list, compute):
        """The entry for `inputs`: read back, or `compute()`d (JSON-able) and kept."""
        value = self.find(inputs)
        if value is None:
            value = compute()
            self.put(inputs, value)
        return value
