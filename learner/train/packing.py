"""Pack a micro-batch's samples into one row with no padding.

The row is the samples back to back: input_ids [1, N], position_ids restarting at 0
for each sample (so RoPE sees each sample from its own start), and cu_seqlens, the
sample boundaries that the varlen attention (learner/train/attention/varlen.py, plugged
into the model by learner/train/attention/hf.py) keeps apart. Completion tokens are laid
out flat exactly as in learner/train/batch.py's padded MicroBatch (same order, same fields), with score_rows all 0 and score_cols the
packed position whose logit predicts each token, so `token_logprobs` and the losses
apply unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from learner.train.batch import Sample


@dataclass(kw_only=True, slots=True)
class PackedBatch:
    input_ids: torch.Tensor  # int64 [1, N]: the samples back to back
    position_ids: torch.Tensor  # int64 [1, N]: 0..len-1 within each sample
    cu_seqlens: torch.Tensor  # int32 [S+1]: sample s occupies [cu_seqlens[s], cu_seqlens[s+1])
    max_seqlen: int  # longest sample (flash-attn wants it as a host int)
    score_rows: torch.Tensor  # int64 [T]: all 0 (one row)
    score_cols: torch.Tensor  # int64 [T]: packed position whose logit predicts each completion token
    targets: torch.Tensor  # int64 [T]
    behaviour_logp: torch.Tensor  # float32 [T]
    token_adv: torch.Tensor  # float32 [T]
    on_policy: torch.Tensor  # bool [T]
    rewards: torch.Tensor  # float32 [S]: each sample's reward (GAE puts it on the last token)
    lengths: torch.Tensor  # int64 [S]: scored tokens of each sample

    def model_kwargs(self) -> dict:
        """Forward kwargs for a model whose attention is "fleetrl_varlen" (names are transformers' own)."""
        return dict(
            input_ids=self.input_ids,
            position_ids=self.position_ids,
            cu_seq_lens_q=self.cu_seqlens,
            cu_seq_lens_k=self.cu_seqlens,
            max_length_q=self.max_seqlen,
            max_length_k=self.max_seqlen,
        )

    def to(self, device: torch.device | str) -> PackedBatch:
        return replace(
            self,
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            cu_seqlens=self.cu_seqlens.to(device),
            score_rows=self.score_rows.to(device),
            score_cols=self.score_cols.to(device),
            targets=self.targets.to(device),
            behaviour_logp=self.behaviour_logp.to(device),
            token_adv=self.token_adv.to(device),
            on_policy=self.on_policy.to(device),
        )


def pack_samples(samples: list[Sample], version: int) -> PackedBatch:
    """One row holding `samples` in order; `version` marks the on-policy tokens (staleness 0)."""
    assert samples, "cannot pack an empty micro-batch"
    lengths = [len(s.tokens) for s in samples]
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = torch.from_numpy(np.concatenate([s.tokens for s in samples]).astype(np.int64))
    positions = torch.cat([torch.arange(n) for n in lengths])
    cols, behaviour, adv, on_policy = [], [], [], []
    for s, start in zip(samples, starts[:-1].tolist(), strict=True):
        at = torch.from_numpy(s.scored())
        c = len(at)
        assert len(s.behaviour_logprobs) == c, f"{len(s.behaviour_logprobs)} behaviour logprobs for {c} scored tokens"
        cols.append(start + at - 1)
        behaviour.append(torch.from_numpy(np.asarray(s.behaviour_logprobs, dtype=np.float32)))
        adv.append(torch.full((c,), s.advantage, dtype=torch.float32))
        on_policy.append(torch.full((c,), s.version_min == s.version_max == version))
    score_cols = torch.cat(cols)
    return PackedBatch(
        input_ids=ids[None],
        position_ids=positions[None],
        cu_seqlens=torch.from_numpy(starts.astype(np.int32)),
        max_seqlen=max(lengths),
        score_rows=torch.zeros_like(score_cols),
        score_cols=score_cols,
        targets=ids[score_cols + 1],
        behaviour_logp=torch.cat(behaviour),
        token_adv=torch.cat(adv),
        on_policy=torch.cat(on_policy),
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
        lengths=torch.tensor([s.n_scored for s in samples], dtype=torch.long),
    )


@dataclass(kw_only=True, slots=True)
class PackingEfficiency:
    """Useful tokens / tokens the model processes (a sample's prompt and completion both count as useful)."""

    padded: float  # right-padded [B, max_len] batch
    packed: float  # one packed row, padded only to a multiple of the sequence-parallel size


def packing_efficiency(lengths: list[int], sp_size: int = 1) -> PackingEfficiency:
    if not lengths or min(lengths) < 1:
        raise ValueError(f"packing_efficiency: lengths must be a non-empty list of positive ints, got {lengths}")
    useful = sum(lengths)
    packed_len = -(-useful // sp_size) * sp_size
    return PackingEfficiency(padded=useful / (len(lengths) * max(lengths)), packed=useful / packed_len)
