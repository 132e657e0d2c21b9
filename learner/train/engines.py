"""What trains on a learner rank, built once at start: the policy's DeepSpeed engine, the GAE critic's, the frozen
reference, each with the attention that matches the micro-batch layout (learner/train/layout.py).

    model --set attention, scoring head, checkpointing--> deepspeed.initialize (ZeRO stage, AdamW, LR schedule:
                                                          learner/train/lr_schedule.py over the run's optimizer steps)
    critic (algo.advantage = gae)          the same, with algo.critic_lr
    reference (KL, algo.keep_reference)    a plain frozen model on the device: no optimizer, never synced

DeepSpeed's config is derived from the run's batch layout (UpdateLayout): the trainer tells DeepSpeed where each
optimizer step falls, so its own accumulation count is bookkeeping only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from learner.plan import Plan
from learner.train.attention.varlen import disable_cudnn_sdpa
from learner.train.distributed import Topology
from learner.train.lr_schedule import lr_scheduler
from learner.train.scoring import ScoringHead, install_scoring_head
from protocol.config import Config


@dataclass(frozen=True, slots=True)
class UpdateLayout:
    """The per-rank batch arithmetic of one update (validated at start by learner/plan/layout.py), and the run's
    length in optimizer steps, over which the learning rate decays."""

    mini_batches: int
    ppo_epochs: int
    micro_samples: int  # samples per forward/backward (1 with a token budget: DeepSpeed's bookkeeping only)
    accumulation: int  # micro-batches per optimizer step on one rank (with a token budget, the most there can be)
    run_steps: int  # optimizer steps in the whole run (the plan's run length): where train.lr_schedule's decay ends

    @classmethod
    def of(cls, plan: Plan) -> UpdateLayout:
        """The layout `fleetrl plan` computed for this run (learner/plan/layout.py checks it adds up)."""
        b = plan.batch
        return cls(
            mini_batches=b.mini_batches,
            ppo_epochs=b.ppo_epochs,
            micro_samples=b.micro_batch,
            accumulation=b.accumulation,
            run_steps=plan.length.optimizer_steps,
        )

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps per update: S = mini_batches x ppo_epochs."""
        return self.mini_batches * self.ppo_epochs


@dataclass(kw_only=True, slots=True)
class Engines:
    policy: Any  # deepspeed.DeepSpeedEngine
    head: ScoringHead  # the policy's output projection, scored a chunk of tokens at a time (learner/train/scoring.py)
    vocab_size: int  # token ids the policy can take and score
    critic: Any | None = None  # deepspeed.DeepSpeedEngine of learner/train/critic.py's Critic (algo.advantage = gae)
    reference: Any | None = None  # learner/train/reference.py's ReferencePolicy


def build_engines(
    cfg: Config, model: torch.nn.Module, topo: Topology, layout: UpdateLayout, attention: str, critic: bool, reference: bool
) -> Engines:
    """`attention`: the implementation matching the micro-batch layout; `critic`, `reference`: whether the algorithm
    needs them (the caller's loss and advantage units say)."""
    import deepspeed

    cuda = topo.device.type == "cuda"
    model.set_attn_implementation(attention)  # type: ignore[operator]
    if cuda:
        disable_cudnn_sdpa()
    head = install_scoring_head(model)
    if cfg.train.gradient_checkpointing:
        checkpoint_layers(model)
    vocab_size = embedding_rows(model)  # read before DeepSpeed: ZeRO-3 leaves empty placeholders
    policy, *_ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=deepspeed_config(cfg, layout, cfg.train.lr, cuda),
        lr_scheduler=lr_scheduler(cfg.train, layout.run_steps),
        mpu=topo.mpu,
    )
    out = Engines(policy=policy, head=head, vocab_size=vocab_size)
    dtype = getattr(torch, cfg.model.dtype)
    if critic:
        from learner.train.critic import Critic

        value_model = Critic.from_pretrained(cfg.algo.critic_path or cfg.model.path, dtype=dtype)
        value_model.backbone.set_attn_implementation(attention)  # type: ignore[operator]
        if cfg.train.gradient_checkpointing:
            checkpoint_layers(value_model.backbone)
        out.critic, *_ = deepspeed.initialize(
            model=value_model,
            model_parameters=list(value_model.parameters()),
            config=deepspeed_config(cfg, layout, cfg.algo.critic_lr, cuda),
            lr_scheduler=lr_scheduler(cfg.train, layout.run_steps),  # one critic step per policy step: the same T
            mpu=topo.mpu,
        )
    if reference:
        from learner.train.reference import ReferencePolicy

        out.reference = ReferencePolicy.from_pretrained(cfg.model.path, dtype=dtype)
        out.reference.model.set_attn_implementation(attention)  # type: ignore[operator]
        out.reference.model.to(topo.device)
    return out


def deepspeed_config(cfg: Config, layout: UpdateLayout, lr: float, cuda: bool) -> dict:
    """`lr`: the peak learning rate. The schedule is no DeepSpeed scheduler but learner/train/lr_schedule.py's,
    handed to deepspeed.initialize beside this config."""
    return {
        "train_micro_batch_size_per_gpu": layout.micro_samples,
        "gradient_accumulation_steps": layout.accumulation,
        "gradient_clipping": cfg.train.grad_clip,
        "optimizer": {
            "type": "AdamW",
            # torch_adam: torch's own AdamW. DeepSpeed's fused Adam is a JIT-compiled op (no compiler on some GPU
            # machines, none for the CPU build); torch's fused CUDA kernel does the same work in one launch.
            "params": {
                "lr": lr,
                "weight_decay": cfg.train.weight_decay,
                "betas": list(cfg.train.adam_betas),
                "eps": cfg.train.adam_eps,
                "torch_adam": True,
                **({"fused": True} if cuda else {}),
            },
        },
        "zero_optimization": {"stage": cfg.train.zero_stage, **_sp_zero3_fix(cfg)},
        "bf16": {"enabled": cfg.model.dtype == "bfloat16"},
        # Micro-batch gradients summed in fp32: left to DeepSpeed's default (the model's dtype), every micro-batch
        # of a token-budget step would round the running sum to bf16, and a small one would vanish in it.
        **({"data_types": {"grad_accum_dtype": "fp32"}} if cfg.model.dtype == "bfloat16" else {}),
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _sp_zero3_fix(cfg: Config) -> dict:
    """DeepSpeed 0.19 ZeRO-3's reduce-scatter path (`__avg_scatter_grads`) averages gradients over every rank,
    SP peers included, where they must be summed: with SP = 2 the gradient came out halved (tests/
    test_learner_ranks.py). Its all-reduce path divides by world / SP, which is right; reduce_scatter=False
    selects it."""
    return {"reduce_scatter": False} if cfg.train.zero_stage == 3 and cfg.train.sequence_parallel_size > 1 else {}


def embedding_rows(model: torch.nn.Module) -> int:
    """The token ids the model can take and score: its input embedding's rows (the output head's, if fewer).
    Often above len(tokenizer) (padded to a multiple of 64 or 128); an id in between is still embeddable."""
    rows = model.get_input_embeddings().num_embeddings  # type: ignore[operator]
    head = model.get_output_embeddings()  # type: ignore[operator]
    return min(rows, head.out_features) if isinstance(head, torch.nn.Linear) else int(rows)


def checkpoint_layers(model: torch.nn.Module) -> None:
    """Activation checkpointing of every decoder layer (transformers' own, non-reentrant: the packed/ring attention
    kwargs reach the recomputed layers, and ZeRO-3 gathers the parameters again for the recompute)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
