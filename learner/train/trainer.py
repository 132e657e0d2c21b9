"""One update per rollout batch, on every learner rank: S = mini_batches x ppo_epochs optimizer steps.

    rank 0: groups -> advantages -> samples -> shares (learner/train/shard.py) --scatter--> every rank
    every rank, for each PPO epoch, for each mini-batch (one optimizer step):
        its micro-batches: learner logprobs -> clipped loss -> backward (gradient accumulation)
        DeepSpeed step: gradients averaged over the learner ranks, AdamW, ZeRO sharding

The ratio is taken against the behaviour logprobs the actor sampled with. The loss is
token-level over the mini-batch's tokens on ALL ranks (`Share.mini_batch_tokens`);
DeepSpeed averages gradients over the world, so each rank's loss is scaled by the world
size to make the sum come out exactly as on one process.

A mini-batch's micro-batches are cut by rank 0 (learner/train/micro_batches.py: a sample count or a
token budget), so their number varies from update to update: the trainer tells DeepSpeed where
each optimizer step falls (`set_gradient_accumulation_boundary`) instead of letting it count.
Logprobs come from the lm_head a chunk of tokens at a time (learner/train/scoring.py), and the loss
stays on the device; one all-reduce per update brings the metrics home.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from learner import staleness as st
from learner.plan import Plan
from learner.train.advantages import GroupAdvantage, make_advantage
from learner.train.attention.varlen import disable_cudnn_sdpa
from learner.train.batch import TokenBatch, check_batch, group_samples
from learner.train.distributed import Topology
from learner.train.layout import attention_implementation, micro_batch_layout
from learner.train.losses import make_policy_loss, value_loss
from learner.train.scoring import install_scoring_head, score_tokens
from learner.train.sequence_parallel import SequenceShard
from learner.train.shard import Share, split_rollout_batch
from learner.train.step_check import StepWatch
from protocol.config import Config, ConfigError, TrainConfig
from protocol.messages import RolloutGroup


@dataclass(frozen=True, slots=True)
class StepLayout:
    """The per-rank batch arithmetic of one update (validated at start by learner/plan.py)."""

    mini_batches: int
    ppo_epochs: int
    micro_samples: int  # samples per forward/backward (1 with a token budget: DeepSpeed's bookkeeping only)
    accumulation: int  # micro-batches per optimizer step on one rank (with a token budget, the most there can be)

    @classmethod
    def of(cls, plan: Plan) -> StepLayout:
        """The layout `fleetrl plan` computed for this run (learner/plan.py checks it adds up)."""
        return cls(
            mini_batches=plan.mini_batches, ppo_epochs=plan.ppo_epochs, micro_samples=plan.micro_batch, accumulation=plan.accumulation
        )

    @property
    def steps(self) -> int:
        return self.mini_batches * self.ppo_epochs


def token_budget(train: TrainConfig) -> int:
    """Tokens of one micro-batch (0: counted in samples). An SP group splits each micro-batch's row over its ranks."""
    return train.max_tokens_per_micro_batch * train.sequence_parallel_size


def deepspeed_config(cfg: Config, layout: StepLayout, lr: float, cuda: bool) -> dict:
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
                "betas": [0.9, 0.999],
                "torch_adam": True,
                **({"fused": True} if cuda else {}),
            },
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": lr,
                "warmup_num_steps": max(1, cfg.train.warmup_steps),
                "warmup_type": "linear",
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


@dataclass(kw_only=True, slots=True)
class UpdateStats:
    loss: float  # mean over the update's optimizer steps
    samples: int
    tokens: int
    logprob_mismatch: float  # mean |behaviour - learner| over staleness-0 tokens at the first step; nan when none
    packing_efficiency: float  # useful / processed token positions (1.0 = no padding)
    padded_efficiency: float  # useful / positions right-padded rows would have processed (for comparison)
    on_policy_tokens: int
    clip_frac: float
    grad_norm: float  # of the last optimizer step
    extra: dict[str, float]  # namespaced extras: kl, entropy, value loss, importance weights
    applied_steps: int  # optimizer steps that changed the weights (S unless DeepSpeed skipped some): the version's advance
    failed_steps: list[int]  # steps skipped or with a non-finite loss or gradient norm (learner/train/step_check.py)
    critic_failed_steps: list[int] = dataclasses.field(default_factory=list)  # the same for the GAE critic's steps


def make_shares(
    cfg: Config, groups: list[RolloutGroup], version: int, max_staleness: int, dp_size: int, vocab_size: int | None = None
) -> tuple[list[Share], torch.Tensor]:
    """Rank 0: group-level advantages, then the samples cut into one share per DP rank, and into micro-batches.

    Raises InvalidBatch (learner/train/batch.py) for groups no model could train on, before anything reaches
    another rank: token ids outside [0, vocab_size), non-finite or positive logprobs, non-finite rewards."""
    check_batch(groups, vocab_size)
    rewards = torch.from_numpy(np.stack([g.rewards for g in groups]).astype(np.float32))
    unit = make_advantage(cfg.algo)
    # Group advantages need the whole group, so rank 0 computes them; GAE is per sample and runs on each rank.
    advantages = unit.per_sample(rewards) if isinstance(unit, GroupAdvantage) else torch.zeros_like(rewards)
    samples = [s for g, adv in zip(groups, advantages, strict=True) for s in group_samples(g, adv)]
    shares = split_rollout_batch(
        samples,
        cfg.train.mini_batches,
        dp_size,
        seed=cfg.run.seed * 1_000_003 + version,
        version=version,
        max_staleness=max_staleness,
        token_budget=token_budget(cfg.train),
        micro_samples=cfg.train.micro_batch_samples,
    )
    return shares, advantages


class Trainer:
    def __init__(self, cfg: Config, model: torch.nn.Module, topo: Topology, layout: StepLayout):
        import deepspeed

        self.cfg, self.topo, self.layout = cfg, topo, layout
        self.advantage = make_advantage(cfg.algo)
        self.policy_loss = make_policy_loss(cfg.algo)
        if self.advantage.needs_critic and topo.sp_size > 1:
            raise ConfigError(
                "algo.advantage: gae needs every value of a sample on one rank; it does not run with train.sequence_parallel_size > 1 yet"
            )
        # Padded rows, one packed row, or this rank's chunk of it (SP): chosen once, with its attention.
        self.attention = attention_implementation(cfg.train)
        self.build = micro_batch_layout(cfg.train, topo.sp_group)
        model.set_attn_implementation(self.attention)  # type: ignore[operator]
        if topo.device.type == "cuda":
            disable_cudnn_sdpa()
        self.head = install_scoring_head(model)
        if cfg.train.gradient_checkpointing:
            _checkpoint_layers(model)
        self.vocab_size = embedding_rows(model)  # read before DeepSpeed: ZeRO-3 leaves empty placeholders
        self.engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=deepspeed_config(cfg, layout, cfg.train.lr, topo.device.type == "cuda"),
            mpu=topo.mpu,
        )
        self.critic = self.reference = None
        if self.advantage.needs_critic:
            from learner.train.critic import Critic

            critic = Critic.from_pretrained(cfg.algo.critic_path or cfg.model.path, dtype=getattr(torch, cfg.model.dtype))
            critic.backbone.set_attn_implementation(self.attention)  # type: ignore[operator]
            if cfg.train.gradient_checkpointing:
                _checkpoint_layers(critic.backbone)
            self.critic, *_ = deepspeed.initialize(
                model=critic,
                model_parameters=list(critic.parameters()),
                config=deepspeed_config(cfg, layout, cfg.algo.critic_lr, topo.device.type == "cuda"),
                mpu=topo.mpu,
            )
        if self.policy_loss.needs_reference or cfg.algo.keep_reference:
            from learner.train.reference import ReferencePolicy

            self.reference = ReferencePolicy.from_pretrained(cfg.model.path, dtype=getattr(torch, cfg.model.dtype))
            self.reference.model.set_attn_implementation(self.attention)  # type: ignore[operator]
            self.reference.model.to(topo.device)

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

    def snapshot(
        self, buckets: list[range], dtype: torch.dtype, out: list[torch.Tensor] | None, host: bool = False
    ) -> list[torch.Tensor] | None:
        """Collective: rank 0 copies the weights into one flat tensor per bucket (reusing `out`); others join the gathers.

        The buffers are on this rank's device, so on GPUs the weight group sends from GPU memory with no trip
        through the host (learner/weights/sync.py); `host` keeps them in pinned host memory instead (a model whose
        full weights do not fit beside training). ZeRO-3 gathers one bucket at a time: no rank holds more than a
        bucket of full parameters beyond its shard, but rank 0 keeps the whole snapshot until the next sync.
        """
        params = [p for _, p in self.named_parameters()]
        shapes = self.full_shapes()
        device = torch.device("cpu") if host else self.topo.device
        if self.topo.is_root and out is None:
            pin = device.type == "cpu" and self.topo.device.type == "cuda"
            out = [torch.empty(sum(int(np.prod(shapes[i])) for i in b), dtype=dtype, device=device, pin_memory=pin) for b in buckets]
        for k, bucket in enumerate(buckets):
            chunk = [params[i] for i in bucket]
            with self.gathered(chunk), torch.no_grad():
                if self.topo.is_root:
                    assert out is not None and out[k].device == device, f"snapshot buffer {k} not on {device}"
                    flat = [p.detach().reshape(-1).to(dtype) for p in chunk]
                    if flat[0].device == device:
                        torch.cat(flat, out=out[k])
                    else:  # to host memory: one device-to-host copy per bucket
                        out[k].copy_(torch.cat(flat))
        return out if self.topo.is_root else None

    def update(self, share: Share) -> UpdateStats:
        """Train this rank's share: S optimizer steps from `share.version`. Stats are summed over ranks."""
        steps, version, max_staleness = self.layout.steps, share.version, share.max_staleness
        for s in share.samples:  # the hard invariant, checked once more where it matters
            assert st.admissible(version, s.version_min, max_staleness, steps), (
                f"sample of version {s.version_min} in update {version} -> {version + steps} breaks max_staleness={max_staleness}"
            )
        chunks = _micro_chunks(share)
        assert len(chunks) == self.layout.mini_batches, f"{len(chunks)} mini-batches in the share, {self.layout} expected"
        # Micro-batches are built once, on the host, then copied to the device once (no stream sync per copy);
        # mini-batch j holds micro_batches[j], its token count is share.mini_batch_tokens[j].
        built = [[self.build(c, version) for c in mini] for mini in chunks]
        # The counts that need no GPU: packing efficiency (positions holding a sample's token / positions run;
        # SP chunks add up), scored tokens, on-policy tokens (the mismatch is taken at the first step only).
        host = np.zeros(len(_HOST_SUMS))
        for j, mbs in enumerate(built):
            for mb in mbs:
                host += [
                    int(mb.on_policy.sum()) if j == 0 else 0,
                    len(mb.targets),
                    _useful_tokens(mb),
                    mb.model_kwargs()["input_ids"].numel(),
                    0,
                ]
        host *= [1, self.layout.ppo_epochs, self.layout.ppo_epochs, self.layout.ppo_epochs, 0]
        # What right-padded rows would have processed for the same micro-batches (counted once per SP group).
        if self.topo.sp_rank == 0:
            host[-1] = self.layout.ppo_epochs * sum(len(c) * max(len(x.tokens) for x in c) for mini in chunks for c in mini)
        micro_batches = [[_to_device(mb, self.topo.device) for mb in mbs] for mbs in built]
        extras = [[self._prepare(mb) for mb in mbs] for mbs in micro_batches]
        if self.cfg.algo.advantage_normalize:
            self._whiten_advantages([e for es in extras for e in es])
        # The loss is a sum over ranks' tokens; DeepSpeed sums SP peers' gradients and averages the DP replicas.
        scale = float(self.topo.dp_size)
        self.engine.train()
        steps_before = self.engine.global_steps
        watch = StepWatch(self.engine, steps, self.topo.device)
        critic_watch = StepWatch(self.critic, steps, self.topo.device, "critic") if self.critic is not None else None
        sums = torch.zeros(len(_DEVICE_SUMS), dtype=torch.float64, device=self.topo.device)
        for epoch in range(self.layout.ppo_epochs):
            for j in range(self.layout.mini_batches):
                last = len(micro_batches[j]) - 1
                for i, (mb, extra) in enumerate(zip(micro_batches[j], extras[j], strict=True)):
                    # Every rank has as many micro-batches in mini-batch j (rank 0 cut them so): the boundaries agree.
                    for engine in (self.engine, self.critic):
                        if engine is not None:
                            engine.set_gradient_accumulation_boundary(i == last)
                    row = self._micro_step(mb, extra, share.mini_batch_tokens[j], scale, first_step=epoch == 0 and j == 0)
                    watch.note_loss(epoch * self.layout.mini_batches + j, row[_DEVICE_SUMS.index("loss")])
                    if critic_watch is not None:
                        critic_watch.note_loss(epoch * self.layout.mini_batches + j, row[_DEVICE_SUMS.index("loss/value")])
                    sums += row
                watch.stepped()
                if critic_watch is not None:
                    critic_watch.stepped()
        assert self.engine.global_steps == steps_before + steps, "DeepSpeed did not take exactly S optimizer steps"
        flags = [watch.loss_flags] + ([critic_watch.loss_flags] if critic_watch is not None else [])
        sums = torch.cat([torch.from_numpy(host).to(sums.device), sums, *flags])
        if self.topo.world > 1:
            dist.all_reduce(sums)
        reduced = sums.tolist()
        n_flags = steps * len(flags)
        outcome = watch.settle(reduced[-n_flags:][:steps])  # the same on every rank; raises NonFiniteStep for corrupted weights
        critic_failed = critic_watch.settle(reduced[-steps:]).failed if critic_watch is not None else []
        total: dict[str, float] = dict(zip(_HOST_SUMS + _DEVICE_SUMS, reduced[:-n_flags], strict=True))
        tokens, on_policy = total["tokens"], total["on_policy"]
        grad_norm = self.engine.get_global_grad_norm()
        metrics = {k: total[k] / tokens for k in ("loss/kl", "loss/entropy", "loss/iw_mean", "loss/value_clip_frac") if tokens}
        if self.critic is not None:
            metrics["loss/value"] = total["loss/value"] / steps
        return UpdateStats(
            loss=total["loss"] / steps,
            samples=len(share.samples) * self.topo.dp_size,
            tokens=int(tokens) // self.layout.ppo_epochs,
            logprob_mismatch=total["mismatch"] / on_policy if on_policy else float("nan"),
            on_policy_tokens=int(on_policy),
            packing_efficiency=total["useful"] / total["processed"] if total["processed"] else float("nan"),
            padded_efficiency=total["useful"] / total["padded"] if total["padded"] else float("nan"),
            clip_frac=total["clipped"] / tokens if tokens else 0.0,
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            extra=metrics,
            applied_steps=outcome.applied,
            failed_steps=outcome.failed,
            critic_failed_steps=critic_failed,
        )

    @torch.no_grad()
    def _prepare(self, mb: TokenBatch) -> dict[str, torch.Tensor]:
        """Before the first step: what must come from the weights as they were (prox, reference, old values, GAE)."""
        out: dict[str, torch.Tensor] = {}
        dev = self.topo.device
        if self.policy_loss.needs_prox and self.layout.steps > 1:
            self.engine.eval()
            out["prox"] = self._score(mb, entropy=False)[0]
        if self.reference is not None:
            out["ref"] = self.reference.logprobs(
                mb,
                self.cfg.rollout.temperature,
                self.cfg.train.logprob_chunk_tokens,
                top_k=self.cfg.rollout.top_k,
                top_p=self.cfg.rollout.top_p,
            )
        if self.critic is not None:
            self.critic.eval()
            values = self.critic(**self._kwargs(mb))
            old = values[mb.score_rows.to(dev), mb.score_cols.to(dev)].float()
            adv = self.advantage(mb.rewards.to(dev), mb.lengths.to(dev), old)  # type: ignore[attr-defined]  # padded and packed layouts have them
            assert adv.returns is not None
            out.update(old_values=old, advantages=adv.tokens.float(), returns=adv.returns.float())
        return out

    def _whiten_advantages(self, extras: list[dict[str, torch.Tensor]]) -> None:
        """GAE advantages to zero mean and unit variance over every completion token of the rollout batch, on all
        ranks (one all-reduce), as Open-Reasoner-Zero normalises its replay buffer (advantage_normalize)."""
        advs = [e["advantages"] for e in extras]
        device = advs[0].device
        stats = torch.stack(
            [
                sum((a.double().sum() for a in advs), torch.zeros((), dtype=torch.float64, device=device)),
                sum((a.double().square().sum() for a in advs), torch.zeros((), dtype=torch.float64, device=device)),
                torch.tensor(float(sum(a.numel() for a in advs)), dtype=torch.float64, device=device),
            ]
        )
        if self.topo.world > 1:
            dist.all_reduce(stats)
        total, squares, count = stats.unbind()
        mean = total / count.clamp(min=1)
        std = (squares / count.clamp(min=1) - mean.square()).clamp(min=0).sqrt()
        for e in extras:
            e["advantages"] = ((e["advantages"].double() - mean) / (std + ADV_EPS)).to(e["advantages"].dtype)

    def _kwargs(self, mb: TokenBatch) -> dict:
        return {k: v.to(self.topo.device) if isinstance(v, torch.Tensor) else v for k, v in mb.model_kwargs().items()}

    def _score(self, mb: TokenBatch, entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's (logprobs, entropies) of the micro-batch's completion tokens, on the device."""
        r = self.cfg.rollout  # the distribution the actors sampled from: temperature, then top-k and top-p
        return score_tokens(
            self.engine,
            self.head,
            mb,
            r.temperature,
            self.cfg.train.logprob_chunk_tokens,
            entropy,
            self.topo.device,
            top_k=r.top_k,
            top_p=r.top_p,
        )

    def _micro_step(
        self, mb: TokenBatch, extra: dict[str, torch.Tensor], total_tokens: int, scale: float, first_step: bool
    ) -> torch.Tensor:
        self.engine.train()
        dev = self.topo.device
        logp, entropy = self._score(mb, entropy=self.policy_loss.needs_entropy)
        behaviour = mb.behaviour_logp.to(dev)
        prox = extra.get("prox", logp.detach()) if self.policy_loss.needs_prox else None  # S = 1: the weights have not moved yet
        adv = extra.get("advantages", mb.token_adv).to(dev)
        out = self.policy_loss(
            logp,
            behaviour,
            adv,
            total_tokens,
            prox_logp=prox,
            ref_logp=extra.get("ref"),
            entropy=entropy if self.policy_loss.needs_entropy else None,
        )
        self.engine.backward(out.loss * scale, scale_wrt_gas=False)
        # DeepSpeed counts micro-steps: step() after every backward, the optimizer runs at the boundary.
        self.engine.step()
        n = len(logp)
        # These sums stay on the device (no sync per micro-batch); update() brings them home once.
        row: dict[str, torch.Tensor] = {}
        if n:  # an SP rank may score no token (clip_frac of nothing is nan); it still ran forward and backward for its peers
            row.update(loss=out.loss.detach(), clipped=out.clip_frac * n)
        if first_step:
            row["mismatch"] = torch.where(mb.on_policy.to(dev), (logp.detach() - behaviour).abs(), 0.0).sum()
        for key, value in (("loss/kl", out.kl_mean), ("loss/entropy", out.entropy_mean), ("loss/iw_mean", out.iw_mean)):
            if value is not None and n:
                row[key] = value * n
        if self.critic is not None:
            self.critic.train()
            values = self.critic(**self._kwargs(mb))
            v = value_loss(
                values[mb.score_rows.to(dev), mb.score_cols.to(dev)].float(),
                extra["old_values"],
                extra["returns"],
                self.cfg.algo.value_clip,
                total_tokens,
            )
            self.critic.backward(v.loss * scale, scale_wrt_gas=False)
            self.critic.step()
            row.update({"loss/value": v.loss.detach(), "loss/value_clip_frac": v.clip_frac * n})
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        return torch.stack([row[k].double() if k in row else zero for k in _DEVICE_SUMS])


def embedding_rows(model: torch.nn.Module) -> int:
    """The token ids the model can take and score: its input embedding's rows (the output head's, if fewer).
    Often above len(tokenizer) (padded to a multiple of 64 or 128); an id in between is still embeddable."""
    rows = model.get_input_embeddings().num_embeddings  # type: ignore[operator]
    head = model.get_output_embeddings()  # type: ignore[operator]
    return min(rows, head.out_features) if isinstance(head, torch.nn.Linear) else int(rows)


def _checkpoint_layers(model: torch.nn.Module) -> None:
    """Activation checkpointing of every decoder layer (transformers' own, non-reentrant: the packed/ring attention
    kwargs reach the recomputed layers, and ZeRO-3 gathers the parameters again for the recompute)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]


def _micro_chunks(share: Share) -> list[list[list]]:
    """The share's samples as mini-batches of micro-batches, as `share.micro_sizes` cuts them."""
    out, start = [], 0
    for sizes in share.micro_sizes:
        mini = []
        for n in sizes:
            mini.append(share.samples[start : start + n])
            start += n
        out.append(mini)
    assert start == len(share.samples), f"micro_sizes cover {start} of the share's {len(share.samples)} samples"
    return out


def _useful_tokens(mb: TokenBatch) -> int:
    """Positions holding a sample's token: the mask (padded rows), the whole row (packed), the chunk's (SP)."""
    if isinstance(mb, SequenceShard):
        return mb.useful
    kwargs = mb.model_kwargs()
    return int(kwargs["attention_mask"].sum()) if "attention_mask" in kwargs else int(kwargs["input_ids"].numel())


ADV_EPS = 1e-8  # the whitened advantages' std floor (a batch of equal advantages stays finite)

# Per-update sums over micro-batches and ranks (one all-reduce): counted on the host, then taken on the device.
_HOST_SUMS = ("on_policy", "tokens", "useful", "processed", "padded")
_DEVICE_SUMS = ("loss", "clipped", "mismatch", "loss/kl", "loss/entropy", "loss/iw_mean", "loss/value", "loss/value_clip_frac")


def _to_device(mb: TokenBatch, device: torch.device) -> TokenBatch:
    """The micro-batch's tensors on `device`: through pinned memory without a stream sync (a plain copy from pageable
    memory waits for the GPU to drain). Other fields (a ring context, ints) stay as they are."""
    if device.type != "cuda":
        return mb
    moved = {
        f.name: getattr(mb, f.name).pin_memory().to(device, non_blocking=True)
        for f in dataclasses.fields(mb)  # type: ignore[arg-type]
        if isinstance(getattr(mb, f.name), torch.Tensor)
    }
    return dataclasses.replace(mb, **moved)  # type: ignore[type-var]
