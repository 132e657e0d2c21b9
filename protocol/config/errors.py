"""ConfigError, and the helpers with which each section's `__post_init__` checks its own fields."""

from __future__ import annotations

import typing
from typing import Any, Literal


class ConfigError(ValueError):
    """A user mistake in the config; the message is one line that names the field."""


def need(ok: bool, name: str, why: str) -> None:
    """ConfigError("NAME: WHY") unless `ok`. NAME is the dotted field, as the user writes it in an override."""
    if not ok:
        raise ConfigError(f"{name}: {why}")


def check_choices(section: Any, prefix: str, skip: tuple[str, ...] = ()) -> None:
    """Every `Literal[...]` field of `section` holds one of its choices; the error names the field and lists them.

    `prefix` is the section's name in the config file (the class does not know it); `skip` names a field that
    its section checks itself (actor.cpu_gemm: a CUDA actor leaves it unchecked).
    """
    for name, typ in typing.get_type_hints(type(section)).items():
        if typing.get_origin(typ) is Literal and name not in skip:
            value, allowed = getattr(section, name), typing.get_args(typ)
            need(value in allowed, f"{prefix}.{name}", f"{value!r} must be {alternatives(allowed)}")


def alternatives(choices: tuple[Any, ...]) -> str:
    """("a", "b", "c") -> "a, b or c"; a longer list reads "one of a, b, c, d"."""
    words = [str(c) for c in choices]
    if len(words) > 3:
        return "one of " + ", ".join(words)
    return " or ".join([", ".join(words[:-1]), words[-1]]) if len(words) > 1 else words[0]


def parse_cpus(spec: str, name: str) -> set[int]:
    """'0,2-3' -> {0, 2, 3}; ConfigError naming the field when malformed."""
    cpus: set[int] = set()
    try:
        for part in filter(None, spec.split(",")):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError as e:
        raise ConfigError(f"{name}: {spec!r} is not a CPU list like '0,2-3'") from e
    return cpus
