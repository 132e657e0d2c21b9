"""A weight-group member without an engine: the actor's protocol and its real receiver, for the death tests.

    python tests/drivers/weight_member.py tcp://HUB ACTOR_ID [--block-at V] [--die-on-sync V] [--silent | --stall-join]
                                          [--device cpu|cuda:N] [--identity ID]

Registers with the hub, heartbeats, and applies every WeightSync with actors/weight_receiver.py
(the code the vLLM worker runs), on a thread of its own so heartbeats go on meanwhile, one sync at
a time, in order, as the actor does. Told `unknown_actor` (it was evicted), it registers again, as the
actor does. Prints one JSON line per event on stdout:
  {"event": "registered"} | {"event": "blocked", "version": V} | {"event": "ignored", "version", "epoch"}
  {"event": "synced", "version", "epoch", "digest", "seconds"}   digest: sha1 of every received tensor's bytes, in order
  {"event": "failed", "version", "epoch", "error", "buckets_loaded", "seconds"}
Fault injection: --block-at V stops inside the load of V's first bucket (so the broadcast is stuck
mid-way until the test kills this process); --die-on-sync V SIGKILLs itself when V's WeightSync arrives;
--silent never joins a group (an actor whose engine never takes the WeightSync); --stall-join sets its
joined keys and then never builds the group (a member whose connect hangs: NCCL's own sockets blocked).
--device: where it receives (a CUDA device makes NCCL groups possible); --identity: the device identity it
registers instead of its device's (a GPU it does not have, so that the learner plans NCCL with it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import zmq

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from actors.weight_receiver import WeightReceiver  # noqa: E402
from protocol import messages as m  # noqa: E402
from protocol import weights as wg  # noqa: E402
from protocol.abortable import joined_key  # noqa: E402
from protocol.codec import decode, encode  # noqa: E402


def say(**event) -> None:
    print(json.dumps(event), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("hub")
    p.add_argument("actor_id")
    p.add_argument("--block-at", type=int, default=-1)
    p.add_argument("--die-on-sync", type=int, default=-1)
    p.add_argument("--heartbeat-s", type=float, default=0.2)
    p.add_argument("--silent", action="store_true")
    p.add_argument("--stall-join", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--identity", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    identity = args.identity if args.identity is not None else wg.device_identity(device)

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(args.hub)
    receiver = WeightReceiver(local=device)
    syncs: queue.Queue[m.WeightSync] = queue.Queue()
    done: queue.Queue[m.WeightVersion] = queue.Queue()
    served = 0

    def loader(sync: m.WeightSync, digest) -> Callable[[list], None]:
        first = [True]

        def load(pairs) -> None:
            if first[0] and sync.policy_version == args.block_at:
                say(event="blocked", version=sync.policy_version)
                time.sleep(3600)
            first[0] = False
            for _, t in pairs:
                digest.update(t.contiguous().view(-1).cpu().numpy().tobytes())  # a CUDA bucket's bytes too

        return load

    def apply_syncs() -> None:
        while True:
            sync = syncs.get()
            digest = hashlib.sha1()
            t0 = time.perf_counter()
            if args.stall_join:  # says it joined, then never builds the group: the learner's connect has to give up
                control = wg.open_store(sync.store_host, sync.store_port, is_master=False, timeout_s=sync.timeout_s)
                control.set(joined_key(sync.group_epoch, sync.rank), "1")
                say(event="stalled", version=sync.policy_version, epoch=sync.group_epoch)
                continue
            result = receiver.receive(sync, sync.rank, loader(sync, digest))
            seconds = round(time.perf_counter() - t0, 3)
            if result.failed:
                say(
                    event="failed",
                    version=sync.policy_version,
                    epoch=sync.group_epoch,
                    error=result.error,
                    buckets_loaded=result.buckets_loaded,
                    seconds=seconds,
                )
                continue
            say(event="synced", version=sync.policy_version, epoch=sync.group_epoch, digest=digest.hexdigest(), seconds=seconds)
            done.put(
                m.WeightVersion(actor_id=args.actor_id, served_version=sync.policy_version, group_epoch=sync.group_epoch, load_s=seconds)
            )

    def register() -> None:
        sock.send_multipart(encode(m.Register(actor_id=args.actor_id, host="test", pid=os.getpid(), served_version=0, devices=[identity])))

    threading.Thread(target=apply_syncs, daemon=True).start()
    register()
    last_beat = time.monotonic()
    while True:
        while not done.empty():
            loaded = done.get()
            served = max(served, loaded.served_version)
            sock.send_multipart(encode(loaded))
        if time.monotonic() - last_beat > args.heartbeat_s:
            last_beat = time.monotonic()
            sock.send_multipart(encode(m.Heartbeat(actor_id=args.actor_id, served_version=served, groups_in_flight=0)))
        if not sock.poll(20):
            continue
        msg = decode(sock.recv_multipart())
        if isinstance(msg, m.RegisterAck):
            say(event="registered")
        elif isinstance(msg, m.WeightSync):
            if msg.policy_version == args.die_on_sync:
                os.kill(os.getpid(), signal.SIGKILL)
            if args.silent:
                say(event="ignored", version=msg.policy_version, epoch=msg.group_epoch)
                continue
            syncs.put(msg)
        elif isinstance(msg, m.Shutdown):
            return
        elif isinstance(msg, m.Error):
            say(event="hub_error", code=msg.code, detail=msg.detail)
            if msg.code == "unknown_actor":
                register()


if __name__ == "__main__":
    main()
