"""A Config from a TOML file plus `section.field=value` overrides, and back to TOML.

The loader checks each value's type (a `Literal[...]` field takes its choices' type); the values themselves
are checked by the sections as they are built (their `__post_init__`) and by Config (protocol/config/root.py).
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from protocol.config.errors import ConfigError
from protocol.config.root import Config


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a TOML file (or the defaults), apply overrides, validate. Raises ConfigError."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError as e:
            raise ConfigError(f"config file {path}: not found") from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path}: {e}") from e
    for item in overrides or []:
        keys, value = _parse_override(item)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {k} is not a table")
        node[keys[-1]] = value
    return _build(Config, data, "")


@dataclass(frozen=True, slots=True)
class _Override:
    """A command-line value: its raw text for str fields (`train.cpu_affinity=0`), else its TOML value."""

    text: str
    value: Any


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected section.field=value")
    key, raw = item.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # bare strings need no quotes on the command line
    text = value if isinstance(value, str) else raw
    return key.strip().split("."), _Override(text, value)


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix}: expected a table, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(f"{prefix}{key}: unknown field (known: {', '.join(sorted(names))})")
    kwargs = {}
    for key, value in data.items():
        typ = hints[key]
        if dataclasses.is_dataclass(typ):
            kwargs[key] = _build(typing.cast(type, typ), value, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(prefix + key, typ, value)
    return cls(**kwargs)  # its __post_init__ checks the values


def _coerce(name: str, typ: Any, value: Any) -> Any:
    if typing.get_origin(typ) is list:  # list[str] (rollout.stop): a TOML array, also on the command line
        value = value.value if isinstance(value, _Override) else value
        (item,) = typing.get_args(typ)
        if not isinstance(value, list) or not all(isinstance(v, item) for v in value):
            raise ConfigError(f'{name}: expected a list of {item.__name__} such as ["a", "b"], got {value!r}')
        return list(value)
    if typing.get_origin(typ) is Literal:  # its section checks the choice; here only its type (str or int)
        (typ,) = {type(choice) for choice in typing.get_args(typ)}
    if isinstance(value, _Override):
        value = value.text if typ is str else value.value
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is bool or isinstance(value, bool):
        if typ is not bool or not isinstance(value, bool):
            raise ConfigError(f"{name}: expected {typ.__name__}, got {value!r}")
        return value
    if not isinstance(value, typ):
        raise ConfigError(f"{name}: expected {typ.__name__}, got {type(value).__name__} {value!r}")
    return value


def dump_toml(cfg: Config) -> str:
    """The resolved config as TOML (written to the run directory)."""
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def toml_value(value: Any) -> str:
    """A field's value as TOML text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):  # JSON's escapes are TOML's: a newline (prompt templates have them) stays "\\n"
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):  # JSON's string escapes are TOML's ("\n" is a common stop string)
        return "[" + ", ".join(json.dumps(v, ensure_ascii=False) for v in value) + "]"
    return repr(value)
