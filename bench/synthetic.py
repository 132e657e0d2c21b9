"""Seeded synthetic rollout groups for driving the learner without actors (benchmarks, multi-rank tests)."""

from __future__ import annotations

import numpy as np

from protocol.messages import RolloutGroup


def synthetic_groups(
    *,
    groups: int,
    samples: int,
    seed: int,
    version: int,
    prompt_len: int,
    completion: tuple[int, int],
    vocab: tuple[int, int],
    behaviour_logp: float,
    actor_id: str = "synthetic",
) -> list[RolloutGroup]:
    """`groups` groups of `samples` completions, lengths uniform in `completion` (inclusive), token ids in `vocab`
    [lo, hi), behaviour logprobs near `behaviour_logp`, 0/1 rewards, all generated at `version`."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        lengths = rng.integers(completion[0], completion[1] + 1, size=samples).astype(np.int32)
        total = int(lengths.sum())
        out.append(
            RolloutGroup(
                actor_id=actor_id,
                prompt_id=g,
                epoch=seed,
                prompt_tokens=rng.integers(*vocab, size=prompt_len).astype(np.int32),
                lengths=lengths,
                completion_tokens=rng.integers(*vocab, size=total).astype(np.int32),
                behaviour_logprobs=(behaviour_logp - 0.1 * rng.random(total)).astype(np.float32),
                rewards=rng.integers(0, 2, size=samples).astype(np.float32),
                finish_reasons=["stop"] * samples,
                version_min=version,
                version_max=version,
                gen_s=0.1,
                reward_s=0.0,
            )
        )
    return out
