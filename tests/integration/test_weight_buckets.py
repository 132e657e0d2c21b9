"""Rank 0's side of the weight broadcast: live buckets over the parameters' own memory, copies, and the guard.

The guard test runs a real gloo weight group (the learner's WeightSender and one receiver
thread that joins it as an actor's worker would) and proves that an optimizer step taken
while the broadcast is still in flight cannot leak into the weights the receiver gets.
"""

import threading
import time

import pytest
import torch

from actors.weight_receiver import WeightReceiver
from learner.weights.buckets import Buckets
from learner.weights.sync import WeightSender
from protocol.config import WeightsConfig

SHAPES = [[64, 32], [32], [128, 64], [7], [256, 256]]


def flat_params(shapes, dtype=torch.float32, seed=0):
    """Parameters as DeepSpeed ZeRO-1/2 keeps them: views into one flat buffer, in order."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:
        p.data = flat.narrow(0, offset, p.numel()).view(p.shape)  # what ZeRO's _update_model_bit16_weights does
        offset += p.numel()
    return params


def expected(params, buckets, dtype):
    return [torch.cat([params[j].detach().reshape(-1).to(dtype) for j in r]) for r in buckets.ranges]


def test_live_buckets_alias_the_flat_parameters():
    params = flat_params(SHAPES)
    b = Buckets(params, torch.float32, bucket_bytes=64 << 10)
    assert len(b) >= 2
    for i, r in enumerate(b.ranges):
        live = b.live(i)
        assert live is not None and live.data_ptr() == params[r[0]].data_ptr()  # no copy: the parameters' memory
        assert torch.equal(live, expected(params, b, torch.float32)[i])
    with torch.no_grad():
        params[0].add_(1.0)
    assert torch.equal(b.live(0)[:10], params[0].reshape(-1)[:10])  # it is the memory, not a snapshot of it


def test_live_is_rechecked_when_a_parameter_moves():
    params = flat_params(SHAPES)
    b = Buckets(params, torch.float32, bucket_bytes=1 << 30)  # one bucket
    assert b.live(0) is not None
    params[1].data = params[1].detach().clone()  # no longer back to back with its neighbours
    assert b.live(0) is None
    assert torch.equal(b.copy(0), expected(params, b, torch.float32)[0])


@pytest.mark.parametrize("layout", ["flat", "separate"])
@pytest.mark.parametrize(
    "param_dtype, wire_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]
)
def test_copies_equal_the_concatenated_parameters(layout, param_dtype, wire_dtype):
    params = flat_params(SHAPES, param_dtype) if layout == "flat" else [torch.randn(s).to(param_dtype) for s in SHAPES]
    b = Buckets(params, wire_dtype, bucket_bytes=64 << 10)
    assert (b.live(0) is not None) == (layout == "flat" and param_dtype == wire_dtype)
    first = b.snapshot()
    for got, want in zip(first, expected(params, b, wire_dtype), strict=True):
        assert got.dtype == wire_dtype and torch.equal(got, want)
    with torch.no_grad():
        for p in params:
            p.mul_(2)
    second = b.snapshot()
    assert [t.data_ptr() for t in second] == [t.data_ptr() for t in first]  # buffers reused across syncs
    for got, want in zip(second, expected(params, b, wire_dtype), strict=True):
        assert torch.equal(got, want)


class ThreadHub:
    """Hands WeightSync messages to a receiver thread instead of over ZeroMQ (the hub is tested elsewhere)."""

    def __init__(self):
        self.sent = []

    def live_actors(self):
        return ["receiver"]

    def devices(self, members):
        return [[""] for _ in members]  # one CPU rank each

    def send_weight_sync(self, members, make):
        self.sent.extend(make(a) for a in members)

    def add_membership_listener(self, fn):
        pass  # the receiver neither joins late nor dies here

    def evict(self, actor_id, why):
        raise AssertionError(f"{actor_id} evicted: {why}")


def receive(msg, go, out, delay_s=0.0):
    """The actor worker's side (actors/weight_receiver.py, as in the vLLM worker): join, land each bucket, keep a copy."""
    go.wait(30)  # joins only once the learner's optimizer step has begun: the broadcast is surely still in flight
    time.sleep(delay_s)  # a slow receiver: an unguarded step would have written the parameters by now
    result = WeightReceiver().receive(msg, msg.rank, lambda pairs: out.update({name: t.clone() for name, t in pairs}))
    assert not result.failed, result


@pytest.mark.parametrize("guarded", [True, False])
def test_a_step_during_the_broadcast_never_reaches_the_receiver(guarded):
    params = flat_params([[256, 256]] * 8)
    before = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=1.0)
    go = threading.Event()
    opt.register_step_pre_hook(lambda *_: go.set())  # runs before the guard's hook (registration order)
    sender = WeightSender.for_params(WeightsConfig(bucket_mb=1, timeout_s=60), [(f"p{i}", p) for i, p in enumerate(params)], "float32")
    if guarded:
        sender.guard(opt)
    hub, got = ThreadHub(), {}
    copies = []
    snapshot = sender.buckets.snapshot
    sender.buckets.snapshot = lambda *a, **kw: copies.append(1) or snapshot(*a, **kw)  # type: ignore[method-assign]
    sender.sync(1, hub)
    receiver = threading.Thread(target=receive, args=(hub.sent.pop(), go, got))
    receiver.start()
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()  # version 2 is written while version 1 is still being sent
    receiver.join()
    report = sender.wait()
    assert "weights/failed" not in report and report["time/broadcast"] > 0, report
    for i, p in enumerate(before):
        assert torch.equal(got[f"p{i}"], p), f"p{i}: the receiver got weights the optimizer wrote after the sync"
    assert torch.equal(params[0].detach(), before[0] - 1.0)  # the step did happen
    if guarded:
        assert report["time/weight_guard_wait"] > 0  # the step waited for the whole receive
        assert copies == []  # and sync itself copied nothing (it broadcasts the parameters' own memory)
    else:
        assert copies  # unguarded, sync sends a copy


def test_deepspeed_zero2_guarded_sync(tiny_model_dir):
    """The guarded sync against the real DeepSpeed engine the learner uses: ZeRO-2 keeps the parameters
    back to back in one buffer (so no bucket is copied), and a step taken while the broadcast is in
    flight waits for it (the hook sits on the torch optimizer inside, before ZeRO writes the parameters)."""
    from transformers import AutoModelForCausalLM

    from learner.train.distributed import init_distributed, make_topology
    from learner.train.engines import UpdateLayout
    from learner.train.trainer import Trainer
    from protocol.config import load_config

    cfg = load_config(None, [f"model.path={tiny_model_dir}", "train.zero_stage=2", "train.micro_batch_samples=64", "weights.bucket_mb=1"])
    init_distributed()
    layout = UpdateLayout(mini_batches=1, ppo_epochs=1, micro_samples=64, accumulation=2, run_steps=100)
    trainer = Trainer(cfg, AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32), make_topology(1), layout)
    named = list(trainer.engine.module.named_parameters())
    sender = WeightSender.for_params(cfg.weights, named, "float32")
    assert len(sender.buckets) > 1 and all(sender.buckets.live(i) is not None for i in range(len(sender.buckets)))
    sender.guard(trainer.engine.optimizer)
    engine, ids = trainer.engine, torch.randint(0, 10, (2, 8))

    def step():
        for _ in range(layout.accumulation):
            engine.backward(engine(input_ids=ids).logits.float().pow(2).mean())
            engine.step()

    step()
    step()  # every step moves the weights: the warmup's first runs at lr / warmup_steps, not 0
    go = threading.Event()
    inner = engine.optimizer.optimizer  # the torch optimizer inside ZeRO, where the guard hooks in
    inner._optimizer_step_pre_hooks.move_to_end(inner.register_step_pre_hook(lambda *_: go.set()).id, last=False)
    before = {n: p.detach().clone() for n, p in named}
    hub, got = ThreadHub(), {}
    sender.sync(1, hub)
    receiver = threading.Thread(target=receive, args=(hub.sent.pop(), go, got, 0.5))
    receiver.start()
    step()
    receiver.join()
    report = sender.wait()
    assert report["time/weight_guard_wait"] > 0, report  # the step waited for the broadcast
    assert all(torch.equal(got[n], before[n]) for n in before)  # which carried the weights of version 1 only
    assert not torch.equal(named[0][1].detach(), before[named[0][0]])  # and then the step wrote version 2
    assert sender.buckets.live(0).data_ptr() == named[0][1].data_ptr()  # into the same memory
