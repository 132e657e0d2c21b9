"""While the learner waits for rollouts, an actor that lags behind its version is sent the current weights again.

The real hub and WeightSender; the actor is a raw DEALER socket speaking the protocol (it never joins the
gloo group, so the broadcast itself fails after weights.timeout_s, which is not what this test is about).
"""

import time

import torch
import zmq

from deploy.tiny import build_tokenizer
from learner.data import PromptSet, addition_items
from learner.hub import Hub
from learner.resync import Resync
from learner.weight_sync import WeightSender
from protocol import messages as m
from protocol import transport
from protocol.config import load_config
from protocol.net import free_port


def _next(sock, kind, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sock.poll(100):
            msg = transport.decode_frames(sock.recv_multipart(), 1 << 20)
            if isinstance(msg, kind):
                return msg
    return None


def test_a_lagging_actor_gets_the_current_version_again_after_the_patience():
    port = free_port()
    cfg = load_config(None, [f"hub.bind=tcp://127.0.0.1:{port}", "weights.timeout_s=1", "weights.bucket_mb=1"])
    hub = Hub(cfg, PromptSet(addition_items(), build_tokenizer()))
    hub.start()
    sender = WeightSender(cfg.weights, ["w"], [[4, 4]], "float32")
    resync = Resync(sender=sender, hub=hub, patience_s=0.5)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        hub.finish_update(5, [])  # the learner reached version 5 (no actor yet)
        sender.sync(5, hub, lambda out: [torch.ones(16)])  # the regular sync: a snapshot, no members
        resync.synced(5)
        sock.send_multipart(transport.encode(m.Register(actor_id="back", host="h", pid=1, served_version=3)))
        assert isinstance(_next(sock, m.RegisterAck), m.RegisterAck)
        assert hub.lagging_actors(5) == ["back"]

        resync()  # within the patience: the last broadcast may still be on its way
        assert resync.count == 0 and _next(sock, m.WeightSync, timeout_s=0.3) is None
        time.sleep(0.5)
        resync()  # lagging past the patience: version 5 again, in a new group epoch that includes it
        sync = _next(sock, m.WeightSync)
        assert resync.count == 1 and sync is not None
        assert (sync.policy_version, sync.group_epoch, sync.rank, sync.world_size) == (5, 1, 1, 2)

        sock.send_multipart(transport.encode(m.Heartbeat(actor_id="back", served_version=5, groups_in_flight=0)))
        deadline = time.monotonic() + 5
        while hub.lagging_actors(5) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)
        resync()  # caught up: nothing to send
        assert resync.count == 1 and hub.lagging_actors(5) == []
    finally:
        sender.wait()
        hub.stop()
        sock.close(linger=0)
        ctx.term()
