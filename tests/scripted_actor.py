"""An actor driven by a script instead of an engine, over the real protocol and sockets.

Used to test the hub (admission, the staleness check, leases, the ledger) without
starting vLLM. `lie_every`: every n-th group claims a version older than the bound
allows, as a buggy or hostile actor would; the hub must never let it be trained.
It heartbeats every `heartbeat_s` as the actor does (an actor the hub has not heard from for hub.silent_s gets
no grants until it is heard from again). Eval grants are answered with `eval_reward(split, prompt_id)` per completion;
`die_on_eval` makes the actor vanish (no reply, no more heartbeats) on its first
eval grant, as a crashed actor would.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable

import numpy as np
import zmq
import zmq.asyncio

from protocol import messages as m
from protocol import transport
from protocol.auth import ClientKeys


class ScriptedActor:
    def __init__(
        self,
        addr: str,
        actor_id: str,
        n: int,
        delay_s: float,
        seed: int,
        lie_every: int = 0,
        lie_by: int = 0,
        heartbeat_s: float = 1.0,
        eval_reward: Callable[[str, int], float] = lambda split, pid: 1.0,
        die_on_eval: bool = False,
        keys: ClientKeys | None = None,
    ):
        self.addr, self.actor_id, self.n, self.delay_s = addr, actor_id, n, delay_s
        self.rng = random.Random(seed)
        self.lie_every, self.lie_by = lie_every, lie_by
        self.heartbeat_s, self.eval_reward, self.die_on_eval = heartbeat_s, eval_reward, die_on_eval
        self.keys = keys  # CURVE client keys (protocol.auth.client_keys), None for a plain socket
        self.eval_grants: list[m.EvalGrant] = []  # every eval grant received
        self.eval_answered = 0
        self.served = 0
        self.target_version = 0  # set by the test when the learner steps (stands in for the weight sync)
        self.sent = 0
        self.stop = threading.Event()
        self.quiet = threading.Event()  # stop working but stay connected (a closed connection is removed at once)
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def start(self):
        self.thread.start()
        return self

    async def _main(self):
        ctx = zmq.asyncio.Context()
        sock = transport.client_socket(ctx, self.addr, 64, 1 << 20, self.keys)
        await transport.send(sock, m.Register(actor_id=self.actor_id, host="test", pid=0, served_version=0))
        tasks = set()

        async def run(grant: m.WorkGrant):
            while self.served < grant.policy_version:
                await asyncio.sleep(0.005)
            version = self.served
            await asyncio.sleep(self.delay_s * self.rng.random())
            self.sent += 1
            if self.lie_every and self.sent % self.lie_every == 0:
                version = max(0, version - self.lie_by)
            lengths = np.full(self.n, 2, dtype=np.int32)
            await transport.send(
                sock,
                m.RolloutGroup(
                    actor_id=self.actor_id,
                    prompt_id=grant.prompt_id,
                    epoch=grant.epoch,
                    prompt_tokens=grant.prompt_tokens,
                    lengths=lengths,
                    completion_tokens=np.ones(2 * self.n, np.int32),
                    behaviour_logprobs=np.full(2 * self.n, -0.5, np.float32),
                    rewards=np.asarray([self.rng.random() for _ in range(self.n)], np.float32),
                    finish_reasons=["stop"] * self.n,
                    version_min=version,
                    version_max=version,
                    gen_s=0.0,
                    reward_s=0.0,
                ),
            )
            await transport.send(sock, m.WorkRequest(actor_id=self.actor_id, max_prompts=4))

        async def answer(grant: m.EvalGrant):
            while self.served < grant.policy_version:
                await asyncio.sleep(0.005)
            await asyncio.sleep(self.delay_s * self.rng.random())
            await transport.send(
                sock,
                m.EvalResult(
                    actor_id=self.actor_id,
                    eval_round=grant.eval_round,
                    split=grant.split,
                    prompt_id=grant.prompt_id,
                    lengths=np.full(grant.n, 2, np.int32),
                    rewards=np.full(grant.n, self.eval_reward(grant.split, grant.prompt_id), np.float32),
                    finish_reasons=["stop"] * grant.n,
                    version_min=self.served,
                    version_max=self.served,
                    gen_s=0.0,
                ),
            )
            self.eval_answered += 1

        last_beat = time.monotonic()
        while not self.stop.is_set():
            if self.quiet.is_set():
                for t in tasks:
                    t.cancel()
                await asyncio.sleep(0.01)
                continue
            if self.heartbeat_s and time.monotonic() - last_beat > self.heartbeat_s:
                last_beat = time.monotonic()
                await transport.send(sock, m.Heartbeat(actor_id=self.actor_id, served_version=self.served, groups_in_flight=0))
            if self.served < self.target_version:
                self.served = self.target_version
                await transport.send(sock, m.WeightVersion(actor_id=self.actor_id, served_version=self.served, group_epoch=0, load_s=0.0))
            if not await sock.poll(5):
                continue
            msg = transport.decode_frames(await sock.recv_multipart(), 1 << 20)
            if isinstance(msg, m.RegisterAck):
                await transport.send(sock, m.WorkRequest(actor_id=self.actor_id, max_prompts=4))
            elif isinstance(msg, m.WorkGrant):
                t = asyncio.ensure_future(run(msg))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            elif isinstance(msg, m.EvalGrant):
                self.eval_grants.append(msg)
                if self.die_on_eval:
                    break  # crashed: the grants it holds are never answered
                t = asyncio.ensure_future(answer(msg))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            elif isinstance(msg, m.Shutdown):
                break
        for t in tasks:
            t.cancel()
        sock.close(linger=0)
        ctx.term()
