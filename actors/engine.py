"""The actor's inference engine: vLLM's AsyncLLM, continuously batched, with weight updates.

Behaviour logprobs: `logprobs_mode="processed_logprobs"` makes vLLM return the
logprob of each sampled token under the distribution it was actually sampled
from, which is what the learner's importance ratio needs: after temperature, and
after top-k / top-p, renormalised over the tokens they keep (the masked ones are
-inf; vllm/v1/sample/ops/topk_topp_sampler.py returns log_softmax of the masked
logits). learner/train/scoring.py scores that same truncated distribution.

Stop strings (rollout.stop, eval.stop) need vLLM's detokenizer: it checks them as text.
A request with stop strings is detokenized by vLLM and its text is vLLM's (cut before
the stop string unless include_stop_str_in_output; the token that completed it is kept
in the token ids); one without is not, and the text is decoded here once.
Prefix caching is off: a cached prefix computed by old weights would make a new
request's logprobs belong to no single policy version.

CPU or CUDA (actor.device): the same engine, with the CPU build's environment knobs on a
CPU and CUDA graphs plus tensor parallelism on GPUs (`engine_args`). CUDA graphs stay valid
across weight syncs: the loads write the parameters in place (actors/worker_ext.py).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from protocol.budget import completion_budget
from protocol.config import Config
from protocol.messages import WeightSync
from protocol.worker_rpc import ReceiveWeights, WeightsReceived, arrived


@dataclass(kw_only=True, slots=True)
class Completion:
    token_ids: np.ndarray  # int32 [len]
    logprobs: np.ndarray  # float32 [len]
    finish_reason: str  # "stop" (EOS, a stop token or a stop string) | "length"
    text: str  # what the reward sees


@dataclass(frozen=True, slots=True)
class Sampling:
    """How one request samples. The learner scores training samples with rollout's temperature, top_k and top_p."""

    temperature: float  # 0.0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    stop: tuple[str, ...] = ()
    include_stop_str: bool = False  # the text keeps the stop string that ended it

    @staticmethod
    def rollout(cfg: Config) -> Sampling:
        r = cfg.rollout
        return Sampling(
            temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, stop=tuple(r.stop), include_stop_str=r.include_stop_str_in_output
        )

    @staticmethod
    def evaluation(cfg: Config, temperature: float) -> Sampling:
        """The hub picks greedy (0.0) or sampled (rollout.temperature) per EvalGrant; the rest is eval.*. One
        reward scores both, so the stop-string convention of the text is rollout's."""
        e = cfg.eval
        return Sampling(
            temperature=temperature,
            top_p=e.top_p,
            top_k=e.top_k,
            stop=tuple(e.stop),
            include_stop_str=cfg.rollout.include_stop_str_in_output,
        )


def engine_env(cfg: Config, on_cuda: bool) -> None:
    """Environment vLLM reads at start (set before the engine spawns its processes). The CPU build's knobs
    are left unset on CUDA: a GPU run takes nothing from the CPU-only actor fields."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if on_cuda:
        return
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.actor.kvcache_gib))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cfg.actor.cpu_bind)
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.actor.threads))
    # Not a default the environment may override: actor.worker_in_engine decides (protocol/config/actor.py).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if cfg.actor.worker_in_engine else "1"
    os.environ["FLEETRL_CPU_GEMM"] = cfg.actor.cpu_gemm  # read by actors/worker_ext.py in the worker


def engine_args(cfg: Config, on_cuda: bool) -> dict[str, Any]:
    """vLLM's AsyncEngineArgs for this actor."""
    args: dict[str, Any] = dict(
        model=cfg.model.path,
        dtype=cfg.model.dtype,  # validated by the config: float32 | bfloat16
        seed=cfg.run.seed,
        max_model_len=cfg.actor.max_model_len,
        max_num_seqs=cfg.actor.max_num_seqs,
        # One engine spans this many GPUs, one worker process each; every worker is a rank of the weight group.
        tensor_parallel_size=cfg.cluster.tensor_parallel_size,
        # CUDA graphs on GPUs (a decode step is otherwise bound by kernel launches). The CPU build has none to capture.
        enforce_eager=not on_cuda,
        enable_prefix_caching=cfg.actor.prefix_cached(on_cuda),
        logprobs_mode="processed_logprobs",
        worker_extension_cls="actors.worker_ext.FleetWeightReceiver",
        disable_log_stats=True,  # its Prometheus counters cost the actor 7% of its time (py-spy); FleetRL logs its own
    )
    if on_cuda:
        args["gpu_memory_utilization"] = cfg.actor.gpu_memory_utilization
    if cfg.actor.block_size:
        args["block_size"] = cfg.actor.block_size
    return args


class Engine:
    def __init__(self, cfg: Config):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        # The engine core dies with the thread that starts it (actors/lifeline.py): only the main one lasts as long as the actor.
        assert threading.current_thread() is threading.main_thread(), "start the engine from the main thread"
        on_cuda = cfg.actor.on_cuda()
        engine_env(cfg, on_cuda)
        self.cfg = cfg
        self.prefix_caching = cfg.actor.prefix_cached(on_cuda)
        # Counts weight loads begun: a request's prefix-cache salt, so that its KV blocks are shared only with
        # requests started under the same weights (a version number would not do: a resumed learner reuses them).
        self.weights_loads = 0
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args(cfg, on_cuda)))
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)  # the one vLLM loads (same folder), unpooled

    async def generate_group(
        self, prompt_tokens: np.ndarray, n: int, seed: int | None = None, sampling: Sampling | None = None, max_tokens: int | None = None
    ) -> list[Completion]:
        """`n` completions of one prompt as one request (vLLM fans it out to n sequences).

        `sampling` defaults to rollout's (Sampling.rollout); temperature 0.0 is greedy (evaluation). `max_tokens`
        (default rollout.max_tokens): an episode's turn asks for what its budget leaves. The context caps both.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.logprobs import FlatLogprobs
        from vllm.sampling_params import RequestOutputKind

        s = sampling or Sampling.rollout(self.cfg)
        # detokenize=False: vLLM would decode every token twice as it goes (the text, and each logprob's token);
        # the reward needs the text once, decoded here. Stop strings are matched on vLLM's text, so they need it.
        # flat_logprobs: one list of floats, not a dict per token.
        params = SamplingParams(
            n=n,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_tokens=completion_budget(len(prompt_tokens), max_tokens or self.cfg.rollout.max_tokens, self.cfg.actor.max_model_len),
            logprobs=0,
            seed=seed,
            output_kind=RequestOutputKind.FINAL_ONLY,
            flat_logprobs=True,
            detokenize=bool(s.stop),
            stop=list(s.stop) or None,
            include_stop_str_in_output=s.include_stop_str,
        )
        final = None
        ids = [int(t) for t in prompt_tokens]
        prompt = (
            TokensPrompt(prompt_token_ids=ids, cache_salt=self.cache_salt()) if self.prefix_caching else TokensPrompt(prompt_token_ids=ids)
        )
        async for out in self.llm.generate(prompt, params, request_id=uuid.uuid4().hex):
            final = out
        assert final is not None and len(final.outputs) == n, "engine returned no or partial output"
        completions = []
        for c in final.outputs:
            ids, lps = list(c.token_ids), c.logprobs
            if not isinstance(lps, FlatLogprobs):
                raise RuntimeError(f"asked for flat logprobs, the engine returned {type(lps).__name__}")
            # Each position starts with the sampled token's entry (more follow if another request in the batch
            # asked for top-k logprobs): its logprob under the distribution sampled from.
            first = lps.start_indices
            if len(first) != len(ids) or [lps.token_ids[i] for i in first] != ids:
                raise RuntimeError(f"engine logprobs do not line up with the {len(ids)} sampled tokens")
            if s.stop:
                text = c.text  # vLLM's: cut at the stop string (a stop string is reported as finish reason "stop")
            else:
                # The text vLLM would have made: without the token that stopped it (EOS, or one of stop_token_ids).
                stopped_by_token = c.finish_reason == "stop" and (c.stop_reason is None or isinstance(c.stop_reason, int))
                kept = ids[:-1] if stopped_by_token and ids else ids
                text = str(self.tokenizer.decode(kept, skip_special_tokens=True, clean_up_tokenization_spaces=False))
            completions.append(
                Completion(
                    token_ids=np.asarray(ids, dtype=np.int32),
                    logprobs=np.asarray([lps.logprobs[i] for i in first], dtype=np.float32),
                    finish_reason=c.finish_reason or "length",
                    text=text,
                )
            )
        return completions

    def cache_salt(self) -> str:
        """The prefix-cache salt of a request started now: the weights it starts under."""
        return f"weights-{self.weights_loads}"

    async def warm_up(self) -> None:
        """One throwaway request: the engine's first is slow (1.7 s for the demo model here, 0.03 s after: lazy
        kernel set-up). Paid before the actor registers, so that a joiner's first group, generated with the
        weights it was just sent, is not already stale when it arrives."""
        await self.generate_group(np.ones(4, dtype=np.int32), self.cfg.rollout.samples_per_prompt)

    async def devices(self) -> list[str]:
        """Each engine worker's device identity, in worker-rank order: the weight-group ranks this actor registers."""
        return list(await self.llm.collective_rpc("fleetrl_device"))

    def death(self) -> dict[str, Any] | None:
        """None while the engine runs; once vLLM has found its engine core dead, how it ended (fields to log).

        vLLM's monitor thread waits on the engine core process and marks the engine dead the moment it ends (a core
        whose worker process failed says so itself; vllm/v1/engine/core_client.py, start_engine_core_monitor and
        validate_alive). Requests then fail with EngineDeadError, but an RPC already sent (pause, resume,
        collective_rpc: a weight sync, `devices`) waits for good: vLLM never fails its future. Whoever awaits the
        engine must also watch this.
        """
        if not self.llm.errored:
            return None
        # vLLM's process manager keeps each process's exit code. Looked up with care: the CUDA build is not pinned.
        manager = getattr(getattr(self.llm.engine_core, "resources", None), "engine_manager", None)
        ended: dict[str, int] = manager.finished_procs() if manager is not None else {}
        if not ended:
            # The engine core reported a failure (its worker process died, say), or vLLM's output loop failed.
            return {"process": "EngineCore", "exit_code": None, "cause": "vLLM declared the engine dead (its error is above)"}
        name, code = next(iter(ended.items()))
        if code >= 0:
            return {"process": name, "exit_code": code}
        try:
            return {"process": name, "exit_code": code, "signal": signal.Signals(-code).name}
        except ValueError:  # a real-time signal has no name
            return {"process": name, "exit_code": code, "signal": str(-code)}

    async def apply_weights(self, sync: WeightSync, leave_group: bool = False) -> tuple[WeightsReceived, float]:
        """Pause between engine steps (in-flight requests are kept), receive and load, resume: the workers' merged
        answer, and the generation stall in seconds (pause to resume; `paused_s` in the actor's log).

        `leave_group`: the worker first drops its weight group and store (the learner that made them is gone).
        A failed sync (its `error` set, actors/weight_receiver.py) that loaded some buckets leaves the engine
        holding parts of two versions: it stays paused, and the next complete sync resumes it (pausing again is
        harmless).
        """
        request = ReceiveWeights(sync=sync, leave_group=leave_group)
        t0 = time.perf_counter()
        # AsyncLLM.pause_generation is this call plus a 20 ms sleep "not required for correctness" (vLLM's
        # words: it lets outputs already produced reach their callers first). It is a stall on every sync.
        await self.llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
        self.weights_loads += 1  # requests from here on (they start once it resumes) share no cached KV with earlier ones
        torn = stopping = False
        try:
            # Every worker runs it at once (one per GPU with tensor parallelism), each as its own rank.
            # Each answer crossed vLLM's msgpack hop back: the map of its fields (protocol/worker_rpc.py).
            answers = await self.llm.collective_rpc("fleetrl_receive", args=(request,), timeout=sync.timeout_s + 30)
            result = merge_results([arrived(WeightsReceived, a) for a in answers])
            torn = result.torn
        except asyncio.CancelledError:
            # Only the actor's stop cancels a sync, and the engine is shut down next. Its workers may still be in the
            # receive (the learner was signalled too), and the engine core answers one RPC at a time: a resume would
            # wait behind the receive until weights.timeout_s, past the stop's grace (actor.stop_overdue).
            stopping = True
            raise
        finally:
            if not (torn or stopping):
                await self.llm.resume_generation()
        return result, time.perf_counter() - t0

    def shutdown(self, timeout_s: float | None = None) -> None:
        """SIGTERM to the engine core; vLLM SIGKILLs its process tree if it has not exited `timeout_s` (None: vLLM's
        default) later."""
        self.llm.shutdown(timeout=timeout_s)
        # AsyncLLM.__del__ calls shutdown() again. Whenever something still holds the engine at interpreter exit
        # (a traceback in a reference cycle, a task the loop never finished), that call runs after the module globals
        # it uses are cleared and prints "TypeError: 'NoneType' object is not callable". There is nothing left to do.
        self.llm.shutdown = _already_shut_down  # type: ignore[method-assign]
        del self.llm


def _already_shut_down(timeout: float | None = None) -> None:
    pass


def merge_results(results: list[WeightsReceived]) -> WeightsReceived:
    """One report for the workers' receives: the slowest worker's times; failed if any failed, with the most
    buckets any worker loaded (a single torn worker leaves the whole engine holding two versions)."""
    assert results, "collective_rpc returned no worker result"
    errors = [r for r in results if r.error is not None]
    if errors:
        return WeightsReceived.failure(
            "; ".join(sorted({r.error for r in errors if r.error is not None})),
            max(r.buckets_loaded or 0 for r in results),
            max(r.failed_after_s or 0.0 for r in errors),
        )
    return WeightsReceived(
        join_s=max(r.join_s for r in results),
        recv_load_s=max(r.recv_load_s for r in results),
        repacked=max(r.repacked for r in results),
        repack_s=max(r.repack_s for r in results),
    )
