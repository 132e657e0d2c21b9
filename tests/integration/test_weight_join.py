"""A member that registers and never joins its weight group, or joins and never connects, holds training up
once at most, for weights.join_timeout_s, and never again: the others get their weights on time.

Before the join deadline existed, such a member held the learner's next optimizer step for weights.timeout_s
(the step waits for the sync's own broadcast), and again at every later sync it was part of.

Real pieces, as in tests/integration/test_weight_death.py: the hub, WeightSender guarded by a real optimizer, gloo, member
processes running the actor's protocol and receiver (tests/drivers/weight_member.py). The GPU test at the end
runs the same with the learner on a GPU, where the member's epoch is NCCL.
"""

import hashlib
import logging
import threading
import time

import pytest
import structlog
import torch
from conftest import wait_until
from structlog.testing import capture_logs

from deploy.tiny import build_tokenizer
from learner.data.prompts import PromptSet, addition_items
from learner.hub.server import Hub
from learner.weights.membership import ALONE, Membership
from learner.weights.sync import WeightSender
from protocol.abortable import Abortable, Aborted, Graveyard
from protocol.config import load_config
from protocol.net import free_port
from tests.integration.test_weight_death import Member, step

TIMEOUT_S = 30.0  # weights.timeout_s: what such a member used to cost each time
JOIN_S = 3.0  # weights.join_timeout_s
SLACK_S = 2.0  # on top of the join deadline: evicting, re-forming and sending 6 MiB
# A sync and the step after it that nobody holds up: under 0.9 x JOIN_S, the least a join deadline waited out takes
# (the first sync's check), with as much room as that leaves for a loaded machine.
QUICK_S = 0.8 * JOIN_S


# ---- who goes into which epoch (no I/O) ------------------------------------------------------------------
def test_newcomers_are_on_probation_until_they_join():
    ms = Membership()
    ms.registered("a")
    ms.registered("b")
    assert ms.regular(["a", "b"]) == ["a", "b"]  # before the first sync there is nothing to prove with
    ms.serving = True
    ms.registered("new")
    assert ms.regular(["a", "b", "new"]) == ["a", "b"]
    assert ms.next_group(["a", "new"]) == ["a"] and ms.next_group(["new"]) == ["new"]  # regular ones first
    ms.joined(["new"])
    assert ms.regular(["a", "b", "new"]) == ["a", "b", "new"]
    ms.removed("new")  # evicted (missed a join), then back under its id: a newcomer again
    ms.registered("new")
    assert ms.regular(["a", "new"]) == ["a"]


def test_a_group_that_does_not_connect_splits_its_members_then_evicts_the_one_that_fails_alone():
    ms = Membership(serving=True)
    ms.joined(["a"])
    ms.registered("x")
    ms.registered("y")
    assert ms.next_group(["x", "y"]) == ["x", "y"]  # newcomers together
    assert ms.connect_failed(["x", "y"]) == [] and ms.probation == {"x": ALONE, "y": ALONE}
    assert ms.next_group(["x", "y"]) == ["x"]  # then one at a time
    assert ms.connect_failed(["x"]) == ["x"]  # alone: to blame
    assert ms.connect_failed(["a", "y"]) == [] and "a" not in ms.proven and "a" not in ms.probation  # proven: one more chance
    assert ms.connect_failed(["a", "y"]) == [] and ms.probation["a"] == ALONE


def test_an_abandoned_build_drops_what_it_made_then_and_later():
    """Abortable.build: at the deadline, what the join made so far (an NCCL group whose communicator is still
    connecting) is dropped at once, and so is what it makes after it was abandoned; a build that ends keeps it."""
    dropped: list[str] = []
    release = threading.Event()

    def make(made):
        made("group")
        release.wait(5)
        made("late")
        return "group"

    waits = Abortable(should_abort=lambda: None, timeout_s=0.2, graveyard=Graveyard(), poll_s=0.01)
    with pytest.raises(Aborted):
        waits.build(make, dropped.append)

    def until(want: list[str]) -> None:  # the build's thread may be slow to start on a loaded machine
        wait_until(lambda: dropped == want, lambda: f"dropped {dropped}, not {want}", 5, every_s=0.01)

    until(["group"])
    release.set()
    until(["group", "late"])
    assert waits.build(lambda made: made("kept") or "kept", dropped.append) == "kept" and dropped == ["group", "late"]


# ---- the learner's delay, with real members ---------------------------------------------------------------
@pytest.fixture
def learner(request):
    # "cpu-lazy": every gloo epoch connects lazily (weights.gloo_mesh_ranks=0), as a large fleet's does
    device, _, lazy = getattr(request, "param", "cpu").partition("-")
    addr = f"tcp://127.0.0.1:{free_port()}"
    # hub.actor_timeout_s is long: a silent member still heartbeats, and must be caught by the join deadline.
    cfg = load_config(
        None,
        [
            f"hub.bind={addr}",
            "hub.heartbeat_s=0.2",
            "hub.actor_timeout_s=20",
            f"weights.timeout_s={TIMEOUT_S}",
            f"weights.join_timeout_s={JOIN_S}",
            "weights.bucket_mb=2",
            *(["weights.gloo_mesh_ranks=0"] if lazy else []),
        ],
    )
    hub = Hub(cfg, PromptSet(addition_items(), build_tokenizer()))
    hub.start()
    flat = torch.randn(6 * (256 << 10), device=device)  # 6 MiB in 6 parameters, views of one flat buffer (ZeRO-1/2)
    params = [torch.nn.Parameter(torch.empty(0, device=device)) for _ in range(6)]
    for i, p in enumerate(params):
        p.data = flat.narrow(0, i * (256 << 10), 256 << 10).view(256, 1024)
    sender = WeightSender.for_params(cfg.weights, [(f"layer{i}.weight", p) for i, p in enumerate(params)], "float32")
    opt = torch.optim.SGD(params, lr=0.1)
    sender.guard(opt)  # each optimizer step first waits for the sync's own broadcast, as in the learner
    members: list[Member] = []
    yield addr, hub, sender, params, opt, members
    try:
        sender.close()  # its last group (NCCL on a GPU) is aborted here, not left to a later test
    finally:
        hub.stop()
        for member in members:
            member.stop()


def digest(params: list[torch.Tensor]) -> str:
    """What tests/drivers/weight_member.py reports for the same bytes (sha1 of every tensor, in order)."""
    h = hashlib.sha1()
    for p in params:
        h.update(p.detach().reshape(-1).cpu().numpy().tobytes())
    return h.hexdigest()


def wait_live(hub, ids, timeout=30.0):
    deadline = time.monotonic() + timeout
    while sorted(hub.live_actors()) != sorted(ids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sorted(hub.live_actors()) == sorted(ids)


def timed_step(opt, params) -> float:
    """The optimizer step, which waits for the sync's own broadcast in flight: the learner's delay."""
    t0 = time.monotonic()
    step(opt, params)
    return time.monotonic() - t0


def served(members, version, timeout) -> tuple[float, str, set[int]]:
    """Seconds until every member holds `version`, the digest they all got, and their group epochs."""
    t0 = time.monotonic()
    got = [m.expect("synced", version=version, timeout=timeout) for m in members]
    (d,) = {g["digest"] for g in got}
    return time.monotonic() - t0, d, {g["epoch"] for g in got}


@pytest.mark.parametrize(
    "learner, mode", [("cpu", "--silent"), ("cpu", "--stall-join"), ("cpu-lazy", "--stall-join")], indirect=["learner"]
)
def test_a_member_that_never_joins_holds_training_up_once_for_the_join_deadline(learner, mode):
    """--silent: registers and never takes its WeightSync (never sets its joined key): evicted at the deadline.
    --stall-join: sets its joined key and never connects: the group's connect gives up at the deadline. In a lazy
    epoch (cpu-lazy) the others' group builds at once, and its first broadcast (the build's probe) waits instead.
    Either way the learner's next step waits the deadline once; the following syncs and steps wait for nothing."""
    addr, hub, sender, params, opt, members = learner
    a, b, bad = Member(addr, "a"), Member(addr, "b"), Member(addr, "bad", mode)
    members += [a, b, bad]
    wait_live(hub, ["a", "b", "bad"])

    step(opt, params)
    sender.sync(1, hub)  # all three registered before the first sync: regular members, the bad one included
    first_delay = timed_step(opt, params)  # the step after a sync waits for that sync's own broadcast
    assert JOIN_S * 0.9 <= first_delay <= JOIN_S + SLACK_S, first_delay

    # The next sync goes to a and b only (the bad one is evicted and back on probation, or kept apart), at once.
    t_sync = time.monotonic()
    sender.sync(2, hub)
    serve_s, d, _ = served([a, b], 2, timeout=JOIN_S + SLACK_S)
    assert d == digest(params)
    assert time.monotonic() - t_sync <= QUICK_S, time.monotonic() - t_sync
    second_delay = timed_step(opt, params)
    assert second_delay <= QUICK_S, second_delay

    sender.sync(3, hub)
    serve3_s, d3, _ = served([a, b], 3, timeout=JOIN_S + SLACK_S)
    assert d3 == digest(params) and serve3_s <= QUICK_S, serve3_s
    third_delay = timed_step(opt, params)
    assert third_delay <= QUICK_S, third_delay
    out = sender.sync(4, hub)
    assert out["weights/members"] == 2.0, out
    assert not [e for e in list(bad.events.queue) if e["event"] == "synced"]
    print(
        f"{mode}: delay of the step after sync 1 {first_delay:.2f} s (weights.join_timeout_s {JOIN_S}), "
        f"after sync 2 {second_delay:.2f} s, after sync 3 {third_delay:.2f} s; weights.timeout_s {TIMEOUT_S}"
    )


def test_a_newcomer_that_never_joins_holds_nobody_up(learner):
    """The operator's case: an actor registers mid-run and never joins. It is on probation: its catch-ups run in
    an epoch of its own (each evicts it at the deadline, and it registers again), no sync waits for it, and the
    others' epoch is kept meanwhile (re-forming it would cost an NCCL init per sync)."""
    addr, hub, sender, params, opt, members = learner
    a, b = Member(addr, "a"), Member(addr, "b")
    members += [a, b]
    wait_live(hub, ["a", "b"])
    step(opt, params)
    sender.sync(1, hub)
    _, _, epochs = served([a, b], 1, timeout=QUICK_S + SLACK_S)

    silent = Member(addr, "silent", "--silent")
    members.append(silent)
    silent.expect("ignored", version=1)  # its catch-up of version 1, in an epoch of its own: it never joins it
    silent.expect("hub_error", timeout=JOIN_S + SLACK_S, code="unknown_actor")  # evicted at the deadline
    silent.expect("ignored", version=1, timeout=SLACK_S)  # registered again: caught up again, apart
    delays = []
    for version in range(2, 5):
        delays.append(timed_step(opt, params))
        out = sender.sync(version, hub)
        serve_s, d, e = served([a, b], version, timeout=JOIN_S + SLACK_S)
        assert d == digest(params) and serve_s <= QUICK_S, (version, serve_s)
        assert e == epochs and out["weights/members"] == 2.0, (e, epochs, out)  # the same group: nothing re-formed
        time.sleep(0.5)  # its catch-up of this version starts meanwhile (and is given up at the next step)
    delays.append(timed_step(opt, params))
    assert max(delays) <= QUICK_S, delays
    assert hub.snapshot()["hub/actors_evicted"] >= 1
    assert not [e for e in list(silent.events.queue) if e["event"] == "synced"]
    print(f"a newcomer that never joins: step delays {[round(d, 2) for d in delays]} s; weights.join_timeout_s {JOIN_S}")


def test_a_newcomer_is_evicted_at_its_deadline_when_steps_are_shorter_than_it(learner):
    """Each optimizer step ends a newcomer's catch-up early. With steps shorter than weights.join_timeout_s, a
    deadline counted per attempt was never reached: the silent member stayed, and was sent a new epoch at every
    step. The deadline counts from its first attempt, so it is evicted after join_timeout_s all the same.

    And it is said once: every cut used to be a weights.attempt_failed warning (and a weights.broadcast.failed
    one), two lines per step. Now the first cut is the one warning, the later attempts are debug lines, and the
    eviction says how many attempts there were; the failures are counted as before."""
    addr, hub, sender, params, opt, members = learner
    a = Member(addr, "a")
    members.append(a)
    wait_live(hub, ["a"])
    step(opt, params)
    sender.sync(1, hub)
    served([a], 1, timeout=QUICK_S + SLACK_S)
    level = structlog.get_config()["wrapper_class"]  # an earlier in-process setup_logging may filter at INFO
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with capture_logs() as logs:
            silent = Member(addr, "silent", "--silent")
            members.append(silent)
            silent.expect("ignored", version=1)
            t0, version, counted = time.monotonic(), 1, 0.0
            while hub.snapshot().get("hub/actors_evicted", 0) < 1:  # no step after it: its return is not cut short
                assert time.monotonic() - t0 < JOIN_S + 3 * SLACK_S, "never evicted: every catch-up was cut short before its deadline"
                version += 1
                step(opt, params)  # ends the newcomer's catch-up in flight
                counted += sender.sync(version, hub).get("weights/failed", 0.0)
                served([a], version, timeout=QUICK_S + SLACK_S)
                time.sleep(JOIN_S / 6)
    finally:
        structlog.configure(wrapper_class=level)
    print(f"evicted {time.monotonic() - t0:.1f} s after its first catch-up, {version - 1} steps later")
    # The silent member's warnings only: on a loaded machine the good members may have warnings of their own.
    warnings = [(e["event"], e.get("members") or e.get("actor")) for e in logs if e["log_level"] == "warning"]
    warnings = [w for w in warnings if w[1] in (["silent"], "silent")]
    assert warnings == [("weights.attempt_failed", ["silent"]), ("hub.actor_removed", "silent")], warnings
    [removed] = [e for e in logs if e["event"] == "hub.actor_removed"]
    failed = [e for e in logs if e["event"] == "weights.attempt_failed"]
    assert all(e["members"] == ["silent"] for e in failed) and len(failed) >= 3, failed  # several steps cut it short
    assert removed["why"].endswith(f"({len(failed)} attempts)"), (removed["why"], len(failed))
    # Counted as before, whatever their log level (+ 1: the returned newcomer's catch-up, if begun, cut short here).
    counted += sender.wait().get("weights/failed", 0.0)
    assert len(failed) <= counted <= len(failed) + 1, (counted, len(failed))


# ---- on a GPU: the learner's epoch with the member is NCCL --------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("learner", ["cuda"], indirect=True)
@pytest.mark.parametrize("mode", ["--silent", "--stall-join"])
def test_nccl_member_that_never_joins_or_connects_does_not_hang_the_learner(learner, mode):
    """The bad member registers a GPU that is not the learner's (a made-up one: it never touches it), so its
    epoch is NCCL. --stall-join leaves the learner's communicator init waiting for a rank that never comes: the
    connect is given up at the join deadline and its group aborted. The learner's GPU and serving thread go on:
    a good member gets the next versions (over NCCL from a second GPU when there is one, else over gloo through
    pinned host memory)."""
    addr, hub, sender, params, opt, members = learner
    bad = Member(addr, "bad", mode, "--identity", "cuda:GPU-00000000-0000-0000-0000-fleetrl-fake")
    members.append(bad)
    wait_live(hub, ["bad"])
    step(opt, params)
    sender.sync(1, hub)
    delay = timed_step(opt, params)
    assert JOIN_S * 0.9 <= delay <= JOIN_S + SLACK_S, delay
    if mode == "--stall-join":
        bad.expect("stalled", version=1)
    torch.cuda.synchronize()  # the learner's GPU is not stuck behind an NCCL kernel

    device = "cuda:1" if torch.cuda.device_count() > 1 else "cpu"
    good = Member(addr, "good", "--device", device)
    members.append(good)
    good.expect("registered")
    sender.sync(2, hub)  # the good one is on probation: caught up apart (and apart from the bad one, if it is back)
    _, d, _ = served([good], 2, timeout=2 * JOIN_S + SLACK_S + 30)  # a first NCCL init is slow
    assert d == digest(params)
    step(opt, params)
    sender.sync(3, hub)
    _, d, _ = served([good], 3, timeout=JOIN_S + SLACK_S)  # the sync's own epoch now: one more communicator init
    assert d == digest(params)
    assert timed_step(opt, params) <= QUICK_S
    assert sender.plan is not None and sender.plan.backend == ("nccl" if device != "cpu" else "gloo")
