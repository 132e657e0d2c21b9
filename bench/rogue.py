"""The chaos run's rogue client (bench/chaos.py): it speaks the protocol like an actor and answers each grant with
one bad group of a kind, so that the run can check the hub refuses every one of them:

  vocab          a token id >= the vocabulary
  negative_id    a negative token id
  huge_reward    a reward of 3e38
  too_long       a completion longer than rollout.max_tokens
  empty_prompt   an empty prompt
  never_granted  a prompt of the next pass over the data, granted to nobody
  low_logprob    a behaviour logprob of -200

It claims to serve every version it is sent, weights never loaded, as a broken actor would.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from protocol import messages as m
from protocol import transport
from protocol.codec import encode

BAD_KINDS = ("vocab", "negative_id", "huge_reward", "too_long", "empty_prompt", "never_granted", "low_logprob")


@dataclass
class Rogue:
    """A client that speaks the protocol and sends one bad group of each kind; records what came back."""

    addr: str
    vocab: int
    max_tokens: int
    samples: int
    replies: dict[str, str] = field(default_factory=dict)  # kind -> reply code (or what happened)
    sessions: int = 0
    actor: str = ""  # the id of the current session

    def run(self, kinds: tuple[str, ...] = BAD_KINDS, timeout_s: float = 90.0) -> None:
        ctx = zmq.Context()
        todo = list(kinds)
        deadline = time.monotonic() + timeout_s
        try:
            while todo and time.monotonic() < deadline:
                self.sessions += 1
                self._session(ctx, todo, deadline)
        finally:
            ctx.destroy(linger=0)
        for kind in todo:
            self.replies.setdefault(kind, "no grant")

    def _session(self, ctx: zmq.Context, todo: list[str], deadline: float) -> None:
        """One connection, one actor id: register, ask for work, answer each grant with the next bad group."""
        sock = ctx.socket(zmq.DEALER)
        sock.connect(self.addr)
        actor = self.actor = f"rogue-{self.sessions}"
        try:
            ack = self._ask(sock, m.Register(actor_id=actor, host="rogue", pid=os.getpid(), served_version=0), deadline)
            if not isinstance(ack, m.RegisterAck):
                return
            # Claims the learner's version without loading it, as a broken actor would.
            _send(sock, m.WeightVersion(actor_id=actor, served_version=ack.policy_version, group_epoch=0, load_s=0.0))
            while todo and time.monotonic() < deadline:
                _send(sock, m.WorkRequest(actor_id=actor, max_prompts=2))  # one may still be held
                grant = self._wait(sock, m.WorkGrant, min(deadline, time.monotonic() + 5))
                if not isinstance(grant, m.WorkGrant):
                    return  # evicted, quarantined or no work: a new session
                kind = todo[0]
                reply = self._ask(sock, self._bad(kind, actor, grant), min(deadline, time.monotonic() + 5))
                self.replies[kind] = reply.code if isinstance(reply, m.Error) else type(reply).__name__ if reply else "no reply"
                todo.pop(0)
                if isinstance(reply, m.Error) and reply.code != "rejected":
                    return  # quarantined or forgotten: go on as someone new
        finally:
            sock.close(linger=0)

    def _ask(self, sock: zmq.Socket, msg: m.Message, deadline: float) -> m.Message | None:
        _send(sock, msg)
        return self._wait(sock, (m.Error, m.RegisterAck), deadline)

    def _wait(self, sock: zmq.Socket, kinds, deadline: float) -> m.Message | None:
        """The next message of `kinds`. A WeightSync is answered with a claim to serve its version, weights never
        loaded, so that the hub keeps granting to this client (it grants only to actors serving the current version)."""
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(int(left * 1000)):
                return None
            msg = transport.decode_frames(sock.recv_multipart(), 1 << 24)
            if isinstance(msg, m.WeightSync):
                _send(
                    sock, m.WeightVersion(actor_id=self.actor, served_version=msg.policy_version, group_epoch=msg.group_epoch, load_s=0.0)
                )
            if isinstance(msg, kinds):
                return msg
        return None

    def _bad(self, kind: str, actor: str, grant: m.WorkGrant) -> m.RolloutGroup:
        n = self.samples
        lengths = np.full(n, 2, np.int32)
        tokens = np.ones(2 * n, np.int32)
        logprobs = np.full(2 * n, -0.5, np.float32)
        rewards = np.ones(n, np.float32)
        prompt, prompt_id, epoch = grant.prompt_tokens, grant.prompt_id, grant.epoch
        if kind == "vocab":
            tokens[0] = self.vocab
        elif kind == "negative_id":
            tokens[0] = -1
        elif kind == "huge_reward":
            rewards[0] = 3e38
        elif kind == "too_long":
            lengths[0] = 1000 * self.max_tokens
            tokens = np.ones(int(lengths.sum()), np.int32)
            logprobs = np.full(tokens.size, -0.5, np.float32)
        elif kind == "empty_prompt":
            prompt = np.zeros(0, np.int32)
        elif kind == "never_granted":  # the next pass over the data: not opened yet, so granted to nobody
            epoch += 1
        elif kind == "low_logprob":
            logprobs[0] = -200.0
        return m.RolloutGroup(
            actor_id=actor,
            prompt_id=prompt_id,
            epoch=epoch,
            prompt_tokens=prompt,
            lengths=lengths,
            completion_tokens=tokens,
            behaviour_logprobs=logprobs,
            rewards=rewards,
            finish_reasons=["stop"] * n,
            version_min=grant.policy_version,
            version_max=grant.policy_version,
            gen_s=0.1,
            reward_s=0.0,
        )


def _send(sock: zmq.Socket, msg: m.Message) -> None:
    frames: list[Any] = encode(msg)  # bytes and numpy arrays: pyzmq sends either (buffer protocol)
    sock.send_multipart(frames)
