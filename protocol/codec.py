"""Wire encoding: one MessagePack header frame that names every field, then one raw frame per array.

    frame 0: msgpack {"v": PROTOCOL_VERSION,
                      "t": the type's name ("RolloutGroup"),
                      "f": {field name: value, ...},           every field that is not an array
                      "a": [[field name, dtype, shape], ...]}  one entry per array frame, in frame order
    frame 1..n: the arrays' bytes (C order, little endian), in the type's ARRAYS order

A map, so the bytes say what they hold (any MessagePack tool prints a header readably) and nothing
depends on a field's position: adding a field to a message is a new key, and every layout change still
bumps PROTOCOL_VERSION. Arrays never pass through MessagePack: `decode` reads each frame in place with
numpy (zero copy; a received array is a view of its zmq frame).

Plain Python, and plain on purpose: a GPU fleet delivers a rollout group every few tens of milliseconds,
and decoding and checking one takes the hub microseconds. What matters is what the hub admits end to end
on one core: `python -m bench.channel` measures it (figures in docs/benchmarks.md).

Validation, in two places written once each. Here: the wire's shape and every field's type, taken from
the message dataclass's annotations (an int is accepted for a float and converted). In
protocol/messages.py: each message's `check()`, its cross-field rules (lengths that add up, finite
rewards, version order), which `decode` runs last. No pickle anywhere. `decode` trusts nothing: every way
input can be wrong raises ProtocolError with a message that names the problem, and nothing else escapes.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
import typing
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np

from protocol.messages import MESSAGE_TYPES, PROTOCOL_VERSION, Message, ProtocolError

Buffer = bytes | np.ndarray  # what encode returns; pyzmq sends either (buffer protocol)
HEADER_KEYS = ("v", "t", "f", "a")

_short = reprlib.Repr()  # the peer's input quoted in an error, cut short: it may be megabytes
_short.maxstring = _short.maxother = 80
_quote = _short.repr


def _checker(hint: Any) -> Callable[[Any], bool]:
    """A type test for one field value as msgpack decodes it (bool is not an int here, nor bytes a str)."""
    if typing.get_origin(hint) is list:
        (inner,) = typing.get_args(hint)
        check = _checker(inner)
        return lambda v: type(v) is list and all(map(check, v))
    if hint is float:
        return lambda v: type(v) is float or type(v) is int
    assert hint in (str, int, bool), f"unsupported field type {hint}"
    return lambda v: type(v) is hint


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    hint: Any
    ok: Callable[[Any], bool]

    def describe(self) -> str:
        return str(self.hint) if typing.get_origin(self.hint) else self.hint.__name__


@dataclasses.dataclass(frozen=True)
class _Array:
    name: str
    dtype: np.dtype  # little endian, as on the wire
    wire_dtype: str  # numpy's name for it, as the header carries it ("int32")
    ndim: int


@dataclasses.dataclass(frozen=True)
class _Schema:
    """One message type's fields and arrays, read once from its dataclass."""

    cls: type[Message]
    fields: tuple[_Field, ...]
    arrays: tuple[_Array, ...]

    @classmethod
    def of(cls, msg_cls: type[Message]) -> _Schema:
        hints = typing.get_type_hints(msg_cls)
        fields = tuple(
            _Field(f.name, hints[f.name], _checker(hints[f.name])) for f in dataclasses.fields(msg_cls) if f.name not in msg_cls.ARRAYS
        )
        arrays = tuple(_Array(name, np.dtype(dtype).newbyteorder("<"), dtype, ndim) for name, (dtype, ndim) in msg_cls.ARRAYS.items())
        return cls(msg_cls, fields, arrays)


_SCHEMAS = {name: _Schema.of(cls) for name, cls in MESSAGE_TYPES.items()}


def encode(msg: Message) -> list[Buffer]:
    """Message -> frames for `socket.send_multipart(frames, copy=False)`.

    Array frames are the message's arrays themselves (no copy: zmq reads them through the buffer protocol),
    so their size in bytes is `.nbytes`, not len().
    """
    s = _SCHEMAS[type(msg).__name__]
    arrays = [getattr(msg, a.name) for a in s.arrays]
    for a, arr in zip(s.arrays, arrays, strict=True):  # our own code builds messages: an internal invariant
        assert isinstance(arr, np.ndarray) and arr.dtype == a.dtype and arr.ndim == a.ndim, (
            f"{s.cls.__name__}.{a.name}: {type(arr).__name__} {getattr(arr, 'dtype', '')} of rank {getattr(arr, 'ndim', '')}, "
            f"expected {a.wire_dtype} of rank {a.ndim}"
        )
    arrays = [np.ascontiguousarray(arr) for arr in arrays]  # no copy if it already is
    header = {
        "v": PROTOCOL_VERSION,
        "t": s.cls.__name__,
        "f": {f.name: getattr(msg, f.name) for f in s.fields},
        "a": [[a.name, a.wire_dtype, list(arr.shape)] for a, arr in zip(s.arrays, arrays, strict=True)],
    }
    return [msgpack.packb(header), *arrays]


def decode(frames: Sequence[Any], max_frame_bytes: int = 64 << 20) -> Message:
    """frames (bytes, memoryviews or zmq.Frame) -> a validated Message, or ProtocolError."""
    if not frames:
        raise ProtocolError("empty message: no frames")
    sizes = [_nbytes(i, f) for i, f in enumerate(frames)]
    for i, size in enumerate(sizes):
        if size > max_frame_bytes:
            raise ProtocolError(f"frame {i}: {size} bytes exceeds the limit of {max_frame_bytes}")
    s, header = _header(frames[0])
    name = s.cls.__name__
    values = _field_values(s, header["f"])
    specs = header["a"]
    if type(specs) is not list or len(specs) != len(s.arrays):
        raise ProtocolError(f"{name}: header.a must list its {len(s.arrays)} arrays {[a.name for a in s.arrays]}, got {_quote(specs)}")
    if len(frames) != 1 + len(s.arrays):
        raise ProtocolError(f"{name}: expected {len(s.arrays)} array frames, got {len(frames) - 1}")
    for a, spec, frame, size in zip(s.arrays, specs, frames[1:], sizes[1:], strict=True):
        values[a.name] = _array(name, a, spec, frame, size)
    msg = s.cls(**values)
    msg.check()
    return msg


def _nbytes(i: int, frame: Any) -> int:
    try:
        return memoryview(frame).nbytes  # len() of a memoryview or an array counts elements, not bytes
    except TypeError:
        raise ProtocolError(f"frame {i}: {type(frame).__name__} is not a buffer") from None


def _header(frame: Any) -> tuple[_Schema, dict[str, Any]]:
    """The header map, with a known version and type; the schema of that type."""
    try:
        header = msgpack.unpackb(frame)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"header: not valid MessagePack ({type(e).__name__}: {e})") from None
    if type(header) is dict and "v" in header:
        version = header["v"]
    elif type(header) is list and header:  # protocols 2-5 sent [version, type, dtypes, values]: name the mismatch
        version = header[0]
    else:
        raise ProtocolError(f"header: expected a map of {', '.join(HEADER_KEYS)}, got {_quote(header)}")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"header.v: protocol version {_quote(version)}, this side speaks {PROTOCOL_VERSION}")
    if type(header) is not dict or set(header) != set(HEADER_KEYS):
        raise ProtocolError(f"header: expected a map of {', '.join(HEADER_KEYS)}, got {_quote(header)}")
    name = header["t"]
    s = _SCHEMAS.get(name) if type(name) is str else None
    if s is None:
        raise ProtocolError(f"header.t: unknown message type {_quote(name)}")
    return s, header


def _field_values(s: _Schema, given: Any) -> dict[str, Any]:
    """Every field, each of its declared type: none missing, none unknown."""
    name = s.cls.__name__
    if type(given) is not dict:
        raise ProtocolError(f"{name}: header.f must be a map of field values, got {type(given).__name__}")
    values = {}
    for f in s.fields:
        if f.name not in given:
            raise ProtocolError(f"{name}.{f.name}: missing field")
        value = given[f.name]
        if not f.ok(value):
            got = "a list of other types" if type(value) is list and typing.get_origin(f.hint) is list else type(value).__name__
            raise ProtocolError(f"{name}.{f.name}: expected {f.describe()}, got {got}")
        values[f.name] = float(value) if f.hint is float else value
    if len(given) != len(values):
        unknown = [k for k in given if k not in values]
        raise ProtocolError(f"{name}: unknown field(s) {_quote(unknown)}")
    return values


def _array(name: str, a: _Array, spec: Any, frame: Any, size: int) -> np.ndarray:
    """One array frame as numpy, in place, after its header entry [field name, dtype, shape] is checked against it."""
    if type(spec) is not list or len(spec) != 3:
        raise ProtocolError(f"{name}.{a.name}: array entry {_quote(spec)}, expected [name, dtype, shape]")
    field, dtype, shape = spec
    if field != a.name:
        raise ProtocolError(f"{name}: array frame {_quote(field)} where {a.name!r} belongs")
    if dtype != a.wire_dtype:
        raise ProtocolError(f"{name}.{a.name}: dtype {_quote(dtype)}, expected {a.wire_dtype}")
    if type(shape) is not list or len(shape) != a.ndim or not all(type(d) is int and d >= 0 for d in shape):
        raise ProtocolError(f"{name}.{a.name}: shape {_quote(shape)}, expected {a.ndim} non-negative int dims")
    if size % a.dtype.itemsize:
        raise ProtocolError(f"{name}.{a.name}: frame of {size} bytes is not a whole number of {a.wire_dtype} ({a.dtype.itemsize} bytes)")
    if math.prod(shape) * a.dtype.itemsize != size:
        raise ProtocolError(f"{name}.{a.name}: shape {shape} needs {math.prod(shape) * a.dtype.itemsize} bytes, frame has {size}")
    return np.frombuffer(frame, a.dtype).reshape(shape)  # zero copy: a view that keeps the frame alive
