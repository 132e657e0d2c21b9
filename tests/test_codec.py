"""Codec: round trips for every message type, and a decoder that only ever raises ProtocolError."""

import msgpack
import numpy as np
import pytest
from conftest import rollout_group
from hypothesis import given, settings
from hypothesis import strategies as hs

from protocol import messages as m
from protocol.codec import decode, encode

SAMPLES = [
    m.Register(actor_id="a", host="h", pid=1, served_version=0),
    m.RegisterAck(actor_id="a", policy_version=3, heartbeat_s=2.0),
    m.Heartbeat(actor_id="a", served_version=2, groups_in_flight=4),
    m.WorkRequest(actor_id="a", max_prompts=8),
    m.WorkGrant(prompt_id=5, epoch=1, prompt_tokens=np.arange(4, dtype=np.int32), answer="7", policy_version=2, lease_s=60.0),
    rollout_group(),
    m.WeightSync(policy_version=1, group_epoch=2, store_host="127.0.0.1", store_port=1234, rank=1, world_size=3,
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
    header = msgpack.unpackb(frames[0])
    assert "completion_tokens" not in header["f"]  # not in the msgpack header
    assert len(frames) == 1 + len(m.RolloutGroup.ARRAYS)
    out = decode(frames)
    assert isinstance(out.completion_tokens, np.ndarray) and out.completion_tokens.dtype == np.int32


def _header(frames):
    return msgpack.unpackb(frames[0])


def _with_header(frames, header):
    return [msgpack.packb(header), *frames[1:]]


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda h: h.update(v=99), "protocol version 99"),
        (lambda h: h.update(t="Nope"), "unknown message type 'Nope'"),
        (lambda h: h["f"].pop("actor_id"), "RolloutGroup.actor_id: missing field"),
        (lambda h: h["f"].update(extra=1), "RolloutGroup.extra: unknown field"),
        (lambda h: h["f"].update(prompt_id="seven"), "RolloutGroup.prompt_id: expected"),
        (lambda h: h["a"][0].__setitem__(1, "float64"), "dtype 'float64', expected int32"),
        (lambda h: h["a"][0].__setitem__(2, [99]), "needs 396 bytes"),
    ],
)
def test_bad_headers_are_named(mutate, needle):
    frames = encode(rollout_group())
    header = _header(frames)
    mutate(header)
    with pytest.raises(m.ProtocolError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        decode(_with_header(frames, header))


def test_truncated_oversized_and_inconsistent():
    frames = [bytes(f) for f in encode(rollout_group())]
    with pytest.raises(m.ProtocolError, match="array frames"):
        decode(frames[:-1])
    with pytest.raises(m.ProtocolError, match="not valid MessagePack"):
        decode([frames[0][:-3], *frames[1:]])
    with pytest.raises(m.ProtocolError, match="exceeds the limit"):
        decode(frames, max_frame_bytes=8)
    with pytest.raises(m.ProtocolError, match="no frames"):
        decode([])
    g = rollout_group()
    g.rewards = g.rewards[:1].copy()
    with pytest.raises(m.ProtocolError, match="rewards"):
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


@settings(max_examples=200, deadline=None)
@given(hs.recursive(hs.none() | hs.booleans() | hs.integers(-(2**63), 2**64 - 1) | hs.floats() | hs.text(max_size=8) | hs.binary(max_size=8),
                    lambda c: hs.lists(c, max_size=4) | hs.dictionaries(hs.text(max_size=4), c, max_size=4), max_leaves=12))
def test_fuzz_structured_headers_only_raise_protocol_error(obj):
    header = {"v": 1, "t": "RolloutGroup", "f": obj, "a": obj}
    try:
        decode([msgpack.packb(header, use_bin_type=True)])
    except m.ProtocolError:
        pass
