"""Every message that crosses a process boundary, typed.

Arrays (token ids, logprobs, rewards) travel as raw frames beside a MessagePack header and arrive as
numpy arrays: they are never turned into Python lists. Ragged per-completion data is one flat array
plus a `lengths` array. Each message type lists its array fields in `ARRAYS` as {name: (dtype, ndim)}.

Versions: `policy_version` is the learner's optimizer-step count; a sample's version is that of the weights
that produced its oldest token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from protocol.message_base import Message as Message
from protocol.message_base import ProtocolError as ProtocolError
from protocol.ops_messages import CONTROL_KEYS as CONTROL_KEYS
from protocol.ops_messages import ControlReply as ControlReply
from protocol.ops_messages import ControlRequest as ControlRequest
from protocol.ops_messages import StatusReply as StatusReply
from protocol.ops_messages import StatusRequest as StatusRequest

# 2: positional header (protocol/codec.py); 3: WorkRequest.max_prompts is a capacity; 4: Register.devices,
# WeightSync.ranks and WeightSync.backend (weight groups on GPUs); 6: a map header again, naming every field and array;
# 7: RolloutGroup.loss_mask (multi-turn episodes: observation tokens are context, not trained); 8: WeightSync.lazy
PROTOCOL_VERSION = 8
WEIGHT_BACKENDS = ("nccl", "gloo")  # a weight group's torch.distributed backend; protocol/weights.py picks one per epoch
MAX_RANKS_PER_ACTOR = 64  # weight-group ranks one registration may claim: a peer cannot grow the group without bound
FINISH_REASONS = ("stop", "length")  # a trained completion's: it ended (EOS, stop token or string) or ran out of room
ENV_ERROR = "env_error"  # an episode's finish reason when its environment failed (rollout.env_errors = requeue)
# A group's named reward parts become metrics (reward/part/<name>): bounded so no actor can mint metric keys at will.
MAX_REWARD_PARTS = 16  # names per group
MAX_PART_NAME_CHARS = 64


def part_name_ok(name: str) -> bool:
    """A reward part name the wire carries: 1 to MAX_PART_NAME_CHARS printable characters."""
    return 0 < len(name) <= MAX_PART_NAME_CHARS and name.isprintable()


@dataclass(kw_only=True, slots=True)
class Register(Message):
    """actor -> hub: a new actor announces itself."""

    actor_id: str  # unique per actor process (host-pid-random)
    host: str  # hostname, for the operator
    pid: int
    served_version: int  # policy version the engine holds now (-1: none of this learner's: it lost the learner or a sync)
    # One entry per weight-group rank the actor holds: its engine's workers in vLLM rank order (tensor x pipeline
    # parallel). Each is the worker's device identity, "cuda:<GPU UUID>" (protocol/weights.device_identity), or ""
    # for a CPU worker. The learner reads them to pick the group's backend (two ranks on one GPU cannot share an
    # NCCL group). The default is one CPU rank, what an engine-less test member is.
    devices: list[str] = field(default_factory=lambda: [""])

    def check(self) -> None:
        if not 1 <= len(self.devices) <= MAX_RANKS_PER_ACTOR:
            raise ProtocolError(f"Register.devices: {len(self.devices)} ranks, must be 1..{MAX_RANKS_PER_ACTOR}")


@dataclass(kw_only=True, slots=True)
class RegisterAck(Message):
    """hub -> actor: registration accepted."""

    actor_id: str
    policy_version: int  # learner's current version
    heartbeat_s: float  # how often to send Heartbeat


@dataclass(kw_only=True, slots=True)
class Heartbeat(Message):
    """actor -> hub: still alive. Silence past hub.actor_timeout_s marks the actor dead."""

    actor_id: str
    served_version: int
    groups_in_flight: int  # prompts the actor is generating now


@dataclass(kw_only=True, slots=True)
class WorkRequest(Message):
    """actor -> hub: it can hold `max_prompts` prompts at once (actor.max_groups). The hub grants up to that
    minus the prompts it leased to this actor and has not received back, so requests still in flight
    (sent before the grants they asked for arrived) never make it grant more than the actor holds."""

    actor_id: str
    max_prompts: int


@dataclass(kw_only=True, slots=True)
class WorkGrant(Message):
    """hub -> actor: generate a group for one prompt, at `policy_version` or newer."""

    ARRAYS: ClassVar[dict[str, tuple[str, int]]] = {"prompt_tokens": ("int32", 1)}
    prompt_id: int  # index into the prompt set
    epoch: int  # pass over the prompt set
    prompt_tokens: np.ndarray  # int32 [prompt_len]
    answer: str  # reference answer for the reward function
    policy_version: int  # the actor must serve at least this version before generating
    lease_s: float  # the hub takes the prompt back after this many seconds
    prompt: str = ""  # the prompt as the model sees it (chat template applied), for the reward function
    metadata: str = "{}"  # JSON object: the row's other columns (dataset name, ground truth parts...), for the reward

    def check(self) -> None:
        if self.prompt_tokens.shape[0] == 0:
            raise ProtocolError("WorkGrant.prompt_tokens: empty prompt")


@dataclass(kw_only=True, slots=True)
class RolloutGroup(Message):
    """actor -> hub: all completions of one prompt, scored."""

    ARRAYS: ClassVar[dict[str, tuple[str, int]]] = {
        "prompt_tokens": ("int32", 1),
        "lengths": ("int32", 1),
        "completion_tokens": ("int32", 1),
        "behaviour_logprobs": ("float32", 1),
        "rewards": ("float32", 1),
        "reward_parts": ("float32", 1),
        "loss_mask": ("uint8", 1),
        "turns": ("int32", 1),
        "tool_calls": ("int32", 1),
    }
    actor_id: str
    prompt_id: int
    epoch: int
    prompt_tokens: np.ndarray  # int32 [prompt_len]
    lengths: np.ndarray  # int32 [n]: tokens in each completion
    completion_tokens: np.ndarray  # int32 [sum(lengths)]: completions, concatenated
    behaviour_logprobs: np.ndarray  # float32 [sum(lengths)], nats, of the distribution sampled (after temperature)
    rewards: np.ndarray  # float32 [n]
    finish_reasons: list[str]  # per completion: "stop" | "length"
    version_min: int  # version of the oldest token's weights (the sample's version)
    version_max: int  # version of the newest token's weights (> min if weights changed mid-sequence)
    gen_s: float  # seconds from grant start to the group's last token
    reward_s: float  # seconds spent scoring
    # The reward function's named parts (k of them), per completion: float32 [n * k], row-major [n, k].
    reward_parts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    reward_part_names: list[str] = field(default_factory=list)  # the k names, the same for every completion
    reward_errors: int = 0  # completions whose reward raised or ran out of time: scored 0
    # uint8 [sum(lengths)]: 1 for the model's tokens (sampled, with behaviour logprobs), 0 for an environment's
    # observation tokens (context only; their logprob slots hold 0). Empty: every token is the model's (one turn).
    loss_mask: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    # Episodes (rollout.env), else empty and 0: int32 [n] model turns and tool calls of each episode, seconds spent
    # in the environment, and episodes its failure ended (requeued groups carry them to the hub's counters too)
    turns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    tool_calls: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    env_s: float = 0.0
    env_errors: int = 0
    env_timeouts: int = 0

    def model_tokens(self) -> np.ndarray:
        """bool [sum(lengths)]: which completion tokens the model sampled (the ones trained on)."""
        if not len(self.loss_mask):
            return np.ones(len(self.completion_tokens), dtype=bool)
        return self.loss_mask.astype(bool)

    def model_token_counts(self) -> np.ndarray:
        """int64 [n]: the model's tokens in each completion."""
        if not len(self.loss_mask):
            return self.lengths.astype(np.int64)
        return np.add.reduceat(self.loss_mask.astype(np.int64), np.concatenate([[0], np.cumsum(self.lengths)[:-1]]))

    def check(self) -> None:
        n = len(self.lengths)
        if n == 0:
            raise ProtocolError("RolloutGroup.lengths: no completions")
        if (self.lengths < 0).any():
            raise ProtocolError("RolloutGroup.lengths: negative length")
        total = int(self.lengths.sum(dtype=np.int64))
        if len(self.completion_tokens) != total:
            raise ProtocolError(f"RolloutGroup.completion_tokens: {len(self.completion_tokens)} tokens, lengths sum to {total}")
        if len(self.behaviour_logprobs) != total:
            raise ProtocolError(f"RolloutGroup.behaviour_logprobs: {len(self.behaviour_logprobs)} values, lengths sum to {total}")
        if len(self.rewards) != n or len(self.finish_reasons) != n:
            raise ProtocolError(f"RolloutGroup: {n} completions but {len(self.rewards)} rewards, {len(self.finish_reasons)} finish reasons")
        if self.version_max < self.version_min:
            raise ProtocolError("RolloutGroup: version_max < version_min")
        if not (np.isfinite(self.rewards).all() and np.isfinite(self.behaviour_logprobs).all()):
            raise ProtocolError("RolloutGroup: non-finite reward or logprob")
        if len(self.reward_parts) != n * len(self.reward_part_names):
            raise ProtocolError(
                f"RolloutGroup.reward_parts: {len(self.reward_parts)} values for {n} completions x {len(self.reward_part_names)} parts"
            )
        if not np.isfinite(self.reward_parts).all():
            raise ProtocolError("RolloutGroup.reward_parts: non-finite value")
        if not 0 <= self.reward_errors <= n:
            raise ProtocolError(f"RolloutGroup.reward_errors: {self.reward_errors} not in [0, {n}]")
        if len(self.loss_mask):
            if len(self.loss_mask) != total:
                raise ProtocolError(f"RolloutGroup.loss_mask: {len(self.loss_mask)} values, lengths sum to {total}")
            if self.loss_mask.max() > 1:
                raise ProtocolError(f"RolloutGroup.loss_mask: value {int(self.loss_mask.max())}, only 0 and 1")
            if (self.lengths > 0).all() and self.model_token_counts().min() == 0:
                raise ProtocolError("RolloutGroup.loss_mask: a completion with no model token (nothing to train)")
        for name in ("turns", "tool_calls"):
            values = getattr(self, name)
            if len(values) not in (0, n) or (len(values) and values.min() < 0):
                raise ProtocolError(f"RolloutGroup.{name}: {len(values)} values for {n} completions, none negative")
        if not (0 <= self.env_errors <= n and 0 <= self.env_timeouts <= self.env_errors and self.env_s >= 0):
            raise ProtocolError(
                f"RolloutGroup: env_errors {self.env_errors}, env_timeouts {self.env_timeouts}, env_s {self.env_s:g} out of range"
            )


@dataclass(kw_only=True, slots=True)
class EvalGrant(Message):
    """hub -> actor: generate for one evaluation prompt with the weights of exactly `policy_version`. Evaluation
    work is outside the ledger and admission control: nothing here is trained on."""

    ARRAYS: ClassVar[dict[str, tuple[str, int]]] = {"prompt_tokens": ("int32", 1)}
    eval_round: int  # evaluation round (one per evaluated policy version)
    split: str  # eval set: "val" | "test"
    prompt_id: int  # index into that set
    prompt_tokens: np.ndarray  # int32 [prompt_len]
    answer: str  # reference answer for the reward function
    policy_version: int  # the version under evaluation; no newer weights are sent until the round ends
    n: int  # completions to generate (1 when greedy)
    temperature: float  # 0.0 = greedy
    seed: int  # sampling seed for this prompt: a re-granted prompt samples the same way
    lease_s: float  # the hub re-grants the prompt to another actor after this many seconds
    prompt: str = ""  # the prompt as the model sees it, for the reward function
    metadata: str = "{}"  # JSON object: the row's other columns, for the reward function

    def check(self) -> None:
        if self.prompt_tokens.shape[0] == 0:
            raise ProtocolError("EvalGrant.prompt_tokens: empty prompt")
        if self.n < 1 or self.temperature < 0:
            raise ProtocolError(f"EvalGrant: n={self.n} must be >= 1 and temperature={self.temperature} >= 0")


@dataclass(kw_only=True, slots=True)
class EvalResult(Message):
    """actor -> hub: the scored completions of one EvalGrant (no tokens: an eval result is never trained on)."""

    ARRAYS: ClassVar[dict[str, tuple[str, int]]] = {"lengths": ("int32", 1), "rewards": ("float32", 1)}
    actor_id: str
    eval_round: int
    split: str
    prompt_id: int
    lengths: np.ndarray  # int32 [n]: tokens in each completion
    rewards: np.ndarray  # float32 [n]
    finish_reasons: list[str]  # per completion: "stop" | "length"
    version_min: int  # version of the weights at the first token
    version_max: int  # version at the last token (the hub accepts only min == max == the grant's version)
    gen_s: float  # seconds from grant start to the last token
    reward_errors: int = 0  # completions whose reward raised or ran out of time: scored 0

    def check(self) -> None:
        n = self.lengths.shape[0]
        if n == 0:
            raise ProtocolError("EvalResult.lengths: no completions")
        if self.rewards.shape[0] != n or len(self.finish_reasons) != n:
            raise ProtocolError(
                f"EvalResult: {n} completions but {self.rewards.shape[0]} rewards, {len(self.finish_reasons)} finish reasons"
            )
        if self.version_max < self.version_min:
            raise ProtocolError("EvalResult: version_max < version_min")
        if not np.isfinite(self.rewards).all():
            raise ProtocolError("EvalResult: non-finite reward")
        if not 0 <= self.reward_errors <= n:
            raise ProtocolError(f"EvalResult.reward_errors: {self.reward_errors} not in [0, {n}]")


@dataclass(kw_only=True, slots=True)
class WeightSync(Message):
    """hub -> actor: join weight-group `group_epoch` and receive version `policy_version`.

    The learner broadcasts the parameters named in `names`, in that order, packed into flat buckets of at
    most `bucket_bytes` (see protocol.weights).
    """

    policy_version: int
    group_epoch: int  # membership number; a new epoch means a new process group
    store_host: str  # TCPStore rendezvous of the weight group (learner rank 0 is master)
    store_port: int
    rank: int  # this actor's first rank in the group (learner rank 0 is rank 0)
    ranks: int  # ranks it holds, rank .. rank + ranks - 1: one per engine worker (worker i is rank + i)
    world_size: int
    backend: str  # "nccl" (tensors on each rank's GPU) | "gloo" (host memory): the learner's choice for this epoch
    timeout_s: float
    names: list[str]
    shapes: list[list[int]]
    dtype: str  # every parameter is sent in this dtype
    bucket_bytes: int
    lazy: bool = False  # gloo: connect only the pairs the broadcast uses (protocol.weights.open_group); all ranks agree

    def check(self) -> None:
        if len(self.names) != len(self.shapes):
            raise ProtocolError("WeightSync: names and shapes differ in length")
        if self.ranks < 1 or not 0 < self.rank <= self.world_size - self.ranks:
            raise ProtocolError(f"WeightSync.rank: ranks {self.rank}..{self.rank + self.ranks - 1} not within 1..{self.world_size - 1}")
        if self.backend not in WEIGHT_BACKENDS:
            raise ProtocolError(f"WeightSync.backend: {self.backend!r} unknown (known: {', '.join(WEIGHT_BACKENDS)})")


@dataclass(kw_only=True, slots=True)
class WeightVersion(Message):
    """actor -> hub: the engine now serves `served_version`."""

    actor_id: str
    served_version: int
    group_epoch: int
    load_s: float  # seconds from WeightSync to serving the new weights


@dataclass(kw_only=True, slots=True)
class Error(Message):
    """either way: the peer sent something wrong. Logged and counted, never fatal."""

    code: str  # protocol | unknown_actor | rejected | id_taken (Register: the id belongs to another CURVE key; final)
    detail: str


@dataclass(kw_only=True, slots=True)
class Shutdown(Message):
    """hub -> actor: the run is over (or the actor is refused); exit cleanly."""

    reason: str


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.__name__: cls
    for cls in (
        Register,
        RegisterAck,
        Heartbeat,
        WorkRequest,
        WorkGrant,
        RolloutGroup,
        EvalGrant,
        EvalResult,
        WeightSync,
        WeightVersion,
        Error,
        Shutdown,
        ControlRequest,
        ControlReply,
        StatusRequest,
        StatusReply,  # operations
    )
}
