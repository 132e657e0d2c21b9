"""Wire encoding: one MessagePack header frame, then one raw frame per array.

    frame 0: msgpack [PROTOCOL_VERSION, type name, dtypes, [field values..., array dims...]]
    frame 1..n: the arrays' bytes (C order, little endian), in `cls.ARRAYS` order

The header is positional. `dtypes` is one string, the arrays' dtypes joined by spaces.
The values list holds the scalar fields in the dataclass's field order (array fields
left out), then every array's dims (each field's rank is fixed by ARRAYS), so a type
always has the same number of values. Both sides derive the order from
protocol/messages.py, and any layout change bumps PROTOCOL_VERSION.

Positional and flat because decode runs once per rollout group on the hub's one
thread: with a map of named fields (protocol 1), unpacking and per-field lookups cost
more than the checks. Here the common case is checked in a few C-level comparisons:
the types of all values and dims at once, all dtypes at once, all element counts at
once; only a failure walks the fields one by one to name what is wrong. About 9 us
per 8x64-token group instead of 39.

Compiled fast paths (protocol/_fastcodec.pyx, built by `pip install`) run first. They take
the common well-formed case and decline anything else with None, and then the Python code
here runs on the same input: it names the error, or handles the rare legal case. Their
contract is "the Python result, or None", fuzzed in tests/test_fastcodec.py. In the
hub's receive loop the Python decoder cost 17.5 us per 8x64-token group, against 38 us
for the receive itself, which held the channel at 0.6x raw ZeroMQ. The compiled one costs
2.4 us under timeit (Python: 8.9), and encode 1.9 (3.8). bench/channel.py has the
end-to-end figures.

No pickle anywhere. `decode` trusts nothing: every way input can be wrong raises
ProtocolError with a message that names the problem, and nothing else escapes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import operator
import sys
import typing
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

from protocol.messages import MESSAGE_TYPES, PROTOCOL_VERSION, Message, ProtocolError, RolloutGroup

Buffer = bytes | bytearray | memoryview | np.ndarray  # what encode returns; pyzmq sends any of them (buffer protocol)
_DTYPE_NDIM, _CONTIGUOUS = operator.attrgetter("dtype", "ndim"), operator.attrgetter("flags.c_contiguous")
_NBYTES_TYPES = (memoryview, np.ndarray)  # frames whose len() is not their size in bytes


def _checker(hint: Any) -> Callable[[Any], bool]:
    """A type test for one field value as msgpack decodes it."""
    if typing.get_origin(hint) is list:
        (inner,) = typing.get_args(hint)
        if inner in (str, int):  # a flat list: one C-level pass over the element types
            allowed = {inner}
            return lambda v: type(v) is list and set(map(type, v)) <= allowed
        check = _checker(inner)
        return lambda v: type(v) is list and all(map(check, v))
    if hint is float:
        return lambda v: type(v) is float or type(v) is int
    return lambda v: type(v) is hint


def _hint_name(hint: Any) -> str:
    return str(hint) if typing.get_origin(hint) else hint.__name__


@dataclasses.dataclass(frozen=True, slots=True)
class _Schema:
    """One message type's wire layout and checks, built once at import."""

    cls: type[Message]
    fields: tuple[str, ...]  # scalar fields, header order
    hints: tuple[Any, ...]
    types: tuple[type, ...]  # exact msgpack types of well-formed values and dims: the fast path compares these at once
    lists: tuple[tuple[int, Callable[[Any], bool]], ...]  # list fields: their elements are checked too
    checks: tuple[Callable[[Any], bool], ...]  # per field, for the slow path that names the error
    arrays: tuple[str, ...]
    dtype_names: list[str]
    dtypes_wire: str  # dtype_names joined by spaces, as the header carries them
    dtypes: tuple[np.dtype, ...]  # little endian
    itemsizes: tuple[int, ...]
    ranks: tuple[int, ...]
    layout: tuple[tuple[np.dtype, int], ...]  # (dtype, rank) per array, as encode asserts them
    flat: bool  # every array is 1-D, so dims are the element counts
    build: Callable[[list[Any], list[np.ndarray]], Message]  # (field values, arrays) -> message
    values_of: Callable[[Message], tuple[Any, ...]]
    arrays_of: Callable[[Message], tuple[np.ndarray, ...]]

    @classmethod
    def of(cls, msg_cls: type[Message]) -> _Schema:
        hints = typing.get_type_hints(msg_cls)
        fields = tuple(f.name for f in dataclasses.fields(msg_cls) if f.name not in msg_cls.ARRAYS)
        types = tuple(typing.get_origin(hints[f]) or hints[f] for f in fields)
        assert all(t in (str, int, float, bool, list) for t in types), f"{msg_cls.__name__}: unsupported field type"
        arrays = tuple(msg_cls.ARRAYS)
        ranks = tuple(r for _, r in msg_cls.ARRAYS.values())
        dtypes = tuple(np.dtype(d).newbyteorder("<") for d, _ in msg_cls.ARRAYS.values())
        return cls(
            cls=msg_cls, fields=fields, hints=tuple(hints[f] for f in fields), types=types + (int,) * sum(ranks),
            lists=tuple((i, _checker(hints[f])) for i, f in enumerate(fields) if types[i] is list),
            checks=tuple(_checker(hints[f]) for f in fields),
            arrays=arrays, dtype_names=[d for d, _ in msg_cls.ARRAYS.values()],
            dtypes_wire=" ".join(d for d, _ in msg_cls.ARRAYS.values()), dtypes=dtypes,
            itemsizes=tuple(d.itemsize for d in dtypes), ranks=ranks, layout=tuple(zip(dtypes, ranks, strict=True)), flat=all(r == 1 for r in ranks),
            build=_constructor(msg_cls, fields, arrays), values_of=_getter(fields), arrays_of=_getter(arrays),
        )

    def field_values(self, values: Any) -> list[Any]:
        """Slow path, taken when the fast type comparison fails: name the bad value, or convert int -> float."""
        name, nf = self.cls.__name__, len(self.fields)
        if type(values) is not list:
            raise ProtocolError(f"{name}: header values must be an array, got {type(values).__name__}")
        if len(values) < nf:
            raise ProtocolError(f"{name}.{self.fields[len(values)]}: missing field ({len(values)} values for {nf} fields)")
        out = []
        for field, hint, ok, value in zip(self.fields, self.hints, self.checks, values, strict=False):
            if not ok(value):
                raise ProtocolError(f"{name}.{field}: expected {_hint_name(hint)}, got {type(value).__name__}")
            out.append(float(value) if hint is float else value)
        return out + self.shape_dims(values[nf:])

    def shape_dims(self, dims: list[Any]) -> list[int]:
        """The dims after the fields: as many as the arrays' ranks add up to, each a non-negative int."""
        name, at = self.cls.__name__, 0
        for field, rank in zip(self.arrays, self.ranks, strict=True):
            shape = dims[at : at + rank]
            at += rank
            if len(shape) != rank or not all(type(d) is int and d >= 0 for d in shape):
                raise ProtocolError(f"{name}.{field}: shape {shape!r}, expected {rank} non-negative int dims")
        if at != len(dims):
            raise ProtocolError(f"{name}: {len(dims) - at} unknown value(s) after the last field and array dims")
        return dims

    def explain_dtypes(self, dtypes: Any) -> typing.NoReturn:
        name = self.cls.__name__
        got = dtypes.split(" ") if type(dtypes) is str else None
        if got is not None and len(got) == len(self.arrays):
            for field, dtype, want in zip(self.arrays, got, self.dtype_names, strict=True):
                if dtype != want:
                    raise ProtocolError(f"{name}.{field}: dtype {dtype!r}, expected {want}")
        raise ProtocolError(f"{name}: array dtypes {dtypes!r}, expected {self.dtypes_wire!r} for {list(self.arrays)}")

    def explain_sizes(self, sizes: list[int], error: Exception) -> typing.NoReturn:
        name = self.cls.__name__
        for field, dtype_name, itemsize, size in zip(self.arrays, self.dtype_names, self.itemsizes, sizes[1:], strict=True):
            if size % itemsize:
                raise ProtocolError(f"{name}.{field}: frame of {size} bytes is not a whole number of {dtype_name} ({itemsize} bytes)")
        raise ProtocolError(f"{name}: array frames of {sizes[1:]} bytes do not fit {self.dtype_names} ({error})")

    def shaped(self, arrays: list[np.ndarray], dims: list[int]) -> list[np.ndarray]:
        """Arrays in their declared shapes (dims already type-checked), or name the one that disagrees with its frame."""
        out, at = [], 0
        for field, rank, arr in zip(self.arrays, self.ranks, arrays, strict=True):
            shape = dims[at : at + rank]
            at += rank
            if min(shape, default=0) < 0:
                raise ProtocolError(f"{self.cls.__name__}.{field}: shape {shape}, expected {rank} non-negative int dims")
            if math.prod(shape) != arr.size:
                raise ProtocolError(f"{self.cls.__name__}.{field}: shape {shape} needs {math.prod(shape) * arr.itemsize} bytes, frame has {arr.nbytes}")
            out.append(arr.reshape(shape))
        return out


def _constructor(cls: type[Message], fields: tuple[str, ...], arrays: tuple[str, ...]) -> Callable[[list[Any], list[np.ndarray]], Message]:
    """A generated `build(values, arrays)` that makes the instance and stores every field in its slot:
    `m = new(cls); m.a = values[0]; ...; m.x = arrays[0]; ...`. The dataclass's own __init__ does the same
    stores behind a keyword call, whose argument parsing is most of its cost: 0.37 vs 1.0 us for a
    RolloutGroup, and `cls(**dict(zip(names, values)))` was 2.9. Every field is stored (the names come from
    the dataclass), and messages define no __post_init__ for this to skip: checked here."""
    names = fields + arrays
    assert all(n.isidentifier() for n in names)
    assert {f.name for f in dataclasses.fields(cls)} == set(names), f"{cls.__name__}: a field is neither a value nor an array"
    assert not hasattr(cls, "__post_init__") and not cls.__dataclass_params__.frozen, f"{cls.__name__}: build would skip __init__'s work"  # type: ignore[attr-defined]
    stores = [f"    m.{n} = values[{i}]" for i, n in enumerate(fields)] + [f"    m.{n} = arrays[{i}]" for i, n in enumerate(arrays)]
    namespace: dict[str, Any] = {"cls": cls, "new": object.__new__}
    exec("def build(values, arrays):\n    m = new(cls)\n" + "\n".join(stores) + "\n    return m\n", namespace)
    return typing.cast(Callable[[list[Any], list[np.ndarray]], Message], namespace["build"])


def _getter(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    if len(names) == 1:  # attrgetter of one name returns the value, not a 1-tuple
        (only,) = names
        return lambda obj: (getattr(obj, only),)
    return operator.attrgetter(*names) if names else (lambda _: ())


_SCHEMAS = {name: _Schema.of(cls) for name, cls in MESSAGE_TYPES.items()}
_BY_CLASS = {s.cls: s for s in _SCHEMAS.values()}


def encode(msg: Message) -> list[Buffer]:
    """Message -> frames for `socket.send_multipart(frames, copy=False)`.

    Array frames are the message's arrays themselves (no copy: zmq reads them through the buffer
    protocol), so their byte size is `.nbytes`, not len().
    """
    frames = _encode_fast(msg)
    return frames if frames is not None else encode_python(msg)


def encode_python(msg: Message) -> list[Buffer]:
    """`encode` where the compiled fast path declines (an array to make contiguous, or a broken invariant to name)."""
    s = _BY_CLASS[type(msg)]
    arrays = s.arrays_of(msg)
    # Internal invariants (our own code builds messages), checked for all arrays at once.
    assert tuple(map(_DTYPE_NDIM, arrays)) == s.layout, (
        f"{s.cls.__name__}: arrays {[(f, a.dtype, a.ndim) for f, a in zip(s.arrays, arrays, strict=True)]}, "
        f"expected dtypes {s.dtype_names} and ranks {s.ranks}"
    )
    if not all(map(_CONTIGUOUS, arrays)):
        arrays = tuple(map(np.ascontiguousarray, arrays))
    dims = list(map(len, arrays)) if s.flat else [d for a in arrays for d in a.shape]
    header = msgpack.packb((PROTOCOL_VERSION, s.cls.__name__, s.dtypes_wire, [*s.values_of(msg), *dims]))
    return [header, *arrays]


def decode(frames: Sequence[Any], max_frame_bytes: int = 64 << 20) -> Message:
    """frames (bytes, memoryviews or zmq.Frame) -> a validated Message, or ProtocolError."""
    msg = _decode_fast(frames, max_frame_bytes)
    return msg if msg is not None else decode_python(frames, max_frame_bytes)


def decode_python(frames: Sequence[Any], max_frame_bytes: int = 64 << 20) -> Message:
    """The decoder that names every error; `decode` runs it where the compiled fast path declines."""
    if not frames:
        raise ProtocolError("empty message: no frames")
    sizes = [f.nbytes if type(f) in _NBYTES_TYPES else len(f) for f in frames]  # len(): bytes, bytearray, zmq.Frame
    if max(sizes) > max_frame_bytes:
        i = next(i for i, size in enumerate(sizes) if size > max_frame_bytes)
        raise ProtocolError(f"frame {i}: {sizes[i]} bytes exceeds the limit of {max_frame_bytes}")
    try:
        header = msgpack.unpackb(frames[0])
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"header: not valid MessagePack ({type(e).__name__}: {e})") from None
    if type(header) is not list or len(header) != 4:
        if type(header) is dict and header.get("v") != PROTOCOL_VERSION:  # protocol 1 sent a map: name its version
            raise ProtocolError(f"header.v: protocol version {header.get('v')!r}, this side speaks {PROTOCOL_VERSION}")
        raise ProtocolError(f"header: expected [version, type, dtypes, values], got {type(header).__name__}")
    version, name, dtypes, values = header
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"header.v: protocol version {version!r}, this side speaks {PROTOCOL_VERSION}")
    s = _SCHEMAS.get(name) if type(name) is str else None
    if s is None:
        raise ProtocolError(f"header.t: unknown message type {name!r}")

    if type(values) is not list or tuple(map(type, values)) != s.types:
        values = s.field_values(values)  # names the bad value, or converts ints sent for floats
    for i, ok in s.lists:
        if not ok(values[i]):
            raise ProtocolError(f"{name}.{s.fields[i]}: expected {_hint_name(s.hints[i])}, got a list of other types")

    if len(frames) != 1 + len(s.arrays):
        raise ProtocolError(f"{name}: expected {len(s.arrays)} array frames, got {len(frames) - 1}")
    if dtypes != s.dtypes_wire:
        s.explain_dtypes(dtypes)
    try:
        arrays = list(map(np.frombuffer, frames[1:], s.dtypes))  # zero copy, the whole frame each
    except (TypeError, ValueError) as e:  # numpy's own check: a frame that is not a whole number of elements
        s.explain_sizes(sizes, e)
    dims = values[len(s.fields) :]  # ints, checked with the fields above
    if not (s.flat and list(map(len, arrays)) == dims):
        arrays = s.shaped(arrays, dims)  # reshapes, or names the array whose frame disagrees with its dims
    msg = s.build(values, arrays)
    msg.check()
    return msg


def _plans() -> list[Any]:
    """The compiled fast paths' per-type plans: for the types whose arrays are all 1-D and whose lists hold str."""
    assert tuple(RolloutGroup.ARRAYS) == ("prompt_tokens", "lengths", "completion_tokens", "behaviour_logprobs", "rewards",
                                          "reward_parts"), \
        "_fastcodec._rollout_ok reads RolloutGroup's arrays by position"
    plans = []
    for name, s in _SCHEMAS.items():
        str_lists = [i for i, _ in s.lists]  # the list fields
        if s.flat and all(s.hints[i] == list[str] for i in str_lists):
            plans.append(_fastcodec.Plan(s.cls, name, s.types, s.fields, s.arrays, s.dtypes_wire, s.dtypes, str_lists,
                                         s.cls is RolloutGroup))
    return plans


def _encode_declined(msg: Message) -> list[Any] | None:
    return None


def _decode_declined(frames: Any, max_frame_bytes: int) -> Message | None:
    return None


def _load_fastcodec() -> Any:
    """protocol._fastcodec (compiled by `pip install`, setup.py), or None with a warning where it is missing or
    was built from another version of the .pyx beside it (a stale build is never used)."""
    try:
        from protocol import _fastcodec
    except ImportError as e:  # no C compiler at install, or a checkout never installed
        reason = f"not built ({e})"
    else:
        source = Path(__file__).with_name("_fastcodec.pyx")
        if not source.exists() or hashlib.sha256(source.read_bytes()).hexdigest() == _fastcodec.SOURCE_SHA:
            return _fastcodec
        reason = "stale: built from another version of protocol/_fastcodec.pyx"
    warnings.warn(f"protocol._fastcodec is {reason}. `pip install -e .` builds it (needs a C compiler); until then "
                  "messages are encoded and decoded in Python alone, about 3x slower.", RuntimeWarning, stacklevel=2)
    return None


_fastcodec = _load_fastcodec()
_encode_fast, _decode_fast = _encode_declined, _decode_declined
if _fastcodec is not None and sys.byteorder == "little":  # the fast paths read the little-endian wire format natively
    _fastcodec.setup(_plans(), msgpack.packb, msgpack.unpackb, PROTOCOL_VERSION, (bytes, zmq.Frame))
    _encode_fast, _decode_fast = _fastcodec.encode_fast, _fastcodec.decode_fast
