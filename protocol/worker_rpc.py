"""The actor's calls into its engine's vLLM workers (`collective_rpc`): typed both ways.

    actor process (AsyncLLM) --msgpack, ZeroMQ--> engine core process --pickle, shared memory--> worker process
                                                   (actor.worker_in_engine = true: the worker is in the engine core,
                                                    which calls it directly: no second hop)
    and each worker's answer back the same way: actors/engine.py -> actors/worker_ext.py -> actors/engine.py.

vLLM's msgpack hop (vllm/v1/serial_utils.py, MsgpackEncoder) writes a dataclass as the map of its fields and reads it
back as a plain dict: the engine core decodes a utility call without a type (vllm/v1/engine/core.py), and a utility
result carries its type only under VLLM_ALLOW_INSECURE_SERIALIZATION, which would also let pickle onto that socket.
The pickle hop (vllm/distributed/device_communicators/shm_broadcast.py) keeps types. So whatever arrives is taken
through `arrived`: the dataclass itself, or that map rebuilt as it, every field's type checked (a missing, unknown
or mistyped field is a ProtocolError that names it). The messages hold only what msgpack carries unchanged: str,
int, float, bool, None, lists, and dataclasses of those.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, TypeVar

from protocol.messages import ProtocolError, WeightSync

T = TypeVar("T")


@dataclass(kw_only=True, slots=True)
class ReceiveWeights:
    """actor -> every worker of its engine (`fleetrl_receive`): join the sync's group epoch if it is new, receive
    every bucket, load it into the model, rebuild the CPU build's packed copies."""

    sync: WeightSync  # the hub's, as the actor received it; the engine's worker i is rank sync.rank + i
    # Drop the weight group and its store first: the learner that made them is gone (a restarted one may host
    # its store on the same port, with epochs from 1 again).
    leave_group: bool = False


@dataclass(kw_only=True, slots=True)
class WeightsReceived:
    """worker -> actor: how one worker's receive went; actors/engine.py merges its workers' into one (merge_results).
    Failed when `error` is set: then `buckets_loaded` and `failed_after_s` are set too, and the timings are 0."""

    join_s: float = 0.0  # seconds to join the group epoch (about 0 when already a member)
    recv_load_s: float = 0.0  # seconds to receive every bucket and load it into the model
    repacked: int = 0  # CPU linear layers whose packed copy was rebuilt (actor.cpu_gemm = "vllm"; else 0)
    repack_s: float = 0.0  # seconds to rebuild them
    error: str | None = None  # why it failed: the error's first line, at most 500 characters
    # Buckets loaded before the failure: > 0 means the model holds parts of two versions (it must not generate).
    buckets_loaded: int | None = None
    failed_after_s: float | None = None  # seconds from the start of the receive to the failure

    @classmethod
    def failure(cls, error: str, buckets_loaded: int, failed_after_s: float) -> WeightsReceived:
        return cls(error=error, buckets_loaded=buckets_loaded, failed_after_s=failed_after_s)

    def check(self) -> None:
        failed = (self.error is not None, self.buckets_loaded is not None, self.failed_after_s is not None)
        if len(set(failed)) != 1:
            raise ProtocolError(f"WeightsReceived: error, buckets_loaded and failed_after_s are set together, got {failed}")

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def torn(self) -> bool:
        """Failed after loading some buckets: the engine holds parts of two versions."""
        return self.buckets_loaded is not None and self.buckets_loaded > 0

    def log_fields(self) -> dict[str, str | int | float]:
        """What the actor logs of it (actor.weights_loaded, or actor.weights_failed): the outcome's own fields."""
        if self.error is not None:
            assert self.buckets_loaded is not None and self.failed_after_s is not None
            return {"error": self.error, "buckets_loaded": self.buckets_loaded, "failed_after_s": self.failed_after_s}
        return {"join_s": self.join_s, "recv_load_s": self.recv_load_s, "repacked": self.repacked, "repack_s": self.repack_s}


@dataclass(kw_only=True, slots=True)
class GemmLayers:
    """worker -> actor (`fleetrl_gemm`): how the model's CPU linear layers compute (tests prove each actor.cpu_gemm)."""

    plain: int  # layers that run torch.nn.functional.linear on their parameter
    packed: int  # layers that run vLLM's packed copy of it


def arrived(cls: type[T], value: object) -> T:
    """`value` as the `cls` it was sent as: itself (in process, or after pickle), or rebuilt from the map of its fields
    that vLLM's msgpack hop makes of it. Raises ProtocolError when it is neither."""
    if isinstance(value, cls):
        return value
    return _build(cls, value, cls.__name__)


def _build(cls: type[T], value: object, where: str) -> T:
    if type(value) is not dict:
        raise ProtocolError(f"{where}: expected {cls.__name__} or the map of its fields, got {type(value).__name__}")
    hints = _hints(cls)
    missing = [name for name in hints if name not in value]
    unknown = [key for key in value if key not in hints]
    if missing or unknown:
        raise ProtocolError(f"{where}: missing field(s) {missing}, unknown field(s) {unknown}")
    built = cls(**{name: _typed(hint, value[name], f"{where}.{name}") for name, hint in hints.items()})
    check = getattr(built, "check", None)
    if check is not None:
        check()
    return built


def _hints(cls: type) -> dict[str, Any]:
    """Each dataclass field's type (ClassVars are no fields)."""
    hints = typing.get_type_hints(cls)
    assert dataclasses.is_dataclass(cls), cls
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _typed(hint: Any, value: object, where: str) -> Any:
    """`value` as a `hint`, as msgpack decodes one (bool is not an int here; an int is taken for a float)."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return value if isinstance(value, hint) else _build(hint, value, where)
    origin = typing.get_origin(hint)
    if origin is list:
        (inner,) = typing.get_args(hint)
        if type(value) is not list:
            raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
        return [_typed(inner, item, f"{where}[{i}]") for i, item in enumerate(value)]
    if origin is types.UnionType or origin is typing.Union:
        if value is None and type(None) in typing.get_args(hint):
            return None
        (inner,) = [t for t in typing.get_args(hint) if t is not type(None)]
        return _typed(inner, value, where)
    if hint is float and type(value) in (int, float):
        return float(typing.cast(float, value))
    assert hint in (str, int, bool, float), f"{where}: unsupported field type {hint}"
    if type(value) is not hint:
        raise ProtocolError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
    return value
