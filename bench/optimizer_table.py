"""`make optimizer-table`: every registered optimizer on one model of one task, a real sweep of short jobs: the
optimizer state measured against its two estimates, the analytic one (`estimated_optimizer_state_mb`) and the
meta-device step's (`pipeline.optimizers.meta_estimate`, computed here on the same model built on the meta
device), its bytes per parameter, and the gradients' part of the peak breakdown. Writes a Markdown table
(default docs/optimizer-table.md, or docs/optimizer-table-causal-lm.md for task=causal_lm) and its CSV beside it.

    python -m bench.optimizer_table            # distilbert-base-cased (random weights), fp32, Accelerate loop
    python -m bench.optimizer_table --task causal_lm   # gpt2-tiny with its LM head (tied to its embeddings)
    python -m bench.optimizer_table --model tiny --precision bf16_pure --optims adamw,lomo --out /tmp/t.md

The jobs run as one `python -m pipeline -m optim=...` sweep into outputs_dir (default outputs/optimizer-table):
a failed job is a FAILED run with its one-line reason, and running the command again trains only the points
not FINISHED before. The Accelerate loop builds each optimizer with the registry's factory, as the meta-device
step does, so the three figures describe the same object (the Trainer's bitsandbytes 8-bit path keeps
embeddings' state in fp32: docs/optimizers.md).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"
EXPERIMENT = "optimizer-table"
# each task's model when --model is not given, and its page: a classifier of DistilBERT's size; as a language model
# the tiny GPT-2, whose LM head is its token embedding (tied: one weight, whose state every figure counts once)
MODEL = {"classification": "distilbert-base-cased", "causal_lm": "gpt2-tiny"}
PAGE = {"classification": "optimizer-table.md", "causal_lm": "optimizer-table-causal-lm.md"}
TITLE = {"classification": "", "causal_lm": " as a causal language model"}
TASK_NOTE = {
    "classification": "",
    "causal_lm": " task=causal_lm: the decoder with its LM head (`AutoModelForCausalLM`), trained on next-token "
    "labels of the data's text; a head tied to the token embedding is one parameter, whose state every figure "
    "counts once. *peak logits*: the logits' part of the step's peak (batch x seq x vocabulary, their fp32 copy "
    "in the loss, their gradient); where the peak falls at the loss, before backward has made any parameter's "
    "gradient, *peak grads* is 0.",
}
# short jobs: a small batch of short texts, two steps (the breakdown profiles step 2), no validation passes
JOB = [
    "train.max_steps=2",
    "batch_size=2",
    "train.max_length=64",
    "data.max_train_samples=16",
    "data.max_eval_samples=8",
    "data.val_fraction=0",
]


# settings that leave the state alone but make a CPU step affordable (tests/test_memory.py's FAST_STEP): torch's
# Muon runs its Newton-Schulz iterations in bf16, minutes a step for DistilBERT on CPU; each runs as its own sweep
FAST = {"muon": ["optim.ns_steps=0"]}


def registered() -> list[str]:
    """Every `optim=` name (conf/optim), `custom` (its default target is AdamW) last."""
    names = sorted(p.stem for p in (CONF / "optim").glob("*.yaml"))
    return [n for n in names if n != "custom"] + ["custom"] * ("custom" in names)


def sweep_overrides(args) -> list[str]:
    extra = ["model.pretrained=false"] if args.model != "tiny" else []
    return [
        f"optim={','.join(args.optims)}",
        f"model={args.model}",
        f"task={args.task}",
        *extra,
        f"train.precision={args.precision}",
        f"backend={args.backend}",
        *JOB,
        f"outputs_dir={args.outputs_dir}",
        f"tracking.experiment={EXPERIMENT}",
    ]


def meta_mb(optim: str, overrides: list[str]) -> tuple[float | None, str]:
    """The meta-device step's estimate (MB) for one optimizer on the sweep's model, or (None, why not)."""
    from hydra import compose, initialize_config_dir

    from pipeline import MB, models, optimizers

    keep = [o for o in overrides if not o.startswith(("optim=", "outputs_dir=", "tracking."))]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", [*keep, f"optim={optim}"])
    spec = optimizers.get(optim)
    task = cfg.task.name  # a classifier of the default data's two classes (as plan mode), or the LM head
    config = models.model_config(cfg.model, num_labels=2, task=task)
    itemsize = 2 if cfg.train.precision == "bf16_pure" else 4
    try:
        model = optimizers.meta_model(config, itemsize, task)
        return optimizers.meta_estimate(spec, cfg, model).bytes / MB, ""
    except optimizers.MetaStepFailed as err:
        return None, str(err)
    except Exception as err:  # noqa: BLE001 (a missing package, a build that needs CUDA: said in the table)
        return None, f"{type(err).__name__}: {str(err).strip().splitlines()[0][:120]}"


def latest_runs(outputs_dir: Path, overrides: list[str]) -> dict[str, object]:
    """optim -> its latest ended run of this model, task, precision and backend in the table's experiment (a run
    logged without a task is a classifier's)."""
    from mlflow import MlflowClient

    from pipeline.tracking import store_uri

    client = MlflowClient(store_uri(None, outputs_dir))
    experiment = client.get_experiment_by_name(EXPERIMENT)
    values = dict(o.split("=", 1) for o in overrides if "=" in o)
    where = " and ".join(
        f"params.{key} = '{values[src]}'"
        for key, src in (("model", "model"), ("precision", "train.precision"), ("backend", "backend"))
    )
    runs = client.search_runs(
        [experiment.experiment_id], f"{where} and attributes.status != 'RUNNING'", max_results=10000,
        order_by=["attributes.start_time DESC"],
    )  # fmt: skip
    latest = {}
    for run in runs:
        if run.data.params.get("task", "classification") == values["task"]:
            latest.setdefault(run.data.params["optim"], run)
    return latest


def fmt(value, digits: int = 2) -> str:
    return "" if value is None else f"{value:,.{digits}f}"


def rows(optims: list[str], runs: dict, overrides: list[str]) -> list[dict]:
    out = []
    for optim in optims:
        run = runs.get(optim)
        meta, why = meta_mb(optim, overrides)
        row = {"optim": optim, "meta step [MB]": meta, "meta note": why}
        if run is None:
            out.append({**row, "status": "not run"})
            continue
        m, tags = run.data.metrics, run.data.tags
        status = (
            run.info.status
            if run.info.status == "FINISHED"
            else f"{run.info.status}: {tags.get('error', '')}"
        )
        out.append(
            {
                **row,
                "status": status,
                "measured [MB]": m.get("optimizer_state_mb"),
                "analytic [MB]": m.get("estimated_optimizer_state_mb"),
                "bytes/param": m.get("optimizer_state_bytes_per_param"),
                "peak grads [MB]": m.get("peak_grads_mb"),
                "peak [MB]": m.get("peak_memory_mb"),
                "params": m.get("model_num_params"),
                # a language model's logits part of the peak (a classifier logs none)
                **({"peak logits [MB]": m["peak_logits_mb"]} if "peak_logits_mb" in m else {}),
            }
        )
    return out


def same(a, b) -> str:
    """`=` when two MB figures are the same to the byte (as logged: MB to float precision), else the gap."""
    if a is None or b is None:
        return ""
    return "=" if abs(a - b) * 2**20 < 0.5 else f"{b - a:+.4f}"


def markdown(table: list[dict], command: str, seconds: float, args) -> str:
    lm = args.task == "causal_lm"
    lines = [
        f"# Optimizer state on {args.model}{TITLE[args.task]} ({args.precision}, {args.backend})",
        "",
        f"Written by `{command}` on {datetime.now():%Y-%m-%d %H:%M} ({seconds:.0f} s; a rerun trains only what is "
        "missing). One real job per optimizer: "
        + " ".join(JOB)
        + ". MB = 2^20 bytes. *measured*: the state the optimizer object holds after training "
        "(`optimizer_state_mb`); *analytic*: the registry's estimate (`estimated_optimizer_state_mb`); *meta step*: "
        "the optimizer built on the same model on the meta device and stepped once (`pipeline.optimizers."
        "meta_estimate`), `=` where it equals the measured state to the byte; *peak grads*: the gradients' part of "
        "the step's peak (the memory breakdown, [metrics.md](metrics.md))." + TASK_NOTE[args.task],
        "",
        "| optimizer | status | measured [MB] | analytic [MB] | meta step [MB] | bytes/param | peak grads [MB] | "
        + "peak logits [MB] | " * lm
        + "peak [MB] |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | " + "---: | " * lm + "---: |",
    ]
    for r in table:
        measured = r.get("measured [MB]")
        analytic = r.get("analytic [MB]")
        meta = r.get("meta step [MB]")
        meta_cell = (
            f"{fmt(meta, 3)} ({same(measured, meta)})"
            if meta is not None and measured is not None
            else fmt(meta, 3)
        )
        if meta is None:
            meta_cell = f"none: {r['meta note']}"
        analytic_cell = fmt(analytic, 3) + (f" ({same(measured, analytic)})" if measured is not None else "")
        lines.append(
            f"| `{r['optim']}` | {r['status']} | {fmt(measured, 3)} | {analytic_cell} | {meta_cell} | "
            f"{fmt(r.get('bytes/param'))} | {fmt(r.get('peak grads [MB]'))} | "
            + f"{fmt(r.get('peak logits [MB]'))} | " * lm
            + f"{fmt(r.get('peak [MB]'))} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.optimizer_table", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--task", default="classification", choices=list(MODEL))
    parser.add_argument("--model", default=None, help="default: the task's (MODEL)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "bf16_pure"])
    parser.add_argument("--backend", default="accelerator", choices=["accelerator", "trainer"])
    parser.add_argument(
        "--optims", type=lambda s: s.split(","), default=None, help="a,b,c (default: every one)"
    )
    parser.add_argument("--outputs-dir", type=Path, default=ROOT / "outputs" / "optimizer-table")
    parser.add_argument("--out", type=Path, default=None, help="default: docs/ + the task's PAGE")
    parser.add_argument("--table-only", action="store_true", help="write the table of what the store holds")
    args = parser.parse_args(argv)
    args.optims = args.optims or registered()
    args.model = args.model or MODEL[args.task]
    args.out = args.out or ROOT / "docs" / PAGE[args.task]
    overrides = sweep_overrides(args)
    start = time.perf_counter()
    if not args.table_only:
        # the sweep's exit code is 1 when some job failed: a failed job is a row of the table too
        sweeps = [[o for o in args.optims if o not in FAST], *([o] for o in args.optims if o in FAST)]
        for names in filter(None, sweeps):
            command = [o if not o.startswith("optim=") else f"optim={','.join(names)}" for o in overrides]
            command += FAST.get(names[0], []) if len(names) == 1 else []
            subprocess.run([sys.executable, "-m", "pipeline", "-m", *command], cwd=ROOT, check=False)
    table = rows(args.optims, latest_runs(args.outputs_dir, overrides), overrides)
    command = "python -m bench.optimizer_table " + " ".join(argv if argv is not None else sys.argv[1:])
    args.out.write_text(markdown(table, command.strip(), time.perf_counter() - start, args))
    import pandas as pd

    pd.DataFrame(table).to_csv(args.out.with_suffix(".csv"), index=False)
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
