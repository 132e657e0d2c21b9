"""Attention on one CUDA GPU without flash-attn: every kernel against float64 references, and never cuDNN.

bf16 inputs at Qwen2.5-0.5B head shapes (14 query heads, 2 KV heads, head_dim 64), samples of 1 to 700
tokens. The references compute from the same bf16 values, upcast, so what differs is the kernels'
own rounding: outputs within 1% and gradients within 2% in relative norm, where a wrong mask, a
wrong GQA head or a wrong lse layout is off by order one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

import learner.train.attention.varlen as va
from learner.train.attention.ring import FlashBlocks, MatmulBlocks, RingContext, _rects, ring_attention
from tests.unit.test_packing import make_samples, tiny_qwen2

pytestmark = pytest.mark.gpu
HEADS, KV_HEADS, DIM = 14, 2, 64
SCALE = DIM**-0.5
LENGTHS = [1, 700, 37, 2, 513, 64, 129, 255, 3, 600, 1, 90]
BF16 = torch.bfloat16


def _inputs(lengths, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(1, HEADS, total, DIM, generator=gen, device="cuda").to(BF16)
    k, v = (torch.randn(1, KV_HEADS, total, DIM, generator=gen, device="cuda").to(BF16) for _ in range(2))
    dout = torch.randn(1, total, HEADS, DIM, generator=gen, device="cuda").to(BF16)
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32, device="cuda")
    return q, k, v, dout, cu


def _reference(q, k, v, lengths):
    """Per sample, causal, in float64: [1, H, N, D] x [1, Hkv, N, D] -> [1, N, H, D]."""
    group = q.shape[1] // k.shape[1]
    parts = []
    for qs, ks, vs in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2), strict=True):
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        s = qs @ ks.transpose(-1, -2) * SCALE
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        parts.append(s.softmax(-1) @ vs)
    return torch.cat(parts, 2).transpose(1, 2)


def _rel_err(got, want):
    return float((got.detach().double() - want.detach().double()).norm() / want.detach().double().norm())


def _check_against_reference(attend, lengths):
    """attend(q, k, v) -> [1, N, H, D]; forward and backward in bf16 against the float64 reference."""
    q, k, v, dout, _ = _inputs(lengths)
    mine = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = attend(*mine)
    assert out.shape == (1, sum(lengths), HEADS, DIM) and out.dtype == BF16
    out.backward(dout)
    full = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref = _reference(*full, lengths)
    ref.backward(dout.double())
    assert _rel_err(out, ref) < 1e-2
    for name, a, b in zip("qkv", mine, full, strict=True):
        assert a.grad.dtype == BF16 and _rel_err(a.grad, b.grad) < 2e-2, f"d{name}"


def test_this_gpu_gets_a_varlen_kernel():
    if va.varlen_attn is not None:
        assert va.TORCH_VARLEN is not None, "this torch's varlen_attn has a signature we cannot read"
    want = "flash_attn" if va.flash_attn_varlen_func is not None else "torch_varlen" if va.TORCH_VARLEN is not None else "sdpa_no_cudnn"
    assert va.kernel_for("cuda", BF16, False) == want


@pytest.mark.parametrize("kernel", ["torch_varlen", "sdpa_no_cudnn", "flash_attn"])
def test_varlen_kernel_matches_reference(kernel):
    if kernel == "torch_varlen" and va.TORCH_VARLEN is None:
        pytest.skip("this torch has no usable varlen_attn")
    if kernel == "flash_attn" and va.flash_attn_varlen_func is None:
        pytest.skip("flash-attn is not installed")
    cu = _inputs(LENGTHS)[4]
    _check_against_reference(lambda q, k, v: va.KERNELS[kernel](q, k, v, cu, max(LENGTHS), SCALE, 0.0), LENGTHS)


def test_dense_rows_match_reference():
    """hf_attention's branch without boundaries: each row one causal sequence (here one row of 700)."""
    _check_against_reference(lambda q, k, v: va.dense_causal_attention(q, k, v, SCALE), [700])


def _op_names(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_no_cudnn_attention_on_cuda(dtype):
    q, k, v, dout, cu = (t.to(dtype) if t.is_floating_point() else t for t in _inputs([300, 5, 41, 700]))
    q.requires_grad_(True)

    def run(attend):
        def go():
            attend().backward(dout)

        return _op_names(go)

    packed = run(lambda: va.varlen_causal_attention(q, k, v, cu, 700, SCALE))
    per_sample = run(lambda: va.KERNELS["sdpa_no_cudnn"](q, k, v, cu, 700, SCALE, 0.0))
    dense = run(lambda: va.dense_causal_attention(q, k, v, SCALE))
    for names in (packed, per_sample, dense):
        assert not [n for n in names if "cudnn" in n.lower()], sorted(names)
    if dtype == BF16:  # flash is first wherever it can run
        assert any("flash_attention" in n for n in per_sample), sorted(per_sample)
        assert any("flash_attention" in n for n in dense), sorted(dense)


# rows of 1,536 tokens cut into 3 chunks of 512: chunk 1 starts with a 1-token piece whose sample reaches back
# into chunk 0 (a 1-row rectangle), then a 1-token sample; chunk 2's first sample reaches back into chunk 1
BLOCK_BOUNDS = [0, 300, 513, 514, 1214, 1536]


@pytest.mark.parametrize("rank,src", [(0, 0), (1, 1), (1, 0), (2, 2), (2, 1)])
def test_flash_ring_blocks_match_dense_blocks(rank, src):
    """One block of a 3-rank ring, flash (bf16) against MatmulBlocks (float64); the backward under a given out/lse."""
    n = BLOCK_BOUNDS[-1] // 3
    rects, causal = _rects(BLOCK_BOUNDS, n, rank, src)
    assert rects
    q, k, v, _, _ = _inputs(np.diff(BLOCK_BOUNDS).tolist(), seed=rank * 3 + src)
    q, k, v = q[:, :, rank * n : (rank + 1) * n], k[:, :, src * n : (src + 1) * n], v[:, :, src * n : (src + 1) * n]
    flash, dense = FlashBlocks(SCALE, {}), MatmulBlocks(SCALE)
    fq, fk, fv = flash.enter(q, k, v)
    dq_, dk_, dv_ = dense.enter(q.double(), k.double(), v.double())
    f_out, f_lse = flash.forward(fq, fk, fv, rects, causal)
    d_out, d_lse = dense.forward(dq_, dk_, dv_, rects, causal)
    hi = rects[-1][1]
    assert f_out.shape == (HEADS, hi, DIM) and f_lse.shape == (HEADS, hi) and f_lse.dtype == torch.float32
    assert _rel_err(f_out, d_out.reshape(HEADS, hi, DIM)) < 1e-2
    torch.testing.assert_close(f_lse.double(), d_lse.reshape(HEADS, hi), rtol=0, atol=1e-3)

    gen = torch.Generator(device="cuda").manual_seed(7)
    out = (0.5 * torch.randn(HEADS, n, DIM, generator=gen, device="cuda")).to(BF16)  # a "final" out of the ring
    dout = torch.randn(HEADS, n, DIM, generator=gen, device="cuda").to(BF16)
    lse = 0.5 + 3 * torch.rand(HEADS, n, generator=gen, device="cuda")  # a "final" lse: above any one block's
    lse[:, :hi] += f_lse
    f_grads = [torch.zeros(t.shape, device="cuda") for t in (fq, fk, fv)]
    flash.backward(fq, fk, fv, out, dout, lse, rects, causal, *f_grads)
    d_grads = [torch.zeros(t.shape, dtype=torch.float64, device="cuda") for t in (dq_, dk_, dv_)]
    dense.backward(
        dq_,
        dk_,
        dv_,
        out.double().reshape(dq_.shape),
        dout.double().reshape(dq_.shape),
        lse.double().reshape(dq_.shape[:-1]),
        rects,
        causal,
        *d_grads,
    )
    for name, f, d in zip("qkv", f_grads, d_grads, strict=True):
        heads = f.shape[1]
        assert _rel_err(f, d.reshape(heads, n, DIM).transpose(0, 1)) < 2e-2, f"d{name}"


@pytest.fixture
def group_of_one():
    """A process group of one rank in this process: the ring on one GPU (no neighbour, so no transfers)."""
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        pytest.skip("a process group of another size is already running in this process")
    yield dist.group.WORLD
    if started:
        dist.destroy_process_group()


def test_ring_of_one_gpu_matches_reference(group_of_one):
    cu = _inputs(LENGTHS)[4]
    ring = RingContext(group=group_of_one, cu_seqlens=cu)
    _check_against_reference(lambda q, k, v: ring_attention(q, k, v, ring, SCALE), LENGTHS)


def test_packed_model_matches_padded_on_gpu():
    """A 14/2-head Qwen2 in bf16: the packed row through the chosen kernel gives the padded batch's logprobs."""
    from learner.train.attention.hf import VARLEN
    from learner.train.batch import make_micro_batch, token_logprobs
    from learner.train.packing import pack_samples

    samples = make_samples()
    model = tiny_qwen2(HEADS, KV_HEADS).to("cuda", BF16)
    padded = make_micro_batch(samples, version=3)
    with torch.no_grad():
        ref = token_logprobs(model(input_ids=padded.input_ids.cuda(), attention_mask=padded.attention_mask.cuda()).logits, padded, 1.0)
        model.set_attn_implementation(VARLEN)
        packed = pack_samples(samples, version=3).to("cuda")
        got = token_logprobs(model(**packed.model_kwargs()).logits, packed, 1.0)
    torch.testing.assert_close(got.cpu(), ref.cpu(), rtol=0, atol=3e-2)
