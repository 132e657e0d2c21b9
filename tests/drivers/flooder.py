"""A client that blasts the hub with malformed and valid-but-useless messages and never reads a reply.

    python tests/drivers/flooder.py ADDR SERVER_KEY CLIENT_KEY MESSAGES MAX_SECONDS MAX_FRAME_BYTES OUT.json

It holds an authorised key (a buggy or hostile actor inside the fleet: an unauthorised one never gets past
the CURVE handshake), so every message reaches the hub's decoder and handlers. Kinds, in rotation:
garbage bytes, truncated and bit-flipped encodings, valid messages with extra frames, frames over
hub.max_frame_bytes, a header quoting 50 kB of text, heartbeats / work requests / rollout groups from
actors that never registered (ids of ~290 characters, so each error reply is long and the replies it never
reads pile up fast), Registers under a new id each time; and last, a frame over the hard cap
(4 x max_frame_bytes), after which libzmq reads nothing more from this connection. Writes counts per kind
to OUT.json when all are queued, and keeps its connection open until its stdin is closed.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
import zmq

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from protocol import messages as m  # noqa: E402
from protocol import transport  # noqa: E402
from protocol.codec import encode  # noqa: E402


def group(actor: str, prompt_id: int, rng: random.Random) -> m.RolloutGroup:
    n, length = 2, 3
    return m.RolloutGroup(
        actor_id=actor,
        prompt_id=prompt_id,
        epoch=0,
        prompt_tokens=np.arange(4, dtype=np.int32),
        lengths=np.full(n, length, np.int32),
        completion_tokens=np.ones(n * length, np.int32),
        behaviour_logprobs=np.full(n * length, -0.5, np.float32),
        rewards=np.asarray([rng.random() for _ in range(n)], np.float32),
        finish_reasons=["stop"] * n,
        version_min=0,
        version_max=0,
        gen_s=0.0,
        reward_s=0.0,
    )


def pools(max_frame_bytes: int, rng: random.Random) -> dict[str, list[list[bytes]]]:
    ghost = "ghost-" + "x" * 280  # each error reply quotes it
    valid = [[bytes(f) for f in encode(group(f"{ghost}-{i}", i, rng))] for i in range(32)]

    def flipped(frames: list[bytes]) -> list[bytes]:
        out = [bytearray(f) for f in frames]
        target = out[rng.randrange(len(out))]
        if target:
            target[rng.randrange(len(target))] ^= 1 << rng.randrange(8)
        return [bytes(f) for f in out]

    return {
        "garbage": [[rng.randbytes(rng.randint(1, 256))] for _ in range(64)],
        "truncated": [[*f[:-1], f[-1][: len(f[-1]) // 2]] if i % 2 else f[: rng.randint(1, len(f) - 1)] for i, f in enumerate(valid)],
        "bit_flip": [flipped(f) for f in valid for _ in range(2)],
        "extra_frames": [[*f, *[b"x" * 16] * 10] for f in valid],
        "oversized": [[b"\x00" * int(max_frame_bytes * 1.5)]],
        "huge_type_name": [[msgpack.packb({"v": m.PROTOCOL_VERSION, "t": "X" * 50_000, "f": {}, "a": []})]],
        "unknown_heartbeat": [
            [bytes(f) for f in encode(m.Heartbeat(actor_id=f"{ghost}-{i}", served_version=0, groups_in_flight=0))] for i in range(64)
        ],
        "unknown_work_request": [[bytes(f) for f in encode(m.WorkRequest(actor_id=f"{ghost}-{i}", max_prompts=1000))] for i in range(64)],
        "unknown_rollout": valid,
    }


def main() -> None:
    addr, server_key, client_key, messages, seconds, max_frame_bytes, out = sys.argv[1:8]
    server_public = zmq.auth.load_certificate(server_key)[0]
    public, secret = zmq.auth.load_certificate(client_key)
    assert secret is not None
    rng = random.Random(0)
    kinds = pools(int(max_frame_bytes), rng)
    names = [*kinds, "register_new_id"]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 1000)
    # It reads nothing and lets almost nothing queue for it: a hub that waited for room to answer it would stall.
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.connect(addr)
    over_cap = [b"\x00" * (transport.HARD_FRAME_FACTOR * int(max_frame_bytes) + 1)]
    sent = dict.fromkeys([*names, "over_hard_cap"], 0)
    t0 = time.monotonic()
    total, limit = 0, int(messages)
    while time.monotonic() - t0 < float(seconds) and total < limit:
        i = total + 1
        if i == limit:
            kind, frames = "over_hard_cap", over_cap  # last: libzmq reads nothing more from this connection
        else:
            kind = names[i % len(names)]
            if kind == "register_new_id":
                frames = [bytes(f) for f in encode(m.Register(actor_id=f"flood-{i}", host="flood", pid=i, served_version=0))]
            else:
                pool = kinds[kind]
                frames = pool[i % len(pool)]
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:  # the hub is not reading us right now: wait for room (TCP backpressure)
            sock.poll(10, zmq.POLLOUT)
            continue
        sent[kind] += 1
        total += 1
    Path(out).write_text(json.dumps({"sent": sent, "total": sum(sent.values()), "seconds": time.monotonic() - t0}))
    sys.stdin.read()  # keep the connection (and what it still has queued) until the test closes our stdin
    sock.close(linger=0)
    ctx.term()


if __name__ == "__main__":
    main()
