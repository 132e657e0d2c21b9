"""Rollout channel throughput vs raw ZeroMQ bytes, same payload, same sockets, one run.

Columns (both in two processes over TCP loopback, the sockets `protocol.transport` makes):
  raw      the sender sends the frames of one encoded RolloutGroup, prepared once, with
           `send_multipart(copy=False)`; the receiver only `recv_multipart(copy=False)`s them.
  fleetrl  the sender encodes the group for every message (`transport.send`: msgpack header
           + raw array frames) over the same call; the receiver makes the same receive call
           and then `decode`s (validates every field, builds the RolloutGroup) each message.
           encode and decode run their compiled fast paths (protocol/_fastcodec.pyx).
  python   the same as fleetrl with the Python encoder and decoder alone (`codec.encode_python`,
           `codec.decode_python`): what the compiled fast paths save.
  ratio    fleetrl (or python) msg/s / raw msg/s of one raw/fleetrl/python triple run back to back;
           the table shows the median over --repeats triples and the spread (min-max). Target >= 0.8.
  cpu us/msg  CPU time of both processes (all their threads, the zmq IO threads included) per
           message: less sensitive to other load on the machine than msg/s.

    python -m bench.channel [--repeats 5] [--seconds 1.5]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time

import numpy as np
import zmq
import zmq.asyncio

from protocol import messages as m
from protocol import transport
from protocol.codec import decode_python, encode, encode_python
from protocol.net import free_port

HWM, MAX_FRAME = 256, 64 << 20
PAYLOADS = [(8, 64), (8, 1024), (16, 8192)]  # completions x tokens per completion
MODES = ("raw", "fleetrl", "python")


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
        await sock.recv_multipart(copy=False)  # first message starts the clock
        t0, cpu0 = time.perf_counter(), time.process_time()
        decode = {"fleetrl": transport.decode_frames, "python": decode_python}.get(mode)
        for _ in range(count - 1):
            frames = await sock.recv_multipart(copy=False)
            if decode is not None:
                assert decode(frames[1:], MAX_FRAME).prompt_id == 1
        out.put(("recv", time.perf_counter() - t0, time.process_time() - cpu0))
        sock.close(linger=0)
        ctx.term()

    asyncio.run(main())


def _sender(port: int, mode: str, count: int, group: m.RolloutGroup, out) -> None:
    async def main():
        ctx = zmq.asyncio.Context()
        sock = transport.actor_socket(ctx, f"tcp://127.0.0.1:{port}", HWM, MAX_FRAME)
        raw = [bytes(f) for f in encode(group)]
        cpu0 = time.process_time()
        for _ in range(count):
            if mode == "fleetrl":
                await transport.send(sock, group)
            elif mode == "python":
                await sock.send_multipart(encode_python(group), copy=False)
            else:
                await sock.send_multipart(raw, copy=False)
        out.put(("send", 0.0, time.process_time() - cpu0))
        await asyncio.sleep(0.5)
        sock.close(linger=2000)
        ctx.term()

    asyncio.run(main())


def measure(mode: str, group: m.RolloutGroup, count: int) -> tuple[float, float]:
    """(messages per second, CPU microseconds per message of both processes)."""
    port = free_port()
    q: mp.Queue = mp.Queue()
    recv = mp.Process(target=_receiver, args=(port, mode, count, q))
    recv.start()
    assert q.get(timeout=30) == "ready"
    send = mp.Process(target=_sender, args=(port, mode, count, group, q))
    send.start()
    results = dict((side, (wall, cpu)) for side, wall, cpu in (q.get(timeout=300), q.get(timeout=300)))
    send.join()
    recv.join()
    elapsed = results["recv"][0]
    return (count - 1) / elapsed, (results["recv"][1] + results["send"][1]) / count * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="raw/fleetrl/python triples per payload, run in turn")
    ap.add_argument("--seconds", type=float, default=1.5, help="about how long one measurement runs")
    args = ap.parse_args()
    rows = []
    for completions, tokens in PAYLOADS:
        group = make_group(completions, tokens)
        size = sum(memoryview(f).nbytes for f in encode(group))
        rate, _ = measure("raw", group, 2000)  # sizes the runs so each takes about --seconds
        count = max(200, int(rate * args.seconds))
        runs: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
        for _ in range(args.repeats):
            for mode in MODES:
                runs[mode].append(measure(mode, group, count))
        ratios = {mode: [f[0] / r[0] for r, f in zip(runs["raw"], runs[mode], strict=True)] for mode in MODES[1:]}
        med = {mode: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for mode, v in runs.items()}
        rows.append((f"{completions}x{tokens} tokens", size, med, ratios))
    print(f"\n{'payload':<18}{'bytes/msg':>11}{'raw msg/s':>11}{'fleetrl msg/s':>15}{'ratio':>7}{'(min-max)':>12}"
          f"{'python-only ratio':>19}{'cpu us/msg: raw':>17}{'fleetrl':>9}{'python':>8}")
    for name, size, med, ratios in rows:
        fast, slow = ratios["fleetrl"], ratios["python"]
        print(f"{name:<18}{size:>11,}{med['raw'][0]:>11,.0f}{med['fleetrl'][0]:>15,.0f}{statistics.median(fast):>7.2f}"
              f"{f'{min(fast):.2f}-{max(fast):.2f}':>12}{f'{statistics.median(slow):.2f} ({min(slow):.2f}-{max(slow):.2f})':>19}"
              f"{med['raw'][1]:>17.1f}{med['fleetrl'][1]:>9.1f}{med['python'][1]:>8.1f}")
    print(f"\nmedians of {args.repeats} raw/fleetrl/python triples; ratio = fleetrl / raw msg/s within each triple (target >= 0.8).")
    print("raw: the same frames received without decoding; fleetrl: encode + send + receive + validated decode;")
    print("python-only: fleetrl without the compiled fast paths (protocol/_fastcodec.pyx).")


if __name__ == "__main__":
    main()
