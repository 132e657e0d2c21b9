"""A fleet of scripted actors in one process, for bench/hub_scale.py: one DEALER socket per actor, the real
actor's message pattern (actors/session.py, actors/main.py), no engine.

    Register --RegisterAck--> WorkRequest(max_groups); every heartbeat_s: Heartbeat + WorkRequest (if room)
    WorkGrant --gen_s later--> RolloutGroup (honest: the granted prompt's tokens, the served version) + WorkRequest
    WeightSync --load_s later--> WeightVersion          Error unknown_actor --> Register again      Shutdown --> stop

One thread waits on every socket's file descriptor (epoll: zmq.Poller looks at every socket on each wake, which
made a thousand actors the bench's bottleneck) and runs the actors' timers from one heap, so a thousand actors
cost one process. ZeroMQ's descriptor signals edges only, so a socket is drained after each signal and after
each send on it. Each actor counts the messages it sends and keeps their send times: the hub's side
(bench/hub_scale.py) says which message each grant answered, and the difference is the grant latency.
SIGSTOP the process and every actor in it hangs with its socket open; SIGKILL it and every connection closes.
"""

from __future__ import annotations

import heapq
import os
import random
import select
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from protocol import messages as m
from protocol import transport
from protocol.codec import encode

MAX_FRAME = 1 << 24
LOAD_S = 0.01  # how long a scripted weight load takes
GEN_S = (0.2, 0.6)  # a group's generation time, uniform in this range (a demo group on the CPU engine)


@dataclass(slots=True)
class Scripted:
    actor_id: str
    sock: zmq.Socket
    served: int = 0
    held: int = 0
    registered: bool = False
    beating: bool = False
    sends: list[float] = field(default_factory=list)  # send time of the actor's n-th message at [n - 1]
    grants: dict[tuple[int, int], float] = field(default_factory=dict)  # (epoch, prompt id) -> arrival time


class Fleet:
    def __init__(self, addr: str, ids: list[str], capacity: int, samples: int, heartbeat_s: float, seed: int):
        self.capacity, self.samples, self.heartbeat_s = capacity, samples, heartbeat_s
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        self.ctx = zmq.Context()
        self.actors = [Scripted(a, transport.client_socket(self.ctx, addr, 256, MAX_FRAME)) for a in ids]  # type: ignore[arg-type]
        self.timers: list[tuple[float, int, int, str, Any]] = []  # (when, tiebreak, actor index, what, arg)
        self.tick = 0
        self.stopped = 0
        self.check: set[int] = set()  # actors (by id()) whose sockets may hold messages

    def at(self, when: float, index: int, what: str, arg: Any = None) -> None:
        self.tick += 1
        heapq.heappush(self.timers, (when, self.tick, index, what, arg))

    def send(self, a: Scripted, msg: m.Message) -> None:
        a.sends.append(time.monotonic())
        frames: list[Any] = encode(msg)
        a.sock.send_multipart(frames)
        self.check.add(id(a))  # a send can swallow the descriptor's edge: look at it again

    def group(self, a: Scripted, grant: m.WorkGrant, version: int) -> m.RolloutGroup:
        """Like tests/conftest.py's rollout_group: completions of 1..4 tokens, ids < 20, logprobs in (-1, 0]."""
        n, rng = self.samples, self.np_rng
        lengths = rng.integers(1, 5, size=n).astype(np.int32)
        total = int(lengths.sum())
        return m.RolloutGroup(
            actor_id=a.actor_id,
            prompt_id=grant.prompt_id,
            epoch=grant.epoch,
            prompt_tokens=grant.prompt_tokens,
            lengths=lengths,
            completion_tokens=rng.integers(0, 20, size=total).astype(np.int32),
            behaviour_logprobs=-rng.random(total).astype(np.float32),
            rewards=rng.random(n).astype(np.float32),
            finish_reasons=["stop"] * n,
            version_min=version,
            version_max=version,
            gen_s=0.3,
            reward_s=0.001,
        )

    def request(self, a: Scripted) -> None:
        if a.registered and a.held < self.capacity:
            self.send(a, m.WorkRequest(actor_id=a.actor_id, max_prompts=self.capacity))

    def register(self, a: Scripted) -> None:
        a.registered = False
        self.send(a, m.Register(actor_id=a.actor_id, host="bench", pid=os.getpid(), served_version=a.served))

    def on_message(self, i: int, a: Scripted, msg: m.Message, now: float) -> None:
        if isinstance(msg, m.RegisterAck):
            a.registered = True
            self.request(a)
            if not a.beating:
                a.beating = True
                self.at(now + self.heartbeat_s * self.rng.random(), i, "beat")
        elif isinstance(msg, m.WorkGrant):
            a.held += 1
            a.grants[(msg.epoch, msg.prompt_id)] = now
            self.at(now + self.rng.uniform(*GEN_S), i, "done", (msg, a.served))
        elif isinstance(msg, m.WeightSync):
            self.at(now + LOAD_S, i, "loaded", msg)
        elif isinstance(msg, m.Error):
            if msg.code == "unknown_actor":
                self.register(a)
        elif isinstance(msg, m.Shutdown):
            a.registered = False
            self.stopped += 1

    def on_timer(self, i: int, what: str, arg: Any, now: float) -> None:
        a = self.actors[i]
        if what == "register":
            self.register(a)
        elif what == "beat":
            if a.registered:
                self.send(a, m.Heartbeat(actor_id=a.actor_id, served_version=a.served, groups_in_flight=a.held))
                self.request(a)
            self.at(now + self.heartbeat_s, i, "beat")
        elif what == "done":
            grant, version = arg
            a.held -= 1
            if a.registered:
                self.send(a, self.group(a, grant, version))
                self.request(a)
        elif what == "loaded":
            sync: m.WeightSync = arg
            a.served = max(a.served, sync.policy_version)
            if a.registered:
                self.send(a, m.WeightVersion(actor_id=a.actor_id, served_version=a.served, group_epoch=sync.group_epoch, load_s=LOAD_S))

    def run(self, stop_at: float, spread_s: float = 1.0) -> None:
        """Serve until every actor was told to shut down, or `stop_at` (monotonic)."""
        start = time.monotonic()
        for i in range(len(self.actors)):
            self.at(start + spread_s * i / max(1, len(self.actors)), i, "register")
        index = {id(a): i for i, a in enumerate(self.actors)}
        epoll = select.epoll()
        by_fd = {}
        for a in self.actors:
            fd = int(a.sock.getsockopt(zmq.FD))
            by_fd[fd] = a
            epoll.register(fd, select.EPOLLIN)
        self.check = set(index)
        while self.stopped < len(self.actors) and (now := time.monotonic()) < stop_at:
            while self.timers and self.timers[0][0] <= now:
                _, _, i, what, arg = heapq.heappop(self.timers)
                self.on_timer(i, what, arg, now)
            wait_s = 0.0 if self.check else 0.05 if not self.timers else max(0.0, min(0.05, self.timers[0][0] - now))
            for fd, _ in epoll.poll(wait_s):
                self.check.add(id(by_fd[fd]))
            todo, self.check = self.check, set()
            for key in todo:
                i = index[key]
                a = self.actors[i]
                while int(a.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    frames = a.sock.recv_multipart(flags=zmq.NOBLOCK)
                    self.on_message(i, a, transport.decode_frames(frames, MAX_FRAME), time.monotonic())
        epoll.close()

    def report(self) -> dict[str, Any]:
        return {a.actor_id: (a.sends, a.grants) for a in self.actors}

    def close(self) -> None:
        for a in self.actors:
            a.sock.close(linger=0)
        self.ctx.term()


def serve(addr: str, ids: list[str], capacity: int, samples: int, heartbeat_s: float, seed: int, limit_s: float, out: Any) -> None:
    """A process's whole life: run the fleet, then put its report on `out` (a multiprocessing queue)."""
    fleet = Fleet(addr, ids, capacity, samples, heartbeat_s, seed)
    try:
        fleet.run(time.monotonic() + limit_s)
        out.put(("fleet", fleet.report()))
    finally:
        fleet.close()
