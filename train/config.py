"""Typed job configuration: dataclass default < YAML file < command line.

A job is one dataclass whose fields carry their help text (`field(metadata={"help": ...})`) and
whose `__post_init__` checks values. YAML keys are exactly the field names and `--field value`
flags override them. Unknown keys, unknown flags and values of the wrong type are errors that
name the key; nothing is read from anywhere else.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

C = TypeVar("C")


class ConfigError(ValueError):
    """A configuration problem, with the offending key in the message."""


def load_config(cls: type[C], argv: list[str] | None = None, description: str = "") -> C:
    """Build `cls` from `--config FILE` and `--field value` overrides in argv."""
    parser = build_parser(cls, description)
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    if args.config:
        values.update(read_yaml(cls, Path(args.config)))
    for f in dataclasses.fields(cls):
        given = getattr(args, f.name)
        if given is not None:
            values[f.name] = coerce(f.name, given, field_type(cls, f.name))
    try:
        return cls(**values)
    except (TypeError, ValueError) as err:
        raise ConfigError(str(err)) from err


def build_parser(cls: type, description: str = "") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description or cls.__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", help="YAML file whose keys are this job's field names")
    for f in dataclasses.fields(cls):
        kind = field_type(cls, f.name)
        help_text = f.metadata.get("help", "")
        if kind is bool:
            parser.add_argument(f"--{f.name}", type=parse_bool, nargs="?", const=True, default=None,
                                help=help_text)
        elif is_list(kind):
            parser.add_argument(f"--{f.name}", nargs="*", default=None, help=help_text)
        else:
            parser.add_argument(f"--{f.name}", default=None, help=help_text)
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
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {unknown}; known keys: {sorted(names)}")
    return {k: coerce(k, v, field_type(cls, k)) for k, v in raw.items()}


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
    return dataclasses.asdict(config)
