"""Which bad values stop a whole sweep at once: a config problem that no swept value can change.

The launching process of a sweep holds the config composed with the constant overrides applied and every
swept key at its default (Hydra's multirun config). Each check of pipeline.config names the keys its verdict
depends on (ConfigError.keys). When no sweep varies any of those keys, nor any key their values interpolate,
every point fails that check with the same line: the command stops with it (exit 2) before any run is opened,
as a single run does. So does a swept value that fails a check whatever the other swept keys are
(`batch_size=8,-1`: no point could use -1). A check that depends on the other swept keys stays a FAILED run of
the points it fails.

The rule reads the overrides and the option files of swept config groups: it composes no point, so it costs
the same for a sweep of 2 points and of 2,000.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from pipeline.config import CONF_DIR, ConfigError, problems, unused_custom_optim

EVERYTHING = ""  # a key related to every key: what a value that cannot be followed depends on
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def related(a: str, b: str) -> bool:
    """Whether setting one key can change the other: the same key, one inside the other, or EVERYTHING."""
    return a == b or EVERYTHING in (a, b) or a.startswith(f"{b}.") or b.startswith(f"{a}.")


def inside(key: str, parent: str) -> bool:
    return key == parent or key.startswith(f"{parent}.")


def leaf_keys(node, prefix: str = "") -> set[str]:
    """Dotted keys of the leaves of a (raw) config mapping."""
    if not isinstance(node, dict) or not node:
        return {prefix}
    return {key for name, value in node.items() for key in leaf_keys(value, f"{prefix}{name}" + ".")}


@functools.cache
def group_keys(group: str, package: str | None) -> frozenset[str] | None:
    """Every key an option of a config group can set (all its options: a sweep function may pick any),
    or None when that cannot be told (a group outside conf/, or an option that pulls in other groups); its
    option files read once per process (a sweep's start asks for the same groups several times)."""
    folder = CONF_DIR / group
    if not folder.is_dir():
        return None
    keys: set[str] = set()
    for path in folder.glob("*.yaml"):
        header = re.search(r"^#\s*@package\s+(\S+)", path.read_text(), re.MULTILINE)
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
        for entry in raw.pop("defaults", None) or []:
            # `override /hydra/launcher: ...` only touches hydra's own settings, which no check reads
            if not (isinstance(entry, dict) and all(k.startswith("override /hydra/") for k in entry)):
                return None
            keys.add("hydra")
        where = package or (header[1] if header else "_group_")
        if where == "_global_":
            keys |= {key.rstrip(".") for key in leaf_keys(raw)}
        else:
            keys.add(where.replace("_group_", group.replace("/", ".")))
    return frozenset(keys)


@dataclass
class Sweep:
    """What the sweep varies, read from its overrides, and the raw config to follow interpolations in."""

    raw: dict
    keys: set[str] = field(default_factory=set)  # keys given several values (key sweeps, sweeper params)
    groups: set[str] = field(default_factory=set)  # keys that the options of swept config groups set
    fixed: set[str] = field(default_factory=set)  # keys set by a constant override: the same at every point
    values: dict[str, list] = field(default_factory=dict)  # a swept key's values, where the sweep lists them
    # a swept config group's options (`optim=a,b`; None where the sweep does not list them: a glob)
    options: dict[str, list | None] = field(default_factory=dict)

    def varies(self, key: str, seen: set[str] | None = None) -> bool:
        """Whether the key's value can differ between points of the sweep."""
        seen = set() if seen is None else seen
        if key in seen:
            return False
        seen.add(key)
        if any(related(key, swept) for swept in self.keys):
            return True
        overridden = any(inside(key, fixed) for fixed in self.fixed)
        if not overridden and any(related(key, swept) for swept in self.groups):
            return True
        return any(self.varies(ref, seen) for ref in self.references(key))

    def references(self, key: str) -> set[str]:
        """The keys the key's raw value interpolates (EVERYTHING for a relative interpolation)."""
        refs: set[str] = set()
        for text in strings(lookup(self.raw, key)):
            if "${" not in text:
                continue
            if re.search(r"\$\{\s*\.", text):
                return {EVERYTHING}
            found = re.findall(r"[A-Za-z_][\w-]*(?:\.[\w-]+)*", text)
            refs |= {ref for ref in found if lookup(self.raw, ref) is not None}
        return refs


def lookup(raw, key: str):
    """The raw value at a dotted key (None when absent)."""
    for part in key.split("."):
        if not isinstance(raw, dict) or part not in raw:
            return None
        raw = raw[part]
    return raw


def strings(node) -> list[str]:
    """Every string in a raw value (its leaves, for a mapping or a list)."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        node = list(node.values())
    if isinstance(node, list):
        return [text for item in node for text in strings(item)]
    return []


def sweep_of(config: DictConfig) -> Sweep | None:
    """The sweep's varying and fixed keys, or None when they cannot be told (another sweeper's search space,
    an override the parser does not take, a group outside conf/)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    sweeper = config.hydra.sweeper
    if sweeper.get("_target_") != BASIC_SWEEPER and "params" not in sweeper:
        return None
    params = sweeper.get("params") or {}
    sweep = Sweep(OmegaConf.to_container(config, resolve=False))
    parser = OverridesParser.create()
    try:
        given = parser.parse_overrides(list(config.hydra.overrides.task))
        from_sweeper = parser.parse_overrides([f"{key}={value}" for key, value in params.items()])
    except HydraException:
        return None
    # the sweeper's params count as swept even with one value (the launching process's config lacks them),
    # unless the command line sets the same key: the sweeper takes the command line's then
    on_command_line = {o.get_key_element() for o in given}
    from_sweeper = [o for o in from_sweeper if o.get_key_element() not in on_command_line]
    groups = set(config.hydra.runtime.choices)  # the config groups composed, wherever their files are
    for override, swept in [(o, o.is_sweep_override()) for o in given] + [(o, True) for o in from_sweeper]:
        if override.is_hydra_override():
            continue
        name = override.key_or_group
        if name in groups or (CONF_DIR / name).is_dir() or override.package is not None:
            if swept:
                keys = group_keys(name, override.package)
                if keys is None:
                    return None
                sweep.groups |= keys
                try:
                    sweep.options[name] = [str(option) for option in override.sweep_iterator()]
                except Exception:  # a glob or a value the parser cannot list: not known
                    sweep.options[name] = None
        elif swept:
            sweep.keys.add(name)
            try:
                sweep.values[name] = list(override.sweep_iterator())
            except Exception:  # an interval (a sweeper samples it) or a value the parser cannot list
                pass
        else:
            sweep.fixed.add(name)
    return sweep


def point_independent_error(config: DictConfig) -> ConfigError | None:
    """The first config problem that every point of the sweep has (no swept value changes its verdict)."""
    sweep = sweep_of(config)
    if sweep is None:
        return None
    for err in problems(config):
        if err.keys and not any(sweep.varies(key) for key in err.keys):
            return err
    optims = sweep.options.get("optim", [config.hydra.runtime.choices.get("optim")])
    unused = None if optims is None else unused_custom_optim(config, optims)
    return unused or unusable_value_error(config, sweep)


def unusable_value_error(config: DictConfig, sweep: Sweep) -> ConfigError | None:
    """The first problem of a swept value that no point could escape: checked with that key at that value, it
    depends on no other key the sweep varies."""
    for name, values in sweep.values.items():
        others = dataclasses.replace(sweep, keys=sweep.keys - {name}, fixed=sweep.fixed | {name})
        for value in values:
            point = copy.deepcopy(config)
            try:
                OmegaConf.update(point, name, value, merge=False)
            except Exception:  # a key the config lacks (`+key=`), a value of another type: its points say
                continue
            for err in problems(point):
                if err.keys and not any(others.varies(key) for key in err.keys):
                    return err
    return None
