"""Causal attention over a packed row that keeps its samples apart (varlen), in torch or flash-attn.

q [1, H, N, D] and k/v [1, Hkv, N, D] hold the packed samples back to back; cu_seqlens
[S+1] marks where each starts. Token i sees token j only if j <= i and both belong to
the same sample. learner/hf_attention.py plugs this into transformers' models.

CPU: one SDPA call per sample with is_causal. A single SDPA call over the whole row
with a block-diagonal boolean mask computes all N^2 scores, and the masked CPU
kernel is slower per score too: measured fwd+bwd at Qwen2-0.5B head shapes (14 heads,
2 kv heads, d 64), 1 thread, it was 8x slower for 64 samples of 24 tokens (450 ms vs
54 ms) and 6-13x slower from 16x256 to 4x2048 tokens. The per-sample loop costs one
small call per sample, a few microseconds each.
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
    bounds = cu_seqlens.tolist()
    parts = [
        F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], dropout_p=dropout, is_causal=True,
                                       scale=scale, enable_gqa=gqa)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return torch.cat(parts, dim=2).transpose(1, 2)
