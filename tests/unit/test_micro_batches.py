"""Token-budget micro-batches (learner/train/micro_batches.py) and their trip through a share (learner/train/shard.py)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.train.batch import Sample
from learner.train.micro_batches import balanced_ranks, cut_mini_batch, pack_tokens, split_to
from learner.train.shard import decode_share, encode_share, split_rollout_batch


def test_pack_tokens_first_fit_decreasing():
    assert sorted(map(sorted, pack_tokens([5, 3, 4, 2, 6], 8))) == [[0, 1], [2], [3, 4]]  # 6+2, 5+3, 4
    assert pack_tokens([20, 3], 8) == [[0], [1]]  # an oversize sample alone; it never blocks the others


def test_split_to_keeps_the_budget_and_every_sample():
    lengths = [4, 4, 1, 1, 1, 1]
    bins = split_to([[0, 2, 3], [1, 4, 5]], lengths, 5)
    assert len(bins) == 5 and sorted(i for b in bins for i in b) == list(range(6))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=40), st.sampled_from([1, 2, 4]), st.integers(1, 120))
def test_cut_mini_batch_properties(raw, ranks, budget):
    lengths = raw[: len(raw) // ranks * ranks] or [1] * ranks
    cuts = cut_mini_batch(lengths, ranks, budget, samples=1)
    per_rank = len(lengths) // ranks
    assert len({len(c) for c in cuts}) == 1, "every rank runs the same number of micro-batches"
    seen = sorted(i for c in cuts for mb in c for i in mb)
    assert seen == list(range(len(lengths))), "every sample exactly once"
    for c in cuts:
        assert sum(len(mb) for mb in c) == per_rank and all(mb for mb in c)
        for mb in c:
            assert len(mb) == 1 or sum(lengths[i] for i in mb) <= budget, (mb, budget)


def test_balanced_ranks():
    lengths = [100, 90, 10, 10, 5, 5, 80, 1]
    ranks = balanced_ranks(lengths, 2)
    assert [len(r) for r in ranks] == [4, 4]
    totals = [sum(lengths[i] for i in r) for r in ranks]
    assert abs(totals[0] - totals[1]) <= max(lengths) and abs(totals[0] - totals[1]) < 100  # not [100, 90, 80, 10] vs rest


def test_sample_counted_cut_is_consecutive_runs():
    assert cut_mini_batch([3] * 8, 2, 0, 2) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


def samples(lengths, prompt=2):
    rng = np.random.default_rng(0)
    return [
        Sample(
            tokens=rng.integers(0, 30, n).astype(np.int32),
            prompt_len=prompt,
            behaviour_logprobs=-rng.random(n - prompt).astype(np.float32),
            advantage=float(i),
            reward=0.5,
            version_min=3,
            version_max=4,
        )
        for i, n in enumerate(lengths)
    ]


def test_shares_carry_the_cut_and_the_mini_batch_tokens():
    lengths = [3, 9, 4, 12, 5, 6, 7, 8, 3, 10, 11, 4]
    batch = samples(lengths)
    shares = split_rollout_batch(batch, mini_batches=2, dp_size=2, seed=1, version=5, max_staleness=1, token_budget=16)
    for share in shares:
        back = decode_share(encode_share(share))
        assert back.micro_sizes == share.micro_sizes and len(back.micro_sizes) == 2
        assert [s.advantage for s in back.samples] == [s.advantage for s in share.samples]
        assert back.mini_batch_tokens == share.mini_batch_tokens
        start = 0
        for sizes in back.micro_sizes:
            for n in sizes:
                mb = back.samples[start : start + n]
                assert n == 1 or sum(len(s.tokens) for s in mb) <= 16
                start += n
        assert start == len(back.samples) == 3 * 2
    assert [len(m) for m in shares[0].micro_sizes] == [len(m) for m in shares[1].micro_sizes]
    # the token-level loss divides by every rank's completion tokens of the mini-batch
    assert sum(shares[0].mini_batch_tokens) == sum(n - 2 for n in lengths)
    assert sorted(s.advantage for sh in shares for s in sh.samples) == [float(i) for i in range(12)]


def test_deepspeed_sums_micro_batch_gradients_in_fp32_under_bf16():
    """Left to DeepSpeed's default (the model's dtype), each of a token-budget step's micro-batches would round
    the running gradient sum to bf16."""
    from learner.train.engines import UpdateLayout, deepspeed_config
    from protocol.config import load_config

    layout = UpdateLayout(mini_batches=1, ppo_epochs=1, micro_samples=1, accumulation=8, run_steps=100)
    bf16 = deepspeed_config(load_config(None, ["model.dtype=bfloat16"]), layout, 1e-6, cuda=True)
    assert bf16["bf16"]["enabled"] and bf16["data_types"]["grad_accum_dtype"] == "fp32"
    assert bf16["optimizer"]["params"]["fused"] is True  # torch's fused AdamW on CUDA
    fp32 = deepspeed_config(load_config(None), layout, 1e-6, cuda=False)
    assert "data_types" not in fp32 and "fused" not in fp32["optimizer"]["params"]
