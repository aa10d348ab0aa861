"""Typed job configuration: dataclass default < YAML file < command line.

A job is one dataclass whose fields carry their help text (`option(default, help)`) and whose
`__post_init__` checks values. YAML keys are exactly the field names and `--field value` flags
override them. A field whose type is itself a dataclass is a section: a mapping in YAML
(`eagle3: {layers: [2, 15, 27]}`) and dotted flags on the command line (`--eagle3.layers 2 15 27`).
Unknown keys, unknown flags and values of the wrong type are errors that name the key; keys a job
renamed (a class's `RENAMED`, and every `<section>_<field>`, the flat spelling of a section's field)
are errors that name the new spelling; nothing is read from anywhere else.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

C = TypeVar("C")


class ConfigError(ValueError):
    """A configuration problem, with the offending key in the message."""


def option(default, help_text: str):
    """A config field with its default and help text (a list default is copied for every instance)."""
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata={"help": help_text})
    return dataclasses.field(default=default, metadata={"help": help_text})


def load_config(cls: type[C], argv: list[str] | None = None, description: str = "") -> C:
    """Build `cls` from `--config FILE` and `--field value` / `--section.field value` overrides in argv."""
    argv = list(sys.argv[1:] if argv is None else argv)
    refuse_renamed_flags(cls, argv)
    args = build_parser(cls, description).parse_args(argv)
    values: dict[str, Any] = read_yaml(cls, Path(args.config)) if args.config else {}
    for key, kind in flag_types(cls).items():
        given = getattr(args, key)
        if given is not None:
            section, _, name = key.rpartition(".")
            target = values.setdefault(section, {}) if section else values
            target[name] = coerce(key, given, kind)
    try:
        return cls(**values)
    except (TypeError, ValueError) as err:
        raise ConfigError(str(err)) from err


def sections(cls: type) -> dict[str, type]:
    """The section fields of `cls`: name -> the section's dataclass."""
    found = {}
    for f in dataclasses.fields(cls):
        kind = field_type(cls, f.name)
        if dataclasses.is_dataclass(kind):
            found[f.name] = kind
    return found


def renamed_keys(cls: type) -> dict[str, str]:
    """Old key -> its new spelling: the class's RENAMED, and the flat `<section>_<field>` of each section field."""
    renamed = dict(getattr(cls, "RENAMED", {}))
    for name, section in sections(cls).items():
        renamed.update({f"{name}_{f.name}": f"{name}.{f.name}" for f in dataclasses.fields(section)})
    return renamed


def flag_types(cls: type) -> dict[str, Any]:
    """Every command-line key of `cls` (sections' as `section.field`) -> the value's type."""
    kinds = {}
    nested = sections(cls)
    for f in dataclasses.fields(cls):
        if f.name in nested:
            kinds.update({f"{f.name}.{g.name}": field_type(nested[f.name], g.name)
                          for g in dataclasses.fields(nested[f.name])})
        else:
            kinds[f.name] = field_type(cls, f.name)
    return kinds


def field_help(cls: type, key: str) -> str:
    section, _, name = key.rpartition(".")
    owner = sections(cls)[section] if section else cls
    return next(f for f in dataclasses.fields(owner) if f.name == name).metadata.get("help", "")


def refuse_renamed_flags(cls: type, argv: list[str]) -> None:
    renamed = renamed_keys(cls)
    for arg in argv:
        name = arg[2:].split("=", 1)[0] if arg.startswith("--") else ""
        if name in renamed:
            raise ConfigError(f"{name} is now {renamed[name]}: pass --{renamed[name]}")


def build_parser(cls: type, description: str = "") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description or cls.__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", help="YAML file whose keys are this job's field names")
    for key, kind in flag_types(cls).items():
        help_text = field_help(cls, key)
        if kind is bool:
            parser.add_argument(f"--{key}", dest=key, type=parse_bool, nargs="?", const=True, default=None,
                                help=help_text)
        elif is_list(kind):
            parser.add_argument(f"--{key}", dest=key, nargs="*", default=None, help=help_text)
        else:
            parser.add_argument(f"--{key}", dest=key, default=None, help=help_text)
    return parser


def read_yaml(cls: type, path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of field names to values")
    return checked_values(cls, raw, str(path))


def checked_values(cls: type, raw: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
    """raw's values coerced to cls's field types; unknown and renamed keys are errors naming them.
    A section's mapping becomes a dict of its own checked values (the section's dataclass is built by cls)."""
    renamed = renamed_keys(cls)
    old = sorted(set(raw) & set(renamed))
    if old:
        raise ConfigError(f"{where}: " + "; ".join(f"{prefix}{k} is now {prefix}{renamed[k]}" for k in old))
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {[prefix + k for k in unknown]}; known keys: {sorted(names)}")
    nested = sections(cls)
    values = {}
    for key, value in raw.items():
        if key in nested:
            if value is not None and not isinstance(value, dict):
                raise ConfigError(f"{where}: {prefix}{key} is a section: a mapping of its field names to values")
            values[key] = checked_values(nested[key], value or {}, where, f"{prefix}{key}.")
        else:
            values[key] = coerce(prefix + key, value, field_type(cls, key))
    return values


def as_section(name: str, kind: type, value: Any) -> Any:
    """A section's dataclass from what a job was given: the dataclass itself, or a mapping of its fields
    (unknown keys are errors naming `name.key`)."""
    if value is None or isinstance(value, kind):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{name}: a section, expected a mapping of its field names to values, got {value!r}")
    known = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"{name}: unknown key(s) {[f'{name}.{k}' for k in unknown]}; known keys: {sorted(known)}")
    return kind(**value)


def field_type(cls: type, name: str) -> Any:
    hints = typing.get_type_hints(cls)
    kind = hints[name]
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]  # Optional[X] -> X
    return kind


def is_list(kind: Any) -> bool:
    return typing.get_origin(kind) is list


def coerce(key: str, value: Any, kind: Any) -> Any:
    """Convert a YAML or command-line value to the field's type, or raise naming the key."""
    try:
        if value is None:
            return None
        if is_list(kind):
            (item,) = typing.get_args(kind) or (str,)
            items = value if isinstance(value, list) else [value]
            return [coerce(key, v, item) for v in items]
        if kind is bool:
            return value if isinstance(value, bool) else parse_bool(value)
        if kind is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            if isinstance(value, bool):
                raise ValueError(value)
            return int(value)
        if kind is float:
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if kind is str:
            if isinstance(value, (dict, list)):
                raise ValueError(value)
            return str(value)
        if kind is dict or typing.get_origin(kind) is dict:
            if not isinstance(value, dict):
                raise ValueError(value)
            return value
        return value
    except (TypeError, ValueError):
        name = getattr(kind, "__name__", str(kind))
        raise ConfigError(f"{key}: expected {name}, got {value!r}") from None


def parse_bool(text: Any) -> bool:
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def check_choice(key: str, value: Any, choices: typing.Iterable[Any]) -> None:
    choices = list(choices)
    if value not in choices:
        raise ConfigError(f"{key}: {value!r} is not one of {choices}")


def to_dict(config: Any) -> dict[str, Any]:
    """The resolved config as plain data (sections as mappings), for manifests, summaries and trackers; the
    sections a job leaves unset (None: another method's) are left out. A namespace gives its attributes."""
    if not dataclasses.is_dataclass(config):
        return dict(vars(config))
    unset = {name for name in sections(type(config)) if getattr(config, name) is None}
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in unset}
