"""Causal attention over a packed row that keeps its samples apart (varlen), and which kernel computes it.

q [1, H, N, D] and k/v [1, Hkv, N, D] hold the packed samples back to back; cu_seqlens
[S+1] marks where each starts. Token i sees token j only if j <= i and both belong to
the same sample. learner/train/attention/hf.py plugs this into transformers' models.

The kernel is chosen once per (device type, dtype, dropout) by `choose_kernel`:
- "flash_attn": flash-attn's flash_attn_varlen_func (installed, CUDA, half precision).
- "torch_varlen": torch's own varlen_attn, the same flash kernel shipped with torch.
- "sdpa_no_cudnn": one SDPA call per sample with cuDNN switched off. On CUDA, SDPA's
  default backend is cuDNN, which builds a new plan for every new sequence length: a
  CPU cost paid per sample, per layer, per step, that dwarfs the attention itself.
  Flash has no plan and takes any length, so it is first; the others cover fp32.
- "sdpa_split": CPU, one SDPA call per sample with is_causal. A single SDPA call over
  the row with a block-diagonal mask computes all N^2 scores, and the masked CPU kernel
  is slower per score too (`python -m bench.packing`). The samples are cut with `split`,
  whose backward is one concatenation; slicing the row per sample made each slice's
  backward write a row-sized zero tensor.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

try:
    from flash_attn import flash_attn_varlen_func
except ImportError:  # CPU build: no flash-attn
    flash_attn_varlen_func = None


def _torch_varlen_attn() -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch older than its varlen API
        return None
    return varlen_attn


varlen_attn = _torch_varlen_attn()

Kernel = Literal["flash_attn", "torch_varlen", "sdpa_no_cudnn", "sdpa_split"]
HALF = (torch.float16, torch.bfloat16)  # the only dtypes the flash kernels take
# flash first where it can run; cuDNN never (a plan per new length, see above)
NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True, slots=True)
class VarlenCall:
    """How this torch's varlen_attn is asked for causal attention: its keywords changed between releases."""

    causal: tuple[str, object]  # ("window_size", (-1, 0)) or ("is_causal", True)
    takes_enable_gqa: bool  # newer releases refuse fewer KV heads unless told; older ones take them as they are

    def kwargs(self, scale: float, gqa: bool) -> dict[str, object]:
        kw: dict[str, object] = {self.causal[0]: self.causal[1], "scale": scale}
        if self.takes_enable_gqa:
            kw["enable_gqa"] = gqa
        return kw


def varlen_call(fn: Callable | None) -> VarlenCall | None:
    """Read `fn`'s keywords once; None when it cannot be told both the scale and causality (then it is not used)."""
    if fn is None:
        return None
    params = inspect.signature(fn).parameters
    if "scale" not in params:
        return None
    if "window_size" in params:  # (-1, 0): unbounded to the left, nothing to the right
        causal: tuple[str, object] = ("window_size", (-1, 0))
    elif "is_causal" in params:
        causal = ("is_causal", True)
    else:
        return None
    return VarlenCall(causal=causal, takes_enable_gqa="enable_gqa" in params)


TORCH_VARLEN = varlen_call(varlen_attn)


def choose_kernel(device_type: str, dtype: torch.dtype, dropout: bool, *, flash_attn: bool, torch_varlen: bool) -> Kernel:
    """The attention kernel for tensors on `device_type` in `dtype`, given which varlen libraries are usable."""
    if device_type != "cuda":
        return "sdpa_split"
    if dtype not in HALF:
        return "sdpa_no_cudnn"
    if flash_attn:
        return "flash_attn"
    if torch_varlen and not dropout:  # torch's varlen_attn has no dropout
        return "torch_varlen"
    return "sdpa_no_cudnn"


@functools.cache
def kernel_for(device_type: str, dtype: torch.dtype, dropout: bool) -> Kernel:
    """`choose_kernel` with what this process has installed, decided once per (device type, dtype, dropout)."""
    return choose_kernel(device_type, dtype, dropout, flash_attn=flash_attn_varlen_func is not None, torch_varlen=TORCH_VARLEN is not None)


def disable_cudnn_sdpa() -> None:
    """Call once at learner start on CUDA, before the first forward."""
    # transformers' own "sdpa" (padded rows) calls SDPA directly, outside our kernel choice: cuDNN would plan per new length
    torch.backends.cuda.enable_cudnn_sdp(False)


def no_cudnn(device: torch.device) -> contextlib.AbstractContextManager:
    """SDPA backends for a call on `device`: on CUDA every backend but cuDNN, flash first."""
    return sdpa_kernel(NO_CUDNN, set_priority=True) if device.type == "cuda" else contextlib.nullcontext()


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dropout: float = 0.0) -> torch.Tensor:
    """q [B, H, L, D], k/v [B, Hkv, L, D]: each row one causal sequence -> [B, L, H, D]."""
    with no_cudnn(q.device):
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


def _flash_attn(q, k, v, cu_seqlens, max_seqlen, scale, dropout):
    assert flash_attn_varlen_func is not None
    out = flash_attn_varlen_func(
        q[0].transpose(0, 1),
        k[0].transpose(0, 1),
        v[0].transpose(0, 1),
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        dropout_p=dropout,
        softmax_scale=scale,
        causal=True,
    )
    return out[None]


def _torch_varlen(q, k, v, cu_seqlens, max_seqlen, scale, dropout):
    assert varlen_attn is not None and TORCH_VARLEN is not None and dropout == 0.0
    # newer torch picks varlen_attn's backend from SDPA's switches, and may prefer cuDNN where it can run
    with no_cudnn(q.device):
        out = varlen_attn(
            q[0].transpose(0, 1),
            k[0].transpose(0, 1),
            v[0].transpose(0, 1),
            cu_seqlens,
            cu_seqlens,
            max_seqlen,
            max_seqlen,
            **TORCH_VARLEN.kwargs(scale, q.shape[1] != k.shape[1]),
        )
    return out[None]


def _per_sample(q, k, v, cu_seqlens, max_seqlen, scale, dropout):
    gqa = q.shape[1] != k.shape[1]
    # split, not slicing: each slice's backward would write a zero tensor the size of the whole row
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    with no_cudnn(q.device):
        parts = [
            F.scaled_dot_product_attention(qs, ks, vs, dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=gqa)
            for qs, ks, vs in zip(q.split(lengths, dim=2), k.split(lengths, dim=2), v.split(lengths, dim=2), strict=True)
        ]
    return torch.cat(parts, dim=2).transpose(1, 2)


# every kernel: (q [1, H, N, D], k/v [1, Hkv, N, D], cu_seqlens, max_seqlen, scale, dropout) -> [1, N, H, D]
KERNELS: dict[Kernel, Callable[..., torch.Tensor]] = {
    "flash_attn": _flash_attn,
    "torch_varlen": _torch_varlen,
    "sdpa_no_cudnn": _per_sample,
    "sdpa_split": _per_sample,
}


def varlen_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
    dropout: float = 0.0,
) -> torch.Tensor:
    """q [1, H, N, D], k/v [1, Hkv, N, D] (H a multiple of Hkv) -> [1, N, H, D]; causal within each sample only."""
    kernel = kernel_for(q.device.type, q.dtype, dropout > 0)
    return KERNELS[kernel](q, k, v, cu_seqlens, max_seqlen, scale, dropout)
