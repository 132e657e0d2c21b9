"""The codec over real ZeroMQ sockets (inproc, and TCP): frames sent as the hub and the actor send them decode to the
same messages, and arrays decoded from TCP frames are views that keep their frames alive. The codec without a
socket: tests/unit/test_codec.py."""

import gc

import numpy as np
import zmq
from conftest import rollout_group

from protocol import messages as m
from protocol.codec import decode, encode
from tests.unit.test_codec import SAMPLES, _equal


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


def _base_chain(arr):
    base = arr.base
    while isinstance(base, memoryview | np.ndarray):
        base = base.obj if isinstance(base, memoryview) else base.base
    return base


def test_frames_received_over_tcp_decode_in_place_and_the_arrays_keep_them_alive():
    g = rollout_group(n=5)
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    port = b.bind_to_random_port("tcp://127.0.0.1")
    a.connect(f"tcp://127.0.0.1:{port}")
    try:
        a.send_multipart(encode(g), copy=False)
        frames = b.recv_multipart(copy=False)
        out = decode(frames)
        for name, frame in zip(m.RolloutGroup.ARRAYS, frames[1:], strict=True):  # views that hold their frame
            assert _base_chain(getattr(out, name)) is frame, name
        del frames, frame
        gc.collect()
        _equal(out, g)
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()
