"""The base of every wire message and the error a bad one raises (protocol/messages.py, protocol/ops_messages.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


class ProtocolError(ValueError):
    """Input that is not a valid message; the text says what was wrong."""


@dataclass(kw_only=True, slots=True)
class Message:
    ARRAYS: ClassVar[dict[str, tuple[str, int]]] = {}

    def check(self) -> None:
        """The message's own rules (cross-field consistency, ranges): the one place they are written. Raises
        ProtocolError. `codec.decode` checks every field's type against the annotations, then runs this."""
