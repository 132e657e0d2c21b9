"""Mixed into vLLM's worker (`worker_extension_cls`): receives weights from the learner.

Runs inside the engine's worker process, reached with `collective_rpc`.

CPU pitfall this module exists to avoid: at load time the CPU build replaces each
linear layer's weight by a prepacked copy (oneDNN or sgl-kernel GEMM) and empties
the parameter. `load_weights` afterwards writes into the emptied parameter and the
layers keep computing with the OLD packed weights, silently. So we (1) keep the
plain parameter as the source of truth (`remove_weight=False`) and (2) rebuild
each layer's packed copy after every load. The logprob-match test proves it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from protocol import weights as wg
from protocol.net import local_addr_towards

_pack_linear: Callable[..., None] | None
try:  # only the CPU build packs weights; on CUDA this patch is never reached.
    from vllm.model_executor.layers import utils as _vllm_layer_utils

    _pack_linear = _vllm_layer_utils.dispatch_cpu_unquantized_gemm
    _vllm_pack = _pack_linear

    def _pack_keeping_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
        _vllm_pack(layer, remove_weight=False)

    _vllm_layer_utils.dispatch_cpu_unquantized_gemm = _pack_keeping_weight
except (ImportError, AttributeError):  # a vLLM without CPU GEMM dispatch: nothing to patch
    _pack_linear = None


class FleetWeightReceiver:
    """Methods run in the vLLM worker; names carry a prefix so they cannot clash with the worker's."""

    model_runner: Any  # provided by the vLLM worker class this is mixed into
    # The weight group this worker is in, keyed by (store address, epoch); None = none (or it broke).
    _fleetrl_epoch: tuple[tuple[str, int], int] | None = None
    _fleetrl_pg: Any = None
    _fleetrl_store: Any = None
    _fleetrl_store_key: tuple[str, int] | None = None

    def fleetrl_receive(self, sync: dict[str, Any]) -> dict[str, Any]:
        """Join the weight group of `sync["group_epoch"]` if new, receive every bucket, load it.

        A broken group (a member died, the link to the learner is down) makes gloo raise after
        `timeout_s`. That is reported, not raised: the group and the store connection are dropped
        (the learner forms a new epoch), and `buckets_loaded` says whether the engine now holds
        parts of two versions.
        `sync["leave_group"]`: drop the group and the store first (the learner that made them is
        gone; a restarted one may host its store on the same port, with epochs from 1 again).
        """
        if sync.get("leave_group"):
            self._fleetrl_leave()
        t0 = time.perf_counter()
        loaded = 0
        try:
            group = self._fleetrl_group(sync)
            t_join = time.perf_counter()
            model = self.model_runner.get_model()
            dtype = wg.DTYPES[sync["dtype"]]
            need = wg.landing_numel(sync["shapes"], dtype, sync["bucket_bytes"])
            buffer = getattr(self, "_fleetrl_buffer", None)
            if buffer is None or buffer.dtype != dtype or buffer.numel() < need:
                # One landing buffer kept across syncs (load_weights copies out of it): fresh memory
                # page-faults on first touch, which costs about as much as the transfer.
                buffer = self._fleetrl_buffer = torch.empty(need, dtype=dtype)
            for pairs in wg.receive_buckets(group, sync["names"], sync["shapes"], dtype, sync["bucket_bytes"], buffer):
                model.load_weights(pairs)
                loaded += 1
        except RuntimeError as e:  # DistBackendError (timeout, peer closed) and DistStoreError are RuntimeErrors
            self._fleetrl_leave()
            return {"error": str(e).splitlines()[0][:500], "buckets_loaded": loaded, "failed_after_s": time.perf_counter() - t0}
        repacked = self._fleetrl_repack(model)
        return {"join_s": t_join - t0, "recv_load_s": time.perf_counter() - t_join, "repacked": float(repacked)}

    def _fleetrl_leave(self) -> None:
        self._fleetrl_epoch, self._fleetrl_pg, self._fleetrl_store, self._fleetrl_store_key = None, None, None, None

    def _fleetrl_group(self, sync: dict[str, Any]):
        # Keyed by the store too: a restarted learner numbers its epochs from 1 again.
        key = (sync["store_host"], sync["store_port"])
        epoch = (key, sync["group_epoch"])
        if self._fleetrl_epoch != epoch:
            if self._fleetrl_store_key != key:
                self._fleetrl_store = wg.open_store(key[0], key[1], is_master=False, timeout_s=sync["timeout_s"])
                self._fleetrl_store_key = key
            bind = local_addr_towards(sync["store_host"], sync["store_port"])
            self._fleetrl_pg = wg.open_group(
                self._fleetrl_store, bind, sync["group_epoch"], sync["rank"], sync["world_size"], sync["timeout_s"],
                backend="nccl" if torch.cuda.is_available() else "gloo",
            )
            self._fleetrl_epoch = epoch
        return self._fleetrl_pg

    @staticmethod
    def _fleetrl_repack(model: torch.nn.Module) -> int:
        """Rebuild the CPU GEMM packed copy of every linear layer from its (kept) weight."""
        pack = _pack_linear
        if pack is None or not any(hasattr(m, "cpu_linear") for m in model.modules()):
            return 0
        count = 0
        for module in model.modules():
            if hasattr(module, "cpu_linear") and getattr(module, "weight", None) is not None:
                weight = module.weight
                assert isinstance(weight, torch.Tensor) and weight.numel() > 0, f"{type(module).__name__}: weight was removed by packing"
                pack(module, remove_weight=False)
                count += 1
        return count
