"""Codec: round trips for every message type, and bad input named in the ProtocolError (tests/unit/test_decoder_fuzz.py
fuzzes the decoder). Over real ZeroMQ sockets: tests/integration/test_codec_sockets.py."""

import re

import msgpack
import numpy as np
import pytest
import zmq
from conftest import rollout_group, sample_messages

from protocol import messages as m
from protocol.codec import decode, encode

SAMPLES = sample_messages()


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
    assert (header["v"], header["t"]) == (m.PROTOCOL_VERSION, "RolloutGroup")
    total = int(g.lengths.sum())
    assert header["a"] == [
        ["prompt_tokens", "int32", [4]],
        ["lengths", "int32", [4]],
        ["completion_tokens", "int32", [total]],
        ["behaviour_logprobs", "float32", [total]],
        ["rewards", "float32", [4]],
        ["reward_parts", "float32", [0]],
        ["loss_mask", "uint8", [0]],
        ["turns", "int32", [0]],
        ["tool_calls", "int32", [0]],
    ]
    assert header["f"]["actor_id"] == "a0" and header["f"]["finish_reasons"] == ["stop"] * 4
    assert not set(header["f"]) & set(m.RolloutGroup.ARRAYS)  # no array data in the header
    assert len(frames) == 1 + len(m.RolloutGroup.ARRAYS)
    assert [f.nbytes for f in frames[1:]] == [
        g.prompt_tokens.nbytes,
        16,
        g.completion_tokens.nbytes,
        g.behaviour_logprobs.nbytes,
        16,
        0,
        0,
        0,
        0,
    ]
    out = decode([bytes(f) for f in frames])
    assert isinstance(out.completion_tokens, np.ndarray) and out.completion_tokens.dtype == np.int32
    assert not out.completion_tokens.flags.owndata  # a view of the received frame, not a copy


def test_arrays_at_any_alignment():
    """TCP frames start at any offset in libzmq's receive buffer: unaligned frames decode and are checked alike."""

    def shifted(msg, offset):  # zmq.Frames over the frames' bytes starting `offset` bytes into an aligned buffer
        frames = [bytes(f) for f in encode(msg)]
        return [frames[0], *[zmq.Frame(memoryview(bytes(offset) + f)[offset:], copy=False) for f in frames[1:]]]

    for offset in range(4):
        g = rollout_group(n=6)
        out = decode(shifted(g, offset))
        assert out.behaviour_logprobs.ctypes.data % 4 == offset % 4 or offset == 0
        _equal(out, g)
        g.behaviour_logprobs[-1] = np.nan
        with pytest.raises(m.ProtocolError, match="non-finite"):
            decode(shifted(g, offset))
        g = rollout_group(n=6)
        g.lengths[-1] = -1
        with pytest.raises(m.ProtocolError, match="negative length"):
            decode(shifted(g, offset))


def test_encode_makes_arrays_contiguous_and_refuses_wrong_ones():
    g = rollout_group(n=4)
    g.completion_tokens = np.arange(2 * len(g.completion_tokens), dtype=np.int32)[::2]  # a strided view: copied once
    assert decode(encode(g)).completion_tokens.tolist() == g.completion_tokens.tolist()
    for wrong in (np.zeros(3, np.int64), np.zeros((3, 1), np.int32), np.zeros(3, ">i4"), [1, 2, 3]):
        g = rollout_group()
        g.prompt_tokens = wrong
        with pytest.raises(AssertionError, match="prompt_tokens"):  # our own code's invariant
            encode(g)


def _header(frames):
    return msgpack.unpackb(frames[0])


def _with_header(frames, header):
    return [msgpack.packb(header), *[bytes(f) for f in frames[1:]]]


def _set_array(i, part, value):
    def mutate(h):
        h["a"][i][part] = value

    return mutate


# header = {"v": version, "t": type, "f": {field: value}, "a": [[name, dtype, shape], ...]}; RolloutGroup's arrays:
# prompt_tokens, lengths, completion_tokens, behaviour_logprobs, rewards, reward_parts (0-5)
@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda h: h.__setitem__("v", 99), f"protocol version 99, this side speaks {m.PROTOCOL_VERSION}"),
        (lambda h: h.__setitem__("v", "2"), f"protocol version '2', this side speaks {m.PROTOCOL_VERSION}"),
        (lambda h: h.__setitem__("v", True), f"protocol version True, this side speaks {m.PROTOCOL_VERSION}"),
        (lambda h: h.pop("v"), "header: expected a map of v, t, f, a"),
        (lambda h: h.__setitem__("t", "Nope"), "unknown message type 'Nope'"),
        (lambda h: h.__setitem__("t", ["RolloutGroup"]), "unknown message type ['RolloutGroup']"),
        (lambda h: h.__setitem__("x", 0), "header: expected a map of v, t, f, a"),
        (lambda h: h.pop("a"), "header: expected a map of v, t, f, a"),
        (lambda h: h["f"].pop("reward_s"), "RolloutGroup.reward_s: missing field"),
        (lambda h: h["f"].pop("reward_errors"), "RolloutGroup.reward_errors: missing field"),  # defaults are sent too
        (lambda h: h["f"].__setitem__("colour", 1), "RolloutGroup: unknown field(s) ['colour']"),
        (lambda h: h["f"].__setitem__("lengths", [1, 2]), "RolloutGroup: unknown field(s) ['lengths']"),  # an array, not a field
        (lambda h: h.__setitem__("f", [1, 2]), "RolloutGroup: header.f must be a map of field values, got list"),
        (lambda h: h["f"].__setitem__("prompt_id", "seven"), "RolloutGroup.prompt_id: expected int, got str"),
        (lambda h: h["f"].__setitem__("prompt_id", True), "RolloutGroup.prompt_id: expected int, got bool"),
        (lambda h: h["f"].__setitem__("prompt_id", 7.0), "RolloutGroup.prompt_id: expected int, got float"),
        (lambda h: h["f"].__setitem__("actor_id", b"a0"), "RolloutGroup.actor_id: expected str, got bytes"),
        (lambda h: h["f"].__setitem__("gen_s", "1.0"), "RolloutGroup.gen_s: expected float, got str"),
        (lambda h: h["f"].__setitem__("finish_reasons", "stop"), "RolloutGroup.finish_reasons: expected list[str], got str"),
        (
            lambda h: h["f"].__setitem__("finish_reasons", ["stop", 1, "stop"]),
            "RolloutGroup.finish_reasons: expected list[str], got a list",
        ),
        (lambda h: h.__setitem__("a", h["a"][:5]), "RolloutGroup: header.a must list its 9 arrays"),
        (lambda h: h.__setitem__("a", {}), "RolloutGroup: header.a must list its 9 arrays"),
        (lambda h: h["a"].__setitem__(0, ["prompt_tokens", "int32"]), "RolloutGroup.prompt_tokens: array entry"),
        (lambda h: h["a"].reverse(), "RolloutGroup: array frame 'tool_calls' where 'prompt_tokens' belongs"),
        (_set_array(0, 1, "float64"), "RolloutGroup.prompt_tokens: dtype 'float64', expected int32"),
        (_set_array(4, 1, "float64"), "RolloutGroup.rewards: dtype 'float64', expected float32"),
        (_set_array(4, 1, ["float32"]), "RolloutGroup.rewards: dtype ['float32'], expected float32"),
        (_set_array(0, 2, [99]), "RolloutGroup.prompt_tokens: shape [99] needs 396 bytes, frame has 16"),
        (_set_array(1, 2, [-1]), "RolloutGroup.lengths: shape [-1], expected 1 non-negative int dims"),
        (_set_array(1, 2, [3.0]), "RolloutGroup.lengths: shape [3.0], expected 1 non-negative int dims"),  # == 3, wrong type
        (_set_array(1, 2, [True]), "RolloutGroup.lengths: shape [True]"),
        (_set_array(5, 2, []), "RolloutGroup.reward_parts: shape [], expected 1"),
        (_set_array(4, 2, [[3]]), "RolloutGroup.rewards: shape [[3]]"),
        (_set_array(4, 2, 3), "RolloutGroup.rewards: shape 3"),
    ],
)
def test_bad_headers_are_named(mutate, needle):
    frames = encode(rollout_group())
    header = _header(frames)
    mutate(header)
    with pytest.raises(m.ProtocolError, match=re.escape(needle)):
        decode(_with_header(frames, header))


@pytest.mark.parametrize(
    "header",
    [
        {"v": 1, "t": "Register", "f": {"actor_id": "a", "host": "h", "pid": 1, "served_version": 0}, "a": []},  # protocol 1: a map
        [5, "Register", "", ["a", "h", 1, 0, [""]]],  # protocols 2-5: [version, type, dtypes, values]
    ],
)
def test_older_protocols_are_told_the_version(header):
    """A peer on an older protocol gets told the version mismatch, not a parse error."""
    version = header["v"] if isinstance(header, dict) else header[0]
    with pytest.raises(m.ProtocolError, match=f"protocol version {version}, this side speaks {m.PROTOCOL_VERSION}"):
        decode([msgpack.packb(header)])


def test_int_for_float_field_is_accepted_as_float():
    frames = encode(rollout_group())
    header = _header(frames)
    header["f"]["gen_s"] = 3  # as another encoder may send a whole number
    out = decode(_with_header(frames, header))
    assert type(out.gen_s) is float and out.gen_s == 3.0


def test_errors_quote_the_peer_briefly():
    frames = encode(rollout_group())
    header = _header(frames)
    header["t"] = "X" * 50_000
    with pytest.raises(m.ProtocolError) as e:
        decode(_with_header(frames, header))
    assert len(str(e.value)) < 200


def test_truncated_oversized_and_inconsistent():
    frames = [bytes(f) for f in encode(rollout_group())]
    with pytest.raises(m.ProtocolError, match="expected 9 array frames, got 8"):
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
        (
            lambda g: (setattr(g, "reward_part_names", ["a"]), setattr(g, "reward_parts", np.array([0, 1, np.nan, 0], np.float32))),
            "reward_parts: non-finite",
        ),
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


def test_reward_parts_round_trip():
    g = rollout_group(n=3)
    g.reward_part_names = ["answer", "format"]
    g.reward_parts = np.array([1, 0.5, 0, 0.5, 1, 0], np.float32)
    g.reward_errors = 1
    out = decode(encode(g))
    assert out.reward_part_names == ["answer", "format"] and out.reward_errors == 1
    np.testing.assert_array_equal(out.reward_parts.reshape(3, 2), g.reward_parts.reshape(3, 2))


def test_status_reply_is_validated():
    reply = m.StatusReply(
        policy_version=3,
        max_staleness=1,
        steps_per_update=1,
        updates=3,
        training=True,
        uptime_s=5.0,
        step_s=0.2,
        syncs=3,
        sync_age_s=0.1,
        sync_s=0.01,
        broadcast_s=0.02,
        buffered=2,
        pending=10,
        granted=4,
        received=2,
        trained=12,
        dropped_stale=1,
        staleness_window=512,
        actor_ids=["a", "b"],
        actor_served_version=np.array([3, 2], np.int32),
        actor_samples_per_s=np.array([10.0, 5.0], np.float32),
        actor_groups=np.array([4, 2], np.int32),
        actor_leases=np.array([1, 0], np.int32),
        actor_heartbeat_age_s=np.array([0.5, 1.0], np.float32),
        staleness_counts=np.array([10, 2], np.int32),
    )
    back = decode(encode(reply))
    assert isinstance(back, m.StatusReply) and back.actor_ids == ["a", "b"] and back.staleness_counts.tolist() == [10, 2]
    reply.actor_leases = np.array([1], np.int32)  # one entry for two actors
    with pytest.raises(m.ProtocolError, match="actor_leases: 1 entries for 2 actors"):
        decode(encode(reply))
    reply.actor_leases = np.array([1, 0], np.int32)
    reply.staleness_counts = np.array([600], np.int32)
    with pytest.raises(m.ProtocolError, match="more than 512 groups"):
        decode(encode(reply))


def test_eval_messages_validate():
    """Their round trips are the codec's (tests/unit/test_codec.py, sample_messages)."""
    grant, result = (msg for msg in sample_messages() if isinstance(msg, m.EvalGrant | m.EvalResult))
    grant.n = 0
    with pytest.raises(m.ProtocolError, match="n=0 must be >= 1"):
        decode(encode(grant))
    result.rewards = np.array([1, 0], np.float32)
    with pytest.raises(m.ProtocolError, match="3 completions but 2 rewards"):
        decode(encode(result))
