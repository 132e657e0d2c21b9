"""Memory per GPU, learner and actor: will the run fit?

Learner GPU. Colocated (cluster.colocate): the policy, the critic (algo.advantage = gae) and the reference
(algo.kl_coef > 0 or algo.keep_reference) share the R learner GPUs, as in Open-Reasoner-Zero; otherwise each
gets its own R GPUs. Parameters take model.dtype's bytes, gradients fp32's (accumulated over micro-batches in
fp32). Adam keeps two fp32 moments, plus an fp32 master copy when training in bf16 (DeepSpeed's mixed precision:
the ZeRO paper's 12 bytes per parameter). ZeRO partitions over all R learner ranks (sequence-parallel ranks
included, as DeepSpeed's sequence-data-parallel group does): stage 1 the optimizer states, stage 2 also the
gradients, stage 3 also the parameters. The reference holds parameters only. The critic is counted at the
policy's size (its value head is negligible). Activations: one micro-batch's training working set, from the
architecture and the tokens a micro-batch puts on one GPU (the budget, or micro_batch_samples x
actor.max_model_len / SP; learner/plan/activations.py says what is counted); the policy's and the critic's are
never alive at once. Under ZeRO-3 rank 0 also keeps the full weights it serves the actors (weights.snapshot =
"device": model.dtype bytes per parameter on its GPU; "host": none there). The run fits when the busiest GPU's
model states + activations + snapshot stay within FIT_SHARE of cluster.gpu_memory_gib: the rest is for the CUDA
context, NCCL's buffers and the allocator's fragmentation.

Actor GPU. vLLM sizes its KV cache within actor.gpu_memory_utilization before any sync; a weight sync then
allocates a landing buffer (the largest weight, or one bucket) and NCCL's buffers outside that share.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from learner.plan.activations import Activations, activation_bytes, config_json, read_arch
from learner.plan.layout import BatchLayout, Placement
from protocol.config import Config

GIB = float(1 << 30)
FIT_SHARE = 0.9  # of a GPU's memory that model states and activations may take
# What an actor's weight group takes on its GPU besides the landing buffer: NCCL's communicator buffers and the
# memory the allocator keeps around them. An estimate: NCCL's own use depends on its channels and the topology.
NCCL_RESERVE = 1.0 * GIB
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelMemory:
    """One model's state on one learner GPU, in bytes."""

    name: str  # policy | critic | reference
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True, kw_only=True, slots=True)
class LearnerMemory:
    num_params: int | None
    params_source: str
    dtype: str
    zero_stage: int
    models: list[ModelMemory]  # one per model held by a learner GPU (empty when num_params is unknown)
    colocate: bool  # the models share each learner GPU (cluster.colocate), or each has GPUs of its own
    gpu_bytes: float | None  # per learner GPU: the sum when colocated, the largest model otherwise
    checkpointing: bool  # train.gradient_checkpointing
    activations: Activations | None  # one micro-batch's working set per GPU (None: architecture unknown)
    arch_source: str
    gpu_memory: float  # bytes of one learner GPU (cluster.gpu_memory_gib)
    snapshot_bytes: float  # rank 0's full copy of the weights on its GPU (ZeRO-3, weights.snapshot = "device"), else 0

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


@dataclass(frozen=True, kw_only=True, slots=True)
class ActorMemory:
    """An engine GPU's memory outside vLLM's share (actor.gpu_memory_utilization), which is sized before any sync."""

    vllm_share: float  # actor.gpu_memory_utilization
    gpu_memory: float  # bytes of one GPU (cluster.gpu_memory_gib, as the learner's)
    landing_bytes: float  # each engine worker's receive buffer: the largest weight, or one bucket

    @property
    def outside(self) -> float:
        return (1 - self.vllm_share) * self.gpu_memory

    @property
    def fits(self) -> bool:
        """Room beside vLLM's share for the weight group's buffers (a full tensor on every tensor-parallel worker:
        each receives whole tensors and its loader keeps its slice)."""
        return self.landing_bytes + NCCL_RESERVE <= self.outside


def memory(cfg: Config, placement: Placement, batch: BatchLayout) -> tuple[LearnerMemory, ActorMemory | None]:
    """The learner's and the actors' memory per GPU (the actors': None when unknown, or actor.device = "cpu")."""
    t = cfg.train
    n_params, params_source = param_count(cfg)
    models = (
        []
        if n_params is None
        else [
            model_memory(m, n_params, cfg.model.dtype, t.zero_stage, placement.learner_ranks, trained=m != "reference")
            for m in placement.models
        ]
    )
    totals = [m.total for m in models]
    arch_path = config_json(cfg.model.path, cfg.model.arch)
    activations, arch_source = None, "unknown: set model.arch (no config.json at model.path here)"
    actor = None
    if arch_path is not None and arch_path.is_file():
        arch = read_arch(arch_path)
        largest = max(arch.vocab * arch.hidden, arch.intermediate * arch.hidden)  # the embedding, or one MLP matrix
        if cfg.actor.device != "cpu":
            landing = float(max(largest * DTYPE_BYTES[cfg.model.dtype], cfg.weights.bucket_mb << 20))
            actor = ActorMemory(
                vllm_share=cfg.actor.gpu_memory_utilization, gpu_memory=cfg.cluster.gpu_memory_gib * GIB, landing_bytes=landing
            )
        # sample-counted micro-batches: at their longest
        tokens = batch.token_budget or -(-batch.micro_batch * cfg.actor.max_model_len // placement.sequence_parallel)
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
    learner = LearnerMemory(
        num_params=n_params,
        params_source=params_source,
        dtype=cfg.model.dtype,
        zero_stage=t.zero_stage,
        models=models,
        colocate=placement.colocate,
        gpu_bytes=(sum(totals) if placement.colocate else max(totals)) if totals else None,
        checkpointing=t.gradient_checkpointing,
        activations=activations,
        arch_source=arch_source,
        gpu_memory=cfg.cluster.gpu_memory_gib * GIB,
        snapshot_bytes=float((n_params or 0) * DTYPE_BYTES[cfg.model.dtype])
        if t.zero_stage == 3 and cfg.weights.snapshot == "device"
        else 0.0,
    )
    return learner, actor


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
    grad = 4  # accumulated in fp32 whatever the training dtype (learner/train/engines.py: grad_accum_dtype)
    return ModelMemory(
        name=name, params=params, grads=n * grad / (shards if stage >= 2 else 1), optimizer=n * adam / (shards if stage >= 1 else 1)
    )
