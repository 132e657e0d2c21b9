"""Wire encoding: one MessagePack header frame, then one raw frame per array.

    frame 0: msgpack {"v": PROTOCOL_VERSION, "t": type name, "f": {scalar fields},
                      "a": [[array field, dtype, shape], ...]}
    frame 1..n: the arrays' bytes (C order, little endian), in the order of "a"

No pickle anywhere. `decode` trusts nothing: every way input can be wrong raises
ProtocolError with a message that names the problem, and nothing else escapes.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np

from protocol.messages import MESSAGE_TYPES, PROTOCOL_VERSION, Message, ProtocolError

Buffer = bytes | bytearray | memoryview


def _scalar_fields_of(cls: type[Message]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name not in cls.ARRAYS}


def encode(msg: Message) -> list[Buffer]:
    """Message -> frames for `socket.send_multipart(frames, copy=False)`."""
    cls = type(msg)
    scalars = {name: getattr(msg, name) for name in _SCALARS[cls]}
    specs, frames = [], []
    for name, (dtype, ndim) in cls.ARRAYS.items():
        arr = getattr(msg, name)
        assert isinstance(arr, np.ndarray) and arr.dtype == np.dtype(dtype) and arr.ndim == ndim, (
            f"{cls.__name__}.{name}: expected {dtype} ndim {ndim}, got {getattr(arr, 'dtype', type(arr))}"
        )
        arr = np.ascontiguousarray(arr)
        specs.append([name, dtype, list(arr.shape)])
        frames.append(arr.data.cast("B"))
    header = msgpack.packb({"v": PROTOCOL_VERSION, "t": cls.__name__, "f": scalars, "a": specs}, use_bin_type=True)
    return [header, *frames]


def _checker(hint: Any) -> Callable[[Any], bool]:
    """A fast type test for one field, built once per message type (decode is on the hot path)."""
    if typing.get_origin(hint) is list:
        (inner,) = typing.get_args(hint)
        check = _checker(inner)
        return lambda v: type(v) is list and all(map(check, v))
    if hint is float:
        return lambda v: type(v) is float or type(v) is int
    if hint is int:
        return lambda v: type(v) is int
    return lambda v: type(v) is hint


# Per message type, computed once at import (decode is on the hot path):
_SCALARS = {cls: _scalar_fields_of(cls) for cls in MESSAGE_TYPES.values()}
_CHECKERS = {cls: tuple((name, hint, _checker(hint)) for name, hint in fields.items()) for cls, fields in _SCALARS.items()}
# name -> (little-endian dtype, ndim); np.dtype construction is too slow to repeat per message
_ARRAYS = {cls: {n: (np.dtype(d).newbyteorder("<"), nd) for n, (d, nd) in cls.ARRAYS.items()} for cls in MESSAGE_TYPES.values()}


def _nbytes(frame: Any) -> int:
    return frame.nbytes if isinstance(frame, memoryview) else len(frame)


def decode(frames: Sequence[Any], max_frame_bytes: int = 64 << 20) -> Message:
    """frames (bytes, memoryviews or zmq.Frame) -> a validated Message, or ProtocolError."""
    if not frames:
        raise ProtocolError("empty message: no frames")
    bufs = [f.buffer if hasattr(f, "buffer") else f for f in frames]
    sizes = [_nbytes(buf) for buf in bufs]
    for i, size in enumerate(sizes):
        if size > max_frame_bytes:
            raise ProtocolError(f"frame {i}: {size} bytes exceeds the limit of {max_frame_bytes}")
    try:
        header = msgpack.unpackb(bufs[0], raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"header: not valid MessagePack ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header: expected a map, got {type(header).__name__}")
    version = header.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"header.v: protocol version {version!r}, this side speaks {PROTOCOL_VERSION}")
    name = header.get("t")
    cls = MESSAGE_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ProtocolError(f"header.t: unknown message type {name!r}")
    fields, specs = header.get("f"), header.get("a")
    if not isinstance(fields, dict) or not isinstance(specs, list):
        raise ProtocolError(f"{name}: header needs a field map 'f' and an array list 'a'")

    kwargs: dict[str, Any] = {}
    expected = _SCALARS[cls]
    for key in fields.keys() - expected.keys():
        raise ProtocolError(f"{name}.{key}: unknown field")
    for key, hint, ok in _CHECKERS[cls]:
        if key not in fields:
            raise ProtocolError(f"{name}.{key}: missing field")
        value = fields[key]
        if not ok(value):
            raise ProtocolError(f"{name}.{key}: expected {hint}, got {type(value).__name__}")
        kwargs[key] = float(value) if hint is float else value

    if len(specs) != len(cls.ARRAYS) or len(bufs) != 1 + len(cls.ARRAYS):
        raise ProtocolError(f"{name}: expected {len(cls.ARRAYS)} array frames, header lists {len(specs)}, got {len(bufs) - 1}")
    arrays = _ARRAYS[cls]
    for spec, buf, size in zip(specs, bufs[1:], sizes[1:], strict=True):
        if not (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[0], str)):
            raise ProtocolError(f"{name}: malformed array spec {spec!r}")
        key, dtype, shape = spec
        if key not in arrays or key in kwargs:
            raise ProtocolError(f"{name}.{key}: unexpected or repeated array")
        want_dtype, want_ndim = arrays[key]
        if dtype != cls.ARRAYS[key][0]:
            raise ProtocolError(f"{name}.{key}: dtype {dtype!r}, expected {cls.ARRAYS[key][0]}")
        if not (type(shape) is list and len(shape) == want_ndim and all(type(d) is int and d >= 0 for d in shape)):
            raise ProtocolError(f"{name}.{key}: shape {shape!r}, expected {want_ndim} non-negative dims")
        count = math.prod(shape)
        if count * want_dtype.itemsize != size:
            raise ProtocolError(f"{name}.{key}: shape {shape} needs {count * want_dtype.itemsize} bytes, frame has {size}")
        kwargs[key] = np.frombuffer(buf, dtype=want_dtype, count=count).reshape(shape)
    msg = cls(**kwargs)
    msg.check()
    return msg
