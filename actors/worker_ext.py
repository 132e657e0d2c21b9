"""Mixed into vLLM's worker (`worker_extension_cls`): receives weights from the learner.

Runs inside the engine's worker process, reached with `collective_rpc`: it takes and answers the typed
messages of protocol/worker_rpc.py (vLLM's msgpack hop delivers them as the maps of their fields: `arrived`).

CPU pitfall this module exists to avoid: at load time the CPU build replaces each
linear layer's weight by a prepacked copy (oneDNN or sgl-kernel GEMM) and empties
the parameter. `load_weights` afterwards writes into the emptied parameter and the
layers keep computing with the OLD packed weights, silently. So the packing step is
replaced here, as `actor.cpu_gemm` (FLEETRL_CPU_GEMM, set by actors/engine.py) says:
- "torch": no packed copy; the layer runs torch.nn.functional.linear on its parameter,
  which `load_weights` writes. Nothing to rebuild after a sync.
- "vllm": vLLM's packed copy, but the plain parameter is kept as the source of truth
  (`remove_weight=False`) and each layer's copy is rebuilt after every load.
The logprob-match test (tests/integration/test_weight_sync.py) proves both.

On CUDA (read from vLLM 0.32's gpu_worker, gpu_model_runner and multiproc executor; CUDA vLLM
is not installed where this was written, and tests/gpu/test_weights_gpu.py runs where it is):
- every worker of an engine runs these methods: `collective_rpc` sends each RPC to all of them
  and returns their answers in worker-rank order. With tensor parallelism each worker is a rank
  of the weight group (`rank` = the WeightSync's first rank + the worker's own `self.rank`),
  receives every bucket, and the model's load_weights keeps its shard (the parallel linear
  layers' weight loaders narrow the full tensor by their TP rank).
- `model_runner.get_model()` unwraps the CUDA-graph wrapper (V1 runner); the V2 runner returns
  the model itself. load_weights copies with `param.data.copy_(loaded)`, which takes a tensor on
  any device (NCCL's buffer on this GPU, gloo's pinned host buffer).
- CUDA graphs are captured once and replay reading the parameters' memory, so a load must write
  in place, which copy_ does: no address changes. CUDA's unquantized linear layers keep their
  weight as loaded (no process_weights_after_loading step to redo, unlike the CPU packing below
  or quantized methods, for which vLLM has its layerwise reload; FleetRL syncs unquantized models).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

from actors import lifeline
from actors.weight_receiver import WeightReceiver
from protocol import weights as wg
from protocol.worker_rpc import GemmLayers, ReceiveWeights, WeightsReceived, arrived

lifeline.attach()  # this process hosts a vLLM worker: it dies with the actor (a no-op if deploy/cli.py attached it)

_pack_linear: Callable[..., None] | None
try:  # only the CPU build packs weights; on CUDA this patch is never reached.
    from vllm.model_executor.layers import utils as _vllm_layer_utils

    _pack_linear = _vllm_layer_utils.dispatch_cpu_unquantized_gemm
    _vllm_pack = _pack_linear

    def _dispatch_keeping_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = layer.weight
        assert isinstance(weight, torch.Tensor)
        if _plain_linear() and weight.ndim == 2:  # other shapes (MoE experts, conv) are vLLM's own kernels
            layer.cpu_linear = torch.nn.functional.linear  # type: ignore[assignment]  # what vLLM's layers call
            return
        _vllm_pack(layer, remove_weight=False)

    _vllm_layer_utils.dispatch_cpu_unquantized_gemm = _dispatch_keeping_weight
except (ImportError, AttributeError):  # a vLLM without CPU GEMM dispatch: nothing to patch
    _pack_linear = None


def _plain_linear() -> bool:
    return os.environ.get("FLEETRL_CPU_GEMM", "torch") == "torch"


def _packed(module: torch.nn.Module) -> bool:
    """A CPU linear layer that computes with vLLM's packed copy (anything but plain F.linear on its parameter)."""
    return getattr(module, "cpu_linear", torch.nn.functional.linear) is not torch.nn.functional.linear


class FleetWeightReceiver:
    """Methods run in the vLLM worker; names carry a prefix so they cannot clash with the worker's."""

    model_runner: Any  # provided by the vLLM worker class this is mixed into
    rank: int  # the worker's rank within its engine (vLLM's WorkerBase.rank): 0 .. tensor x pipeline parallel - 1

    def fleetrl_device(self) -> str:
        """This worker's device identity (protocol/weights.device_identity): what the actor registers, one per worker."""
        return wg.device_identity(wg.local_device())

    def fleetrl_receive(self, request: ReceiveWeights | dict[str, Any]) -> WeightsReceived:
        """Join the weight group of the sync's epoch if new, receive every bucket, load it, repack. A failure comes
        back as the answer's `error` (actors/weight_receiver.py), with `buckets_loaded`. `request` is the map of its
        fields when it crossed vLLM's msgpack hop (protocol/worker_rpc.py)."""
        req = arrived(ReceiveWeights, request)
        receiver = getattr(self, "_fleetrl_receiver", None)
        if receiver is None:
            receiver = self._fleetrl_receiver = WeightReceiver()
        if req.leave_group:
            receiver.leave(drop_store=True)
        sync = req.sync
        if not 0 <= self.rank < sync.ranks:  # the actor registered fewer workers than the engine has
            return WeightsReceived.failure(f"worker rank {self.rank} is outside the {sync.ranks} ranks this actor was given", 0, 0.0)
        model = self.model_runner.get_model()
        result = receiver.receive(sync, sync.rank + self.rank, model.load_weights)
        if not result.failed:
            t0 = time.perf_counter()
            result.repacked = self._fleetrl_repack(model)
            result.repack_s = time.perf_counter() - t0
        return result

    def fleetrl_gemm(self) -> GemmLayers:
        """How the model's CPU linear layers compute: plain F.linear, or vLLM's packed copy."""
        layers = [m for m in self.model_runner.get_model().modules() if hasattr(m, "cpu_linear")]
        packed = sum(map(_packed, layers))
        return GemmLayers(plain=len(layers) - packed, packed=packed)

    @staticmethod
    def _fleetrl_repack(model: torch.nn.Module) -> int:
        """Rebuild the CPU GEMM packed copy of every packed linear layer from its (kept) weight."""
        pack = _pack_linear
        if pack is None:
            return 0
        count = 0
        for module in model.modules():
            if _packed(module):
                weight = module.weight
                assert isinstance(weight, torch.Tensor) and weight.numel() > 0, f"{type(module).__name__}: weight was removed by packing"
                pack(module, remove_weight=False)
                count += 1
        return count
