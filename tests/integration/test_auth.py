"""CURVE authentication over the real hub thread and sockets, the key files, and the weight store's bind address.

A client without an authorised key gets nothing (no ack, no grant, no error) and changes nothing (counters,
registry, ledger); an authorised one registers and trains; a key added to the allow-list is admitted while
the hub runs, a removed one is cut off.
"""

import asyncio
import json
import os
import socket
import stat
import time
from contextlib import aclosing
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from conftest import rollout_group
from scripted_actor import ScriptedActor

from deploy.cli import main as cli
from deploy.tiny import build_tokenizer
from learner.data.prompts import PromptSet, addition_items
from learner.hub.server import Hub
from protocol import auth, transport
from protocol import messages as m
from protocol import weights as wg
from protocol.auth import ClientKeys
from protocol.codec import decode, encode
from protocol.config import ConfigError, load_config
from protocol.net import free_port

ROOT = Path(__file__).resolve().parents[2]


def curve_config(keys, port, *extra):
    return load_config(
        None,
        [
            f"hub.bind=tcp://127.0.0.1:{port}",
            "auth.curve=on",
            f"auth.server_secret={keys}/server.key_secret",
            f"auth.authorized={keys}/authorized",
            f"auth.server_key={keys}/server.key",
            f"auth.client_key={keys}/clients/actor-a.key_secret",
            "rollout.samples_per_prompt=2",
            "train.prompts_per_step=2",
            *extra,
        ],
    )


def start_hub(cfg):
    hub = Hub(cfg, PromptSet(addition_items(), build_tokenizer()))
    hub.start()
    return hub


def dealer(ctx, addr, keys):
    return transport.client_socket(ctx, addr, 64, 1 << 20, keys)  # a sync socket on a sync context


def send_if_possible(sock, frames):
    """A refused client's socket soon has no connection to queue on (libzmq gives up on a refused key)."""
    try:
        sock.send_multipart(frames, flags=zmq.NOBLOCK)
    except zmq.Again:
        pass


def replies(sock, wait_s):
    out, deadline = [], time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000) + 1):
            out.append(decode(sock.recv_multipart()))
    return out


def without_auth(snapshot):
    """The hub's state with the gate's own counters left out (and counters that exist but are 0)."""
    return {k: v for k, v in snapshot.items() if not k.startswith("hub/auth_") and (v or not k.startswith("hub/"))}


def test_keys_command_writes_private_files_and_never_overwrites(tmp_path, capsys):
    out = tmp_path / "keys"
    assert cli(["keys", "--out", str(out), "--client", "node1", "--client", "ops"]) == 0
    for secret in (out / "server.key_secret", out / "clients" / "node1.key_secret", out / "clients" / "ops.key_secret"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600, secret
    assert stat.S_IMODE((out / "clients").stat().st_mode) == 0o700
    public, secret = zmq.auth.load_certificate(out / "clients" / "node1.key_secret")
    assert len(public) == 40 and len(secret) == 40 and zmq.curve_public(secret) == public
    assert zmq.auth.load_certificate(out / "authorized" / "node1.key") == (public, None)
    assert zmq.auth.load_certificate(out / "server.key")[0] == zmq.auth.load_certificate(out / "server.key_secret")[0]
    server = (out / "server.key_secret").read_bytes()
    assert cli(["keys", "--out", str(out), "--client", "node1"]) == 2  # a name that exists: refused
    assert "exist already" in capsys.readouterr().err
    assert cli(["keys", "--out", str(out)]) == 2  # nothing to add
    assert cli(["keys", "--out", str(out), "--client", "node2"]) == 0
    assert (out / "server.key_secret").read_bytes() == server  # the server key survives: clients hold its public half
    assert sorted(p.name for p in (out / "authorized").iterdir()) == ["node1.key", "node2.key", "ops.key"]
    assert cli(["keys", "--out", str(out), "--client", "../evil"]) == 2


def test_config_refuses_an_open_hub_without_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"^auth: CURVE is on .*hub.bind tcp://0.0.0.0:5555.*fleetrl keys --out"):
        load_config(None, ["hub.bind=tcp://0.0.0.0:5555"])
    with pytest.raises(ConfigError, match=r"^auth.curve: off is refused for hub.bind tcp://\*:5555"):
        load_config(None, ["hub.bind=tcp://*:5555", "auth.curve=off"])
    with pytest.raises(ConfigError, match=r"^auth.curve: 'maybe' must be auto, on or off"):
        load_config(None, ["auth.curve=maybe"])
    cfg = load_config(None, ["hub.bind=tcp://[::1]:5555"])  # loopback: optional, off by default
    assert auth.server_keys(cfg) is None and auth.client_keys(cfg, "tcp://localhost:5555") is None
    with pytest.raises(ConfigError, match=r"^auth.server_key: required when CURVE is on"):
        auth.client_keys(cfg, "tcp://10.1.2.3:5555")  # dialling a remote hub turns CURVE on for the client

    keys = tmp_path / "keys"
    auth.generate(keys, ["actor-a"])
    cfg = curve_config(keys, 5555)
    assert auth.server_keys(cfg) is not None and auth.client_keys(cfg, "tcp://127.0.0.1:5555") is not None
    bad = [
        ("auth.server_secret=/nope", r"^auth.server_secret: /nope: "),
        (f"auth.server_secret={keys}/server.key", r"^auth.server_secret: .*holds no secret key"),
        (f"auth.authorized={keys}/server.key", r"^auth.authorized: .* is not a folder"),
    ]
    for override, needle in bad:
        with pytest.raises(ConfigError, match=needle):
            auth.server_keys(curve_config(keys, 5555, override))
    (keys / "clients" / "actor-a.key_secret").chmod(0o644)
    with pytest.raises(ConfigError, match=r"^auth.client_key: .* readable by other users \(mode 0644\); chmod 600"):
        auth.client_keys(cfg, "tcp://127.0.0.1:5555")


def test_unauthorised_clients_get_nothing_and_change_nothing(tmp_path):
    keys = tmp_path / "keys"
    auth.generate(keys, ["actor-a"])
    port = free_port()
    addr = f"tcp://127.0.0.1:{port}"
    cfg = curve_config(keys, port, "hub.actor_timeout_s=2", "staleness.lease_s=60")
    good = auth.client_keys(cfg, addr)
    assert good is not None
    hub = start_hub(cfg)
    ctx = zmq.Context()
    stranger_pub, stranger_sec = zmq.curve_keypair()
    fake_server_pub, _ = zmq.curve_keypair()
    bad_keys = {
        "unlisted key": ClientKeys(server_public=good.server_public, public=stranger_pub, secret=stranger_sec),
        "no CURVE": None,
        "listed public key, wrong secret": ClientKeys(server_public=good.server_public, public=good.public, secret=stranger_sec),
        "wrong server key": ClientKeys(server_public=fake_server_pub, public=good.public, secret=good.secret),
    }
    actor = None
    try:
        before = hub.snapshot()
        socks = {why: dealer(ctx, addr, k) for why, k in bad_keys.items()}
        for i, sock in enumerate(socks.values()):
            for msg in (
                m.Register(actor_id=f"bad{i}", host="h", pid=1, served_version=0),
                m.WorkRequest(actor_id=f"bad{i}", max_prompts=8),
                m.Heartbeat(actor_id=f"bad{i}", served_version=0, groups_in_flight=0),
                rollout_group(n=2, actor=f"bad{i}", prompt_id=0),
            ):
                send_if_possible(sock, encode(msg))
            send_if_possible(sock, [b"\xc1not a message"])
        time.sleep(1.5)  # several reconnect-and-handshake rounds (RECONNECT_IVL 200 ms)
        for why, sock in socks.items():
            assert not sock.poll(0), f"{why}: the hub answered"
        after = hub.snapshot()
        assert without_auth(after) == without_auth(before)  # no counter, no registry entry, no ledger change
        assert after["hub/actors"] == 0 and after.get("ledger/granted", 0) == 0 and "hub/protocol_errors" not in after
        # Only the unlisted key reaches ZAP; the others fail inside the CURVE handshake itself.
        assert after["hub/auth_refused"] >= 1 and "hub/auth_admitted" not in after

        # The authorised actor registers, gets grants and its groups are trained.
        actor = ScriptedActor(addr, "good", 2, 0.01, seed=0, heartbeat_s=0.2, keys=good).start()
        batch = hub.take_batch(2, timeout_s=20)
        hub.finish_update(1, [item.key for item in batch])
        assert {item.group.actor_id for item in batch} == {"good"}
        snap = hub.snapshot()
        assert snap["hub/actors"] == 1 and snap["ledger/trained"] == 2 and snap["hub/auth_admitted"] >= 1

        # A key added while the hub runs is admitted (the folder is re-read once a second) ...
        auth.generate(keys, ["late"])
        late_keys = auth.client_keys(curve_config(keys, port, f"auth.client_key={keys}/clients/late.key_secret"), addr)
        for _attempt in range(5):  # a handshake before the re-read is refused for good: the client starts over
            late = dealer(ctx, addr, late_keys)
            send_if_possible(late, encode(m.Register(actor_id="late", host="h", pid=2, served_version=0)))
            acked = any(isinstance(r, m.RegisterAck) for r in replies(late, 1.0))
            late.close(linger=0)
            if acked:
                break
        assert acked
        # ... and a removed one is cut off, open connection included: its messages are dropped, it goes silent,
        # it is declared dead and what it held goes back to the queue.
        (keys / "authorized" / "actor-a.key").unlink()
        deadline = time.monotonic() + 10
        while "good" in hub.live_actors() and time.monotonic() < deadline:
            time.sleep(0.1)
        snap = hub.snapshot()
        assert "good" not in hub.live_actors() and snap["hub/auth_revoked"] >= 1 and snap["hub/actors_lost"] >= 1
        assert snap.get("ledger/granted", 0) == 0  # nothing left leased to it
        hub.ledger.check()
    finally:
        if actor is not None:
            actor.stop.set()
        ctx.destroy(linger=0)  # every socket of the test, whichever assertion stopped it
        hub.stop()


def test_hub_socket_without_a_zap_handler_admits_no_one(tmp_path):
    """ZAP_ENFORCE_DOMAIN: had the gatekeeper failed to start, the socket would refuse everyone, not admit everyone."""
    keys = tmp_path / "keys"
    auth.generate(keys, ["actor-a"])
    port = free_port()
    cfg = curve_config(keys, port)
    ctx = zmq.Context()
    server = transport.hub_socket(ctx, cfg.hub.bind, 64, 1 << 20, auth.server_keys(cfg))
    client = dealer(ctx, cfg.hub.bind, auth.client_keys(cfg, cfg.hub.bind))
    try:
        client.send_multipart(encode(m.Register(actor_id="a", host="h", pid=1, served_version=0)))
        assert not server.poll(1500)
    finally:
        client.close(linger=0)
        server.close(linger=0)
        ctx.term()


def _listening(pid_fds: set[str]) -> set[tuple[str, int]]:
    """(local address hex, port) of the LISTEN sockets among this process's socket inodes."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in list(f)[1:]:
                cols = row.split()
                local, state, inode = cols[1], cols[3], cols[9]
                if state == "0A" and inode in pid_fds:
                    addr, port = local.split(":")
                    out.add((addr, int(port, 16)))
    return out


def _socket_inodes() -> set[str]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False


def test_weight_store_listens_only_on_the_given_address():
    """The whole of 127/8 reaches this machine, so 127.0.0.2 stands in for 'another interface'."""
    before = _socket_inodes()
    store = wg.open_store("127.0.0.1", 0, is_master=True, timeout_s=5)
    assert _listening(_socket_inodes() - before) == {("0100007F", store.port)}  # 127.0.0.1 only
    assert _reachable("127.0.0.1", store.port) and not _reachable("127.0.0.2", store.port)
    client = wg.open_store("127.0.0.1", store.port, is_master=False, timeout_s=5)
    client.set("k", "v")
    assert store.get("k") == b"v"
    # Negative control: torch's own server (no listening socket handed over) takes every interface.
    import torch.distributed as dist

    from protocol.net import free_port as pick

    raw = dist.TCPStore("127.0.0.1", pick(), is_master=True, wait_for_workers=False)
    assert _reachable("127.0.0.2", raw.port), "torch's TCPStore binds only its host now: open_store's workaround can go"
    del raw, client, store


def test_a_refused_client_learns_it_is_refused(tmp_path):
    """libzmq never retries a refused key, so the actor watches its socket's events for it (transport.socket_events,
    as actors/main.py does) and exits non-zero."""
    keys = tmp_path / "keys"
    auth.generate(keys, ["actor-a"])
    port = free_port()
    cfg = curve_config(keys, port)
    good = auth.client_keys(cfg, cfg.hub.bind)
    assert good is not None
    stranger_pub, stranger_sec = zmq.curve_keypair()
    hub = start_hub(cfg)

    async def verdict(keys):
        ctx = zmq.asyncio.Context()
        sock = transport.client_socket(ctx, cfg.hub.bind, 64, 1 << 20, keys, events=zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        try:
            async with aclosing(transport.socket_events(sock, zmq.EVENT_HANDSHAKE_FAILED_AUTH)) as events:
                return int((await asyncio.wait_for(anext(events), timeout=2.0))["value"])  # the ZAP status
        except TimeoutError:
            return None
        finally:
            ctx.destroy(linger=0)

    try:
        assert asyncio.run(verdict(ClientKeys(server_public=good.server_public, public=stranger_pub, secret=stranger_sec))) == 400
        assert asyncio.run(verdict(good)) is None  # admitted: nothing to report
    finally:
        hub.stop()


def test_weight_group_rendezvous_listens_only_on_the_given_address():
    """Learner side of a real 2-member group (store + gloo): every socket it opens to listen is on 127.0.0.1."""
    import subprocess
    import sys

    import torch

    before = _socket_inodes()
    store = wg.open_store("127.0.0.1", 0, is_master=True, timeout_s=120)
    member = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, torch; sys.path.insert(0, sys.argv[1]); from protocol import weights as wg; "
                "s = wg.open_store('127.0.0.1', int(sys.argv[2]), False, 120); g = wg.open_group(s, '127.0.0.1', 1, 1, 2, 120); "
                "t = torch.zeros(4); wg.broadcast(g, t); assert t.tolist() == [1.0] * 4; "
                # Left to interpreter exit, gloo's teardown sometimes aborts ("terminate called without an active exception").
                "del g, s; import gc; gc.collect()"
            ),
            str(ROOT),
            str(store.port),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        group = wg.open_group(store, "127.0.0.1", 1, 0, 2, 120)
        wg.broadcast(group, torch.ones(4))
        listening = _listening(_socket_inodes() - before)
    finally:
        _, err = member.communicate(timeout=120)
    assert member.returncode == 0, err[-2000:]
    # The store's socket and gloo's, both on 127.0.0.1 (0100007F) and nowhere else.
    assert len(listening) >= 2 and {addr for addr, _ in listening} == {"0100007F"}, listening


def test_an_actor_id_belongs_to_the_key_that_registered_it(tmp_path):
    """Two authorised keys: the second cannot take over (and so unregister) the first's actor id; the first key,
    from a new connection (a restarted actor), can. The refused actor hears `id_taken`, which is final."""
    keys = tmp_path / "keys"
    auth.generate(keys, ["node-a", "node-b"])
    port = free_port()
    addr = f"tcp://127.0.0.1:{port}"
    key_a = auth.client_keys(curve_config(keys, port, f"auth.client_key={keys}/clients/node-a.key_secret"), addr)
    key_b = auth.client_keys(curve_config(keys, port, f"auth.client_key={keys}/clients/node-b.key_secret"), addr)
    # These clients never heartbeat and the test waits 2 s per registration: under hub.silent_s' 4 s default,
    # actor0 went silent (not live) before the checks on a loaded machine.
    hub = start_hub(curve_config(keys, port, "hub.silent_s=25"))
    ctx = zmq.Context()

    def register(sock, actor_id):
        sock.send_multipart(encode(m.Register(actor_id=actor_id, host="h", pid=1, served_version=0)))
        got = replies(sock, 2.0)
        assert len(got) == 1, got
        return got[0]

    try:
        a, b = dealer(ctx, addr, key_a), dealer(ctx, addr, key_b)
        assert isinstance(register(a, "actor0"), m.RegisterAck)
        refused = register(b, "actor0")
        assert isinstance(refused, m.Error) and refused.code == "id_taken" and "another key" in refused.detail
        assert hub.live_actors() == ["actor0"] and hub.actors["actor0"].key == "node-a"
        assert hub.snapshot()["hub/register_wrong_key"] == 1
        assert isinstance(register(b, "actor1"), m.RegisterAck)  # its own id is fine
        restarted = dealer(ctx, addr, key_a)  # node-a's actor restarted: a new connection, the same key
        assert isinstance(register(restarted, "actor0"), m.RegisterAck)
        assert hub.actors["actor0"].key == "node-a" and sorted(hub.live_actors()) == ["actor0", "actor1"]
    finally:
        ctx.destroy(linger=0)
        hub.stop()


def test_ctl_and_status_speak_curve_with_the_operator_key(tmp_path, capsys):
    """`fleetrl ctl` / `status` against a hub with CURVE on: with an authorised key they work; with an unlisted one
    they say the key was refused (exit 1); without keys for a hub off loopback they refuse to start (exit 2)."""
    keys = tmp_path / "keys"
    auth.generate(keys, ["actor-a", "operator"])
    stranger = tmp_path / "stranger"
    auth.generate(stranger, ["operator"])  # a pair of its own, unknown to the hub
    port = free_port()
    addr = f"tcp://127.0.0.1:{port}"
    hub = start_hub(curve_config(keys, port))
    ops = ["--server-key", str(keys / "server.key"), "--client-key", str(keys / "clients" / "operator.key_secret")]
    try:
        assert cli(["ctl", "--learner", addr, *ops, "set", "max_staleness", "2"]) == 0
        assert hub.max_staleness == 2
        assert cli(["status", "--learner", addr, *ops, "--once"]) == 0
        assert addr in capsys.readouterr().out
        bad = ["--server-key", str(keys / "server.key"), "--client-key", str(stranger / "clients" / "operator.key_secret")]
        assert cli(["ctl", "--learner", addr, *bad, "--timeout", "3", "set", "max_staleness", "1"]) == 1
        assert "refused this client's key" in capsys.readouterr().err and hub.max_staleness == 2
        assert cli(["ctl", "--learner", "tcp://10.1.2.3:5555", "set", "max_staleness", "1"]) == 2
        assert "--server-key and --client-key: required" in capsys.readouterr().err
        assert cli(["ctl", "--learner", addr, "--server-key", str(keys / "server.key"), "set", "max_staleness", "1"]) == 2
        assert "--client-key" in capsys.readouterr().err
    finally:
        hub.stop()


def _first_handshake_failure(addr: str, keys: ClientKeys) -> tuple[int, int]:
    """(event, value) of the first failed handshake a client socket with `keys` reports."""
    failures = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL

    async def watch():
        ctx = zmq.asyncio.Context()
        sock = transport.client_socket(ctx, addr, 64, 1 << 20, keys, events=failures)
        try:
            async with aclosing(transport.socket_events(sock, failures)) as events:
                event = await asyncio.wait_for(anext(events), timeout=5.0)
                return int(event["event"]), int(event["value"])
        finally:
            ctx.destroy(linger=0)

    return asyncio.run(watch())


def test_a_failed_handshake_names_the_key_at_fault(tmp_path):
    """From what real sockets report: a client key the hub does not list is refused (ZAP status 400) and named; with
    another server key the hub hangs up without a word, and the message names the server key, not the client key.
    A key pair file whose halves do not match is refused when it is read: the hub would hang up on it the same way."""
    keys, stranger = tmp_path / "keys", tmp_path / "stranger"
    auth.generate(keys, ["actor-a"])
    auth.generate(stranger, ["actor-a"])  # another learner's key folder
    port = free_port()
    addr = f"tcp://127.0.0.1:{port}"
    unlisted = auth.client_keys(curve_config(keys, port, f"auth.client_key={stranger}/clients/actor-a.key_secret"), addr)
    wrong_server = auth.client_keys(curve_config(keys, port, f"auth.server_key={stranger}/server.key"), addr)
    assert unlisted is not None and wrong_server is not None
    hub = start_hub(curve_config(keys, port))
    try:
        refused = _first_handshake_failure(addr, unlisted)
        dropped = _first_handshake_failure(addr, wrong_server)
    finally:
        hub.stop()
    assert refused == (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400)
    assert dropped[0] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    refused_why, dropped_why = auth.handshake_failure(*refused), auth.handshake_failure(*dropped)
    assert refused_why is not None and dropped_why is not None
    assert refused_why.startswith("the learner refused this client's key") and "auth.client_key" in refused_why
    assert "server_key" not in refused_why
    assert "auth.server_key is not the public key of the learner at this address" in dropped_why
    assert "Not auth.client_key" in dropped_why  # said plainly: the client key is not the cause
    assert "--server-key is not" in auth.handshake_failure(*dropped, server_key="--server-key", client_key="--client-key")
    assert auth.handshake_failure(zmq.EVENT_DISCONNECTED, 12) is None

    secret_file = keys / "clients" / "actor-a.key_secret"
    other_public = zmq.auth.load_certificate(stranger / "server.key")[0].decode()
    own_public = zmq.auth.load_certificate(secret_file)[0].decode()
    damaged = tmp_path / "damaged.key_secret"
    damaged.write_text(secret_file.read_text().replace(own_public, other_public))
    damaged.chmod(0o600)
    with pytest.raises(ConfigError, match=r"^auth.client_key: .*damaged.key_secret: its public key is not the one of its secret key"):
        auth.client_keys(curve_config(keys, port, f"auth.client_key={damaged}"), addr)


def test_an_actor_says_which_key_its_handshake_failed_on(tmp_path):
    """The actor's own lines (actors/session.py, actors/main.py). With another server key libzmq retries forever, so the actor keeps
    going and keeps saying why: once in actor.handshake_failed, again in each actor.waiting_for_learner. With an
    unlisted client key (final) it stops, exit code 1, with actor.key_refused naming the client key."""
    from actors.main import Actor

    keys, stranger = tmp_path / "keys", tmp_path / "stranger"
    auth.generate(keys, ["actor-a"])
    auth.generate(stranger, ["actor-a"])
    port = free_port()
    addr = f"tcp://127.0.0.1:{port}"
    hub = start_hub(curve_config(keys, port))

    async def run(actor, seconds):
        ctx = zmq.asyncio.Context()
        actor.session.connect(ctx, devices=[""])
        tasks = [asyncio.ensure_future(actor._watch_connection()), asyncio.ensure_future(actor.session.heartbeat())]
        try:
            await asyncio.wait_for(actor.stop.wait(), timeout=seconds)
        except TimeoutError:
            pass
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        ctx.destroy(linger=0)

    def events(actor_id, name):
        lines = (tmp_path / "run" / "logs" / f"actor-{actor_id}.jsonl").read_text().splitlines()
        return [e for e in map(json.loads, lines) if e["event"] == name]

    try:
        wrong_server = Actor(
            curve_config(keys, port, f"auth.server_key={stranger}/server.key", f"run.dir={tmp_path / 'run'}"), addr, "wrong-server"
        )
        asyncio.run(run(wrong_server, 3.5))  # registration retries after 1 s and 2 s more
        unlisted = Actor(
            curve_config(keys, port, f"auth.client_key={stranger}/clients/actor-a.key_secret", f"run.dir={tmp_path / 'run'}"),
            addr,
            "unlisted",
        )
        asyncio.run(run(unlisted, 5.0))
        no_keys = Actor(load_config(None, ["rollout.samples_per_prompt=2", f"run.dir={tmp_path / 'run'}"]), addr, "no-keys")
        assert no_keys.session.keys is None  # CURVE off on loopback
        asyncio.run(run(no_keys, 1.5))
    finally:
        hub.stop()
    # Without keys the learner's hang-up is no wrong key (there is none): CURVE is off here and on there.
    [plain] = events("no-keys", "actor.handshake_failed")
    assert plain["cause"].startswith("the learner uses CURVE and this client does not: set auth.server_key and auth.client_key")
    assert not wrong_server.stop.is_set() and wrong_server.exit_code == 0
    [failed] = events("wrong-server", "actor.handshake_failed")
    assert failed["cause"].startswith("the learner hung up during the CURVE handshake: auth.server_key is not")
    waiting = events("wrong-server", "actor.waiting_for_learner")
    assert len(waiting) >= 2 and all(e["cause"] == failed["cause"] for e in waiting), waiting
    assert unlisted.stop.is_set() and unlisted.exit_code == 1
    [refused] = events("unlisted", "actor.key_refused")
    assert refused["status"] == 400 and "auth.client_key" in refused["cause"] and "server_key" not in refused["cause"]
    assert not events("unlisted", "actor.handshake_failed")


def test_ctl_and_status_name_the_key_flag_to_fix_when_the_handshake_fails(tmp_path, capsys):
    """A learner that will not talk to the operator's keys used to look like no learner at all ("no reply ... is
    the learner running?", after all of --timeout). From the socket's monitor, `fleetrl ctl` and `status` say at
    once, in one line, which flag to fix: --server-key for another learner's key (or a learner without CURVE),
    --client-key for a key the learner does not list, both for a learner with CURVE given none. Exit 1 (refused)."""
    keys, stranger = tmp_path / "keys", tmp_path / "stranger"
    auth.generate(keys, ["actor-a", "operator"])
    auth.generate(stranger, ["operator"])  # another learner's key folder
    port, plain_port = free_port(), free_port()
    addr, plain_addr = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{plain_port}"

    def flags(server: Path, client: Path) -> list[str]:
        return ["--server-key", str(server / "server.key"), "--client-key", str(client / "clients" / "operator.key_secret")]

    wrong_server = "--server-key is not the public key of the learner at this address"
    cases = [
        ("ctl", addr, flags(stranger, keys), wrong_server),
        ("status", addr, flags(stranger, keys), wrong_server),
        ("ctl", plain_addr, flags(keys, keys), "runs without CURVE"),  # either of two events (auth.handshake_failure)
        ("ctl", addr, flags(keys, stranger), "the public key of --client-key is not in the learner's auth.authorized folder"),
        ("status", addr, [], "the learner uses CURVE and this client does not: set --server-key and --client-key"),
    ]
    hub = start_hub(curve_config(keys, port))
    plain = start_hub(load_config(None, [f"hub.bind={plain_addr}"]))
    before = hub.max_staleness, plain.max_staleness
    try:
        for command, learner, key_flags, needle in cases:
            argv = [command, "--learner", learner, *key_flags, "--timeout", "30"]
            argv += ["set", "max_staleness", str(before[0] + 1)] if command == "ctl" else ["--once"]
            t0 = time.monotonic()
            assert cli(argv) == 1, argv
            took = time.monotonic() - t0
            # One line of its own (the hubs' log lines share stderr once a test before this one has set up logging).
            [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fleetrl ")]
            assert line.startswith(f"fleetrl {command}: {learner}: ") and needle in line, (argv, line)
            assert took < 10, (argv, took)  # at the first handshake, not at --timeout (30 s)
        assert (hub.max_staleness, plain.max_staleness) == before
    finally:
        hub.stop()
        plain.stop()
    # CURVE on one side only: the mismatch blames the side that the client's own keys say.
    mismatch = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
    with_keys = auth.handshake_failure(*mismatch, "--server-key", "--client-key", curve="", client_curve=True)
    assert with_keys is not None and with_keys.endswith(
        "runs without CURVE and this client uses it: leave out --server-key and --client-key"
    )
    assert auth.handshake_failure(*mismatch, client_curve=False) == (
        "the learner uses CURVE and this client does not: set auth.server_key and auth.client_key (auth.curve = on)"
    )
    assert "or the other way round" in str(auth.handshake_failure(*mismatch))
