"""The cases of bench.learner_gpu: model shapes, per-case settings, and the data both loops train on.

Both sides of a case (FleetRL's trainer, the plain PyTorch loop) run in processes of their own
and rebuild the same updates from the same seeds here, so they train on identical samples in
the same order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bench.synthetic import synthetic_groups
from learner.train.batch import Sample, group_samples
from learner.train.shard import Share
from protocol.config import Config, load_config

# Qwen2.5 shapes (their config.json files); each model ties the lm_head to the input embeddings.
SHAPES: dict[str, dict[str, int]] = {
    "Qwen2.5-0.5B": dict(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864, vocab_size=151936
    ),
    "Qwen2.5-1.5B": dict(
        hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960, vocab_size=151936
    ),
    # Smoke only: every code path in seconds on a CPU (GQA kept: 2 query heads share 1 kv head).
    "tiny": dict(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256, vocab_size=1000
    ),
}


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    shape: str  # key of SHAPES
    samples: int  # samples per update (one optimizer step)
    group: int  # samples per prompt (GRPO group)
    prompt_len: int
    completion: tuple[int, int]  # completion tokens per sample, uniform in [lo, hi]
    token_budget: int  # FleetRL: train.max_tokens_per_micro_batch (packed first-fit up to it)
    checkpointing: bool  # gradient checkpointing, on both sides
    plain_rows: int  # plain loop: padded rows per micro-batch

    @property
    def tokens_text(self) -> str:
        lo, hi = self.completion
        return f"{self.samples} x ({self.prompt_len} + {lo}-{hi}) tokens"


# Budgets for one 80 GB H100, bf16, ZeRO-2 on one rank, from counting bytes (not measured):
# - FleetRL's model state is 16 bytes per parameter (bf16 weights and gradients, fp32 master weights
#   and Adam moments): 8 GB at 0.5B, 25 GB at 1.5B. Without checkpointing autograd keeps roughly
#   1.6 MB (0.5B) and 3.2 MB (1.5B) of activations per token, so 16k and 8k tokens per micro-batch
#   leave headroom for the lm_head chunks and the allocator. With checkpointing only each layer's
#   input stays (about 43 KB per token at 0.5B): a 32k-token micro-batch fits.
# - The plain loop trains in pure bf16 (8 bytes per parameter with AdamW's moments). Its full
#   [rows, length, vocab] logits, their float32 copy, log-softmax and gradient cost about 14 bytes
#   x 152k vocab per padded position (~2 MB): 8 rows of ~1.1k positions stay under about 60 GB at
#   1.5B; 2 rows of up to 8k with checkpointing under about 40 GB at 0.5B (4 rows would need ~70 GB).
CASES: dict[str, Case] = {
    c.name: c
    for c in (
        Case(
            name="1.5B-short",
            shape="Qwen2.5-1.5B",
            samples=64,
            group=8,
            prompt_len=128,
            completion=(256, 1024),
            token_budget=8192,
            checkpointing=False,
            plain_rows=8,
        ),
        Case(
            name="0.5B-short",
            shape="Qwen2.5-0.5B",
            samples=64,
            group=8,
            prompt_len=128,
            completion=(256, 1024),
            token_budget=16384,
            checkpointing=False,
            plain_rows=8,
        ),
        # 2k-8k tokens per sample in all: prompt 128 + completion 1920-8064.
        Case(
            name="0.5B-long",
            shape="Qwen2.5-0.5B",
            samples=8,
            group=8,
            prompt_len=128,
            completion=(1920, 8064),
            token_budget=32768,
            checkpointing=True,
            plain_rows=2,
        ),
        # A budget below the update's tokens, so the smoke run cuts several micro-batches.
        Case(
            name="tiny",
            shape="tiny",
            samples=16,
            group=8,
            prompt_len=16,
            completion=(16, 48),
            token_budget=256,
            checkpointing=True,
            plain_rows=4,
        ),
    )
}
GPU_CASES = ("1.5B-short", "0.5B-short", "0.5B-long")
LOGPROB_CHUNK = 2048  # tokens per lm_head chunk: a ~1 GB float32 slice at 152k vocab, large enough to keep the GEMM busy


def case_config(case: Case, dtype: str) -> Config:
    """FleetRL's settings for the case, as the overrides a user would pass."""
    lo, hi = case.completion
    return load_config(
        None,
        [
            f"model.dtype={dtype}",
            "cluster.learner_gpus_per_node=1",
            "train.zero_stage=2",
            "train.packing=true",
            f"train.prompts_per_step={case.samples // case.group}",
            f"rollout.samples_per_prompt={case.group}",
            "train.mini_batches=1",
            "train.ppo_epochs=1",
            "staleness.max_staleness=0",
            f"rollout.max_tokens={hi}",
            f"actor.max_model_len={case.prompt_len + hi + 1}",
            f"train.max_tokens_per_micro_batch={case.token_budget}",
            f"train.gradient_checkpointing={str(case.checkpointing).lower()}",
            f"train.logprob_chunk_tokens={LOGPROB_CHUNK}",
            # The plain loop's loss is the bare PPO clip; FleetRL's default off-policy correction (tis) adds a bound.
            "algo.correction=none",
            # Speed does not depend on the values; a small step keeps bf16 random weights from blowing up.
            "train.lr=1e-6",
            "train.warmup_steps=0",
        ],
    )


def build_model(case: Case, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A randomly initialised Qwen2 of the case's shape (no hub access), built on `device` in `dtype` directly."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**SHAPES[case.shape], tie_word_embeddings=True, max_position_embeddings=32768, use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


@dataclass(frozen=True, slots=True)
class Update:
    share: Share  # FleetRL's: the samples in its micro-batch order, with their cuts
    samples: list[Sample]  # the same samples in rollout order, as a plain loop would get them


def update_data(cfg: Config, case: Case, updates: int) -> list[Update]:
    """The updates' data, seeded by each update's index: the same on both sides."""
    from learner.train.shard import make_shares

    vocab = SHAPES[case.shape]["vocab_size"]
    out = []
    for u in range(updates):
        # Behaviour logprobs near a random model's own (-ln vocab), so ratios start near 1 as in training.
        groups = synthetic_groups(
            groups=case.samples // case.group,
            samples=case.group,
            seed=u,
            version=u,
            prompt_len=case.prompt_len,
            completion=case.completion,
            vocab=(3, vocab),
            behaviour_logp=-math.log(vocab),
        )
        shares, advantages = make_shares(cfg, groups, u, 0, 1)
        samples = [s for g, adv in zip(groups, advantages, strict=True) for s in group_samples(g, adv)]
        out.append(Update(share=shares[0], samples=samples))
    return out


def positions(samples: list[Sample]) -> int:
    """Prompt + completion tokens: the positions a forward over the samples must process (padding not counted)."""
    return sum(len(s.tokens) for s in samples)
