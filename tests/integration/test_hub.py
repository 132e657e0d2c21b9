"""Bad input over the real socket: the hub answers with an error naming the problem, counts it, keeps going."""

import msgpack
import numpy as np
import zmq
from conftest import rollout_group

from deploy.tiny import build_tokenizer
from learner.data.prompts import PromptSet, addition_items
from learner.hub.server import Hub
from protocol import messages as m
from protocol.codec import decode, encode
from protocol.config import load_config
from protocol.net import free_port


def _ask(sock, frames):
    sock.send_multipart(frames)
    assert sock.poll(5000), "the hub did not answer"
    return decode(sock.recv_multipart())


def test_bad_input_is_answered_counted_and_survived():
    port = free_port()
    cfg = load_config(None, [f"hub.bind=tcp://127.0.0.1:{port}", "rollout.samples_per_prompt=3", "hub.max_frame_bytes=4096"])
    hub = Hub(cfg, PromptSet(addition_items(), build_tokenizer()))
    hub.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        reply = _ask(sock, [b"\xc1garbage"])
        assert isinstance(reply, m.Error) and "not valid MessagePack" in reply.detail
        reply = _ask(sock, [msgpack.packb({"v": 42, "t": "Register", "f": {}, "a": []})])
        assert "protocol version 42" in reply.detail
        reply = _ask(sock, [bytes(f) for f in encode(rollout_group(n=3))][:-1])  # truncated
        assert "array frames" in reply.detail
        reply = _ask(sock, [b"x" * 5000])
        assert "exceeds the limit of 4096" in reply.detail
        reply = _ask(sock, encode(rollout_group(n=3, actor="stranger")))
        assert reply.code == "unknown_actor"

        ack = _ask(sock, encode(m.Register(actor_id="a0", host="h", pid=1, served_version=0)))
        assert isinstance(ack, m.RegisterAck) and ack.policy_version == 0
        reply = _ask(sock, encode(rollout_group(n=5, actor="a0")))  # a prompt nobody was granted
        assert reply.code == "rejected" and "not granted to 'a0'" in reply.detail

        snap = hub.snapshot()
        assert snap["hub/protocol_errors"] == 4 and snap["hub/unknown_actor"] == 1 and snap["hub/rejected_grant"] == 1
        assert snap["hub/actors"] == 1 and snap["ledger/received"] == 0  # state intact, nothing accepted
        sock.send_multipart(encode(m.WorkRequest(actor_id="a0", max_prompts=2)))
        grants = []
        for _ in range(2):  # still serving
            assert sock.poll(5000), "no grant"
            grants.append(decode(sock.recv_multipart()))
        assert all(isinstance(g, m.WorkGrant) and g.prompt_tokens.dtype == np.int32 for g in grants)
        # Requests are capacities: asking again (as an actor does before its grants arrive) adds nothing while
        # it holds what it can hold; one group back frees one slot.
        for _ in range(3):
            sock.send_multipart(encode(m.WorkRequest(actor_id="a0", max_prompts=2)))
        assert not sock.poll(1000), "granted past the actor's capacity"
        g = grants[0]
        done = rollout_group(n=3, actor="a0", prompt_id=g.prompt_id, epoch=g.epoch, prompt_tokens=g.prompt_tokens)
        sock.send_multipart(encode(done))
        sock.send_multipart(encode(m.WorkRequest(actor_id="a0", max_prompts=2)))
        assert sock.poll(5000) and isinstance(new := decode(sock.recv_multipart()), m.WorkGrant)
        assert not sock.poll(1000), "granted past the actor's capacity"
        # A rejected group (wrong size) gives its prompt back at once and frees the slot.
        bad = rollout_group(n=5, actor="a0", prompt_id=new.prompt_id, epoch=new.epoch, prompt_tokens=new.prompt_tokens)
        assert "expected 3" in (reply := _ask(sock, encode(bad))).detail and reply.code == "rejected"
        assert hub.snapshot()["ledger/requeued_rejected"] == 1 and hub.snapshot()["hub/rejected_size"] == 1
        sock.send_multipart(encode(m.WorkRequest(actor_id="a0", max_prompts=2)))
        assert sock.poll(5000) and isinstance(decode(sock.recv_multipart()), m.WorkGrant)
    finally:
        sock.close(linger=0)
        ctx.term()
        hub.stop()
