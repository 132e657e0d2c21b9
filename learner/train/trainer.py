"""One update per rollout batch, on every learner rank: S = mini_batches x ppo_epochs optimizer steps.

    rank 0: groups -> advantages -> samples -> shares (learner/train/shard.py: make_shares) --scatter--> every rank
    every rank, for each PPO epoch, for each mini-batch (one optimizer step):
        its micro-batches: learner logprobs -> clipped loss -> backward (gradient accumulation)
        DeepSpeed step: gradients averaged over the learner ranks, AdamW, ZeRO sharding
    The engines (policy, critic, reference) are built once by learner/train/engines.py.

The ratio is taken against the behaviour logprobs the actor sampled with, or against the learner's own before
the update (algo.old_logprobs = recompute: one no-grad pass in `_prepare` when S > 1). Each micro-batch's loss is
its share of the mini-batch's (learner/train/aggregation.py), divided by counts over ALL ranks (`Share`); DeepSpeed
averages gradients over the data-parallel replicas, so each rank's loss is scaled by dp_size to make the sum come
out exactly as on one process.

A mini-batch's micro-batches are cut by rank 0 (learner/train/micro_batches.py: a sample count or a
token budget), so their number varies from update to update: the trainer tells DeepSpeed where
each optimizer step falls (`set_gradient_accumulation_boundary`) instead of letting it count.
Logprobs come from the lm_head a chunk of tokens at a time (learner/train/scoring.py), and the loss
stays on the device; one all-reduce per update brings the metrics home.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from learner import staleness as st
from learner.train.advantages import make_advantage
from learner.train.aggregation import Denominators, Segments
from learner.train.batch import Sample, TokenBatch
from learner.train.distributed import Topology
from learner.train.engines import UpdateLayout, build_engines
from learner.train.kl import make_kl_reward
from learner.train.layout import attention_implementation, micro_batch_layout
from learner.train.losses import make_policy_loss, value_loss
from learner.train.scoring import score_tokens
from learner.train.sequence_parallel import SequenceShard
from learner.train.shard import Share
from learner.train.step_check import StepWatch
from protocol.config import Config, ConfigError


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


class Trainer:
    def __init__(self, cfg: Config, model: torch.nn.Module, topo: Topology, layout: UpdateLayout):
        self.cfg, self.topo, self.layout = cfg, topo, layout
        self.advantage = make_advantage(cfg.algo)
        self.policy_loss = make_policy_loss(cfg.algo, cfg.rollout.max_tokens)
        self.kl_reward = make_kl_reward(cfg.algo)  # None unless algo.kl_in_reward (gae): then the loss has no KL term
        if self.advantage.needs_critic and topo.sp_size > 1:
            raise ConfigError(
                "algo.advantage: gae needs every value of a sample on one rank; it does not run with train.sequence_parallel_size > 1 yet"
            )
        # Padded rows, one packed row, or this rank's chunk of it (SP): chosen once, with its attention.
        self.build = micro_batch_layout(cfg.train, topo.sp_group)
        engines = build_engines(
            cfg,
            model,
            topo,
            layout,
            attention_implementation(cfg.train),
            critic=self.advantage.needs_critic,
            reference=self.policy_loss.needs_reference or self.kl_reward is not None or cfg.algo.keep_reference,
        )
        self.engine, self.head, self.vocab_size = engines.policy, engines.head, engines.vocab_size
        self.critic, self.reference = engines.critic, engines.reference

    def update(self, share: Share) -> UpdateStats:
        """Train this rank's share: S optimizer steps from `share.version`. Stats are summed over ranks."""
        steps, version, max_staleness = self.layout.optimizer_steps, share.version, share.max_staleness
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
        # What each micro-batch's loss divides by: counts over all ranks, so that any cut gives the same loss.
        norms = [[_denominators(share, j, c, self.topo.dp_size) for c in mini] for j, mini in enumerate(chunks)]
        segments = [
            [self._segments(c, mb) for c, mb in zip(mini, mbs, strict=True)] for mini, mbs in zip(chunks, micro_batches, strict=True)
        ]
        # The loss is a sum over ranks' micro-batches; DeepSpeed sums SP peers' gradients and averages the DP replicas.
        scale = float(self.topo.dp_size)
        self.engine.train()
        steps_before = self.engine.global_steps
        lr = float(self.engine.get_lr()[0])  # the update's first optimizer step's (learner/train/lr_schedule.py)
        watch = StepWatch(self.engine, steps, self.topo.device)
        critic_watch = StepWatch(self.critic, steps, self.topo.device, "critic") if self.critic is not None else None
        sums = torch.zeros(len(_DEVICE_SUMS), dtype=torch.float64, device=self.topo.device)
        for epoch in range(self.layout.ppo_epochs):
            for j in range(self.layout.mini_batches):
                last = len(micro_batches[j]) - 1
                for i, (mb, extra, norm, seg) in enumerate(zip(micro_batches[j], extras[j], norms[j], segments[j], strict=True)):
                    # Every rank has as many micro-batches in mini-batch j (rank 0 cut them so): the boundaries agree.
                    for engine in (self.engine, self.critic):
                        if engine is not None:
                            engine.set_gradient_accumulation_boundary(i == last)
                    row = self._micro_step(mb, extra, norm, seg, scale, first_step=epoch == 0 and j == 0)
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
        metrics["train/lr"] = lr
        if self.critic is not None:
            metrics["loss/value"] = total["loss/value"] / steps
        if self.cfg.algo.seq_mask_bound > 0 and tokens:
            metrics["loss/seq_masked_frac"] = total["loss/seq_masked_frac"] / tokens
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
        if self.policy_loss.needs_prox and self.layout.optimizer_steps > 1:
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
            # algo.kl_in_reward: -kl_coef * KL(behaviour || reference) on every token, before GAE (learner/train/kl.py)
            penalty = None if self.kl_reward is None else self.kl_reward(mb.behaviour_logp.to(dev), out["ref"])
            adv = self.advantage(mb.rewards.to(dev), mb.lengths.to(dev), old, penalty)  # type: ignore[attr-defined]  # padded and packed layouts have them
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

    def _segments(self, samples: list[Sample], mb: TokenBatch) -> Segments | None:
        """Which sample each scored token is of, when a sequence-level term needs it (an SP rank: its range)."""
        if not self.policy_loss.needs_segments:
            return None
        lengths = [s.n_scored for s in samples]
        return Segments.of(lengths, mb.tokens if isinstance(mb, SequenceShard) else None).to(self.topo.device)

    def _micro_step(
        self, mb: TokenBatch, extra: dict[str, torch.Tensor], norm: Denominators, seg: Segments | None, scale: float, first_step: bool
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
            norm,
            prox_logp=prox,
            segments=seg,
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
        for key, value in (
            ("loss/kl", out.kl_mean),
            ("loss/entropy", out.entropy_mean),
            ("loss/iw_mean", out.iw_mean),
            ("loss/seq_masked_frac", out.masked_frac),
        ):
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
                norm.tokens,  # the value loss stays a token mean over the mini-batch, whatever loss_agg says
            )
            self.critic.backward(v.loss * scale, scale_wrt_gas=False)
            self.critic.step()
            row.update({"loss/value": v.loss.detach(), "loss/value_clip_frac": v.clip_frac * n})
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        return torch.stack([row[k].double() if k in row else zero for k in _DEVICE_SUMS])


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
_DEVICE_SUMS = (
    "loss",
    "clipped",
    "mismatch",
    "loss/kl",
    "loss/entropy",
    "loss/iw_mean",
    "loss/seq_masked_frac",
    "loss/value",
    "loss/value_clip_frac",
)


def _denominators(share: Share, j: int, samples: list[Sample], dp_size: int) -> Denominators:
    """Micro-batch `samples` of mini-batch j: the mini-batch's counts over all ranks (rank 0 put them in the share),
    its own completion tokens (whole samples: an SP group's chunks share them), and the micro-batches of the
    mini-batch over all DP ranks (each has as many: rank 0 cut them so, micro_batches.py)."""
    return Denominators(
        tokens=share.mini_batch_tokens[j],
        samples=share.mini_batch_samples[j],
        micro_tokens=sum(s.n_scored for s in samples),
        micro_batches=len(share.micro_sizes[j]) * dp_size,
    )


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
