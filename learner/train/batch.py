"""Turn rollout groups into training tensors: advantages per sample, then padded micro-batches.

A sample is prompt + completion; only the completion tokens the model sampled carry loss (the "scored" tokens:
all of a one-turn completion; in a multi-turn episode its loss mask leaves out the observation tokens, which
stay in the sequence as context). The logit at position t predicts token t+1, so completion token j of a sample
whose prompt has P tokens is scored by the logit at position P - 1 + j. Every loss, advantage and metric sees
only the scored tokens, so none can count an observation token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from protocol.messages import RolloutGroup


class InvalidBatch(ValueError):
    """Rank 0 refuses a rollout batch no model could train on; the update is aborted, its prompts requeued."""


def check_batch(groups: list[RolloutGroup], vocab_size: int | None) -> None:
    """The learner's own guard, behind the hub's admission checks (learner/hub/core/checks.py): an id outside the
    embedding crashes the forward (on a GPU, a device-side assert that poisons the CUDA context), and a
    non-finite logprob or reward turns the whole update into NaN. Raises InvalidBatch naming the group."""
    for g in groups:
        where = f"group of prompt {g.prompt_id} (epoch {g.epoch}) from {g.actor_id!r}"
        ids = np.concatenate([g.prompt_tokens, g.completion_tokens])
        if ids.size and vocab_size is not None and (ids.min() < 0 or ids.max() >= vocab_size):
            raise InvalidBatch(f"{where}: token ids {int(ids.min())}..{int(ids.max())} outside the embedding's 0..{vocab_size - 1}")
        logprobs = g.behaviour_logprobs[g.model_tokens()]
        if not np.isfinite(logprobs).all() or (logprobs.size and logprobs.max() > 0):
            raise InvalidBatch(f"{where}: behaviour logprobs not all finite and <= 0")
        if not np.isfinite(g.rewards).all():
            raise InvalidBatch(f"{where}: non-finite reward")


@dataclass(kw_only=True, slots=True)
class Sample:
    tokens: np.ndarray  # int32 [prompt_len + completion_len]
    prompt_len: int
    behaviour_logprobs: np.ndarray  # float32 [scored tokens]: the model's tokens only
    advantage: float
    reward: float
    version_min: int
    version_max: int
    # uint8 [completion_len]: 1 = the model's token (scored), 0 = an observation (context); None = all the model's
    loss_mask: np.ndarray | None = None

    def scored(self) -> np.ndarray:
        """int64: positions in `tokens` of the scored tokens, ascending."""
        if self.loss_mask is None:
            return np.arange(self.prompt_len, len(self.tokens), dtype=np.int64)
        return self.prompt_len + np.flatnonzero(self.loss_mask).astype(np.int64)

    @property
    def n_scored(self) -> int:
        return len(self.tokens) - self.prompt_len if self.loss_mask is None else int(np.count_nonzero(self.loss_mask))


def group_samples(group: RolloutGroup, advantages: torch.Tensor) -> list[Sample]:
    """Split a group's flat arrays into samples; `advantages` is [n] for this group."""
    out, offset = [], 0
    masked = len(group.loss_mask) > 0 and not group.loss_mask.all()
    for i, length in enumerate(group.lengths.tolist()):
        completion = group.completion_tokens[offset : offset + length]
        mask = group.loss_mask[offset : offset + length] if masked else None
        logprobs = group.behaviour_logprobs[offset : offset + length]
        out.append(
            Sample(
                tokens=np.concatenate([group.prompt_tokens, completion]),
                prompt_len=int(group.prompt_tokens.shape[0]),
                behaviour_logprobs=logprobs if mask is None else logprobs[mask.astype(bool)],
                advantage=float(advantages[i]),
                reward=float(group.rewards[i]),
                version_min=group.version_min,
                version_max=group.version_max,
                loss_mask=mask,
            )
        )
        offset += length
    return out


@dataclass(kw_only=True, slots=True)
class MicroBatch:
    input_ids: torch.Tensor  # int64 [B, L], right-padded with 0
    attention_mask: torch.Tensor  # int64 [B, L]
    score_rows: torch.Tensor  # int64 [T]: sample index of each scored token
    score_cols: torch.Tensor  # int64 [T]: logit position that predicts it
    targets: torch.Tensor  # int64 [T]: the scored token
    behaviour_logp: torch.Tensor  # float32 [T]
    token_adv: torch.Tensor  # float32 [T]
    on_policy: torch.Tensor  # bool [T]: token's sample has staleness 0 (for logprob_mismatch)
    rewards: torch.Tensor  # float32 [B]: each sample's reward (GAE puts it on the last token)
    lengths: torch.Tensor  # int64 [B]: scored tokens of each sample

    def model_kwargs(self) -> dict:
        return dict(input_ids=self.input_ids, attention_mask=self.attention_mask)


def make_micro_batch(samples: list[Sample], version: int) -> MicroBatch:
    length = max(len(s.tokens) for s in samples)
    ids = torch.zeros(len(samples), length, dtype=torch.long)
    mask = torch.zeros(len(samples), length, dtype=torch.long)
    rows, cols, targets, behaviour, adv, on_policy = [], [], [], [], [], []
    for b, s in enumerate(samples):
        n = len(s.tokens)
        ids[b, :n] = torch.from_numpy(s.tokens.astype(np.int64))
        mask[b, :n] = 1
        at = torch.from_numpy(s.scored())
        c = len(at)
        rows.append(torch.full((c,), b))
        cols.append(at - 1)
        targets.append(ids[b, at])
        behaviour.append(torch.from_numpy(np.asarray(s.behaviour_logprobs, dtype=np.float32)))
        adv.append(torch.full((c,), s.advantage))
        on_policy.append(torch.full((c,), s.version_min == s.version_max == version))
    return MicroBatch(
        input_ids=ids,
        attention_mask=mask,
        score_rows=torch.cat(rows),
        score_cols=torch.cat(cols),
        targets=torch.cat(targets),
        behaviour_logp=torch.cat(behaviour),
        token_adv=torch.cat(adv).float(),
        on_policy=torch.cat(on_policy),
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
        lengths=torch.tensor([s.n_scored for s in samples], dtype=torch.long),
    )


class TokenBatch(Protocol):
    """A micro-batch in any layout (learner/train/layout.py): MicroBatch, PackedBatch or SequenceShard.

    The model runs on `model_kwargs()`; the completion tokens it scores are flat [T],
    in the same order in every layout, so losses and metrics never see the layout.
    """

    score_rows: torch.Tensor
    score_cols: torch.Tensor
    targets: torch.Tensor
    behaviour_logp: torch.Tensor
    token_adv: torch.Tensor
    on_policy: torch.Tensor

    def model_kwargs(self) -> dict: ...


def token_logprobs(logits: torch.Tensor, mb: TokenBatch, temperature: float) -> torch.Tensor:
    """Logprobs [T] of the completion tokens under softmax(logits / temperature): the sampled distribution."""
    dev = logits.device
    picked = logits[mb.score_rows.to(dev), mb.score_cols.to(dev)].float() / temperature
    return torch.log_softmax(picked, dim=-1).gather(1, mb.targets.to(dev)[:, None]).squeeze(1)
