"""One update per rollout batch, on every learner rank: S = mini_batches x ppo_epochs optimizer steps.

    rank 0: groups -> advantages -> samples -> shares (learner/shard.py) --scatter--> every rank
    every rank, for each PPO epoch, for each mini-batch (one optimizer step):
        its micro-batches: learner logprobs -> clipped loss -> backward (gradient accumulation)
        DeepSpeed step: gradients averaged over the learner ranks, AdamW, ZeRO sharding

The ratio is taken against the behaviour logprobs the actor sampled with. The loss is
token-level over the mini-batch's tokens on ALL ranks (`Share.mini_batch_tokens`);
DeepSpeed averages gradients over the world, so each rank's loss is scaled by the world
size to make the sum come out exactly as on one process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from learner import staleness as st
from learner.batch import Sample, group_samples, make_micro_batch, token_logprobs
from learner.distributed import Topology
from learner.losses import ADVANTAGES, ppo_clip_loss
from learner.shard import Share, split_rollout_batch
from protocol.config import Config
from protocol.messages import RolloutGroup


@dataclass(frozen=True, slots=True)
class StepLayout:
    """The per-rank batch arithmetic of one update (validated at start by learner/plan.py)."""

    mini_batches: int
    ppo_epochs: int
    micro_samples: int  # samples per forward/backward
    accumulation: int  # micro-batches per optimizer step on one rank

    @property
    def steps(self) -> int:
        return self.mini_batches * self.ppo_epochs


def deepspeed_config(cfg: Config, layout: StepLayout) -> dict:
    return {
        "train_micro_batch_size_per_gpu": layout.micro_samples,
        "gradient_accumulation_steps": layout.accumulation,
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
    loss: float  # mean over the update's optimizer steps
    samples: int
    tokens: int
    logprob_mismatch: float  # mean |behaviour - learner| over staleness-0 tokens at the first step; nan when none
    on_policy_tokens: int
    clip_frac: float
    grad_norm: float  # of the last optimizer step


def make_shares(cfg: Config, groups: list[RolloutGroup], version: int, max_staleness: int, dp_size: int) -> tuple[list[Share], torch.Tensor]:
    """Rank 0: group-level advantages, then the samples cut into one share per DP rank."""
    rewards = torch.from_numpy(np.stack([g.rewards for g in groups]).astype(np.float32))
    advantages = ADVANTAGES[cfg.algo.advantage](rewards)
    samples = [s for g, adv in zip(groups, advantages, strict=True) for s in group_samples(g, adv)]
    shares = split_rollout_batch(samples, cfg.train.mini_batches, dp_size, seed=cfg.run.seed * 1_000_003 + version,
                                 version=version, max_staleness=max_staleness)
    return shares, advantages


class Trainer:
    def __init__(self, cfg: Config, model: torch.nn.Module, topo: Topology, layout: StepLayout):
        import deepspeed

        self.cfg, self.topo, self.layout = cfg, topo, layout
        self.engine, *_ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=deepspeed_config(cfg, layout))

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(self.engine.module.named_parameters())

    def full_shapes(self) -> list[list[int]]:
        """Unsharded shapes (ZeRO-3 leaves an empty placeholder in `.shape` and the real one in `.ds_shape`)."""
        return [list(getattr(p, "ds_shape", p.shape)) for _, p in self.named_parameters()]

    @contextlib.contextmanager
    def gathered(self, params: list[torch.nn.Parameter]) -> Iterator[None]:
        """Collective under ZeRO-3: the full values of `params` on every rank inside the block."""
        if self.cfg.train.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                yield
        else:
            yield

    def snapshot(self, buckets: list[range], dtype: torch.dtype, out: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        """Collective: rank 0 copies the weights into one flat tensor per bucket (reusing `out`); others join the gathers."""
        params = [p for _, p in self.named_parameters()]
        shapes = self.full_shapes()
        if self.topo.is_root and out is None:
            out = [torch.empty(sum(int(np.prod(shapes[i])) for i in b), dtype=dtype) for b in buckets]
        for k, bucket in enumerate(buckets):
            chunk = [params[i] for i in bucket]
            with self.gathered(chunk), torch.no_grad():
                if self.topo.is_root:
                    assert out is not None
                    torch.cat([p.detach().reshape(-1).to(dtype).cpu() for p in chunk], out=out[k])
        return out if self.topo.is_root else None

    def update(self, share: Share) -> UpdateStats:
        """Train this rank's share: S optimizer steps from `share.version`. Stats are summed over ranks."""
        steps, version, max_staleness = self.layout.steps, share.version, share.max_staleness
        for s in share.samples:  # the hard invariant, checked once more where it matters
            assert st.admissible(version, s.version_min, max_staleness, steps), (
                f"sample of version {s.version_min} in update {version} -> {version + steps} breaks max_staleness={max_staleness}")
        per_mb = len(share.samples) // self.layout.mini_batches
        micro = self.layout.micro_samples
        scale = float(self.topo.world)  # DeepSpeed averages gradients over the ranks; the loss is a sum
        self.engine.train()
        steps_before = self.engine.global_steps
        sums = torch.zeros(5, dtype=torch.float64)  # loss, clipped tokens, mismatch sum, on-policy tokens, tokens
        for epoch in range(self.layout.ppo_epochs):
            for j in range(self.layout.mini_batches):
                mb_samples = share.samples[j * per_mb : (j + 1) * per_mb]
                total_tokens = share.mini_batch_tokens[j]
                chunks = [mb_samples[i : i + micro] for i in range(0, len(mb_samples), micro)]
                assert len(chunks) == self.layout.accumulation, f"{len(chunks)} micro-batches, DeepSpeed expects {self.layout.accumulation}"
                first_step = epoch == 0 and j == 0
                for chunk in chunks:
                    sums += self._micro_step(chunk, version + epoch * self.layout.mini_batches + j, total_tokens, scale, first_step)
                    # DeepSpeed counts micro-steps: step() after every backward, the optimizer runs at the boundary.
                    self.engine.step()
        assert self.engine.global_steps == steps_before + steps, "DeepSpeed did not take exactly S optimizer steps"
        if self.topo.world > 1:
            dist.all_reduce(sums)
        loss, clipped, mismatch, on_policy, tokens = sums.tolist()
        grad_norm = self.engine.get_global_grad_norm()
        return UpdateStats(
            loss=loss / steps, samples=len(share.samples) * self.topo.dp_size, tokens=int(tokens) // self.layout.ppo_epochs,
            logprob_mismatch=mismatch / on_policy if on_policy else float("nan"), on_policy_tokens=int(on_policy),
            clip_frac=clipped / tokens if tokens else 0.0, grad_norm=float(grad_norm) if grad_norm is not None else float("nan"))

    def _micro_step(self, chunk: list[Sample], step_version: int, total_tokens: int, scale: float, first_step: bool) -> torch.Tensor:
        mb = make_micro_batch(chunk, step_version)
        logits = self.engine(input_ids=mb.input_ids.to(self.topo.device), attention_mask=mb.attention_mask.to(self.topo.device)).logits
        logp = token_logprobs(logits, mb, self.cfg.rollout.temperature).cpu()
        out = ppo_clip_loss(logp, mb.behaviour_logp, mb.token_adv, self.cfg.algo.clip_low, self.cfg.algo.tis_cap, total_tokens)
        self.engine.backward(out.loss * scale, scale_wrt_gas=False)
        diff = (logp.detach() - mb.behaviour_logp).abs()[mb.on_policy] if first_step else torch.zeros(0)
        return torch.tensor([out.loss.item(), out.clip_frac.item() * len(logp), diff.sum().item(), diff.numel(), len(logp)],
                            dtype=torch.float64)
