"""How a mini-batch's samples are dealt to the data-parallel ranks and cut into micro-batches.

Two ways to size a micro-batch (train.max_tokens_per_micro_batch):
- samples (0): every micro-batch holds train.micro_batch_samples samples, the ranks get equal
  consecutive runs of the shuffled mini-batch;
- tokens (> 0): the ranks get equal numbers of samples with balanced token totals (the
  longest first, each to the rank with the fewest tokens so far), then each rank's samples are
  packed first-fit decreasing into micro-batches of at most the budget. A sample longer than
  the budget gets a micro-batch of its own.

Every rank must run the same number of micro-batches per mini-batch: ZeRO-2/3 reduce the
gradients inside each backward, a collective, so a rank with one micro-batch fewer would
leave the others waiting in it until the timeout. Rank 0 therefore picks, per mini-batch,
the largest count any rank needs and splits the other ranks' largest micro-batches until
they have as many (each rank has at least that many samples, so this always works).

The loss does not depend on the cut: every micro-batch divides by the whole mini-batch's
token count (learner/train/losses.py), so the micro-batches' losses sum to the mini-batch's.
"""

from __future__ import annotations

import heapq


def balanced_ranks(lengths: list[int], ranks: int) -> list[list[int]]:
    """Indices dealt to `ranks` ranks, len(lengths) / ranks each, token totals balanced (longest first)."""
    per_rank, rest = divmod(len(lengths), ranks)
    assert rest == 0, f"{len(lengths)} samples do not split over {ranks} ranks"
    out: list[list[int]] = [[] for _ in range(ranks)]
    heap = [(0, r) for r in range(ranks)]  # (tokens so far, rank): ranks with room left
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        tokens, r = heapq.heappop(heap)
        out[r].append(i)
        if len(out[r]) < per_rank:
            heapq.heappush(heap, (tokens + lengths[i], r))
    return out


def pack_tokens(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices into micro-batches of at most `budget` tokens, first-fit decreasing (an oversize sample alone)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return bins


def split_to(bins: list[list[int]], lengths: list[int], count: int) -> list[list[int]]:
    """Split the micro-batch with the most tokens (of those with 2+ samples) in two until there are `count`."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        assert splittable, f"{sum(map(len, bins))} samples cannot fill {count} micro-batches"
        b = max(splittable, key=lambda b: sum(lengths[i] for i in bins[b]))
        halves: tuple[list[int], list[int]] = ([], [])
        for i in sorted(bins[b], key=lambda i: -lengths[i]):  # each to the lighter half
            min(halves, key=lambda h: (sum(lengths[j] for j in h), len(h))).append(i)
        bins[b : b + 1] = [halves[0], halves[1]]
    return bins


def cut_mini_batch(lengths: list[int], ranks: int, budget: int, samples: int) -> list[list[list[int]]]:
    """One mini-batch: for each rank, its micro-batches as lists of indices into `lengths`.

    `budget` > 0 packs by tokens (equal micro-batch counts on every rank); 0 cuts consecutive
    runs of `samples` samples, as the shuffled order has them.
    """
    if budget <= 0:
        per_rank = len(lengths) // ranks
        assert per_rank * ranks == len(lengths) and per_rank % samples == 0, (len(lengths), ranks, samples)
        return [[list(range(r * per_rank + i, r * per_rank + i + samples)) for i in range(0, per_rank, samples)] for r in range(ranks)]
    dealt = balanced_ranks(lengths, ranks)
    packed = [[[mine[i] for i in b] for b in pack_tokens([lengths[i] for i in mine], budget)] for mine in dealt]
    count = max(len(p) for p in packed)
    return [split_to(p, lengths, count) for p in packed]
