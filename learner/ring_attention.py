"""Ring attention over a sequence-parallel group, varlen and causal.

The packed row (N tokens, a multiple of P = group size) is split into P contiguous
chunks of n = N / P; rank r holds chunk r's queries, keys and values. Token i may see
token j only if j <= i (global index) and both belong to the same packed sample.

Forward: K/V chunks travel around the ring (rank r sends to r+1, receives from r-1,
P-1 hops, the next transfer posted before the current block is computed). Each block
is folded into the output with online softmax: a running log-sum-exp per query row.
Backward: recomputes each block from the saved final log-sum-exp, and a dK/dV
accumulator travels with its K/V chunk, collecting every rank's contribution; one
last hop brings it home, so gradients are exact.

Varlen makes the blocks sparse. Chunk r's own block is causal within each sample
piece; an earlier chunk s < r can be seen only by the one sample that contains
chunk r's first token, and only if that sample reaches back into chunk s: a single
dense rectangle. Only those rectangles are computed (never an n x n mask). Chunks
are contiguous, not zigzag, so rank r computes up to r + 1 blocks and the last rank
does the most work.

GQA: queries are viewed as [Hkv, group, n, D] against keys [Hkv, 1, n, D], so K/V are
never repeated and dK/dV sum over the group by construction.

GPU: ring-flash-attn's llama3_flash_attn_varlen_func (it all-gathers K/V per head
stride and reduce-scatters dK/dV, same contiguous layout and global cu_seqlens).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

try:
    from ring_flash_attn import llama3_flash_attn_prepare_cu_seqlens, llama3_flash_attn_varlen_func
except ImportError:  # CPU build
    llama3_flash_attn_varlen_func = None

Rect = tuple[int, int, int, int]  # local query rows [q0, q1) x local key rows [k0, k1)


@dataclass(kw_only=True, slots=True)
class RingContext:
    """What every attention layer needs to know about the split (reaches the model as kwarg `fleetrl_ring`)."""

    group: dist.ProcessGroup
    cu_seqlens: torch.Tensor  # int32 [S+1] over the whole padded row; the pad tail is its own last segment
    rank: int = field(init=False)
    size: int = field(init=False)
    bounds: list[int] = field(init=False)
    flash_args: tuple | None = field(init=False, default=None)  # llama3 cu_seqlens, computed once per step on GPU

    def __post_init__(self) -> None:
        self.rank, self.size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.bounds = self.cu_seqlens.tolist()
        assert self.bounds[-1] % self.size == 0, f"row of {self.bounds[-1]} tokens does not split over {self.size} ranks"


def _rects(bounds: list[int], n: int, r: int, s: int) -> tuple[list[Rect], bool]:
    """Rectangles of (query chunk r, key chunk s) that may attend, and whether they are causal squares."""
    if s > r:
        return [], False
    lo, hi = r * n, (r + 1) * n
    i = bisect.bisect_right(bounds, lo) - 1  # sample containing the chunk's first token
    if s < r:
        a, b = bounds[i], bounds[i + 1]
        if a >= (s + 1) * n:
            return [], False
        return [(0, min(b, hi) - lo, max(a, s * n) - s * n, n)], False
    rects = []
    while i + 1 < len(bounds) and bounds[i] < hi:
        a, b = max(bounds[i], lo) - lo, min(bounds[i + 1], hi) - lo
        rects.append((a, b, a, b))
        i += 1
    return rects, True


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    """Blocks are combined in fp32 at least (bf16 partial sums would drift), fp64 stays fp64 (exact tests)."""
    return torch.promote_types(x.dtype, torch.float32)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _exchange(tensors: list[torch.Tensor], group: dist.ProcessGroup, rank: int, size: int):
    """Send `tensors` to rank + 1 and receive the same shapes from rank - 1; returns (received, pending requests)."""
    received = [torch.empty_like(t) for t in tensors]
    assert all(t.is_contiguous() for t in tensors), "a send buffer must be contiguous (a copy could be freed in flight)"
    ops = [dist.P2POp(dist.isend, t, group=group, group_peer=(rank + 1) % size, tag=i)
           for i, t in enumerate(tensors)]
    ops += [dist.P2POp(dist.irecv, b, group=group, group_peer=(rank - 1) % size, tag=i)
            for i, b in enumerate(received)]
    return received, dist.batch_isend_irecv(ops)


def _wait(reqs) -> None:
    for req in reqs:
        req.wait()


class RingAttention(torch.autograd.Function):
    """q [Hkv, g, n, D], k/v [Hkv, 1, n, D] (this rank's chunk) -> out [Hkv, g, n, D]."""

    @staticmethod
    def forward(ctx, q, k, v, ring: RingContext, scale: float):
        n, rank, size = q.shape[-2], ring.rank, ring.size
        acc = _acc_dtype(q)
        qf = q.to(acc)
        out = torch.zeros_like(qf)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        k_cur, v_cur = k, v
        for t in range(size):
            if t < size - 1:
                (k_next, v_next), reqs = _exchange([k_cur, v_cur], ring.group, rank, size)
            rects, causal = _rects(ring.bounds, n, rank, (rank - t) % size)
            for q0, q1, k0, k1 in rects:
                s = _scores(qf[..., q0:q1, :], k_cur[..., k0:k1, :].to(acc), scale, causal)
                blk_lse = torch.logsumexp(s, dim=-1)
                blk_out = torch.exp(s - blk_lse[..., None]) @ v_cur[..., k0:k1, :].to(acc)
                if t == 0:  # own chunk first: every row sees at least itself, so lse is finite from here on
                    out[..., q0:q1, :], lse[..., q0:q1] = blk_out, blk_lse
                else:
                    new = torch.logaddexp(lse[..., q0:q1], blk_lse)
                    out[..., q0:q1, :] = (out[..., q0:q1, :] * torch.exp(lse[..., q0:q1] - new)[..., None]
                                          + blk_out * torch.exp(blk_lse - new)[..., None])
                    lse[..., q0:q1] = new
            if t < size - 1:
                _wait(reqs)
                k_cur, v_cur = k_next, v_next
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale = ring, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        n, rank, size = q.shape[-2], ring.rank, ring.size
        acc = out.dtype
        qf, do = q.to(acc), dout.to(acc)
        delta = (do * out).sum(-1)  # rowsum(dO * O): the softmax-backward correction term
        dq = torch.zeros_like(qf)
        k_cur, v_cur = k, v
        dk_cur = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv_cur = torch.zeros_like(dk_cur)
        for t in range(size):
            if t < size - 1:
                (k_next, v_next), reqs = _exchange([k_cur, v_cur], ring.group, rank, size)
            rects, causal = _rects(ring.bounds, n, rank, (rank - t) % size)
            for q0, q1, k0, k1 in rects:
                kk, vv = k_cur[..., k0:k1, :].to(acc), v_cur[..., k0:k1, :].to(acc)
                qq, dd = qf[..., q0:q1, :], do[..., q0:q1, :]
                p = torch.exp(_scores(qq, kk, scale, causal) - lse[..., q0:q1, None])
                dv_cur[..., k0:k1, :] += (p.transpose(-1, -2) @ dd).sum(1, keepdim=True)
                ds = p * (dd @ vv.transpose(-1, -2) - delta[..., q0:q1, None])
                dq[..., q0:q1, :] += (ds @ kk) * scale
                dk_cur[..., k0:k1, :] += (ds.transpose(-1, -2) @ qq).sum(1, keepdim=True) * scale
            if t < size - 1:
                _wait(reqs)
                k_cur, v_cur = k_next, v_next
            # the accumulator follows its chunk; after the last block one more hop brings it home
            (dk_cur, dv_cur), reqs = _exchange([dk_cur, dv_cur], ring.group, rank, size)
            _wait(reqs)
        return dq.to(q.dtype), dk_cur.to(k.dtype), dv_cur.to(v.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingContext, scale: float) -> torch.Tensor:
    """q [1, H, n, D], k/v [1, Hkv, n, D]: this rank's chunk of the packed row -> [1, n, H, D]."""
    heads, kv_heads, n, d = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    if q.is_cuda and llama3_flash_attn_varlen_func is not None:
        if ring.flash_args is None:
            ring.flash_args = llama3_flash_attn_prepare_cu_seqlens(
                ring.cu_seqlens.to(q.device), causal=True, rank=ring.rank, world_size=ring.size)
        cu_q, cu_k, max_q, max_k, k_slice = ring.flash_args
        out = llama3_flash_attn_varlen_func(
            q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu_q, cu_k, max_q, max_k,
            heads_k_stride=1, local_k_slice=k_slice, softmax_scale=scale, causal=True, group=ring.group)
        return out[None]
    out = RingAttention.apply(q.reshape(kv_heads, heads // kv_heads, n, d), k.reshape(kv_heads, 1, n, d).contiguous(),
                              v.reshape(kv_heads, 1, n, d).contiguous(), ring, scale)
    return out.reshape(1, heads, n, d).transpose(1, 2)
