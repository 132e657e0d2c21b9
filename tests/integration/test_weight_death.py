"""A weight-group member dies mid-broadcast, hangs, or dies as a sync starts: the sender gives that attempt up
far sooner than weights.timeout_s, the survivors stop waiting too, and they get the version in a new epoch.

Real pieces: the hub (its thread and socket), WeightSender over parameters laid out as DeepSpeed ZeRO-1/2
keeps them and guarded by a real optimizer (the learner's path), gloo. Each member is a process running the
actor's protocol and its real receiver (tests/drivers/weight_member.py), without an engine.
"""

import hashlib
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from deploy.tiny import build_tokenizer
from learner.data.prompts import PromptSet, addition_items
from learner.hub.server import Hub
from learner.weights.sync import WeightSender
from protocol.config import load_config
from protocol.net import free_port

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "drivers" / "weight_member.py"
TIMEOUT_S = 60.0  # weights.timeout_s: what a dead member used to cost; every bound below is far under it
ACTOR_TIMEOUT_S = 2.0  # hub.actor_timeout_s: how long a silent (stopped) member takes to be declared dead
BOUND_S = 6.0  # a death seen at once (its connection closed): kill -> survivors hold the version again


class Member:
    def __init__(self, addr: str, actor_id: str, *flags: str):
        self.actor_id = actor_id
        self.proc = subprocess.Popen([sys.executable, str(DRIVER), addr, actor_id, *flags], stdout=subprocess.PIPE, text=True, cwd=ROOT)
        self.events: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.put(json.loads(line))

    def expect(self, event: str, timeout: float = 30.0, **match) -> dict:
        """The next event of this kind (others of that kind that do not match are skipped)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                e = self.events.get(timeout=left)
            except queue.Empty:
                break
            if e["event"] == event and all(e.get(k) == v for k, v in match.items()):
                return e
        raise AssertionError(f"{self.actor_id}: no {event} {match} within {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=10)


def digest(params: list[torch.Tensor]) -> str:
    h = hashlib.sha1()
    for p in params:
        h.update(p.detach().reshape(-1).numpy().tobytes())
    return h.hexdigest()


@pytest.fixture
def learner(request):
    addr = f"tcp://127.0.0.1:{free_port()}"
    # weights.gloo_mesh_ranks: "lazy" (0) makes every gloo epoch connect lazily, as a large fleet's does
    mesh = {"mesh": [], "lazy": ["weights.gloo_mesh_ranks=0"]}[getattr(request, "param", "mesh")]
    cfg = load_config(
        None,
        [
            f"hub.bind={addr}",
            "hub.heartbeat_s=0.2",
            f"hub.actor_timeout_s={ACTOR_TIMEOUT_S}",
            f"weights.timeout_s={TIMEOUT_S}",
            "weights.bucket_mb=8",
            *mesh,
        ],
    )
    hub = Hub(cfg, PromptSet(addition_items(), build_tokenizer()))
    hub.start()
    # 48 MiB in 6 parameters, views of one flat buffer as ZeRO-1/2 keeps them: 6 buckets, each far above
    # what loopback socket buffers absorb, so a member that stops reading stalls the sender mid-broadcast.
    flat = torch.randn(6 * (2 << 20))
    params = [torch.nn.Parameter(torch.empty(0)) for _ in range(6)]
    for i, p in enumerate(params):
        p.data = flat.narrow(0, i * (2 << 20), 2 << 20).view(1024, 2048)
    sender = WeightSender.for_params(cfg.weights, [(f"layer{i}.weight", p) for i, p in enumerate(params)], "float32")
    opt = torch.optim.SGD(params, lr=0.1)
    sender.guard(opt)  # each optimizer step first stops the serving thread, as in the learner
    members: list[Member] = []
    yield addr, hub, sender, params, opt, members
    sender.wait()
    hub.stop()
    for member in members:
        member.stop()


def step(opt, params) -> None:
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()


@pytest.mark.parametrize("learner", ["mesh", "lazy"], indirect=True)
def test_dead_and_hung_members_are_dropped_and_the_survivors_served(learner):
    addr, hub, sender, params, opt, members = learner
    a, b, victim = Member(addr, "a"), Member(addr, "b"), Member(addr, "victim", "--block-at", "2")
    members += [a, b, victim]
    deadline = time.monotonic() + 30
    while len(hub.live_actors()) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hub.live_actors() == ["a", "b", "victim"]

    step(opt, params)
    sender.sync(1, hub)
    got = [m.expect("synced", version=1) for m in (a, b, victim)]
    assert {g["digest"] for g in got} == {digest(params)}  # every member holds exactly the learner's bytes
    (epoch1,) = {g["epoch"] for g in got}

    # 1. SIGKILL mid-broadcast: the victim stops inside the load of version 2's first bucket, the sender
    #    stalls on it; the kill closes its connections. The survivors, waiting for a bucket that will not
    #    come, are told the epoch is over, and get version 2 again in a new epoch.
    step(opt, params)
    sender.sync(2, hub)
    d2 = digest(params)
    victim.expect("blocked", version=2)
    t_kill = time.monotonic()
    victim.proc.kill()
    for m in (a, b):
        # Told the epoch is over (its abort key), or, fed by the victim in gloo's broadcast tree, by gloo itself.
        failed = m.expect("failed", version=2, timeout=BOUND_S)
        peer_gone = ("closed by peer", "Connection reset")  # gloo's words for the victim's closed socket
        assert failed["epoch"] == epoch1 and ("gave epoch" in failed["error"] or any(w in failed["error"] for w in peer_gone)), failed
        synced = m.expect("synced", version=2, timeout=BOUND_S)
        assert synced["digest"] == d2 and synced["epoch"] > epoch1, synced
    killed_s = time.monotonic() - t_kill
    assert killed_s < BOUND_S, killed_s
    assert hub.live_actors() == ["a", "b"]

    # 2. A member that registers while version 2 is served gets it at once, in an epoch of its own. Then it
    #    hangs (SIGSTOP) mid-broadcast of version 3: silent, the hub declares it dead after actor_timeout_s.
    sleeper = Member(addr, "sleeper", "--block-at", "3")
    members.append(sleeper)
    assert sleeper.expect("synced", version=2)["digest"] == d2
    step(opt, params)
    out2 = sender.sync(3, hub)  # reports what serving version 2 took
    assert out2["weights/failed"] >= 1 and out2["weights/catchups"] >= 1 and out2["time/broadcast"] > 0, out2
    d3 = digest(params)
    sleeper.expect("blocked", version=3)
    t_stop = time.monotonic()
    sleeper.proc.send_signal(signal.SIGSTOP)
    for m in (a, b):
        assert m.expect("synced", version=3, timeout=ACTOR_TIMEOUT_S + BOUND_S)["digest"] == d3
    hung_s = time.monotonic() - t_stop
    assert hung_s < ACTOR_TIMEOUT_S + BOUND_S, hung_s
    assert hub.live_actors() == ["a", "b"]

    # 3. A member that dies the moment version 4's WeightSync reaches it, while its new group is forming.
    late = Member(addr, "late", "--die-on-sync", "4")
    members.append(late)
    assert late.expect("synced", version=3)["digest"] == d3
    step(opt, params)
    t_sync = time.monotonic()
    sender.sync(4, hub)
    d4 = digest(params)
    got = [m.expect("synced", version=4, timeout=BOUND_S) for m in (a, b)]
    assert {g["digest"] for g in got} == {d4}
    formed_s = time.monotonic() - t_sync
    assert formed_s < BOUND_S, formed_s
    assert late.proc.wait(timeout=5) == -signal.SIGKILL
    (epoch4,) = {g["epoch"] for g in got}

    # 4. The survivors' group keeps working: the next version goes out in the same epoch.
    step(opt, params)
    sender.sync(5, hub)
    got = [m.expect("synced", version=5, timeout=BOUND_S) for m in (a, b)]
    assert {g["digest"] for g in got} == {digest(params)} and {g["epoch"] for g in got} == {epoch4}
    sender.wait()
    snap = hub.snapshot()
    assert snap["hub/actors_lost"] == 3 and snap["hub/actors_disconnected"] == 2  # the stopped one: heartbeat timeout
    print(
        f"death costs: killed mid-broadcast {killed_s:.2f} s, hung {hung_s:.2f} s (actor_timeout_s {ACTOR_TIMEOUT_S}), "
        f"died as its group formed {formed_s:.2f} s; weights.timeout_s = {TIMEOUT_S}"
    )


@pytest.mark.parametrize("version", [0, 4])
def test_start_serves_a_resumed_version_to_each_actor_that_registers(learner, version):
    """A resumed learner (version 4) starts serving before any update: actors come back to it serving -1 and
    get no work until they hold its version, so each one that registers is sent it at once, bytes exact.
    A fresh learner (version 0) sends nothing: every actor loads version 0 from model.path."""
    addr, hub, sender, params, opt, members = learner
    hub.finish_update(version, [])
    sender.start(version, hub)
    first = Member(addr, "first")
    members.append(first)
    if version == 0:
        first.expect("registered")
        time.sleep(2.0)
        assert not [e for e in list(first.events.queue) if e["event"] in ("synced", "failed")]
        assert "time/broadcast" not in sender.wait()  # nothing was served
        return
    got = first.expect("synced", version=version, timeout=BOUND_S)
    assert got["digest"] == digest(params)
    second = Member(addr, "second")  # a later one gets it too, in an epoch of its own (the first keeps serving)
    members.append(second)
    again = second.expect("synced", version=version, timeout=BOUND_S)
    assert again["digest"] == digest(params) and again["epoch"] > got["epoch"]
    report = sender.wait()
    assert report["time/broadcast"] > 0 and report["weights/catchups"] == 1, report
