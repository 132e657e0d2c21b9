"""Types of the compiled fast paths in protocol/_fastcodec.pyx (see its doc for the contract)."""

from collections.abc import Callable, Sequence
from typing import Any

from protocol.messages import Message

class Plan:
    def __init__(self, cls: type[Message], name: str, types: Sequence[type], fields: Sequence[str], arrays: Sequence[str],
                 dtypes_wire: str, dtypes: Sequence[Any], str_lists: Sequence[int], rollout: bool) -> None: ...

def setup(plans: Sequence[Plan], packb: Callable[[Any], bytes], unpackb: Callable[[Any], Any], version: int,
          frame_types: Sequence[type]) -> None: ...
def encode_fast(msg: Message) -> list[Any] | None: ...
def decode_fast(frames: Any, max_frame_bytes: int) -> Message | None: ...

SOURCE_SHA: str
