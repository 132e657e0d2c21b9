"""Rollout channel: groups per second the hub admits on one core, next to raw ZeroMQ.

    python -m bench.channel [--repeats 3] [--seconds 3] [--smoke]

Columns, per payload (completions x tokens per completion):
  hub groups/s   An actor process speaks the public protocol to the real hub (learner.hub.server.Hub over
                 a real PromptSet, in its own process): Register, WorkRequest, then one RolloutGroup for
                 each WorkGrant it receives, for the prompt granted, encoded and sent as the actor sends
                 (protocol.transport.send), and a WorkRequest after each. The hub decodes, validates and
                 admits every group into its buffer; a trainer stand-in in the hub's process takes batches
                 (take_batch, then finish_update at the same version: no model, no weight sync) so that
                 admission control keeps granting. Groups taken per second, after a warm-up.
  raw msg/s      The same group's frames, encoded once, sent from a DEALER to a ROUTER (the sockets
                 protocol.transport makes) and only received: ZeroMQ alone on the same cores.
  hub / raw      hub groups/s over raw msg/s (medians).
  hub CPU        CPU time of the hub's process (every thread: the hub's loop, the trainer stand-in,
                 ZeroMQ's IO thread) per group admitted, and how busy that kept its core: near 100%, the
                 hub's core is the limit; well below, the actor is.
  encode, decode The codec alone, per group, in this process (timeit; decode includes RolloutGroup.check).

The hub and the raw receiver are pinned to one core, the actor and the raw sender to another
(os.sched_setaffinity, where the OS has it). The table shows medians of --repeats raw/hub pairs,
and the spread of hub groups/s (min-max).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import multiprocessing as mp
import os
import platform
import queue
import statistics
import time
import timeit
from importlib.metadata import version as package_version

import numpy as np
import zmq
import zmq.asyncio

from protocol import messages as m
from protocol import transport
from protocol.codec import decode, encode
from protocol.net import free_port

HWM, MAX_FRAME = 256, 64 << 20
PAYLOADS = [(8, 64), (8, 1024), (16, 8192)]  # completions x tokens per completion
TARGET = ((8, 1024), 1000)  # the hub admits at least this many groups/s of this payload on one core
PROMPTS_PER_STEP = 32  # groups the trainer stand-in takes at a time
ACTOR_CAPACITY = 64  # prompts the actor holds at once (actor.max_groups)
MAX_STALENESS = 4  # admission then allows 5 x PROMPTS_PER_STEP outstanding, more than the actor holds
RUN_LIMIT_S = 120.0  # a side that sees nothing for this long gives up (a broken run fails, it does not hang)


def cores() -> tuple[int | None, int | None]:
    """(the hub's core, the actor's core); None where the OS cannot pin."""
    if not hasattr(os, "sched_getaffinity"):
        return None, None
    allowed = sorted(os.sched_getaffinity(0))
    return allowed[0], allowed[1 % len(allowed)]


def _pin(core: int | None) -> None:
    if core is not None:
        os.sched_setaffinity(0, {core})  # before any thread starts: threads inherit it


def make_group(completions: int, tokens: int) -> m.RolloutGroup:
    rng = np.random.default_rng(0)
    total = completions * tokens
    return m.RolloutGroup(
        actor_id="bench",
        prompt_id=1,
        epoch=0,
        prompt_tokens=rng.integers(0, 32000, 256).astype(np.int32),
        lengths=np.full(completions, tokens, np.int32),
        completion_tokens=rng.integers(0, 32000, total).astype(np.int32),
        behaviour_logprobs=-rng.random(total).astype(np.float32),
        rewards=rng.random(completions).astype(np.float32),
        finish_reasons=["stop"] * completions,
        version_min=0,
        version_max=0,
        gen_s=1.0,
        reward_s=0.01,
    )


# ---- hub groups/s: the real hub, fed by an actor over the public protocol --------------------------


def _hub(port: int, core: int | None, completions: int, tokens: int, warmup_s: float, seconds: float, out: mp.Queue) -> None:
    import logging

    _pin(core)
    from deploy.tiny import build_tokenizer
    from learner.data.prompts import PromptSet, addition_items
    from learner.hub.server import Hub
    from protocol.config import load_config
    from protocol.logs import setup_logging

    setup_logging("bench", level=logging.ERROR)  # the learner logs at INFO; per-group lines are DEBUG either way
    cfg = load_config(
        None,
        [
            f"hub.bind=tcp://127.0.0.1:{port}",
            f"rollout.samples_per_prompt={completions}",
            f"rollout.max_tokens={tokens}",
            f"actor.max_model_len={tokens + 1024}",
            f"train.prompts_per_step={PROMPTS_PER_STEP}",
            f"staleness.max_staleness={MAX_STALENESS}",
            f"hub.hwm={HWM}",
            f"hub.max_frame_bytes={MAX_FRAME}",
        ],
    )
    hub = Hub(cfg, PromptSet(addition_items(), build_tokenizer()))
    hub.start()
    out.put("ready")

    def take() -> int:
        batch = hub.take_batch(PROMPTS_PER_STEP, timeout_s=RUN_LIMIT_S)
        hub.finish_update(0, [item.key for item in batch])  # the version stays 0: no weight sync to wait for
        return len(batch)

    try:
        take()  # the first batch: the actor is up and groups flow
        warm_end = time.perf_counter() + warmup_s
        while time.perf_counter() < warm_end:
            take()
        taken, t0, cpu0 = 0, time.perf_counter(), time.process_time()
        while (wall := time.perf_counter() - t0) < seconds:
            taken += take()
        cpu = time.process_time() - cpu0
        errors = hub.snapshot().get("hub/protocol_errors", 0.0)
        assert errors == 0, f"the hub counted {errors} protocol errors"
        out.put((taken / wall, cpu / taken * 1e6, cpu / wall))
    finally:
        hub.stop()  # sends the actor a Shutdown


def _actor(port: int, core: int | None, completions: int, tokens: int) -> None:
    _pin(core)
    template = make_group(completions, tokens)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        sock = transport.client_socket(ctx, f"tcp://127.0.0.1:{port}", HWM, MAX_FRAME)
        request = m.WorkRequest(actor_id="bench", max_prompts=ACTOR_CAPACITY)
        await transport.send(sock, m.Register(actor_id="bench", host="bench", pid=os.getpid(), served_version=0))
        try:
            while True:
                if not await sock.poll(RUN_LIMIT_S * 1000):
                    raise TimeoutError(f"the hub sent nothing for {RUN_LIMIT_S} s")
                msg = transport.decode_frames(await sock.recv_multipart(copy=False), MAX_FRAME)
                if isinstance(msg, m.RegisterAck):
                    await transport.send(sock, request)
                elif isinstance(msg, m.WorkGrant):
                    template.prompt_id, template.epoch, template.prompt_tokens = msg.prompt_id, msg.epoch, msg.prompt_tokens
                    await transport.send(sock, template)  # encoded afresh each time, as the actor's group is
                    await transport.send(sock, request)
                elif isinstance(msg, m.Shutdown):
                    return
                else:
                    raise AssertionError(f"the hub answered {msg}")
        finally:
            sock.close(linger=0)
            ctx.term()

    asyncio.run(main())


def _get(q: mp.Queue, procs: list) -> object:
    """The next result on `q`; an AssertionError, not a hang, if a process exits first or nothing comes."""
    deadline = time.monotonic() + RUN_LIMIT_S
    while time.monotonic() < deadline:
        try:
            return q.get(timeout=0.5)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode is not None]
            if dead:
                raise AssertionError(f"{dead[0].name} exited with {dead[0].exitcode} before reporting") from None
    raise AssertionError(f"no result in {RUN_LIMIT_S} s")


def measure_hub(completions: int, tokens: int, warmup_s: float, seconds: float) -> tuple[float, float, float]:
    """(groups/s taken from the hub's buffer, hub CPU us per group, hub CPU busy fraction)."""
    spawn = mp.get_context("spawn")  # fresh processes: nothing inherited from this one or from a previous run
    hub_core, actor_core = cores()
    port, q = free_port(), spawn.Queue()
    hub = spawn.Process(target=_hub, args=(port, hub_core, completions, tokens, warmup_s, seconds, q))
    hub.start()
    assert _get(q, [hub]) == "ready"
    actor = spawn.Process(target=_actor, args=(port, actor_core, completions, tokens))
    actor.start()
    result = _get(q, [hub, actor])
    hub.join(timeout=30)
    actor.join(timeout=30)
    assert hub.exitcode == 0 and actor.exitcode == 0, f"exit codes: hub {hub.exitcode}, actor {actor.exitcode}"
    return result


# ---- raw ZeroMQ: the same frames, only sent and received ------------------------------------------


def _raw_receiver(port: int, core: int | None, count: int, out: mp.Queue) -> None:
    _pin(core)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        sock = transport.hub_socket(ctx, f"tcp://127.0.0.1:{port}", HWM, MAX_FRAME)
        out.put("ready")
        await sock.recv_multipart(copy=False)  # the first message starts the clock
        t0 = time.perf_counter()
        for _ in range(count - 1):
            await sock.recv_multipart(copy=False)
        out.put((count - 1) / (time.perf_counter() - t0))
        sock.close(linger=0)
        ctx.term()

    asyncio.run(main())


def _raw_sender(port: int, core: int | None, count: int, frames: list[bytes]) -> None:
    _pin(core)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        sock = transport.client_socket(ctx, f"tcp://127.0.0.1:{port}", HWM, MAX_FRAME)
        for _ in range(count):
            await sock.send_multipart(frames, copy=False)
        await asyncio.sleep(0.5)
        sock.close(linger=2000)
        ctx.term()

    asyncio.run(main())


def measure_raw(frames: list[bytes], count: int) -> float:
    """Messages per second received."""
    spawn = mp.get_context("spawn")
    hub_core, actor_core = cores()
    port, q = free_port(), spawn.Queue()
    recv = spawn.Process(target=_raw_receiver, args=(port, hub_core, count, q))
    recv.start()
    assert _get(q, [recv]) == "ready"
    send = spawn.Process(target=_raw_sender, args=(port, actor_core, count, frames))
    send.start()
    rate = _get(q, [recv, send])
    send.join(timeout=30)
    recv.join(timeout=30)
    return rate


# ---- the table --------------------------------------------------------------------------------------


def codec_us(group: m.RolloutGroup) -> tuple[float, float]:
    """(encode, decode) microseconds per group, best of 5 timeit runs."""
    frames = [bytes(f) for f in encode(group)]
    n = 2000
    enc = min(timeit.repeat(lambda: encode(group), number=n, repeat=5)) / n * 1e6
    dec = min(timeit.repeat(lambda: decode(frames), number=n, repeat=5)) / n * 1e6
    return enc, dec


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores; Python {platform.python_version()}, pyzmq {zmq.__version__}, "
        f"libzmq {zmq.zmq_version()}, msgpack {package_version('msgpack')}, numpy {np.__version__}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="raw/hub pairs per payload")
    ap.add_argument("--seconds", type=float, default=3.0, help="how long one hub measurement runs, after its warm-up")
    ap.add_argument("--smoke", action="store_true", help="the target payload only, once, briefly (about ten seconds in all)")
    args = ap.parse_args()
    payloads, repeats, seconds, warmup = PAYLOADS, args.repeats, args.seconds, 1.0
    if args.smoke:
        payloads, repeats, seconds, warmup = [TARGET[0]], 1, 0.5, 0.3
    rows = []
    for completions, tokens in payloads:
        group = make_group(completions, tokens)
        frames = [bytes(f) for f in encode(group)]
        count = 500 if args.smoke else int(measure_raw(frames, 1000) * seconds)  # raw runs about as long as a hub run
        raw, hub = [], []
        for _ in range(repeats):
            raw.append(measure_raw(frames, count))
            hub.append(measure_hub(completions, tokens, warmup, seconds))
        rates = [h[0] for h in hub]
        rows.append(
            (
                (completions, tokens),
                sum(map(len, frames)),
                statistics.median(rates),
                min(rates),
                max(rates),
                statistics.median(raw),
                statistics.median(h[1] for h in hub),
                statistics.median(h[2] for h in hub),
                *codec_us(group),
            )
        )
    print(
        f"\n`python -m bench.channel{' --smoke' if args.smoke else ''}`; {machine()}; "
        f"{datetime.date.today().isoformat()}; medians of {repeats} run(s).\n"
    )
    print(
        "| payload (completions x tokens) | bytes/group | hub groups/s (min-max) | raw ZeroMQ msg/s | hub / raw "
        "| hub CPU us/group (core busy) | encode us | decode us |"
    )
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    for (c, t), size, med, lo, hi, raw_rate, cpu_us, busy, enc, dec in rows:
        print(
            f"| {c} x {t} | {size:,} | {med:,.0f} ({lo:,.0f}-{hi:,.0f}) | {raw_rate:,.0f} | {med / raw_rate:.2f} "
            f"| {cpu_us:,.0f} ({busy:.0%}) | {enc:.1f} | {dec:.1f} |"
        )
    (target_c, target_t), target_rate = TARGET
    got = next(r[2] for r in rows if r[0] == (target_c, target_t))
    verdict = "meets" if got >= target_rate else "misses"
    print(
        f"\nThe hub admits {got:,.0f} groups/s of {target_c} x {target_t} tokens on one core: it {verdict} the target of "
        f"{target_rate:,} (64 H100s generating with a 7B model produce on the order of 10-20 groups/s)."
    )


if __name__ == "__main__":
    main()
