"""One policy update per batch of groups: advantages, learner logprobs, clipped loss, AdamW via DeepSpeed.

The learner recomputes its own logprobs of every completion token; the ratio is
taken against the behaviour logprobs the actor sampled with. One optimizer step
per batch; micro-batches accumulate gradients (DeepSpeed's gradient accumulation,
with the loss already normalised by the step's total tokens).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from learner import staleness as st
from learner.advantages import GroupAdvantage, make_advantage
from learner.batch import group_samples, make_micro_batch, token_logprobs
from learner.hub import Accepted
from learner.losses import make_policy_loss
from protocol.config import Config, ConfigError


def init_distributed() -> None:
    """Join (or, for a lone process, create) the learner's default process group."""
    import deepspeed

    if "RANK" not in os.environ:
        from protocol.net import free_port

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")


def deepspeed_config(cfg: Config, micro_batches: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_samples,
        "gradient_accumulation_steps": micro_batches,
        "gradient_clipping": cfg.train.grad_clip,
        "optimizer": {
            "type": "AdamW",
            # torch_adam: DeepSpeed's fused CPU Adam needs a compiled op that the CPU build lacks.
            "params": {"lr": cfg.train.lr, "weight_decay": cfg.train.weight_decay, "betas": [0.9, 0.999], "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": cfg.train.lr, "warmup_num_steps": max(1, cfg.train.warmup_steps), "warmup_type": "linear"},
        },
        "zero_optimization": {"stage": cfg.train.zero_stage},
        "bf16": {"enabled": cfg.model.dtype == "bfloat16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


@dataclass(kw_only=True, slots=True)
class UpdateStats:
    loss: float
    reward_mean: float
    samples: int
    tokens: int
    staleness_max: int
    staleness_mean: float
    logprob_mismatch: float  # mean |behaviour - learner| over staleness-0 tokens; nan when there are none
    on_policy_tokens: int
    clip_frac: float
    grad_norm: float
    adv_abs_mean: float


class Trainer:
    def __init__(self, cfg: Config, model: torch.nn.Module):
        import deepspeed

        self.cfg = cfg
        samples = cfg.train.prompts_per_step * cfg.rollout.samples_per_prompt
        self.micro_batches = math.ceil(samples / cfg.train.micro_batch_samples)
        advantage = make_advantage(cfg.algo)
        if not isinstance(advantage, GroupAdvantage):
            raise ConfigError(f"algo.advantage: {cfg.algo.advantage!r} needs the critic, which this trainer does not run yet")
        self.advantage = advantage
        self.policy_loss = make_policy_loss(cfg.algo)
        if self.policy_loss.needs_reference or self.policy_loss.needs_entropy:
            raise ConfigError(f"algo.kl_coef={cfg.algo.kl_coef}, algo.entropy_coef={cfg.algo.entropy_coef}: "
                              "the reference model and the entropy bonus are not wired into this trainer yet (use 0)")
        self.engine, *_ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=deepspeed_config(cfg, self.micro_batches))

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(self.engine.module.named_parameters())

    def update(self, batch: list[Accepted], version: int, max_staleness: int) -> UpdateStats:
        groups = [item.group for item in batch]
        for g in groups:  # the hard invariant, checked once more where it matters
            assert st.admissible(version, g.version_min, max_staleness), (
                f"sample of version {g.version_min} in update {version} -> {version + 1} breaks max_staleness={max_staleness}")
        rewards = torch.from_numpy(np.stack([g.rewards for g in groups]).astype(np.float32))
        advantages = self.advantage.per_sample(rewards)
        samples = [s for g, adv in zip(groups, advantages, strict=True) for s in group_samples(g, adv)]
        total_tokens = sum(len(s.tokens) - s.prompt_len for s in samples)
        micro = self.cfg.train.micro_batch_samples
        chunks = [samples[i : i + micro] for i in range(0, len(samples), micro)]
        assert len(chunks) == self.micro_batches, f"{len(chunks)} micro-batches, DeepSpeed expects {self.micro_batches}"

        self.engine.train()
        steps_before = self.engine.global_steps
        loss_sum, clip_sum, mismatch_sum, on_policy = 0.0, 0.0, 0.0, 0
        for chunk in chunks:
            mb = make_micro_batch(chunk, version)
            logits = self.engine(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
            logp = token_logprobs(logits, mb, self.cfg.rollout.temperature)
            # One optimizer step per batch: the learner before this update is the one computing logp now.
            prox = logp.detach() if self.policy_loss.needs_prox else None
            out = self.policy_loss(logp, mb.behaviour_logp, mb.token_adv, total_tokens, prox_logp=prox)
            self.engine.backward(out.loss, scale_wrt_gas=False)
            self.engine.step()
            loss_sum += out.loss.item()
            clip_sum += out.clip_frac.item() * len(logp)
            diff = (logp.detach() - mb.behaviour_logp).abs()[mb.on_policy]
            mismatch_sum += diff.sum().item()
            on_policy += int(diff.numel())
        assert self.engine.global_steps == steps_before + 1, "DeepSpeed did not take exactly one optimizer step"
        stale = [version - g.version_min for g in groups]
        grad_norm = self.engine.get_global_grad_norm()
        return UpdateStats(
            loss=loss_sum, reward_mean=float(rewards.mean()), samples=len(samples), tokens=total_tokens,
            staleness_max=max(stale), staleness_mean=float(np.mean(stale)),
            logprob_mismatch=mismatch_sum / on_policy if on_policy else float("nan"), on_policy_tokens=on_policy,
            clip_frac=clip_sum / total_tokens, grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            adv_abs_mean=float(advantages.abs().mean()),
        )
