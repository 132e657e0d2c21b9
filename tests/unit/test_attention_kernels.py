"""Which attention kernel runs where, and the varlen path's plumbing checked on CPU (in-process, no group).

The CUDA kernels cannot run here, so their callers are driven with stand-ins of the same signatures that compute
the documented semantics in float64: torch's varlen_attn ([total, heads, dim] tensors). What these tests check is
our side: layouts, cu_seqlens, GQA heads. The kernels themselves are checked against references in
tests/gpu/test_gpu_attention.py; the ring's blocks over real gloo groups in tests/integration/test_ring_blocks.py.
"""

from __future__ import annotations

import inspect
import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import learner.train.attention.varlen as va

BF16 = torch.bfloat16


# -- the choice ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device,flash_attn,torch_varlen", list(itertools.product(["cpu", "cuda"], [True, False], [True, False])))
def test_kernel_choice(device, flash_attn, torch_varlen):
    got = va.choose_kernel(device, BF16, False, flash_attn=flash_attn, torch_varlen=torch_varlen)
    if device == "cpu":
        want = "sdpa_split"
    elif flash_attn:
        want = "flash_attn"
    elif torch_varlen:
        want = "torch_varlen"
    else:
        want = "sdpa_no_cudnn"
    assert got == want


def test_kernel_choice_outside_the_flash_kernels_reach():
    # fp32 on CUDA: no flash kernel takes it, and cuDNN stays off
    for flash_attn, torch_varlen in itertools.product([True, False], repeat=2):
        assert va.choose_kernel("cuda", torch.float32, False, flash_attn=flash_attn, torch_varlen=torch_varlen) == "sdpa_no_cudnn"
    # torch's varlen_attn has no dropout; flash-attn's has
    assert va.choose_kernel("cuda", BF16, True, flash_attn=False, torch_varlen=True) == "sdpa_no_cudnn"
    assert va.choose_kernel("cuda", BF16, True, flash_attn=True, torch_varlen=True) == "flash_attn"
    assert va.kernel_for("cpu", torch.float32, False) == "sdpa_split"


def test_no_cudnn_context_and_global_switch():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with va.no_cudnn(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled()
        assert torch._C._get_sdp_priority_order()[0] == int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    try:
        va.disable_cudnn_sdpa()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


# -- torch's varlen_attn: keywords by signature, plumbing with a stand-in -----------------------------------


def _varlen_math(q, k, v, cu_q, cu_k, scale, causal):
    """[total, H, D] x [total, Hkv, D] per sequence, by SDPA on CPU."""
    bounds = cu_q.tolist()
    assert bounds == cu_k.tolist()
    parts = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        out = F.scaled_dot_product_attention(
            *(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), is_causal=causal, scale=scale, enable_gqa=True
        )
        parts.append(out[0].transpose(0, 1))
    return torch.cat(parts)


def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
    assert query.dim() == 3 and key.shape[1] <= query.shape[1] and max_q == max_k
    assert max_q == int((cu_seq_q[1:] - cu_seq_q[:-1]).max())
    return _varlen_math(query, key, value, cu_seq_q, cu_seq_k, scale, window_size == (-1, 0))


def varlen_2_13(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
    seqused_k=None,
    block_table=None,
    num_splits=None,
):
    if not enable_gqa and query.shape[1] != key.shape[1]:
        raise ValueError("Try setting enable_gqa=True for GQA.")
    return varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size)


def test_varlen_call_reads_each_signature():
    old = va.varlen_call(varlen_2_11)
    assert old is not None and old.kwargs(0.5, True) == {"window_size": (-1, 0), "scale": 0.5}
    new = va.varlen_call(varlen_2_13)
    assert new is not None and new.kwargs(0.5, True) == {"window_size": (-1, 0), "scale": 0.5, "enable_gqa": True}
    assert new.kwargs(0.5, False)["enable_gqa"] is False

    def is_causal_style(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None):
        raise AssertionError("only read, never called")

    def no_scale(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False):
        raise AssertionError("only read, never called")

    causal_kw = va.varlen_call(is_causal_style)
    assert causal_kw is not None and causal_kw.kwargs(1.0, True) == {"is_causal": True, "scale": 1.0}
    assert va.varlen_call(no_scale) is None  # a default scale we cannot override would be wrong for some models
    assert va.varlen_call(None) is None
    if va.varlen_attn is not None:  # the installed torch: whatever it is, it must be readable
        assert va.TORCH_VARLEN is not None, inspect.signature(va.varlen_attn)


def packed_qkv(heads, kv_heads, lengths, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(1, heads, total, 16, generator=gen, dtype=dtype)
    k, v = (torch.randn(1, kv_heads, total, 16, generator=gen, dtype=dtype) for _ in range(2))
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    return q, k, v, cu


@pytest.mark.parametrize("fake", [varlen_2_11, varlen_2_13])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_torch_varlen_path_matches_per_sample_sdpa(monkeypatch, fake, heads, kv_heads):
    monkeypatch.setattr(va, "varlen_attn", fake)
    monkeypatch.setattr(va, "TORCH_VARLEN", va.varlen_call(fake))
    lengths = [5, 1, 9, 3]
    results = []
    for kernel in ("torch_varlen", "sdpa_split"):
        q, k, v, cu = (t.requires_grad_(t.is_floating_point()) for t in packed_qkv(heads, kv_heads, lengths))
        out = va.KERNELS[kernel](q, k, v, cu, max(lengths), 0.3, 0.0)
        assert out.shape == (1, sum(lengths), heads, 16)
        out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape))
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_varlen_path_keeps_samples_apart():
    """The CPU kernel's numbers against dense masked attention over the row (so a mask leak would show)."""
    lengths = [4, 7, 1, 5]
    q, k, v, cu = packed_qkv(6, 2, lengths, seed=3)
    got = va.varlen_causal_attention(q, k, v, cu, max(lengths), 0.25)
    torch.testing.assert_close(got.transpose(1, 2), dense_reference(q, k, v, cu, 0.25), rtol=1e-12, atol=1e-12)


def dense_reference(q, k, v, cu, scale):
    """[1, H, N, D] -> [1, H, N, D]: causal and only within a packed sample, over the whole row."""
    n = q.shape[2]
    segment = torch.repeat_interleave(torch.arange(len(cu) - 1), (cu[1:] - cu[:-1]).long())
    index = torch.arange(n)
    allowed = (segment[:, None] == segment[None, :]) & (index[:, None] >= index[None, :])
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf")).softmax(-1) @ v
