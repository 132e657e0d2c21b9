"""The row's other columns reach the actor as a bounded JSON object, in work and eval grants alike, over the real
hub and socket. The formats themselves (ORZ, verl, open-instruct, templates, dotted keys, the metadata's bound):
tests/unit/test_data_rows.py."""

import zmq

from deploy.tiny import build_tokenizer
from learner.data.prompts import PromptSet
from learner.data.rows import Row
from learner.hub.core.evaluation import EvalRound, Sampling
from learner.hub.server import Hub
from protocol import messages as m
from protocol.codec import decode, encode
from protocol.config import load_config
from protocol.net import free_port


def test_work_and_eval_grants_carry_prompt_and_metadata():
    tok = build_tokenizer()
    prompts = PromptSet([Row("1+2=", "3", '{"dataset": "gsm8k"}'), Row("2+2=", "4", '{"k": [1]}')], tok)
    assert prompts[0].metadata == '{"dataset": "gsm8k"}' and PromptSet([("1+1=", "2")], tok)[0].metadata == "{}"
    rnd = EvalRound(1, 0, {"val": prompts}, Sampling(n=1, temperature=0.0))
    grants = [g for _, g in rnd.assign(["a0"], 4, 0.0)]
    assert [(g.prompt, g.metadata, g.answer) for g in grants] == [("1+2=", '{"dataset": "gsm8k"}', "3"), ("2+2=", '{"k": [1]}', "4")]

    port = free_port()
    cfg = load_config(None, [f"hub.bind=tcp://127.0.0.1:{port}", "rollout.samples_per_prompt=2"])
    hub = Hub(cfg, prompts)
    hub.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send_multipart(encode(m.Register(actor_id="a0", host="h", pid=1, served_version=0)))
        assert sock.poll(5000) and isinstance(decode(sock.recv_multipart()), m.RegisterAck)
        sock.send_multipart(encode(m.WorkRequest(actor_id="a0", max_prompts=2)))
        got = []
        for _ in range(2):
            assert sock.poll(5000), "no grant"
            got.append(decode(sock.recv_multipart()))
        by_id = {g.prompt_id: g for g in got}
        assert by_id[0].prompt == "1+2=" and by_id[0].metadata == '{"dataset": "gsm8k"}'
        assert by_id[1].prompt == "2+2=" and by_id[1].metadata == '{"k": [1]}'
    finally:
        sock.close(linger=0)
        ctx.term()
        hub.stop()
