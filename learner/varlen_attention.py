"""Causal attention over a packed row that keeps its samples apart (varlen), in torch or flash-attn.

q [1, H, N, D] and k/v [1, Hkv, N, D] hold the packed samples back to back; cu_seqlens
[S+1] marks where each starts. Token i sees token j only if j <= i and both belong to
the same sample. learner/hf_attention.py plugs this into transformers' models.

CPU: one SDPA call per sample with is_causal. A single SDPA call over the whole row
with a block-diagonal boolean mask computes all N^2 scores, and the masked CPU
kernel is slower per score too: fwd + bwd at Qwen2-0.5B head shapes (14 heads, 2 kv
heads, d 64), 1 thread, the masked call took 9-22x longer (`python -m bench.packing`:
462 vs 21 ms for 64 samples of 24 tokens, 4.5 vs 0.49 s for 8 of 100-1000). The
samples are cut with `split`, whose backward is one concatenation; slicing the row
per sample made each slice's backward write a row-sized zero tensor (3x slower
with 64 samples).
GPU: flash_attn_varlen_func when flash-attn is installed and the tensors are on CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    from flash_attn import flash_attn_varlen_func
except ImportError:  # CPU build: no flash-attn
    flash_attn_varlen_func = None


def varlen_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
    scale: float, dropout: float = 0.0,
) -> torch.Tensor:
    """q [1, H, N, D], k/v [1, Hkv, N, D] (H a multiple of Hkv) -> [1, N, H, D]; causal within each sample only."""
    if q.is_cuda and flash_attn_varlen_func is not None:
        out = flash_attn_varlen_func(
            q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu_seqlens, cu_seqlens,
            max_seqlen, max_seqlen, dropout_p=dropout, softmax_scale=scale, causal=True)
        return out[None]
    gqa = q.shape[1] != k.shape[1]
    # split, not slicing: each slice's backward would write a zero tensor the size of the whole row
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    parts = [
        F.scaled_dot_product_attention(qs, ks, vs, dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=gqa)
        for qs, ks, vs in zip(q.split(lengths, dim=2), k.split(lengths, dim=2), v.split(lengths, dim=2), strict=True)
    ]
    return torch.cat(parts, dim=2).transpose(1, 2)
