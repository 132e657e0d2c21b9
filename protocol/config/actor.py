"""The actor's inference engine (vLLM): device, memory, context, batching and the CPU build's own settings."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

from protocol.config.errors import alternatives, check_choices, need, parse_cpus

Device = Literal["auto", "cpu", "cuda"]
CpuGemm = Literal["torch", "vllm"]
PrefixCaching = Literal["auto", "on", "off"]


@dataclass(kw_only=True, slots=True)
class ActorConfig:
    # Where the engine runs: "cuda" (vLLM's CUDA build; the CPU-only fields below are then neither set nor checked),
    # "cpu" (vLLM's CPU build), or "auto": cuda when torch in the actor's process sees a GPU, else cpu.
    device: Device = "auto"
    gpu_memory_utilization: float = 0.9  # CUDA: share of each GPU's memory vLLM may take (weights, KV cache, graphs)
    kvcache_gib: int = 1  # CPU: vLLM KV cache size (VLLM_CPU_KVCACHE_SPACE)
    max_model_len: int = 64  # engine context length
    max_num_seqs: int = 256  # engine's concurrent sequences (continuous batching width)
    threads: int = 1  # CPU: threads for the engine's worker (OMP_NUM_THREADS)
    cpu_bind: str = "nobind"  # CPU: VLLM_CPU_OMP_THREADS_BIND: "nobind", "auto", or CPU ids such as "0-1"
    # Run vLLM's model worker inside its engine-core process (vLLM's "uni" executor, as it does on a GPU with
    # one device) instead of a process of its own (its default on CPU). One process fewer per actor, and none of
    # the spin-waits between the two: `make demo` trained 2.8x faster (all processes on 2 cores), and with two
    # actors pinned to one core bench.async_vs_sync gained 1.05-1.3x samples/s.
    # Needs cpu_bind = "nobind": vLLM binds OMP threads only in a worker process of its own. CPU only: on CUDA
    # vLLM already runs one GPU's worker in its engine core, and one process per GPU with tensor parallelism.
    worker_in_engine: bool = True
    # How the CPU build runs linear layers (no effect on GPUs):
    # - "torch": torch.nn.functional.linear on the parameter itself. A weight sync writes straight into what
    #   the layer computes with; nothing to rebuild. For the demo's tiny fp32 model it generated 1.2x faster.
    # - "vllm": vLLM's own choice, a prepacked oneDNN or sgl-kernel copy of each weight (faster for large bf16
    #   models, by vLLM's measurements), rebuilt after every sync (actors/worker_ext.py).
    cpu_gemm: CpuGemm = "torch"
    # vLLM's prefix cache: a group's n completions share their prompt's KV blocks instead of holding n copies (64 x
    # a 2k-token prompt in the ORZ recipes). Each request is salted with the weights it started under
    # (actors/engine.py), so no cached block outlives a weight sync. "auto": on with CUDA, off on the CPU (short
    # prompts there, shorter than a block). "on" | "off" force it.
    prefix_caching: PrefixCaching = "auto"
    block_size: int = 0  # KV-cache block in tokens (0: vLLM's choice); the prefix cache shares whole blocks only
    max_groups: int = 8  # prompts an actor holds at once (asks for more below this)
    cpu_affinity: str = ""  # CPU ids the actor and its engine processes may run on, e.g. "1" ("" = all)

    def __post_init__(self) -> None:
        check_choices(self, "actor", skip=("cpu_gemm",))
        # max_model_len > rollout.max_tokens: protocol/config/root.py (it depends on rollout)
        need(self.max_groups >= 1, "actor.max_groups", "must be >= 1")
        need(self.block_size >= 0, "actor.block_size", "must be >= 0 (0: vLLM's choice)")
        need(0 < self.gpu_memory_utilization <= 1, "actor.gpu_memory_utilization", "must be in (0, 1]")
        # CPU-only fields: a GPU actor neither sets nor checks them. Each check asks on_cuda() only once it has
        # failed, so a CPU run (and a learner, which shares this file) never imports torch for it.
        need(
            not self.worker_in_engine or self.cpu_bind == "nobind" or self.on_cuda(),
            "actor.worker_in_engine",
            f"must be false when actor.cpu_bind = {self.cpu_bind!r}: vLLM binds OMP threads only in a worker process of its own",
        )
        cpu_gemms = typing.get_args(CpuGemm)
        need(self.cpu_gemm in cpu_gemms or self.on_cuda(), "actor.cpu_gemm", f"{self.cpu_gemm!r} must be {alternatives(cpu_gemms)}")
        parse_cpus(self.cpu_affinity, "actor.cpu_affinity")

    def prefix_cached(self, on_cuda: bool) -> bool:
        return self.prefix_caching == "on" or (self.prefix_caching == "auto" and on_cuda)

    def on_cuda(self) -> bool:
        """Whether the engine runs on CUDA. "auto" asks torch, so it is imported only when this is called."""
        if self.device != "auto":
            return self.device == "cuda"
        import torch

        return torch.cuda.is_available()
