"""The weight-update path, proven: after a sync the engine's logprobs equal the learner's within 3e-4 (SYNCED).

A real vLLM AsyncLLM (CPU build) serves a tiny model; the learner side perturbs its
own copy, and WeightSender broadcasts it over a real gloo weight group into the
engine's worker. The vLLM CPU build silently keeps stale packed linear weights after
a naive update (24 nats of error were measured), so this is the test that matters.
It runs once per `actor.cpu_gemm` (plain torch linear layers, and vLLM's packed ones), and once with vLLM's
worker in a process of its own (`actor.worker_in_engine = false`): the typed messages of protocol/worker_rpc.py then
cross a second hop, pickled from the engine core to the worker and back, after the msgpack hop from the actor's
process to the engine core that every engine has.
"""

import asyncio
import time

import numpy as np
import pytest
import torch
from conftest import unserved_sync

from learner.train.batch import Sample, make_micro_batch, token_logprobs
from learner.weights.sync import WeightSender
from protocol.config import load_config
from protocol.worker_rpc import GemmLayers, arrived

pytestmark = pytest.mark.engine

# The engine's logprobs and the learner's on the same weights: both fp32, summed in other orders (vLLM's CPU kernels,
# torch's). Weights perturbed by 0.3 x randn make large logits: the largest difference over a group's sampled tokens
# reached 1.3e-4 in 150 groups (2026-11-29; CI once failed a bound of 1e-4 at 1.0085e-4), and is about 5e-7 on the
# weights from disk. Stale weights are off by more than 0.01.
SYNCED = 3e-4


class DirectHub:
    """Hands WeightSync messages straight to the test instead of over ZeroMQ (the hub is tested elsewhere)."""

    def __init__(self, members):
        self.names = members
        self.sent = []

    def live_actors(self):
        return self.names

    def devices(self, members):
        return [[""] for _ in members]  # one CPU rank each

    def send_weight_sync(self, members, make):
        self.sent.extend(make(a) for a in members)

    def add_membership_listener(self, fn):
        pass  # nobody joins or dies here (tests/integration/test_weight_death.py covers that)

    def evict(self, actor_id, why):
        raise AssertionError(f"{actor_id} evicted: {why}")


def learner_logprobs(model, prompt, completion, temperature):
    s = Sample(
        tokens=np.concatenate([prompt, completion]),
        prompt_len=len(prompt),
        behaviour_logprobs=np.zeros(len(completion), np.float32),
        advantage=0.0,
        reward=0.0,
        version_min=0,
        version_max=0,
    )
    mb = make_micro_batch([s], 0)
    with torch.no_grad():
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
    return token_logprobs(logits, mb, temperature).numpy()


def max_mismatch(engine, model, prompt, temperature):
    completions = asyncio.get_event_loop().run_until_complete(engine.generate_group(prompt, 4))
    return max(float(np.abs(learner_logprobs(model, prompt, c.token_ids, temperature) - c.logprobs).max()) for c in completions)


# (actor.cpu_gemm, actor.worker_in_engine): one engine each, shared by the tests of this file.
ENGINES = [("torch", True), ("vllm", True), ("torch", False)]


@pytest.fixture(scope="module", params=ENGINES, ids=[f"{gemm}-{'in-engine' if inside else 'worker-process'}" for gemm, inside in ENGINES])
def setup(tmp_path_factory, request):
    gemm, worker_in_engine = request.param
    from transformers import AutoModelForCausalLM

    from actors.engine import Engine
    from deploy.tiny import write_tiny_model

    path = write_tiny_model(tmp_path_factory.mktemp("model"), seed=3)
    cfg = load_config(
        None,
        [
            f"model.path={path}",
            "rollout.temperature=0.7",
            "rollout.max_tokens=12",
            "actor.max_model_len=64",
            "actor.prefix_caching=on",  # its salt is proven below; a block of 32 tokens lets a test prompt fill one
            "actor.block_size=32",
            "weights.bucket_mb=1",
            f"actor.cpu_gemm={gemm}",
            f"actor.worker_in_engine={str(worker_in_engine).lower()}",
        ],
    )
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    engine = loop.run_until_complete(_make_engine(Engine, cfg))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    yield cfg, engine, model, loop
    loop.run_until_complete(_shutdown(engine))
    loop.close()


async def _shutdown(engine):
    # AsyncLLM closes its ZeroMQ sockets from tasks on this loop; shutting down outside the
    # running loop leaves one open, and the context's garbage collection then blocks forever.
    engine.shutdown()
    await asyncio.sleep(0.5)


async def _make_engine(cls, cfg):
    return cls(cfg)


def _sync(cfg, engine, sender, hub, version, loop, snapshot=None):
    sender.sync(version, hub, snapshot)  # sends WeightSync and returns; the broadcast runs in the background
    msg = hub.sent.pop()
    info, paused_s = loop.run_until_complete(engine.apply_weights(msg))
    done = sender.wait()
    assert "weights/failed" not in done and done["time/broadcast"] > 0, done
    assert not info.failed and info.recv_load_s > 0 and paused_s >= info.recv_load_s, info
    return msg, info


def test_logprobs_match_after_sync(setup):
    cfg, engine, model, loop = setup
    prompt = np.array([5, 6, 17, 7, 15], dtype=np.int32)
    # vLLM's "uni" executor calls the worker inside the engine core; "mp" runs it in a process of its own.
    assert engine.llm.vllm_config.parallel_config.distributed_executor_backend == ("uni" if cfg.actor.worker_in_engine else "mp")
    (gemm,) = [arrived(GemmLayers, g) for g in loop.run_until_complete(engine.llm.collective_rpc("fleetrl_gemm"))]
    if cfg.actor.cpu_gemm == "torch":
        assert gemm.plain > 0 and gemm.packed == 0, gemm
    else:
        assert gemm.packed > 0, gemm  # vLLM's packed copies: the path that goes stale without a repack
    assert max_mismatch(engine, model, prompt, cfg.rollout.temperature) < SYNCED  # same weights from disk

    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    stale = max_mismatch(engine, model, prompt, cfg.rollout.temperature)
    assert stale > 0.1, "the perturbation must be visible before the sync, or the test proves nothing"

    sender = WeightSender.for_params(cfg.weights, list(model.named_parameters()), "float32")
    assert len(sender.buckets) > 1  # weights.bucket_mb=1: this model spans several buckets
    hub = DirectHub(["engine"])
    msg, info = _sync(cfg, engine, sender, hub, 1, loop)
    assert msg.group_epoch == 1 and info.repacked == gemm.packed
    assert max_mismatch(engine, model, prompt, cfg.rollout.temperature) < SYNCED

    # A second sync into a new group epoch (membership changed) must work the same way.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.9)
    hub.names = ["engine-renamed"]
    # ZeRO-3's path: no parameters held here; each sync is handed a snapshot of the buckets (Trainer.snapshot).
    params = [p for _, p in model.named_parameters()]
    shards = WeightSender(cfg.weights, sender.names, sender.shapes, "float32")
    shards.store, shards.port, shards.control = (
        sender.store,
        sender.port,
        sender.control,
    )  # one learner has one rendezvous and one epoch count
    shards.epoch = sender.epoch
    snapshot = lambda out: [torch.cat([params[i].detach().reshape(-1) for i in r]) for r in shards.ranges]  # noqa: E731
    msg, _ = _sync(cfg, engine, shards, hub, 2, loop, snapshot)
    assert msg.group_epoch == 2
    assert max_mismatch(engine, model, prompt, cfg.rollout.temperature) < SYNCED
    sender.epoch = shards.epoch  # back to the first sender: the next epoch is 3 (an epoch number is never reused)

    # The learner's path: parameters as views of one flat buffer (DeepSpeed ZeRO-1/2's layout) and a
    # guarded sender, which broadcasts from that memory in place instead of copying it.
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:
        p.data = flat.narrow(0, offset, p.numel()).view(p.shape)
        offset += p.numel()
    assert all(sender.buckets.live(i) is not None for i in range(len(sender.buckets)))
    opt = torch.optim.SGD(params, lr=0.05)
    sender.guard(opt)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert max_mismatch(engine, model, prompt, cfg.rollout.temperature) > 0.01, "the step must be visible before the sync"
    _sync(cfg, engine, sender, hub, 3, loop)
    assert max_mismatch(engine, model, prompt, cfg.rollout.temperature) < SYNCED


def test_completion_text_is_what_vllm_would_detokenize(setup):
    """generate_group asks vLLM for no text (detokenize=False) and decodes once itself: the reward sees the same text."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    cfg, engine, _, loop = setup
    prompt = np.array([5, 6, 17, 7, 15], dtype=np.int32)

    async def vllm_texts():
        params = SamplingParams(
            n=6,
            temperature=cfg.rollout.temperature,
            max_tokens=cfg.rollout.max_tokens,
            seed=11,
            output_kind=RequestOutputKind.FINAL_ONLY,
            skip_special_tokens=True,
        )
        async for out in engine.llm.generate(TokensPrompt(prompt_token_ids=prompt.tolist()), params, request_id="detok-check"):
            final = out
        return [(list(c.token_ids), c.text) for c in final.outputs]

    ours = loop.run_until_complete(engine.generate_group(prompt, 6, seed=11))
    theirs = loop.run_until_complete(vllm_texts())
    assert [c.token_ids.tolist() for c in ours] == [ids for ids, _ in theirs]  # same seed, same samples
    assert [c.text for c in ours] == [text for _, text in theirs]
    assert any(c.text for c in ours) and all(len(c.logprobs) == len(c.token_ids) for c in ours)


def test_the_prefix_cache_never_outlives_a_sync(setup):
    """With prefix caching a group's completions share their prompt's KV blocks, and a later request for the same
    prompt reuses them. Computed under older weights they would be stale: each request is salted with the weights
    it starts under (Engine.cache_salt). Shown both ways: salted, the logprobs match the learner's after a sync;
    with one salt for all, the cached blocks of the old weights make them wrong."""
    cfg, engine, model, loop = setup
    assert engine.prefix_caching
    prompt = np.array([(5 * i + 3) % 19 + 1 for i in range(40)], dtype=np.int32)  # a 32-token block, and more
    temperature = cfg.rollout.temperature
    assert max_mismatch(engine, model, prompt, temperature) < SYNCED  # in sync with the learner's copy; now cached
    sender = WeightSender.for_params(cfg.weights, list(model.named_parameters()), "float32")
    hub = DirectHub(["engine-cache"])

    def perturb(seed):
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.3 * torch.randn_like(p))

    perturb(1)
    _sync(cfg, engine, sender, hub, 10, loop)
    assert max_mismatch(engine, model, prompt, temperature) < SYNCED  # the cached blocks of the old weights are not hit

    engine.cache_salt = lambda: "one salt for all weights"  # what an unsalted prefix cache does
    try:
        assert max_mismatch(engine, model, prompt, temperature) < SYNCED  # cached under this salt, with these weights
        perturb(2)
        _sync(cfg, engine, sender, hub, 11, loop)
        stale = max_mismatch(engine, model, prompt, temperature)
    finally:
        del engine.cache_salt
    assert stale > 0.01, f"the cache was not hit ({stale}): this test would prove nothing"
    assert max_mismatch(engine, model, prompt, temperature) < SYNCED  # salted again: computed afresh


def test_a_stop_during_a_sync_does_not_wait_for_the_receive(setup):
    """An actor's stop cancels its sync, and its workers may still be in the receive (the learner was signalled
    too: a Slurm preemption signals every process). The cancel ends at once. A resume of the paused engine would
    wait behind the receive (the engine core answers one RPC at a time): the stop used to wait there, past its grace
    (actor.stop_overdue in CI's Slurm preemption test)."""
    from protocol import weights as wg
    from protocol.abortable import joined_key

    cfg, engine, _, loop = setup
    if cfg.actor.cpu_gemm != "torch":
        pytest.skip("once per executor (in the engine core, in a worker process): the gemm changes nothing here")
    receive_s = 8.0  # the receive's own timeout: the worker gives up on rank 0 then
    store = wg.open_store("127.0.0.1", 0, is_master=True, timeout_s=60)  # the group's rendezvous; rank 0 never comes
    sync = unserved_sync(store.port, timeout_s=receive_s)

    async def stop_during_the_receive() -> tuple[float, float]:
        task = asyncio.ensure_future(engine.apply_weights(sync))
        t_start = time.monotonic()
        while not store.check([joined_key(1, 1)]):  # the worker is in the receive, waiting for rank 0
            assert not task.done() and time.monotonic() - t_start < receive_s / 2, "the worker did not join in time"
            await asyncio.sleep(0.02)
        t0 = time.monotonic()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        cancel_s = time.monotonic() - t0
        await engine.llm.resume_generation()  # what the stop used to wait for; it leaves the engine as it was
        return cancel_s, time.monotonic() - t0

    cancel_s, resume_s = loop.run_until_complete(stop_during_the_receive())
    assert cancel_s < 2.0, cancel_s  # it was the rest of the receive (over receive_s / 2)
    assert resume_s > receive_s / 2, f"the resume did not wait for the receive ({resume_s:.2f} s): this test proves nothing"
    completions = loop.run_until_complete(engine.generate_group(np.array([5, 6, 17], dtype=np.int32), 2))
    assert len(completions) == 2 and all(len(c.token_ids) for c in completions)  # the engine serves again
