"""optimizer.step() time of every registered optimizer on one model: `python -m bench.optim_steps MODEL STEPS`.

Each optimizer is built by the registry's direct factory (as the Accelerator backend builds it) from the
config Hydra composes for `optim=<name> model=<MODEL>`, on the same model with the same fixed gradients.
The first step (it creates the state) is reported apart; the median is over the next STEPS steps. Prints one
JSON line per optimizer. Off CUDA, torchao's torch.compile'd step runs eagerly, as in a pipeline job.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_steps(optimizer, steps: int) -> tuple[float, list[float]]:
    """(first step ms, the next `steps` step times in ms)."""
    times = []
    for _ in range(steps + 1):
        sync()
        start = time.perf_counter()
        optimizer.step()
        sync()
        times.append((time.perf_counter() - start) * 1000)
    return times[0], times[1:]


def main(model_name: str, steps: int) -> None:
    import torch
    from hydra import compose, initialize_config_dir

    from pipeline import models, optimizers
    from pipeline.backends import optimizer_step_mode

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        base = compose("config", [f"model={model_name}"])
        torch.manual_seed(0)
        model = models.load_model(base.model, num_labels=2).to(device)
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-2
        num_params = sum(p.numel() for p in model.parameters())
        for name, spec in optimizers.REGISTRY.items():
            row = {"optim": name, "model": model_name, "params": num_params, "device": device}
            missing = optimizers.missing_packages(spec)
            if missing:
                print(json.dumps({**row, "error": f"needs {', '.join(missing)} (extra [optim])"}), flush=True)
                continue
            cfg = compose("config", [f"model={model_name}", f"optim={name}"])
            try:
                optimizer = spec.build(model, cfg)
                if spec.needs_train_eval_mode:
                    optimizer.train()
                with optimizer_step_mode(spec, device):  # as in a job: torchao's step runs eagerly on CPU
                    first, times = time_steps(optimizer, steps)
            except Exception as err:  # one optimizer that cannot run here must not hide the others
                print(json.dumps({**row, "error": f"{type(err).__name__}: {err}"[:200]}), flush=True)
                continue
            row |= {"first_step_ms": first, "step_ms": statistics.median(times)}
            row |= {"min_ms": min(times), "max_ms": max(times), "steps": len(times)}
            print(json.dumps(row), flush=True)
            del optimizer


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
