"""Sequence parallelism on real gloo process groups: the split row gives the unsplit row's numbers.

Each test spawns its ranks with torch.multiprocessing; a rank that finds a mismatch
raises, and spawn re-raises it here with the rank's traceback.
"""

import copy
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from protocol.net import free_port

# Packed layouts (total length, prompt length) for SP = 2, named by what they exercise.
LAYOUTS = {
    # 16 tokens, n = 8: the sample boundary is the chunk boundary
    "boundary_on_chunk_edge": [(8, 3), (8, 5)],
    # 44 tokens, n = 22: sample 2 crosses the chunk boundary
    "boundary_inside_sample": [(9, 4), (3, 2), (15, 6), (6, 5), (11, 1)],
    # 15 tokens + 1 pad, n = 8: rank 0's last logit predicts rank 1's first token (both completion tokens)
    "padded_and_predicts_across": [(10, 4), (5, 2)],
    # rank 0 scores no token; its parameters get gradient only through the ring's dK/dV
    "rank0_scores_nothing": [(12, 11), (4, 1)],
}


def _spawn(fn, world: int, *args) -> None:
    mp.spawn(fn, args=(world, free_port(), *args), nprocs=world, join=True)


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _reference_attention(q, k, v, cu_seqlens, scale):
    """Dense masked attention over the whole row: causal, and only within a packed sample. [1,H,N,D] -> [1,H,N,D]."""
    n = q.shape[2]
    segment = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1), cu_seqlens[1:] - cu_seqlens[:-1])
    index = torch.arange(n)
    allowed = (segment[:, None] == segment[None, :]) & (index[:, None] >= index[None, :])
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1) @ v


def _ring_worker(rank, world, port):
    from learner.train.attention.ring import RingContext, ring_attention

    _init(rank, world, port)
    # (lengths, 24 tokens in all, heads, kv heads): boundaries inside chunks, one sample over every chunk,
    # samples inside one chunk, 1-token samples, a sample over two chunks; GQA (groups of 2 and 4) and MHA
    cases = [([5, 7, 4, 8], 4, 2), ([24], 4, 1), ([1, 2, 3, 1, 4, 5, 2, 6], 2, 2), ([13, 3, 4, 4], 6, 3)]
    for lengths, heads, kv_heads in cases:
        gen = torch.Generator().manual_seed(sum(lengths) + heads)
        total, d = sum(lengths), 16
        n = total // world
        cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
        q, dout = (torch.randn(1, heads, total, d, generator=gen, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(1, kv_heads, total, d, generator=gen, dtype=torch.float64) for _ in range(2))
        for t in (q, k, v):
            t.requires_grad_(True)
        ref = _reference_attention(q, k, v, cu, 0.25)
        ref.backward(dout)
        mine = slice(rank * n, (rank + 1) * n)
        lq, lk, lv = (t.detach()[:, :, mine].clone().requires_grad_(True) for t in (q, k, v))
        out = ring_attention(lq, lk, lv, RingContext(group=dist.group.WORLD, cu_seqlens=cu), 0.25)  # [1, n, H, D]
        out.backward(dout[:, :, mine].transpose(1, 2))
        tol = dict(rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(out.transpose(1, 2), ref[:, :, mine].detach(), **tol)
        for name, local, full in (("dq", lq, q), ("dk", lk, k), ("dv", lv, v)):
            torch.testing.assert_close(local.grad, full.grad[:, :, mine], **tol, msg=lambda m, x=f"{name} {lengths}": f"{x}: {m}")
    dist.destroy_process_group()


def test_ring_attention_matches_dense_masked_attention():
    """3 ranks (K/V make 2 hops, dK/dV 3), fp64: outputs and dQ/dK/dV equal a dense varlen-causal reference to 1e-10."""
    _spawn(_ring_worker, 3)


def _tiny_gqa_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=40,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )  # GQA: 2 query heads per kv head, head_dim 64
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).float()


def _samples(shapes):
    from learner.train.batch import Sample

    rng = np.random.default_rng(len(shapes))
    return [
        Sample(
            tokens=rng.integers(0, 40, n).astype(np.int32),
            prompt_len=p,
            behaviour_logprobs=(-3.7 + 0.1 * rng.normal(size=n - p)).astype(np.float32),
            advantage=(-1.0) ** i * (0.5 + i),
            reward=0.0,
            version_min=0,
            version_max=0,
        )
        for i, (n, p) in enumerate(shapes)
    ]


def _loss(model, kwargs, batch, total_tokens):
    from learner.train.aggregation import Denominators
    from learner.train.batch import token_logprobs
    from learner.train.losses import make_policy_loss
    from protocol.config import AlgoConfig

    logp = token_logprobs(model(**kwargs).logits, batch, temperature=0.7)
    return logp, make_policy_loss(AlgoConfig())(logp, batch.behaviour_logp, batch.token_adv, Denominators(tokens=total_tokens)).loss


def _model_worker(rank, world, port):
    from learner.train.attention.hf import RING, VARLEN
    from learner.train.layout import micro_batch_layout
    from learner.train.packing import pack_samples
    from protocol.config import load_config

    _init(rank, world, port)
    layout = micro_batch_layout(load_config(None, [f"train.sequence_parallel_size={world}"]).train, dist.group.WORLD)
    base = _tiny_gqa_model()
    worst = [0.0]
    # the last run recomputes activations in backward: the ring's kwargs must survive the re-run forward
    runs = [(name, shapes, False) for name, shapes in LAYOUTS.items()]
    runs.append(("activation_checkpointing", LAYOUTS["boundary_inside_sample"], True))
    for name, shapes, checkpointing in runs:
        samples = _samples(shapes)
        packed = pack_samples(samples, version=0)
        total_tokens = len(packed.targets)
        ref_model, sp_model = copy.deepcopy(base), copy.deepcopy(base)
        ref_model.set_attn_implementation(VARLEN)  # no SP: the whole packed row in this process
        ref_logp, ref_loss = _loss(ref_model, packed.model_kwargs(), packed, total_tokens)
        ref_loss.backward()

        sp_model.set_attn_implementation(RING)
        if checkpointing:
            sp_model.gradient_checkpointing_enable()
            assert sp_model.training and sp_model.model.layers[0].gradient_checkpointing
        calls = []
        sp_model.model.layers[0].self_attn.register_forward_hook(lambda *_, c=calls: c.append(1))
        shard = layout(samples, 0)  # this rank's chunk of the same packed row
        logp, loss = _loss(sp_model, shard.model_kwargs(), shard, total_tokens)
        loss.backward()  # also on a rank that scores nothing: its peers' ring backward needs it
        assert len(calls) == (2 if checkpointing else 1), calls  # checkpointing did re-run the forward

        gathered: list = [None] * world
        dist.all_gather_object(gathered, (shard.tokens, logp.detach()))
        assert [t for t, _ in gathered] == [slice(0, t0 := gathered[1][0].start), slice(t0, total_tokens)]
        if name == "rank0_scores_nothing":
            assert t0 == 0
        torch.testing.assert_close(
            torch.cat([lp for _, lp in gathered]), ref_logp.detach(), rtol=0, atol=1e-5, msg=lambda m, x=name: f"{x} logprobs: {m}"
        )
        total = loss.detach().clone()
        dist.all_reduce(total)
        torch.testing.assert_close(total, ref_loss.detach(), rtol=1e-5, atol=0, msg=lambda m, x=name: f"{x} loss: {m}")
        for (pname, p), ref_p in zip(sp_model.named_parameters(), ref_model.parameters(), strict=True):
            grad = p.grad.clone()
            dist.all_reduce(grad)  # SP peers' shares add up (DeepSpeed does this sum through its mpu)
            scale = ref_p.grad.abs().max()
            assert scale > 0, pname  # every parameter is exercised, so the comparison means something
            # 1e-5 relative to the tensor's largest entry: fp32 sums in another order differ by ~1e-7 of it
            torch.testing.assert_close(
                grad, ref_p.grad, rtol=1e-5, atol=1e-5 * float(scale), msg=lambda m, x=f"{name} {pname}": f"{x}: {m}"
            )
            worst[0] = max(worst[0], float((grad - ref_p.grad).abs().max() / scale))
    print(f"rank {rank}: worst gradient error {worst[0]:.1e} of the tensor's largest entry")
    dist.destroy_process_group()


def test_sp2_loss_and_gradients_equal_unsplit_row():
    """SP = 2 on a GQA Qwen2: logprobs, loss and every parameter gradient equal the unsplit packed row's."""
    _spawn(_model_worker, 2)


def _deepspeed_worker(rank, world, port):
    import deepspeed

    from learner.train.attention.hf import RING, VARLEN
    from learner.train.packing import pack_samples
    from learner.train.sequence_parallel import init_sequence_parallel, shard_packed

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    mpu = init_sequence_parallel(world)
    packed = pack_samples(_samples(LAYOUTS["boundary_inside_sample"]), version=0)
    total_tokens = len(packed.targets)
    ref_model, sp_model = _tiny_gqa_model(), _tiny_gqa_model()
    ref_model.set_attn_implementation(VARLEN)
    _, ref_loss = _loss(ref_model, packed.model_kwargs(), packed, total_tokens)
    ref_loss.backward()
    ref_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref_model.parameters()]))

    sp_model.set_attn_implementation(RING)
    before = {n: p.detach().clone() for n, p in sp_model.named_parameters()}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2},
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    # plain SGD, lr 1: the step is exactly -grad, so a wrong reduction factor shows (Adam's first step would hide it)
    engine, *_ = deepspeed.initialize(model=sp_model, optimizer=torch.optim.SGD(sp_model.parameters(), lr=1.0), config=config, mpu=mpu)
    shard = shard_packed(packed, mpu.get_sequence_parallel_group())
    _, loss = _loss(engine, shard.model_kwargs(), shard, total_tokens)
    engine.backward(loss)
    engine.step()
    torch.testing.assert_close(float(engine.get_global_grad_norm()), float(ref_norm), rtol=1e-5, atol=0)
    for (name, p), ref_p in zip(engine.module.named_parameters(), ref_model.parameters(), strict=True):
        step = before[name] - p.detach()
        scale = float(ref_p.grad.abs().max())
        torch.testing.assert_close(step, ref_p.grad, rtol=1e-4, atol=1e-5 * scale + 2e-7, msg=lambda m, x=name: f"{x}: {m}")


def test_deepspeed_sums_sp_gradients_through_its_mpu():
    """DeepSpeed ZeRO-2 with init_sequence_parallel's mpu: one SGD step on SP = 2 equals the unsplit row's gradient."""
    _spawn(_deepspeed_worker, 2)


@pytest.mark.gpu
def test_ring_flash_attn_matches_dense_on_gpu():
    """GPU path (ring-flash-attn llama3 varlen) vs the dense reference; needs 2 GPUs, flash-attn, ring-flash-attn."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    pytest.importorskip("ring_flash_attn")
    _spawn(_gpu_ring_worker, 2)


def _gpu_ring_worker(rank, world, port):
    from learner.train.attention.ring import RingContext, ring_attention

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    lengths, heads, kv_heads, d = [300, 700, 1048], 8, 2, 64
    gen = torch.Generator().manual_seed(0)
    total, n = sum(lengths), sum(lengths) // world
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    q = torch.randn(1, heads, total, d, generator=gen)
    k, v = (torch.randn(1, kv_heads, total, d, generator=gen) for _ in range(2))
    ref = _reference_attention(q, k, v, cu, d**-0.5)
    mine = slice(rank * n, (rank + 1) * n)
    lq, lk, lv = (t[:, :, mine].cuda().bfloat16() for t in (q, k, v))
    out = ring_attention(lq, lk, lv, RingContext(group=dist.group.WORLD, cu_seqlens=cu.cuda()), d**-0.5)
    torch.testing.assert_close(out.transpose(1, 2).float().cpu(), ref[:, :, mine], rtol=2e-2, atol=2e-2)
    dist.destroy_process_group()
