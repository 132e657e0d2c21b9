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

The ring loop (RingAttention) is shared; one block is computed by a `Blocks`:
- MatmulBlocks: dense matmuls in fp32 at least, any device, exact; the CPU path.
  GQA: queries are viewed as [Hkv, group, n, D] against keys [Hkv, 1, n, D], so K/V are
  never repeated and dK/dV sum over the group by construction.
- FlashBlocks: torch's own flash kernels (aten._flash_attention_forward/backward), for
  CUDA in half precision without ring-flash-attn. The own chunk is one varlen causal
  call over its sample pieces, an earlier chunk's rectangle one non-causal call; each
  returns out and lse. The backward gives the flash backward the FINAL out and lse, so
  each call yields exactly its block's share of dQ, dK, dV. The kernel takes fewer KV
  heads natively and sums dK/dV over the group itself.

GPU with ring-flash-attn: its llama3_flash_attn_varlen_func (it all-gathers K/V per head
stride and reduce-scatters dK/dV, same contiguous layout and global cu_seqlens).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from learner.train.attention.varlen import HALF

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
    # FlashBlocks' device cu_seqlens per block, built once per step (a host-to-device copy each)
    block_cu: dict = field(init=False, default_factory=dict)

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


class Blocks(Protocol):
    """One rank's attention blocks, in a layout of its own. A block's rectangles always cover query rows [0, hi)."""

    def enter(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Model layout (q [1, H, n, D], k/v [1, Hkv, n, D]) -> this layout; k and v contiguous (they are sent)."""
        ...

    def leave(self, out: torch.Tensor) -> torch.Tensor:
        """Accumulated out (see forward) -> model layout [1, n, H, D]."""
        ...

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rects: list[Rect], causal: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Query rows [0, hi) against one key chunk -> (out [..., hi, D], lse [..., hi]) in the accumulation dtype."""
        ...

    def saved_out(self, out: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
        """What backward gets as `out`: the accumulated out or the returned result (out in q's dtype)."""
        ...

    def backward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        dout: torch.Tensor,
        lse: torch.Tensor,
        rects: list[Rect],
        causal: bool,
        dq: torch.Tensor,
        dk: torch.Tensor,
        dv: torch.Tensor,
    ) -> None:
        """Adds the block's share to dq (this rank's queries) and dk/dv (the accumulators travelling with k/v)."""
        ...


@dataclass(frozen=True, slots=True)
class MatmulBlocks:
    """Dense blocks: q [Hkv, g, n, D], k/v [Hkv, 1, n, D]; out [Hkv, g, rows, D], lse [Hkv, g, rows]."""

    scale: float

    def enter(self, q, k, v):
        kv_heads, n, d = k.shape[1], q.shape[2], q.shape[3]
        return (
            q.reshape(kv_heads, q.shape[1] // kv_heads, n, d),
            k.reshape(kv_heads, 1, n, d).contiguous(),
            v.reshape(kv_heads, 1, n, d).contiguous(),
        )

    def leave(self, out):
        kv_heads, group, n, d = out.shape
        return out.reshape(1, kv_heads * group, n, d).transpose(1, 2)

    def forward(self, q, k, v, rects, causal):
        acc = _acc_dtype(q)
        outs, lses = [], []
        for q0, q1, k0, k1 in rects:
            s = _scores(q[..., q0:q1, :].to(acc), k[..., k0:k1, :].to(acc), self.scale, causal)
            lse = torch.logsumexp(s, dim=-1)
            outs.append(torch.exp(s - lse[..., None]) @ v[..., k0:k1, :].to(acc))
            lses.append(lse)
        return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)

    def saved_out(self, out, result):
        return out

    def backward(self, q, k, v, out, dout, lse, rects, causal, dq, dk, dv):
        acc = out.dtype
        for q0, q1, k0, k1 in rects:
            kk, vv = k[..., k0:k1, :].to(acc), v[..., k0:k1, :].to(acc)
            qq, dd = q[..., q0:q1, :].to(acc), dout[..., q0:q1, :].to(acc)
            delta = (dd * out[..., q0:q1, :]).sum(-1)  # rowsum(dO * O): the softmax-backward correction term
            p = torch.exp(_scores(qq, kk, self.scale, causal) - lse[..., q0:q1, None])
            dv[..., k0:k1, :] += (p.transpose(-1, -2) @ dd).sum(1, keepdim=True)
            ds = p * (dd @ vv.transpose(-1, -2) - delta[..., None])
            dq[..., q0:q1, :] += (ds @ kk) * self.scale
            dk[..., k0:k1, :] += (ds.transpose(-1, -2) @ qq).sum(1, keepdim=True) * self.scale


class FlashBlocks:
    """Flash blocks: q [n, H, D], k/v [n, Hkv, D] (the kernels' layout); out [H, rows, D], lse [H, rows].

    One varlen call per block: the own chunk's sample pieces are its sequences (causal),
    an earlier chunk's rectangle its one sequence (not causal). lse comes back as
    [H, total_q]. The backward is handed the ring's final out (q's dtype, as the kernel
    requires) and final lse; dropout is never on, so the RNG state it takes is unused.
    """

    def __init__(self, scale: float, cu_cache: dict, fwd=None, bwd=None) -> None:
        self.scale, self.cu_cache = scale, cu_cache
        # the aten ops unless a test hands in stand-ins with their signatures
        self.fwd = fwd if fwd is not None else torch.ops.aten._flash_attention_forward.default
        self.bwd = bwd if bwd is not None else torch.ops.aten._flash_attention_backward.default

    def enter(self, q, k, v):
        return tuple(t[0].transpose(0, 1).contiguous() for t in (q, k, v))

    def leave(self, out):
        return out.transpose(0, 1)[None]

    def _segments(self, rects: list[Rect], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """(cu_seqlens_q, cu_seqlens_k, max_q, max_k) of one block, relative to its first query and key rows."""
        key = tuple(rects)
        if key not in self.cu_cache:
            assert rects[0][0] == 0, f"a block must start at query row 0: {rects}"
            k_lo = rects[0][2]
            cu_q = [r[0] for r in rects] + [rects[-1][1]]
            cu_k = [r[2] - k_lo for r in rects] + [rects[-1][3] - k_lo]
            self.cu_cache[key] = (
                torch.tensor(cu_q, dtype=torch.int32, device=device),
                torch.tensor(cu_k, dtype=torch.int32, device=device),
                max(b - a for a, b in zip(cu_q, cu_q[1:], strict=False)),
                max(b - a for a, b in zip(cu_k, cu_k[1:], strict=False)),
            )
        return self.cu_cache[key]

    def forward(self, q, k, v, rects, causal):
        cu_q, cu_k, max_q, max_k = self._segments(rects, q.device)
        hi, k0, k1 = rects[-1][1], rects[0][2], rects[-1][3]
        out, lse = self.fwd(q[:hi], k[k0:k1], v[k0:k1], cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=self.scale)[:2]
        acc = _acc_dtype(q)
        return out.transpose(0, 1).to(acc), lse.to(acc)

    def saved_out(self, out, result):
        return result

    def backward(self, q, k, v, out, dout, lse, rects, causal, dq, dk, dv):
        cu_q, cu_k, max_q, max_k = self._segments(rects, q.device)
        hi, k0, k1 = rects[-1][1], rects[0][2], rects[-1][3]
        rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # read only with dropout
        unused = torch.empty(0, device=q.device)
        dq_b, dk_b, dv_b = self.bwd(
            dout.transpose(0, 1)[:hi],
            q[:hi],
            k[k0:k1],
            v[k0:k1],
            out.transpose(0, 1)[:hi],
            lse[:, :hi].contiguous(),
            cu_q,
            cu_k,
            max_q,
            max_k,
            0.0,
            causal,
            rng_state,
            unused,
            scale=self.scale,
        )
        dq[:hi] += dq_b
        dk[k0:k1] += dk_b
        dv[k0:k1] += dv_b


def _exchange(tensors: list[torch.Tensor], group: dist.ProcessGroup, rank: int, size: int):
    """Send `tensors` to rank + 1 and receive the same shapes from rank - 1; returns (received, pending requests)."""
    received = [torch.empty_like(t) for t in tensors]
    assert all(t.is_contiguous() for t in tensors), "a send buffer must be contiguous (a copy could be freed in flight)"
    ops = [dist.P2POp(dist.isend, t, group=group, group_peer=(rank + 1) % size, tag=i) for i, t in enumerate(tensors)]
    ops += [dist.P2POp(dist.irecv, b, group=group, group_peer=(rank - 1) % size, tag=i) for i, b in enumerate(received)]
    return received, dist.batch_isend_irecv(ops)


def _wait(reqs) -> None:
    for req in reqs:
        req.wait()


class RingAttention(torch.autograd.Function):
    """q, k, v: this rank's chunk in `blocks`' layout -> out in that layout (q's dtype)."""

    @staticmethod
    def forward(ctx, q, k, v, ring: RingContext, blocks: Blocks):
        rank, size = ring.rank, ring.size
        n = ring.bounds[-1] // size
        out = lse = None
        k_cur, v_cur = k, v
        for t in range(size):
            if t < size - 1:
                (k_next, v_next), reqs = _exchange([k_cur, v_cur], ring.group, rank, size)
            rects, causal = _rects(ring.bounds, n, rank, (rank - t) % size)
            if rects:
                blk_out, blk_lse = blocks.forward(q, k_cur, v_cur, rects, causal)
                if t == 0:  # own chunk first: it covers every row, and every row sees itself, so lse is finite
                    out, lse = blk_out, blk_lse
                else:
                    assert out is not None and lse is not None
                    hi = blk_lse.shape[-1]
                    new = torch.logaddexp(lse[..., :hi], blk_lse)
                    out[..., :hi, :] = (
                        out[..., :hi, :] * torch.exp(lse[..., :hi] - new)[..., None] + blk_out * torch.exp(blk_lse - new)[..., None]
                    )
                    lse[..., :hi] = new
            if t < size - 1:
                _wait(reqs)
                k_cur, v_cur = k_next, v_next
        assert out is not None and lse is not None
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, blocks.saved_out(out, result), lse)
        ctx.ring, ctx.blocks = ring, blocks
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, blocks = ctx.ring, ctx.blocks
        rank, size = ring.rank, ring.size
        n = ring.bounds[-1] // size
        acc = _acc_dtype(q)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        k_cur, v_cur = k, v
        dk_cur = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv_cur = torch.zeros_like(dk_cur)
        for t in range(size):
            if t < size - 1:
                (k_next, v_next), reqs = _exchange([k_cur, v_cur], ring.group, rank, size)
            rects, causal = _rects(ring.bounds, n, rank, (rank - t) % size)
            if rects:
                blocks.backward(q, k_cur, v_cur, out, dout, lse, rects, causal, dq, dk_cur, dv_cur)
            if t < size - 1:
                _wait(reqs)
                k_cur, v_cur = k_next, v_next
            if size > 1:  # the accumulator follows its chunk; after the last block one more hop brings it home
                (dk_cur, dv_cur), reqs = _exchange([dk_cur, dv_cur], ring.group, rank, size)
                _wait(reqs)
        return dq.to(q.dtype), dk_cur.to(k.dtype), dv_cur.to(v.dtype), None, None


def ring_blocks_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingContext, blocks: Blocks) -> torch.Tensor:
    """q [1, H, n, D], k/v [1, Hkv, n, D]: this rank's chunk -> [1, n, H, D], each block computed by `blocks`."""
    return blocks.leave(RingAttention.apply(*blocks.enter(q, k, v), ring, blocks))


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingContext, scale: float) -> torch.Tensor:
    """q [1, H, n, D], k/v [1, Hkv, n, D]: this rank's chunk of the packed row -> [1, n, H, D]."""
    if q.is_cuda and llama3_flash_attn_varlen_func is not None:
        if ring.flash_args is None:
            ring.flash_args = llama3_flash_attn_prepare_cu_seqlens(
                ring.cu_seqlens.to(q.device), causal=True, rank=ring.rank, world_size=ring.size
            )
        cu_q, cu_k, max_q, max_k, k_slice = ring.flash_args
        out = llama3_flash_attn_varlen_func(
            q[0].transpose(0, 1),
            k[0].transpose(0, 1),
            v[0].transpose(0, 1),
            cu_q,
            cu_k,
            max_q,
            max_k,
            heads_k_stride=1,
            local_k_slice=k_slice,
            softmax_scale=scale,
            causal=True,
            group=ring.group,
        )
        return out[None]
    # flash kernels take half precision only; fp32 on CUDA runs the dense blocks
    flash = q.is_cuda and q.dtype in HALF
    blocks: Blocks = FlashBlocks(scale, ring.block_cu) if flash else MatmulBlocks(scale)
    return ring_blocks_attention(q, k, v, ring, blocks)
