"""The weight path on one GPU: an NCCL weight group of world size 1, and the shared-GPU fallback into a CUDA engine.

NCCL will not put two ranks on one GPU, so a one-GPU machine cannot run a learner and an actor in one
NCCL group: what runs here is everything else of that path. The learner's buckets on the GPU (live
views and copies, dtype conversion) broadcast through a real NCCL group of world size 1 (the learner
alone), and a receive into a CUDA landing buffer through the same group. The `vllm` test is the one-GPU
deployment itself: learner and engine on the same GPU, where the learner must pick gloo through pinned
host memory and the engine's worker load it into its CUDA parameters, proven by matching logprobs.
"""

import asyncio

import numpy as np
import pytest
import torch

from learner.weights.buckets import Buckets
from protocol import weights as wg
from protocol.abortable import Abortable, Graveyard

pytestmark = pytest.mark.gpu


def _cuda_params(shapes, flat: bool) -> list[torch.Tensor]:
    """Parameters on the GPU: separate tensors, or views of one buffer (DeepSpeed ZeRO-1/2's layout)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    if not flat:
        return [torch.randn(s, device=dev) for s in shapes]
    buf = torch.randn(sum(int(np.prod(s)) for s in shapes), device=dev)
    out, at = [], 0
    for s in shapes:
        n = int(np.prod(s))
        out.append(buf[at : at + n].view(s))
        at += n
    return out


@pytest.fixture
def nccl_world_one():
    """An NCCL weight group of world size 1 (the learner alone), aborted at the end whatever the test did: a later
    test must not meet a communicator this one left wedged."""
    store = wg.open_store("127.0.0.1", 0, is_master=True, timeout_s=60)
    local = wg.local_device()
    group = wg.open_group(store, "127.0.0.1", 1, 0, 1, 60, "nccl", wg.group_device("nccl", local))
    try:
        yield group
    finally:
        wg.close_group(group, "nccl")


@pytest.mark.parametrize("flat, wire", [(True, torch.float32), (False, torch.float32), (True, torch.bfloat16)])
def test_nccl_world_one_sends_buckets_from_gpu_memory(flat, wire, nccl_world_one):
    shapes = [[256, 256], [256], [1024, 64], [7]]
    params = _cuda_params(shapes, flat)
    # Sized in the wire dtype (bf16 halves the bytes): half the weights per bucket, so always more than one.
    wire_bytes = sum(int(np.prod(s)) for s in shapes) * torch.tensor([], dtype=wire).element_size()
    b = Buckets(params, wire, bucket_bytes=wire_bytes // 2)
    assert len(b) > 1
    waits = Abortable(should_abort=lambda: None, timeout_s=60, graveyard=Graveyard())
    sent = []
    with waits.pipeline() as pipe:  # as the serving thread sends: two in flight, each ended by a CUDA event
        for i in range(len(b)):
            live = b.live(i)
            src = live if live is not None else b.copy(i)
            assert src.is_cuda and src.dtype == wire  # no trip through the host
            if flat and wire == torch.float32:
                assert live is not None and live.data_ptr() == params[b.ranges[i][0]].data_ptr()  # sent in place
            pipe.room()
            pipe.start(nccl_world_one, src)
            sent.append(src)
    for i, flat_sent in enumerate(sent):
        want = torch.cat([params[j].reshape(-1).to(wire) for j in b.ranges[i]])
        assert torch.equal(flat_sent, want)


def test_receive_buckets_land_in_a_cuda_buffer_with_names_and_dtypes(nccl_world_one):
    names = ["embed.weight", "layers.0.w", "layers.0.b", "head.weight"]
    shapes = [[128, 64], [64, 64], [64], [128, 64]]
    group = nccl_world_one
    local = wg.local_device()
    buf = wg.landing_buffer(wg.landing_numel(shapes, torch.bfloat16, 40 << 10), torch.bfloat16, "nccl", local)
    assert buf.device == local and not buf.is_pinned()
    waits = Abortable(should_abort=lambda: None, timeout_s=60, graveyard=Graveyard())
    seen = []
    for pairs in wg.receive_buckets(group, names, shapes, torch.bfloat16, 40 << 10, buf, waits=waits, backend="nccl", local=local):
        for name, t in pairs:
            assert t.device == local and t.dtype == torch.bfloat16
            assert t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()  # a view of the one landing buffer
            seen.append((name, list(t.shape)))
    assert seen == list(zip(names, shapes, strict=True))


def test_device_identity_and_the_shared_gpu_plan():
    local = wg.local_device()
    me = wg.device_identity(local)
    assert me.startswith("cuda:") and len(me) > len("cuda:")
    assert wg.plan_group(me, [("engine", [me])]).backend == "gloo"  # one GPU: the fallback
    pinned = wg.landing_buffer(16, torch.float32, "gloo", local)
    assert pinned.device.type == "cpu" and pinned.is_pinned()


@pytest.mark.vllm
def test_one_gpu_learner_and_engine_sync_through_pinned_host_memory(tmp_path):
    """Learner and CUDA vLLM engine on the same GPU: the sender picks gloo (the engine registered this GPU),
    stages its GPU buckets in pinned memory, and the worker's load_weights writes its CUDA parameters in place
    (CUDA graphs on): afterwards the engine's logprobs are the learner's. fp32 on both sides; the tolerance
    allows for different attention kernels on the GPU."""
    from transformers import AutoModelForCausalLM

    from actors.engine import Engine
    from deploy.tiny import write_tiny_model
    from learner.weights.sync import WeightSender
    from protocol.config import load_config

    path = write_tiny_model(tmp_path / "model", seed=3)
    cfg = load_config(
        None,
        [
            f"model.path={path}",
            "actor.device=cuda",
            "actor.gpu_memory_utilization=0.3",
            "rollout.temperature=0.7",
            "rollout.max_tokens=12",
            "actor.max_model_len=32",
            "weights.bucket_mb=1",
        ],
    )
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)

    async def make():
        return Engine(cfg)

    engine = loop.run_until_complete(make())
    try:
        devices = loop.run_until_complete(engine.devices())
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # CPU: the logprobs to match
        prompt = np.array([5, 6, 17, 7, 15], dtype=np.int32)

        def mismatch() -> float:
            """The largest gap between the engine's sampled-token logprobs and the reference's, after temperature."""
            worst = 0.0
            for c in loop.run_until_complete(engine.generate_group(prompt, 4)):
                ids = torch.as_tensor(np.concatenate([prompt, c.token_ids]), dtype=torch.long)[None]
                with torch.no_grad():
                    logits = reference(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / cfg.rollout.temperature
                ours = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])[:, 0].numpy()
                worst = max(worst, float(np.abs(ours - c.logprobs).max()))
            return worst

        torch.manual_seed(0)
        with torch.no_grad():
            for p in reference.parameters():
                p.add_(0.3 * torch.randn_like(p))
        assert mismatch() > 0.1, "the perturbation must be visible before the sync"
        learner = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(wg.local_device())
        learner.load_state_dict(reference.state_dict())
        sender = WeightSender.for_params(cfg.weights, list(learner.named_parameters()), "float32")
        assert devices == [sender.identity]  # the engine's one worker is on the learner's GPU

        from tests.fake_hub import RecordingHub

        hub = RecordingHub({"engine": devices})
        sender.sync(1, hub)
        (msg,) = hub.sent
        assert msg.backend == "gloo" and (msg.rank, msg.ranks, msg.world_size) == (1, 1, 2)
        info, _ = loop.run_until_complete(engine.apply_weights(msg))
        done = sender.close()
        assert not info.failed and "weights/failed" not in done, (info, done)
        assert mismatch() < 2e-3
    finally:
        engine.shutdown()
        loop.run_until_complete(asyncio.sleep(0.5))
        loop.close()


def test_one_gpu_member_lands_in_cuda_through_pinned_host_memory():
    """The one-GPU fallback without vLLM: the learner's CUDA parameters and a member on the same GPU. The learner picks
    gloo, stages each GPU bucket in pinned host memory; the member (actors/weight_receiver.py, as the vLLM worker runs
    it) receives into its pinned landing buffer and copies each bucket into CUDA tensors. The copies are
    non_blocking, as a loader may make them: the next bucket must not land in pinned memory a copy still reads."""
    import threading

    from actors.weight_receiver import WeightReceiver
    from learner.weights.sync import WeightSender
    from protocol.config import WeightsConfig
    from tests.fake_hub import RecordingHub

    local = wg.local_device()
    shapes = [[1 << 20], *[[1 << 18]] * 8]  # a 4 MiB bucket, then eight of 1 MiB: several side by side in the ring
    params = [torch.full(s, float(k + 1), device=local) for k, s in enumerate(shapes)]
    names = [f"p{k}" for k in range(len(shapes))]
    sender = WeightSender.for_params(WeightsConfig(bucket_mb=1, timeout_s=60), list(zip(names, params, strict=True)), "float32")
    hub = RecordingHub({"member": [sender.identity]})  # registered the learner's own GPU
    sender.sync(1, hub)
    (msg,) = hub.sent
    assert msg.backend == "gloo" and sender.plan is not None and "share GPU" in sender.plan.fallback
    receiver = WeightReceiver(local=local)
    engine = {n: torch.zeros(s, device=local) for n, s in zip(names, shapes, strict=True)}  # the engine's parameters
    out: list = []

    def load(pairs):
        for name, t in pairs:
            assert t.device.type == "cpu" and t.is_pinned()
            engine[name].copy_(t, non_blocking=True)

    thread = threading.Thread(target=lambda: out.append(receiver.receive(msg, msg.rank, load)))
    try:
        thread.start()
        thread.join(120)
        assert not thread.is_alive(), "the receive did not end"
        report = sender.close()
    finally:
        receiver.leave(drop_store=True)
    (result,) = out
    assert not result.failed and "weights/failed" not in report, (result, report)
    torch.cuda.synchronize(local)
    for name, p in zip(names, params, strict=True):
        assert torch.equal(engine[name], p), name


@pytest.mark.parametrize("to_host", [False, True])
def test_staging_crosses_the_bus_in_one_reused_buffer(to_host):
    """A host snapshot bucket (weights.snapshot = host) reaches an NCCL group as a GPU copy; a GPU bucket reaches a
    gloo group (the shared-GPU fallback) as a pinned host copy. One buffer serves every bucket."""
    from learner.weights.buckets import Staging

    cuda = torch.device("cuda", torch.cuda.current_device())
    src_dev, dst_dev = (cuda, torch.device("cpu")) if to_host else (torch.device("cpu"), cuda)
    staging, drained = Staging(capacity=1000), []
    a = torch.randn(1000, device=src_dev)
    b = torch.randn(600, device=src_dev)
    out_a = staging.to(dst_dev, a, lambda: drained.append("a"))
    assert out_a.device == dst_dev and torch.equal(out_a.cpu(), a.cpu())
    assert out_a.is_pinned() == to_host
    ptr = out_a.data_ptr()
    out_b = staging.to(dst_dev, b, lambda: drained.append("b"))
    assert out_b.data_ptr() == ptr and torch.equal(out_b.cpu(), b.cpu())  # reused, smaller bucket
    assert drained == ["b"]  # it lands on a's elements: a's broadcast had to end first
    same = torch.randn(10, device=dst_dev)
    assert staging.to(dst_dev, same, lambda: drained.append("same")) is same  # where the group sends from: no copy
