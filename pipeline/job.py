"""One job in its own process: data, model, optimizer -> train -> evaluate -> measure -> result.json.

Run by the sweep runner as `python -m pipeline.job JOB_DIR` (JOB_DIR/config.yaml holds the resolved
config), so no job's peak-memory counters, caches or global state can leak into the next one. The result
goes to JOB_DIR/result.json and, on an exception, the traceback to JOB_DIR/error.txt; MLflow is left to
the runner.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

RESULT_FILE, ERROR_FILE, CONFIG_FILE = "result.json", "error.txt", "config.yaml"


def library_versions() -> dict[str, str]:
    import accelerate
    import datasets
    import torch
    import transformers

    return {m.__name__: m.__version__ for m in (torch, transformers, accelerate, datasets)}


def run(cfg: DictConfig, job_dir: Path) -> dict:
    import transformers

    from pipeline import backends, data, models, optimizers
    from pipeline.memory import optimizer_state_size, peak_rss_mb

    transformers.set_seed(cfg.seed)
    tokenizer = models.load_tokenizer(cfg.model)
    splits = data.load_splits(cfg.data)
    model = models.load_model(cfg.model, splits.num_labels)
    splits = data.tokenize(splits, tokenizer, cfg.train.max_length, models.vocab_size(model))
    spec = optimizers.get(cfg.optim.name)
    num_params = sum(p.numel() for p in model.parameters())
    estimate = spec.estimate_state(optimizers.param_layout(model.parameters()))

    out = backends.get(cfg.backend.name).train(cfg, model, tokenizer, splits, spec, job_dir)

    state = optimizer_state_size(out.optimizer)
    samples = cfg.train.max_steps * cfg.batch_size
    metrics = {
        "model_num_params": num_params,
        "optimizer_state_numel": state.numel,
        "optimizer_state_bytes": state.bytes,
        "optimizer_state_mb": state.mb,
        "estimated_optimizer_state_mb": estimate.mb,
        **out.peak.metrics(),
        "peak_rss_mb": peak_rss_mb(),
        "train_loss_final": out.losses[-1],
        "train_runtime_s": out.train_runtime_s,
        "train_samples_per_second": samples / out.train_runtime_s,
        **{f"eval_{k}": v for k, v in out.eval_metrics.items()},
    }
    return {
        "metrics": metrics,
        "series": {"train_loss": out.losses},
        "params": {
            "device": out.device,
            "num_labels": splits.num_labels,
            "train_samples": len(splits.train),
            "eval_samples": len(splits.eval),
        },
        "tags": {f"version.{k}": v for k, v in library_versions().items()},
    }


def main(job_dir: Path) -> int:
    cfg = OmegaConf.load(job_dir / CONFIG_FILE)
    try:
        result = run(cfg, job_dir)
    except BaseException:  # noqa: BLE001 - every failure is reported to the runner, then re-signalled by exit code
        (job_dir / ERROR_FILE).write_text(traceback.format_exc())
        traceback.print_exc()
        return 1
    (job_dir / RESULT_FILE).write_text(json.dumps(result, indent=1))
    m = result["metrics"]
    print(
        f"[job] state {m['optimizer_state_mb']:.2f} MB (estimated {m['estimated_optimizer_state_mb']:.2f}), "
        f"peak {m['peak_memory_mb']:.1f} MB, eval F1 {m['eval_f1']:.3f}, "
        f"{m['train_samples_per_second']:.1f} samples/s",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
