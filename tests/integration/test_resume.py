"""Learner restart: checkpoints hold the training state, `fleetrl learner --resume RUN_DIR` continues from the newest
complete one, and running actors wait for the learner and come back by themselves.

Here: a resumed hub over its real socket, `--resume` without a checkpoint, an interrupted checkpoint write (a process
killed mid-write) that resume must never take, resumed learner ranks under torchrun, and the engine test that kills a
real learner mid-run and resumes it while its vLLM actor keeps running. In-process: the ledger's state round trip
(granted and received prompts return to pending, the order and the next epochs' shuffles continue exactly) in
tests/unit/test_ledger.py, and metrics.jsonl cut back to the checkpoint in tests/unit/test_run_dir.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import torchrun_driver

from learner.hub.core.ledger import Ledger, State
from learner.resume import latest_checkpoint
from protocol.net import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_restored_hub_admits_only_actors_serving_its_weights():
    """A resumed hub at version 4: an actor still holding weights from the dead learner's future (version 6) gets
    no work and its groups are rejected until it serves the resumed weights; the in-flight prompts come back first,
    trained ones never. An actor that re-registers serving -1 forms a new weight-group membership; its retries do not."""
    import zmq
    from conftest import rollout_group

    from deploy.tiny import build_tokenizer
    from learner.data.prompts import PromptSet, addition_items
    from learner.hub.server import Hub
    from protocol import messages as m
    from protocol.codec import decode, encode
    from protocol.config import load_config

    port = free_port()
    cfg = load_config(
        None, [f"hub.bind=tcp://127.0.0.1:{port}", "rollout.samples_per_prompt=3", "train.prompts_per_step=4", "staleness.max_staleness=1"]
    )
    prompts = PromptSet(addition_items(), build_tokenizer())
    dead = Hub(cfg, prompts)  # the learner that died: 8 prompts granted and received, 4 of them trained
    keys = [dead.ledger.next_pending() for _ in range(8)]
    for k in keys:
        dead.ledger.grant(k, "a0", 1e9)
        dead.ledger.receive(k)
    for k in keys[:4]:
        dead.ledger.trained(k)
    dead.counters["granted"] = 8
    hub = Hub(cfg, prompts)
    hub.restore(json.loads(json.dumps(dead.export_state())), version=4)
    joins: list[tuple[str, bool]] = []  # what the weight sender hears: each registration and removal
    hub.add_membership_listener(lambda actor, joined: joins.append((actor, joined)))
    hub.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")

    def ask(msg):
        sock.send_multipart(encode(msg))
        assert sock.poll(5000), "the hub did not answer"
        return decode(sock.recv_multipart())

    try:
        ack = ask(m.Register(actor_id="a0", host="h", pid=1, served_version=6))
        assert isinstance(ack, m.RegisterAck) and ack.policy_version == 4
        sock.send_multipart(encode(m.WorkRequest(actor_id="a0", max_prompts=8)))
        assert not sock.poll(1500), "an actor serving weights the resumed learner never had got work"
        reply = ask(rollout_group(n=3, actor="a0", version=6, prompt_id=keys[5][1], epoch=keys[5][0]))
        assert reply.code == "rejected" and "newer than the learner's 4" in reply.detail
        snap = hub.snapshot()
        assert snap["hub/served_ahead"] == 1 and snap["hub/rejected_ahead"] == 1 and snap["ledger/received"] == 0
        assert snap["hub/granted"] == 8 and snap["ledger/requeued_resume"] == 4  # counters continue
        assert joins == [("a0", True)]
        sock.send_multipart(encode(m.WeightVersion(actor_id="a0", served_version=4, group_epoch=1, load_s=0.0)))
        grants = []
        for _ in range(8):
            assert sock.poll(5000), f"only {len(grants)} grants"
            grants.append(decode(sock.recv_multipart()))
        granted = [(g.epoch, g.prompt_id) for g in grants]
        assert all(g.policy_version == 4 for g in grants)
        assert granted[:4] == sorted(keys[4:]) and not set(granted) & set(keys[:4])
        assert joins == [("a0", True)]  # nothing changed membership so far
        assert isinstance(ask(m.Register(actor_id="a0", host="h", pid=1, served_version=-1)), m.RegisterAck)
        assert joins == [("a0", True), ("a0", False), ("a0", True)]  # a rejoin: its worker left the weight group
        assert isinstance(ask(m.Register(actor_id="a0", host="h", pid=1, served_version=-1)), m.RegisterAck)
        assert len(joins) == 3  # a retry of the same rejoin
        assert hub.actors["a0"].served_version == -1 and not hub.actors["a0"].held  # its grants went back
    finally:
        sock.close(linger=0)
        ctx.term()
        hub.stop()


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path):
    (tmp_path / "checkpoints" / "step-3").mkdir(parents=True)  # weights only, no training state
    proc = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "learner", "--resume", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"--resume {tmp_path}: no complete checkpoint with training state" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "learner"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 2 and "--config FILE is required (or --resume RUN_DIR)" in proc.stderr


def test_interrupted_checkpoint_write_is_never_resumed_from(tmp_path):
    """A learner killed (os._exit) while writing step-3's training state, after step-2 was complete: resume
    takes step-2, and the next start removes the half-written folder."""
    script = f"""
        import os
        from pathlib import Path
        from learner.checkpoint import CheckpointManager
        from learner.resume import LearnerState, write_learner_state
        from protocol.config import load_config

        def write(step, crash):
            def writer(path):
                (path / "state" / "policy").mkdir(parents=True)
                (path / "state" / "policy" / "shard.pt").write_bytes(b"x" * 1000)
                if crash:
                    os._exit(9)  # killed before learner.json and the rename
                write_learner_state(path / "state", LearnerState(updates=step, version=step, steps_per_update=1, world=1,
                                                                 zero_stage=2, hub={{}}))
            return writer

        cfg = load_config(None, ["checkpoint.every_steps=1"]).checkpoint
        CheckpointManager(cfg, {str(tmp_path)!r}, write(2, False)).maybe_save(2, {{}})
        CheckpointManager(cfg, {str(tmp_path)!r}, write(3, True)).maybe_save(3, {{}})
    """
    proc = subprocess.run(
        [sys.executable, "-c", __import__("textwrap").dedent(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 9, proc.stderr[-2000:]
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [".tmp-step-3-part", "step-2"]
    (ckpts / "step-4").mkdir()  # weights only (no training state): not a resume point either
    assert latest_checkpoint(tmp_path) == ckpts / "step-2"
    from learner.checkpoint import CheckpointManager
    from protocol.config import load_config

    CheckpointManager(load_config().checkpoint, tmp_path, lambda p: None)
    assert not (ckpts / ".tmp-step-3-part").exists()


def _run_driver(model_dir: Path, run_dir: Path, mode: str, nproc: int, *overrides: str) -> dict:
    out = run_dir / f"{mode}.json"
    settings = ("train.total_steps=4", "checkpoint.every_steps=2", "train.prompts_per_step=4", "rollout.samples_per_prompt=4",
                "train.micro_batch_samples=4", "train.mini_batches=2", "staleness.max_staleness=1", "train.lr=1e-3",
                "train.warmup_steps=20", f"cluster.learner_gpus_per_node={nproc}")  # fmt: skip
    return torchrun_driver("resume_steps.py", nproc, out, str(model_dir), str(run_dir), str(out), mode, *settings, *overrides, timeout=300)


@pytest.mark.parametrize(
    "ranks, algo",
    [(2, ("train.zero_stage=3",)), (1, ("train.zero_stage=2", "algo.advantage=gae", "algo.critic_lr=1e-3"))],
    ids=["2ranks-zero3", "1rank-zero2-critic"],
)
def test_resume_trains_exactly_like_no_interruption(tiny_model_dir, tmp_path, ranks, algo):
    """2 learner ranks with ZeRO-3 (weights and Adam moments sharded), or PPO with a critic (its own engine), 2
    optimizer steps per update, the LR still warming up: a run saves its training state after update 2 (every rank,
    told by the share header); a new process group resumes from it. Updates 3 and 4 must come out as in the
    uninterrupted run: same losses, same weights, same optimizer step count and LR. Without the optimizer state or
    the scheduler they would not."""
    whole = _run_driver(tiny_model_dir, tmp_path, "run", ranks, *algo)
    state = tmp_path / "checkpoints" / "step-2" / "state"
    if ranks == 2:
        assert sorted(p.name for p in (state / "policy").iterdir() if p.suffix == ".pt") == [
            "zero_pp_rank_0_mp_rank_00_model_states.pt",
            "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "zero_pp_rank_1_mp_rank_00_model_states.pt",
            "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        ]  # one shard per rank
    else:
        assert (state / "critic" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").is_file()
    resumed = _run_driver(tiny_model_dir, tmp_path, "resume", ranks, *algo)
    assert list(resumed["losses"]) == ["3", "4"]
    assert [resumed["losses"][k] for k in ("3", "4")] == pytest.approx([whole["losses"][k] for k in ("3", "4")], rel=1e-6, abs=1e-9)
    assert resumed["version"] == whole["version"] == 8 and resumed["optimizer_steps"] == whole["optimizer_steps"] == 8
    assert resumed["lr"] == pytest.approx(whole["lr"]) and whole["lr"] < 1e-3  # mid-warmup: the scheduler was restored
    assert resumed["weight_abs"] == pytest.approx(whole["weight_abs"], rel=1e-9)
    assert resumed["weight_sum"] == pytest.approx(whole["weight_sum"], rel=1e-9)
    assert whole["losses"]["3"] != pytest.approx(whole["losses"]["1"], rel=1e-3), "the weights must change for this to prove anything"


# ---- the whole path: a real learner killed and resumed, a real vLLM actor that keeps running ------------------------


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return out


def _events(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _wait(what: str, cond, procs: list[subprocess.Popen], timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        for p in procs:
            assert p.poll() is None, f"{p.args[3]} exited {p.returncode} while waiting for {what}"
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _kill_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


@pytest.mark.engine
@pytest.mark.parametrize("ranks, sig", [(1, signal.SIGKILL), (2, signal.SIGTERM)], ids=["1rank-sigkill", "2ranks-zero3-sigterm"])
def test_learner_stopped_and_resumed_while_the_actor_keeps_running(tmp_path, tiny_model_dir, ranks, sig):
    """SIGKILL (a crash) on one rank: the updates after the newest checkpoint are trained again. SIGTERM on 2 ranks
    (ZeRO-3, 2 optimizer steps per update): the learner group stops after a final checkpoint that every rank joins.
    Either way the actor keeps running, waits, and continues with the resumed weights."""
    steps, prompts, n = 8, 8, 4
    s = 1 if ranks == 1 else 2  # optimizer steps per update
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    hub = f"tcp://127.0.0.1:{free_port()}"
    overrides = [
        f"run.dir={run_dir}",
        f"model.path={tiny_model_dir}",
        f"hub.bind={hub}",
        f"train.total_steps={steps}",
        f"train.prompts_per_step={prompts}",
        f"rollout.samples_per_prompt={n}",
        "checkpoint.keep=2",
        "hub.heartbeat_s=0.5",
        f"staleness.max_staleness={s - 1}",
    ]  # k = S - 1: synchronous, so every row measures the logprob match
    if ranks == 1:
        overrides += ["train.micro_batch_samples=16", "checkpoint.every_steps=2"]
    else:  # checkpoints only at the end: the one resumed from is the one the SIGTERM made
        overrides += [
            "cluster.learner_gpus_per_node=2",
            "train.zero_stage=3",
            f"train.mini_batches={s}",
            "train.micro_batch_samples=4",
            "checkpoint.every_steps=0",
        ]
    config = run_dir / "config.toml"
    from protocol.config import dump_toml, load_config

    config.write_text(dump_toml(load_config(ROOT / "configs" / "demo.toml", overrides)))
    cli = [sys.executable, "-m", "deploy.cli"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}
    logs = run_dir / "logs"

    def start(args: list[str], name: str) -> subprocess.Popen:
        out = (tmp_path / f"{name}.out").open("w")
        return subprocess.Popen([*cli, *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    learner = start(["learner", "--config", str(config)], "learner-1")
    actor = start(["actor", "--learner", hub, "--config", str(config), "--id", "actor0"], "actor")
    procs = [learner, actor]
    try:
        # Stop the learner after step 3: with SIGKILL checkpoint step-2 is the newest and step 3 is trained again.
        _wait("3 learner steps", lambda: len(_rows(run_dir)) >= 3, procs, 300)
        _kill_group(learner, sig)
        learner.wait(timeout=60)
        _kill_group(learner, signal.SIGKILL)  # what torchrun left, if anything
        stopped_rows = _rows(run_dir)
        checkpoint = latest_checkpoint(run_dir)
        assert checkpoint is not None
        resumed_from = int(checkpoint.name[5:])
        if sig == signal.SIGTERM:  # a graceful stop saves what it trained, every rank its shard
            assert resumed_from == len(stopped_rows) >= 3
            assert sorted(p.name for p in (checkpoint / "state" / "policy").glob("zero_pp_rank_*_optim_states.pt")) == [
                "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                "zero_pp_rank_1_mp_rank_00_optim_states.pt",
            ]
        # The actor notices, keeps its engine and waits (with backoff) instead of crashing or hanging.
        _wait(
            "the actor to wait for the learner",
            lambda: any(e["event"] == "actor.waiting_for_learner" for e in _events(logs / "actor-actor0.jsonl")),
            [actor],
            60,
        )
        learner = start(["learner", "--resume", str(run_dir), f"hub.bind={hub}"], "learner-2")
        procs = [learner, actor]
        assert learner.wait(timeout=400) == 0, (tmp_path / "learner-2.out").read_text()[-4000:]
        assert actor.wait(timeout=60) == 0, (tmp_path / "actor.out").read_text()[-4000:]  # the learner's Shutdown
    finally:
        for p in procs:
            _kill_group(p, signal.SIGKILL)

    rows = _rows(run_dir)
    # One row per update, versions count optimizer steps: no gap and no repeat across the restart.
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["policy_version"] for r in rows] == [s * u for u in range(1, steps + 1)]
    assert rows[:resumed_from] == stopped_rows[:resumed_from]  # rows up to the checkpoint are kept as they were
    assert all(r["samples"] == prompts * n for r in rows)
    assert all(r["staleness_max"] == 0 for r in rows)
    # After the resume the actor generated with the resumed weights: its logprobs match the learner's.
    after = [r["logprob_mismatch"] for r in rows[resumed_from:]]
    assert None not in after and max(after) < 1e-4, after
    # The ledger: every update trained exactly `prompts` prompts, none twice, none lost; those trained before
    # the checkpoint stay trained.
    final = json.loads((run_dir / "checkpoints" / f"step-{steps}" / "state" / "learner.json").read_text())
    assert final["version"] == s * steps and final["updates"] == steps
    ledger = Ledger.from_state(final["hub"]["ledger"], max_epochs=1000)
    ledger.check()
    trained = {k for k, st in ledger.states().items() if st is State.TRAINED}
    assert len(trained) == steps * prompts and rows[-1]["ledger/trained"] == steps * prompts
    assert rows[resumed_from - 1]["ledger/trained"] == resumed_from * prompts
    # The actor's side: it saw the learner go, waited, registered again, and nothing failed.
    events = _events(logs / "actor-actor0.jsonl")
    names = [e["event"] for e in events]
    lost_at = names.index("actor.learner_lost")
    assert "actor.waiting_for_learner" in names[lost_at:] and "actor.registered" in names[lost_at:]
    # Its worker left the dead learner's weight group, so it joined the new one at once: reusing the old group
    # (the new learner numbers its epochs from 1 again) fails the sync and stalls until weights.timeout_s.
    assert "actor.weights_failed" not in names[names.index("actor.registered", lost_at) :]
    assert not any(e["event"] == "actor.task_failed" for e in events)
    learner_events = _events(logs / "learner.jsonl")
    resumed = [e for e in learner_events if e["event"] == "learner.resumed"]
    assert len(resumed) == 1 and resumed[0]["updates"] == resumed_from and resumed[0]["version"] == s * resumed_from
    # The first weights the returning actor got were the resumed ones, sent as it registered (WeightSender.start).
    assert any(e["event"] == "weights.new_group_epoch" and e["version"] == s * resumed_from for e in learner_events)
    if ranks == 2:
        rank1 = _events(logs / "learner-rank1.jsonl")
        assert [e["checkpoint"] for e in rank1 if e["event"] == "learner.resumed_engines"] == [str(checkpoint)]
