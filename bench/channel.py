"""Rollout channel throughput vs raw ZeroMQ bytes, same payload, same sockets, one run.

FleetRL's channel: the actor encodes a RolloutGroup (msgpack header + raw array
frames) and sends it from an asyncio DEALER; the hub's ROUTER receives it and
`decode` validates every field before it is used. Raw: the same frames' bytes sent
over the same socket pair and received without decoding. Each side runs in its own
process over TCP loopback.

    python -m bench.channel [--seconds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time

import numpy as np
import zmq
import zmq.asyncio

from protocol import messages as m
from protocol import transport
from protocol.codec import encode
from protocol.net import free_port

HWM, MAX_FRAME = 256, 64 << 20


def make_group(completions: int, tokens: int) -> m.RolloutGroup:
    rng = np.random.default_rng(0)
    total = completions * tokens
    return m.RolloutGroup(
        actor_id="bench", prompt_id=1, epoch=0, prompt_tokens=rng.integers(0, 32000, 256).astype(np.int32),
        lengths=np.full(completions, tokens, np.int32), completion_tokens=rng.integers(0, 32000, total).astype(np.int32),
        behaviour_logprobs=-rng.random(total).astype(np.float32), rewards=rng.random(completions).astype(np.float32),
        finish_reasons=["stop"] * completions, version_min=3, version_max=3, gen_s=1.0, reward_s=0.01)


def _receiver(port: int, mode: str, count: int, out) -> None:
    async def main():
        ctx = zmq.asyncio.Context()
        sock = transport.hub_socket(ctx, f"tcp://127.0.0.1:{port}", HWM, MAX_FRAME)
        out.put("ready")
        got = await sock.recv_multipart(copy=False)  # first message starts the clock
        t0 = time.perf_counter()
        nbytes = 0
        for _ in range(count - 1):
            frames = await sock.recv_multipart(copy=False)
            if mode == "fleetrl":
                msg = transport.decode_frames(frames[1:], MAX_FRAME)
                nbytes += msg.completion_tokens.nbytes + msg.behaviour_logprobs.nbytes
            else:
                nbytes += sum(len(f.buffer) for f in frames[1:])
        out.put((time.perf_counter() - t0, nbytes, len(got)))
        sock.close(linger=0)
        ctx.term()

    asyncio.run(main())


def _sender(port: int, mode: str, count: int, group: m.RolloutGroup) -> None:
    async def main():
        ctx = zmq.asyncio.Context()
        sock = transport.actor_socket(ctx, f"tcp://127.0.0.1:{port}", HWM, MAX_FRAME)
        raw = [bytes(f) for f in encode(group)]
        for _ in range(count):
            if mode == "fleetrl":
                await transport.send(sock, group)
            else:
                await sock.send_multipart(raw, copy=False)
        await asyncio.sleep(0.5)
        sock.close(linger=2000)
        ctx.term()

    asyncio.run(main())


def measure(mode: str, group: m.RolloutGroup, count: int) -> float:
    """Messages per second."""
    port = free_port()
    q = mp.Queue()
    recv = mp.Process(target=_receiver, args=(port, mode, count, q))
    recv.start()
    assert q.get(timeout=30) == "ready"
    send = mp.Process(target=_sender, args=(port, mode, count, group))
    send.start()
    elapsed, _, _ = q.get(timeout=300)
    send.join()
    recv.join()
    return (count - 1) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for completions, tokens, count in [(8, 64, 20000), (8, 1024, 5000), (16, 8192, 400)]:
        group = make_group(completions, tokens)
        size = sum(len(bytes(f)) for f in encode(group))
        best = {mode: max(measure(mode, group, count) for _ in range(args.repeats)) for mode in ("raw", "fleetrl")}
        rows.append((f"{completions}x{tokens} tokens", size, best["raw"], best["fleetrl"]))
    print(f"\n{'payload':<22}{'bytes/msg':>12}{'raw zmq msg/s':>16}{'fleetrl msg/s':>16}{'raw MB/s':>12}{'fleetrl MB/s':>14}{'ratio':>8}")
    for name, size, raw, ours in rows:
        print(f"{name:<22}{size:>12,}{raw:>16,.0f}{ours:>16,.0f}{raw * size / 1e6:>12,.0f}{ours * size / 1e6:>14,.0f}{ours / raw:>8.2f}")
    print("\nratio = FleetRL channel (encode + send + receive + validated decode) / raw bytes on the same sockets; target >= 0.8")


if __name__ == "__main__":
    main()
