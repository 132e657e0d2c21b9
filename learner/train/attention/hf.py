"""Plug FleetRL's attention into a stock transformers model: "fleetrl_varlen" (packed) and "fleetrl_ring" (SP).

Importing this module registers both names with transformers' AttentionInterface;
`model.set_attn_implementation(attention_implementation(cfg.train))` (learner/train/layout.py)
picks one once at setup. The model is then called with `PackedBatch.model_kwargs()` or
`SequenceShard.model_kwargs()`: the sample boundaries travel as forward kwargs
(transformers' own `cu_seq_lens_q`/`max_length_q`, or our `fleetrl_ring` context),
which the model hands unchanged to every attention call. Kwargs rather than a
context object because activation checkpointing re-runs the forward inside
backward, after any `with` block around the forward has exited.

No dense mask is ever built: masking_utils returns mask None at once for an
implementation with no entry in AttentionMaskInterface, and we register none
(tests/unit/test_packing.py checks it). Without `cu_seq_lens_q`, "fleetrl_varlen" treats
each row as one causal sequence, which is also exact for the real tokens of a
right-padded batch (pads only follow them); left padding would be wrong and is
never produced here. Both branches keep SDPA off cuDNN on CUDA (learner/train/attention/varlen.py).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from learner.train.attention.ring import ring_attention
from learner.train.attention.varlen import dense_causal_attention, varlen_causal_attention

VARLEN = "fleetrl_varlen"
RING = "fleetrl_ring"


def _scale(query: torch.Tensor, scaling: float | None) -> float:
    return scaling if scaling is not None else query.shape[-1] ** -0.5


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [B, H, L, D], key/value [B, Hkv, L, D] -> ([B, L, H, D], None)."""
    assert attention_mask is None, f"{VARLEN} has no mask function, so transformers must not build a mask"
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:  # each row is one causal sequence
        return dense_causal_attention(query, key, value, _scale(query, scaling), dropout), None
    if query.shape[0] != 1:
        raise ValueError(f"{VARLEN}: a packed batch is one row, got batch size {query.shape[0]}")
    max_seqlen = kwargs.get("max_length_q") or int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    cu_seqlens = cu_seqlens.to(query.device, non_blocking=True)
    out = varlen_causal_attention(query, key, value, cu_seqlens, max_seqlen, _scale(query, scaling), dropout)
    return out, None


def ring_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    assert attention_mask is None, f"{RING} has no mask function, so transformers must not build a mask"
    if dropout > 0:
        raise ValueError(f"{RING}: attention dropout is not supported (got {dropout})")
    ring = kwargs.get("fleetrl_ring")
    if ring is None:
        raise ValueError(f"{RING}: call the model with SequenceShard.model_kwargs() (no `fleetrl_ring` kwarg)")
    return ring_attention(query, key, value, ring, _scale(query, scaling)), None


AttentionInterface.register(VARLEN, varlen_attention_forward)
AttentionInterface.register(RING, ring_attention_forward)
