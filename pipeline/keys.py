"""An unknown config key on the command line (`train.lrr=1`): one line that names it, with a "did you mean"
when a key is close, before Hydra composes anything (Hydra's own message takes six lines and exits 1).

The keys a command line can set are those of conf/config.yaml and of the options its config groups take: the
option it names (`optim=adafactor`, every one of `optim=adamw,adafactor`), else the default one. Only a key
that is certainly absent is reported: a key below a value that is no mapping (`model.architecture` of a
pretrained model is null), an override that adds or deletes a key (`+key=`, `++key=`, `~key`), Hydra's own
keys and anything the parser does not take are left to Hydra.
"""

from __future__ import annotations

import copy
import difflib
import functools
import re
from pathlib import Path

from omegaconf import OmegaConf

from pipeline.config import CONF_DIR, ConfigError, did_you_mean, search_dirs


@functools.cache
def _parsed(path: Path) -> tuple[dict, str | None, list]:
    """An option file read once per process: its keys (without its defaults list), its `# @package` header,
    if any, and its defaults list."""
    text = path.read_text()
    header = re.search(r"^#\s*@package\s+(\S+)", text, re.MULTILINE)
    raw = OmegaConf.to_container(OmegaConf.create(text), resolve=False) or {}
    defaults = raw.pop("defaults", None) or []
    return raw, header[1] if header else None, defaults


def _raw(path: Path) -> tuple[dict, str | None]:
    """An option file's keys (without its defaults list) and its `# @package` header, if any: a copy, which
    the caller may merge into."""
    raw, header, _ = _parsed(path)
    return copy.deepcopy(raw), header


def _union(into: dict, other: dict) -> None:
    """Every key of `other` into `into` (mappings merged, else the first value kept)."""
    for key, value in other.items():
        if isinstance(into.get(key), dict) and isinstance(value, dict):
            _union(into[key], value)
        elif key not in into or (isinstance(value, dict) and not isinstance(into[key], dict)):
            into[key] = value


def _defaults() -> tuple[dict, dict[str, str]]:
    """conf/config.yaml's own keys and the option each config group takes by default."""
    raw, _ = _raw(CONF_DIR / "config.yaml")
    chosen = {}
    for entry in _parsed(CONF_DIR / "config.yaml")[2]:
        if isinstance(entry, dict):
            chosen.update({str(k): str(v) for k, v in entry.items()})
    return raw, chosen


def option_file(group: str, name: str, dirs=(CONF_DIR,)) -> Path | None:
    """A group option's file: in conf/ first, then in the folders a hydra.searchpath override adds."""
    return next((d / group / f"{name}.yaml" for d in dirs if (d / group / f"{name}.yaml").exists()), None)


def _option_keys(path: Path, group: str, dirs) -> tuple[dict, str | None]:
    """An option file's keys, with those of the options of its group its defaults list starts from (a user's
    `defaults: [custom, _self_]`), and its `# @package` header."""
    raw, package = _raw(path)
    for entry in _parsed(path)[2]:
        base = option_file(group, entry, dirs) if isinstance(entry, str) and entry != "_self_" else None
        if base is not None and base != path:
            _union(raw, _option_keys(base, group, dirs)[0])
    return raw, package


def known_keys(options: dict[str, list[str]], dirs=(CONF_DIR,)) -> dict:
    """The tree of keys the command line can set, with `options` (group -> options it names) in place of
    the defaults; `dirs`: where options are found (conf/, then hydra.searchpath's folders)."""
    tree, chosen = _defaults()
    tree.pop("hydra", None)
    for group, names in {**{g: [o] for g, o in chosen.items()}, **options}.items():
        for name in names:
            path = option_file(group, name, dirs)
            if path is None:
                continue  # an unknown option: pipeline.config's group check says so
            raw, package = _option_keys(path, group, dirs)
            if package == "_global_":
                _union(tree, raw)
            else:
                _union(tree.setdefault(group, {}), raw)
    return tree


def _leaves(node, prefix: str = "") -> list[str]:
    if not isinstance(node, dict) or not node:
        return [prefix.rstrip(".")]
    return [key for name, value in node.items() for key in _leaves(value, f"{prefix}{name}.")]


def unknown_key_error(key: str, text: str, tree: dict) -> ConfigError | None:
    """The line for an override of `key` (given as `text`) when the key is certainly not in `tree`."""
    node, parts = tree, key.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, dict):
            return None  # below a leaf (a null, a list): Hydra knows better
        if part not in node:
            parent = ".".join(parts[:i])
            where = f"in {parent}" if parent else "at the top level"
            siblings = [str(k) for k in node]
            near = difflib.get_close_matches(part, siblings, n=1)
            close = (
                f"did you mean {'.'.join([*parts[:i], near[0]])}? "
                if near
                else did_you_mean(key, _leaves(tree))
            )
            return ConfigError(
                f"{text} is invalid: no key {part} {where}; {close}its keys: {', '.join(siblings)}", (key,)
            )
        node = node[part]
    return None


def check_keys(argv: list[str]) -> None:
    """Raise ConfigError for the first override on the command line whose key is not a config key."""
    if any(a in ("-cp", "-cn", "-cd") or a.startswith(("--config-", "--info")) for a in argv):
        return  # another config: its keys are not conf/'s
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    parsed = []
    for arg in argv:
        if arg.startswith("-") or ("=" not in arg and not arg.startswith("~")):
            continue  # a flag, or a flag's value (`--cfg job`)
        try:
            parsed.append((arg, parser.parse_override(arg)))
        except HydraException:
            continue  # Hydra says what is wrong with it
    groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir()}
    dirs, _ = search_dirs(argv)
    options: dict[str, list[str]] = {}
    unsure: set[str] = set()
    for _, override in parsed:
        if override.key_or_group in groups and override.package is None:
            try:
                values = list(override.sweep_string_iterator()) if override.is_sweep_override() else None
                values = values or [str(override.value())]
            except Exception:  # a sweep function or glob: which options it picks is Hydra's to say
                unsure.add(override.key_or_group)
                continue
            options[override.key_or_group] = values  # the last one wins, as in Hydra
            if any(option_file(override.key_or_group, v, dirs) is None for v in values):
                unsure.add(override.key_or_group)  # an option from elsewhere (pkg://): Hydra knows its keys
    for text, override in parsed:
        key = override.key_or_group
        if (
            override.type != OverrideType.CHANGE
            or override.is_hydra_override()
            or override.package is not None
            or key in groups
            or key.split(".")[0] in unsure
        ):
            continue
        root = key.split(".")[0]
        # a key of a swept group must be in each of its options: every point composes one of them
        for option in options.get(root, [None]):
            err = unknown_key_error(
                key, text, known_keys({**options, **({root: [option]} if option else {})}, dirs)
            )
            if err is not None:
                if len(options.get(root, [])) > 1:
                    err = ConfigError(str(err).replace(f" in {root};", f" in {root}={option};", 1), err.keys)
                raise err
