"""Rank 0 turns a rollout batch into one share per data-parallel rank (`make_shares`) and hands each out as one
flat byte buffer (`scatter_shares`).

    groups -> check -> group advantages (GRPO; GAE runs per rank) -> samples -> shuffle, mini-batches, DP ranks,
    micro-batches (learner/train/micro_batches.py) -> Share per DP rank -> scatter

A share is the rank's samples for every mini-batch of the update, in order (mini-batch 0's
samples first, each mini-batch's micro-batches back to back), how many samples each
micro-batch takes (learner/train/micro_batches.py decides), plus each mini-batch's completion-token and sample
counts over ALL ranks, which the loss divides by (learner/train/aggregation.py). Advantages that need a whole
group (GRPO) are computed on rank 0 before the split, so a group may span ranks.

Layout of the buffer (little endian):
    int64 header [samples, mini_batches, total token ids, scored tokens, version, max_staleness, save_step]
                                                                                   (samples = -1: stop)
    int64  mini_batch_tokens [mini_batches], mini_batch_samples [mini_batches], micro_counts [mini_batches]
    int32  micro_sizes [sum of micro_counts]: samples of each micro-batch, in order
    int32  lengths [samples], prompt_lens [samples], versions [samples, 2]
    float32 advantages [samples], rewards [samples]
    int32  tokens [total token ids]      float32 behaviour_logprobs [scored tokens]
    uint8  loss_mask [completion tokens]: 1 scored (the model's), 0 an observation (multi-turn context)

Everything crosses as two collectives per update: scatter of the sizes, then of the
buffers padded to the largest. Both work on gloo (CPU) and NCCL (CUDA tensors).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from learner.train.advantages import GroupAdvantage, make_advantage
from learner.train.batch import Sample, check_batch, group_samples
from learner.train.distributed import Topology
from learner.train.micro_batches import cut_mini_batch
from protocol.config import Config, TrainConfig
from protocol.messages import RolloutGroup

HEADER_BYTES = 7 * 8


@dataclass(kw_only=True, slots=True)
class Share:
    samples: list[Sample]
    mini_batch_tokens: list[int]  # scored tokens of each mini-batch summed over all DP ranks
    # samples of each mini-batch with at least one completion token, over all DP ranks (seq_mean_*, constant)
    mini_batch_samples: list[int] = field(default_factory=list)
    micro_sizes: list[list[int]] = field(default_factory=list)  # per mini-batch: samples of each micro-batch, in order
    version: int = 0  # the policy version the update starts from
    max_staleness: int = 0  # the bound in force for this update (it can change during a run)
    stop: bool = False  # rank 0 is ending the run: no update follows
    save_step: int = 0  # after this update (or before stopping) every rank saves its training state into checkpoint step-N (0 = no)


def encode_share(share: Share) -> np.ndarray:
    if share.stop:
        return np.array([-1, 0, 0, 0, 0, 0, share.save_step], dtype=np.int64).view(np.uint8)
    s = share.samples
    tokens = np.concatenate([x.tokens for x in s]).astype(np.int32) if s else np.zeros(0, np.int32)
    behaviour = np.concatenate([x.behaviour_logprobs for x in s]).astype(np.float32) if s else np.zeros(0, np.float32)
    masks = [np.ones(len(x.tokens) - x.prompt_len, np.uint8) if x.loss_mask is None else x.loss_mask for x in s]
    mask = np.concatenate(masks).astype(np.uint8) if s else np.zeros(0, np.uint8)
    parts = [
        np.array(
            [len(s), len(share.mini_batch_tokens), tokens.size, behaviour.size, share.version, share.max_staleness, share.save_step],
            dtype=np.int64,
        ),
        np.asarray(share.mini_batch_tokens, dtype=np.int64),
        np.asarray(share.mini_batch_samples, dtype=np.int64),
        np.array([len(m) for m in share.micro_sizes], dtype=np.int64),
        np.array([n for m in share.micro_sizes for n in m], dtype=np.int32),
        np.array([len(x.tokens) for x in s], dtype=np.int32),
        np.array([x.prompt_len for x in s], dtype=np.int32),
        np.array([[x.version_min, x.version_max] for x in s], dtype=np.int32).reshape(-1),
        np.array([x.advantage for x in s], dtype=np.float32),
        np.array([x.reward for x in s], dtype=np.float32),
        tokens,
        behaviour,
        mask,
    ]
    return np.concatenate([p.view(np.uint8) for p in parts])


def decode_share(buf: np.ndarray) -> Share:
    header = buf[:HEADER_BYTES].view(np.int64)
    n, mbs, ntok, ncomp, version, k, save_step = (int(x) for x in header)
    if n < 0:
        return Share(samples=[], mini_batch_tokens=[], stop=True, save_step=save_step)
    offset = HEADER_BYTES

    def take(dtype: type, count: int) -> np.ndarray:
        nonlocal offset
        size = np.dtype(dtype).itemsize * count
        out: np.ndarray = buf[offset : offset + size].view(dtype)
        offset += size
        return out

    mb_tokens, mb_samples = take(np.int64, mbs), take(np.int64, mbs)
    micro_counts = take(np.int64, mbs).tolist()
    flat_sizes = take(np.int32, sum(micro_counts)).tolist()
    bounds = np.cumsum([0, *micro_counts]).tolist()
    micro_sizes = [flat_sizes[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    lengths, prompt_lens = take(np.int32, n), take(np.int32, n)
    versions = take(np.int32, 2 * n).reshape(n, 2)
    advantages, rewards = take(np.float32, n), take(np.float32, n)
    tokens, behaviour = take(np.int32, ntok), take(np.float32, ncomp)
    mask = take(np.uint8, ntok - int(prompt_lens.sum(dtype=np.int64)))
    assert offset == buf.size, f"share buffer has {buf.size} bytes, layout needs {offset}"
    samples, t, c, k = [], 0, 0, 0
    for i in range(n):
        length, plen = int(lengths[i]), int(prompt_lens[i])
        own = mask[k : k + length - plen]
        scored = int(np.count_nonzero(own))
        samples.append(
            Sample(
                tokens=tokens[t : t + length],
                prompt_len=plen,
                behaviour_logprobs=behaviour[c : c + scored],
                advantage=float(advantages[i]),
                reward=float(rewards[i]),
                version_min=int(versions[i, 0]),
                version_max=int(versions[i, 1]),
                loss_mask=None if scored == len(own) else own,
            )
        )
        t, c, k = t + length, c + scored, k + length - plen
    return Share(
        samples=samples,
        mini_batch_tokens=[int(x) for x in mb_tokens],
        mini_batch_samples=[int(x) for x in mb_samples],
        micro_sizes=micro_sizes,
        version=version,
        max_staleness=k,
        save_step=save_step,
    )


def scatter_shares(topo: Topology, shares: list[Share] | None) -> Share:
    """Collective. Rank 0 passes one Share per DP rank; every rank gets its DP rank's share."""
    if topo.world == 1:
        assert shares is not None and len(shares) == 1
        return shares[0]
    dev = topo.device
    if topo.is_root:
        assert shares is not None and len(shares) == topo.dp_size, f"{len(shares or [])} shares for {topo.dp_size} DP ranks"
        bufs = [encode_share(shares[r // topo.sp_size]) for r in range(topo.world)]  # SP peers get the same share
        sizes = [torch.tensor([b.size], dtype=torch.int64, device=dev) for b in bufs]
    size = torch.zeros(1, dtype=torch.int64, device=dev)
    dist.scatter(size, sizes if topo.is_root else None, src=0)
    if topo.is_root:
        longest = max(b.size for b in bufs)
        padded = []
        for b in bufs:
            t = torch.zeros(longest, dtype=torch.uint8)
            t[: b.size] = torch.from_numpy(b)
            padded.append(t.to(dev))
        longest_t = torch.tensor([longest], dtype=torch.int64, device=dev)
    else:
        longest_t = torch.zeros(1, dtype=torch.int64, device=dev)
    dist.broadcast(longest_t, src=0)
    out = torch.empty(int(longest_t.item()), dtype=torch.uint8, device=dev)
    dist.scatter(out, padded if topo.is_root else None, src=0)
    return decode_share(out[: int(size.item())].cpu().numpy())


def make_shares(
    cfg: Config, groups: list[RolloutGroup], version: int, max_staleness: int, dp_size: int, vocab_size: int | None = None
) -> tuple[list[Share], torch.Tensor]:
    """Rank 0: group-level advantages, then the samples cut into one share per DP rank, and into micro-batches.

    Raises InvalidBatch (learner/train/batch.py) for groups no model could train on, before anything reaches
    another rank: token ids outside [0, vocab_size), non-finite or positive logprobs, non-finite rewards."""
    check_batch(groups, vocab_size)
    rewards = torch.from_numpy(np.stack([g.rewards for g in groups]).astype(np.float32))
    unit = make_advantage(cfg.algo)
    # Group advantages need the whole group, so rank 0 computes them; GAE is per sample and runs on each rank.
    # reinforce_baseline also whitens over the whole batch's completion tokens, hence the lengths.
    lengths = torch.from_numpy(np.stack([g.model_token_counts() for g in groups]).astype(np.int64))
    advantages = unit.per_sample(rewards, lengths) if isinstance(unit, GroupAdvantage) else torch.zeros_like(rewards)
    samples = [s for g, adv in zip(groups, advantages, strict=True) for s in group_samples(g, adv)]
    shares = split_rollout_batch(
        samples,
        cfg.train.mini_batches,
        dp_size,
        seed=cfg.run.seed * 1_000_003 + version,
        version=version,
        max_staleness=max_staleness,
        token_budget=token_budget(cfg.train),
        micro_samples=cfg.train.micro_batch_samples,
    )
    return shares, advantages


def token_budget(train: TrainConfig) -> int:
    """Tokens of one micro-batch (0: counted in samples). An SP group splits each micro-batch's row over its ranks."""
    return train.max_tokens_per_micro_batch * train.sequence_parallel_size


def split_rollout_batch(
    samples: list[Sample],
    mini_batches: int,
    dp_size: int,
    seed: int,
    version: int,
    max_staleness: int,
    token_budget: int = 0,
    micro_samples: int = 0,
) -> list[Share]:
    """Shuffle (seeded), cut into `mini_batches` equal mini-batches, deal each over `dp_size` ranks and cut
    each rank's part into micro-batches (learner/train/micro_batches.py): of `micro_samples` samples when
    `token_budget` is 0, else packed up to `token_budget` tokens, the same count on every rank.

    The batch arithmetic was checked at start (learner/plan/layout.py), so every cut is whole.
    """
    order = np.random.default_rng(seed).permutation(len(samples)) if mini_batches > 1 else np.arange(len(samples))
    per_mb = len(samples) // mini_batches
    assert per_mb * mini_batches == len(samples) and per_mb % dp_size == 0, (
        f"{len(samples)} samples do not split into {mini_batches} x {dp_size}"
    )
    micro = micro_samples or per_mb // dp_size
    shuffled = [samples[i] for i in order]
    shares = [Share(samples=[], mini_batch_tokens=[], version=version, max_staleness=max_staleness) for _ in range(dp_size)]
    for j in range(mini_batches):
        mini = shuffled[j * per_mb : (j + 1) * per_mb]
        cuts = cut_mini_batch([len(s.tokens) for s in mini], dp_size, token_budget, micro)
        tokens = sum(s.n_scored for s in mini)
        scored = sum(s.n_scored > 0 for s in mini)
        for share, micro_batches in zip(shares, cuts, strict=True):
            share.samples += [mini[i] for mb in micro_batches for i in mb]
            share.mini_batch_tokens.append(tokens)
            share.mini_batch_samples.append(scored)
            share.micro_sizes.append([len(mb) for mb in micro_batches])
    return shares
