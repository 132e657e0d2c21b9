"""The ring attention's blocks over real gloo groups: aten's flash ops driven through float64 stand-ins of the same
signatures (lse [heads, total_q], the backward taking a given out and lse), and the matmul blocks, against dense
masked attention. What this checks is our side: which out/lse the backward gets, the ring's folding, GQA. The
kernels themselves run in tests/gpu/test_gpu_attention.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from learner.train.attention.ring import FlashBlocks, MatmulBlocks, RingContext, ring_blocks_attention
from protocol.net import free_port
from tests.unit.test_attention_kernels import BF16, dense_reference, packed_qkv

# -- the ring's flash blocks, driven through stand-ins of aten's flash ops -----------------------------------


def _segment_scores(q, k, scale, causal):
    """q [Lq, H, D], k [Lk, Hkv, D] -> scores [H, Lq, Lk] (KV head h // group for query head h), k expanded."""
    kk = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    if causal:  # bottom-right aligned, as flash-attn
        lq, lk = q.shape[0], k.shape[0]
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool).triu(lk - lq + 1), float("-inf"))
    return s, kk


def _segments(cu_q, cu_k, max_q, max_k, total_q, total_k):
    bq, bk = cu_q.tolist(), cu_k.tolist()
    assert cu_q.dtype == cu_k.dtype == torch.int32 and len(bq) == len(bk) and bq[0] == bk[0] == 0
    assert (bq[-1], bk[-1]) == (total_q, total_k), "cu_seqlens must end at the tensors' lengths"
    assert max_q == max(np.diff(bq)) and max_k == max(np.diff(bk))
    return list(zip(bq, bq[1:], bk, bk[1:], strict=False))


def fake_flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale):
    """out in q's dtype and lse in float32 (float64 for float64 inputs), as the kernel; the math in float64."""
    assert all(t.dim() == 3 and t.stride(-1) == 1 for t in (q, k, v)) and dropout_p == 0.0 and not return_debug_mask
    segments = _segments(cu_q, cu_k, max_q, max_k, q.shape[0], k.shape[0])
    q, k, v, dtype = q.double(), k.double(), v.double(), q.dtype
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=q.dtype)  # [H, total_q]
    for a, b, c, d in segments:
        s, _ = _segment_scores(q[a:b], k[c:d], scale, is_causal)
        lse[:, a:b] = torch.logsumexp(s, -1)
        out[a:b] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v[c:d].repeat_interleave(s.shape[0] // v.shape[1], 1))
    lse_dtype = torch.promote_types(dtype, torch.float32)
    return out.to(dtype), lse.to(lse_dtype), torch.zeros(2, dtype=torch.uint64), torch.empty(0), torch.empty(0)


def fake_flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, rng_state, unused, *, scale):
    """Gradients under the GIVEN out and lse, in q's dtype; GQA's dK/dV summed over each group."""
    assert out.shape == dout.shape == q.shape and out.dtype == dout.dtype == q.dtype, "out/dout as q: [total_q, H, D]"
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.is_contiguous(), "lse: contiguous [H, total_q]"
    assert lse.dtype == torch.promote_types(q.dtype, torch.float32)
    segments = _segments(cu_q, cu_k, max_q, max_k, q.shape[0], k.shape[0])
    dtype = q.dtype
    dout, q, k, v, out, lse = (t.double() for t in (dout, q, k, v, out, lse))
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    group = q.shape[1] // k.shape[1]
    for a, b, c, d in segments:
        s, kk = _segment_scores(q[a:b], k[c:d], scale, is_causal)
        vv = v[c:d].repeat_interleave(group, 1)
        p = torch.exp(s - lse[:, a:b, None])
        delta = (dout[a:b] * out[a:b]).sum(-1).T
        ds = p * (torch.einsum("qhd,khd->hqk", dout[a:b], vv) - delta[..., None])
        dq[a:b] = torch.einsum("hqk,khd->qhd", ds, kk) * scale
        dkk = torch.einsum("hqk,qhd->khd", ds, q[a:b]) * scale
        dvv = torch.einsum("hqk,qhd->khd", p, dout[a:b])
        dk[c:d] = dkk.reshape(d - c, k.shape[1], group, -1).sum(2)
        dv[c:d] = dvv.reshape(d - c, k.shape[1], group, -1).sum(2)
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)


def _rel_err(got, want):
    return float((got.detach().double() - want.double()).norm() / want.double().norm())


# (lengths, heads, kv heads): boundaries inside chunks, one sample over every chunk, 1-token samples and
# a 1-row rectangle, a sample over two chunks; GQA and MHA
RING_CASES = [([5, 7, 4, 8], 4, 2), ([24], 4, 1), ([1, 2, 3, 1, 4, 5, 2, 6], 2, 2), ([13, 3, 4, 4], 6, 3), ([11, 2, 11], 6, 2)]


def _ring_case(rank, world, lengths, heads, kv_heads, group):
    q, k, v, cu = packed_qkv(heads, kv_heads, lengths, seed=sum(lengths) + heads)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=q.dtype)
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = dense_reference(*full, cu, 0.25)
    ref.backward(dout)
    n = sum(lengths) // world
    mine = slice(rank * n, (rank + 1) * n)
    ring = RingContext(group=group, cu_seqlens=cu)
    for blocks in (MatmulBlocks(0.25), FlashBlocks(0.25, ring.block_cu, fwd=fake_flash_forward, bwd=fake_flash_backward)):
        local = [t[:, :, mine].clone().requires_grad_(True) for t in (q, k, v)]
        out = ring_blocks_attention(*local, ring, blocks)  # [1, n, H, D]
        out.backward(dout[:, :, mine].transpose(1, 2))
        tol = dict(rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(out.transpose(1, 2), ref[:, :, mine].detach(), **tol)
        kind = type(blocks).__name__
        for name, loc, ful in zip("qkv", local, full, strict=True):
            torch.testing.assert_close(loc.grad, ful.grad[:, :, mine], **tol, msg=lambda m, x=f"d{name} {lengths} {kind}": f"{x}: {m}")
    # bf16, as on the GPU: the backward must get the out it returned (bf16) and a float32 lse
    local = [t[:, :, mine].to(BF16).requires_grad_(True) for t in (q, k, v)]
    blocks = FlashBlocks(0.25, ring.block_cu, fwd=fake_flash_forward, bwd=fake_flash_backward)
    out = ring_blocks_attention(*local, ring, blocks)
    assert out.dtype == BF16
    out.backward(dout[:, :, mine].transpose(1, 2).to(BF16))
    assert _rel_err(out.transpose(1, 2), ref[:, :, mine].detach()) < 1e-2
    for name, loc, ful in zip("qkv", local, full, strict=True):
        assert _rel_err(loc.grad, ful.grad[:, :, mine]) < 2e-2, (name, lengths)


def _ring_worker(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for lengths, heads, kv_heads in RING_CASES:
        _ring_case(rank, world, lengths, heads, kv_heads, dist.group.WORLD)
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_flash_blocks_ring_matches_dense_on_cpu(world):
    """FlashBlocks' plumbing (stand-in kernels) and MatmulBlocks give the dense numbers over real gloo rings."""
    mp.spawn(_ring_worker, args=(world, free_port()), nprocs=world, join=True)


def test_ring_of_one_needs_no_neighbour():
    """A group of one (the one-GPU test's setting): the own chunk is the whole row, no send to itself."""
    store = dist.HashStore()
    group_started = not dist.is_initialized()
    if group_started:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        pytest.skip("a process group of another size is already running in this process")
    try:
        for lengths, heads, kv_heads in RING_CASES:
            _ring_case(0, 1, lengths, heads, kv_heads, dist.group.WORLD)
    finally:
        if group_started:
            dist.destroy_process_group()
