"""The learner's update: batch sizes, optimizer and parallelism (train), and the RL algorithm (algo).

An update trains one rollout batch (train.prompts_per_step prompts) in S = train.mini_batches x
train.ppo_epochs optimizer steps. The policy version counts optimizer steps; train.total_steps counts updates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from protocol.config.errors import check_choices, need, parse_cpus

Advantage = Literal["grpo", "dr_grpo", "rloo", "reinforce_baseline", "gae"]
GrpoStd = Literal["biased", "unbiased"]
Correction = Literal["none", "tis", "decoupled"]
OldLogprobs = Literal["behaviour", "recompute"]
Ratio = Literal["token", "sequence"]
LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "micro_batch_token_mean", "constant"]
LrSchedule = Literal["constant", "linear", "cosine"]
KlEstimator = Literal["k1", "k2", "k3"]


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    # prompts (groups) in one update's rollout batch, trained in mini_batches x ppo_epochs optimizer steps
    prompts_per_step: int = 16
    total_steps: int = 100  # updates (rollout batches) in the run, not optimizer steps; total_episodes overrides it
    total_episodes: int = 0  # run length in samples (prompts x samples_per_prompt); 0 = use total_steps
    mini_batches: int = 1  # optimizer steps per rollout batch and PPO epoch (the batch split evenly)
    ppo_epochs: int = 1  # passes over each rollout batch: an update takes mini_batches x ppo_epochs optimizer steps
    lr: float = 5e-4  # AdamW peak learning rate
    # linear LR warmup, in optimizer steps: step t (from 0) of the first N runs at lr x (t + 1) / N, so the first
    # at lr / N, never 0; Adam's first steps are sign-like and jolt a small policy
    warmup_steps: int = 10
    lr_schedule: LrSchedule = "constant"  # after warmup: constant | linear | cosine decay to lr x min_lr_ratio over the run
    min_lr_ratio: float = 0.0  # linear/cosine: the floor of the decay, a fraction of lr, reached after the run's last step
    weight_decay: float = 0.0  # AdamW weight decay
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW (beta1, beta2), policy and critic
    adam_eps: float = 1e-8  # AdamW epsilon, added to sqrt(v): policy and critic
    grad_clip: float = 1.0  # global gradient-norm clip
    zero_stage: Literal[0, 1, 2, 3] = 2  # DeepSpeed ZeRO stage (0, 1, 2 or 3)
    micro_batch_samples: int = 64  # samples per forward/backward per data-parallel rank (accumulation beyond)
    # Token budget of one forward/backward per rank (0 = count micro-batches in samples, micro_batch_samples).
    # > 0: each rank packs its samples greedily up to this many tokens (prompt + completion), as verl's
    # ppo_max_token_len_per_gpu; micro_batch_samples is then ignored. With sequence parallelism one micro-batch
    # holds up to budget x sequence_parallel_size tokens, split over the SP group.
    max_tokens_per_micro_batch: int = 0
    gradient_checkpointing: bool = False  # recompute each decoder layer in backward: long generations fit (8k-16k)
    logprob_chunk_tokens: int = 1024  # tokens per chunk of the vocabulary projection: no [tokens, vocab] fp32 tensor
    packing: bool = True  # pack a micro-batch's samples into one row (no padding) instead of padding them
    sequence_parallel_size: int = 1  # learner ranks that share one packed sequence (ring attention)
    threads: int = 1  # torch intra-op threads in the learner process
    cpu_affinity: str = ""  # CPU ids the learner may run on, e.g. "0" or "0-3" ("" = all)

    def __post_init__(self) -> None:
        check_choices(self, "train")
        need(self.prompts_per_step >= 1, "train.prompts_per_step", "must be >= 1")
        need(self.total_steps >= 1, "train.total_steps", "must be >= 1")
        need(self.lr > 0, "train.lr", "must be > 0")
        need(self.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
        need(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", "must be in [0, 1]")
        need(
            len(self.adam_betas) == 2 and all(0 <= b < 1 for b in self.adam_betas),
            "train.adam_betas",
            f"{self.adam_betas} must be two numbers in [0, 1), e.g. [0.9, 0.999]",
        )
        need(self.adam_eps > 0, "train.adam_eps", "must be > 0")
        need(self.total_episodes >= 0, "train.total_episodes", "must be >= 0 (0 = use train.total_steps)")
        need(self.mini_batches >= 1, "train.mini_batches", "must be >= 1")
        need(self.ppo_epochs >= 1, "train.ppo_epochs", "must be >= 1")
        need(self.micro_batch_samples >= 1, "train.micro_batch_samples", "must be >= 1")
        need(self.max_tokens_per_micro_batch >= 0, "train.max_tokens_per_micro_batch", "must be >= 0 (0 = count in samples)")
        need(self.logprob_chunk_tokens >= 1, "train.logprob_chunk_tokens", "must be >= 1")
        need(self.sequence_parallel_size >= 1, "train.sequence_parallel_size", "must be >= 1")
        need(
            self.sequence_parallel_size == 1 or self.packing,
            "train.sequence_parallel_size",
            f"{self.sequence_parallel_size} needs train.packing = true (SP splits one packed row)",
        )
        parse_cpus(self.cpu_affinity, "train.cpu_affinity")


@dataclass(kw_only=True, slots=True)
class AlgoConfig:
    # grpo (group mean/std) | dr_grpo (group mean only) | rloo (leave-one-out mean) | reinforce_baseline (group mean,
    # then whitened over the batch: REINFORCE++-baseline) | gae (critic + GAE, i.e. PPO)
    advantage: Advantage = "grpo"
    grpo_std: GrpoStd = "biased"  # grpo's group std: biased (divide by n) | unbiased (n - 1, torch.std: verl, SimpleRL)
    gamma: float = 1.0  # GAE discount (advantage = gae only)
    lam: float = 1.0  # GAE lambda (advantage = gae only); 1.0 with gamma 1.0 is Open-Reasoner-Zero's setting
    clip_low: float = 0.2  # ratio floor 1 - clip_low
    clip_high: float = 0.2  # ratio ceiling 1 + clip_high (DAPO's clip-higher raises it)
    # what the PPO ratio is clipped against: behaviour (the engine's logprobs) | recompute (the learner's own, before
    # the update: one extra no-grad forward when an update takes > 1 optimizer step; ORZ, verl, open-instruct)
    old_logprobs: OldLogprobs = "behaviour"
    ratio: Ratio = "token"  # token (PPO) | sequence (GSPO: a sample's geometric-mean ratio on all of its tokens)
    # off-policy correction for stale samples: none | tis (dual clip: for A < 0, r capped at tis_cap) | decoupled
    # (needs old_logprobs = recompute: dual clip plus the behaviour weight min(exp(prox - behaviour), tis_cap))
    correction: Correction = "tis"
    tis_cap: float = 2.0  # cap C > 1 of the dual clip (tis, decoupled) and of decoupled's behaviour weight
    seq_mask_bound: float = 0.0  # drop a sample's policy gradient if |mean(learner - behaviour logprob)| > it (0 = off)
    # how token terms add up (learner/train/aggregation.py): token_mean | seq_mean_token_mean | seq_mean_token_sum |
    # micro_batch_token_mean (ORZ, SimpleRL: depends on the micro-batch cut) | constant (Dr. GRPO: / rollout.max_tokens)
    loss_agg: LossAgg = "token_mean"
    kl_coef: float = 0.0  # weight of the KL penalty to the frozen reference model (0 = no reference model)
    kl_estimator: KlEstimator = "k3"  # k1 (log ratio) | k2 (half its square) | k3 (unbiased, non-negative)
    kl_clamp: float = 0.0  # bound each token's KL estimate to [-kl_clamp, kl_clamp] (0 = none; verl clamps k3 at 10)
    kl_in_reward: bool = False  # gae: -kl_coef * KL per token in the reward before GAE, not in the loss (Tulu 3 PPO)
    keep_reference: bool = False  # hold the reference model even at kl_coef = 0, to report KL to it (as ORZ does)
    entropy_coef: float = 0.0  # entropy bonus weight
    filter_equal_rewards: bool = False  # drop groups whose rewards are all equal (no GRPO signal)
    value_clip: float = 0.2  # critic: clip of the value update around the old values
    critic_lr: float = 5e-6  # critic's AdamW learning rate
    critic_path: str = ""  # critic init (HF folder); "" = the policy model's weights with a fresh value head
    advantage_normalize: bool = False  # gae: whiten the advantages over the whole rollout batch (Open-Reasoner-Zero does)

    def __post_init__(self) -> None:
        check_choices(self, "algo")
        need(0 <= self.gamma <= 1, "algo.gamma", "must be in [0, 1]")
        need(0 <= self.lam <= 1, "algo.lam", "must be in [0, 1]")
        need(0 < self.clip_low < 1, "algo.clip_low", "must be in (0, 1)")
        need(self.clip_high > 0, "algo.clip_high", "must be > 0")
        need(self.tis_cap > 1, "algo.tis_cap", "must be > 1 (at 1 the dual clip would floor every A < 0 token at A itself)")
        need(
            self.correction != "decoupled" or self.old_logprobs == "recompute",
            "algo.correction",
            "decoupled clips against the learner's recomputed logprobs: set algo.old_logprobs = recompute",
        )
        need(self.seq_mask_bound >= 0, "algo.seq_mask_bound", "must be >= 0 (0 = off)")
        need(self.kl_coef >= 0, "algo.kl_coef", "must be >= 0")
        need(self.kl_clamp >= 0, "algo.kl_clamp", "must be >= 0 (0 = no clamp)")
        need(
            not self.kl_in_reward or self.advantage == "gae",
            "algo.kl_in_reward",
            f"needs algo.advantage = gae; {self.advantage}'s advantages are made on rank 0 before any reference logprob exists"
            " (put the KL in the loss: kl_in_reward = false)",
        )
        need(not self.kl_in_reward or self.kl_coef > 0, "algo.kl_in_reward", "needs algo.kl_coef > 0 (the penalty's weight)")
        need(
            self.grpo_std == "biased" or self.advantage == "grpo",
            "algo.grpo_std",
            f"is grpo's group std; algo.advantage = {self.advantage} does not divide by it",
        )
        need(self.entropy_coef >= 0, "algo.entropy_coef", "must be >= 0")
        need(self.value_clip > 0, "algo.value_clip", "must be > 0")
        need(self.critic_lr > 0, "algo.critic_lr", "must be > 0")
        need(
            not self.advantage_normalize or self.advantage == "gae",
            "algo.advantage_normalize",
            f"whitens GAE advantages; algo.advantage = {self.advantage} sets the scale of its group advantages itself",
        )
