"""The run plan: placement, batch arithmetic, run length and memory per GPU, checked before anything starts.

Semantics (issue #3):

- One rollout batch ("update") is train.prompts_per_step x rollout.samples_per_prompt samples. It is trained in
  train.ppo_epochs passes, each split into train.mini_batches mini-batches, and each mini-batch is ONE optimizer
  step: S = mini_batches x ppo_epochs optimizer steps per rollout batch.
- The policy version counts optimizer steps. A rollout batch taken at version u is trained by the steps that
  produce u+1 .. u+S, so a sample of version v in it must satisfy (u + S - 1) - v <= staleness.max_staleness.
  Hence k >= S - 1, or even a fresh sample breaks the bound at its batch's last step.
- Learner ranks R = cluster.learner_nodes x cluster.learner_gpus_per_node (cluster.debug_gpus when > 0).
  Sequence-parallel size SP = train.sequence_parallel_size divides R; data-parallel size DP = R / SP.
- Samples per mini-batch M = rollout batch / mini_batches; per DP rank M / DP; micro-batches per rank
  (gradient accumulation) A = (M / DP) / train.micro_batch_samples. Every division is exact and DP <= M.
  With a token budget (train.max_tokens_per_micro_batch > 0) the micro-batches are cut by tokens at every
  update (learner/train/micro_batches.py): A is then at most M / DP, and the budget x SP must hold the longest
  sample (actor.max_model_len tokens).
- Run length: train.total_steps rollout batches, or total_episodes / rollout batch when train.total_episodes > 0
  (whole). Over N training prompts: N / prompts_per_step steps per epoch, steps x prompts_per_step / N epochs,
  epochs x samples_per_prompt samples per prompt. N comes from the prompt set when it is at hand (addition: 100;
  data.path: its rows minus the validation split), else from data.num_prompts.
- Debug placement (cluster.debug_gpus = G): the same recipe on G learner GPUs. DP shrinks to G / SP and A grows,
  so the global batch and everything else stay identical. Actors go on the learner's node:
  cluster.actor_gpus_per_node / tensor_parallel_size engines.
- Generation: actor engines = actor_nodes x actor_gpus_per_node / tensor_parallel_size (whole).
- Memory per learner GPU. Colocated (cluster.colocate): the policy, the critic (algo.advantage = gae) and the
  reference (algo.kl_coef > 0 or algo.keep_reference) share the R learner GPUs, as in Open-Reasoner-Zero;
  otherwise each gets its own R GPUs. Parameters take model.dtype's bytes, gradients fp32's (accumulated over
  micro-batches in fp32). Adam keeps two fp32 moments, plus an fp32 master copy when training in bf16
  (DeepSpeed's mixed precision: the ZeRO paper's 12 bytes per parameter). ZeRO partitions over all R learner
  ranks (sequence-parallel ranks included, as DeepSpeed's sequence-data-parallel group does): stage 1 the
  optimizer states, stage 2 also the gradients, stage 3 also the parameters. The reference holds
  parameters only. The critic is counted at the policy's size (its value head is negligible).
- Activations per learner GPU: one micro-batch's training working set, estimated from the architecture and
  the tokens a micro-batch puts on one GPU (the budget, or micro_batch_samples x actor.max_model_len / SP):
  learner/memory.py says what is counted. The policy's and the critic's are never alive at once.
  Under ZeRO-3 rank 0 also keeps the full weights it serves the actors (weights.snapshot = "device": model.dtype
  bytes per parameter on its GPU; "host": none there). The run fits when the busiest GPU's model states +
  activations + snapshot stay within FIT_SHARE of cluster.gpu_memory_gib: the rest is for the CUDA context,
  NCCL's buffers and the allocator's fragmentation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from learner.memory import Activations, activation_bytes, config_json, read_arch
from protocol.config import Config, ConfigError

GIB = float(1 << 30)
FIT_SHARE = 0.9  # of a GPU's memory that model states and activations may take
# What an actor's weight group takes on its GPU besides the landing buffer: NCCL's communicator buffers and the
# memory the allocator keeps around them. An estimate: NCCL's own use depends on its channels and the topology.
NCCL_RESERVE = 1.0 * GIB
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def _need(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"{name}: {why}")


@dataclass(kw_only=True, slots=True)
class ModelMemory:
    """One model's state on one learner GPU, in bytes."""

    name: str  # policy | critic | reference
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


@dataclass(kw_only=True, slots=True)
class Plan:
    # placement
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
    # batch arithmetic
    prompts_per_step: int
    samples_per_prompt: int
    max_tokens: int  # generated tokens per sample, at most
    rollout_batch: int  # samples per rollout batch
    mini_batches: int
    ppo_epochs: int
    steps_per_batch: int  # S = mini_batches x ppo_epochs optimizer steps per rollout batch
    mini_batch: int  # M: samples per optimizer step
    samples_per_rank: int  # M / DP
    micro_batch: int  # samples per forward/backward (1 with a token budget)
    accumulation: int  # A = (M / DP) / micro_batch (with a token budget, the most there can be)
    token_budget: int  # train.max_tokens_per_micro_batch: tokens per micro-batch per GPU (0: counted in samples)
    recipe_accumulation: int  # A at the recipe's ranks
    max_staleness: int  # k
    min_staleness: int  # S - 1: the smallest k that fresh samples satisfy
    # run length
    length_source: str  # train.total_steps | train.total_episodes
    rollout_batches: int  # updates in the run
    optimizer_steps: int  # rollout_batches x S: the final policy version
    episodes: int  # samples trained over the run
    num_prompts: int | None  # training prompts (None: unknown)
    prompts_source: str
    steps_per_epoch: float | None
    epochs: float | None
    samples_per_prompt_run: float | None  # samples drawn per prompt over the run
    # memory per learner GPU
    num_params: int | None
    params_source: str
    dtype: str
    zero_stage: int
    memory: list[ModelMemory]  # one per model held by a learner GPU (empty when num_params is unknown)
    gpu_bytes: float | None  # per learner GPU: the sum when colocated, the largest model otherwise
    checkpointing: bool  # train.gradient_checkpointing
    activations: Activations | None  # one micro-batch's working set per GPU (None: architecture unknown)
    arch_source: str
    gpu_memory: float  # bytes of one learner GPU (cluster.gpu_memory_gib)
    snapshot_bytes: float  # rank 0's full copy of the weights on its GPU (ZeRO-3, weights.snapshot = "device"), else 0
    # memory per actor GPU, outside vLLM's share (actor.gpu_memory_utilization), which is sized before any sync
    vllm_share: float  # actor.gpu_memory_utilization
    landing_bytes: float | None  # each engine worker's receive buffer: the largest weight, or one bucket (None: unknown,
    # or actor.device = "cpu")

    @property
    def peak_bytes(self) -> float | None:
        """Model states + one micro-batch's activations + the weight snapshot on the busiest learner GPU (rank 0)."""
        if self.gpu_bytes is None or self.activations is None:
            return None
        return self.gpu_bytes + self.activations.total + self.snapshot_bytes

    @property
    def fits(self) -> bool | None:
        peak = self.peak_bytes
        return None if peak is None else peak <= FIT_SHARE * self.gpu_memory

    @property
    def actor_fits(self) -> bool | None:
        """Whether an engine GPU has room, beside vLLM's share, for the weight group's buffers (a full tensor on
        every tensor-parallel worker: each receives whole tensors and its loader keeps its slice)."""
        if self.landing_bytes is None:
            return None
        return self.landing_bytes + NCCL_RESERVE <= (1 - self.vllm_share) * self.gpu_memory


def _split(
    mini: int, ranks: int, ranks_text: str, sp: int, micro: int, *, sp_field: str, ranks_field: str, micro_field: str
) -> tuple[int, int]:
    """(DP, accumulation) for `ranks` learner ranks; ConfigError naming the field, with the arithmetic.
    `micro` 1 (a token budget): accumulation is the most micro-batches a rank can have, one per sample."""
    _need(ranks % sp == 0, sp_field, f"sequence_parallel_size {sp} does not divide {ranks_text}")
    dp = ranks // sp
    dp_text = f"{dp} data-parallel ranks ({ranks_text} / sequence_parallel_size {sp})"
    _need(dp <= mini, ranks_field, f"{dp_text} exceed the {mini} samples of a mini-batch")
    _need(mini % dp == 0, ranks_field, f"{mini} samples per mini-batch / {dp_text} is not whole")
    per_rank = mini // dp
    _need(
        per_rank % micro == 0,
        micro_field,
        f"{mini} samples per mini-batch / {dp} data-parallel ranks = {per_rank} per rank "
        f"is not a multiple of train.micro_batch_samples {micro}",
    )
    return dp, per_rank // micro


def held_out(rows: int, val_fraction: float) -> int:
    """Prompts data.val_fraction holds out: at least one when nonzero, as the data split does (by rows here)."""
    return 0 if val_fraction == 0 else max(1, round(val_fraction * rows))


def prompt_count(cfg: Config) -> tuple[int | None, str]:
    """Training prompts and where the number comes from: the set when at hand, else data.num_prompts."""
    from learner.data.prompts import addition_items
    from learner.data.sources import count_rows

    d = cfg.data
    if d.task == "addition":
        rows, source = len(addition_items()), "data.task = addition"
    elif Path(d.path).exists():  # a file or a folder; a hub id is not here
        rows, source = count_rows(Path(d.path)), f"rows of {d.path}"
    elif d.num_prompts > 0:
        rows, source = d.num_prompts, f"data.num_prompts ({d.path} is not here)"
    else:
        return None, f"unknown: {d.path} is not here and data.num_prompts = 0"
    held = held_out(rows, d.val_fraction)
    return rows - held, source + (f", minus {held} held out by data.val_fraction {d.val_fraction}" if held else "")


def count_params(path: str) -> int:
    """Parameters of the Hugging Face model at `path` (a folder or its config.json), built on the meta device: no
    weights read, no memory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = json.loads(Path(path).read_text()) if path.endswith(".json") else None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config) if config is not None else AutoConfig.from_pretrained(path))
    return sum(p.numel() for p in model.parameters())  # tied embeddings count once


def param_count(cfg: Config) -> tuple[int | None, str]:
    if cfg.model.num_params > 0:
        return cfg.model.num_params, "model.num_params"
    path = config_json(cfg.model.path, cfg.model.arch)
    if path is not None and path.is_file():
        return count_params(str(path)), str(path)
    return None, "unknown: set model.num_params or model.arch (no config.json at model.path here)"


def model_memory(name: str, n: int, dtype: str, stage: int, shards: int, trained: bool) -> ModelMemory:
    """Bytes of one model on one GPU under ZeRO `stage` partitioned over `shards` ranks."""
    b = DTYPE_BYTES[dtype]
    params = n * b / (shards if stage >= 3 else 1)
    if not trained:  # the frozen reference: weights only
        return ModelMemory(name=name, params=params, grads=0.0, optimizer=0.0)
    adam = 8 + (4 if b < 4 else 0)  # m and v in fp32, plus the fp32 master weights under bf16
    grad = 4  # accumulated in fp32 whatever the training dtype (learner/train/trainer.py: grad_accum_dtype)
    return ModelMemory(
        name=name, params=params, grads=n * grad / (shards if stage >= 2 else 1), optimizer=n * adam / (shards if stage >= 1 else 1)
    )


def make_plan(cfg: Config, num_prompts: int | None = None) -> Plan:
    """Every number of the run, checked; ConfigError naming the field and showing the arithmetic.

    `num_prompts`: the training prompt count when the caller has loaded the set (the learner does);
    otherwise it is found as `prompt_count` says.
    """
    c, t, r = cfg.cluster, cfg.train, cfg.rollout
    sp, budget = t.sequence_parallel_size, t.max_tokens_per_micro_batch
    micro = 1 if budget else t.micro_batch_samples
    longest = cfg.actor.max_model_len
    _need(
        not budget or budget * sp >= longest,
        "train.max_tokens_per_micro_batch",
        f"{budget} x sequence_parallel_size {sp} < actor.max_model_len {longest}: the longest sample would not fit "
        f"one micro-batch; set it to at least {-(-longest // sp)}",
    )
    rollout = t.prompts_per_step * r.samples_per_prompt
    batch_text = f"{t.prompts_per_step} prompts x {r.samples_per_prompt} samples = {rollout} samples per rollout batch"
    _need(rollout % t.mini_batches == 0, "train.mini_batches", f"{batch_text} / {t.mini_batches} mini-batches is not whole")
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
    _need(
        k >= steps - 1,
        "staleness.max_staleness",
        f"{k} < S - 1 = {steps - 1}: a rollout batch is trained in S = {steps} optimizer steps (train.mini_batches "
        f"{t.mini_batches} x train.ppo_epochs {t.ppo_epochs}), so even a fresh sample is {steps - 1} versions old "
        f"at its batch's last step; set max_staleness >= {steps - 1}",
    )

    if t.total_episodes > 0:
        _need(
            t.total_episodes % rollout == 0,
            "train.total_episodes",
            f"{t.total_episodes} samples / ({batch_text}) = {t.total_episodes / rollout:.2f} rollout batches is not whole",
        )
        updates, length_source = t.total_episodes // rollout, "train.total_episodes"
    else:
        updates, length_source = t.total_steps, "train.total_steps"

    actor_gpus = c.actor_nodes * c.actor_gpus_per_node
    _need(
        actor_gpus % c.tensor_parallel_size == 0,
        "cluster.tensor_parallel_size",
        f"cluster.actor_nodes {c.actor_nodes} x cluster.actor_gpus_per_node {c.actor_gpus_per_node} = {actor_gpus} "
        f"actor GPUs / tensor_parallel_size {c.tensor_parallel_size} is not whole",
    )
    engines = recipe_engines = actor_gpus // c.tensor_parallel_size
    actor_nodes = c.actor_nodes
    if c.debug_gpus > 0:  # one node's worth of engines, beside the learner
        engines, actor_nodes = c.actor_gpus_per_node // c.tensor_parallel_size, 1
        _need(
            engines >= 1,
            "cluster.debug_gpus",
            f"debug actors run on the learner's node: cluster.actor_gpus_per_node {c.actor_gpus_per_node} / "
            f"tensor_parallel_size {c.tensor_parallel_size} makes no whole engine",
        )

    n_prompts, prompts_source = (num_prompts, "the loaded prompt set") if num_prompts is not None else prompt_count(cfg)
    per_epoch = n_prompts / t.prompts_per_step if n_prompts else None
    epochs = updates * t.prompts_per_step / n_prompts if n_prompts else None

    a = cfg.algo
    models = ["policy"] + ["critic"] * (a.advantage == "gae") + ["reference"] * (a.kl_coef > 0 or a.keep_reference)
    n_params, params_source = param_count(cfg)
    memory = (
        []
        if n_params is None
        else [model_memory(m, n_params, cfg.model.dtype, t.zero_stage, ranks, trained=m != "reference") for m in models]
    )
    totals = [m.total for m in memory]
    gpu_bytes = (sum(totals) if c.colocate else max(totals)) if totals else None
    arch_path = config_json(cfg.model.path, cfg.model.arch)
    activations, arch_source = None, "unknown: set model.arch (no config.json at model.path here)"
    landing: float | None = None
    if arch_path is not None and arch_path.is_file():
        arch = read_arch(arch_path)
        largest = max(arch.vocab * arch.hidden, arch.intermediate * arch.hidden)  # the embedding, or one MLP matrix
        landing = float(max(largest * DTYPE_BYTES[cfg.model.dtype], cfg.weights.bucket_mb << 20))
        tokens = budget or -(-micro * longest // sp)  # sample-counted micro-batches: at their longest
        activations = activation_bytes(
            arch,
            tokens,
            DTYPE_BYTES[cfg.model.dtype],
            t.gradient_checkpointing,
            t.logprob_chunk_tokens,
            t.zero_stage,
            n_params or 0,
            cfg.rollout.top_p,
            cfg.rollout.top_k,
        )
        arch_source = str(arch_path)

    return Plan(
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
        prompts_per_step=t.prompts_per_step,
        samples_per_prompt=r.samples_per_prompt,
        max_tokens=r.max_tokens,
        rollout_batch=rollout,
        mini_batches=t.mini_batches,
        ppo_epochs=t.ppo_epochs,
        steps_per_batch=steps,
        mini_batch=mini,
        samples_per_rank=mini // dp,
        micro_batch=micro,
        accumulation=acc,
        recipe_accumulation=recipe_acc,
        token_budget=budget,
        max_staleness=k,
        min_staleness=steps - 1,
        length_source=length_source,
        rollout_batches=updates,
        optimizer_steps=updates * steps,
        episodes=updates * rollout,
        num_prompts=n_prompts,
        prompts_source=prompts_source,
        steps_per_epoch=per_epoch,
        epochs=epochs,
        samples_per_prompt_run=epochs * r.samples_per_prompt if epochs is not None else None,
        num_params=n_params,
        params_source=params_source,
        dtype=cfg.model.dtype,
        zero_stage=t.zero_stage,
        memory=memory,
        gpu_bytes=gpu_bytes,
        checkpointing=t.gradient_checkpointing,
        activations=activations,
        arch_source=arch_source,
        gpu_memory=c.gpu_memory_gib * GIB,
        snapshot_bytes=float((n_params or 0) * DTYPE_BYTES[cfg.model.dtype])
        if t.zero_stage == 3 and cfg.weights.snapshot == "device"
        else 0.0,
        vllm_share=cfg.actor.gpu_memory_utilization,
        landing_bytes=landing if cfg.actor.device != "cpu" else None,
    )


Rows = list[tuple[str, str, str]]  # label, value, how it was computed


def _table(sections: list[tuple[str, Rows]]) -> str:
    """Titled blocks of rows, with the columns aligned across all blocks."""
    rows = [r for _, block in sections for r in block]
    w0, w1 = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    lines = []
    for title, block in sections:
        lines += [title] + [f"  {a:<{w0}}  {b:>{w1}}  {c}".rstrip() for a, b, c in block] + [""]
    return "\n".join(lines)


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def sequences_how(p: Plan) -> str:
    """How one actor's sequences in flight compare with what its engine batches: on a GPU, fewer leave it part idle
    (decoding costs about the same per step for 8 sequences as for 256)."""
    how = f"= actor.max_groups x {p.samples_per_prompt} samples; the engine batches up to {p.max_num_seqs:,} (actor.max_num_seqs)"
    if p.engine_sequences < p.max_num_seqs:
        groups = -(-p.max_num_seqs // p.samples_per_prompt)
        how += f"; a GPU engine would run part idle: actor.max_groups = {groups} fills it"
    return how


def render(plan: Plan) -> str:
    """The plan as a readable text table: placement, batch arithmetic, run length, memory per GPU."""
    p = plan
    recipe = " (recipe: {})" if p.debug else ""
    ranks_how = f"{p.learner_nodes} node(s) x {p.learner_gpus_per_node} GPUs"
    if p.debug:
        ranks_how = f"cluster.debug_gpus, debug placement (recipe: {p.recipe_ranks} = {ranks_how})"
    models_how = ", ".join(p.models) + (
        f": colocated on the same {p.learner_ranks} GPUs" if p.colocate else f": {p.learner_ranks} GPUs each, {p.learner_gpus} in all"
    )
    engines_how = (
        f"on the learner's node: {p.actor_gpus_per_node} GPUs / tensor parallel {p.tensor_parallel} (recipe: {p.recipe_actor_engines})"
        if p.debug
        else f"{p.actor_nodes} node(s) x {p.actor_gpus_per_node} GPUs / tensor parallel {p.tensor_parallel}"
    )
    placement: Rows = [
        ("learner ranks", str(p.learner_ranks), ranks_how),
        ("sequence parallel", str(p.sequence_parallel), "ranks sharing one packed sequence"),
        (
            "data parallel",
            str(p.data_parallel),
            f"{p.learner_ranks} ranks / SP {p.sequence_parallel}" + recipe.format(p.recipe_data_parallel),
        ),
        ("learner models", str(len(p.models)), models_how),
        ("actor engines", str(p.actor_engines), engines_how),
        ("GPUs in all", str(p.learner_gpus + p.actor_engines * p.tensor_parallel), "learner + actors"),
        ("sequences per engine", f"{p.engine_sequences:,}", sequences_how(p)),
    ]
    batch: Rows = [
        ("rollout batch", f"{p.rollout_batch:,}", f"samples = {p.prompts_per_step} prompts x {p.samples_per_prompt}"),
        ("generated tokens", f"{p.max_tokens:,}", "per sample, at most (rollout.max_tokens)"),
        ("optimizer steps per batch", str(p.steps_per_batch), f"S = {p.mini_batches} mini-batch(es) x {p.ppo_epochs} PPO epoch(s)"),
        ("mini-batch", f"{p.mini_batch:,}", f"samples per optimizer step = {p.rollout_batch:,} / {p.mini_batches}"),
        ("per data-parallel rank", f"{p.samples_per_rank:,}", f"samples = {p.mini_batch:,} / {p.data_parallel}"),
        (
            "micro-batch",
            f"{p.token_budget:,} tokens" if p.token_budget else str(p.micro_batch),
            "per GPU, packed greedily (train.max_tokens_per_micro_batch)" if p.token_budget else "samples per forward/backward",
        ),
        (
            "gradient accumulation",
            f"<= {p.accumulation:,}" if p.token_budget else f"{p.accumulation:,}",
            "micro-batches, as many as the tokens need"
            if p.token_budget
            else f"= {p.samples_per_rank:,} / {p.micro_batch}" + recipe.format(p.recipe_accumulation),
        ),
        ("max staleness", str(p.max_staleness), f"k >= S - 1 = {p.min_staleness}"),
    ]
    unknown = ("unknown", "")
    per_epoch = (f"{p.steps_per_epoch:.2f}", f"= {p.num_prompts:,} / {p.prompts_per_step}") if p.steps_per_epoch else unknown
    epochs = (f"{p.epochs:.2f}", f"= {p.rollout_batches:,} x {p.prompts_per_step} / {p.num_prompts:,}") if p.epochs else unknown
    per_prompt = (f"{p.samples_per_prompt_run:.1f}", f"= epochs x {p.samples_per_prompt}") if p.samples_per_prompt_run else unknown
    length: Rows = [
        ("rollout batches", f"{p.rollout_batches:,}", p.length_source),
        ("optimizer steps", f"{p.optimizer_steps:,}", "the final policy version"),
        ("samples", f"{p.episodes:,}", ""),
        ("training prompts", f"{p.num_prompts:,}" if p.num_prompts else "unknown", p.prompts_source),
        ("steps per epoch", *per_epoch),
        ("epochs", *epochs),
        ("samples per prompt", *per_prompt),
    ]
    title = f"Memory per learner GPU ({p.dtype}, ZeRO-{p.zero_stage} over {p.learner_ranks} ranks)"
    memory: Rows = [("parameters", f"{p.num_params:,}" if p.num_params else "unknown", p.params_source)]
    memory += [
        (
            m.name,
            _gib(m.total),
            f"= params {_gib(m.params)} + grads {_gib(m.grads)} + Adam {_gib(m.optimizer)}" if m.optimizer else "= params only (frozen)",
        )
        for m in p.memory
    ]
    if p.gpu_bytes is not None:
        memory.append(("model states", _gib(p.gpu_bytes), "sum of the colocated models" if p.colocate else "the largest model"))
    a = p.activations
    if a is None:
        memory.append(("activations", "unknown", p.arch_source))
    else:
        how = "gradient checkpointing" if p.checkpointing else "no gradient checkpointing"
        memory.append(
            (
                "activations",
                _gib(a.total),
                f"= layers {_gib(a.layers)} + lm_head {_gib(a.head)}"
                + (f" + ZeRO-3 gathered {_gib(a.gathered)}" if a.gathered else "")
                + f" ({a.tokens:,} tokens per micro-batch, {how})",
            )
        )
    if p.snapshot_bytes:
        memory.append(
            (
                "weight snapshot",
                _gib(p.snapshot_bytes),
                "rank 0 only: the full weights it serves the actors (ZeRO-3, weights.snapshot = device)",
            )
        )
    if p.peak_bytes is not None:
        verdict = "fits" if p.fits else "DOES NOT FIT"
        memory.append(
            (
                "per GPU",
                _gib(p.peak_bytes),
                f"{verdict}: {FIT_SHARE:.0%} of {_gib(p.gpu_memory)} (cluster.gpu_memory_gib) is {_gib(FIT_SHARE * p.gpu_memory)}",
            )
        )
    elif p.gpu_bytes is not None:
        memory.append(("per GPU", _gib(p.gpu_bytes), "model states only (activations unknown)"))
    return _table([("Placement", placement), ("Batch arithmetic", batch), ("Run length", length), (title, memory), *_actor_memory(p)])


def _actor_memory(p: Plan) -> list[tuple[str, Rows]]:
    """The engine GPU's memory outside vLLM's share: what a weight sync allocates after vLLM sized its KV cache."""
    if p.landing_bytes is None:
        return []
    outside = (1 - p.vllm_share) * p.gpu_memory
    verdict = "fits" if p.actor_fits else "DOES NOT FIT: lower actor.gpu_memory_utilization"
    rows: Rows = [
        ("vLLM", _gib(p.vllm_share * p.gpu_memory), f"= {p.vllm_share:g} (actor.gpu_memory_utilization) x {_gib(p.gpu_memory)}"),
        ("weight landing buffer", _gib(p.landing_bytes), "the largest weight, or one bucket (weights.bucket_mb), per engine GPU"),
        ("NCCL", _gib(NCCL_RESERVE), "communicator buffers, an estimate"),
        ("outside vLLM", _gib(outside), f"{verdict} (landing buffer + NCCL)"),
    ]
    return [(f"Memory per actor GPU (CUDA, {_gib(p.gpu_memory)} as the learner's: cluster.gpu_memory_gib)", rows)]
