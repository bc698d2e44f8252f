"""Hydra's basic sweeper with each point's config composed once (conf/hydra/sweeper/compose_once.yaml, the
pipeline's default sweeper).

The basic sweeper composes every point of a batch to check that it composes before any of them runs, and Hydra's
basic launcher (launcher=local) composes each point again as it runs it. Here the launcher runs the config the
check composed: the sweeper and the launcher share a config loader that keeps each point's composed config from
the check until its job starts (about 150 KB a point). Launchers that compose their points in other processes
(launcher=parallel, slurm, submitit_local) have their batches checked as the basic sweeper checks them.

A Hydra plugin (a module of the `hydra_plugins` namespace package, where Hydra looks for them); it imports nothing
of the pipeline's.
"""

from __future__ import annotations

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"  # launcher=local's


class ComposedConfigs:
    """The config loader the sweeper and Hydra's basic launcher share: a point's config composed as the sweeper
    checks its batch (keep) is the one load_sweep_config hands the launcher for that point, instead of composing
    it again. Everything else goes to Hydra's own loader."""

    def __init__(self, loader):
        self._loader = loader
        self._kept: dict[tuple[str, ...], list[DictConfig]] = {}  # by a point's overrides

    def keep(self, master_config: DictConfig, sweep_overrides: list[str]) -> None:
        composed = self._loader.load_sweep_config(master_config, sweep_overrides)
        self._kept.setdefault(tuple(sweep_overrides), []).append(composed)

    def load_sweep_config(self, master_config: DictConfig, sweep_overrides: list[str]) -> DictConfig:
        kept = self._kept.get(tuple(sweep_overrides))
        if not kept:
            return self._loader.load_sweep_config(master_config, sweep_overrides)
        if len(kept) == 1:
            del self._kept[tuple(sweep_overrides)]
        return kept.pop(0)

    def __getattr__(self, name: str):
        return getattr(self._loader, name)


class ComposeOnceSweeper(BasicSweeper):
    """The basic sweeper (the same batches, the same check before each batch runs), each point composed once
    where the launcher is Hydra's basic one."""

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        if OmegaConf.select(config, "hydra.launcher._target_") == BASIC_LAUNCHER:
            hydra_context = HydraContext(
                ComposedConfigs(hydra_context.config_loader), hydra_context.callbacks
            )
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def validate_batch_is_legal(self, batch) -> None:
        loader = self.hydra_context.config_loader
        if not isinstance(loader, ComposedConfigs):
            super().validate_batch_is_legal(batch)
            return
        for overrides in batch:  # a point that does not compose stops the sweep before any of the batch runs
            loader.keep(self.config, list(overrides))
