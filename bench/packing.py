"""Packed vs padded micro-batches on CPU: attention alone, then a whole forward + backward.

Attention: varlen causal attention (learner/train/attention/varlen.py, one SDPA call per
sample) vs one SDPA call over the packed row with a block-diagonal boolean mask, at
Qwen2-0.5B head shapes (14 heads, 2 kv heads, d 64), fwd + bwd, best of 3.
Model: a small random Qwen2 (4 layers, hidden 256, GQA 4/2), logprobs of the
completion tokens + backward: padded rows with sdpa vs one packed row with
"fleetrl_varlen", best of 2. One intra-op thread, like the learner's default.

    python -m bench.packing
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from learner.train.attention.hf import VARLEN
from learner.train.attention.varlen import varlen_causal_attention
from learner.train.batch import Sample, make_micro_batch, token_logprobs
from learner.train.packing import pack_samples, packing_efficiency


def _masked(q, k, v, cu):
    segment = torch.repeat_interleave(torch.arange(len(cu) - 1), cu[1:] - cu[:-1])
    index = torch.arange(q.shape[2])
    mask = (segment[:, None] == segment[None, :]) & (index[:, None] >= index[None, :])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _attention_times(lengths: list[int]) -> tuple[int, float, float]:
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    n = int(cu[-1])
    q = torch.randn(1, 14, n, 64, requires_grad=True)
    k, v = (torch.randn(1, 2, n, 64, requires_grad=True) for _ in range(2))
    masked = _best(lambda: _masked(q, k, v, cu).sum().backward(), 3)
    varlen = _best(lambda: varlen_causal_attention(q, k, v, cu, max(lengths), 64**-0.5).sum().backward(), 3)
    return n, masked, varlen


def attention_table(rng: np.random.Generator) -> None:
    print("| samples x tokens | N | masked SDPA ms | varlen ms | speed-up |\n|---|---:|---:|---:|---:|")
    cases = {
        "64 x 24": [24] * 64,
        "64 x 8..40": rng.integers(8, 41, 64).tolist(),
        "16 x 256": [256] * 16,
        "8 x 100..1000": rng.integers(100, 1001, 8).tolist(),
    }
    for name, lengths in cases.items():
        n, masked, varlen = _attention_times(lengths)
        print(f"| {name} | {n} | {masked * 1e3:.0f} | {varlen * 1e3:.0f} | {masked / varlen:.1f}x |")


def model_table(rng: np.random.Generator) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    print("\n| micro-batch | padded efficiency | padded s | packed s | speed-up |\n|---|---:|---:|---:|---:|")
    cases = {
        "16 long-tail, 40 + lognormal(5, 0.9)": (40 + rng.lognormal(5.0, 0.9, 16)).astype(int).tolist(),
        "64 of 26..64": (25 + rng.integers(1, 40, 64)).tolist(),
        "64 of 22..25 (demo-like, near uniform)": (21 + rng.integers(1, 5, 64)).tolist(),
    }
    for name, lengths in cases.items():
        samples = [
            Sample(
                tokens=rng.integers(0, 256, n).astype(np.int32),
                prompt_len=20,
                behaviour_logprobs=np.zeros(n - 20, np.float32),
                advantage=1.0,
                reward=0.0,
                version_min=0,
                version_max=0,
            )
            for n in lengths
        ]
        times = {}
        for layout, build, attention in (("padded", make_micro_batch, "sdpa"), ("packed", pack_samples, VARLEN)):
            model.set_attn_implementation(attention)
            batch = build(samples, 0)
            times[layout] = _best(lambda b=batch: token_logprobs(model(**b.model_kwargs()).logits, b, 1.0).sum().backward(), 2)
        eff = packing_efficiency(lengths)
        print(f"| {name} | {eff.padded:.2f} | {times['padded']:.2f} | {times['packed']:.2f} | {times['padded'] / times['packed']:.2f}x |")


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    attention_table(rng)
    model_table(rng)


if __name__ == "__main__":
    main()
