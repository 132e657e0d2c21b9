"""`fleetrl plan`'s text: the plan as titled tables of label, value, and how the value was computed."""

from __future__ import annotations

from learner.plan.layout import BatchLayout, Placement
from learner.plan.length import LrPlan, RunLength
from learner.plan.make import Plan
from learner.plan.memory import FIT_SHARE, GIB, NCCL_RESERVE, ActorMemory, LearnerMemory

Rows = list[tuple[str, str, str]]  # label, value, how it was computed


def render(plan: Plan) -> str:
    """The plan as a readable text table: placement, batch arithmetic, run length, memory per GPU."""
    p, b, m = plan.placement, plan.batch, plan.learner_memory
    sections = [
        ("Placement", placement_rows(p, b)),
        ("Batch arithmetic", batch_rows(b, p)),
        ("Run length", length_rows(plan.length, b)),
        (f"Memory per learner GPU ({m.dtype}, ZeRO-{m.zero_stage} over {p.learner_ranks} ranks)", learner_rows(m)),
    ]
    if (a := plan.actor_memory) is not None:
        sections.append((f"Memory per actor GPU (CUDA, {_gib(a.gpu_memory)} as the learner's: cluster.gpu_memory_gib)", actor_rows(a)))
    return _table(sections)


def sequences_how(p: Placement, samples_per_prompt: int) -> str:
    """How one actor's sequences in flight compare with what its engine batches: on a GPU, fewer leave it part idle
    (decoding costs about the same per step for 8 sequences as for 256)."""
    how = f"= actor.max_groups x {samples_per_prompt} samples; the engine batches up to {p.max_num_seqs:,} (actor.max_num_seqs)"
    if p.engine_sequences < p.max_num_seqs:
        groups = -(-p.max_num_seqs // samples_per_prompt)
        how += f"; a GPU engine would run part idle: actor.max_groups = {groups} fills it"
    return how


def placement_rows(p: Placement, b: BatchLayout) -> Rows:
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
    return [
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
        ("sequences per engine", f"{p.engine_sequences:,}", sequences_how(p, b.samples_per_prompt)),
    ]


def batch_rows(b: BatchLayout, p: Placement) -> Rows:
    recipe = " (recipe: {})" if p.debug else ""
    return [
        ("rollout batch", f"{b.rollout_batch:,}", f"samples per update = {b.prompts_per_update} prompts x {b.samples_per_prompt}"),
        ("generated tokens", f"{b.max_tokens:,}", "per sample, at most (rollout.max_tokens)"),
        (
            "optimizer steps per update",
            str(b.steps_per_update),
            f"S = {b.mini_batches} mini-batch(es) x {b.ppo_epochs} PPO epoch(s)",
        ),
        ("mini-batch", f"{b.mini_batch:,}", f"samples per optimizer step = {b.rollout_batch:,} / {b.mini_batches}"),
        ("per data-parallel rank", f"{b.samples_per_rank:,}", f"samples = {b.mini_batch:,} / {p.data_parallel}"),
        (
            "micro-batch",
            f"{b.token_budget:,} tokens" if b.token_budget else str(b.micro_batch),
            "per GPU, packed greedily (train.max_tokens_per_micro_batch)" if b.token_budget else "samples per forward/backward",
        ),
        (
            "gradient accumulation",
            f"<= {b.accumulation:,}" if b.token_budget else f"{b.accumulation:,}",
            "micro-batches, as many as the tokens need"
            if b.token_budget
            else f"= {b.samples_per_rank:,} / {b.micro_batch}" + recipe.format(b.recipe_accumulation),
        ),
        ("max staleness", str(b.max_staleness), f"k >= S - 1 = {b.min_staleness}"),
    ]


def length_rows(n: RunLength, b: BatchLayout) -> Rows:
    unknown = ("unknown", "")
    per_epoch, loader, epochs = unknown, unknown, unknown
    if n.num_prompts and n.updates_per_epoch and n.epochs:
        how = f"= {n.num_prompts:,} / {b.prompts_per_update}; FleetRL's epochs run back to back, a batch may span two"
        per_epoch = (f"{n.updates_per_epoch:.2f}", how)
        epochs_how = f"= {n.updates:,} x {b.prompts_per_update} / {n.num_prompts:,}"
        if n.last_batch:
            loader = (
                f"{n.batches_kept:,} | {n.batches_dropped:,}",
                f"batches per epoch, the last of {n.last_batch:,} prompts trained (ORZ) | dropped (verl, open-instruct)",
            )
            kept = f"{n.updates / n.batches_kept:.2f}" if n.batches_kept else "-"
            dropped = f"{n.updates / n.batches_dropped:.2f}" if n.batches_dropped else "-"
            epochs_how += f"; as the sources count: {kept} (ORZ) | {dropped} (verl, open-instruct)"
        else:
            loader = (f"{n.batches_kept:,}", "batches per epoch, none partial")
        if n.epochs > n.max_epochs:
            epochs_how += f"; more than data.epochs = {n.max_epochs}: the prompts run out first"
        epochs = (f"{n.epochs:.2f}", epochs_how)
    per_prompt = (f"{n.samples_per_prompt:.1f}", f"= epochs x {b.samples_per_prompt}") if n.samples_per_prompt else unknown
    return [
        ("updates", f"{n.updates:,}", f"rollout batches ({n.source})"),
        ("optimizer steps", f"{n.optimizer_steps:,}", "the final policy version"),
        ("learning rate", f"{n.lr.peak:g}", lr_how(n.lr, n.optimizer_steps)),
        ("samples", f"{n.episodes:,}", ""),
        ("training prompts", f"{n.num_prompts:,}" if n.num_prompts else "unknown", n.prompts_source),
        ("updates per epoch", *per_epoch),
        ("per-epoch dataloader", *loader),
        ("epochs", *epochs),
        ("samples per prompt", *per_prompt),
    ]


def lr_how(lr: LrPlan, steps: int) -> str:
    """The schedule in words (learner/train/lr_schedule.py)."""
    warmup = f"warmup over {lr.warmup_steps:,} optimizer steps from {lr.first:g}, then " if lr.warmup_steps else ""
    if lr.schedule == "constant":
        return f"peak (train.lr); {warmup}constant"
    return f"peak (train.lr); {warmup}{lr.schedule} decay to {lr.final:g} after step {steps:,}"


def learner_rows(m: LearnerMemory) -> Rows:
    rows: Rows = [("parameters", f"{m.num_params:,}" if m.num_params else "unknown", m.params_source)]
    rows += [
        (
            x.name,
            _gib(x.total),
            f"= params {_gib(x.params)} + grads {_gib(x.grads)} + Adam {_gib(x.optimizer)}" if x.optimizer else "= params only (frozen)",
        )
        for x in m.models
    ]
    if m.gpu_bytes is not None:
        rows.append(("model states", _gib(m.gpu_bytes), "sum of the colocated models" if m.colocate else "the largest model"))
    a = m.activations
    if a is None:
        rows.append(("activations", "unknown", m.arch_source))
    else:
        how = "gradient checkpointing" if m.checkpointing else "no gradient checkpointing"
        rows.append(
            (
                "activations",
                _gib(a.total),
                f"= layers {_gib(a.layers)} + lm_head {_gib(a.head)}"
                + (f" + ZeRO-3 gathered {_gib(a.gathered)}" if a.gathered else "")
                + f" ({a.tokens:,} tokens per micro-batch, {how})",
            )
        )
    if m.snapshot_bytes:
        rows.append(
            (
                "weight snapshot",
                _gib(m.snapshot_bytes),
                "rank 0 only: the full weights it serves the actors (ZeRO-3, weights.snapshot = device)",
            )
        )
    if m.peak_bytes is not None:
        verdict = "fits" if m.fits else "DOES NOT FIT"
        rows.append(
            (
                "per GPU",
                _gib(m.peak_bytes),
                f"{verdict}: {FIT_SHARE:.0%} of {_gib(m.gpu_memory)} (cluster.gpu_memory_gib) is {_gib(FIT_SHARE * m.gpu_memory)}",
            )
        )
    elif m.gpu_bytes is not None:
        rows.append(("per GPU", _gib(m.gpu_bytes), "model states only (activations unknown)"))
    return rows


def actor_rows(a: ActorMemory) -> Rows:
    """The engine GPU's memory outside vLLM's share: what a weight sync allocates after vLLM sized its KV cache."""
    verdict = "fits" if a.fits else "DOES NOT FIT: lower actor.gpu_memory_utilization"
    return [
        ("vLLM", _gib(a.vllm_share * a.gpu_memory), f"= {a.vllm_share:g} (actor.gpu_memory_utilization) x {_gib(a.gpu_memory)}"),
        ("weight landing buffer", _gib(a.landing_bytes), "the largest weight, or one bucket (weights.bucket_mb), per engine GPU"),
        ("NCCL", _gib(NCCL_RESERVE), "communicator buffers, an estimate"),
        ("outside vLLM", _gib(a.outside), f"{verdict} (landing buffer + NCCL)"),
    ]


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
