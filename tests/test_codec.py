"""Codec: round trips for every message type, and a decoder that only ever raises ProtocolError."""

import re

import msgpack
import numpy as np
import pytest
import zmq
from conftest import rollout_group
from hypothesis import given, settings
from hypothesis import strategies as hs

from protocol import messages as m
from protocol.codec import decode, encode

SAMPLES = [
    m.Register(actor_id="a", host="h", pid=1, served_version=0, devices=["cuda:GPU-1", ""]),
    m.RegisterAck(actor_id="a", policy_version=3, heartbeat_s=2.0),
    m.Heartbeat(actor_id="a", served_version=2, groups_in_flight=4),
    m.WorkRequest(actor_id="a", max_prompts=8),
    m.WorkGrant(prompt_id=5, epoch=1, prompt_tokens=np.arange(4, dtype=np.int32), answer="7", policy_version=2, lease_s=60.0),
    rollout_group(),
    m.WeightSync(policy_version=1, group_epoch=2, store_host="127.0.0.1", store_port=1234, rank=1, ranks=2, world_size=3, backend="nccl",
                 timeout_s=30.0, names=["w", "b"], shapes=[[2, 3], [3]], dtype="float32", bucket_bytes=1 << 20),
    m.WeightVersion(actor_id="a", served_version=1, group_epoch=2, load_s=0.1),
    m.Error(code="protocol", detail="x"),
    m.Shutdown(reason="done"),
]


def _equal(a, b):
    assert type(a) is type(b)
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), name
        else:
            assert x == y, name


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip(msg):
    frames = encode(msg)
    _equal(decode([bytes(f) for f in frames]), msg)


def test_arrays_travel_as_raw_frames_not_lists():
    g = rollout_group(n=4)
    frames = encode(g)
    version, name, dtypes, values = msgpack.unpackb(frames[0])
    assert (version, name) == (m.PROTOCOL_VERSION, "RolloutGroup")
    assert dtypes == "int32 int32 int32 float32 float32 float32"
    total = int(g.lengths.sum())
    assert values[-6:] == [4, 4, total, total, 4, 0]  # the arrays' dims only: no array data in the header
    assert not any(isinstance(v, list) and len(v) == total for v in values)
    assert len(frames) == 1 + len(m.RolloutGroup.ARRAYS)
    assert [f.nbytes for f in frames[1:]] == [g.prompt_tokens.nbytes, 16, g.completion_tokens.nbytes, g.behaviour_logprobs.nbytes, 16, 0]
    out = decode([bytes(f) for f in frames])
    assert isinstance(out.completion_tokens, np.ndarray) and out.completion_tokens.dtype == np.int32
    assert not out.completion_tokens.flags.owndata  # a view of the received frame, not a copy


def test_round_trip_through_zmq_frames():
    """What the hub and the actor do: send_multipart(copy=False) of encode(), recv_multipart(copy=False), decode."""
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://codec")
    b.connect("inproc://codec")
    try:
        for msg in [*SAMPLES, rollout_group(n=16, seed=3)]:
            a.send_multipart(encode(msg), copy=False)
            _equal(decode(b.recv_multipart(copy=False)), msg)
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


def _header(frames):
    return msgpack.unpackb(frames[0])


def _with_header(frames, header):
    return [msgpack.packb(header), *[bytes(f) for f in frames[1:]]]


# header = [version, type, dtypes, values]; RolloutGroup's values: actor_id, prompt_id, epoch, finish_reasons,
# version_min, version_max, gen_s, reward_s, reward_part_names, reward_errors (0-9), then the dims of prompt_tokens,
# lengths, completion_tokens, behaviour_logprobs, rewards, reward_parts (10-15)
@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda h: h.__setitem__(0, 99), f"protocol version 99, this side speaks {m.PROTOCOL_VERSION}"),
        (lambda h: h.__setitem__(0, "2"), f"protocol version '2', this side speaks {m.PROTOCOL_VERSION}"),
        (lambda h: h.__setitem__(1, "Nope"), "unknown message type 'Nope'"),
        (lambda h: h.__setitem__(1, ["RolloutGroup"]), "unknown message type ['RolloutGroup']"),
        (lambda h: h.append(0), "header: expected [version, type, dtypes, values], got list"),
        (lambda h: h.__setitem__(3, h[3][:7]), "RolloutGroup.reward_s: missing field"),
        (lambda h: h.__setitem__(3, h[3][:1]), "RolloutGroup.prompt_id: missing field"),
        (lambda h: h[3].append(1), "RolloutGroup: 1 unknown value(s) after the last field and array dims"),
        (lambda h: h.__setitem__(3, {"actor_id": "a0"}), "RolloutGroup: header values must be an array, got dict"),
        (lambda h: h[3].__setitem__(1, "seven"), "RolloutGroup.prompt_id: expected int, got str"),
        (lambda h: h[3].__setitem__(1, True), "RolloutGroup.prompt_id: expected int, got bool"),
        (lambda h: h[3].__setitem__(0, b"a0"), "RolloutGroup.actor_id: expected str, got bytes"),
        (lambda h: h[3].__setitem__(6, "1.0"), "RolloutGroup.gen_s: expected float, got str"),
        (lambda h: h[3].__setitem__(3, "stop"), "RolloutGroup.finish_reasons: expected list[str], got str"),
        (lambda h: h[3].__setitem__(3, ["stop", 1, "stop"]), "RolloutGroup.finish_reasons: expected list[str], got a list"),
        (lambda h: h.__setitem__(2, "float64 int32 int32 float32 float32 float32"), "RolloutGroup.prompt_tokens: dtype 'float64', expected int32"),
        (lambda h: h.__setitem__(2, "int32 int32 int32 float32 float64 float32"), "RolloutGroup.rewards: dtype 'float64', expected float32"),
        (lambda h: h.__setitem__(2, "int32 int32 int32 float32"), "RolloutGroup: array dtypes"),
        (lambda h: h.__setitem__(2, ["int32"] * 3 + ["float32"] * 2), "RolloutGroup: array dtypes"),
        (lambda h: h[3].__setitem__(10, 99), "RolloutGroup.prompt_tokens: shape [99] needs 396 bytes, frame has 16"),
        (lambda h: h[3].__setitem__(11, -1), "RolloutGroup.lengths: shape [-1], expected 1 non-negative int dims"),
        (lambda h: h[3].__setitem__(11, 3.0), "RolloutGroup.lengths: shape [3.0], expected 1 non-negative int dims"),  # == 3, wrong type
        (lambda h: h[3].__setitem__(11, True), "RolloutGroup.lengths: shape [True]"),
        (lambda h: h[3].pop(), "RolloutGroup.reward_parts: shape [], expected 1"),
        (lambda h: h[3].__setitem__(14, [3]), "RolloutGroup.rewards: shape [[3]]"),
    ],
)
def test_bad_headers_are_named(mutate, needle):
    frames = encode(rollout_group())
    header = _header(frames)
    mutate(header)
    with pytest.raises(m.ProtocolError, match=re.escape(needle)):
        decode(_with_header(frames, header))


def test_protocol_1_header_names_the_version():
    """A peer still on the map layout (protocol 1) gets told the version mismatch, not a parse error."""
    header = {"v": 1, "t": "Register", "f": {"actor_id": "a", "host": "h", "pid": 1, "served_version": 0}, "a": []}
    with pytest.raises(m.ProtocolError, match=f"protocol version 1, this side speaks {m.PROTOCOL_VERSION}"):
        decode([msgpack.packb(header)])


def test_int_for_float_field_is_accepted_as_float():
    frames = encode(rollout_group())
    header = _header(frames)
    header[3][6] = 3  # gen_s, as another encoder may send a whole number
    out = decode(_with_header(frames, header))
    assert type(out.gen_s) is float and out.gen_s == 3.0


def test_truncated_oversized_and_inconsistent():
    frames = [bytes(f) for f in encode(rollout_group())]
    with pytest.raises(m.ProtocolError, match="expected 6 array frames, got 5"):
        decode(frames[:-1])
    with pytest.raises(m.ProtocolError, match="not valid MessagePack"):
        decode([frames[0][:-3], *frames[1:]])
    with pytest.raises(m.ProtocolError, match="exceeds the limit"):
        decode(frames, max_frame_bytes=8)
    with pytest.raises(m.ProtocolError, match="no frames"):
        decode([])
    with pytest.raises(m.ProtocolError, match=re.escape("completion_tokens: frame of 7 bytes is not a whole number of int32")):
        decode([*frames[:3], frames[3][:7], *frames[4:]])
    with pytest.raises(m.ProtocolError, match=re.escape("completion_tokens: shape [")):
        decode([*frames[:3], frames[3][:-4], *frames[4:]])  # a whole element short: the header's dim disagrees
    g = rollout_group()
    g.rewards = g.rewards[:1].copy()
    with pytest.raises(m.ProtocolError, match="rewards"):
        decode(encode(g))


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda g: g.lengths.__setitem__(0, -1), "negative length"),
        (lambda g: setattr(g, "lengths", g.lengths[:0].copy()), "no completions"),
        (lambda g: g.lengths.__setitem__(0, g.lengths[0] + 1), "lengths sum to"),
        (lambda g: setattr(g, "finish_reasons", g.finish_reasons[:-1]), "finish reasons"),
        (lambda g: setattr(g, "version_max", g.version_min - 1), "version_max < version_min"),
        (lambda g: g.behaviour_logprobs.__setitem__(-1, np.nan), "non-finite"),
        (lambda g: g.behaviour_logprobs.__setitem__(0, -np.inf), "non-finite"),
        (lambda g: g.rewards.__setitem__(1, np.inf), "non-finite"),
        (lambda g: g.rewards.__setitem__(1, np.nan), "non-finite"),
        (lambda g: setattr(g, "reward_part_names", ["format"]), r"reward_parts: 0 values for 4 completions x 1 parts"),
        (lambda g: (setattr(g, "reward_part_names", ["a"]), setattr(g, "reward_parts", np.array([0, 1, np.nan, 0], np.float32))),
         "reward_parts: non-finite"),
        (lambda g: setattr(g, "reward_errors", 5), r"reward_errors: 5 not in \[0, 4\]"),
        (lambda g: setattr(g, "reward_errors", -1), "reward_errors"),
    ],
)
def test_inconsistent_groups_are_named(mutate, needle):
    g = rollout_group(n=4)
    mutate(g)
    with pytest.raises(m.ProtocolError, match=needle):
        decode(encode(g))


def test_long_group_finite_check():
    """Longer than the cached ones vector the logprob sum uses (65,536): it grows, and a nan at the end is caught."""
    n, each = 4, 40_000
    g = rollout_group(n=n)
    g.lengths = np.full(n, each, np.int32)
    g.completion_tokens = np.zeros(n * each, np.int32)
    g.behaviour_logprobs = np.full(n * each, -1.5, np.float32)
    assert decode(encode(g)).behaviour_logprobs.sum() == -1.5 * n * each
    g.behaviour_logprobs[-1] = np.nan
    with pytest.raises(m.ProtocolError, match="non-finite"):
        decode(encode(g))


@settings(max_examples=300, deadline=None)
@given(hs.lists(hs.binary(max_size=64), min_size=0, max_size=7))
def test_fuzz_random_frames_only_raise_protocol_error(frames):
    try:
        decode(frames)
    except m.ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(hs.integers(0, 5), hs.integers(0, 10_000), hs.binary(min_size=1, max_size=4))
def test_fuzz_mutated_valid_messages_only_raise_protocol_error(which, pos, patch):
    frames = [bytearray(f) for f in encode(SAMPLES[which] if which < 5 else rollout_group())]
    target = frames[pos % len(frames)]
    i = pos % max(1, len(target))
    target[i : i + len(patch)] = patch
    try:
        decode([bytes(f) for f in frames])
    except m.ProtocolError:
        pass


_ANY = hs.recursive(
    hs.none() | hs.booleans() | hs.integers(-(2**63), 2**64 - 1) | hs.floats() | hs.text(max_size=8) | hs.binary(max_size=8),
    lambda c: hs.lists(c, max_size=6) | hs.dictionaries(hs.text(max_size=4), c, max_size=4), max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(_ANY)
def test_fuzz_structured_headers_only_raise_protocol_error(obj):
    for header in ([m.PROTOCOL_VERSION, "RolloutGroup", obj, obj], {"v": 1, "t": "RolloutGroup", "f": obj, "a": obj}, obj):
        try:
            decode([msgpack.packb(header, use_bin_type=True)])
        except m.ProtocolError:
            pass


@settings(max_examples=300, deadline=None)
@given(hs.integers(0, 3), _ANY)
def test_fuzz_one_header_part_with_real_frames_only_raises_protocol_error(part, obj):
    """Each header part replaced by arbitrary MessagePack while the array frames stay valid: reaches the array checks."""
    frames = encode(rollout_group())
    header = _header(frames)
    header[part] = obj
    try:
        decode(_with_header(frames, header))
    except m.ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(hs.integers(0, 12), _ANY)
def test_fuzz_one_value_with_real_frames_only_raises_protocol_error(index, obj):
    """One field value or array dim replaced by arbitrary MessagePack: reaches the dims and group checks."""
    frames = encode(rollout_group())
    header = _header(frames)
    header[3][index] = obj
    try:
        decode(_with_header(frames, header))
    except m.ProtocolError:
        pass


def test_reward_parts_round_trip():
    g = rollout_group(n=3)
    g.reward_part_names = ["answer", "format"]
    g.reward_parts = np.array([1, 0.5, 0, 0.5, 1, 0], np.float32)
    g.reward_errors = 1
    out = decode(encode(g))
    assert out.reward_part_names == ["answer", "format"] and out.reward_errors == 1
    np.testing.assert_array_equal(out.reward_parts.reshape(3, 2), g.reward_parts.reshape(3, 2))
