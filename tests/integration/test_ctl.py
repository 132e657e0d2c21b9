"""`fleetrl ctl` changes max_staleness in a running hub, and the staleness invariant holds across the change.

The hub runs for real (its thread, its ROUTER socket, the codec); the control client is the real
`fleetrl ctl` code; scripted actors speak the real protocol. The test's loop stands in for the
learner's: take a batch, "train" (sleep), finish the update, let the actors sync.
"""

import time

import pytest
from conftest import wait_until
from scripted_actor import ScriptedActor
from structlog.testing import capture_logs

from deploy.cli import main
from deploy.ctl import request, set_setting
from protocol import messages as m
from protocol.net import free_port

COMMON = ("train.prompts_per_step=4", "rollout.samples_per_prompt=2", "data.epochs=1000", "train.mini_batches=2")


def test_ctl_sets_max_staleness_and_refuses_bad_values(capsys, start_hub):
    hub = start_hub(*COMMON, "staleness.max_staleness=1")  # S = 2: k >= 1
    addr = hub.cfg.hub.bind
    with capture_logs() as logs:
        assert main(["ctl", "--learner", addr, "set", "max_staleness", "3"]) == 0
    out = capsys.readouterr().out
    assert "max_staleness 1 -> 3 at version 0" in out
    assert hub.max_staleness == 3 and hub.snapshot()["staleness/max_staleness"] == 3.0
    changed = [e for e in logs if e["event"] == "hub.max_staleness_changed"]
    assert [(e["old"], e["new"], e["source"]) for e in changed] == [(1, 3, "fleetrl ctl")]

    # Below S - 1: refused with the numbers, exit 1, k unchanged.
    assert main(["ctl", "--learner", addr, "set", "max_staleness", "0"]) == 1
    err = capsys.readouterr().err
    assert "refused: max_staleness: 0 < 2 optimizer steps per update - 1" in err and "max_staleness stays 3" in err
    assert main(["ctl", "--learner", addr, "set", "max_staleness", "-5"]) == 1
    assert hub.max_staleness == 3

    # The reply carries the numbers too.
    reply = set_setting(addr, "max_staleness", 2)
    assert (reply.ok, reply.previous, reply.value, reply.policy_version) == (True, 3, 2, 0)

    # Unknown setting: argparse refuses it; sent raw, the hub's decoder does, and the hub stays up.
    with pytest.raises(SystemExit) as exit_info:
        main(["ctl", "--learner", addr, "set", "lr", "1"])
    assert exit_info.value.code == 2
    reply = request(addr, m.ControlRequest(command="set", key="lr", value=1))
    assert isinstance(reply, m.Error) and "ControlRequest.key: 'lr' unknown (known: max_staleness)" in reply.detail
    reply = request(addr, m.ControlRequest(command="reset", key="max_staleness", value=1))
    assert isinstance(reply, m.Error) and "ControlRequest.command: 'reset' unknown" in reply.detail
    assert hub.max_staleness == 2 and hub.snapshot()["hub/protocol_errors"] == 2
    # Nobody listening: a clear message, exit 1, no hang.
    t0 = time.monotonic()
    assert main(["ctl", "--learner", f"tcp://127.0.0.1:{free_port()}", "--timeout", "0.3", "set", "max_staleness", "2"]) == 1
    assert "no reply from" in capsys.readouterr().err and time.monotonic() - t0 < 3


def test_control_file_changes_max_staleness(tmp_path, start_hub):
    path = tmp_path / "control.toml"
    path.write_text("max_staleness = 5\n")  # there before the start: not applied
    hub = start_hub(*COMMON, "staleness.max_staleness=1", control_file=path)

    time.sleep(1.5)  # at least one poll
    assert hub.max_staleness == 1
    with capture_logs() as logs:
        path.write_text("max_staleness = 4\n")
        wait_until(lambda: hub.max_staleness == 4, lambda: f"max_staleness is {hub.max_staleness}, not 4", 5)

        def logged(event: str) -> None:  # the hub reads the file once a second, later on a loaded machine
            wait_until(lambda: event in [e["event"] for e in logs], f"{event} was not logged", 10)

        path.write_text("max_staleness = 0\n")  # < S - 1: refused, logged
        logged("hub.control_refused")
        path.write_text("max_staleness = [\n")  # not TOML: logged, ignored
        logged("hub.control_file_bad")
    assert hub.max_staleness == 4
    source = next(e["source"] for e in logs if e["event"] == "hub.max_staleness_changed")
    assert source == f"file {path}"


@pytest.mark.parametrize(("steps", "k_high", "k_low"), [(1, 3, 0), (2, 3, 1)])
def test_invariant_holds_across_a_live_lowering(steps, k_high, k_low, start_hub):
    """k goes k_high -> k_low (via `fleetrl ctl`, while an update trains) -> k_high.

    After the lowering is acknowledged no batch holds a sample with (u + S - 1) - v > k_low; the
    groups buffered under the old bound are dropped and requeued, counted; raising k admits older ones.
    """
    prompts = 4
    hub = start_hub(*COMMON, f"train.mini_batches={steps}", f"staleness.max_staleness={k_high}", "staleness.lease_s=30")
    addr = hub.cfg.hub.bind
    actors = [ScriptedActor(addr, "fast", 2, delay_s=0.02, seed=0).start(), ScriptedActor(addr, "slow", 2, delay_s=0.4, seed=1).start()]
    seen: list[tuple[str, int, int]] = []  # (phase, staleness, k the batch was checked with)
    version, phase = 0, "high"
    buffered_at_lowering = dropped_before = 0
    try:
        for update in range(24):
            batch = hub.take_batch(prompts, timeout_s=30)
            seen += [(phase, version + steps - 1 - item.group.version_min, hub.batch_max_staleness) for item in batch]
            time.sleep(0.05)  # training: the actors fill the buffer meanwhile (k_high leaves room)
            if update == 8:
                deadline = time.monotonic() + 5
                while len(hub.buffer) == 0 and time.monotonic() < deadline:
                    time.sleep(0.01)
                with hub.cond:
                    buffered_at_lowering = len(hub.buffer)  # all of version <= u: too stale for k_low after this update
                    dropped_before = hub.counters["dropped_stale"]
                reply = set_setting(addr, "max_staleness", k_low)
                assert reply.ok and reply.previous == k_high and reply.value == k_low
                phase = "low"
            if update == 16:
                assert set_setting(addr, "max_staleness", k_high).ok
                phase = "raised"
            version += steps
            hub.finish_update(version, [item.key for item in batch])
            for a in actors:
                a.target_version = version
        snap = hub.snapshot()
    finally:
        for a in actors:
            a.stop.set()
    assert buffered_at_lowering > 0, "precondition: groups admitted under k_high were waiting when k was lowered"
    low = [s for p, s, _ in seen if p == "low"]
    assert len(low) == 8 * prompts and max(low) <= k_low, f"a sample beyond k_low = {k_low} was trained: {max(low)}"
    assert all(k == k_low for p, _, k in seen if p == "low")
    assert max(s for p, s, k in seen if p == "high") <= k_high
    raised = [s for p, s, _ in seen if p == "raised"]
    assert max(raised) > k_low, "raising k again should admit older samples"
    assert snap["hub/dropped_stale"] - dropped_before >= buffered_at_lowering
    assert snap["ledger/requeued_stale"] == snap["hub/dropped_stale"]  # every dropped group went back to the queue
    assert snap["ledger/trained"] == 24 * prompts
    hub.ledger.check()
