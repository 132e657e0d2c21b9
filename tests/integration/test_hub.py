"""Bad input over the real socket: the hub answers with an error naming the problem, counts it, keeps going."""

import threading
import time

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


def test_a_peer_that_stops_reading_holds_up_only_its_own_messages(monkeypatch):
    """The hub never blocks on a full peer: what finds its queue full waits in that peer's own line, in order, while
    everyone else's messages go out at once; the line goes out when the peer reads again, and what is still
    waiting after SEND_TIMEOUT_S fails (counted in hub/send_failures)."""
    from learner.hub import thread
    from learner.hub.core.records import Out

    monkeypatch.setattr(thread, "SEND_TIMEOUT_S", 3.0)
    port = free_port()
    cfg = load_config(None, [f"hub.bind=tcp://127.0.0.1:{port}", "hub.hwm=2"])
    hub = Hub(cfg, PromptSet(addition_items(), build_tokenizer()))
    hub.start()
    ctx = zmq.Context()
    socks = {}
    try:
        for name in ("slow", "fast"):
            s = socks[name] = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.RCVHWM, 2)
            s.setsockopt(zmq.RCVBUF, 4096)
            s.connect(f"tcp://127.0.0.1:{port}")
            assert isinstance(_ask(s, encode(m.Register(actor_id=name, host="h", pid=1, served_version=0))), m.RegisterAck)
        with hub.cond:
            ident = {a: st.identity for a, st in hub.state.actors.items()}
        big = "x" * (256 << 10)  # far more than the socket buffers hold: the slow peer's queue fills after a few

        def flood(tag: str) -> threading.Event:
            to_slow = [Out(ident["slow"], m.Shutdown(reason=f"{i} {tag} {big}"), reply=False) for i in range(40)]
            done = threading.Event()
            threading.Thread(target=lambda: (hub._thread.send(to_slow, timeout_s=30), done.set()), daemon=True).start()
            return done

        def read_slow() -> list[int]:
            got = []
            while socks["slow"].poll(500):
                got.append(int(decode(socks["slow"].recv_multipart()).reason.split()[0]))
            return got

        # 1. The slow peer reads again within the deadline: its whole line goes out, in order.
        done = flood("first")
        time.sleep(0.5)
        assert not done.is_set()  # the slow peer's line waits for room
        t0 = time.monotonic()
        hub._thread.send([Out(ident["fast"], m.Shutdown(reason="fast"), reply=False)], timeout_s=5)
        assert socks["fast"].poll(2000) and decode(socks["fast"].recv_multipart()).reason == "fast"
        assert time.monotonic() - t0 < 2.0  # not behind the slow peer's line (that would be SEND_TIMEOUT_S, 3 s, at least)
        assert read_slow() == list(range(40))
        assert done.wait(5) and hub.snapshot().get("hub/send_failures", 0) == 0

        # 2. It does not: what still waits at SEND_TIMEOUT_S fails, and the request ends then.
        t0 = time.monotonic()
        done = flood("second")
        assert done.wait(10)
        waited = time.monotonic() - t0
        got, failed = read_slow(), hub.snapshot().get("hub/send_failures", 0)
        assert 2.5 < waited < 9.0, waited  # SEND_TIMEOUT_S (3 s), not the request's own 30 s
        assert got == list(range(len(got))) and failed > 0 and len(got) + failed == 40, (got, failed)
    finally:
        for s in socks.values():
            s.close(linger=0)
        hub.stop(tell_actors=False)
        ctx.term()


def test_a_hub_thread_that_fails_ends_says_why_and_lets_go(monkeypatch):
    """An exception in the hub thread's loop ends the thread with its reason logged (hub.thread_failed), closes its
    sockets (a monitor left open held ctx.term() forever), and the training thread's calls neither hang nor crash:
    send raises TimeoutError at once, kick and stop return."""
    from structlog.testing import capture_logs

    from learner.hub.core.records import Out

    port = free_port()
    hub = Hub(load_config(None, [f"hub.bind=tcp://127.0.0.1:{port}"]), PromptSet(addition_items(), build_tokenizer()))

    def broken(*args, **kw):
        raise RuntimeError("boom")

    monkeypatch.setattr(hub.state, "handle", broken)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        with capture_logs() as logs:
            hub.start()
            sock.send_multipart(encode(m.Register(actor_id="a0", host="h", pid=1, served_version=0)))
            deadline = time.monotonic() + 10
            while hub._thread.alive and time.monotonic() < deadline:
                time.sleep(0.02)
            assert not hub._thread.alive
        assert [e["error"] for e in logs if e["event"] == "hub.thread_failed"] == ["RuntimeError: boom"]
        t0 = time.monotonic()
        try:
            hub._thread.send([Out(b"x", m.Shutdown(reason="r"), reply=False)], timeout_s=30)
            raise AssertionError("send to a dead hub thread returned")
        except TimeoutError:
            pass
        hub._thread.kick()
        hub._thread.stop()
        assert time.monotonic() - t0 < 2.0
        assert not hub._thread._thread.is_alive()
    finally:
        sock.close(linger=0)
        ctx.term()
