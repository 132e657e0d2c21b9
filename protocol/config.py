"""One typed config for a run: TOML file plus `section.field=value` overrides.

The same file serves the learner and the actors. Every field has a one-line doc
(the comment beside it); `load_config` fails at start with the field's dotted name.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

from protocol.net import is_loopback


class ConfigError(ValueError):
    """A user mistake in the config; the message names the field."""


@dataclass(kw_only=True, slots=True)
class RunConfig:
    dir: str = "runs/demo"  # run directory: resolved config, logs, metrics.jsonl, checkpoints, plots
    seed: int = 0  # seeds the prompt order, sampling and the learner's init


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    path: str = ""  # Hugging Face model folder (local); the demo builds one when empty
    dtype: str = "float32"  # float32 | bfloat16; the same on learner and engines so logprobs compare
    num_params: int = 0  # parameter count for `fleetrl plan`'s memory estimate; 0 = count from the config.json
    arch: str = ""  # a config.json of the model's architecture, for `fleetrl plan` when model.path is not here (configs/models/)


DATA_FORMATS = ("plain", "orz", "verl", "open_instruct")  # data.format: learner/data/rows.py's FORMATS


@dataclass(kw_only=True, slots=True)
class DataConfig:
    task: str = "addition"  # built-in prompt set ("addition"), or "file": the rows at `path`
    path: str = ""  # prompt set when task = "file": a .json/.jsonl/.parquet file, a folder of them, or a hub dataset id
    format: str = "plain"  # column mapping: plain (prompt, answer) | orz | verl | open_instruct (learner/data/rows.py)
    prompt_key: str = ""  # column holding the prompt, a string or chat messages; dotted for nested ("" = data.format's)
    answer_key: str = ""  # column holding the reference answer; dotted for nested, e.g. reward_model.ground_truth ("" = data.format's)
    prompt_template: str = ""  # a string prompt's text: "{prompt}" (and "{bos_token}") replaced ("" = data.format's; plain: "{prompt}")
    chat_template: bool = False  # render string prompts as a user turn through the tokenizer's chat template (chat lists always are)
    # columns sent to the reward as metadata (dotted ok); [] = all but prompt and answer
    metadata_keys: list[str] = field(default_factory=list)
    max_metadata_bytes: int = 65536  # a row's metadata JSON above this is an error: every grant carries it, the learner holds all
    split: str = "train"  # split of a hub dataset at data.path
    subset: str = ""  # hub dataset configuration name (e.g. "main" for openai/gsm8k); "" = its default
    val_fraction: float = 0.0  # share of the prompt set held out for validation (never trained on)
    test_path: str = ""  # separate test set (same forms as data.path), evaluated like the validation split
    test_split: str = "test"  # split of a hub dataset at data.test_path
    epochs: int = 1000  # passes over the prompt set (the run stops at train.total_steps first)
    num_prompts: int = 0  # size of the prompt set when the file is not at hand, for `fleetrl plan` (0 = unknown)


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    samples_per_prompt: int = 16  # completions per prompt (the GRPO group size; 16 as in DAPO)
    max_tokens: int = 4  # generation length limit per completion
    temperature: float = 1.0  # sampling temperature; behaviour logprobs are taken after it
    top_p: float = 1.0  # nucleus sampling: the most likely tokens up to this mass (1 = off); the learner scores the same
    top_k: int = 0  # sample among the k most likely tokens (0 = off); the learner scores the same
    stop: list[str] = field(default_factory=list)  # stop strings: generation ends at the first one (finish reason "stop")
    include_stop_str_in_output: bool = False  # the reward's text keeps the stop string that ended it (ORZ's "</answer>"); eval too
    reward_fn: str = "actors.rewards:exact_match"  # import path `package.module:function` (built-ins: actors/rewards)
    reward_timeout_s: float = 10.0  # a reward call running longer is killed (its worker replaced) and scores 0, counted an error
    reward_workers: int = 2  # processes per actor that run the reward function, off the actor's event loop
    # A group with a behaviour logprob below this is refused: sampling any token this unlikely has a chance of at
    # most vocabulary x e^min_logprob, whatever the distribution (e^-88 for 152k tokens), so it means a broken actor
    min_logprob: float = -100.0
    # a group with a reward beyond +-this is refused: the built-ins stay within +-10; 3e38 overflowed the advantages
    reward_bound: float = 1e4


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    prompts_per_step: int = 16  # prompts (groups) consumed by one optimizer step
    total_steps: int = 100  # rollout batches (updates) in the run; total_episodes overrides it
    total_episodes: int = 0  # run length in samples (prompts x samples_per_prompt); 0 = use total_steps
    mini_batches: int = 1  # optimizer steps per rollout batch and PPO epoch (the batch split evenly)
    ppo_epochs: int = 1  # passes over each rollout batch
    lr: float = 5e-4  # AdamW peak learning rate
    warmup_steps: int = 10  # linear LR warmup; Adam's first steps are sign-like and jolt a small policy
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # global gradient-norm clip
    zero_stage: int = 2  # DeepSpeed ZeRO stage (0, 1, 2 or 3)
    micro_batch_samples: int = 64  # samples per forward/backward per data-parallel rank (accumulation beyond)
    # Token budget of one forward/backward per rank (0 = count micro-batches in samples, micro_batch_samples).
    # > 0: each rank packs its samples greedily up to this many tokens (prompt + completion), as verl's
    # ppo_max_token_len_per_gpu; micro_batch_samples is then ignored. With sequence parallelism one micro-batch
    # holds up to budget x sequence_parallel_size tokens, split over the SP group.
    max_tokens_per_micro_batch: int = 0
    gradient_checkpointing: bool = False  # recompute each decoder layer in backward: long generations fit (8k-16k)
    logprob_chunk_tokens: int = 1024  # tokens per chunk of the vocabulary projection: no [tokens, vocab] fp32 tensor
    packing: bool = True  # pack a micro-batch's samples into one row (no padding) instead of padding them
    sequence_parallel_size: int = 1  # learner ranks that share one packed sequence (ring attention)
    threads: int = 1  # torch intra-op threads in the learner process
    cpu_affinity: str = ""  # CPU ids the learner may run on, e.g. "0" or "0-3" ("" = all)


@dataclass(kw_only=True, slots=True)
class AlgoConfig:
    advantage: str = "grpo"  # grpo (group mean/std) | dr_grpo (group mean only) | gae (critic + GAE, i.e. PPO)
    gamma: float = 1.0  # GAE discount (advantage = gae only)
    lam: float = 1.0  # GAE lambda (advantage = gae only); 1.0 with gamma 1.0 is Open-Reasoner-Zero's setting
    clip_low: float = 0.2  # ratio floor 1 - clip_low
    clip_high: float = 0.2  # ratio ceiling 1 + clip_high (DAPO's clip-higher raises it)
    correction: str = "tis"  # off-policy correction for stale samples: none | tis | decoupled
    tis_cap: float = 2.0  # cap C of the truncated importance weight (tis, decoupled)
    kl_coef: float = 0.0  # weight of the KL penalty to the frozen reference model (0 = no reference model)
    kl_estimator: str = "k3"  # k1 (log ratio) | k3 (unbiased, non-negative)
    keep_reference: bool = False  # hold the reference model even at kl_coef = 0, to report KL to it (as ORZ does)
    entropy_coef: float = 0.0  # entropy bonus weight
    filter_equal_rewards: bool = False  # drop groups whose rewards are all equal (no GRPO signal)
    value_clip: float = 0.2  # critic: clip of the value update around the old values
    critic_lr: float = 5e-6  # critic's AdamW learning rate
    critic_path: str = ""  # critic init (HF folder); "" = the policy model's weights with a fresh value head
    advantage_normalize: bool = False  # gae: whiten the advantages over the whole rollout batch (Open-Reasoner-Zero does)


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


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    every_steps: int = 0  # evaluate the validation and test sets every N updates (0 = never)
    greedy: bool = True  # greedy decoding for evaluation; false = sample like training
    samples: int = 1  # completions per eval prompt when sampling
    top_p: float = 1.0  # nucleus sampling for evaluation when eval.greedy = false (1 = off)
    top_k: int = 0  # top-k sampling for evaluation when eval.greedy = false (0 = off)
    stop: list[str] = field(default_factory=list)  # stop strings for evaluation (greedy or not); set them as rollout.stop's
    max_prompts: int = 0  # evaluate at most this many prompts per set (0 = all)
    timeout_s: float = 300.0  # an eval round unfinished after this long is recorded partial (eval/*/prompts says how many)


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    every_steps: int = 0  # write a Hugging Face checkpoint every N updates (0 = only at the end)
    keep: int = 3  # newest checkpoints kept on disk (the best one is always kept)
    best_metric: str = "eval/val/reward_mean"  # metric that picks the best checkpoint (higher is better)


@dataclass(kw_only=True, slots=True)
class StalenessConfig:
    max_staleness: int = 1  # k: a sample of version v trains the update u -> u+1 only if u - v <= k
    lease_s: float = 120.0  # a granted prompt returns to the queue when its actor holds it this long


@dataclass(kw_only=True, slots=True)
class HubConfig:
    bind: str = "tcp://127.0.0.1:5555"  # learner hub address; actors connect here
    hwm: int = 256  # ZeroMQ high-water mark (messages) per socket direction: bounds memory
    max_frame_bytes: int = 64 << 20  # frames larger than this are rejected before decoding
    heartbeat_s: float = 2.0  # actor heartbeat period
    actor_timeout_s: float = 30.0  # an actor silent this long is declared dead
    quarantine_after: int = 3  # refused groups within quarantine_window_s that get an actor quarantined (0 = never)
    quarantine_window_s: float = 600.0  # the window those refusals are counted over
    # how long a quarantined actor's id and connection are refused (a --resume keeps the time left; a fresh learner forgets it)
    quarantine_s: float = 3600.0


@dataclass(kw_only=True, slots=True)
class WeightsConfig:
    host: str = "127.0.0.1"  # address the weight-group rendezvous (TCPStore) binds to
    port: int = 0  # rendezvous port; 0 picks a free one
    bucket_mb: int = 32  # flat bucket size for the broadcast
    timeout_s: float = 120.0  # a broadcast blocked this long (dead member) fails
    # Joining a new group epoch, from its WeightSyncs to the group connected (gloo's rendezvous, NCCL's communicator
    # init: seconds for a large NCCL group). A member that misses it is evicted and the epoch re-formed without it.
    join_timeout_s: float = 10.0
    # ZeRO-3: where learner rank 0 keeps the full weights it serves between syncs. "device": its GPU, sent from
    # there; "host": pinned host memory, copied to the GPU a bucket at a time to send (for models whose full
    # weights do not fit beside training: 32B in bf16 is 64 GB). `fleetrl plan` counts the "device" copy.
    snapshot: str = "device"


@dataclass(kw_only=True, slots=True)
class AuthConfig:
    """ZeroMQ CURVE on the hub's socket and its clients (protocol/auth.py; `fleetrl keys` writes the files)."""

    curve: str = "auto"  # auto: on unless hub.bind is loopback | on | off (refused for a non-loopback hub.bind)
    server_key: str = ""  # the learner's public key file (KEYS/server.key); every client needs it
    server_secret: str = ""  # the learner's key pair file (KEYS/server.key_secret, mode 0600); the learner only
    client_key: str = ""  # this client's key pair file (KEYS/clients/NAME.key_secret, mode 0600): actors, ctl, status
    authorized: str = ""  # folder of client public keys (*.key) the hub admits; re-read when it changes


@dataclass(kw_only=True, slots=True)
class ActorConfig:
    # Where the engine runs: "cuda" (vLLM's CUDA build; the CPU-only fields below are then neither set nor checked),
    # "cpu" (vLLM's CPU build), or "auto": cuda when torch in the actor's process sees a GPU, else cpu.
    device: str = "auto"
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
    cpu_gemm: str = "torch"
    # vLLM's prefix cache: a group's n completions share their prompt's KV blocks instead of holding n copies (64 x
    # a 2k-token prompt in the ORZ recipes). Each request is salted with the weights it started under
    # (actors/engine.py), so no cached block outlives a weight sync. "auto": on with CUDA, off on the CPU (short
    # prompts there, shorter than a block). "on" | "off" force it.
    prefix_caching: str = "auto"
    block_size: int = 0  # KV-cache block in tokens (0: vLLM's choice); the prefix cache shares whole blocks only
    max_groups: int = 8  # prompts an actor holds at once (asks for more below this)
    cpu_affinity: str = ""  # CPU ids the actor and its engine processes may run on, e.g. "1" ("" = all)

    def prefix_cached(self, on_cuda: bool) -> bool:
        return self.prefix_caching == "on" or (self.prefix_caching == "auto" and on_cuda)

    def on_cuda(self) -> bool:
        """Whether the engine runs on CUDA. "auto" asks torch, so it is imported only when this is called."""
        if self.device != "auto":
            return self.device == "cuda"
        import torch

        return torch.cuda.is_available()


@dataclass(kw_only=True, slots=True)
class DemoConfig:
    num_actors: int = 2  # actor processes started by `fleetrl demo`
    warmstart_steps: int = 300  # full-batch supervised steps that give the tiny model its starting policy
    warmstart_smoothing: float = 0.45  # label smoothing of that run: how unsure (high-entropy) the start is


WANDB_MODES = ("online", "offline")  # log.wandb_mode


@dataclass(kw_only=True, slots=True)
class LogConfig:
    """What the learner records beside metrics.jsonl: sample completions, and Weights & Biases (learner/metrics.py)."""

    samples_every_steps: int = 10  # write sample prompts, completions and rewards to RUN_DIR/samples.jsonl every N updates (0 = never)
    samples_groups: int = 2  # groups written each time: their prompt and every completion, decoded
    wandb: bool = False  # also send each metrics row to Weights & Biases (needs `pip install 'fleetrl[wandb]'`)
    wandb_project: str = "fleetrl"  # W&B project
    wandb_run_name: str = ""  # W&B run name ("" = the run directory's name)
    wandb_mode: str = "online"  # online | offline: write RUN_DIR/wandb only, no network (`wandb sync` uploads it later)


@dataclass(kw_only=True, slots=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    hub: HubConfig = field(default_factory=HubConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class _Override:
    """A command-line value: its raw text for str fields (`train.cpu_affinity=0`), else its TOML value."""

    text: str
    value: Any


def _coerce(name: str, typ: type, value: Any) -> Any:
    if typing.get_origin(typ) is list:  # list[str] (rollout.stop): a TOML array, also on the command line
        value = value.value if isinstance(value, _Override) else value
        (item,) = typing.get_args(typ)
        if not isinstance(value, list) or not all(isinstance(v, item) for v in value):
            raise ConfigError(f'{name}: expected a list of {item.__name__} such as ["a", "b"], got {value!r}')
        return list(value)
    if isinstance(value, _Override):
        value = value.text if typ is str else value.value
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is bool or isinstance(value, bool):
        if typ is not bool or not isinstance(value, bool):
            raise ConfigError(f"{name}: expected {typ.__name__}, got {value!r}")
        return value
    if not isinstance(value, typ):
        raise ConfigError(f"{name}: expected {typ.__name__}, got {type(value).__name__} {value!r}")
    return value


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix}: expected a table, got {data!r}")
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(f"{prefix}{key}: unknown field (known: {', '.join(sorted(names))})")
    kwargs = {}
    for key, value in data.items():
        typ = hints[key]
        if dataclasses.is_dataclass(typ):
            kwargs[key] = _build(typing.cast(type, typ), value, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(prefix + key, typ, value)
    return cls(**kwargs)


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected section.field=value")
    key, raw = item.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # bare strings need no quotes on the command line
    text = value if isinstance(value, str) else raw
    return key.strip().split("."), _Override(text, value)


def _check(cfg: Config) -> None:
    def need(ok: bool, name: str, why: str) -> None:
        if not ok:
            raise ConfigError(f"{name}: {why}")

    need(cfg.model.dtype in ("float32", "bfloat16"), "model.dtype", "must be float32 or bfloat16")
    need(cfg.model.num_params >= 0, "model.num_params", "must be >= 0 (0 = count from model.path)")
    need(cfg.data.task in ("addition", "file"), "data.task", "must be 'addition' or 'file'")
    need(cfg.data.task != "file" or bool(cfg.data.path), "data.path", "required when data.task = 'file'")
    need(cfg.data.format in DATA_FORMATS, "data.format", f"{cfg.data.format!r} must be one of {', '.join(DATA_FORMATS)}")
    need(
        not cfg.data.prompt_template or "{prompt}" in cfg.data.prompt_template,
        "data.prompt_template",
        "must contain {prompt}, where the row's prompt goes",
    )
    need(all(cfg.data.metadata_keys), "data.metadata_keys", "an empty column name")
    need(cfg.data.max_metadata_bytes >= 2, "data.max_metadata_bytes", "must be >= 2 (the empty object {})")
    need(0 <= cfg.data.val_fraction < 1, "data.val_fraction", "must be in [0, 1)")
    need(cfg.data.epochs >= 1, "data.epochs", "must be >= 1")
    need(cfg.data.num_prompts >= 0, "data.num_prompts", "must be >= 0 (0 = unknown)")
    # Group-normalized advantages need a group; PPO with a critic can learn from one sample per prompt (Tulu 3).
    need(
        cfg.rollout.samples_per_prompt >= 2 or cfg.algo.advantage == "gae",
        "rollout.samples_per_prompt",
        f"algo.advantage = {cfg.algo.advantage} needs >= 2 per group (only gae works with 1)",
    )
    need(cfg.rollout.max_tokens >= 1, "rollout.max_tokens", "must be >= 1")
    need(cfg.rollout.temperature > 0, "rollout.temperature", "must be > 0")
    need(0 < cfg.rollout.top_p <= 1, "rollout.top_p", f"{cfg.rollout.top_p} must be in (0, 1] (1 = off)")
    need(cfg.rollout.top_k >= 0, "rollout.top_k", f"{cfg.rollout.top_k} must be >= 0 (0 = off)")
    need(all(cfg.rollout.stop), "rollout.stop", "an empty stop string would stop every completion at once")
    need(":" in cfg.rollout.reward_fn, "rollout.reward_fn", "must look like package.module:function")
    need(cfg.rollout.reward_timeout_s > 0, "rollout.reward_timeout_s", "must be > 0")
    need(cfg.rollout.reward_workers >= 1, "rollout.reward_workers", "must be >= 1")
    need(cfg.rollout.min_logprob < 0, "rollout.min_logprob", f"{cfg.rollout.min_logprob} must be < 0 (logprobs are <= 0)")
    need(cfg.rollout.reward_bound > 0, "rollout.reward_bound", f"{cfg.rollout.reward_bound} must be > 0")
    need(cfg.train.prompts_per_step >= 1, "train.prompts_per_step", "must be >= 1")
    need(cfg.train.total_steps >= 1, "train.total_steps", "must be >= 1")
    need(cfg.train.lr > 0, "train.lr", "must be > 0")
    need(cfg.train.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
    need(cfg.train.total_episodes >= 0, "train.total_episodes", "must be >= 0 (0 = use train.total_steps)")
    need(cfg.train.mini_batches >= 1, "train.mini_batches", "must be >= 1")
    need(cfg.train.ppo_epochs >= 1, "train.ppo_epochs", "must be >= 1")
    need(cfg.train.zero_stage in (0, 1, 2, 3), "train.zero_stage", "must be 0, 1, 2 or 3")
    need(cfg.train.micro_batch_samples >= 1, "train.micro_batch_samples", "must be >= 1")
    need(cfg.train.max_tokens_per_micro_batch >= 0, "train.max_tokens_per_micro_batch", "must be >= 0 (0 = count in samples)")
    need(cfg.train.logprob_chunk_tokens >= 1, "train.logprob_chunk_tokens", "must be >= 1")
    need(cfg.train.sequence_parallel_size >= 1, "train.sequence_parallel_size", "must be >= 1")
    need(
        cfg.train.sequence_parallel_size == 1 or cfg.train.packing,
        "train.sequence_parallel_size",
        f"{cfg.train.sequence_parallel_size} needs train.packing = true (SP splits one packed row)",
    )
    need(cfg.algo.advantage in ("grpo", "dr_grpo", "gae"), "algo.advantage", "must be grpo, dr_grpo or gae")
    need(0 <= cfg.algo.gamma <= 1, "algo.gamma", "must be in [0, 1]")
    need(0 <= cfg.algo.lam <= 1, "algo.lam", "must be in [0, 1]")
    need(0 < cfg.algo.clip_low < 1, "algo.clip_low", "must be in (0, 1)")
    need(cfg.algo.clip_high > 0, "algo.clip_high", "must be > 0")
    need(cfg.algo.correction in ("none", "tis", "decoupled"), "algo.correction", "must be none, tis or decoupled")
    need(cfg.algo.tis_cap >= 1, "algo.tis_cap", "must be >= 1 (a cap below 1 would shrink on-policy weights)")
    need(cfg.algo.kl_coef >= 0, "algo.kl_coef", "must be >= 0")
    need(cfg.algo.kl_estimator in ("k1", "k3"), "algo.kl_estimator", "must be k1 or k3")
    need(cfg.algo.entropy_coef >= 0, "algo.entropy_coef", "must be >= 0")
    need(cfg.algo.value_clip > 0, "algo.value_clip", "must be > 0")
    need(cfg.algo.critic_lr > 0, "algo.critic_lr", "must be > 0")
    need(
        not cfg.algo.advantage_normalize or cfg.algo.advantage == "gae",
        "algo.advantage_normalize",
        f"whitens GAE advantages; algo.advantage = {cfg.algo.advantage} normalises within each group already",
    )
    for name in ("learner_nodes", "learner_gpus_per_node", "actor_nodes", "actor_gpus_per_node", "tensor_parallel_size"):
        need(getattr(cfg.cluster, name) >= 1, f"cluster.{name}", "must be >= 1")
    need(cfg.cluster.debug_gpus >= 0, "cluster.debug_gpus", "must be >= 0 (0 = off)")
    need(cfg.cluster.gpu_memory_gib > 0, "cluster.gpu_memory_gib", "must be > 0")
    need(cfg.eval.every_steps >= 0, "eval.every_steps", "must be >= 0 (0 = never)")
    need(cfg.eval.samples >= 1, "eval.samples", "must be >= 1")
    need(0 < cfg.eval.top_p <= 1, "eval.top_p", f"{cfg.eval.top_p} must be in (0, 1] (1 = off)")
    need(cfg.eval.top_k >= 0, "eval.top_k", f"{cfg.eval.top_k} must be >= 0 (0 = off)")
    need(
        not cfg.eval.greedy or (cfg.eval.top_p == 1 and cfg.eval.top_k == 0),
        "eval.greedy",
        "greedy decoding ignores eval.top_p and eval.top_k: set eval.greedy = false to sample with them",
    )
    need(all(cfg.eval.stop), "eval.stop", "an empty stop string would stop every completion at once")
    need(cfg.eval.max_prompts >= 0, "eval.max_prompts", "must be >= 0 (0 = all)")
    need(cfg.eval.timeout_s > 0, "eval.timeout_s", "must be > 0")
    need(cfg.checkpoint.every_steps >= 0, "checkpoint.every_steps", "must be >= 0")
    need(cfg.checkpoint.keep >= 1, "checkpoint.keep", "must be >= 1")
    scored = cfg.checkpoint.best_metric.startswith("eval/") and cfg.eval.every_steps > 0 and cfg.checkpoint.every_steps > 0
    need(
        not scored or cfg.checkpoint.every_steps % cfg.eval.every_steps == 0,
        "checkpoint.every_steps",
        f"{cfg.checkpoint.every_steps} must be a multiple of eval.every_steps ({cfg.eval.every_steps}), "
        f"so every checkpoint gets a {cfg.checkpoint.best_metric} score",
    )
    need(cfg.staleness.max_staleness >= 0, "staleness.max_staleness", "must be >= 0")
    need(cfg.staleness.lease_s > 0, "staleness.lease_s", "must be > 0")
    need(tcp_port(cfg.hub.bind) is not None, "hub.bind", f"{cfg.hub.bind!r} must be tcp://HOST:PORT, PORT in 1-65535")
    need(cfg.hub.hwm >= 1, "hub.hwm", "must be >= 1")
    need(cfg.hub.quarantine_after >= 0, "hub.quarantine_after", "must be >= 0 (0 = never)")
    need(cfg.hub.quarantine_window_s > 0, "hub.quarantine_window_s", "must be > 0")
    need(cfg.hub.quarantine_s > 0, "hub.quarantine_s", "must be > 0")
    need(cfg.weights.bucket_mb >= 1, "weights.bucket_mb", "must be >= 1")
    need(cfg.weights.join_timeout_s > 0, "weights.join_timeout_s", "must be > 0")
    need(cfg.weights.snapshot in ("device", "host"), "weights.snapshot", f"{cfg.weights.snapshot!r} must be device or host")
    _check_auth(cfg, need)
    need(cfg.actor.max_model_len > cfg.rollout.max_tokens, "actor.max_model_len", "must exceed rollout.max_tokens")
    need(cfg.actor.max_groups >= 1, "actor.max_groups", "must be >= 1")
    need(cfg.actor.device in ("auto", "cpu", "cuda"), "actor.device", f"{cfg.actor.device!r} must be auto, cpu or cuda")
    need(cfg.actor.prefix_caching in ("auto", "on", "off"), "actor.prefix_caching", f"{cfg.actor.prefix_caching!r} must be auto, on or off")
    need(cfg.actor.block_size >= 0, "actor.block_size", "must be >= 0 (0: vLLM's choice)")
    need(0 < cfg.actor.gpu_memory_utilization <= 1, "actor.gpu_memory_utilization", "must be in (0, 1]")
    # CPU-only fields: a GPU actor neither sets nor checks them. Each check asks on_cuda() only once it has
    # failed, so a CPU run (and a learner, which shares this file) never imports torch for it.
    need(
        not cfg.actor.worker_in_engine or cfg.actor.cpu_bind == "nobind" or cfg.actor.on_cuda(),
        "actor.worker_in_engine",
        f"must be false when actor.cpu_bind = {cfg.actor.cpu_bind!r}: vLLM binds OMP threads only in a worker process of its own",
    )
    need(cfg.actor.cpu_gemm in ("torch", "vllm") or cfg.actor.on_cuda(), "actor.cpu_gemm", f"{cfg.actor.cpu_gemm!r} must be torch or vllm")
    need(cfg.demo.num_actors >= 1, "demo.num_actors", "must be >= 1")
    need(cfg.demo.warmstart_steps >= 0, "demo.warmstart_steps", "must be >= 0")
    need(0 <= cfg.demo.warmstart_smoothing < 1, "demo.warmstart_smoothing", "must be in [0, 1)")
    need(cfg.log.samples_every_steps >= 0, "log.samples_every_steps", "must be >= 0 (0 = never)")
    need(cfg.log.samples_groups >= 1, "log.samples_groups", "must be >= 1")
    need(cfg.log.wandb_mode in WANDB_MODES, "log.wandb_mode", f"{cfg.log.wandb_mode!r} must be online or offline")
    need(not cfg.log.wandb or bool(cfg.log.wandb_project), "log.wandb_project", "required when log.wandb = true")


def _check_auth(cfg: Config, need: Callable[[bool, str, str], None]) -> None:
    """CURVE is on by default off loopback; only the keys' presence is checked here (files: protocol/auth.py)."""
    a = cfg.auth
    need(a.curve in ("auto", "on", "off"), "auth.curve", f"{a.curve!r} must be auto, on or off")
    loopback = is_loopback(cfg.hub.bind)
    need(
        a.curve != "off" or loopback,
        "auth.curve",
        f"off is refused for hub.bind {cfg.hub.bind} (not loopback): anyone who reaches it could take prompts "
        "and submit samples; run `fleetrl keys --out keys` and set the auth.* key files",
    )
    if a.curve == "on" or not loopback:
        need(
            any((a.server_key, a.server_secret, a.client_key, a.authorized)),
            "auth",
            f"CURVE is on (auth.curve = {a.curve}, hub.bind {cfg.hub.bind}) but no key is set: run "
            "`fleetrl keys --out keys`, then set auth.server_secret and auth.authorized on the learner, "
            "auth.server_key and auth.client_key on actors and other clients",
        )


def tcp_port(address: str) -> int | None:
    """tcp://HOST:PORT -> PORT; None when malformed (no host, or PORT not in 1-65535: ZeroMQ takes 99999 and binds elsewhere)."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    if not address.startswith("tcp://") or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        return None
    return int(port)


def parse_cpus(spec: str, name: str) -> set[int]:
    """'0,2-3' -> {0, 2, 3}; ConfigError naming the field when malformed."""
    cpus: set[int] = set()
    try:
        for part in filter(None, spec.split(",")):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError as e:
        raise ConfigError(f"{name}: {spec!r} is not a CPU list like '0,2-3'") from e
    return cpus


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a TOML file (or the defaults), apply overrides, validate. Raises ConfigError."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError as e:
            raise ConfigError(f"config file {path}: not found") from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path}: {e}") from e
    for item in overrides or []:
        keys, value = _parse_override(item)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {k} is not a table")
        node[keys[-1]] = value
    cfg = _build(Config, data, "")
    _check(cfg)
    parse_cpus(cfg.train.cpu_affinity, "train.cpu_affinity")
    parse_cpus(cfg.actor.cpu_affinity, "actor.cpu_affinity")
    return cfg


def dump_toml(cfg: Config) -> str:
    """The resolved config as TOML (written to the run directory)."""
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def toml_value(value: Any) -> str:
    """A field's value as TOML text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):  # JSON's escapes are TOML's: a newline (prompt templates have them) stays "\\n"
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):  # JSON's string escapes are TOML's ("\n" is a common stop string)
        return "[" + ", ".join(json.dumps(v, ensure_ascii=False) for v in value) + "]"
    return repr(value)
