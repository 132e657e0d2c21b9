"""Per-step metrics of the rollouts themselves (not of the update): what the actors generated and how it scored.

response/length_mean, response/length_max   completion tokens, over every completion of the batch
response/truncation_rate                    share of completions that ran into rollout.max_tokens
                                            (finish reason "length": cut off, not finished)
reward/part/<name>                          mean of each named reward part, over the completions whose group
                                            carries it (a group carries every part any of its completions returned);
                                            the run's first MAX_RUN_PART_NAMES names only, so that no actor can
                                            mint metric keys without bound (the hub bounds them per group)
reward/errors                               completions whose reward function raised or timed out (scored 0),
                                            over every group received for the step, filtered ones included: a
                                            failing reward scores a whole group 0, and algo.filter_equal_rewards
                                            drops exactly such groups
env/turns_mean, env/tool_calls_mean         episodes (rollout.env): model turns and tool calls per episode
env/tool_use_share                          share of episodes with at least one tool call
env/obs_token_share                         observation tokens / completion tokens (model and observation)
env/step_s                                  seconds in the environment per model turn
env/errors, env/timeouts                    episodes of the step's groups (filtered ones included) that a failing
                                            environment ended (rollout.env_errors = zero: trained, scored 0);
                                            requeued ones never reach a step: hub/env_errors counts every one
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from protocol.messages import MAX_REWARD_PARTS, RolloutGroup

PART_PREFIX = "reward/part/"
MAX_RUN_PART_NAMES = 4 * MAX_REWARD_PARTS  # reward part names one run reports (a mix of datasets each with its own)


def rollout_metrics(
    groups: list[RolloutGroup], filtered: Sequence[RolloutGroup] = (), part_names: set[str] | None = None
) -> dict[str, float]:
    """`groups`: the step's trained groups; `filtered`: the ones received with them and dropped (counted for errors).
    `part_names`: the run's reported part names so far, added to here; a name beyond MAX_RUN_PART_NAMES of them is
    left out (None: no bound, one step alone)."""
    assert groups, "a step trains at least one group"
    lengths = np.concatenate([g.lengths for g in groups])
    reasons = [r for g in groups for r in g.finish_reasons]
    out = {
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/truncation_rate": sum(r == "length" for r in reasons) / len(reasons),
        "reward/errors": float(sum(g.reward_errors for g in [*groups, *filtered])),
    }
    out.update(episode_metrics(groups, filtered))
    parts: dict[str, list[np.ndarray]] = defaultdict(list)
    for g in groups:
        if not g.reward_part_names:
            continue
        table = g.reward_parts.reshape(len(g.lengths), len(g.reward_part_names))  # row-major [n, k]
        for j, name in enumerate(g.reward_part_names):
            if part_names is not None and name not in part_names:
                if len(part_names) >= MAX_RUN_PART_NAMES:
                    continue
                part_names.add(name)
            parts[name].append(table[:, j])
    for name in sorted(parts):
        out[PART_PREFIX + name] = float(np.concatenate(parts[name]).mean(dtype=np.float64))  # float32 parts may be huge
    return out


def episode_metrics(groups: Sequence[RolloutGroup], filtered: Sequence[RolloutGroup] = ()) -> dict[str, float]:
    """env/* of the step's episodes; {} when its groups are single completions (no rollout.env)."""
    episodes = [g for g in groups if len(g.turns)]
    if not episodes:
        return {}
    turns = np.concatenate([g.turns for g in episodes]).astype(np.float64)
    calls = np.concatenate([g.tool_calls for g in episodes]).astype(np.float64)
    tokens = sum(int(g.lengths.sum()) for g in episodes)
    observed = sum(int(len(g.loss_mask) - g.loss_mask.sum(dtype=np.int64)) for g in episodes)
    everything = [*groups, *filtered]
    return {
        "env/turns_mean": float(turns.mean()),
        "env/tool_calls_mean": float(calls.mean()) if len(calls) else 0.0,
        "env/tool_use_share": float((calls > 0).mean()) if len(calls) else 0.0,
        "env/obs_token_share": observed / max(tokens, 1),
        "env/step_s": sum(g.env_s for g in episodes) / max(float(turns.sum()), 1.0),
        "env/errors": float(sum(g.env_errors for g in everything)),
        "env/timeouts": float(sum(g.env_timeouts for g in everything)),
    }
