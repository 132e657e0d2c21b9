"""Evaluation by the actors, over the real hub thread and sockets: eval grants are answered, their results
reach the eval metrics and never the training buffer or the ledger, admission control ignores them,
and an actor dying mid-round does not lose the round."""

import math
import time

import numpy as np
import zmq
from conftest import rollout_group
from scripted_actor import ScriptedActor
from structlog.testing import capture_logs

from deploy.tiny import build_tokenizer
from learner.data.prompts import PromptSet, load_datasets
from learner.evaluator import Evaluator
from learner.hub.core.evaluation import EvalRound, Sampling
from learner.hub.server import Hub
from protocol import messages as m
from protocol.codec import decode, encode
from protocol.config import load_config
from protocol.net import free_port

TEST_ITEMS = [(f"{a}*{a}=", str(a * a)) for a in range(6)]


def even_prompts_right(split: str, prompt_id: int) -> float:
    return float(prompt_id % 2 == 0)


def setup(overrides, with_test=False):
    port = free_port()
    cfg = load_config(None, [f"hub.bind=tcp://127.0.0.1:{port}", *overrides])
    tok = build_tokenizer()
    data = load_datasets(cfg, tok)
    sets = data.eval_sets()
    if with_test:
        sets["test"] = PromptSet(TEST_ITEMS, tok)
    hub = Hub(cfg, data.train)
    hub.start()
    return cfg, data, sets, hub, f"tcp://127.0.0.1:{port}"


def recv(sock, timeout_ms=2000):
    return decode(sock.recv_multipart()) if sock.poll(timeout_ms) else None


def recv_all(sock, quiet_ms=300):
    out = []
    while (msg := recv(sock, quiet_ms)) is not None:
        out.append(msg)
    return out


def answer(grant, version, reward, actor="a0", errors=0):
    return encode(
        m.EvalResult(
            actor_id=actor,
            eval_round=grant.eval_round,
            split=grant.split,
            prompt_id=grant.prompt_id,
            lengths=np.full(grant.n, 1, np.int32),
            rewards=np.full(grant.n, reward, np.float32),
            finish_reasons=["stop"] * grant.n,
            version_min=version,
            version_max=version,
            gen_s=0.1,
            reward_errors=errors,
        )
    )


def test_eval_is_outside_admission_and_the_ledger():
    """One raw DEALER plays the actor, so every message the hub sends is seen and counted."""
    cfg, data, sets, hub, addr = setup(
        [
            "staleness.max_staleness=1",
            "train.prompts_per_step=4",
            "rollout.samples_per_prompt=2",
            "actor.max_groups=8",
            "data.val_fraction=0.1",
            "eval.every_steps=1",
        ]
    )
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(addr)
    try:
        sock.send_multipart(encode(m.Register(actor_id="a0", host="h", pid=1, served_version=0)))
        assert isinstance(recv(sock), m.RegisterAck)
        rnd = EvalRound(1, 0, sets, Sampling.from_config(cfg), lease_s=60.0)
        hub.start_eval(rnd)
        evals = recv_all(sock)
        assert len(evals) == 8 and all(isinstance(g, m.EvalGrant) for g in evals)  # up to actor.max_groups held
        # 8 eval prompts held, and training admission still grants its full (k + 1) x prompts_per_step.
        sock.send_multipart(encode(m.WorkRequest(actor_id="a0", max_prompts=100)))
        work = recv_all(sock)
        assert len(work) == 8 and all(isinstance(g, m.WorkGrant) for g in work)
        val_texts = {p.text for p in data.val.items}
        assert not val_texts & {data.train[g.prompt_id].text for g in work}  # training grants never hold val prompts
        g0 = evals[0]
        assert (g0.split, g0.policy_version, g0.n, g0.temperature) == ("val", 0, 1, 0.0)  # greedy: one sample, T = 0
        assert np.array_equal(g0.prompt_tokens, data.val[g0.prompt_id].tokens) and g0.answer == data.val[g0.prompt_id].answer

        # A training group still lands in the buffer and the ledger as before.
        w = work[0]
        sock.send_multipart(encode(rollout_group(n=2, actor="a0", prompt_id=w.prompt_id, epoch=w.epoch, prompt_tokens=w.prompt_tokens)))
        # A result from the wrong version is rejected and its prompt granted again.
        sock.send_multipart(answer(g0, version=3, reward=1.0))
        reply = recv(sock)
        assert isinstance(reply, m.Error) and reply.code == "rejected" and "round 1 evaluates 0" in reply.detail
        again = recv(sock)
        assert isinstance(again, m.EvalGrant) and again.prompt_id == g0.prompt_id
        pending = [again, *evals[1:]]
        answered = 0
        while pending:
            g = pending.pop()
            right = even_prompts_right(g.split, g.prompt_id)  # the wrong ones' reward raised: counted as errors
            sock.send_multipart(answer(g, version=0, reward=right, errors=int(right == 0.0)))
            answered += 1
            pending += [x for x in recv_all(sock, 100) if isinstance(x, m.EvalGrant)]  # the last two prompts
        sock.send_multipart(answer(g0, version=0, reward=0.0))  # a duplicate: first result wins
        deadline = time.monotonic() + 5
        while not rnd.done and time.monotonic() < deadline:
            time.sleep(0.01)
        assert hub.wait_eval(5.0) is rnd and hub.eval_round is None
        out = rnd.metrics()
        assert answered == 10 == out["eval/val/prompts"] and out["eval/val/reward_mean"] == 0.5
        assert out["eval/val/reward_errors"] == 5  # the half scored 0, each with its reward's error
        assert out["eval/partial"] == 0 and out["eval/rejected"] == 1 and out["eval/policy_version"] == 0
        assert out["eval/duplicates"] <= 1 and out["eval/regranted_dead"] == 0  # the duplicate may arrive after the close
        sock.send_multipart(answer(g0, version=0, reward=1.0))  # after the round: counted, ignored
        assert recv(sock, 300) is None

        snap = hub.snapshot()
        assert snap["hub/granted"] == 8 and snap["hub/eval_granted"] == 11  # 8 + 1 re-grant + the last 2
        assert snap["ledger/received"] == 1 and snap["ledger/granted"] == 7 and snap["hub/buffered"] == 1
        assert "ledger/duplicates" not in snap  # no eval result ever reached the ledger
        assert snap["hub/eval_late"] + out["eval/duplicates"] == 2
        assert len(hub.ledger.entries) == len(data.train)  # one epoch of training prompts, no eval entries
    finally:
        sock.close(linger=0)
        ctx.term()
        hub.stop()


def test_actor_dying_mid_eval_does_not_lose_the_round():
    cfg, data, sets, hub, addr = setup(
        [
            "staleness.max_staleness=1",
            "train.prompts_per_step=4",
            "rollout.samples_per_prompt=2",
            "actor.max_groups=4",
            "data.val_fraction=0.2",
            "eval.every_steps=2",
            "hub.actor_timeout_s=1.0",
            "staleness.lease_s=60",
            "eval.timeout_s=30",
        ],
        with_test=True,
    )
    evaluator = Evaluator(cfg, sets, hub)
    steady = ScriptedActor(addr, "steady", 2, 0.02, seed=0, heartbeat_s=0.2, eval_reward=even_prompts_right).start()
    doomed = ScriptedActor(addr, "doomed", 2, 0.02, seed=1, heartbeat_s=0.2, die_on_eval=True).start()
    rows = {}
    try:
        for version in range(1, 5):
            batch = hub.take_batch(4, timeout_s=30)
            hub.finish_update(version, [item.key for item in batch])
            for a in (steady, doomed):
                a.target_version = version
            rows[version] = evaluator.run(version, last=version == 4)
        snap = hub.snapshot()
    finally:
        hub.stop()
        steady.stop.set()
    assert rows[1] == {} and rows[3] == {}
    dead_round, alone_round = rows[2], rows[4]
    assert doomed.eval_grants and doomed.eval_answered == 0  # it died holding eval prompts (actor.max_groups of them)
    assert dead_round["eval/regranted_dead"] == 4 and alone_round["eval/regranted_dead"] == 0
    for version, out in ((2, dead_round), (4, alone_round)):
        assert out["eval/policy_version"] == version and out["eval/partial"] == 0
        assert out["eval/val/prompts"] == 20 and out["eval/val/reward_mean"] == 0.5
        assert out["eval/test/prompts"] == 6 and out["eval/test/reward_mean"] == 0.5
    assert snap["ledger/trained"] == 16 and snap["hub/actors"] == 1 and snap["hub/actors_lost"] == 1
    # The survivor did every prompt of both rounds: its own share and the dead actor's.
    assert [sum(g.policy_version == v for g in steady.eval_grants) for v in (2, 4)] == [26, 26]
    assert {g.policy_version for g in doomed.eval_grants} == {2}
    hub.ledger.check()


def test_round_times_out_with_a_logged_partial_result():
    cfg, data, sets, hub, addr = setup(
        [
            "data.val_fraction=0.1",
            "eval.every_steps=1",
            "eval.timeout_s=2.5",
            "hub.actor_timeout_s=1.0",
            "eval.greedy=false",
            "eval.samples=3",
            "rollout.samples_per_prompt=8",  # its training groups must pass the hub's checks, or it is quarantined first
        ]
    )
    evaluator = Evaluator(cfg, sets, hub)
    doomed = ScriptedActor(addr, "doomed", 8, 0.0, seed=1, heartbeat_s=0.2, die_on_eval=True).start()
    try:
        deadline = time.monotonic() + 10
        while not hub.live_actors() and time.monotonic() < deadline:
            time.sleep(0.01)
        t0 = time.monotonic()
        with capture_logs() as logs:
            out = evaluator.run(0)
        waited = time.monotonic() - t0
        stopped = evaluator.run(0, should_stop=lambda: True)  # SIGTERM: no waiting
    finally:
        hub.stop()
    assert 2.4 <= waited < 6
    assert doomed.eval_grants and all((g.n, g.temperature) == (3, 1.0) for g in doomed.eval_grants)  # sampled eval
    assert out["eval/partial"] == 1 and out["eval/val/prompts"] == 0 and math.isnan(out["eval/val/reward_mean"])
    assert out["eval/regranted_dead"] == 8  # all it held (actor.max_groups), then nobody was left to take them
    assert stopped["eval/partial"] == 1 and stopped["time/eval"] < 1.0
    partial = [e for e in logs if e["event"] == "eval.round_partial"]
    assert partial and partial[0]["answered"] == 0 and partial[0]["total"] == 10
