"""The compiled fast paths (protocol/_fastcodec.pyx) against the Python codec they shortcut.

Their contract: return exactly what the Python code returns, or None (decline). Each test checks both
halves. Where the Python decoder accepts a normal message, the fast path must accept it too, or it
would be declining everything and these tests would pass on a fast path that never runs.
"""

import gc
import math

import msgpack
import numpy as np
import pytest
import zmq
from conftest import rollout_group
from hypothesis import example, given, settings
from hypothesis import strategies as hs
from test_codec import _ANY, SAMPLES, _header, _with_header

from protocol import codec
from protocol import messages as m

LIMIT = 64 << 20
_GROUP = next(s for s in SAMPLES if type(s) is m.RolloutGroup)
_GROUP_VALUES = codec._SCHEMAS["RolloutGroup"].fields
PLANNED = {type(s).__name__ for s in SAMPLES} - {"WeightSync"}  # WeightSync's list[list[int]] stays in Python


def _same_value(x, y):
    if isinstance(x, np.ndarray):
        return type(y) is np.ndarray and x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
    if isinstance(x, float) and math.isnan(x):
        return type(y) is float and math.isnan(y)
    return type(x) is type(y) and x == y


def _assert_same_message(a, b):
    assert type(a) is type(b)
    for name in a.__dataclass_fields__:
        assert _same_value(getattr(a, name), getattr(b, name)), name


def _compare(frames, limit=LIMIT):
    """Decode with both; the fast path returns the Python result or declines (always where Python raises).
    Returns (fast, python): None for a decline / a ProtocolError."""
    try:
        want = codec.decode_python(frames, limit)
    except m.ProtocolError:
        want = None
    got = codec._decode_fast(frames, limit)
    if got is not None:
        assert want is not None, "the fast path accepted what the Python decoder refuses"
        _assert_same_message(got, want)
    if type(frames) is list and all(type(f) is bytes for f in frames):  # the same bytes as zmq gives them
        again = codec._decode_fast([zmq.Frame(f) for f in frames], limit)
        assert (again is None) == (got is None)
        if again is not None:
            _assert_same_message(again, want)
    return got, want


def test_the_compiled_module_is_built_and_in_use():
    assert codec._fastcodec is not None, "protocol._fastcodec is not built: pip install -e . builds it"
    for msg in SAMPLES:
        frames = [bytes(f) for f in codec.encode_python(msg)]
        fast, want = _compare(frames)
        assert want is not None
        assert (fast is not None) == (type(msg).__name__ in PLANNED), type(msg).__name__
        assert (codec._encode_fast(msg) is not None) == (type(msg).__name__ in PLANNED), type(msg).__name__


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda x: type(x).__name__)
def test_encode_fast_gives_the_python_frames(msg):
    fast = codec._encode_fast(msg)
    if fast is None:
        return  # declined (WeightSync: checked above)
    want = codec.encode_python(msg)
    assert fast[0] == want[0]
    assert len(fast) == len(want) and all(a is b for a, b in zip(fast[1:], want[1:], strict=True))  # the arrays themselves


def test_encode_fast_declines_what_python_must_fix_or_refuse():
    g = rollout_group(n=4)
    g.completion_tokens = np.arange(2 * len(g.completion_tokens), dtype=np.int32)[::2]  # not contiguous: Python copies it
    assert codec._encode_fast(g) is None
    assert codec.decode(codec.encode(g)).completion_tokens.tolist() == g.completion_tokens.tolist()
    for wrong in (np.zeros(3, np.int64), np.zeros((3, 1), np.int32), np.zeros(3, ">i4"), [1, 2, 3]):
        g = rollout_group()
        g.prompt_tokens = wrong
        assert codec._encode_fast(g) is None
        with pytest.raises((AssertionError, AttributeError)):  # our own code's invariant, named by the Python encoder
            codec.encode(g)


def _base_chain(arr):
    base = arr.base
    while isinstance(base, memoryview | np.ndarray):
        base = base.obj if isinstance(base, memoryview) else base.base
    return base


def test_frames_received_over_tcp_decode_fast_and_the_arrays_keep_them_alive():
    g = rollout_group(n=5)
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    port = b.bind_to_random_port("tcp://127.0.0.1")
    a.connect(f"tcp://127.0.0.1:{port}")
    a.send_multipart(codec.encode(g), copy=False)
    frames = b.recv_multipart(copy=False)
    out = codec._decode_fast(frames, LIMIT)
    assert out is not None
    for name, frame in zip(m.RolloutGroup.ARRAYS, frames[1:], strict=True):  # views that hold their frame
        assert _base_chain(getattr(out, name)) is frame, name
    del frames, frame
    gc.collect()
    _assert_same_message(out, g)
    a.close(linger=0)
    b.close(linger=0)
    ctx.term()


def test_arrays_at_any_alignment():
    """TCP frames start at any offset in libzmq's receive buffer: the compiled checks read them unaligned."""

    def shifted(msg, offset):  # zmq.Frames over the frames' bytes starting `offset` bytes into an aligned buffer
        frames = [bytes(f) for f in codec.encode(msg)]
        return [frames[0], *[zmq.Frame(memoryview(bytes(offset) + f)[offset:], copy=False) for f in frames[1:]]]

    for offset in range(4):
        g = rollout_group(n=6)
        out = codec._decode_fast(shifted(g, offset), LIMIT)
        assert out is not None
        assert out.behaviour_logprobs.ctypes.data % 4 == offset and out.behaviour_logprobs.flags.aligned == (offset == 0)
        _assert_same_message(out, g)
        g.behaviour_logprobs[-1] = np.nan  # the last value: the vectorised loop's tail
        assert codec._decode_fast(shifted(g, offset), LIMIT) is None
        g = rollout_group(n=6)
        g.lengths[-1] = -1
        assert codec._decode_fast(shifted(g, offset), LIMIT) is None


def test_other_frame_types_are_left_to_python():
    frames = codec.encode(rollout_group())
    for kind in (bytearray, memoryview):
        converted = [kind(bytes(f)) for f in frames]
        assert codec._decode_fast(converted, LIMIT) is None
        _assert_same_message(codec.decode(converted), codec.decode_python([bytes(f) for f in frames]))
    assert codec._decode_fast(tuple(bytes(f) for f in frames), LIMIT) is None  # a list is what zmq gives


def test_rare_legal_input_is_left_to_python():
    """An int sent for a float, and logprobs too large for the fast finiteness bound, still decode (in Python)."""
    frames = codec.encode(rollout_group())
    header = _header(frames)
    header[3][codec._SCHEMAS["RolloutGroup"].fields.index("gen_s")] = 1
    int_gen_s = _with_header(frames, header)
    assert codec._decode_fast(int_gen_s, LIMIT) is None and codec.decode(int_gen_s).gen_s == 1.0
    g = rollout_group()
    g.behaviour_logprobs[0] = -1e31
    assert codec._decode_fast([bytes(f) for f in codec.encode(g)], LIMIT) is None
    assert codec.decode(codec.encode(g)).behaviour_logprobs[0] == np.float32(-1e31)


def test_the_frame_limit_applies_to_both():
    frames = [bytes(f) for f in codec.encode(rollout_group(n=8))]
    biggest = max(map(len, frames))
    assert _compare(frames, biggest)[0] is not None
    assert _compare(frames, biggest - 1) == (None, None)


_INT32 = hs.integers(-(2**31), 2**31 - 1)
_FLOAT32 = hs.floats(width=32)


_DEFECTS = [None, None, "tokens", "logprobs", "rewards", "reasons", "versions"]  # at most one thing wrong, often none


@settings(max_examples=500, deadline=None)
@given(
    hs.lists(hs.integers(-2, 6), max_size=6) | hs.lists(_INT32, max_size=3),  # lengths: negative ones and huge ones too
    hs.sampled_from(_DEFECTS), hs.sampled_from([-1, 1]),  # what is inconsistent, and by how much
    hs.sampled_from([-1.5, -1e29, -1e30, 1e31, 3.3e38, float("nan"), float("inf")]) | _FLOAT32,  # one logprob
    hs.sampled_from([float("nan"), float("inf"), -float("inf"), 3.4e38]) | _FLOAT32,  # one reward
    hs.integers(-(2**63), 2**64 - 1), hs.integers(-(2**63), 2**64 - 1),  # the two versions
)
@example([-1, 2], None, 1, -1.5, 0.5, 0, 0)  # each check's own case, besides what the search finds
@example([2, 3], "tokens", 1, -1.5, 0.5, 0, 0)
@example([2, 3], "tokens", -1, -1.5, 0.5, 0, 0)
@example([2, 3], "logprobs", 1, -1.5, 0.5, 0, 0)
@example([2, 3], "rewards", -1, -1.5, 0.5, 0, 0)
@example([2, 3], "reasons", 1, -1.5, 0.5, 0, 0)
@example([2, 3], "versions", 1, -1.5, 0.5, 4, 5)
@example([], None, 1, -1.5, 0.5, 0, 0)
@example([2, 3], None, 1, -1e30, 0.5, 0, 0)
@example([2, 3], None, 1, float("nan"), 0.5, 0, 0)
@example([2, 3], None, 1, -1.5, float("inf"), 0, 0)
def test_fuzz_rollout_groups_fast_equals_python(lengths, defect, delta, logprob, reward, v1, v2):
    n, total = len(lengths), sum(lengths)
    if not 0 <= total <= 100:  # lengths too large to send the tokens for: a group that must be refused
        total = 3
    off = {defect: delta}
    tokens = max(0, total + off.get("tokens", 0))
    logprobs = np.full(max(0, total + off.get("logprobs", 0)), -0.5, np.float32)
    if len(logprobs):
        logprobs[len(logprobs) // 2] = np.float32(logprob)
    rewards = np.full(max(0, n + off.get("rewards", 0)), 0.5, np.float32)
    if len(rewards):
        rewards[0] = np.float32(reward)
    vmin, vmax = sorted((v1, v2), reverse=defect == "versions")
    g = m.RolloutGroup(
        actor_id="a", prompt_id=1, epoch=0, prompt_tokens=np.arange(3, dtype=np.int32), lengths=np.array(lengths, np.int32),
        completion_tokens=np.zeros(tokens, np.int32), behaviour_logprobs=logprobs, rewards=rewards,
        finish_reasons=["stop"] * max(0, n + off.get("reasons", 0)), version_min=vmin, version_max=vmax, gen_s=0.1, reward_s=0.0)
    fast, want = _compare([bytes(f) for f in codec.encode(g)])
    normal = bool(np.all(np.abs(logprobs) < 1e30))  # the fast path's finiteness bound (module doc)
    assert (fast is not None) == (want is not None and normal)


@settings(max_examples=300, deadline=None)
@given(hs.integers(0, len(SAMPLES) - 1), hs.integers(0, 10_000), hs.binary(min_size=1, max_size=4))
def test_fuzz_mutated_bytes_fast_equals_python(which, pos, patch):
    frames = [bytearray(f) for f in codec.encode_python(SAMPLES[which])]
    target = frames[pos % len(frames)]
    i = pos % max(1, len(target))
    target[i : i + len(patch)] = patch
    _compare([bytes(f) for f in frames])


@settings(max_examples=300, deadline=None)
@given(hs.integers(0, 3), _ANY)
@example(0, float(m.PROTOCOL_VERSION))  # a version that compares equal but is not an int
@example(0, True)
@example(0, m.PROTOCOL_VERSION + 1)
@example(1, ["RolloutGroup"])  # unhashable
@example(1, "WorkGrant")  # another type's name over these frames
@example(2, "int32 int32 int32 float32 float64")
@example(3, {})
def test_fuzz_header_parts_fast_equals_python(part, obj):
    frames = codec.encode(rollout_group())
    header = _header(frames)
    header[part] = obj
    _compare(_with_header(frames, header))


@settings(max_examples=600, deadline=None)
@given(hs.integers(0, len(SAMPLES) - 1), hs.integers(0, 17), _ANY | hs.integers(-5, 40))
@example(SAMPLES.index(_GROUP), _GROUP_VALUES.index("finish_reasons"), ["stop", 1, "stop"])  # a list[str] holding an int
@example(SAMPLES.index(_GROUP), _GROUP_VALUES.index("gen_s"), True)
@example(SAMPLES.index(_GROUP), _GROUP_VALUES.index("epoch"), 1.0)
def test_fuzz_values_and_dims_fast_equals_python(which, index, obj):
    """One field value or array dim of any message type replaced: wrong types (bool for int, int for float
    and the reverse), values the type's check() refuses, and dims off by a little."""
    frames = codec.encode(SAMPLES[which])
    header = _header(frames)
    values = header[3]
    values[index % len(values)] = obj
    _compare(_with_header(frames, header))


def test_missing_and_extra_frames():
    frames = [bytes(f) for f in codec.encode(rollout_group())]
    for bad in (frames[:-1], [*frames, frames[-1]], [*frames, b""], frames[:1]):
        assert _compare(bad) == (None, None)


def test_a_limit_of_any_type_or_size_never_raises():
    frames = codec.encode(rollout_group())
    for limit in (6.4e7, 1 << 70, -1, "64"):
        assert codec._decode_fast(frames, limit) is None
    assert codec.decode(frames, 1 << 70).prompt_id == 7


def test_a_stale_build_is_not_used(monkeypatch):
    """A .so built from another version of the .pyx (edited since, not rebuilt) is refused, with a warning."""
    assert codec._load_fastcodec() is codec._fastcodec
    monkeypatch.setattr(codec._fastcodec, "SOURCE_SHA", "0" * 64)
    with pytest.warns(RuntimeWarning, match="stale"):
        assert codec._load_fastcodec() is None


@settings(max_examples=200, deadline=None)
@given(hs.lists(hs.binary(max_size=64), min_size=0, max_size=7), _ANY)
def test_fuzz_arbitrary_frames_fast_equals_python(frames, obj):
    _compare(frames)
    _compare([msgpack.packb(obj), *frames])


@settings(max_examples=300, deadline=None)
@given(hs.integers(1, 4), hs.integers(0, 3), hs.sampled_from([0, 0, -1, 1]), hs.integers(-2, 6),
       hs.sampled_from([float("nan"), float("inf"), -float("inf"), 3.4e38]) | _FLOAT32)
@example(2, 2, 0, 0, 3.4e38)  # large but finite values that a float32 sum would overflow: both accept
@example(2, 1, 1, 0, 0.5)
@example(2, 1, 0, 3, 0.5)
def test_fuzz_reward_parts_fast_equals_python(n, k, delta, errors, value):
    g = rollout_group(n=n)
    parts = np.full(max(0, n * k + delta), 3.4e38 if value == 3.4e38 else 0.25, np.float32)
    if len(parts):
        parts[0] = np.float32(value)
    g.reward_part_names, g.reward_parts, g.reward_errors = [f"part{i}" for i in range(k)], parts, errors
    fast, want = _compare([bytes(f) for f in codec.encode(g)])
    assert (fast is not None) == (want is not None)
