"""`python -m pipeline [-m] key=value ...`: Hydra entry point; each job goes to pipeline.runner, the sweep's
summary and exit code come from pipeline.sweep."""

import gc
import signal
import sys

from pipeline import starter

if __name__ == "__main__":
    # no cyclic garbage collection while this process starts: its imports (Hydra, MLflow, pandas, matplotlib)
    # make few cycles but would pay for passes over a heap that keeps growing (a fifth of their CPU); a sweep
    # collects once when it has started (pipeline.sweep), a single run turns the collector on in main
    gc.disable()
    # the jobs' starter begins importing torch & co. now, while this process imports Hydra and MLflow
    starter.prestart_from_command(sys.argv[1:])

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from pipeline import quiet, runner, sweep  # noqa: E402
from pipeline.config import CONF_DIR, ConfigError, check_group_overrides, own_model  # noqa: E402
from pipeline.keys import check_keys  # noqa: E402

# `--help`: one line per config group (conf/config.yaml's hydra.help.template calls ${config_groups:})
GROUP_HELP = {
    "optim": "the optimizer and its settings, docs/optimizers.md",
    "model": "the model fine-tuned (tiny: 1M parameters, for tests; the decoders also as language models; your "
    "own: model.config=<its config.json or folder>)",
    "peft": "full fine-tuning (none) or LoRA adapters on a frozen base (lora), a 4-bit one (qlora), docs/config.md",
    "task": "classification (a head over the data's labels) or causal_lm (a decoder's next-token loss on the text)",
    "data": "the dataset (csv: your own files, data.train_file and data.eval_file)",
    "backend": "the training loop, the HF Trainer (an optim= string) or an Accelerate loop (the object)",
    "tracking": "the MLflow store, local (sqlite under outputs_dir) or a server (tracking.uri)",
    "launcher": "where and how many jobs run at once, docs/scaling.md",
    "protocol": "+protocol=tune_lr puts every optimizer on a learning-rate grid with seeds, docs/tuning.md",
}


def config_groups() -> str:
    """`group   what it is; options: a, b, ...`, one line per config group of conf/."""
    groups = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and any(p.glob("*.yaml")))
    width = max(map(len, groups))
    return "\n".join(
        f"{g:<{width}}  {GROUP_HELP.get(g, g)}; options: {', '.join(sorted(p.stem for p in (CONF_DIR / g).glob('*.yaml')))}"
        for g in groups
    )


OmegaConf.register_new_resolver("config_groups", config_groups, replace=True)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    gc.enable()  # (off while the command started; a single run's config was checked: SweepCallback)
    try:  # a model of one's own (model.config): its catalog entry, what the run's name, params and job read
        cfg = own_model(cfg)
    except ConfigError:
        pass  # a sweep's point fails with the check's line
    try:  # this process's library noise too: plan=true jobs run here
        quiet.install(quiet.log_level(cfg))
    except ValueError:
        pass  # a bad log_level: the job's own check makes it a FAILED point with that line
    outcome = runner.run(cfg, sweep.current_ids())
    sweep.RESULT.add(outcome)
    return outcome.score  # the validation metric (val_<eval.metric>): what a Hydra sweeper optimises


def interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


if __name__ == "__main__":
    try:
        check_group_overrides(sys.argv[1:])
        check_keys(sys.argv[1:])
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    # SIGTERM (a scheduler, `kill`) stops the sweep like Ctrl-C: the running job is killed, runs marked KILLED
    signal.signal(signal.SIGTERM, interrupted)
    try:
        main()
    except KeyboardInterrupt as err:
        sweep.mark_killed()  # what a parallel worker, torn down with the sweep, could not mark itself
        print(
            f"\n[sweep] interrupted ({str(err) or 'Ctrl-C'}): the running job and the sweep are marked KILLED"
        )
        sys.exit(130)
    except SystemExit as err:
        if err.code == 1:  # Hydra reported a crash of the launching process
            sweep.mark_failed()
        if err.code == 2:  # rejected (bad input, a store that cannot be opened): it leaves no folder
            sweep.remove_new()
        raise
    code = sweep.RESULT.finish()
    # all recorded and printed: the collections of the whole heap the interpreter makes as it ends (MLflow's,
    # pandas' and matplotlib's objects: a second here) are left out; exit handlers still run, files still close
    gc.freeze()
    sys.exit(code)
