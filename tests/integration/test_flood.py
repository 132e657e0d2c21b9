"""A flood of malformed and valid-but-useless messages leaves the hub's memory bounded and training stepping.

The learner side (hub thread + a training loop calling take_batch / finish_update) runs in this process, so
its RSS is what is measured. An honest scripted actor keeps producing groups through the real hub while a
separate flooder process (tests/drivers/flooder.py, holding an authorised CURVE key) blasts it without
ever reading a reply.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import zmq
from scripted_actor import ScriptedActor

from deploy.tiny import build_tokenizer
from learner.data.prompts import PromptSet, addition_items
from learner.hub.server import Hub
from protocol import auth
from protocol import messages as m
from protocol.codec import decode, encode
from protocol.config import load_config
from protocol.net import free_port

ROOT = Path(__file__).resolve().parents[2]
FLOOD_MESSAGES = 20_000
FLOOD_MAX_S = 40.0
MAX_FRAME = 64 << 10  # oversized frames are 96 KiB: hub.hwm of them per connection is what libzmq may hold


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def setup(tmp_path, *extra):
    keys = tmp_path / "keys"
    auth.generate(keys, ["honest", "flooder"])
    port = free_port()
    addr = f"tcp://127.0.0.1:{port}"
    cfg = load_config(
        None,
        [
            f"hub.bind={addr}",
            "auth.curve=on",
            f"auth.server_secret={keys}/server.key_secret",
            f"auth.authorized={keys}/authorized",
            f"auth.server_key={keys}/server.key",
            f"auth.client_key={keys}/clients/honest.key_secret",
            f"hub.max_frame_bytes={MAX_FRAME}",
            "rollout.samples_per_prompt=2",
            "train.prompts_per_step=4",
            "staleness.max_staleness=1",
            "hub.actor_timeout_s=30",
            *extra,
        ],
    )
    hub = Hub(cfg, PromptSet(addition_items(), build_tokenizer()))
    hub.start()
    return cfg, keys, addr, hub


def counted(snap) -> float:
    """Flood messages the hub has handled: each one is a protocol error, an unknown actor, or a Register
    (each but the first replacing its connection's previous actor), or, once libzmq has closed the
    flooder's connection for its oversized last frame, one it had queued before (dropped, counted)."""
    return (
        snap.get("hub/protocol_errors", 0)
        + snap.get("hub/unknown_actor", 0)
        + snap.get("hub/reregistered", 0)
        + snap.get("hub/from_closed_connections", 0)
        + 1
    )


def train(hub, actor, version, seconds, on_step=lambda: None, until=lambda: False):
    """The learner's loop without the model: take a batch, finish the update, 'sync' the actor."""
    steps, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline and not until():
        batch = hub.take_batch(4, timeout_s=30)
        version += 1
        hub.finish_update(version, [item.key for item in batch])
        actor.target_version = version
        steps += 1
        on_step()
    return version, steps


def test_flood_leaves_memory_bounded_and_the_learner_stepping(tmp_path):
    cfg, keys, addr, hub = setup(tmp_path)
    actor = ScriptedActor(addr, "honest", 2, 0.002, seed=0, heartbeat_s=0.5, keys=auth.client_keys(cfg, addr)).start()
    flooder = None
    try:
        version, _ = train(hub, actor, 0, 2.0)  # warm up: every buffer and code path in use once
        version, base_steps = train(hub, actor, version, 3.0)
        base_rate = base_steps / 3.0
        rss0 = rss_mb()
        peak = [rss0]
        out = tmp_path / "flood.json"
        flooder = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "tests" / "drivers" / "flooder.py"),
                addr,
                str(keys / "server.key"),
                str(keys / "clients" / "flooder.key_secret"),
                str(FLOOD_MESSAGES),
                str(FLOOD_MAX_S),
                str(MAX_FRAME),
                str(out),
            ],
            stdin=subprocess.PIPE,
        )
        while not counted(hub.snapshot()) and flooder.poll() is None:
            version, _ = train(hub, actor, version, 0.05)  # until the flood reaches the hub
        t0 = time.monotonic()
        # Train through the flood: until every message the flooder sent has been handled by the hub.
        version, flood_steps = train(
            hub,
            actor,
            version,
            FLOOD_MAX_S + 20,
            on_step=lambda: peak.append(rss_mb()),
            until=lambda: out.exists() and counted(hub.snapshot()) >= FLOOD_MESSAGES - 1,
        )
        flood_s = time.monotonic() - t0
        flood_rate = flood_steps / flood_s
        assert flooder.stdin is not None
        flooder.stdin.close()
        assert flooder.wait(timeout=30) == 0
        flood = json.loads(out.read_text())
        version, after_steps = train(hub, actor, version, 1.0)
        snap = hub.snapshot()
    finally:
        actor.stop.set()
        if flooder is not None and flooder.poll() is None:
            flooder.kill()
        hub.stop()
    growth = max(peak) - rss0
    handled = counted(snap)
    print(
        f"flood: {flood['total']} messages queued in {flood['seconds']:.1f} s, the hub handled {handled:.0f} in {flood_s:.1f} s "
        f"(protocol errors {snap['hub/protocol_errors']:.0f}, unknown actor {snap['hub/unknown_actor']:.0f}, "
        f"replies dropped {snap.get('hub/replies_dropped', 0):.0f}); steps/s {base_rate:.1f} before, {flood_rate:.1f} during; "
        f"RSS {rss0:.0f} MB + {growth:.1f} MB"
    )
    # Every message but the last (over the hard cap: libzmq stops reading that connection) reached the hub's
    # decoder and handlers and was counted exactly once.
    assert flood["total"] == FLOOD_MESSAGES and handled == FLOOD_MESSAGES - 1
    assert growth < 50, f"RSS grew {growth:.1f} MB under the flood"
    # The honest actor kept training going: at least a fifth of its rate without the flood (room for a loaded machine), and after it.
    assert flood_rate >= base_rate / 5, (base_rate, flood_rate)
    assert after_steps >= 1
    # Replies to a client that never reads are dropped at its HWM, not buffered and not waited on.
    assert snap["hub/replies_dropped"] > 0
    # Every Register from the flooder's connection replaced the last one: one actor per connection.
    assert snap["hub/actors"] <= 2 + flood["sent"]["over_hard_cap"]  # a reconnect is a new connection
    assert snap["hub/reregistered"] >= flood["sent"]["register_new_id"] // 2
    hub.ledger.check()
    assert snap["ledger/trained"] == 4 * version  # every trained group was the honest actor's, counted once


def test_error_replies_are_short_whatever_the_input(tmp_path):
    cfg, keys, addr, hub = setup(tmp_path)
    ctx = zmq.Context()
    from protocol import transport

    sock = transport.client_socket(ctx, addr, 64, 1 << 20, auth.client_keys(cfg, addr))
    try:
        import msgpack

        sock.send_multipart([msgpack.packb({"v": m.PROTOCOL_VERSION, "t": "X" * 50_000, "f": {}, "a": []})])
        assert sock.poll(5000)
        reply = decode(sock.recv_multipart())
        assert isinstance(reply, m.Error) and reply.code == "protocol" and len(reply.detail) <= 300
        sock.send_multipart(encode(m.Heartbeat(actor_id="g" * 50_000, served_version=0, groups_in_flight=0)))
        assert sock.poll(5000)
        reply = decode(sock.recv_multipart())
        assert reply.code == "unknown_actor" and len(reply.detail) <= 300
    finally:
        ctx.destroy(linger=0)
        hub.stop()
