"""`fleetrl status --once` against a real hub with scripted actors: their rows, the counts, the histogram.

The StatusReply is checked field by field against the hub's own state, then the printed table
against the reply. The test's loop stands in for the learner and reports its timings
(Hub.note_update) as the learner does.
"""

import time
from collections import Counter

import pytest
from conftest import settled
from scripted_actor import ScriptedActor

from deploy.cli import main
from deploy.status import fetch
from protocol.net import free_port


def _row(out: str, actor: str) -> list[str]:
    (line,) = [ln for ln in out.splitlines() if ln.startswith("│ " + actor + " ")]
    return [cell.strip() for cell in line.strip("│").split("│")]


def test_status_once_shows_the_fleet(capsys, start_hub):
    hub = start_hub(
        "staleness.max_staleness=2", "train.prompts_per_step=4", "rollout.samples_per_prompt=2", "staleness.lease_s=60", "data.epochs=1000"
    )
    addr = hub.cfg.hub.bind
    actors = [ScriptedActor(addr, "fast", 2, delay_s=0.01, seed=0).start(), ScriptedActor(addr, "slow", 2, delay_s=0.5, seed=1).start()]
    staleness = Counter()
    try:
        t_sync = 0.0
        for version in range(1, 7):
            t0 = time.perf_counter()
            batch = hub.take_batch(4, timeout_s=30)
            staleness.update(version - 1 - item.group.version_min for item in batch)
            hub.finish_update(version, [item.key for item in batch])
            t_sync = time.monotonic()
            for a in actors:
                a.target_version = version  # stands in for the weight broadcast
            hub.note_update(time.perf_counter() - t0, t_sync, 0.004, 0.03)
        deadline = time.monotonic() + 5
        while any(s.served_version < 6 for s in list(hub.actors.values())) and time.monotonic() < deadline:
            time.sleep(0.01)  # both report serving the last version
        for a in actors:
            a.quiet.set()  # connected but silent: a closed connection would remove the actor at once

        def seen() -> dict:
            with hub.cond:
                return {a: (s.served_version, s.groups, len(s.held), s.last_seen) for a, s in hub.actors.items()}

        # Until their last messages have landed (an actor sees `quiet` only between two messages): nothing heard for 0.4 s.
        settled(seen, "what the quiet actors sent", 0.4)
        reply = fetch(addr)
        with hub.cond:
            state = {a: (s.served_version, s.groups, len(s.held)) for a, s in hub.actors.items()}
            ledger = hub.ledger.state_counts()
            buffered, dropped = len(hub.buffer), hub.counters["dropped_stale"]

        assert reply.actor_ids == ["fast", "slow"]
        got = {
            a: (int(reply.actor_served_version[i]), int(reply.actor_groups[i]), int(reply.actor_leases[i]))
            for i, a in enumerate(reply.actor_ids)
        }
        assert got == state
        assert state["fast"][1] > 0 and state["fast"][0] == 6
        assert reply.actor_samples_per_s[0] > 0 and reply.actor_samples_per_s[0] > reply.actor_samples_per_s[1]
        assert (reply.actor_heartbeat_age_s >= 0.3).all() and (reply.actor_heartbeat_age_s < 30).all()
        assert (reply.policy_version, reply.updates, reply.max_staleness, reply.steps_per_update, reply.training) == (6, 6, 2, 1, False)
        assert (reply.pending, reply.granted, reply.received, reply.trained) == (
            ledger["pending"],
            ledger["granted"],
            ledger["received"],
            ledger["trained"],
        )
        assert reply.trained == 24 and (reply.buffered, reply.dropped_stale) == (buffered, dropped)
        assert reply.staleness_counts.tolist() == [staleness[s] for s in range(max(staleness) + 1)]
        assert reply.syncs == 6 and reply.sync_s == pytest.approx(0.004) and reply.broadcast_s == pytest.approx(0.03)
        assert 0.3 <= reply.sync_age_s < 30 and reply.step_s > 0

        assert main(["status", "--learner", addr, "--once"]) == 0
        out = capsys.readouterr().out
        for actor in ("fast", "slow"):
            served, groups, leases = state[actor]
            cells = _row(out, actor)  # actor, version, behind, samples/s, groups, leases, heartbeat
            assert (cells[1], cells[2], cells[4], cells[5]) == (str(served), str(6 - served), str(groups), str(leases)), cells
            assert cells[6].endswith("s ago")
        assert "version 6 (6 updates, S = 1)" in out and "k = 2" in out
        assert "trained 24" in out and f"granted {ledger['granted']}" in out
        assert "held the learner 0.004 s, broadcast 0.030 s" in out
        for s, count in enumerate(reply.staleness_counts.tolist()):
            (line,) = [ln for ln in out.splitlines() if ln.startswith(f"│ {s:>9} │")]
            assert line.split("│")[2].strip() == str(count)
    finally:
        for a in actors:
            a.stop.set()
    assert main(["status", "--learner", f"tcp://127.0.0.1:{free_port()}", "--once", "--timeout", "0.3"]) == 1
    assert "no reply from" in capsys.readouterr().err
