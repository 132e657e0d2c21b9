"""The processes and what joins them: placement (cluster), the staleness bound, the hub's socket, the weight
broadcast and its authentication."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from protocol.config.errors import check_choices, need

GLOO_MESH_RANKS = 32  # weights.gloo_mesh_ranks' default (protocol.weights.plan_group's too)

Snapshot = Literal["device", "host"]
Curve = Literal["auto", "on", "off"]


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    """Where the run's processes go; `fleetrl plan` prints it. On CPU a "GPU" is one process."""

    learner_nodes: int = 1  # nodes of the learner group
    learner_gpus_per_node: int = 1  # learner ranks per node
    actor_nodes: int = 1  # nodes running actors
    actor_gpus_per_node: int = 1  # inference GPUs per actor node
    tensor_parallel_size: int = 1  # GPUs per vLLM engine (one actor process per engine)
    colocate: bool = True  # policy, critic and reference share the learner's GPUs
    debug_gpus: int = 0  # fit the recipe onto this many learner GPUs for a debug run (0 = off)
    gpu_memory_gib: float = 80.0  # memory of one learner GPU, for `fleetrl plan`'s fits / does not fit
    # Slurm (deploy/slurm/submit.sh): this many seconds before the job's time limit, Slurm signals the job (sbatch
    # --signal=B:USR1@N, up to 60 s early), the learner checkpoints and the job requeues itself, to resume from that
    # checkpoint when it starts again. Leave the learner time to write a checkpoint (and the actors to stop).
    # 0 = off: at the limit Slurm sends SIGTERM (the learner checkpoints if it can within KillWait) and the job ends.
    time_limit_grace_s: int = 300

    def __post_init__(self) -> None:
        for name in ("learner_nodes", "learner_gpus_per_node", "actor_nodes", "actor_gpus_per_node", "tensor_parallel_size"):
            need(getattr(self, name) >= 1, f"cluster.{name}", "must be >= 1")
        need(self.debug_gpus >= 0, "cluster.debug_gpus", "must be >= 0 (0 = off)")
        need(self.gpu_memory_gib > 0, "cluster.gpu_memory_gib", "must be > 0")
        need(
            0 <= self.time_limit_grace_s <= 65535,
            "cluster.time_limit_grace_s",
            "must be 0 (off) to 65535 seconds (sbatch --signal's limit)",
        )


@dataclass(kw_only=True, slots=True)
class StalenessConfig:
    # k: a sample of policy version v may train the optimizer step u -> u+1 only if u - v <= k (versions count
    # optimizer steps). An update of S = train.mini_batches x train.ppo_epochs steps starting at u needs
    # (u + S - 1) - v <= k, so k >= S - 1 (`fleetrl plan` and the learner's start check it); k = S - 1 is the
    # synchronous on-policy loop.
    max_staleness: int = 1
    lease_s: float = 120.0  # a granted prompt returns to the queue when its actor holds it this long

    def __post_init__(self) -> None:
        need(self.max_staleness >= 0, "staleness.max_staleness", "must be >= 0")
        need(self.lease_s > 0, "staleness.lease_s", "must be > 0")


@dataclass(kw_only=True, slots=True)
class HubConfig:
    bind: str = "tcp://127.0.0.1:5555"  # learner hub address; actors connect here
    hwm: int = 256  # ZeroMQ high-water mark (messages) per socket direction: bounds memory
    max_frame_bytes: int = 64 << 20  # frames larger than this are rejected before decoding
    heartbeat_s: float = 2.0  # actor heartbeat period
    actor_timeout_s: float = 30.0  # an actor silent this long is declared dead
    # An actor silent this long (a hung process keeps its socket open) loses its leases: they go back to the queue
    # (it may still deliver them late), so that admission does not count them until actor_timeout_s. A few missed
    # heartbeats: an actor heartbeats even while it generates.
    silent_s: float = 4.0
    quarantine_after: int = 3  # refused groups within quarantine_window_s that get an actor quarantined (0 = never)
    quarantine_window_s: float = 600.0  # the window those refusals are counted over
    # how long a quarantined actor's id and connection are refused (a --resume keeps the time left; a fresh learner forgets it)
    quarantine_s: float = 3600.0

    def __post_init__(self) -> None:
        need(tcp_port(self.bind) is not None, "hub.bind", f"{self.bind!r} must be tcp://HOST:PORT, PORT in 1-65535")
        need(self.hwm >= 1, "hub.hwm", "must be >= 1")
        need(
            self.silent_s > self.heartbeat_s,
            "hub.silent_s",
            f"must be > hub.heartbeat_s ({self.heartbeat_s}): a live actor is heard that often",
        )
        need(self.quarantine_after >= 0, "hub.quarantine_after", "must be >= 0 (0 = never)")
        need(self.quarantine_window_s > 0, "hub.quarantine_window_s", "must be > 0")
        need(self.quarantine_s > 0, "hub.quarantine_s", "must be > 0")


def tcp_port(address: str) -> int | None:
    """tcp://HOST:PORT -> PORT; None when malformed (no host, or PORT not in 1-65535: ZeroMQ takes 99999 and binds elsewhere)."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    if not address.startswith("tcp://") or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        return None
    return int(port)


@dataclass(kw_only=True, slots=True)
class WeightsConfig:
    host: str = "127.0.0.1"  # address the weight-group rendezvous (TCPStore) binds to
    port: int = 0  # rendezvous port; 0 picks a free one
    bucket_mb: int = 32  # flat bucket size for the broadcast
    timeout_s: float = 120.0  # a broadcast blocked this long (dead member) fails
    # Joining a new group epoch, from its WeightSyncs to the group connected (gloo's rendezvous, NCCL's communicator
    # init: seconds for a large NCCL group). A member that misses it is evicted and the epoch re-formed without it.
    join_timeout_s: float = 10.0
    # A gloo group of more ranks than this connects lazily: each rank opens only the connections of the
    # broadcast's tree (about log2 N), not one to every other rank (N - 1), so a large CPU fleet forms in
    # seconds instead of N² connects (docs/architecture.md, "How large one weight group can be").
    gloo_mesh_ranks: int = GLOO_MESH_RANKS
    # ZeRO-3: where learner rank 0 keeps the full weights it serves between syncs. "device": its GPU, sent from
    # there; "host": pinned host memory, copied to the GPU a bucket at a time to send (for models whose full
    # weights do not fit beside training: 32B in bf16 is 64 GB). `fleetrl plan` counts the "device" copy.
    snapshot: Snapshot = "device"

    def __post_init__(self) -> None:
        check_choices(self, "weights")
        need(self.bucket_mb >= 1, "weights.bucket_mb", "must be >= 1")
        need(self.join_timeout_s > 0, "weights.join_timeout_s", "must be > 0")
        need(self.gloo_mesh_ranks >= 0, "weights.gloo_mesh_ranks", "must be >= 0 (0: every gloo group connects lazily)")


@dataclass(kw_only=True, slots=True)
class AuthConfig:
    """ZeroMQ CURVE on the hub's socket and its clients (protocol/auth.py; `fleetrl keys` writes the files)."""

    curve: Curve = "auto"  # auto: on unless hub.bind is loopback | on | off (refused for a non-loopback hub.bind)
    server_key: str = ""  # the learner's public key file (KEYS/server.key); every client needs it
    server_secret: str = ""  # the learner's key pair file (KEYS/server.key_secret, mode 0600); the learner only
    client_key: str = ""  # this client's key pair file (KEYS/clients/NAME.key_secret, mode 0600): actors, ctl, status
    authorized: str = ""  # folder of client public keys (*.key) the hub admits; re-read when it changes

    def __post_init__(self) -> None:
        # whether CURVE may be off, and needs keys, depends on hub.bind: protocol/config/root.py
        check_choices(self, "auth")
