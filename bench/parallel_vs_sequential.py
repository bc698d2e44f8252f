"""Wall time of 4 tiny jobs run 2 at a time (launcher=parallel) against one after another, same results.

    .venv/bin/python bench/parallel_vs_sequential.py [--steps 20] [--n-jobs 2] [--out bench/results]

Prints both wall times and their ratio, checks that both sweeps logged the same loss series and state sizes,
and writes the figures to OUT/parallel_vs_sequential.json.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlflow import MlflowClient

ROOT = Path(__file__).resolve().parents[1]
POINTS = ["-m", "optim=adamw,adafactor", "seed=0,1", "model=tiny", "data.max_train_samples=256"]
POINTS += ["data.max_eval_samples=64"]


def sweep(folder: Path, steps: int, *launcher: str) -> tuple[float, dict]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    cmd = [sys.executable, "-m", "pipeline", *POINTS, f"train.max_steps={steps}", *launcher]
    start = time.perf_counter()
    subprocess.run([*cmd, f"outputs_dir={folder}"], cwd=ROOT, env=env, check=True, capture_output=True)
    wall = time.perf_counter() - start
    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()], "tags.config_hash != ''"
    )
    results = {
        r.info.run_name: {
            "train_loss": [m.value for m in client.get_metric_history(r.info.run_id, "train_loss")],
            "optimizer_state_bytes": r.data.metrics["optimizer_state_bytes"],
        }
        for r in runs
    }
    return wall, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--n-jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sequential, seq = sweep(Path(tmp) / "sequential", args.steps)
        parallel, par = sweep(
            Path(tmp) / "parallel", args.steps, "launcher=parallel", f"launcher.n_jobs={args.n_jobs}"
        )
    same = sorted(seq) == sorted(par) and all(
        seq[k]["optimizer_state_bytes"] == par[k]["optimizer_state_bytes"]
        and all(
            abs(a - b) <= 1e-5 * abs(a)
            for a, b in zip(seq[k]["train_loss"], par[k]["train_loss"], strict=True)
        )
        for k in seq
    )
    figures = {
        "jobs": len(seq),
        "n_jobs": args.n_jobs,
        "steps": args.steps,
        "cores": len(os.sched_getaffinity(0)),
        "sequential_s": round(sequential, 1),
        "parallel_s": round(parallel, 1),
        "speedup": round(sequential / parallel, 2),
        "same_results": same,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "parallel_vs_sequential.json").write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures))
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
