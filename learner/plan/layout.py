"""Where the run's processes go and how one update's batch is cut: the two records `fleetrl plan` checks first.

- Learner ranks R = cluster.learner_nodes x cluster.learner_gpus_per_node (cluster.debug_gpus when > 0).
  Sequence-parallel size SP = train.sequence_parallel_size divides R; data-parallel size DP = R / SP.
- One update trains one rollout batch of train.prompts_per_step x rollout.samples_per_prompt samples, in
  train.ppo_epochs passes, each split into train.mini_batches mini-batches, each mini-batch ONE optimizer step:
  S = mini_batches x ppo_epochs optimizer steps per update.
- Samples per mini-batch M = rollout batch / mini_batches; per DP rank M / DP; micro-batches per rank
  (gradient accumulation) A = (M / DP) / train.micro_batch_samples. Every division is exact and DP <= M.
  With a token budget (train.max_tokens_per_micro_batch > 0) the micro-batches are cut by tokens at every
  update (learner/train/micro_batches.py): A is then at most M / DP, and the budget x SP must hold the longest
  sample (actor.max_model_len tokens).
- The policy version counts optimizer steps. A rollout batch taken at version u is trained by the steps that
  produce u+1 .. u+S, so a sample of version v in it must satisfy (u + S - 1) - v <= staleness.max_staleness.
  Hence k >= S - 1, or even a fresh sample breaks the bound at its batch's last step.
- Debug placement (cluster.debug_gpus = G): the same recipe on G learner GPUs. DP shrinks to G / SP and A grows,
  so the global batch and everything else stay identical. Actors go on the learner's node:
  cluster.actor_gpus_per_node / tensor_parallel_size engines.
- Generation: actor engines = actor_nodes x actor_gpus_per_node / tensor_parallel_size (whole).
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.config import Config, ConfigError


def need(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"{name}: {why}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    learner_nodes: int
    learner_gpus_per_node: int
    recipe_ranks: int  # the recipe's learner ranks: learner_nodes x learner_gpus_per_node
    debug: bool  # cluster.debug_gpus > 0: the recipe fitted onto fewer (or other) learner GPUs
    learner_ranks: int  # R in this placement (debug_gpus when debugging)
    sequence_parallel: int  # SP: ranks sharing one packed sequence
    data_parallel: int  # DP = R / SP
    recipe_data_parallel: int  # DP at the recipe's ranks (== data_parallel unless debugging)
    models: list[str]  # what the learner GPUs hold: policy, critic, reference
    colocate: bool
    learner_gpus: int  # GPUs on the learner side: R colocated, R per model otherwise
    actor_nodes: int  # nodes with actors (debug: 1, the learner's)
    actor_gpus_per_node: int
    tensor_parallel: int  # GPUs per engine
    actor_engines: int  # actor processes, one vLLM engine each
    recipe_actor_engines: int
    engine_sequences: int  # sequences one actor keeps in flight: actor.max_groups x rollout.samples_per_prompt
    max_num_seqs: int  # what its engine batches at once (actor.max_num_seqs)


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchLayout:
    prompts_per_update: int  # train.prompts_per_step
    samples_per_prompt: int
    max_tokens: int  # generated tokens per sample, at most
    rollout_batch: int  # samples per update
    mini_batches: int
    ppo_epochs: int
    steps_per_update: int  # S = mini_batches x ppo_epochs optimizer steps
    mini_batch: int  # M: samples per optimizer step
    samples_per_rank: int  # M / DP
    micro_batch: int  # samples per forward/backward (1 with a token budget)
    accumulation: int  # A = (M / DP) / micro_batch (with a token budget, the most there can be)
    recipe_accumulation: int  # A at the recipe's ranks
    token_budget: int  # train.max_tokens_per_micro_batch: tokens per micro-batch per GPU (0: counted in samples)
    max_staleness: int  # k
    min_staleness: int  # S - 1: the smallest k that fresh samples satisfy


def models_of(cfg: Config) -> list[str]:
    """What the learner GPUs hold: the policy, the critic (algo.advantage = gae), the reference (KL, or kept)."""
    a = cfg.algo
    return ["policy"] + ["critic"] * (a.advantage == "gae") + ["reference"] * (a.kl_coef > 0 or a.keep_reference)


def lay_out(cfg: Config) -> tuple[Placement, BatchLayout]:
    """The placement and the batch arithmetic, checked together (DP depends on both); ConfigError naming the field,
    with the arithmetic."""
    c, t, r = cfg.cluster, cfg.train, cfg.rollout
    sp, budget = t.sequence_parallel_size, t.max_tokens_per_micro_batch
    micro = 1 if budget else t.micro_batch_samples
    longest = cfg.actor.max_model_len
    need(
        not budget or budget * sp >= longest,
        "train.max_tokens_per_micro_batch",
        f"{budget} x sequence_parallel_size {sp} < actor.max_model_len {longest}: the longest sample would not fit "
        f"one micro-batch; set it to at least {-(-longest // sp)}",
    )
    rollout = t.prompts_per_step * r.samples_per_prompt
    batch_text = f"{t.prompts_per_step} prompts x {r.samples_per_prompt} samples = {rollout} samples per rollout batch"
    need(rollout % t.mini_batches == 0, "train.mini_batches", f"{batch_text} / {t.mini_batches} mini-batches is not whole")
    mini = rollout // t.mini_batches

    recipe_ranks = c.learner_nodes * c.learner_gpus_per_node
    recipe_text = (
        f"{recipe_ranks} learner ranks (cluster.learner_nodes {c.learner_nodes} x cluster.learner_gpus_per_node {c.learner_gpus_per_node})"
    )
    recipe_dp, recipe_acc = _split(
        mini,
        recipe_ranks,
        recipe_text,
        sp,
        micro,
        sp_field="train.sequence_parallel_size",
        ranks_field="cluster.learner_gpus_per_node",
        micro_field="train.micro_batch_samples",
    )
    ranks, dp, acc = recipe_ranks, recipe_dp, recipe_acc
    if c.debug_gpus > 0:  # same batch, fewer ranks: the micro-batch stays, accumulation absorbs the rest
        ranks = c.debug_gpus
        # The recipe itself passed above, so whatever fails here is the debug placement's fault.
        dp, acc = _split(
            mini,
            ranks,
            f"cluster.debug_gpus = {ranks} learner ranks",
            sp,
            micro,
            sp_field="cluster.debug_gpus",
            ranks_field="cluster.debug_gpus",
            micro_field="cluster.debug_gpus",
        )

    steps = t.mini_batches * t.ppo_epochs
    k = cfg.staleness.max_staleness
    need(
        k >= steps - 1,
        "staleness.max_staleness",
        f"{k} < S - 1 = {steps - 1}: a rollout batch is trained in S = {steps} optimizer steps (train.mini_batches "
        f"{t.mini_batches} x train.ppo_epochs {t.ppo_epochs}), so even a fresh sample is {steps - 1} versions old "
        f"at its batch's last step; set max_staleness >= {steps - 1}",
    )

    actor_gpus = c.actor_nodes * c.actor_gpus_per_node
    need(
        actor_gpus % c.tensor_parallel_size == 0,
        "cluster.tensor_parallel_size",
        f"cluster.actor_nodes {c.actor_nodes} x cluster.actor_gpus_per_node {c.actor_gpus_per_node} = {actor_gpus} "
        f"actor GPUs / tensor_parallel_size {c.tensor_parallel_size} is not whole",
    )
    engines = recipe_engines = actor_gpus // c.tensor_parallel_size
    actor_nodes = c.actor_nodes
    if c.debug_gpus > 0:  # one node's worth of engines, beside the learner
        engines, actor_nodes = c.actor_gpus_per_node // c.tensor_parallel_size, 1
        need(
            engines >= 1,
            "cluster.debug_gpus",
            f"debug actors run on the learner's node: cluster.actor_gpus_per_node {c.actor_gpus_per_node} / "
            f"tensor_parallel_size {c.tensor_parallel_size} makes no whole engine",
        )
    models = models_of(cfg)
    placement = Placement(
        learner_nodes=c.learner_nodes,
        learner_gpus_per_node=c.learner_gpus_per_node,
        recipe_ranks=recipe_ranks,
        debug=c.debug_gpus > 0,
        learner_ranks=ranks,
        sequence_parallel=sp,
        data_parallel=dp,
        recipe_data_parallel=recipe_dp,
        models=models,
        colocate=c.colocate,
        learner_gpus=ranks if c.colocate else ranks * len(models),
        actor_nodes=actor_nodes,
        actor_gpus_per_node=c.actor_gpus_per_node,
        tensor_parallel=c.tensor_parallel_size,
        actor_engines=engines,
        recipe_actor_engines=recipe_engines,
        engine_sequences=cfg.actor.max_groups * r.samples_per_prompt,
        max_num_seqs=cfg.actor.max_num_seqs,
    )
    batch = BatchLayout(
        prompts_per_update=t.prompts_per_step,
        samples_per_prompt=r.samples_per_prompt,
        max_tokens=r.max_tokens,
        rollout_batch=rollout,
        mini_batches=t.mini_batches,
        ppo_epochs=t.ppo_epochs,
        steps_per_update=steps,
        mini_batch=mini,
        samples_per_rank=mini // dp,
        micro_batch=micro,
        accumulation=acc,
        recipe_accumulation=recipe_acc,
        token_budget=budget,
        max_staleness=k,
        min_staleness=steps - 1,
    )
    return placement, batch


def _split(
    mini: int, ranks: int, ranks_text: str, sp: int, micro: int, *, sp_field: str, ranks_field: str, micro_field: str
) -> tuple[int, int]:
    """(DP, accumulation) for `ranks` learner ranks; ConfigError naming the field, with the arithmetic.
    `micro` 1 (a token budget): accumulation is the most micro-batches a rank can have, one per sample."""
    need(ranks % sp == 0, sp_field, f"sequence_parallel_size {sp} does not divide {ranks_text}")
    dp = ranks // sp
    dp_text = f"{dp} data-parallel ranks ({ranks_text} / sequence_parallel_size {sp})"
    need(dp <= mini, ranks_field, f"{dp_text} exceed the {mini} samples of a mini-batch")
    need(mini % dp == 0, ranks_field, f"{mini} samples per mini-batch / {dp_text} is not whole")
    per_rank = mini // dp
    need(
        per_rank % micro == 0,
        micro_field,
        f"{mini} samples per mini-batch / {dp} data-parallel ranks = {per_rank} per rank "
        f"is not a multiple of train.micro_batch_samples {micro}",
    )
    return dp, per_rank // micro
